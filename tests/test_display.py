"""Pictures, tables and names: what a person sees of a captured graph.

The SVG is read back as XML and checked for structure (one ``<g class="cluster">``
per autograd node, one ``<g class="edge">`` with an arrowhead marker per fx edge
between drawn nodes) and geometry (every edge runs from the bottom of its tail's
box down to the top of its head's box; boxes do not overlap and lie in their
frame).
"""

import re
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.capture.view import display, layout, picture
from helpers import Double

SVG = "{http://www.w3.org/2000/svg}"
ENGINES = ["layered"] + (["dot"] if layout.dot_available() else [])


def mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10))
    return model, nn.functional.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))


def cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(16, 10))
    return model, model(torch.randn(4, 3, 16, 16)).square().mean()


def transformer():
    torch.manual_seed(0)
    model = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                                  num_layers=2, enable_nested_tensor=False)
    return model, model(torch.randn(2, 10, 32)).square().mean()


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def _points(d: str):
    return [tuple(float(v) for v in p.split(",")) for p in re.findall(r"-?[\d.]+,-?[\d.]+", d)]


def _rect(g):
    r = g.find(f"{SVG}rect")
    x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
    return x, y, x + w, y + h


def read_svg(svg: str):
    root = ET.fromstring(svg)
    markers = {m.get("id") for m in root.iter(f"{SVG}marker")}
    graph = next(g for g in root.iter(f"{SVG}g") if g.get("class") == "graph")
    clusters = [g for g in graph if g.get("class") == "cluster"]
    nodes = {g.get("id"): g for g in graph if g.get("class") == "node"}
    edges = [g for g in graph if g.get("class") == "edge"]
    return root, markers, clusters, nodes, edges


def _on_border(point, box, tolerance=2.0) -> bool:
    (x, y), (x0, y0, x1, y1) = point, box
    inside = x0 - tolerance <= x <= x1 + tolerance and y0 - tolerance <= y <= y1 + tolerance
    return inside and min(x - x0, x1 - x, y - y0, y1 - y) <= tolerance


def check_edges(edges, boxes, markers, engine):
    """Every edge: an arrowhead marker; it starts on its tail's box and ends on its
    head's box (the built-in layout: bottom to top), the head below the tail."""
    for e in edges:
        path = e.find(f"{SVG}path")
        assert path.get("marker-end") in {f"url(#{m})" for m in markers}, e.get("data-tail")
        pts = _points(path.get("d"))
        tail, head = pts[0], pts[-1]
        where = f"edge {e.get('data-tail')} -> {e.get('data-head')}"
        assert head[1] > tail[1], f"{where} runs upwards"
        tail_box, head_box = boxes[e.get("data-tail")], boxes[e.get("data-head")]
        assert _on_border(tail, tail_box) and _on_border(head, head_box), where
        assert head_box[1] > tail_box[1], f"{where}: head box above tail box"
        if engine == "layered":
            assert abs(tail[1] - tail_box[3]) < 0.1 and abs(head[1] - head_box[1]) < 0.1, where


def no_overlap(boxes):
    items = sorted(boxes.items(), key=lambda kv: kv[1][0])
    for k, (a, (ax0, ay0, ax1, ay1)) in enumerate(items):
        for b, (bx0, by0, bx1, by1) in items[k + 1:]:
            if bx0 >= ax1:
                break
            assert ay1 <= by0 or by1 <= ay0, f"boxes {a} and {b} overlap"


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("name", list(MODELS))
def test_full_picture(name, engine):
    model, loss = MODELS[name]()
    g = gradfx.capture(loss, names=model)
    svg = g.to_svg(detail="full", engine=engine)
    root, markers, clusters, nodes, edges = read_svg(svg)
    drawn = [n for n in g.graph_module.graph.nodes if n.name in nodes]
    # everything but runtime objects and sizes is drawn, with its kind
    for n in g.graph_module.graph.nodes:
        kind = display.node_kind(n)
        if kind in ("runtime", "size") or (kind == "output" and not n.all_input_nodes):
            assert n.name not in nodes
        else:
            assert nodes[n.name].get("data-kind") == kind
    # one frame per autograd node, named as the table names it
    groups = display.group_labels(g.graph_module.graph)
    indices = {display.group_of(n) for n in drawn} - {None}
    passing = display.pass_through(g.graph_module.graph)
    assert len(clusters) == len(indices) == g.autograd_nodes - len(passing)
    assert all(groups[i].split()[0] in ("AddBackward0", "CloneBackward0") for i in passing)
    assert (name == "transformer") == bool(passing) and (not passing or "hand their gradient on" in svg)
    assert sorted(c.get("data-node") for c in clusters) == sorted(groups[i] for i in indices)
    # one edge per fx edge between drawn nodes
    expected = sorted((a.name, n.name) for n in drawn for a in n.all_input_nodes if a.name in nodes)
    assert sorted((e.get("data-tail"), e.get("data-head")) for e in edges) == expected
    boxes = {name: _rect(el) for name, el in nodes.items()}
    check_edges(edges, boxes, markers, engine)
    no_overlap(boxes)
    frames = {c.get("data-node"): _rect(c) for c in clusters}
    for n in drawn:
        if display.group_of(n) is not None:
            fx0, fy0, fx1, fy1 = frames[groups[display.group_of(n)]]
            x0, y0, x1, y1 = boxes[n.name]
            assert fx0 <= x0 and x1 <= fx1 and fy0 <= y0 and y1 <= fy1, n.name
    # leaves by their names; accumulations say which
    def texts(kind):
        return {el.find(f"{SVG}text").text for el in nodes.values() if el.get("data-kind") == kind}
    params = dict(model.named_parameters())
    assert {t.split()[0] for t in texts("leaf")} == set(params)
    assert {f"{p}  f32{list(params[p].shape)}" for p in params} == texts("leaf")
    assert texts("accumulate") == {f"accumulate → {p}" for p in params}
    assert "leaf_" not in svg and "node_" not in svg


