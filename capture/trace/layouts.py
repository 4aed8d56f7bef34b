"""Views of gradients whose layout is known only at run time become reshapes.

The tracer gives a gradient that Python returns (a hook, a custom Function's
backward, a node run for real) the layout of a contiguous tensor, so a C++
formula's ``reshape`` of it is traced as ``view``.  At run time that gradient may
be laid out otherwise (``g.expand(shape)``, ``g.t()``), and ``view`` would raise
where eager's ``reshape`` copies.  ``reshape`` of the real tensor does what eager
did: a view where one exists, else a copy.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .fx_kinds import data_inputs, kind_of

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default)


def _follows_layout(target) -> bool:
    """Can the op's output be laid out like its input (a view, a pointwise op, Python)?"""
    if isinstance(target, torch._ops.OpOverload):
        return target.is_view or torch.Tag.pointwise in target.tags
    return True  # getitem, add_grads: they hand on a tensor they were given


def generalize_views(graph: fx.Graph) -> int:
    """Turn views of tensors whose layout was guessed into reshapes; how many."""
    unknown: set = set()
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if kind_of(node) in ("opaque", "hook"):
            unknown.add(node)
        elif any(a in unknown for a in data_inputs(node)):
            if node.target in _VIEWS:
                node.target = aten.reshape.default
                changed += 1
                unknown.add(node)
            elif _follows_layout(node.target):
                unknown.add(node)
    return changed
