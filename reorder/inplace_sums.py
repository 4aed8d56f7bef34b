"""Sum gradients into the input buffer in place, where eager does.

When a second gradient reaches an input that already holds one, the engine adds it into
the first in place (``InputBuffer::accumulate``: ``old.add_(new)``) if the buffer holds
the only reference to the first and it is a plain dense tensor.  The tracer records the
sum as ``old + new``: the same values, in a fresh tensor per sum, which costs an
allocation (on the CPU, fresh pages for a large one) and may raise peak memory.  This pass
turns a recorded sum (``meta[BUFFER_SUM]``) into ``aten.add_`` where the graph
alone holds the first gradient: an aten op made it as a tensor of its own (not an alias
of its inputs; a view of such a tensor that nothing else uses, and an earlier in-place
sum into one, count), and it is contiguous, of the sum's dtype and shape.  Other ops may
read it too, as where a residual connection's gradient went both to the sum and to the
branch beside it (eager's buffer holds the only reference again once the branch has
read it): each must come before the sum in the graph, be an aten op, and, where it is a
view of the first gradient, have only such readers itself.  Such a sum writes only to
what nothing reads after it: no side effect (``fx_kinds.has_side_effect``), so a
compiler's region keeps it, and its functionalization sees the sum it is.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..capture.trace.fx_kinds import BUFFER_SUM, has_side_effect, shares_storage
from ..capture.trace.plain_layout import plainly_contiguous

aten = torch.ops.aten

def inplace_sums(graph: fx.Graph) -> None:
    order = None
    for node in graph.find_nodes(op="call_function", target=aten.add.Tensor):
        if node.meta.get(BUFFER_SUM):
            if order is None:  # this pass changes ops, never their order
                order = {n: k for k, n in enumerate(graph.nodes)}
            if _only_holder(node, order):
                node.target = aten.add_.Tensor


def _only_holder(node: fx.Node, order: dict) -> bool:
    """May ``node``'s sum be made into its first operand?"""
    old, new = node.args[0], node.args[1]
    if not isinstance(old, fx.Node) or not isinstance(new, fx.Node) or node.kwargs or old is new \
            or not _read_before(old, node, order):
        return False
    got, first, second = node.meta.get("val"), old.meta.get("val"), new.meta.get("val")
    if not all(type(v) is torch._subclasses.FakeTensor for v in (got, first, second)):
        return False
    return (first.dtype == second.dtype == got.dtype and _same_sizes(first.shape, got.shape) and
            plainly_contiguous(first) and _own_tensor(old))


def _same_sizes(a, b) -> bool:
    """Equal sizes as written (symbolic ones by their expressions): no guard is asked."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if type(x) is int and type(y) is int:
            if x != y:
                return False
        elif not (isinstance(x, torch.SymInt) and isinstance(y, torch.SymInt) and x.node.expr == y.node.expr):
            return False
    return True


def _read_before(tensor: fx.Node, sum_node: fx.Node, order: dict) -> bool:
    """Is every other reader of ``tensor`` an aten op before ``sum_node`` (one that returns an
    alias of it, a view, itself read so)?  After the sum nothing sees the tensor, or an
    alias of it, as it was."""
    for user in tensor.users:
        if user is sum_node:
            continue
        target = user.target
        if order[user] > order[sum_node] or user.op != "call_function":
            return False
        if target is operator.getitem:  # one of several outputs
            aliases = True
        elif isinstance(target, torch._ops.OpOverload) and target.namespace == "aten" and not has_side_effect(user):
            aliases = shares_storage(target) or any(r.alias_info is not None for r in target._schema.returns)
        else:
            return False  # a hook, an opaque call, an accumulation: it may keep the tensor
        if aliases and not _read_before(user, sum_node, order):
            return False
    return True


def _own_tensor(node: fx.Node) -> bool:
    """Is ``node`` a tensor its aten op allocated, sharing no storage with its inputs?"""
    if node.op == "call_function" and node.target is operator.getitem:  # one of several outputs
        node = node.args[0]
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    op = node.target
    if op.namespace != "aten":  # (a functional collective's wait returns its input)
        return False
    if op is aten.add_.Tensor:  # an earlier sum made in place: into a tensor of its own?
        return bool(node.meta.get(BUFFER_SUM)) and _own_tensor(node.args[0])
    if shares_storage(op):  # a view of a tensor of its own that nothing else uses
        base = node.args[0]
        return isinstance(base, fx.Node) and len(base.users) == 1 and _own_tensor(base)
    return all(r.alias_info is None for r in op._schema.returns)
