"""Top-down layered layout of boxes, grouped in frames, with routed edges.

Two engines give the same result type (:class:`Layout`):

* ``"dot"``: Graphviz's ``dot`` program, when it is installed (clusters for the
  frames, splines for the edges);
* ``"layered"``: pure Python on networkx (installed with torch), a Sugiyama
  layout in two levels: the boxes inside each frame are laid out in layers,
  then the frames themselves.  Each level assigns layers from networkx's
  ``topological_generations``, inserts pass-through points for edges that skip
  layers, orders each layer by barycenters (keeping the order with the fewest
  crossings) and places the layer by weighted isotonic regression (each box as
  close to its neighbours as the order allows; what carries more of the graph
  below it moves less, so the main path runs straight).  An edge leaving or entering
  a frame goes through a port on the frame's bottom or top edge, reserved in
  the frame's own layout, so edges never run through boxes.

In both, every edge runs downwards: its head lies below its tail.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from dataclasses import dataclass, field

import networkx as nx

log = logging.getLogger("gradfx")

GAP_X = 16  # between neighbours in a row
GAP_Y = 34  # between rows of frames
ROW_GAP = 22  # between rows inside a frame
PAD = 8  # inside a frame's border
TITLE_H = 18  # a frame's title line
PORT_W = 6  # room a passing edge takes in a row


@dataclass
class Scene:
    """What to lay out: boxes (id -> (width, height)), frames, edges."""

    boxes: dict
    edges: list  # (tail id, head id)
    group: dict = field(default_factory=dict)  # box id -> frame id; boxes without one stand alone
    titles: dict = field(default_factory=dict)  # frame id -> width its title needs
    labels: dict = field(default_factory=dict)  # frame id -> its title (for dot's own measure)
    bottom: set = field(default_factory=set)  # boxes to put in the last row (the output)


@dataclass
class Layout:
    centers: dict  # box id -> (x, y)
    frames: dict  # frame id -> (x0, y0, x1, y1)
    paths: dict  # (tail, head) -> [("M", p), ("C", c1, c2, p) | ("L", p), ...]
    width: float
    height: float
    engine: str


NO_DOT = ("engine='dot' needs Graphviz's `dot` program, which was not found on PATH: install Graphviz "
          "(`apt install graphviz`, `brew install graphviz` or `conda install graphviz`), or use "
          "engine='layered' (the default, built in) or engine='auto' (dot when installed)")


def dot_available() -> bool:
    return shutil.which("dot") is not None


def lay_out(scene: Scene, engine: str = "layered") -> Layout:
    """Lay ``scene`` out with ``engine``: "layered", "dot", or "auto" (dot when installed)."""
    if engine not in ("auto", "dot", "layered"):
        raise ValueError(f"unknown layout engine {engine!r}; use 'auto', 'dot' or 'layered'")
    if engine == "dot" or (engine == "auto" and dot_available()):
        try:
            return _dot(scene)
        except (OSError, subprocess.SubprocessError, ValueError, KeyError) as err:
            if engine == "dot":
                raise
            log.info("gradfx: dot failed (%s); using the built-in layered layout", err)
    return _layered(scene)


# -- the pure-Python engine -------------------------------------------------------

class _Level:
    """One level of the layered layout: items in rows, edges between rows.

    Items are real boxes, ports (where an edge crosses a frame's border) and
    pass-through points of edges that skip rows; only real boxes have a height.
    """

    def __init__(self):
        self.layer: dict = {}
        self.width: dict = {}
        self.height: dict = {}
        self.key: dict = {}  # initial order
        self.links: list = []  # (u, v, offset in u, offset in v): v one row below u
        self.chains: dict = {}  # (u, v, ou, ov) -> items from u to v
        self.weight: dict = {}  # item -> how firmly it keeps its line (default: by its links)

    def add(self, item, layer, width, height, key):
        self.layer[item], self.width[item], self.height[item], self.key[item] = layer, width, height, key

    def connect(self, u, v, ou=0.0, ov=0.0):
        """An edge from ``u`` down to ``v`` (offsets: where on each it attaches)."""
        chain_key = (u, v, ou, ov)
        if chain_key in self.chains:
            return
        chain, prev, prev_off = [u], u, ou
        for layer in range(self.layer[u] + 1, self.layer[v]):
            dummy = ("pass", chain_key, layer)
            self.add(dummy, layer, PORT_W, 0.0, self.key[u])
            self.links.append((prev, dummy, prev_off, 0.0))
            chain.append(dummy)
            prev, prev_off = dummy, 0.0
        self.links.append((prev, v, prev_off, ov))
        chain.append(v)
        self.chains[chain_key] = chain

    def solve(self):
        """Order each row, place it, and give each row its top and height."""
        n_rows = max(self.layer.values()) + 1 if self.layer else 0
        rows = [[] for _ in range(n_rows)]
        for item in sorted(self.layer, key=lambda i: self.key[i]):
            rows[self.layer[item]].append(item)
        down = {i: [] for i in self.layer}
        up = {i: [] for i in self.layer}
        for u, v, ou, ov in self.links:
            down[u].append((v, ou, ov))
            up[v].append((u, ov, ou))
        self.rows = _order(rows, down, up)
        self.x = _place_rows(self.rows, self.width, down, up, self.weight)
        self._straighten()
        self.heights = [max([self.height[i] for i in row] + [0.0]) for row in self.rows]
        self.gaps = [0.0] * len(self.rows)  # below each row: more where edges run far sideways
        for u, v, ou, ov in self.links:
            k = self.layer[u]
            self.gaps[k] = max(self.gaps[k], abs(self.x[u] + ou - self.x[v] - ov))

    def _straighten(self) -> None:
        """Put each long edge's pass-through points on one vertical line where
        their rows leave room (edges that wiggle between rows read badly)."""
        where = {item: (k, p) for k, row in enumerate(self.rows) for p, item in enumerate(row)}

        def room(item):
            k, p = where[item]
            row, w = self.rows[k], self.width[item]
            lo = self.x[row[p - 1]] + (self.width[row[p - 1]] + w) / 2 + GAP_X if p > 0 else float("-inf")
            hi = self.x[row[p + 1]] - (self.width[row[p + 1]] + w) / 2 - GAP_X if p + 1 < len(row) else float("inf")
            return lo, hi
        for chain in self.chains.values():
            dummies = [i for i in chain if isinstance(i, tuple) and i[0] == "pass"]
            if len(dummies) < 2:
                continue
            candidates = sorted((self.x[d] for d in dummies), key=lambda v: abs(v - self.x[dummies[len(dummies) // 2]]))
            for target in candidates:
                if all(lo <= target <= hi for lo, hi in map(room, dummies)):
                    for d in dummies:
                        self.x[d] = target
                    break

    def gap(self, k: int, base: float) -> float:
        return base + min(3 * base, 0.12 * self.gaps[k])


def _crossings(upper, lower, down) -> int:
    pos = {item: k for k, item in enumerate(lower)}
    pairs = sorted((a, pos[v]) for a, u in enumerate(upper) for v, _, _ in down[u])
    count = 0
    for i in range(len(pairs)):
        for j in range(i + 1, len(pairs)):
            if pairs[j][0] > pairs[i][0] and pairs[j][1] < pairs[i][1]:
                count += 1
    return count


def _order(rows, down, up, sweeps: int = 8):
    """Barycentric ordering (down and up sweeps); keeps the order with fewest crossings."""
    def total(rs):
        return sum(_crossings(rs[k], rs[k + 1], down) for k in range(len(rs) - 1))

    best, best_count = [list(r) for r in rows], total(rows)
    current = [list(r) for r in rows]
    for sweep in range(sweeps):
        if best_count == 0:
            break
        indices = range(1, len(current)) if sweep % 2 == 0 else range(len(current) - 2, -1, -1)
        for k in indices:
            neighbour = current[k - 1] if sweep % 2 == 0 else current[k + 1]
            pos = {item: p for p, item in enumerate(neighbour)}
            links = up if sweep % 2 == 0 else down
            keyed = []
            for p, item in enumerate(current[k]):
                seen = [pos[other] for other, _, _ in links[item] if other in pos]
                keyed.append((sum(seen) / len(seen) if seen else p, p, item))
            current[k] = _centre_ports([item for _, _, item in sorted(keyed, key=lambda t: (t[0], t[1]))],
                                       {item: b for b, _, item in keyed})
        count = total(current)
        if count < best_count:
            best, best_count = [list(r) for r in current], count
    return best


def _is_port(item) -> bool:
    return isinstance(item, tuple) and item[0] in ("in", "out", "pass")


def _centre_ports(row, bary):
    """Within each run of equal barycentre, ports go to the middle: an edge then
    comes straight down between the boxes that share its consumer."""
    out, k = [], 0
    while k < len(row):
        j = k
        while j + 1 < len(row) and bary[row[j + 1]] == bary[row[k]]:
            j += 1
        run = row[k:j + 1]
        ports = [i for i in run if _is_port(i)]
        boxes = [i for i in run if not _is_port(i)]
        half = len(boxes) // 2
        out += boxes[:half] + ports + boxes[half:]
        k = j + 1
    return out


def _isotonic(targets: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [weighted sum, weight, count]
    for t, w in zip(targets, weights):
        blocks.append([t * w, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w_, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w_
            blocks[-1][2] += c
    out = []
    for s, w_, c in blocks:
        out.extend([s / w_] * c)
    return out


def _place(row, width, desired, weights=None) -> list[float]:
    """Centres for ``row`` closest to ``desired`` (weighted) keeping order and spacing."""
    offsets = [0.0]
    for a, b in zip(row, row[1:]):
        offsets.append(offsets[-1] + (width[a] + width[b]) / 2 + GAP_X)
    fit = _isotonic([d - o for d, o in zip(desired, offsets)], weights or [1.0] * len(row))
    return [f + o for f, o in zip(fit, offsets)]


def _place_rows(rows, width, down, up, fixed_weight, sweeps: int = 6) -> dict:
    x = {}
    for row in rows:
        centres = _place(row, width, [0.0] * len(row))
        shift = (centres[0] + centres[-1]) / 2 if centres else 0.0
        for item, c in zip(row, centres):
            x[item] = c - shift

    # What carries the most of the graph below it holds its line; short
    # branches (an accumulation, a transpose feeding one) and side inputs give
    # way, and a long edge bends around the flow rather than the flow around it.
    # With equal weights the main path drifts sideways at every branch.
    below = {}
    for row in reversed(rows):
        for item in row:
            below[item] = max((below[v] + 1 for v, _, _ in down[item]), default=0)
    weight = {i: (1.0 + below[i]) * (0.3 if isinstance(i, tuple) and i[0] == "pass" else 1.0) for i in x}
    weight.update(fixed_weight)

    def relax(row, links):
        desired = []
        for item in row:
            wanted = [(x[other] + o_other - o_self, weight[other]) for other, o_self, o_other in links(item)]
            total = sum(w for _, w in wanted)
            desired.append(sum(p * w for p, w in wanted) / total if wanted else x[item])
        for item, c in zip(row, _place(row, width, desired, [weight[i] for i in row])):
            x[item] = c

    both = lambda item: down[item] + up[item]  # noqa: E731
    for _ in range(sweeps):
        for row in rows[1:]:
            relax(row, lambda item: up[item])
        for row in reversed(rows[:-1]):
            relax(row, lambda item: down[item])
    for row in rows:
        relax(row, both)
    return x


def _layers(nodes, edges, sources_down=True, bottom=()) -> dict:
    """Longest-path layers (networkx generations); lone sources sit just above
    their first consumer; ``bottom`` goes to the last layer."""
    g = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    layer = {}
    for k, generation in enumerate(nx.topological_generations(g)):
        for n in generation:
            layer[n] = k
    if sources_down:
        for n in nodes:
            if g.in_degree(n) == 0 and g.out_degree(n) > 0:
                layer[n] = min(layer[s] for s in g.successors(n)) - 1
    if bottom and layer:
        last = max(layer.values())
        for n in bottom:
            if g.out_degree(n) == 0:
                layer[n] = last
    return layer


class _Frame:
    """The inside of one frame: its boxes plus ports for edges crossing its border.

    Row 0 holds the top ports (one per outside box feeding the frame) beside the
    frame's source boxes; the last row holds the bottom ports (one per box
    feeding something outside), on the frame's bottom border.
    """

    def __init__(self, fid, members, scene, order):
        self.fid = fid
        self.members = members
        member_set = set(members)
        inner = [(t, h) for t, h in scene.edges if t in member_set and h in member_set]
        self.top_ports, self.bottom_ports = {}, {}  # outside tail -> port; inside tail -> port
        port_edges = []
        for t, h in scene.edges:
            if h in member_set and t not in member_set:
                port_edges.append((self.top_ports.setdefault(t, ("in", fid, t)), h))
            if t in member_set and h not in member_set:
                self.bottom_ports.setdefault(t, ("out", fid, t))
        layer = _frame_layers(members, inner, {h for _, h in port_edges})
        last = max(layer.values()) + 1
        level = self.level = _Level()
        for m in members:
            w, h = scene.boxes[m]
            level.add(m, layer[m], w, h, order[m])
        for t, p in self.top_ports.items():
            level.add(p, 0, PORT_W, 0.0, order.get(t, -1))
        for t, p in self.bottom_ports.items():
            level.add(p, last, PORT_W, 0.0, order[t])
        for t, h in inner:
            level.connect(t, h)
        for p, h in port_edges:
            level.connect(p, h)
        for t, p in self.bottom_ports.items():
            level.connect(t, p)
        # The path of the gradient through the frame (from a top port to a box
        # whose consumer hands gradients on) keeps one line, so that the chain
        # of frames runs straight down; side inputs and dead ends give way.
        tails = {t for t, _ in scene.edges}
        g = nx.DiGraph(inner + port_edges + [(t, p) for t, p in self.bottom_ports.items()])
        fed = set()
        for p in self.top_ports.values():
            fed |= nx.descendants(g, p) | {p}
        onward = {p for t, p in self.bottom_ports.items() if any(a == t and h in tails for a, h in scene.edges)}
        for p in list(onward):
            onward |= nx.ancestors(g, p)
        for item in onward & fed if self.top_ports else onward:
            level.weight[item] = 400.0
        level.solve()
        lefts = [level.x[i] - level.width[i] / 2 for i in level.x]
        rights = [level.x[i] + level.width[i] / 2 for i in level.x]
        left, right = min(lefts), max(rights)
        right = max(right, left + scene.titles.get(fid, 0.0))
        self.left = left - PAD
        self.width = right - left + 2 * PAD
        self.row_top, y = [], TITLE_H + PAD / 2
        for k, height in enumerate(level.heights):
            self.row_top.append(y)
            y += height + level.gap(k, ROW_GAP)
        if self.bottom_ports:  # the ports' row lies on the bottom border
            self.height = self.row_top[-1]
        else:
            self.height = y - level.gap(len(level.heights) - 1, ROW_GAP) + PAD

    def centre_x(self, item) -> float:
        """x of ``item`` relative to the frame's centre."""
        return self.level.x[item] - (self.left + self.width / 2)


