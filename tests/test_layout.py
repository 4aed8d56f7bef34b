"""The package's layers hold (tests/layout.py reads its imports): no import circle, no
upward import, every module in a layer, and docs/ARCHITECTURE.md's picture is the code's."""

import pathlib
import re

import layout


def _read():
    names = layout.modules()
    return names, layout.imports(names)


def test_no_import_circle():
    names, edges = _read()
    assert layout.circles(edges) == [], "modules that import each other: " + "; ".join(
        " <-> ".join(group) for group in layout.circles(edges))


def test_no_upward_import():
    names, edges = _read()
    assert layout.upward(names, edges) == [], "imports of a layer above (see tests/layout.py LAYERS)"


def test_every_module_has_a_layer():
    names, _ = _read()
    for name in names:
        layout.layer_of(name)  # raises for a module no layer owns


def test_the_architecture_page_draws_the_code():
    names, edges = _read()
    text = (layout.ROOT / "docs" / "ARCHITECTURE.md").read_text()
    drawn = re.search(r"<!-- layers: drawn by tests/layout.py -->\n```\n(.*?)\n```", text, re.S)
    assert drawn, "docs/ARCHITECTURE.md lost its picture of the layers"
    assert drawn.group(1) == layout.picture(names, edges), \
        "the layers changed: paste `python tests/layout.py`'s picture into docs/ARCHITECTURE.md"


def test_the_reader_sees_circles_and_upward_imports():
    """The checks above can fail: a made-up circle and an upward edge are found."""
    edges = {"capture.graph.kinds": {"capture.graph.hidden"}, "capture.graph.hidden": {"capture.graph.kinds"},
             "capture.graph.walk": {"capture.run.cache"}}
    assert layout.circles(edges) == [["capture.graph.hidden", "capture.graph.kinds"]]
    names = {n: pathlib.Path() for n in ("capture.graph.walk", "capture.run.cache")}
    assert layout.upward(names, edges) == [("capture.graph.walk", "capture.run.cache")]
