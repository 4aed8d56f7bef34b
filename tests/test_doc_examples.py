"""Every example program in the README and docs/ runs as written (a newcomer copies them).

Which blocks are programs (the rule docs/TESTING.md states): every fenced ```python block
of README.md, CHANGELOG.md and docs/*.md that has an import statement at the start of a
line is a program and runs in a fresh interpreter, in an empty directory; a block with
the comment ``# fragment`` on a line of its own, or without any import (a signature, a
few lines using names defined elsewhere), is a fragment and is not run.

Also: every relative link in those files names a file inside the repository (and, with
``#anchor``, one of its headings), and the README's test command is the one .ci/run runs.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_FENCE = re.compile(r"^```[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<code>.*?)^```[ \t]*$", re.M | re.S)
_IMPORT = re.compile(r"^(import|from)\s+[\w.]+", re.M)
_FRAGMENT = re.compile(r"^[ \t]*#[ \t]*fragment\b", re.M | re.I)


def _doc_files() -> list:
    names = ["README.md", "CHANGELOG.md"]
    files = [os.path.join(ROOT, n) for n in names if os.path.exists(os.path.join(ROOT, n))]
    return files + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def _python_blocks(text: str) -> list:
    return [m.group("code") for m in _FENCE.finditer(text) if m.group("lang").lower() in ("python", "py", "python3")]


def is_program(code: str) -> bool:
    """A block that imports what it uses and is not marked ``# fragment``."""
    return bool(_IMPORT.search(code)) and not _FRAGMENT.search(code)


def _examples() -> list:
    """(file:number, code) of each example program, numbered among the file's programs."""
    found = []
    for path in _doc_files():
        programs = [b for b in _python_blocks(_read(path)) if is_program(b)]
        found += [(f"{os.path.basename(path)}:{k + 1}", code) for k, code in enumerate(programs)]
    return found


def test_the_readme_has_an_example_program():
    assert any(name.startswith("README.md") for name, _ in _examples())


def test_the_fragment_rule():
    assert is_program("import torch, gradfx\nprint(gradfx.stats())\n")
    assert is_program("from gradfx import capture\n")
    assert not is_program("with gradfx.compiled_autograd():\n    loss.backward()\n")  # no import
    assert not is_program("# fragment\nimport torch\nloss.backward()\n")
    assert not is_program("gradfx.capture(outputs)  # see: import gradfx\n")  # not at a line's start


@pytest.mark.parametrize("name,code", _examples(), ids=[name for name, _ in _examples()])
def test_example_runs_as_written(name, code, tmp_path):
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{name} fails as written:\n{done.stderr[-2000:]}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set:
    text = _FENCE.sub("", text)
    seen, anchors = {}, set()
    for heading in re.findall(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", text, re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        anchors.add(slug if n == 0 else f"{slug}-{n}")
        seen[slug] = n + 1
    return anchors


def _links(text: str) -> list:
    text = _FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)  # code spans are not links
    return re.findall(r"\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


@pytest.mark.parametrize("path", _doc_files(), ids=[os.path.relpath(p, ROOT) for p in _doc_files()])
def test_links_stay_inside_the_repository(path):
    text = _read(path)
    wrong = []
    for link in _links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I) or link.startswith("//"):
            wrong.append(f"{link}: points outside the repository")
            continue
        target, _, anchor = link.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
        if os.path.relpath(full, ROOT).startswith(os.pardir):
            wrong.append(f"{link}: points outside the repository")
        elif not os.path.exists(full):
            wrong.append(f"{link}: no such file")
        elif anchor and full.endswith(".md") and anchor not in _anchors(_read(full)):
            wrong.append(f"{link}: no heading #{anchor} in {os.path.relpath(full, ROOT)}")
    assert not wrong, f"{os.path.relpath(path, ROOT)}:\n" + "\n".join(wrong)


def test_the_readme_test_command_is_the_one_ci_runs():
    readme = _read(os.path.join(ROOT, "README.md"))
    commands = [line for line in readme.splitlines() if "pytest" in line and line.startswith("python3 -m venv .venv &&")]
    assert commands, "the README's test command (python3 -m venv .venv && ... pytest ...) is missing"
    ci = _read(os.path.join(ROOT, ".ci", "run")).splitlines()
    ci_command = ci[ci.index("# The README's test command:") + 1]
    assert commands[0].split(" && ")[-1] == ci_command
