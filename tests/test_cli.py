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
    assert "build" in out and "build gradfx's compiled part now" in out
    assert "examples:\n  python -m gradfx demo --steps 500 --svg graph.svg\n  python -m gradfx build" in out


def test_a_bare_command_prints_the_help():
    done = _run([])
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout == _run(["--help"]).stdout


def test_demo_help_describes_every_option():
    done = _run(["demo", "--help"])
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # argparse wraps to the terminal's width
    assert "usage: python -m gradfx demo [-h] [--steps N] [--svg PATH] [--no-wait]" in out
    assert ("--steps N pairs of backwards to time (an eager one, then a gradfx one, after 20 pairs of "
            "warm-up); the median ratio and its spread are printed (default: 200)") in out
    assert "--svg PATH also write a picture of the captured graph (SVG) to PATH" in out
    assert "--no-wait do not wait for gradfx's compiled part" in out
    assert "for 3 steps" not in out.split("options:")[1]  # the training's steps are not --steps


def test_build_help_says_where_and_how():
    done = _run(["build", "--help"])
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())
    assert "usage: python -m gradfx build [-h]" in out
    assert "GRADFX_CACHE_DIR" in out and "GRADFX_NATIVE=0" in out and "Exits 1, saying why" in out


def _cli():
    spec = importlib.util.spec_from_file_location("gradfx_cli", MAIN)
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    return cli


@pytest.mark.parametrize("args, error", [
    (["train"], "invalid choice: 'train'"),
    (["demo", "--steps", "0"], "argument --steps: must be 1 or more, got 0"),
    (["demo", "--steps", "many"], "argument --steps: not a whole number: 'many'"),
    (["demo", "--svg"], "argument --svg: expected one argument"),
    (["demo", "--svg", "/no/such/dir/g.svg"], "argument --svg: no such directory: '/no/such/dir'"),
    (["demo", "--svg", os.path.dirname(HERE)], "is a directory; give a file name"),
    (["build", "--now"], "unrecognized arguments: --now"),
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
                                "cli.main(['demo', '--svg', '/no/such/dir/g.svg'])"))
    assert done.returncode == 2, done.stderr  # the wrong --svg: argparse's exit, before the demo runs
    assert "gradfx: compiled autograd for PyTorch." in done.stdout and "demo 3 g.svg" in done.stdout
    assert "argument --svg: no such directory" in done.stderr
    assert "torch imported: False False" in done.stderr, done.stderr


def test_the_demo_says_what_served_and_times_in_pairs(tmp_path):
    """Python serving (GRADFX_NATIVE=0): the timing line says so, and why."""
    env_off = {"GRADFX_NATIVE": "0"}
    done = _run_env(["demo", "--steps", "5", "--svg", str(tmp_path / "g.svg")], env_off)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "gradients bitwise equal to eager: True" in out
    assert os.path.getsize(tmp_path / "g.svg") > 0
    timing = out[out.index("Backward, 5 pairs (eager, gradfx) after 20 of warm-up: eager "):]
    assert "(median of the pairs; middle half " in timing
    assert "Python served, without gradfx's compiled part: GRADFX_NATIVE=0" in timing
    assert "First run" not in out  # nothing to wait for


def _run_env(args, extra):
    env = dict(os.environ, **extra)
    env.pop("TORCH_LOGS", None)
    repo_parent = os.path.dirname(os.path.dirname(HERE))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_parent, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "gradfx", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=HERE)


def test_the_demo_says_the_compiled_part_served():
    from gradfx.capture import native
    if native.module() is None:
        pytest.skip(f"no compiled part here: {native.reason()}")
    done = _run(["demo", "--steps", "5"])
    assert done.returncode == 0, done.stderr
    assert f"gradfx's compiled part served (loaded from {native.directory()})" in done.stdout


