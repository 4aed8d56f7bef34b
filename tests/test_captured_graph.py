"""CapturedGraph views: code, table, HTML, SVG, pass records, save()."""

import runpy

import torch
import torch.nn as nn

import gradfx


def _graph():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    return lin, gradfx.capture(lin(torch.randn(2, 4)).relu().sum())


def test_views():
    lin, g = _graph()
    assert "threshold_backward" in g.code and "accumulate_grad" in g.code
    rows = g.table()
    kinds = {r["kind"] for r in rows}
    assert {"grad", "saved", "leaf", "compute", "accumulate", "output"} == kinds  # no "runtime" rows
    assert any(r["autograd_node"].startswith("AddmmBackward0") for r in rows)
    html = g._repr_html_()
    assert "<table>" in html and "threshold_backward" in html
    svg = g.to_svg()
    assert svg.startswith("<svg") and svg.endswith("</svg>") and "accumulate → leaf[3, 4]" in svg
    assert [p.name for p in g.passes] == gradfx.list_passes()
    assert g.passes[0].removed >= 1  # detaches stripped
    assert len(g.guards) == 1 and g.guards[0].endswith("sizes as captured")  # static
    assert "f32[2, 3]" in g.print_readable(print_output=False)


def test_save_runs_standalone(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    g = gradfx.capture((x @ w).tanh().sum(), inputs=[w])
    path = tmp_path / "graph.py"
    g.save(path)
    ns = runpy.run_path(str(path))
    with torch.no_grad():
        out = ns["Backward"]()(*ns["random_inputs"]())
    assert isinstance(out, tuple) and out[0].shape == (3, 3)
