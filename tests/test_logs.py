"""The ``gradfx`` logger.

``TORCH_LOGS="gradfx"`` prints each line once (issue 13): torch imports gradfx
itself while it parses ``TORCH_LOGS`` (any importable module name is accepted
there); gradfx must then not set up handlers a second time.  Checked in a fresh
interpreter, both import orders.

Every backend compile is logged at INFO (docs/API.md, Logging), fast ones too.
"""

import logging
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import gradfx


@pytest.mark.parametrize("setting, imports", [("gradfx", "import gradfx"), ("+gradfx", "import torch; import gradfx")])
def test_torch_logs_prints_each_line_once(setting, imports):
    code = (f"{imports}\nimport logging, torch\n"
            "x = torch.randn(3, requires_grad=True)\n"
            "with gradfx.compiled_autograd():\n    (x * 2).sum().backward()\n"
            "print(len(logging.getLogger('gradfx').handlers), len(logging.getLogger('torch').handlers))\n")
    env = dict(os.environ, TORCH_LOGS=setting)
    repo_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_parent, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"], done.stdout
    assert done.stderr.count("gradfx: captured") == 1, done.stderr


def _identity_backend(gm, example_inputs):
    return gm


def _compile_records(caplog, backend):
    gradfx.reset()
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    with caplog.at_level(logging.INFO, logger="gradfx"):
        with gradfx.compiled_autograd(backend=backend) as session:
            lin(torch.randn(2, 4)).sum().backward()
    compiles = [r for r in caplog.records if r.name == "gradfx" and " compile" in r.getMessage()]
    return session, compiles


@pytest.mark.parametrize("backend", ["aot_eager", "eager", _identity_backend, lambda gm, ex: gm])
def test_a_fast_backend_compile_is_logged_at_info(caplog, backend):
    session, compiles = _compile_records(caplog, backend)
    assert session.stats["compiles"] == 1
    assert len(compiles) == 1, [r.getMessage() for r in compiles]
    record = compiles[0]
    assert record.levelno == logging.INFO
    nodes = len(session.graphs[0].graph_module.graph.nodes)
    m = re.fullmatch(r"gradfx: backend (.+) compiled a backward of (\d+) fx nodes in (\d+\.\d\d) s",
                     record.getMessage())
    assert m, record.getMessage()
    assert m.group(1) == session.backend_name and int(m.group(2)) == nodes > 0
    if not isinstance(backend, str):
        assert "_identity_backend" in m.group(1) or "<lambda>" in m.group(1)


def test_a_failed_backend_compile_is_logged_at_info(caplog):
    def broken(gm, example_inputs):
        raise RuntimeError("no")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", gradfx.FallbackWarning)
        session, compiles = _compile_records(caplog, broken)
    assert len(compiles) == 1 and compiles[0].levelno == logging.INFO
    assert re.fullmatch(r"gradfx: backend .*broken failed to compile a backward of \d+ fx nodes \(\d+\.\d\d s\); "
                        r"the eager backend runs it", compiles[0].getMessage()), compiles[0].getMessage()


def test_the_first_capture_of_a_process_is_compared_with_no_probe():
    """The self-check's probe captures (before the first capture of a process) are not the
    user's: the first new-structure line compares the user's second capture with the first."""
    code = ("import logging, torch, gradfx\n"
            "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
            "lin = torch.nn.Linear(3, 2)\n"
            "with gradfx.compiled_autograd():\n    lin(torch.randn(4, 3)).sum().backward()\n"
            "with gradfx.compiled_autograd():\n    lin(torch.randn(4, 3)).tanh().sum().backward()\n")
    env = dict(os.environ)
    env.pop("TORCH_LOGS", None)
    repo_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo_parent, env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("gradfx: new structure")]
    assert len(lines) == 1, done.stderr
    assert re.sub(r"#\d+", "#", lines[0]) == ("gradfx: new structure (vs the last capture): node 1 is now "
                                              "TanhBackward0 # instead of AddmmBackward0 (6 nodes now, 5 before)")
    assert done.stderr.index("gradfx: captured 5 autograd nodes") < done.stderr.index(lines[0])
