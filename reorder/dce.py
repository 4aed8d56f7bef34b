"""Dead-code elimination that keeps every side effect.

fx's own ``eliminate_dead_code`` decides impurity by its own rules; a backward
graph has side effects fx does not know about (leaf accumulation, hook calls,
opaque node calls).  Here a node is kept if it is a placeholder or output, its
kind (``capture.trace.fx_kinds``) is a side effect, it is an in-place or otherwise
mutating aten op, or something kept uses it.

Before::

    t = aten.t(w); unused = aten.sum(t); mm = aten.mm(g, t)
    accumulate_grad(leaf, mm, True)

After::

    t = aten.t(w); mm = aten.mm(g, t)
    accumulate_grad(leaf, mm, True)
"""

from __future__ import annotations

import torch.fx as fx

from ..capture.trace.fx_kinds import has_side_effect


def eliminate_dead_code(graph: fx.Graph) -> None:
    """Remove nodes with no side effect whose results are never used."""
    for node in reversed(list(graph.nodes)):
        if not node.users and not has_side_effect(node):
            graph.erase_node(node)
