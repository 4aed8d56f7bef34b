"""The picture's header and legend, and the arrows no fx edge gives.

The header (the title, the legend, notes such as the autograd nodes that pass
their gradient on) must not overlap itself, the title must count what is drawn,
and the legend must name every kind of box drawn.  A post-accumulate hook gets an
arrow from its accumulation.  engine="dot" without Graphviz says what to install.
"""

import re
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.capture.view import display, picture
from helpers import Double
from test_display import ENGINES, SVG, _rect, check_edges, mlp, read_svg, transformer

FONT_SIZE = 11  # the pictures' font-size


def encoder_layer():
    """One encoder layer: small enough for a full picture, with pass-through nodes."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(32, 4, batch_first=True)
    return model, model(torch.randn(2, 5, 32)).sum()


def opaque_linear():
    """A custom Function's gradient feeding a traced formula: an opaque box and a check box."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, Double.apply(model(torch.randn(2, 4))).sum()


def hooked_linear():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model.weight.register_post_accumulate_grad_hook(lambda p: None)
    return model, model(torch.randn(2, 4)).sum()


def _text_box(el):
    """A generous box around an SVG text: the monospace advance wide, the font's
    ascent above the baseline and its descent below."""
    x, y = float(el.get("x")), float(el.get("y"))
    return x, y - FONT_SIZE, x + len(el.text or "") * picture.CHAR_W, y + 3


def _intersect(a, b) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def _header(svg):
    """(title, legend boxes {kind: rect fill}, legend extents, notes) of a picture."""
    root = ET.fromstring(svg)
    top_texts = [el for el in root if el.tag == f"{SVG}text"]
    legend = next(g for g in root if g.get("class") == "legend")
    swatches = legend.findall(f"{SVG}rect")
    labels = legend.findall(f"{SVG}text")
    fills = {t.text: r.get("fill") for r, t in zip(swatches, labels)}
    extents = [_text_box(t) for t in labels] + [_rect_of(r) for r in swatches]
    return top_texts[0], fills, extents, top_texts[1:]


def _rect_of(r):
    x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
    return x, y, x + w, y + h


def test_notes_clear_the_legend():
    model, loss = encoder_layer()
    g = gradfx.capture(loss, names=model)
    svg = g.to_svg(detail="full")
    title, _, legend, notes = _header(svg)
    assert notes and "hand their gradient on" in notes[0].text
    for note in notes:
        box = _text_box(note)
        for other in legend + [_text_box(title)]:
            assert not _intersect(box, other), (note.text, box, other)
    # and the graph starts below the header
    top = float(re.search(r'class="graph" transform="translate\(0,([\d.]+)\)"', svg).group(1))
    assert all(_text_box(t)[3] <= top for t in [title] + notes)
    assert all(e[3] <= top for e in legend)


PICTURES = {"mlp full": (mlp, "full"), "encoder full": (encoder_layer, "full"),
            "transformer summary": (transformer, "summary"), "opaque and check": (opaque_linear, "full"),
            "post-accumulate hook": (hooked_linear, "full"), "opaque summary": (opaque_linear, "summary")}


@pytest.mark.parametrize("name", list(PICTURES))
def test_legend_names_every_kind_drawn(name):
    make, detail = PICTURES[name]
    model, loss = make()
    g = gradfx.capture(loss, names=model)
    svg = g.to_svg(detail=detail)
    root, _, clusters, nodes, _ = read_svg(svg)
    boxes = list(nodes.values()) + (clusters if detail == "summary" else [])
    drawn = {b.get("data-kind") for b in boxes}
    _, legend, _, _ = _header(svg)
    assert drawn <= set(legend), drawn - set(legend)
    # each swatch has its kind's colour, as the boxes do
    for b in boxes:
        assert b.find(f"{SVG}rect").get("fill") == legend[b.get("data-kind")]
    if name == "opaque and check":
        assert {"check", "opaque"} <= drawn


@pytest.mark.parametrize("engine", ENGINES)
def test_post_accumulate_hook_follows_its_accumulation(engine):
    model, loss = hooked_linear()
    g = gradfx.capture(loss, names=model)
    graph = g.graph_module.graph
    hook = next(n for n in graph.nodes if display.label(n).startswith("post-accumulate hook"))
    accumulate = next(n for n in graph.nodes if display.label(n) == "accumulate → weight")
    svg = g.to_svg(detail="full", engine=engine)
    _, markers, _, nodes, edges = read_svg(svg)
    found = [e for e in edges if (e.get("data-tail"), e.get("data-head")) == (accumulate.name, hook.name)]
    assert len(found) == 1 and found[0].get("data-kind") == "order"
    boxes = {k: _rect(v) for k, v in nodes.items()}
    check_edges(edges, boxes, markers, engine)  # it runs down, from the accumulation to the hook
    # the other edges are the fx edges
    data = sorted((e.get("data-tail"), e.get("data-head")) for e in edges if e.get("data-kind") != "order")
    assert data == sorted((a.name, n.name) for n in graph.nodes if n.name in nodes
                          for a in n.all_input_nodes if a.name in nodes)


@pytest.mark.parametrize("make", [mlp, encoder_layer, transformer, opaque_linear])
@pytest.mark.parametrize("detail", ["full", "summary"])
def test_title_counts_what_is_drawn(make, detail):
    model, loss = make()
    g = gradfx.capture(loss, names=model)
    svg = g.to_svg(detail=detail)
    title = _header(svg)[0].text
    _, _, clusters, nodes, _ = read_svg(svg)
    if detail == "full":
        match = re.match(r"(\d+) boxes \(fx nodes\) in (\d+) frames \(autograd nodes\) \(full;", title)
        assert match, title
        assert int(match.group(1)) == len(nodes) and int(match.group(2)) == len(clusters)
        passing = display.pass_through(g.graph_module.graph)
        assert len(clusters) == g.autograd_nodes - len(passing)
    else:
        match = re.match(r"(\d+) boxes: (\d+) autograd nodes(.*) \(summary;", title)
        assert match, title
        assert int(match.group(1)) == len(clusters) + len(nodes)
        assert int(match.group(2)) == len(clusters) == g.autograd_nodes
        rest = {"grad": "root gradient", "output": "output"}
        loose = sorted(rest[n.get("data-kind")] for n in nodes.values())
        assert sorted(re.findall(r", 1 ([a-z ]+)", match.group(3))) == loose


def test_dot_not_installed_says_what_to_do(monkeypatch):
    model, loss = mlp()
    g = gradfx.capture(loss, names=model)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(FileNotFoundError, match="Graphviz's `dot` program") as err:
        g.to_svg(engine="dot")
    assert "apt install graphviz" in str(err.value) and "conda install graphviz" in str(err.value)
    assert "engine='layered'" in str(err.value)
    assert "layout: layered" in g.to_svg(engine="auto")  # auto still draws, with the built-in layout
