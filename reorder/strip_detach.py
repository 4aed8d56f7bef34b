"""Drop ``aten.detach`` nodes.

Unpacking a saved tensor inside a backward formula detaches it; in a graph that
runs under ``no_grad`` a detach only costs a dispatch (~2 us each), so uses of
``detach(x)`` are rewired to ``x``.  In a ``create_graph`` graph only the
detaches of saved-tensor inputs go (see below).

Before: ``d = aten.detach(saved_3); y = aten.mul(g, d)``
After:  ``y = aten.mul(g, saved_3)``
"""

from __future__ import annotations

import torch
import torch.fx as fx

_DETACH = torch.ops.aten.detach.default


def strip_detach(graph: fx.Graph) -> None:
    # A create_graph graph keeps the autograd history of what it computes: there only
    # the detach that unpacking a saved tensor records goes (the saved input already
    # carries the history eager's unpack gives it); a detach a formula asks for stays.
    history = getattr(graph, "_gradfx_create_graph", False)
    for node in list(graph.find_nodes(op="call_function", target=_DETACH)):
        source = node.args[0]
        if history and not (source.op == "placeholder" and source.meta.get("gradfx_kind") == "saved"):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
