"""What each fx node of a captured graph is: stamped once by the tracer, read everywhere.

The tracer stamps ``node.meta["gradfx_kind"]`` on every node it records:
placeholders by the runtime input they take (``size``, ``grad``, ``saved``,
``variable``, ``node``, ``hook``, ``retained``), calls as ``compute`` (pure
tensor code), ``accumulate`` (writes a leaf's ``.grad``), ``hook`` (calls user
code), ``opaque`` (runs a real autograd node or a custom Function's backward) or
``check`` (stops the graph where an opaque call's gradient is None: run.continuation).
Rewrites keep the stamp (the compiler-facing form swaps targets, not kinds), so
the DCE pass, the split backend and the views all ask :func:`kind_of`.  Nodes a
user's pass adds carry no stamp: they are classified by their target.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..runtime import ddp_buckets, hook_ops, runtime_ops

SIDE_EFFECTS = frozenset({"accumulate", "hook", "opaque", "check"})

# node.meta keys the tracer sets: a recorded sum of two gradients for one input (which
# reorder.inplace_sums may make in place), and a value that may be a tensor subclass of
# a context only the run knows (backends.traceable refuses it)
BUFFER_SUM = "gradfx_buffer_sum"
RUNTIME_SUBCLASS = "gradfx_subclass"
# a call of an accumulator's post-hooks that are all C++ hooks (DistributedDataParallel's
# reducer, the one torch registers): it reads the parameter's .grad and no other graph
# value, and changes none (backends.split may run it later, with the accumulations)
CPP_POST_HOOKS = "gradfx_cpp_post_hooks"

# For nodes without a stamp: gradfx's runtime functions by what they do.
_BY_TARGET = {
    runtime_ops.accumulate_grad: "accumulate", runtime_ops.accumulate_grad_unchecked: "accumulate",
    runtime_ops.accumulate_grad_create_graph: "accumulate",
    runtime_ops.call_node: "opaque", runtime_ops.call_backward: "opaque", runtime_ops.release_saved: "opaque",
    runtime_ops.release_hooked: "opaque",
    runtime_ops.require_gradients: "check",
    **{fn: "hook" for fn in hook_ops.HOOK_CALLS},
    ddp_buckets.open_buckets: "hook", ddp_buckets.ready: "hook", ddp_buckets.finish: "hook",
}


def kind_of(node: fx.Node) -> str:
    """The node's kind; ``output`` for the output node, ``input`` for an unstamped placeholder."""
    if node.op == "output":
        return "output"
    kind = node.meta.get("gradfx_kind")
    if kind is not None:
        return kind
    if node.op == "placeholder":
        return "input"
    return _BY_TARGET.get(node.target, "compute") if node.op == "call_function" else "compute"


def data_inputs(node: fx.Node) -> list:
    """The fx nodes whose values ``node`` computes with.  A ``check`` also takes what
    the rest of the backward needs should the graph stop there (run.continuation):
    a hand-over, not data flow (views do not draw it, layouts do not follow it)."""
    if node.op == "call_function" and node.target is runtime_ops.require_gradients:
        return [a for a in node.args[0] if isinstance(a, fx.Node)]
    return node.all_input_nodes


# Ops that return a tensor sharing its input's storage without saying so in their schema.
_SHARES_STORAGE = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten._reshape_alias.default,
                             torch.ops.aten.lift_fresh.default})


def shares_storage(target) -> bool:
    """Does the op return a tensor sharing its first argument's memory (a view, or an op such
    as ``_unsafe_view`` that does so without its schema saying it)?"""
    return isinstance(target, torch._ops.OpOverload) and (target.is_view or target in _SHARES_STORAGE)


def has_side_effect(node: fx.Node) -> bool:
    """Must the node stay, and keep its place among the other side effects, even if
    nothing uses its result?"""
    if node.op in ("placeholder", "output"):
        return True
    if node.op != "call_function":
        return False
    if kind_of(node) in SIDE_EFFECTS:
        return True
    if node.target is torch.ops.aten.add_.Tensor and node.meta.get(BUFFER_SUM):
        return False  # a sum made in place into a tensor only it reads (reorder.inplace_sums)
    return op_has_side_effect(node.target)


# Tagged nondeterministic_seeded, yet they replay the forward's dropout from the seed and
# offset passed to them as tensors: no generator is read or advanced.
_SEEDED_BY_ARGUMENTS = frozenset(
    getattr(getattr(torch.ops.aten, name, None), "default", None)
    for name in ("_scaled_dot_product_efficient_attention_backward",
                 "_scaled_dot_product_cudnn_attention_backward")) - {None}

_op_effects: dict = {}  # target -> bool, for hashable targets


def op_has_side_effect(target) -> bool:
    """Does calling ``target`` do more than return its result?  In-place and out= ops (they
    write to their arguments), random draws (they advance a generator: dropping or
    reordering one changes every later draw), and what fx or torch mark effectful."""
    try:
        return _op_effects[target]
    except KeyError:
        pass
    except TypeError:  # unhashable: not an op
        return False
    found = _op_effects[target] = _effectful(target)
    return found


def _effectful(target) -> bool:
    if target in fx.node._side_effectful_functions:
        return True
    if isinstance(target, torch._ops.OpOverload):
        schema = target._schema
        if schema.is_mutable or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            return True
        if torch.Tag.nondeterministic_seeded in target.tags and target not in _SEEDED_BY_ARGUMENTS:
            return True
        return _registered_effect(target)
    return False


def _registered_effect(op) -> bool:
    """Registered with torch.library's effect registry (ordered with effect tokens)."""
    try:
        from torch._higher_order_ops.effects import _get_effect
    except ImportError:  # the registry's reader is private: where it moves, nothing is registered there
        return False
    return _get_effect(op) is not None
