"""The plan of a cache-hit walk in one C++ call (native/program.cpp).

A structure made only of builtin nodes and leaves, with no hook, hidden state or
custom Function, is what most training steps have.  Its generated walker's lines
(``fast_walk``) then consist of the compiled part's reads (structure, metadata, saved
tensors, leaves) and the saved values' getters, each followed by a comparison.  The
same reads and comparisons, in the same order, run as one C++ call over a plan built
here from the same specifications (``kinds``): no Python line per node, no bytecode
to fetch per backward.  The call answers what the lines would return, or None; then
the lines run (they decide, and the call took nothing over).  Where hooks may be
live the lines run directly.  Leaves whose only hooks are post-accumulate-grad hooks
(an optimizer in the backward, DDP's Python reducer) or C++ post-hooks on their
accumulators (DDP's C++ reducer) are walked here too: the call reads the hooks' dict
itself and returns its callables as the lines do; whether each is DDP's reducer hook
alone (part of the key) is asked in Python, of the callables it returned.  Two more
forms join the call where they are few, as under FSDP2 (its post-backward Function per
layer, its pre-backward hooks on the layers' outputs):

* a custom Function's node that runs as itself, its saved tensors left to it: the call
  hands the node's checks to one Python callable (``FunctionKind.checker``);
* tensor pre-hooks (``Tensor.register_hook`` on a non-leaf) on builtin nodes and those:
  the call leaves their inputs empty; the caller finds every such hook of the walk from
  the registry's side (``hooks.tensor_pre_of_walk``: its entries, not a probe per node),
  checks they are on the expected nodes and fills them in.  The call
makes no Python object per node (program.cpp says how): a node's own input is None in
what it returns, and the session gives a graph the node objects it reads.

Every value check here is one of ``kinds.emit_values``' forms; a structure with any
other (a nested size layout, a value keyed by ``value_key``) keeps its lines alone.
"""

from __future__ import annotations

from .. import native
from .kinds import (ACCUMULATE, OPAQUE, TRACED, AccumulateKind, FunctionKind, TracedKind, _tensor_expected,
                    flatten_sizes, kind_of, native_offsets)
from .saved import ForeignOwned

# Step and input codes of program.cpp
METAS, VALUE, SAVED, LEAF, GRAD, FOREIGN, CPP_HOOKS, CALL = range(8)
SIZE, SIZES, NONE, EQUAL = range(4)
GRAD_INPUT, SAVED_INPUT, NODE_INPUT, LEAF_INPUT, HOOK_INPUT, FILLED_LATER = range(6)


def _post_accumulate_only(spec) -> int | None:
    """How many post-accumulate-grad hooks a node's hooks are, with or without C++
    post-hooks (DDP's reducers: the Python one's hooks, the C++ one's); None for any other
    hook, which the lines read."""
    if spec is None:
        return 0
    if spec.tensor_pre or spec.retain or spec.pre or spec.post:
        return None
    return len(spec.post_accumulate)


def _tensor_pre_only(spec) -> tuple | None:
    """A non-leaf node's hooks as their key's tensor pre-hook part ((output_nr, how many),
    ...; empty for no hook), where they are tensor pre-hooks alone; None for any other."""
    if spec is None:
        return ()
    if spec.retain or spec.pre or spec.post or spec.post_accumulate or spec.native_post:
        return None
    return tuple((nr, len(positions)) for nr, positions in spec.tensor_pre)


