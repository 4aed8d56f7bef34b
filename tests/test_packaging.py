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


def _module_imports(top: str) -> dict:
    """module -> the modules of ``top`` it imports at module level (relative imports)."""
    import ast
    modules = {}
    for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for f in filenames:
            if f.endswith(".py") and f != "__init__.py":
                path = os.path.join(dirpath, f)
                modules[os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")] = path
    edges = {}
    for name, path in modules.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        package = name.split(".")[:-1]
        found = set()
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package[: len(package) - (node.level - 1)] + (node.module.split(".") if node.module else [])
                for alias in node.names:
                    for target in (".".join(base), ".".join(base + [alias.name])):
                        if target in modules and target != name:
                            found.add(target)
        edges[name] = found
    return edges


def test_capture_modules_import_each_other_without_cycles():
    # The folders follow one backward (graph -> trace -> run, view beside them): a module-level
    # cycle would tie them back into one knot.  (Imports inside functions are not counted.)
    edges = _module_imports("capture")
    state = {}

    def visit(name, path):
        state[name] = "open"
        for target in edges[name]:
            assert state.get(target) != "open", " -> ".join(path + [target])
            if target not in state:
                visit(target, path + [target])
        state[name] = "done"
    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert len(edges) > 20 and any(edges.values())  # it read the tree
