"""The picture of a captured graph: an SVG drawn top-down, as data flows.

Two levels of detail:

* ``"full"``: one box per fx node (its op or what it is, and its shape), the
  boxes of one autograd node inside one labelled frame, one arrow per fx edge,
  and a dashed arrow from an accumulation to each post-accumulate hook of its
  leaf (the hook runs after it; no fx edge says so);
* ``"summary"``: one box per autograd node (its ops, the shapes it hands on),
  one arrow per pair of connected autograd nodes: for large graphs.

``"auto"`` picks ``full`` up to :data:`FULL_LIMIT` boxes.  Runtime-object inputs
(autograd nodes, hook callables, retained tensors) and size inputs are left out
(their symbols show in the shapes).  The SVG follows Graphviz's conventions:
each autograd node is a ``<g class="cluster">``, each box a ``<g class="node">``
and each arrow a ``<g class="edge">`` whose path ends in an SVG marker.
"""

from __future__ import annotations

import hashlib
import html
import operator
from collections import Counter

import torch.fx as fx

from ..trace.fx_kinds import data_inputs
from . import display
from .layout import Layout, Scene, TITLE_H, lay_out

FULL_LIMIT = 160  # boxes: past this a full picture is taller than a screen is useful
CHAR_W = 6.6  # advance of the 11px monospace font
LINE_H = 14
FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"
# The header, top down: the title (its baseline), the legend's row (10 high),
# then the notes (header lines after the title), one LINE_H apart.  The first
# note's baseline is a full line below the legend, so that its letters (up to
# 11px above the baseline) clear the legend's; the graph starts below the header.
TITLE_Y = 15
LEGEND_Y = 24
HEADER_H = 40  # the graph's top without notes
NOTE_Y = LEGEND_Y + 10 + LINE_H + 2
NOTE_DESCENT = 4  # room below the last note's baseline

_STYLE = {  # kind -> extra attributes of the box's rect
    "accumulate": 'stroke="#2e7d32" stroke-width="2"',
    "hook": 'stroke="#ad1457" stroke-width="1.5" stroke-dasharray="4 2"',
    "opaque": 'stroke="#e65100" stroke-width="1.5"',
    "leaf": 'stroke="#8d6e00" stroke-width="1.5"',
}


class _Box:
    __slots__ = ("id", "lines", "kind", "tooltip", "group", "dashed")

    def __init__(self, id_, lines, kind, tooltip, group=None):
        self.id, self.lines, self.kind, self.tooltip, self.group = id_, lines, kind, tooltip, group
        self.dashed = False

    def size(self) -> tuple[float, float]:
        return max(len(line) for line in self.lines) * CHAR_W + 12, len(self.lines) * LINE_H + 8


def _drawn(graph: fx.Graph) -> list[fx.Node]:
    out = []
    for node in graph.nodes:
        kind = display.node_kind(node)
        if kind in ("runtime", "size"):
            continue
        if kind == "output" and not any(display.shown(a) for a in data_inputs(node)):
            continue
        out.append(node)
    return out


def _full(graph: fx.Graph, nodes, groups):
    boxes, edges = [], []
    drawn = set(nodes)
    for node in nodes:
        kind = display.node_kind(node)
        text = display.label(node)
        shape = display.short_shape(node)
        line = f"{text}  {shape}" if shape and kind not in ("accumulate",) else text
        tip = [f"{node.name}: {node.format_node() or node.op}", shape]
        index = display.group_of(node)
        if index is not None:
            tip.append(groups.get(index, ""))
        boxes.append(_Box(node.name, [line], kind, "\n".join(t for t in tip if t), index))
        for arg in data_inputs(node):
            if arg in drawn:
                edges.append((arg.name, node.name))
    order = [(a.name, h.name) for a, h in display.after_accumulation(graph) if a in drawn and h in drawn]
    return boxes, edges, order


