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

from ..graph.run_real import RUN_REAL, RUN_REAL_WITH_HISTORY  # noqa: F401  (the tracer's lists, here too)

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

# Rules that take missing (None) incoming gradients themselves: a symbolic trace calls
# them whatever the gradients, as their node's formula would read saved sizes even then
# (the others run as their node where a gradient is None).
TAKES_NONE: frozenset = frozenset({"NativeGroupNormBackward0"})

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