def test_timing_lines_note_a_machine_too_busy_to_measure():
    cli = _cli()
    calm = {"pairs": 200, "eager": 1.3e-4, "gradfx": 1.7e-4, "ratio": 1.30, "low": 1.25, "high": 1.36}
    lines = cli.timing_lines(calm, "gradfx's compiled part served")
    assert lines[0] == ("Backward, 200 pairs (eager, gradfx) after 20 of warm-up: eager 0.130 ms, gradfx 0.170 ms "
                        "(medians); gradfx/eager 1.30x (median of the pairs; middle half 1.25-1.36x)")
    assert lines[1:] == ["  gradfx's compiled part served"]
    busy = dict(calm, low=0.9, high=2.1)
    note = cli.timing_lines(busy, "x")[2]
    assert note.startswith("  note: the machine was too busy to measure: the middle half of the pairs spans "
                           "0.90-2.10x")


def test_time_pairs_alternates_after_warm_up(monkeypatch):
    """The pairs: eager first, then gradfx, each pair after the warm-up kept."""
    import torch
    import torch.nn as nn

    import gradfx
    cli = _cli()
    order = []
    real = gradfx.compiled_autograd

    def spy(*args, **kwargs):
        order.append("gradfx")
        return real(*args, **kwargs)
    monkeypatch.setattr(gradfx, "compiled_autograd", spy)
    model = nn.Linear(4, 3)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    t = cli.time_pairs(model, torch.randn(2, 4), torch.tensor([0, 1]), steps=4, warmup=2)
    assert len(calls) == 12 and order == ["gradfx"] * 6
    assert t["pairs"] == 4 and t["low"] <= t["ratio"] <= t["high"] and t["eager"] > 0 and t["gradfx"] > 0


class _FakeNative:
    """A compiled part that is not built yet and builds in three seconds."""

    def __init__(self, fails=False):
        self.loaded, self.fails, self.why = None, fails, None

    def module(self):
        return self.loaded

    def reason(self):
        return self.why

    def directory(self):
        return "/cache/native/torch-x"

    def build_now(self, progress):
        for second in range(3):
            progress(float(second))
        if self.fails:
            self.why = "its build failed: no compiler"
            return None
        self.loaded = object()
        return self.loaded


def test_a_first_run_waits_for_the_build_with_a_progress_line(capsys):
    cli = _cli()
    cli.wait_for_native(_FakeNative())
    out = capsys.readouterr().out
    assert out.startswith("First run with this torch release: building gradfx's compiled part once, before "
                          "timing (log: /cache/native/torch-x/build.log; `python -m gradfx build` does it ahead "
                          "of time, GRADFX_NATIVE=0 turns it off)\n")
    assert "  building: 0 s\n" in out and out.endswith("  built and loaded in 0 s\n")
    failing = _FakeNative(fails=True)
    cli.wait_for_native(failing)
    assert capsys.readouterr().out.endswith("  not built: its build failed: no compiler; Python serves\n")
    assert cli._served(failing) == "Python served, without gradfx's compiled part: its build failed: no compiler"
    built = _FakeNative()
    built.loaded = object()
    cli.wait_for_native(built)
    assert capsys.readouterr().out == ""  # built already: nothing said, nothing waited for


def test_build_says_where_it_is_or_why_not():
    from gradfx.capture import native
    off = _run_env(["build"], {"GRADFX_NATIVE": "0"})
    assert off.returncode == 1 and off.stdout == ""
    assert off.stderr.strip() == "python -m gradfx build: error: gradfx's compiled part cannot be had: GRADFX_NATIVE=0"
    if native.module() is None:
        pytest.skip(f"no compiled part here: {native.reason()}")
    done = _run(["build"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"gradfx's compiled part is built: {native.directory()}{os.sep}")
    assert "(built earlier, in " in done.stdout


def test_a_failed_build_exits_1_with_its_reason(tmp_path):
    done = _run_env(["build"], {"GRADFX_CACHE_DIR": str(tmp_path), "CXX": "/bin/false"})
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stdout.startswith(f"Building gradfx's compiled part in {tmp_path}")
    assert "python -m gradfx build: error: gradfx's compiled part cannot be had: its build failed: " in done.stderr