def _summary(graph: fx.Graph, nodes, groups):
    """One box per autograd node that ran (those that pass their gradient on
    unchanged included), edges of the autograd graph."""
    members: dict = {i: [] for i in groups}
    loose = []
    for node in nodes:
        index = display.group_of(node)
        if index is None:
            loose.append(node)
        else:
            members[index].append(node)
    unit = {n: f"g{i}" for i, ms in members.items() for n in ms}
    unit.update({n: n.name for n in loose})
    boxes = []
    for index, ms in members.items():
        kinds = Counter(display.node_kind(n) for n in ms)
        ops = Counter(display.op_name(n) for n in ms
                      if display.node_kind(n) == "compute" and n.target is not operator.getitem)
        lines = [groups[index]]
        if ops:
            lines.append(_clip(" · ".join(f"{op} ×{c}" if c > 1 else op for op, c in ops.items()), 44))
        elif not ms:
            lines.append("passes the gradient on")
        hooks = [display.label(n) for n in ms if display.node_kind(n) == "hook"]
        if hooks:
            lines.append(_clip("hooks: " + ", ".join(hooks), 44))
        handed = list(dict.fromkeys(display.short_shape(n) for n in ms
                                    if any(unit.get(u, u) != unit[n] for u in n.users if n in data_inputs(u))
                                    and display.short_shape(n)))
        if handed:
            lines.append(_clip("→ " + ", ".join(handed[:3]) + (" …" if len(handed) > 3 else ""), 44))
        kind = "opaque" if kinds["opaque"] else "accumulate" if kinds["accumulate"] else "compute"
        box = _Box(f"g{index}", lines, kind, "\n".join([lines[0]] + [n.name for n in ms]), index)
        box.dashed = bool(kinds["hook"])
        boxes.append(box)
    for n in loose:
        shape = display.short_shape(n)
        text = display.label(n)
        boxes.append(_Box(n.name, [f"{text}  {shape}" if shape else text], display.node_kind(n), n.name))
    edges = [(a.name if isinstance(a, fx.Node) else f"g{a}", f"g{b}") for a, b in display.autograd_edges(graph)]
    ids = {b.id for b in boxes}
    edges = [(a, b) for a, b in edges if a in ids and b in ids]
    for n in loose:  # the output: fed by the nodes whose gradients it returns
        for arg in data_inputs(n):
            if arg in unit and unit[arg] != unit[n]:
                edges.append((unit[arg], unit[n]))
    return boxes, list(dict.fromkeys(edges)), []


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def draw(gm: fx.GraphModule, detail: str = "auto", engine: str = "layered", title: str = "") -> str:
    """The SVG picture of ``gm`` (see the module docstring)."""
    if detail not in ("auto", "full", "summary"):
        raise ValueError(f"detail must be 'auto', 'full' or 'summary', got {detail!r}")
    graph = gm.graph
    nodes = _drawn(graph)
    groups = display.group_labels(graph)
    if detail == "auto":
        detail = "full" if len(nodes) <= FULL_LIMIT else "summary"
    boxes, edges, order = (_full if detail == "full" else _summary)(graph, nodes, groups)
    scene = Scene({b.id: b.size() for b in boxes}, edges + order)
    if detail == "full":
        for b in boxes:
            if b.group is not None:
                scene.group[b.id] = b.group
        for index in set(scene.group.values()):
            scene.titles[index] = len(groups.get(index, "")) * CHAR_W + 8
            scene.labels[index] = groups.get(index, "")
    scene.bottom = {b.id for b in boxes if b.kind == "output"}
    layout = lay_out(scene, engine)
    hidden = sum(1 for n in graph.nodes if display.node_kind(n) in ("runtime", "size"))
    header = [title or f"{_drawn_text(boxes, detail)} ({detail}; {hidden} runtime and size inputs not drawn; "
              f"layout: {layout.engine})"]
    if detail == "full":
        passing = [groups[i] for i in display.pass_through(graph)]
        if passing:
            header.append(_clip(f"{len(passing)} autograd nodes hand their gradient on unchanged and record "
                                "no fx node: " + ", ".join(passing), 160))
    return _svg(boxes, edges, order, layout, groups, detail, header, gm.code)


_WHAT = {"grad": "root gradient", "output": "output"}  # what an ungrouped summary box stands for


def _drawn_text(boxes, detail) -> str:
    """What the picture draws, counted from its boxes: ``47 boxes (fx nodes) in 12 frames
    (autograd nodes)`` (full) or ``113 boxes: 111 autograd nodes, 1 root gradient, 1 output``
    (summary)."""
    if detail == "full":
        frames = len({b.group for b in boxes if b.group is not None})
        return f"{len(boxes)} boxes (fx nodes) in {frames} frames (autograd nodes)"
    counts = Counter("autograd node" if b.group is not None else _WHAT.get(b.kind, b.kind) for b in boxes)
    return f"{len(boxes)} boxes: " + ", ".join(f"{c} {what}" + ("s" if c > 1 else "") for what, c in counts.items())