@pytest.mark.parametrize("engine", ENGINES)
def test_summary_picture_of_a_transformer(engine):
    model, loss = transformer()
    g = gradfx.capture(loss, names=model)
    assert g.autograd_nodes > 100
    svg = g.to_svg(engine=engine)  # auto: too many boxes for a full picture
    assert "(summary;" in svg
    root, markers, clusters, nodes, edges = read_svg(svg)
    assert len(clusters) == g.autograd_nodes
    boxes = {c.get("id"): _rect(c) for c in clusters}
    boxes.update({k: _rect(v) for k, v in nodes.items()})
    check_edges(edges, boxes, markers, engine)
    no_overlap(boxes)
    named = {c.get("data-node") for c in clusters if c.get("data-kind") == "accumulate"}
    assert named == {f"AccumulateGrad {p}" for p, _ in model.named_parameters()}


def test_sizes_of_the_pictures():
    """The default (built-in) layout of the CNN and the transformer: a column about
    a screen wide, laid out in well under a second."""
    sizes = {}
    for name in ("cnn", "transformer"):
        model, loss = MODELS[name]()
        svg = gradfx.capture(loss, names=model).to_svg()
        width, height = (float(v) for v in re.search(r'width="(\d+)" height="(\d+)"', svg).groups())
        sizes[name] = (width, height)
    assert sizes["cnn"][0] < 2000 and sizes["transformer"][0] < 1600, sizes


def test_leaves_without_names_show_their_shape():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    g = gradfx.capture(lin(torch.randn(2, 4)).sum())
    labels = {r["label"] for r in g.table() if r["kind"] == "leaf"}
    assert labels == {"leaf[3, 4]", "leaf[3]"}
    assert "accumulate → leaf[3, 4]" in g.to_svg()
    assert "leaf_" in g.code


