"""The built-in backends: eager, aot_eager, inductor."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

from . import register_backend


@register_backend("eager")
def eager(gm: fx.GraphModule, example_inputs: list):
    """Run the graph as generated Python.

    The module is regenerated with boxed calling (one list argument, cleared on
    entry), so every input is freed at its last use inside the graph, as the eager
    engine frees saved tensors node by node.
    """
    boxed = fx.GraphModule(gm, gm.graph)
    boxed.graph.set_codegen(_BoxedCodeGen())
    boxed.recompile()
    forward = boxed.forward

    def run(*args):
        return forward(list(args))
    run._boxed = forward
    return run


@register_backend("aot_eager")
def aot_eager(gm: fx.GraphModule, example_inputs: list):
    """Through torch.compile's aot_eager: dynamo, AOTAutograd, no codegen."""
    return torch.compile(gm, backend="aot_eager", dynamic=False)


@register_backend("inductor")
def inductor(gm: fx.GraphModule, example_inputs: list):
    """Through torch.compile with inductor."""
    return torch.compile(gm, backend="inductor", dynamic=False)