def _svg(boxes, edges, order, layout: Layout, groups, detail, header, code) -> str:
    marker = "gfx-arrow-" + hashlib.sha1((code + detail).encode()).hexdigest()[:10]
    kinds = _legend_kinds(boxes)
    notes = len(header) - 1
    top = NOTE_Y + LINE_H * (notes - 1) + NOTE_DESCENT if notes else HEADER_H
    width = max(layout.width, max(len(h) for h in header) * CHAR_W + 16, _legend_width(kinds) + 16)
    height = layout.height + top
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="{FONT}" font-size="11">',
           f'<defs><marker id="{marker}" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
           'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/>'
           '</marker></defs>',
           '<rect width="100%" height="100%" fill="#ffffff"/>',
           f'<text class="title" x="8" y="{TITLE_Y}" font-weight="bold">{html.escape(header[0])}</text>']
    out.append(_legend(8, LEGEND_Y, kinds))
    for k, line in enumerate(header[1:]):
        out.append(f'<text class="note" x="8" y="{NOTE_Y + LINE_H * k:.0f}" fill="#555">{html.escape(line)}</text>')
    out.append(f'<g class="graph" transform="translate(0,{top})">')
    if detail == "full":
        for index, (x0, y0, x1, y1) in sorted(layout.frames.items(), key=lambda kv: str(kv[0])):
            name = groups.get(index, "")
            out.append(f'<g class="cluster" data-node="{html.escape(name)}"><title>{html.escape(name)}</title>'
                       f'<rect x="{x0:.1f}" y="{y0:.1f}" width="{x1 - x0:.1f}" height="{y1 - y0:.1f}" rx="6" '
                       'fill="#fafafa" stroke="#9e9e9e"/></g>')
    # order edges (a post-accumulate hook after its accumulation) carry no value: dashed
    for t, h, after in [(t, h, False) for t, h in edges] + [(t, h, True) for t, h in order]:
        path = layout.paths.get((t, h))
        if path is None:
            continue
        d = " ".join(c + " " + " ".join(f"{x:.1f},{y:.1f}" for x, y in pts) for c, *pts in path)
        out.append(f'<g class="edge" data-tail="{html.escape(t)}" data-head="{html.escape(h)}"'
                   + (' data-kind="order"' if after else "") + ">"
                   f'<title>{html.escape(t)} → {html.escape(h)}{" (runs after)" if after else ""}</title>'
                   f'<path d="{d}" fill="none" stroke="#555" stroke-width="1"'
                   + (' stroke-dasharray="3 3"' if after else "") + f' marker-end="url(#{marker})"/></g>')
    for b in boxes:
        x, y = layout.centers[b.id]
        w, h = b.size()
        cls = "cluster" if detail == "summary" and b.group is not None else "node"
        name = groups.get(b.group, "") if cls == "cluster" else ""
        extra = _STYLE.get(b.kind, 'stroke="#607d8b"')
        if b.dashed:
            extra += ' stroke-dasharray="4 2"'
        out.append(f'<g class="{cls}" id="{html.escape(b.id)}" data-kind="{b.kind}"'
                   + (f' data-node="{html.escape(name)}"' if name else "") + ">"
                   f"<title>{html.escape(b.tooltip)}</title>"
                   f'<rect x="{x - w / 2:.1f}" y="{y - h / 2:.1f}" width="{w:.1f}" height="{h:.1f}" rx="3" '
                   f'fill="{display.COLOURS.get(b.kind, "#fff")}" {extra}/>')
        for k, line in enumerate(b.lines):
            weight = ' font-weight="bold"' if (k == 0 and cls == "cluster") or b.kind == "leaf" else ""
            out.append(f'<text x="{x - w / 2 + 6:.1f}" y="{y - h / 2 + 4 + LINE_H * (k + 1) - 3:.1f}"{weight}>'
                       f"{html.escape(line)}</text>")
        out.append("</g>")
    if detail == "full":  # frame titles last, haloed, so arrows entering a frame never hide them
        for index, (x0, y0, _, _) in sorted(layout.frames.items(), key=lambda kv: str(kv[0])):
            out.append(f'<text class="cluster-title" x="{x0 + 6:.1f}" y="{y0 + TITLE_H - 5:.1f}" '
                       'font-weight="bold" fill="#37474f" stroke="#fafafa" stroke-width="3" '
                       f'paint-order="stroke">{html.escape(groups.get(index, ""))}</text>')
    out.append("</g></svg>")
    return "\n".join(out)


_LEGEND = ("grad", "saved", "leaf", "input", "compute", "accumulate", "hook", "opaque", "check", "output")


def _legend_kinds(boxes) -> list[str]:
    """The kinds the picture draws, in legend order; "hook" also for the dashed
    border of a summary box that runs hooks."""
    drawn = {b.kind for b in boxes} | ({"hook"} if any(b.dashed for b in boxes) else set())
    return [k for k in _LEGEND if k in drawn] + sorted(drawn - set(_LEGEND))


def _legend_width(kinds) -> float:
    return sum(len(k) * CHAR_W + 26 for k in kinds)


def _legend(x: float, y: float, kinds) -> str:
    parts = ['<g class="legend">']
    for kind in kinds:
        extra = _STYLE.get(kind, 'stroke="#607d8b"')
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="12" height="10" rx="2" '
                     f'fill="{display.COLOURS.get(kind, "#fff")}" {extra}/>'
                     f'<text x="{x + 16:.1f}" y="{y + 9:.1f}" data-kind="{kind}">{kind}</text>')
        x += len(kind) * CHAR_W + 26
    parts.append("</g>")
    return "".join(parts)