def plan(call, structure_plan: tuple):
    """program.cpp's plan for ``call``'s structure (parsed once: a capsule); the nodes whose
    saved tensors the user's hooks hold (the caller's lines tell those hooks from gradfx's
    and make their owners); the hooks whose ``reducer_hook_alone`` the key holds (the
    caller asks it of the hooks the call returns); the nodes with tensor pre-hooks, as
    (node index, their key, where their inputs start), which the caller finds and fills
    in.  None where its lines must serve."""
    if native.module() is None or call.outputs is not None or call.accumulate is not True:
        return None
    records = call.records
    if any(k not in call.tensor_slots for k in range(len(call.roots))):
        return None  # a subclass root gradient (walk.root_layout_id)
    steps = [(GRAD, k, _tensor_expected(call, k, call.inputs[k])) for k in range(len(call.roots))]
    layout = [(GRAD_INPUT, k, 0) for k in range(len(call.roots))]
    held = []
    hooked = []  # (node index, its raw saved attributes) per node under the user's saved-tensor hooks
    alone = []  # (input index, expected) of each post-accumulate-grad hook: the key's reducer_hook_alone
    tensor_hooked = []  # (node index, its tensor pre-hooks' key, where their inputs start)
    for i, node in enumerate(call.nodes):
        rec = records[i]
        if not rec.runs or rec.subclass is not None:
            return None
        spec, info = kind_of(node)
        if isinstance(spec, AccumulateKind):
            post_accumulate = _post_accumulate_only(rec.hooks)
            if rec.kind is not ACCUMULATE or post_accumulate is None:
                return None
            native_post = rec.hooks is not None and rec.hooks.native_post
            v = node.variable
            if v.device.type == "cuda":
                return None
            steps.append((LEAF, i, ((type(v), v.dim(), v.dtype, v.layout, v.device, v.is_contiguous()),
                                    v.requires_grad, v.grad_dtype), post_accumulate))
            # C++ post-hooks (DDP's reducer) where the capture found them and none elsewhere:
            # the lines ask only while torch.distributed is initialized, this check always.
            steps.append((CPP_HOOKS, i, native_post))
            layout.append((LEAF_INPUT, i, 0))
            # the hooks' inputs as walk_hooks adds them (hooks.Found.inputs): the
            # post-accumulate-grad hooks, then the node their calls run as
            if post_accumulate:
                alone += zip(range(len(layout), len(layout) + post_accumulate), rec.hooks.post_accumulate_alone)
            layout += [(HOOK_INPUT, i, j) for j in range(post_accumulate)]
            if rec.hooks is not None:
                layout.append((NODE_INPUT, i, 0))
            continue
        tensor_pre = _tensor_pre_only(rec.hooks)
        metas = node._input_metadata
        if tensor_pre is None or any(m.device.type == "cuda" for m in metas):
            return None  # other hooks, which the lines find; the stream check stays in Python
        metas_step = (METAS, i, tuple((len(m.shape), m.dtype, m.device) for m in metas))
        if isinstance(spec, FunctionKind):
            check = spec.checker(node, call.owned[i]) if rec.kind is OPAQUE else None
            if check is None:
                return None
            steps += [metas_step, (CALL, i, check)]
            layout.append((NODE_INPUT, i, 0))
            _tensor_hooks(i, tensor_pre, layout, tensor_hooked)
            continue
        foreign = type(call.owned[i]) is ForeignOwned  # walked as OPAQUE: the user's hooks hold its tensors
        if not isinstance(spec, TracedKind) or info.kind is not TRACED or info.hidden or \
                (rec.kind is not TRACED and not foreign):
            return None
        steps.append(metas_step)
        for attr in info.saved_values:
            step = _value_step(i, type(node), attr, getattr(node, attr), attr in info.size_values)
            if step is None:
                return None
            steps.append(step)
        defined = 0
        if foreign:  # under the user's hooks: found so in C++, told in Python
            raws = tuple(getattr(node, raw) for raw in info.raw_saved)
            offsets = None if any(type(r) is tuple for r in raws) else native.module().offsets(node, raws)
            if offsets is None:
                return None
            steps.append((FOREIGN, i, offsets))
            hooked.append((i, info.raw_saved))
        elif info.raw_saved:
            offsets = native_offsets(node, info)
            if offsets is None:
                return None
            mask = call.owned[i].mask
            expected = []
            k = 0
            for is_defined in mask:
                if not is_defined:
                    expected.append(None)
                    continue
                pos = rec.saved[k]
                expected.append(_tensor_expected(call, pos, call.inputs[pos]))
                k += 1
            defined = k
            steps.append((SAVED, i, (offsets, tuple(expected))))
            held.append((i, offsets, mask))
        layout += [(SAVED_INPUT, i, j) for j in range(defined)] + [(NODE_INPUT, i, 0)]
        _tensor_hooks(i, tensor_pre, layout, tensor_hooked)
    compiled = native.module().compile_program(
        (structure_plan, tuple(steps), tuple(layout), tuple(held), len(call.nodes)), list(call.nodes))
    return compiled, tuple(hooked), tuple(alone), tuple(tensor_hooked)


def _tensor_hooks(i: int, key: tuple, layout: list, tensor_hooked: list) -> None:
    """Node i's tensor pre-hooks' inputs, after its own as hooks.Found.inputs puts them:
    left empty by the call, filled in by its caller."""
    if key:
        tensor_hooked.append((i, key, len(layout)))
        layout += [(FILLED_LATER, i, j) for j in range(sum(count for _, count in key))]


def _value_step(i: int, node_type: type, attr: str, value, is_size: bool):
    """emit_values' check of one saved value as a step, or None for its other forms."""
    descriptor = _descriptor(node_type, attr)
    if descriptor is None:
        return None
    if is_size:
        layout = flatten_sizes(value, [])
        if layout is None:
            return (VALUE, i, descriptor, SIZE, None)
        if isinstance(layout, tuple) and all(e is None for e in layout):
            return (VALUE, i, descriptor, SIZES, len(layout))
        return None
    tv = type(value)
    if value is None:
        return (VALUE, i, descriptor, NONE, None)
    if tv in (int, bool, str, tuple) or (tv is float and value == value):
        return (VALUE, i, descriptor, EQUAL, (tv, value))
    return None


def _descriptor(node_type: type, attr: str):
    """The getter ``node.attr`` runs (a data descriptor of the type), or None."""
    for klass in node_type.__mro__:
        found = klass.__dict__.get(attr)
        if found is not None:
            return found if hasattr(type(found), "__get__") and hasattr(type(found), "__set__") else None
    return None
