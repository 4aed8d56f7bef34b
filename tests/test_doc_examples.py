"""Every example program in the README and docs/ runs as written (a newcomer copies them)."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _examples() -> list:
    """(file:number, code) of each ```python block that imports torch or gradfx."""
    found = []
    for path in [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        blocks = re.findall(r"```python\n(.*?)```", open(path).read(), re.S)
        programs = [b for b in blocks if re.search(r"^\s*(import|from)\s+(torch|gradfx)\b", b, re.M)]
        found += [(f"{os.path.basename(path)}:{k + 1}", code) for k, code in enumerate(programs)]
    return found


def test_the_readme_has_an_example_program():
    assert any(name.startswith("README.md") for name, _ in _examples())


@pytest.mark.parametrize("name,code", _examples(), ids=[name for name, _ in _examples()])
def test_example_runs_as_written(name, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} fails as written:\n{done.stderr[-2000:]}"
