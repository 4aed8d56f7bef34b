"""A compiled region cut into its repeated blocks, so that a compiler compiles a block once.

A transformer's backward is one pure region of some 70 aten ops per layer: compiled
whole, its compile time grows with the depth (GPT-2 small: 12 layers, 800 fx nodes, one
inductor compile of about 20 s).  Its layers' backwards are the same ops on tensors of
the same shapes.  This module finds them:

1. **Cut points**: places in the region's order where at most ``t`` values computed
   inside the region are still read by a later op of the region (a layer boundary
   carries the residual stream's gradient; a tied weight's gradient may ride along).
   Cutting anywhere is correct (what crosses a cut becomes an output of one block and
   an input of the next); cutting where little crosses keeps what fusion loses small.
2. **Chunks** between consecutive cut points, each with a signature: its ops, how they
   connect, their constant arguments and output shapes.
3. **The period**: the number of chunks ``p`` whose repetition ``sig[i] == sig[i + p]``
   covers most of the region; the run is cut into blocks of ``p`` chunks, identical by
   construction, and what comes before and after it into one block each.

:func:`canonical_key` names a block's graph by what it computes (ops, wiring, constants,
its inputs' shapes, strides, dtypes and devices), not by its node names, so that
``split.runner`` compiles each distinct block once and every repeat reuses the code.
"""

from __future__ import annotations

import torch
import torch.fx as fx

MIN_NODES = 100  # smaller regions compile fast whole
# Two repeats save one block's compile, and cost a small model a few percent in steady
# speed (tiny GPT-2, 2 layers: 1.03x the region compiled whole); from three on, the
# compile saved grows with the depth and the steady cost was nil (GPT-2 small: 1.00x).
MIN_REPEATS = 3
MAX_CROSSING = (1, 2, 3)  # the cut-point thresholds tried, in order


def blocks(region: list[fx.Node]) -> list[list[fx.Node]]:
    """``region`` (pure nodes in order) as consecutive blocks: the repeated ones, and the
    rest before and after them; ``[region]`` where nothing repeats."""
    if len(region) < MIN_NODES:
        return [region]
    sizes = _size_math(region)
    ordered = _sunk([n for n in region if n not in sizes])
    crossing = _crossing(ordered)
    for limit in MAX_CROSSING:
        cuts = [k for k in range(1, len(ordered)) if crossing[k] <= limit]
        found = _by_period(ordered, cuts)
        if found is not None:
            # The sizes first (Python): every block may read them, and a compiled block
            # returns tensors only.
            return ([[n for n in region if n in sizes]] if sizes else []) + found
    return [region]


def _size_math(region: list[fx.Node]) -> set:
    """The nodes computing ints from sizes alone (a symbolic graph's size arithmetic)."""
    found: set = set()
    inside = set(region)
    for n in region:
        if isinstance(n.meta.get("val"), (int, torch.SymInt)) and not isinstance(n.meta.get("val"), bool) \
                and all(a not in inside or a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def _sunk(region: list[fx.Node]) -> list[fx.Node]:
    """The region with each node read only inside it moved down to just before its first
    reader (pure ops: any order their data allows computes the same).  What is computed
    early and read late would cross every cut between (a tied embedding's gradient from
    the LM head, read by the embedding's backward at the end): a block would have to take
    it as an input, and its last block could not add to it in place."""
    inside = set(region)
    order = list(region)
    for node in reversed(region):
        if not node.users or any(u not in inside for u in node.users):
            continue
        k = order.index(node)
        first = min(order.index(u) for u in node.users)
        if first > k + 1:
            order.insert(first - 1, order.pop(k))  # right before its first reader
    return order


def _crossing(region: list[fx.Node]) -> list[int]:
    """For each place k (before ``region[k]``): how many tensors computed before it are read
    by an op of the region at or after it; a value of another kind (a tuple, an int)
    must not cross: it counts as too many."""
    position = {n: k for k, n in enumerate(region)}
    last_read: dict = {}
    for k, n in enumerate(region):
        for a in n.all_input_nodes:
            if a in position:
                last_read[a] = k
    starts = [0] * (len(region) + 2)
    for a, last in last_read.items():
        # A tuple must stay with its getitems, and a compiled block returns tensors only.
        weight = 1 if isinstance(a.meta.get("val"), torch.Tensor) else len(region)
        starts[position[a] + 1] += weight
        starts[last + 1] -= weight
    counts, running = [], 0
    for k in range(len(region) + 1):
        running += starts[k]
        counts.append(running)
    return counts


def _by_period(region: list[fx.Node], cuts: list[int]):
    bounds = [0] + cuts + [len(region)]
    chunks = [region[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]
    if len(chunks) < 2 * MIN_REPEATS:
        return None
    sigs = [_signature(c) for c in chunks]
    best = None  # (nodes covered, -period, start, blocks)
    for p in range(1, len(chunks) // MIN_REPEATS + 1):
        k = 0
        while k + p < len(chunks):
            if sigs[k] != sigs[k + p]:
                k += 1
                continue
            start = k
            while k + p < len(chunks) and sigs[k] == sigs[k + p]:
                k += 1
            repeats = (k - start) // p + 1  # chunks start .. k + p - 1 hold them
            if repeats >= MIN_REPEATS:
                covered = sum(len(c) for c in chunks[start:start + repeats * p])
                candidate = (covered, -p, start, repeats)
                if best is None or candidate > best:
                    best = candidate
    if best is None or best[0] * 2 < len(region):
        return None
    _, negative_p, start, repeats = best
    p = -negative_p
    out = []
    if start:
        out.append([n for c in chunks[:start] for n in c])
    for r in range(repeats):
        out.append([n for c in chunks[start + r * p:start + (r + 1) * p] for n in c])
    rest = [n for c in chunks[start + repeats * p:] for n in c]
    if rest:
        out.append(rest)
    return out


def _signature(nodes: list[fx.Node]) -> tuple:
    local = {n: k for k, n in enumerate(nodes)}
    return tuple(_node_signature(n, local) for n in nodes)


def _node_signature(node: fx.Node, local: dict) -> tuple:
    val = node.meta.get("val")
    meta = (_sizes(val.shape), _sizes(val.stride()), val.dtype) if isinstance(val, torch.Tensor) else None
    return (node.op, str(node.target), _arg(node.args, local), _arg(tuple(sorted(node.kwargs.items())), local), meta)


def _sizes(sizes) -> tuple:
    """Sizes to compare: a symbol by its expression (comparing SymInts would add guards)."""
    return tuple(str(s.node.expr) if isinstance(s, torch.SymInt) else s for s in sizes)


def _arg(a, local: dict):
    if isinstance(a, fx.Node):
        return ("inside", local[a]) if a in local else ("outside",)
    if isinstance(a, (list, tuple)):
        return (type(a).__name__, tuple(_arg(x, local) for x in a))
    return repr(a)


def canonical_key(gm: fx.GraphModule, examples: list) -> tuple:
    """What ``gm`` computes on inputs like ``examples``: equal keys, same compiled code."""
    nodes = list(gm.graph.nodes)
    local = {n: k for k, n in enumerate(nodes)}
    body = tuple((n.op, "" if n.op == "placeholder" else str(n.target), _arg(n.args, local),
                  _arg(tuple(sorted(n.kwargs.items())), local)) for n in nodes)  # a placeholder's target: its name
    inputs = tuple((tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type, x.device.index)
                   if isinstance(x, torch.Tensor) else (type(x).__name__, x) for x in examples)
    return body, inputs