def _frame_layers(members, inner, fed) -> dict:
    """Layers inside a frame: longest paths, boxes fed from outside at least in
    layer 1 (below the top ports), lone sources just above their first consumer."""
    g = nx.DiGraph()
    g.add_nodes_from(members)
    g.add_edges_from(inner)
    layer = {}
    for n in nx.topological_sort(g):
        below = [layer[p] + 1 for p in g.predecessors(n)] + ([1] if n in fed else [])
        layer[n] = max(below) if below else 0
    for n in reversed(list(nx.topological_sort(g))):
        if g.in_degree(n) == 0 and n not in fed and g.out_degree(n) > 0:
            layer[n] = min(layer[s] for s in g.successors(n)) - 1
    return layer


def _layered(scene: Scene) -> Layout:
    order = {b: k for k, b in enumerate(scene.boxes)}
    frames, members = {}, {}
    for b in scene.boxes:
        fid = scene.group.get(b)
        if fid is not None:
            members.setdefault(fid, []).append(b)
    for fid, ms in members.items():
        frames[fid] = _Frame(fid, ms, scene, order)
    unit_of = {b: ("frame", scene.group[b]) if scene.group.get(b) is not None else ("box", b) for b in scene.boxes}
    units = list(dict.fromkeys(unit_of[b] for b in scene.boxes))
    unit_edges = {(unit_of[t], unit_of[h]) for t, h in scene.edges if unit_of[t] != unit_of[h]}
    bottom = {unit_of[b] for b in scene.bottom}
    layer = _layers(units, sorted(unit_edges, key=str), bottom=bottom)
    top = _Level()
    for u in units:
        if u[0] == "frame":
            f = frames[u[1]]
            top.add(u, layer[u], f.width, f.height, order[f.members[0]])
        else:
            w, h = scene.boxes[u[1]]
            top.add(u, layer[u], w, h, order[u[1]])

    def bottom_port(t):  # (unit, offset) where an edge from box t leaves its unit
        u = unit_of[t]
        return u, (frames[u[1]].centre_x(frames[u[1]].bottom_ports[t]) if u[0] == "frame" else 0.0)

    def top_port(t, h):
        u = unit_of[h]
        return u, (frames[u[1]].centre_x(frames[u[1]].top_ports[t]) if u[0] == "frame" else 0.0)

    for t, h in scene.edges:
        if unit_of[t] != unit_of[h]:
            (ut, ot), (uh, oh) = bottom_port(t), top_port(t, h)
            top.connect(ut, uh, ot, oh)
    top.solve()

    # absolute geometry
    row_top, y = [], float(PAD)
    for k, height in enumerate(top.heights):
        row_top.append(y)
        y += height + top.gap(k, GAP_Y)
    total_h = y - top.gap(len(top.heights) - 1, GAP_Y) + PAD if top.heights else 2 * PAD
    xs = [top.x[i] - top.width[i] / 2 for i in top.x]
    shift = PAD - min(xs) if xs else PAD
    right = max(top.x[i] + top.width[i] / 2 for i in top.x) + shift + PAD if xs else 2 * PAD
    centers, frame_boxes = {}, {}
    unit_box = {}
    for u in units:
        cx, uy = top.x[u] + shift, row_top[top.layer[u]]
        unit_box[u] = (cx - top.width[u] / 2, uy, cx + top.width[u] / 2, uy + top.height[u])
        if u[0] == "box":
            centers[u[1]] = (cx, uy + scene.boxes[u[1]][1] / 2)
        else:
            f = frames[u[1]]
            frame_boxes[u[1]] = unit_box[u]
            x0 = cx - f.width / 2
            for m in f.members:
                k = f.level.layer[m]
                centers[m] = (x0 + f.level.x[m] - f.left, uy + f.row_top[k] + f.level.heights[k] / 2)

    def frame_point(u, item):
        """(x, y in, y out) of a port or pass-through point inside a frame."""
        f = frames[u[1]]
        x0, uy = unit_box[u][0], unit_box[u][1]
        k = f.level.layer[item]
        x = x0 + f.level.x[item] - f.left
        if item in f.top_ports.values():
            return (x, uy, uy + f.row_top[k] + f.level.heights[k])
        if item in f.bottom_ports.values():
            return (x, uy + f.height, uy + f.height)
        return (x, uy + f.row_top[k], uy + f.row_top[k] + f.level.heights[k])

    def inner_chain(u, a, b, oa=0.0, ob=0.0):
        f = frames[u[1]]
        return [frame_point(u, i) for i in f.level.chains[(a, b, oa, ob)][1:-1]]

    def top_chain(ut, uh, ot, oh):
        out = []
        for item in top.chains[(ut, uh, ot, oh)][1:-1]:
            k = top.layer[item]
            out.append((top.x[item] + shift, row_top[k], row_top[k] + top.heights[k]))
        return out

    def box_out(b):
        x, yc = centers[b]
        return (x, yc + scene.boxes[b][1] / 2, yc + scene.boxes[b][1] / 2)

    def box_in(b):
        x, yc = centers[b]
        return (x, yc - scene.boxes[b][1] / 2, yc - scene.boxes[b][1] / 2)

    paths = {}
    for t, h in scene.edges:
        ut, uh = unit_of[t], unit_of[h]
        points = [box_out(t)]
        if ut == uh:
            points += inner_chain(ut, t, h)
        else:
            (_, ot), (_, oh) = bottom_port(t), top_port(t, h)
            if ut[0] == "frame":
                port = frames[ut[1]].bottom_ports[t]
                points += inner_chain(ut, t, port) + [frame_point(ut, port)]
            points += top_chain(ut, uh, ot, oh)
            if uh[0] == "frame":
                port = frames[uh[1]].top_ports[t]
                points += [frame_point(uh, port)] + inner_chain(uh, port, h)
        points.append(box_in(h))
        paths[(t, h)] = _smooth(points)
    return Layout(centers, frame_boxes, paths, right, total_h, "layered")