def test_names_in_code_tables_and_save(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    g = gradfx.capture(model(torch.randn(3, 4)).sum(), names=model)
    placeholders = [n.name for n in g.graph_module.graph.find_nodes(op="placeholder")]
    assert {"l_0_weight", "l_0_bias", "l_2_weight", "l_2_bias"} <= set(placeholders)
    rows = g.table()
    leaf_rows = {r["name"]: r for r in rows if r["kind"] == "leaf"}
    assert leaf_rows["l_0_weight"]["label"] == "0.weight" and leaf_rows["l_0_weight"]["shape"] == "[8, 4]"
    assert leaf_rows["l_0_weight"]["autograd_node"] == "AccumulateGrad 0.weight"
    assert {r["label"] for r in rows if r["kind"] == "accumulate"} == {
        f"accumulate → {p}" for p, _ in model.named_parameters()}
    assert "def forward(self, grad_0" in g.code and "l_2_weight" in g.print_readable(print_output=False)
    path = tmp_path / "graph.py"
    g.save(path)
    text = path.read_text()
    assert "l_0_weight" in text and "# l_0_weight: 0.weight" in text
    import runpy
    ns = runpy.run_path(str(path))
    with torch.no_grad():
        ns["Backward"]()(*ns["random_inputs"]())


@pytest.mark.parametrize("form", ["module", "tensor->name", "name->tensor", "pairs"])
def test_names_forms(form):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    names = {"module": model, "tensor->name": {model.weight: "W", model.bias: "b"},
             "name->tensor": {"W": model.weight, "b": model.bias},
             "pairs": (("W", model.weight), ("b", model.bias))}[form]
    g = gradfx.capture(model(torch.randn(3, 4)).sum(), names=names)
    expected = {"weight", "bias"} if form == "module" else {"W", "b"}
    assert {r["label"] for r in g.table() if r["kind"] == "leaf"} == expected


def test_names_refused_with_a_type_error():
    with pytest.raises(TypeError, match="names="):
        gradfx.compiled_autograd(names=3)
    with pytest.raises(TypeError, match="names="):
        gradfx.compiled_autograd(names={"w": 1.0})


def test_names_never_change_the_cache_key():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(3, 4)
    gradfx.reset()
    with gradfx.compiled_autograd(names=model) as named:
        model(x).sum().backward()
    with gradfx.compiled_autograd() as unnamed:
        model(x).sum().backward()
    with gradfx.compiled_autograd(names={model[0].weight: "first"}) as renamed:
        model(x).sum().backward()
    assert gradfx.stats()["captures"] == 1 and gradfx.stats()["cache_hits"] == 2
    assert unnamed.graphs == [] and renamed.graphs == []
    # the graph shows the names of the capture that made it
    assert "0.weight" in named.graphs[0].to_svg()


def test_gradients_returned_by_autograd_grad_are_named():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    g = gradfx.capture(model(torch.randn(4, 3)).sum(), inputs=[model.bias, model.weight], names=model)
    output = next(n for n in g.graph_module.graph.nodes if n.op == "output")
    assert display.label(output) == "output (bias, weight)"
    assert "output (bias, weight)" in g.to_svg()


def test_runtime_inputs_are_hidden_but_in_the_code():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    y.register_hook(lambda grad: grad * 2)
    g = gradfx.capture(y.sum())
    runtime = [n.name for n in g.graph_module.graph.nodes if display.node_kind(n) == "runtime"]
    assert any(r.startswith("node_") for r in runtime) and any(r.startswith("hook_") for r in runtime)
    assert all(r in g.code for r in runtime)
    names = {r["name"] for r in g.table()}
    assert not names & set(runtime)
    assert set(runtime) <= {r["name"] for r in g.table(include_runtime=True)}
    assert not any(f'id="{r}"' in g.to_svg() for r in runtime)
    hook = next(r for r in g.table() if r["kind"] == "hook")
    assert hook["label"] == "tensor hook <lambda>"


def test_custom_function_shows_as_opaque():
    x = torch.randn(3, requires_grad=True)
    g = gradfx.capture(Double.apply(x).sum())
    row = next(r for r in g.table() if r["target"] == "call_backward")
    assert row["kind"] == "opaque" and row["autograd_node"].startswith("DoubleBackward")
    assert 'data-kind="opaque"' in g.to_svg()


def test_print_readable_is_headed_by_autograd_nodes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    text = gradfx.capture(model(torch.randn(2, 4)).sum(), names=model).print_readable(print_output=False)
    assert "No stacktrace" not in text
    lines = [line.strip() for line in text.splitlines()]
    assert "# ReluBackward0 #" in " ".join(lines) and "# AccumulateGrad 0.weight" in lines
    heading = lines.index("# AccumulateGrad 0.weight")
    assert lines[heading + 1].startswith("accumulate_grad") and "l_0_weight" in lines[heading + 1]


def test_pass_records_repr_one_line_each():
    torch.manual_seed(0)
    g = gradfx.capture(nn.Linear(4, 3)(torch.randn(2, 4)).sum())
    text = repr(g.passes)
    assert text.splitlines() == [str(r) for r in g.passes]
    assert len(text.splitlines()) == len(gradfx.list_passes()) and "def forward" not in text
    assert text.splitlines()[0].startswith("strip_detach: ")
    assert "def forward" in g.passes[0].code() and g.passes[0].code() == g.passes[0].code_after
    assert g.passes[-1].code().strip() == g.code.strip()
    assert repr(gradfx.capture(nn.Linear(2, 1)(torch.randn(1, 2)).sum()).passes) != ""


def test_layout_engines_are_checked():
    model, loss = mlp()
    g = gradfx.capture(loss)
    with pytest.raises(ValueError, match="engine"):
        g.to_svg(engine="neato")
    with pytest.raises(ValueError, match="detail"):
        g.to_svg(detail="some")


def test_picture_is_deterministic_and_small_graphs_are_full():
    model, loss = mlp()
    g = gradfx.capture(loss, names=model)
    assert g.to_svg() == g.to_svg()
    assert "(full;" in g.to_svg() and len([n for n in g.graph_module.graph.nodes]) < picture.FULL_LIMIT


def test_html_view_has_picture_and_table_without_runtime_inputs():
    model, loss = mlp()
    html = gradfx.capture(loss, names=model)._repr_html_()
    assert "<svg" in html and "<table>" in html and "0.weight" in html
    assert "node_" not in html.split("<pre>")[0]  # only the code mentions them


def test_html_view_survives_a_failing_picture(monkeypatch, caplog):
    model, loss = mlp()
    g = gradfx.capture(loss, names=model)

    def broken(*args, **kwargs):
        raise RuntimeError("no room")
    monkeypatch.setattr(picture, "draw", broken)
    html = g._repr_html_()
    assert "(no picture: RuntimeError: no room)" in html and "<table>" in html
    assert any("could not draw" in r.getMessage() for r in caplog.records)
