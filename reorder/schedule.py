"""Move side effects as early as the data and eager's order allow.

A captured graph's side effects (leaf accumulations, hook calls, opaque calls)
are in eager's order already; the pure ops between them are in trace order.
This pass lifts each side effect to the earliest point where

* its inputs exist,
* the previous side effect has run (side effects keep their relative order, so
  no hook can see a difference), and
* every op that reads one of its tensor inputs *before* it in the original order
  still reads first (a hook may change its argument in place; a stolen gradient
  becomes ``.grad``).

Accumulating a leaf's gradient earlier lets the graph free it earlier.

Before::

    g_w = mm(...); g_b = sum(g); g_x = mm(g, w)
    accumulate_grad(bias, g_b); accumulate_grad(weight, g_w)

After::

    g_w = mm(...); g_b = sum(g); accumulate_grad(bias, g_b)
    accumulate_grad(weight, g_w); g_x = mm(g, w)
"""

from __future__ import annotations

import torch.fx as fx

from ..capture.trace.getitems import is_getitem, unpack_right_after
from ..capture.trace.fx_kinds import has_side_effect


def _is_side_effect(node: fx.Node) -> bool:
    return node.op == "call_function" and has_side_effect(node)


def early_side_effects(graph: fx.Graph) -> None:
    order = {n: k for k, n in enumerate(graph.nodes)}
    previous = None
    for node in list(graph.nodes):
        if not _is_side_effect(node):
            continue
        anchor = max(list(node.all_input_nodes) + ([previous] if previous is not None else []),
                     key=order.__getitem__, default=None)
        for arg in node.all_input_nodes:
            for reader in arg.users:
                if reader is not node and order[reader] < order[node]:
                    if anchor is None or order[reader] > order[anchor]:
                        anchor = reader
        while anchor is not None and is_getitem(anchor.next) and anchor.next is not node:
            anchor = anchor.next  # a tuple is unpacked whole before anything runs in between
        if anchor is not None and anchor.next is not node:
            anchor.append(node)
            unpack_right_after(node)
            order = {n: k for k, n in enumerate(graph.nodes)}
        previous = node
