"""Free every graph input at its last use.

A graph called as ``fn(*inputs)`` keeps all its inputs (saved tensors, root
gradients) alive until it returns, while the eager engine frees each node's
saved tensors as soon as that node has run.  This pass marks the graph for boxed
calling: the eager backend then generates code that takes one list, empties it
on entry and drops each value after its last use, so peak memory follows eager's.
(The inductor and aot_eager backends always free inputs this way.)
"""

from __future__ import annotations

import torch.fx as fx

_FLAG = "_gradfx_free_inputs_early"


def free_inputs_early(graph: fx.Graph) -> None:
    setattr(graph, _FLAG, True)


def frees_inputs_early(graph: fx.Graph) -> bool:
    return getattr(graph, _FLAG, False)
