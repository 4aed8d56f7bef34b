"""Importing gradfx, and using it, leaves eager PyTorch exactly as it was.

The programs of ``eager_programs.py`` run in three fresh processes: without
gradfx, after ``import gradfx``, and with each graph first run through a gradfx
block (``retain_graph=True``) and ``gradfx.capture``.  Values, hook calls and
their order, handle ids, exception types and texts must be identical.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).parent


def _run(mode):
    env = dict(os.environ)
    env.pop("TORCH_LOGS", None)
    out = subprocess.run([sys.executable, str(HERE / "eager_programs.py"), mode], capture_output=True,
                         text=True, env=env, cwd=HERE, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return dict((name, log) for name, log in json.loads(out.stdout))


@pytest.fixture(scope="module")
def runs():
    return {mode: _run(mode) for mode in ("plain", "import", "used")}


@pytest.mark.parametrize("program", ["retain_grad_twice", "register_hook_twice", "hooks_removed_through_handles",
                                     "hooks_on_views_and_inplace", "tensor_subclass", "hook_without_grad_fn",
                                     "module_backward_hooks", "errors"])
@pytest.mark.parametrize("mode", ["import", "used"])
def test_eager_program_unchanged(runs, program, mode):
    assert runs[mode][program] == runs["plain"][program]
    assert runs["plain"][program]  # the program observed something


def test_import_starts_no_thread_and_loads_no_tracer():
    # A thread importing torch._dynamo at import time raced the user's own imports of it
    # (a partially initialised module); tracing's modules load at the first capture.
    code = ("import sys, threading, torch\n"
            "before = threading.active_count()\n"
            "import gradfx\n"
            "print(threading.active_count() - before, 'torch._dynamo' in sys.modules)\n"
            "import torch._dynamo\n")
    env = dict(os.environ)
    env.pop("TORCH_LOGS", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=HERE,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["0", "False"], out.stdout
