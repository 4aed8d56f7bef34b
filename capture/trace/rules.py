"""Backward rules: Python formulas for node types whose C++ formula bakes in sizes.

Running a builtin node on fake tensors records its own C++ backward formula.
Formulas that read saved sizes (``_saved_self_sym_sizes``, ``_saved_mat1_sym_strides``,
...) read the concrete values saved in the forward, so a graph traced that way is
only valid for those sizes.  A rule rebuilds the same backward from the node's
saved values as graph values, so sizes can stay symbolic:

    @rule("SumBackward0")
    def sum_backward0(saved, grad):
        return (grad.expand(saved.self_sym_sizes),)

A rule gets ``saved`` (attribute access to the node's saved values without the
``_saved_`` prefix: tensors, ints, sizes (possibly SymInts), scalars) and the
node's incoming gradients, and returns the node's outputs (one per next edge,
None where the node returns no gradient), exactly as calling the node would
before the engine's ``validate_outputs``.  It must call the same aten ops in the
same way as the C++ formula, so results are bitwise equal: every rule is checked
against the real node on random inputs (tests/test_rules.py).
"""

from __future__ import annotations

from typing import Callable

RULES: dict[str, Callable] = {}

# Rules for formulas that read state their node hides from Python (cat's input sizes):
# node name -> (recover, rule).  ``recover(node, out, inputs, observed)`` rebuilds that
# state from the input metadata of the node (``out``) and of its next nodes (``inputs``,
# per next edge: what went in on it, None where the walk read no node for it), each as
# (shape, dtype) with the shape as the walk's size list holds it (symbolic where it is),
# so the cache guards what it recovers; ``observed``: post-hooks see the node's outputs,
# those of edges without a node too.  It returns None where the metadata does not
# determine the state (the node then runs as itself).  The tracer calls
# ``rule(recovered, *grads)``, statically and symbolically alike.
HIDDEN_RULES: dict[str, tuple[Callable, Callable]] = {}

# Node types whose C++ formula computes differently while being traced, so the
# graph calls the real node instead (bitwise eager by construction).  Their
# formulas branch on ``isTensorSubclassLike``, which is true whenever a dispatch
# mode is active (always, while tracing), and take a composite path there that
# rounds differently from eager's; eager's path also branches on the data
# (whether an input holds zeros), which no traced graph can replay.
RUN_REAL: dict[str, str] = {
    # Formulas that read saved state Python cannot see: a traced graph would bake it
    # in while the cache key, built from what Python sees, stayed the same.
    "CopySlices": "reads the base and view geometry and a wrapped node, hidden in C++",
    "AsStridedBackward0": "reads the input's geometry (its storage offset), hidden in C++",
    "AsStridedBackward0_copy": "as AsStridedBackward0 (as_strided_copy)",
    "AsStridedBackward1": "as AsStridedBackward0 (as_strided_)",
    "BlockDiagBackward0": "reads the sizes of every input, hidden in C++",
    "NativeDropoutBackward0": "reads the train flag (the scale), hidden in C++",
    "ToDenseBackward0": "reads masked_grad, hidden in C++",
    "PackPaddedSequenceBackward0": "reads the batch sizes' data (a saved tensor): fakes hold none",
    "CppFunction": "every node without Python bindings (foreach ops, C++ custom Functions): one type, "
                   "no saved values to key",
    # The cached graph would fix the size of the values a boolean mask selects (data).
    "IndexPutBackward0": "the values' size follows the data of a boolean index",
    "IndexPutImplBackward0": "the values' size follows the data of a boolean index",
    "UnsafeIndexPutBackward0": "the values' size follows the data of a boolean index",
    "MaskedFillBackward1": "masked_fill_backward: masked_select(mask).sum() in eager, where(mask).sum() traced",
    "ProdBackward0": "prod_backward: branches on zeros in the input; result / input in eager",
    "ProdBackward1": "prod_backward (dim): branches on zeros in the input; result / input in eager",
    "CumprodBackward0": "cumprod_backward: branches on zeros in the input",
    # evenly_distribute_backward: masked_fill on a zero tensor in eager (CPU), mask * grad
    # traced; the two part where the incoming gradient is inf or nan.
    "MaxBackward1": "evenly_distribute_backward: masked_fill in eager, mask * grad traced",
    "MinBackward1": "evenly_distribute_backward: masked_fill in eager, mask * grad traced",
    "MedianBackward0": "evenly_distribute_backward: masked_fill in eager, mask * grad traced",
    "NanmedianBackward0": "evenly_distribute_backward: masked_fill in eager, mask * grad traced",
}

# Rules that take missing (None) incoming gradients themselves: a symbolic trace calls
# them whatever the gradients, as their node's formula would read saved sizes even then
# (the others run as their node where a gradient is None).
TAKES_NONE: frozenset = frozenset({"NativeGroupNormBackward0"})

# Under create_graph only: the formula branches on the data under grad mode.
RUN_REAL_WITH_HISTORY: dict[str, str] = {
    "LinalgDetBackward0": "det's backward takes a data-dependent path when it must be differentiable",
    "NativeGroupNormBackward0": "group_norm's backward takes a differentiable path (other rounding) under grad mode",
}


def rule(node_name: str):
    """Register a backward rule for autograd nodes named ``node_name``."""
    def add(fn):
        RULES[node_name] = fn
        return fn
    return add


def hidden_rule(node_name: str, recover: Callable):
    """Register a rule whose node hides what it reads (see ``HIDDEN_RULES``)."""
    def add(fn):
        HIDDEN_RULES[node_name] = (recover, fn)
        return fn
    return add


class RealSaved:
    """``saved`` for a live node: reads ``node._saved_<name>``."""

    __slots__ = ("_node",)

    def __init__(self, node):
        self._node = node

    def __getattr__(self, name):
        return getattr(self._node, "_saved_" + name)

    def reshape(self, grad, shape):
        return None  # real tensors: reshape itself


def reshape_groups(source, target):
    """The dim groups of a reshape from ``source`` to ``target`` sizes (ints), in order:
    (source indices, target indices) per run of dims with equal products; stops where
    the products do not meet (sizes that are not a reshape of each other)."""
    i = j = 0
    while i < len(source) and j < len(target):
        ga, gb, pa, pb, i, j = [i], [j], source[i], target[j], i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(source):
                ga.append(i)
                pa, i = pa * source[i], i + 1
            elif pb < pa and j < len(target):
                gb.append(j)
                pb, j = pb * target[j], j + 1
            else:
                return
        yield ga, gb


def apply_rule(node, grads, saved=None):
    """Run ``node``'s rule (or None if it has none)."""
    fn = RULES.get(type(node).__name__)
    if fn is None:
        return None
    return fn(saved if saved is not None else RealSaved(node), *grads)

