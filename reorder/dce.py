"""Dead-code elimination that keeps every side effect.

fx's own ``eliminate_dead_code`` decides impurity by its own rules; a backward
graph has side effects fx does not know about (leaf accumulation, hook calls,
opaque node calls).  Here a node is kept if it is a placeholder or output, its
target is in :data:`gradfx.capture.runtime_ops.SIDE_EFFECTS`, it is an in-place or
otherwise mutating aten op, or something kept uses it.

Before::

    t = aten.t(w); unused = aten.sum(t); mm = aten.mm(g, t)
    accumulate_grad(leaf, mm, True)

After::

    t = aten.t(w); mm = aten.mm(g, t)
    accumulate_grad(leaf, mm, True)
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..capture.run import runtime_ops


def has_side_effect(node: fx.Node) -> bool:
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    if target in runtime_ops.SIDE_EFFECTS:
        return True
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        return schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write
                                        for a in schema.arguments)
    return False


def eliminate_dead_code(graph: fx.Graph) -> None:
    """Remove nodes with no side effect whose results are never used."""
    for node in reversed(list(graph.nodes)):
        if not node.users and not has_side_effect(node):
            graph.erase_node(node)