def _smooth(points) -> list:
    """A path through vertical segments (x, y in, y out): straight down each,
    an S-curve with vertical tangents between them."""
    x, _, y = points[0]
    out = [("M", (x, y))]
    for nx_, y_in, y_out in points[1:]:
        mid = (y + y_in) / 2
        out.append(("C", (x, mid), (nx_, mid), (nx_, y_in)))
        if y_out > y_in:
            out.append(("L", (nx_, y_out)))
        x, y = nx_, y_out
    return out


# -- Graphviz ---------------------------------------------------------------------

def _quote(s) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dot(scene: Scene) -> Layout:
    """Run ``dot -Tjson`` on the scene and read back positions and splines.

    Sizes go in as fixed sizes (points, 72 per inch, so one point per pixel);
    dot's y axis points up, the picture's down.
    """
    ids = {b: f"n{k}" for k, b in enumerate(scene.boxes)}
    back = {v: k for k, v in ids.items()}
    fids = {fid: f"cluster_{k}" for k, fid in enumerate(dict.fromkeys(scene.group.values()))}
    lines = ["digraph G {", "rankdir=TB; nodesep=0.22; ranksep=0.35;",
             'node [shape=box, fixedsize=true, label=""];',
             'edge [arrowhead=normal, arrowsize=0.6];']
    by_frame = {}
    for b in scene.boxes:
        by_frame.setdefault(scene.group.get(b), []).append(b)

    def node_line(b):
        w, h = scene.boxes[b]
        return f"{ids[b]} [width={w / 72:.4f}, height={h / 72:.4f}];"
    for fid, bs in by_frame.items():
        if fid is None:
            lines += [node_line(b) for b in bs]
            continue
        # the title itself, in a font of the picture's advance, so that dot reserves its room
        lines.append(f"subgraph {fids[fid]} {{ label={_quote(scene.labels.get(fid, ''))}; labeljust=l; "
                     'fontname="Courier"; fontsize=11; margin=8;')
        lines += [node_line(b) for b in bs]
        lines.append("}")
    if scene.bottom:
        lines.append("{rank=max; " + " ".join(ids[b] for b in scene.bottom) + "}")
    for t, h in scene.edges:
        lines.append(f"{ids[t]} -> {ids[h]};")
    lines.append("}")
    try:
        done = subprocess.run(["dot", "-Tjson0"], input="\n".join(lines), capture_output=True, text=True,
                              timeout=60, check=True)
    except FileNotFoundError as err:  # subprocess only says "'dot'"
        raise FileNotFoundError(NO_DOT) from err
    data = json.loads(done.stdout)
    llx, lly, urx, ury = (float(v) for v in data["bb"].split(","))
    flip = lambda x, y: (float(x) - llx + PAD, ury - float(y) + PAD)  # noqa: E731
    centers, frames, paths = {}, {}, {}
    gvid = {}
    for obj in data.get("objects", []):
        name = obj["name"]
        if name in back:
            gvid[obj["_gvid"]] = back[name]
            centers[back[name]] = flip(*obj["pos"].split(","))
        elif name.startswith("cluster_") and "bb" in obj:
            x0, y0, x1, y1 = (float(v) for v in obj["bb"].split(","))
            fid = next(f for f, c in fids.items() if c == name)
            (ax, ay), (bx, by) = flip(x0, y1), flip(x1, y0)
            frames[fid] = (ax, ay, bx, by)
    for e in data.get("edges", []):
        t, h = gvid[e["tail"]], gvid[e["head"]]
        paths[(t, h)] = _dot_path(e["pos"], flip)
    return Layout(centers, frames, paths, urx - llx + 2 * PAD, ury - lly + 2 * PAD, "dot")


def _dot_path(pos: str, flip) -> list:
    """dot's spline ``e,x,y p0 p1 p2 p3 ...`` (cubic Bezier pieces; ``e`` is the arrow tip)."""
    end, points = None, []
    for part in pos.split():
        bits = part.split(",")
        if bits[0] == "e":
            end = flip(bits[1], bits[2])
        elif bits[0] == "s":
            continue
        else:
            points.append(flip(bits[0], bits[1]))
    out = [("M", points[0])]
    for k in range(1, len(points) - 2, 3):
        out.append(("C", points[k], points[k + 1], points[k + 2]))
    if end is not None:
        out.append(("L", end))
    return out
