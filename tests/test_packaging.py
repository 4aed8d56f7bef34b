"""The installed package is the repository's package: no subpackage is left out of a wheel."""
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _package_dirs():
    found = set()
    for top in ("capture", "reorder", "backends"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            if "__init__.py" in filenames:
                rel = os.path.relpath(dirpath, ROOT).replace(os.sep, ".")
                found.add("gradfx." + rel)
    return found | {"gradfx"}


def test_every_package_directory_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    assert declared == _package_dirs()


def test_a_wheel_install_imports_every_module(tmp_path):
    # A plain (non-editable) install, as `pip install gradfx` would give it.
    # Built from a clean copy: a build/ left in the checkout would hide a missing package.
    source, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "__pycache__", "*.egg-info", "notebooks", "bench"))
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps",
         "--target", str(target), str(source)],
        capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip("cannot build a wheel here: " + build.stderr.strip()[-300:])
    modules = []
    for package in sorted(_package_dirs()):
        path = os.path.join(ROOT, *package.split(".")[1:])
        modules += [package] + [package + "." + f[:-3] for f in sorted(os.listdir(path))
                                if f.endswith(".py") and f != "__init__.py"]
    code = "import importlib\nfor m in %r:\n    importlib.import_module(m)\n" % modules
    env = dict(os.environ, PYTHONPATH=str(target))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=str(tmp_path))
    assert run.returncode == 0, run.stderr[-2000:]
