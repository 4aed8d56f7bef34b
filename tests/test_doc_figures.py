"""Every ratio figure the README and docs/*.md quote is one the benchmarks wrote.

The benchmark scripts merge what they measure into ``bench/results.json``
(``bench/results_file.py``): per benchmark and model, the date, the machine (CPU model,
cores, load), the torch release, and the ratios to eager (keys starting with ``ratio``).
A figure such as ``0.90x``, ``1.000x`` or ``1.11-1.12x`` in the README or ``docs/*.md``
must be one of those ratios at the precision quoted (each end of a range); a figure
measured by hand, remembered from an older run or from another machine fails here.
Before/after figures of individual changes belong in CHANGELOG.md, which is not checked.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results.json")
FIGURE = re.compile(r"(?<![\w.])(\d+\.\d+)(?:-(\d+\.\d+))?x\b")


def _documents():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _ratios(data):
    if isinstance(data, dict):
        for key, value in data.items():
            if key.startswith("ratio") and isinstance(value, (int, float)):
                yield float(value)
            else:
                yield from _ratios(value)
    elif isinstance(data, list):
        for item in data:
            yield from _ratios(item)


@pytest.fixture(scope="module")
def results():
    with open(RESULTS) as f:
        return json.load(f)


def _held(figure: str, ratios) -> bool:
    places = len(figure.split(".")[1])
    return any(f"{r:.{places}f}" == figure for r in ratios)


def figures(text: str):
    """(line number, figure as written, its ends) for every ratio figure in ``text``."""
    for number, line in enumerate(text.splitlines(), 1):
        for m in FIGURE.finditer(line):
            yield number, m.group(0), [g for g in m.groups() if g is not None]


def test_every_ratio_figure_in_the_docs_is_in_the_results_file(results):
    ratios = sorted(set(_ratios(results)))
    missing = []
    for path in _documents():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for number, figure, ends in figures(text):
            if not all(_held(end, ratios) for end in ends):
                missing.append(f"{os.path.relpath(path, ROOT)}:{number}: {figure}")
    assert not missing, ("figures that bench/results.json does not hold (run the benchmark that measures them, "
                         "or reword):\n" + "\n".join(missing))


def test_every_result_says_when_where_and_with_what(results):
    assert results, "bench/results.json is empty"
    for benchmark, models in results.items():
        for model, entry in models.items():
            where = f"{benchmark} / {model}"
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", entry["date"]), where
            assert entry["machine"]["cpu"] and entry["machine"]["cores"] >= 1, where
            assert entry["torch"] and entry["command"].startswith("python bench/"), where
            assert any(k.startswith("ratio") for k in entry), where


def test_the_check_finds_figures_and_ranges():
    text = "about 1.11-1.12x eager, 0.90x, 1.000x eager; 3 times wider; 1.0-1.3 µs; v2.13x"
    assert [(f, e) for _, f, e in figures(text)] == [("1.11-1.12x", ["1.11", "1.12"]), ("0.90x", ["0.90"]),
                                                     ("1.000x", ["1.000"])]
    assert _held("1.07", [1.0745]) and _held("1.1", [1.0745]) and not _held("1.08", [1.0745])
