"""``TORCH_LOGS="gradfx"`` prints each line once (issue 13).

torch imports gradfx itself while it parses ``TORCH_LOGS`` (any importable
module name is accepted there); gradfx must then not set up handlers a second
time.  Checked in a fresh interpreter, both import orders.
"""

import os
import subprocess
import sys

import pytest


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
