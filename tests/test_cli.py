"""``python -m gradfx``: its help, and a command line parsed without torch.

Run in fresh interpreters, as test_logs.py runs its own: the repository's parent
folder on PYTHONPATH (the repository root is the package), from the tests folder.
"""

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
MAIN = os.path.join(os.path.dirname(HERE), "__main__.py")


def _run(args, code=None):
    env = dict(os.environ)
    env.pop("TORCH_LOGS", None)
    repo_parent = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_parent, env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", code, *args] if code is not None else [sys.executable, "-m", "gradfx", *args]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=HERE)


def _standalone(body: str) -> str:
    """Code that loads __main__.py as a module of its own (not through the gradfx package,
    whose import loads torch), runs ``body`` and prints whether torch got imported."""
    return ("import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('gradfx_cli', {MAIN!r})\n"
            "cli = importlib.util.module_from_spec(spec)\n"
            "spec.loader.exec_module(cli)\n"
            "try:\n"
            + "".join(f"    {line}\n" for line in body.splitlines()) +
            "finally:\n"
            "    print('torch imported:', 'torch' in sys.modules, 'gradfx' in sys.modules, file=sys.stderr)\n")


def test_help_describes_the_tool_and_every_command():
    done = _run(["--help"])
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("usage: python -m gradfx")
    assert "gradfx: compiled autograd for PyTorch." in out
    assert "demo" in out and "train a small MLP" in out  # the command and its help
    assert "example:\n  python -m gradfx demo --steps 50 --svg graph.svg" in out


def test_demo_help_describes_every_option():
    done = _run(["demo", "--help"])
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # argparse wraps to the terminal's width
    assert "usage: python -m gradfx demo [-h] [--steps N] [--svg PATH]" in out
    assert "--steps N backward passes to time" in out and "(default: 20)" in out
    assert "--svg PATH also write a picture of the captured graph (SVG) to PATH" in out


def _cli():
    spec = importlib.util.spec_from_file_location("gradfx_cli", MAIN)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


@pytest.mark.parametrize("args, error", [
    ([], "the following arguments are required: COMMAND"),
    (["train"], "invalid choice: 'train'"),
    (["demo", "--steps", "0"], "argument --steps: must be 1 or more, got 0"),
    (["demo", "--steps", "many"], "argument --steps: not a whole number: 'many'"),
    (["demo", "--svg"], "argument --svg: expected one argument"),
])
def test_wrong_arguments_exit_2_with_usage(capsys, args, error):
    with pytest.raises(SystemExit) as exited:
        _cli().main(args)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: python -m gradfx") and error in err, err


def test_wrong_arguments_through_python_m():
    done = _run(["demo", "--steps", "0"])
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("usage: python -m gradfx demo") and "must be 1 or more, got 0" in done.stderr


def test_the_command_line_is_parsed_without_torch():
    # `python -m gradfx` imports the gradfx package first (and with it torch); what
    # __main__ itself does before a command runs must not.
    done = _run([], _standalone("print(cli.build_parser().format_help())\n"
                                "args = cli.build_parser().parse_args(['demo', '--steps', '3', '--svg', 'g.svg'])\n"
                                "print(args.command, args.steps, args.svg)\n"
                                "cli.main(['demo', '--steps', '0'])"))
    assert done.returncode == 2, done.stderr  # the wrong --steps: argparse's exit, before the demo runs
    assert "gradfx: compiled autograd for PyTorch." in done.stdout and "demo 3 g.svg" in done.stdout
    assert "must be 1 or more, got 0" in done.stderr
    assert "torch imported: False False" in done.stderr, done.stderr
