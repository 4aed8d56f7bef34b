"""One specification per autograd node kind, behind both walks.

Each kind (a leaf's AccumulateGrad, a builtin node gradfx traces, a custom
Function) says in one place what a node of that kind contributes to a backward
call: its part of the structure key, its sizes, its runtime inputs (saved
tensors, the node or leaf object, hook callables) and its hooks.  It says it
twice, side by side, in the same order:

* ``walk``: read the live node and record (the generic walk, which discovers a
  new structure and builds its key);
* ``check`` / ``take`` / ``inputs``: emit straight-line code that checks a live
  node against what was recorded and collects the same sizes and inputs (the
  cache-hit walker of ``fast_walk``: checks first, take-over after every check
  passed).

Hooks are the same for every kind (``walk_hooks`` / ``emit_hooks``): tensor
pre-hooks, retains-grad hooks, node pre- and post-hooks, post-accumulate-grad
hooks.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction

from .. import native
from ..errors import _Fallback
from .functions import dtensor_function, promised_traceable
from . import distributed, hidden, hooks, regions, subclasses
from .run_real import RUN_REAL
from .saved import (ForeignHooks, ForeignOwned, Origin, SubclassSaved, Untouched, any_hooked, foreign_hooks,
                    leave_to_node, plain_type, readable, saved_layouts, take_saved, unreadable)

TRACED, ACCUMULATE, OPAQUE, FUNCTION = "traced", "accumulate", "opaque", "function"

# Saved values whose names say they hold sizes: these may become symbolic.
_SIZE_WORDS = ("sizes", "strides", "numel", "argsize", "split_size")
# Saved plain ints that are sizes though their names do not say so, per node type:
# group_norm's batch, channels and the product of its spatial dims follow the data.
# An upsampling's output_size is its output's spatial sizes (computed from the input's
# sizes where a scale factor is given).
_UPSAMPLE_NODES = (
    "UpsampleNearest1DBackward0", "UpsampleNearestExact1DBackward0", "UpsampleNearest2DBackward0",
    "UpsampleNearestExact2DBackward0", "UpsampleNearest3DBackward0", "UpsampleNearestExact3DBackward0",
    "UpsampleLinear1DBackward0", "UpsampleBilinear2DBackward0", "UpsampleBicubic2DBackward0",
    "UpsampleTrilinear3DBackward0", "UpsampleBilinear2DAaBackward0", "UpsampleBicubic2DAaBackward0",
)
_NAMED_SIZES = {
    "NativeGroupNormBackward0": frozenset({"_saved_N", "_saved_C", "_saved_HxW"}),
    **{name: frozenset({"_saved_output_size"}) for name in _UPSAMPLE_NODES},
}


@dataclass(frozen=True)
class TypeInfo:
    """What gradfx needs to know about an autograd node type."""

    kind: str
    raw_saved: tuple[str, ...]  # `_raw_saved_x` attributes (SavedVariables)
    saved_tensors: tuple[str, ...]  # the matching `_saved_x` attributes
    saved_values: tuple[str, ...]  # other `_saved_x`: ints, floats, sizes, ...
    size_values: frozenset  # those of saved_values that hold sizes, strides or numels
    hidden: bool = False  # keeps C++ state its backward reads (graph.hidden), keyed too


_type_info: dict[type, TypeInfo] = {}


def type_info(node_type: type) -> TypeInfo:
    info = _type_info.get(node_type)
    if info is None:
        names = dir(node_type)
        raw = tuple(n for n in names if n.startswith("_raw_saved_"))
        tensors = tuple("_saved_" + n[len("_raw_saved_"):] for n in raw)
        values = tuple(n for n in names if n.startswith("_saved_") and n not in tensors)
        if node_type.__name__ == "AccumulateGrad":
            kind = ACCUMULATE
        elif issubclass(node_type, BackwardCFunction):
            # A custom autograd.Function: its saved tensors are ctx.saved_tensors.
            kind, raw, tensors, values = FUNCTION, ("_raw_saved_tensors",), ("saved_tensors",), ()
        else:
            kind = TRACED
        named = _NAMED_SIZES.get(node_type.__name__, frozenset())
        sized = frozenset(v for v in values if v in named or any(w in v for w in _SIZE_WORDS))
        info = _type_info[node_type] = TypeInfo(kind, raw, tensors, values, sized,
                                                node_type.__name__ in hidden.KEYED)
    return info


def is_traceable(function_node_type: type) -> bool:
    """Is this custom Function's backward traced into the graph (see gradfx.traceable; a
    torch.compile'd region's backward: graph.regions)?"""
    cls = function_node_type._forward_cls
    if promised_traceable(cls):
        return True
    return regions.is_region(cls)


def traced_ctx_key(ctx):
    """What a traced backward bakes in of its ctx, for the key; None where the node must
    run opaque after all (a compiled region holding opaque objects)."""
    if promised_traceable(ctx._forward_cls):
        return ctx_key(ctx)
    return regions.ctx_key(ctx)


def function_materializes(ctx) -> bool:
    # ctx.materialize_grads cannot be read back from Python; set_materialize_grads
    # is wrapped (graph.functions.install) to leave a readable copy.
    return ctx.__dict__.get("_gradfx_materialize_grads", True)


def region_ints(ctx):
    """The ints a traced compiled region's ctx saved (sizes), or None for other Functions."""
    if promised_traceable(ctx._forward_cls):
        return None
    return regions.saved_ints(ctx)


REGION_INTS = "_saved_symints"  # the NodeRecord.values slot of a compiled region's saved ints


def ctx_key(ctx) -> tuple:
    items = []
    for name, value in sorted(ctx.__dict__.items()):
        if isinstance(value, torch.Tensor):
            items.append((name, "tensor") + tensor_meta(value))
        else:
            items.append((name, value_key(value)))
    return tuple(items)


def tensor_meta(t: torch.Tensor) -> tuple:
    readable(t, "in a saved value or a traced Function's ctx")
    return (t.dtype, t.shape, t.stride(), t.device, t.layout)


def value_key(v):
    """Key for a saved non-tensor value.

    Each attribute of a node type has one C++ type, so tuples (sizes, dims) are
    used as they are; a lone scalar may be an int, a float or a bool, which compare
    equal but trace differently, so its type is part of the key (floats by repr,
    which also makes NaN equal to itself).
    """
    tv = type(v)
    if tv is tuple or v is None:
        return v
    if tv is float:
        return repr(v)
    if isinstance(v, torch.Tensor):
        return ("tensor",) + tensor_meta(v)
    try:
        hash(v)
        return (tv, v)
    except TypeError:
        return (tv, repr(v))


def flatten_sizes(value, out: list):
    """Append the ints of a size value (int, tuple of ints, list of tuples) to ``out``;
    return its layout (None for an int, else the nested lengths) for the key."""
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return tuple(flatten_sizes(v, out) for v in value)
    out.append(value)
    return None


@dataclass
class HookSpec:
    """Hooks of one node, as positions of their callables in the runtime inputs.

    Eager's order: tensor pre-hooks (per hooked output, in registration order),
    retains-grad hooks, pre-hooks, the node, post-hooks; for a leaf, the
    accumulation and then its post-accumulate-grad hooks.
    """

    tensor_pre: list = field(default_factory=list)  # (output_nr, [input positions])
    retain: list = field(default_factory=list)  # (output_nr, input position of the tensor)
    pre: list = field(default_factory=list)
    post: list = field(default_factory=list)
    post_accumulate: list = field(default_factory=list)
    post_incoming: tuple = ()  # per post-hook: hooks.hands_on_incoming
    # per post-accumulate-grad hook: distributed.reducer_hook_alone (its calls may move)
    post_accumulate_alone: tuple = ()
    node: int | None = None  # an accumulator's own node, for its hooks (hooks.Found.node)
    # An accumulator with C++ post-hooks (DDP's reducer): its whole post-hook list runs
    # through the compiled part (hook_ops.call_node_post_hooks), ``post`` not one by one.
    native_post: bool = False

    def key(self) -> tuple:
        return (tuple((nr, len(p)) for nr, p in self.tensor_pre), tuple(nr for nr, _ in self.retain),
                len(self.pre), self.post_incoming, self.post_accumulate_alone, self.native_post)


@dataclass
class NodeRecord:
    """What the walk learned of one node that holds for every backward of its structure."""

    kind: str  # as walked: ACCUMULATE, TRACED, FUNCTION, or OPAQUE (saved tensors under the user's hooks)
    edges: tuple  # per next edge: (child index, input_nr) or None
    deps: int  # incoming edges
    runs: bool  # eager's exec_info: does the node run (autograd.grad / inputs= skip some)
    node_input: int | None = None  # input position of its node object (leaf tensor for an accumulator)
    hooks: HookSpec | None = None
    meta_start: int | None = None  # where its input metadata's shapes start in the sizes
    values: dict = field(default_factory=dict)  # saved size attribute -> (start in sizes, layout)
    saved: tuple = ()  # input positions of its saved tensors
    hidden: object = None  # its hidden state as keyed (graph.hidden), None: it runs as itself
    subclass: str | None = None  # why it runs as itself where a tensor subclass reaches it, or None


class Walk:
    """What the generic walk accumulates: key, sizes and inputs, in the order walked."""

    def __init__(self, grads, index: dict):
        """``index``: id(node) -> node index, to find the retain_grad() tensors of the nodes."""
        self.key: list = []
        self.sizes: list = []
        self.inputs: list = list(grads)
        self.input_kinds: list = ["grad"] * len(grads)
        self.input_owner: list = [-1] * len(grads)
        self.tensor_slots: dict = {}  # input position -> (shape start, ndim, stride start or -1)
        self.owned: dict = {}  # node index -> SavedTensors
        # Take an opaque custom Function's saved tensors over (a compiler inlines its
        # backward with them as graph inputs), or leave them to the node (see Untouched).
        self.take_functions = True
        self.hooks_active = hooks.active()  # one state per walk: it counts the hook dicts found
        # node index -> [(output_nr, tensor)] for retain_grad()
        self.retained = hooks.retained_by_node(index) if self.hooks_active else {}

    def add_input(self, value, kind: str, owner: int) -> int:
        self.inputs.append(value)
        self.input_kinds.append(kind)
        self.input_owner.append(owner)
        return len(self.inputs) - 1

    def tensor(self, t, pos, role: str, node=None):
        """A tensor's structure for the key; its sizes (and strides unless contiguous)
        go to the sizes, so that they can be guarded or made symbolic.  ``role`` and
        ``node``: where it was met, for a fallback's reason."""
        readable(t, role, node)
        if t.layout is not torch.strided or t.is_nested:  # no strided sizes to read
            raise unreadable(f"a {'nested' if t.is_nested else t.layout} tensor", role, node)
        sizes = self.sizes
        start = len(sizes)
        sizes.extend(t.shape)
        if t.is_contiguous():
            stride_start = -1
        else:
            stride_start = len(sizes)
            sizes.extend(t.stride())
        if pos is not None:
            self.tensor_slots[pos] = (start, t.dim(), stride_start)
        return (t.dtype, t.device, t.layout, t.dim(), stride_start < 0)


# -- streams (the engine's Note [Streaming backwards]) ------------------------------
# A CUDA node's input metadata records the stream its forward ran on: eager runs the
# node's backward there, syncs gradients that cross streams and, at the end, the
# caller's current streams with the leaves' streams.  gradfx runs the whole graph on
# the caller's current stream of each device: eager's behaviour only where every CUDA
# node ran on that stream.  torch 2.11 and 2.13 do not expose the stream to Python
# (InputMetadata has shape, dtype, device, is_nested_tensor, is_cpp_nested_tensor),
# so there every CUDA graph is refused, unless ``assume_current_stream`` is set: the
# program's promise that its forwards ran on the stream current at backward().  CPU
# metadata is never looked at.

assume_current_stream = False
_THIS = sys.modules[__name__]  # where generated walkers read it


def stream_reason(meta, node) -> str | None:
    """None if the node whose CUDA input metadata is ``meta`` would run on the caller's
    current stream in eager too; else why it must run on the eager engine."""
    stream = getattr(meta, "stream", None)  # no release exposes it yet
    if stream is None:
        if assume_current_stream:
            return None
        return (f"a CUDA node ({type(node).__name__}): torch {torch.__version__} does not say which stream its "
                "forward ran on, and gradfx runs the backward on the current stream (set "
                "gradfx.capture.graph.kinds.assume_current_stream = True where forwards run on it)")
    current = torch.cuda.current_stream(meta.device)
    if (stream.stream_id, stream.device_index) == (current.stream_id, current.device_index):
        return None
    return (f"{type(node).__name__}'s forward ran on CUDA stream {stream.stream_id}, not the caller's current "
            f"stream {current.stream_id} of {meta.device} (eager runs it on its own stream)")


def _check_stream(meta, node) -> None:
    reason = stream_reason(meta, node)
    if reason is not None:
        raise _Fallback(reason, process_wide=getattr(meta, "stream", None) is None)


def stream_ok(meta) -> bool:
    """The generated walker's form of the check (a miss: the generic walk says why)."""
    return stream_reason(meta, None) is None


def emit_stream(src, meta) -> str:
    """The generated walker's condition on the CUDA metadata ``mk`` recorded as ``meta``."""
    if getattr(meta, "stream", None) is None:  # unreadable on this release: the promise alone
        return f"{src.const(_THIS)}.assume_current_stream"
    return "stream_ok(mk)"


# -- the pieces every kind is made of: walk and code side by side -------------------

def walk_metas(w: Walk, rec: NodeRecord, node) -> None:
    """The node's input metadata: shapes to the sizes, (ndim, dtype, device) to the key."""
    rec.meta_start = len(w.sizes)
    out = []
    for meta in node._input_metadata:
        shape = meta.shape
        w.sizes.extend(shape)
        device = meta.device
        if device.type == "cuda":
            _check_stream(meta, node)
        out.append((len(shape), meta.dtype, device))
    w.key.append(tuple(out))


def emit_metas(src, var: str, node) -> None:
    metas = node._input_metadata
    reader = native.module()
    if reader is not None and all(meta.device.type != "cuda" for meta in metas):
        # The same checks in one C++ call (capture/native/walk.cpp); CUDA's stream check stays here.
        expected = tuple((len(meta.shape), meta.dtype, meta.device) for meta in metas)
        src.bail_unless(f"native_metas({var}, {src.const(expected)}, sizes)")
        return
    src.emit(f"m = {var}._input_metadata")
    src.bail_unless(f"len(m) == {len(metas)}")
    for k, meta in enumerate(metas):
        src.emit(f"mk = m[{k}]")
        src.emit("sh = mk.shape")
        stream = f" and {emit_stream(src, meta)}" if meta.device.type == "cuda" else ""
        src.bail_unless(f"len(sh) == {len(meta.shape)} and mk.dtype is {src.const(meta.dtype)} "
                        f"and mk.device == {src.const(meta.device)}{stream}")
        src.emit("sizes += sh")


def walk_values(w: Walk, rec: NodeRecord, node, info: TypeInfo) -> None:
    """Saved non-tensor values: sizes to the sizes (layout to the key), the rest to the key."""
    for attr in info.saved_values:
        value = getattr(node, attr)
        if attr in info.size_values:
            start = len(w.sizes)
            layout = flatten_sizes(value, w.sizes)
            rec.values[attr] = (start, layout)
            w.key.append(layout)
        else:
            w.key.append(value_key(value))


def emit_values(src, var: str, node, info: TypeInfo) -> None:
    for attr in info.saved_values:
        value = getattr(node, attr)
        src.emit(f"x = {var}.{attr}")
        if attr in info.size_values:
            layout = flatten_sizes(value, [])
            if layout is None:  # one int
                src.bail_unless("type(x) is int")
                src.emit("sizes.append(x)")
            elif isinstance(layout, tuple) and all(e is None for e in layout):  # flat sizes
                src.bail_unless(f"type(x) is tuple and len(x) == {len(layout)}")
                src.emit("sizes += x")
            else:
                src.bail_unless(f"flatten(x, sizes) == {src.const(layout)}")
            continue
        tv = type(value)
        if value is None:
            src.bail_unless("x is None")
        elif tv in (int, bool, str, tuple) or (tv is float and value == value):
            # Same type and equal: what value_key would compare, without its call.
            src.bail_unless(f"type(x) is {tv.__name__} and x == {src.const(value)}")
        else:
            src.bail_unless(f"value_key(x) == {src.const(value_key(value))}")


def walk_hidden(w: Walk, rec: NodeRecord, node) -> None:
    """C++ state the node's formula reads (graph.hidden): its sizes to the sizes, the rest to
    the key; None (the node runs as itself) to the key where it cannot be read."""
    read = hidden_state(node)
    if read is None:
        w.key.append(None)
        return
    sizes, rec.hidden = read
    start = len(w.sizes)
    layout = flatten_sizes(sizes, w.sizes)
    rec.values[hidden.SIZES] = (start, layout)
    w.key.append((layout, rec.hidden))


def emit_hidden(src, i: int, rec: NodeRecord) -> None:
    if rec.hidden is None:
        src.bail_unless(f"hidden_state(n{i}) is None")
        return
    src.emit(f"x = hidden_state(n{i})")
    layout = rec.values[hidden.SIZES][1]
    src.bail_unless(f"x is not None and x[1] == {src.const(rec.hidden)} and flatten(x[0], sizes) == "
                    f"{src.const(layout)}")


def walk_saved(w: Walk, rec: NodeRecord, i: int, node, info: TypeInfo, subclasses_too: bool = False) -> bool:
    """Take the node's saved tensors over as inputs; False if the user's hooks own them, or
    if one is a tensor subclass (True for a builtin node, ``subclasses_too``: its saved
    values are left to it and the graph reads them as it runs, see walk_subclass_values)."""
    try:
        owned, mask, values = take_saved(node, info.raw_saved, info.saved_tensors)
    except ForeignHooks:
        w.key.append(OPAQUE)
        w.owned[i] = ForeignOwned(node)  # released after the backward as the engine would
        return False
    except SubclassSaved as found:
        rec.subclass = f"a tensor subclass ({found}) among the saved tensors"
        if subclasses_too:
            walk_subclass_values(w, rec, i, node, info)
        else:  # a custom Function: it runs as itself
            w.key.append((OPAQUE, found.types))
            w.owned[i] = leave_to_node(node, info.raw_saved)
        return subclasses_too
    w.owned[i] = owned
    w.key.append(mask)
    positions = []
    for t in values:
        pos = w.add_input(t, "saved", i)
        positions.append(pos)
        w.key.append(w.tensor(t, pos, "among the saved tensors", node))
    rec.saved = tuple(positions)
    return True


def walk_subclass_values(w: Walk, rec: NodeRecord, i: int, node, info: TypeInfo) -> None:
    """A builtin node a tensor subclass reaches (saved, or its gradients): its saved
    variables are left to it.  The tracer traces the node through the subclass where it
    can: the graph then reads them from the node when it runs (runtime_ops.ReadSaved), and
    is valid for their layouts and contexts (a DTensor's placements and global shape) and
    for DTensor's dispatch state.  Those are one more size (SUBCLASS_LAYOUTS, an id:
    subclasses.layout_id), not part of the key: a static graph is found by its sizes, that
    one included, while a symbolic graph, where such nodes run as themselves, holds for
    any (its symbol unused).  Where the tracer cannot, the node runs as itself; what it
    hands on is checked where a traced formula takes it (a subclass gradient stops the
    graph there, and the rest of the backward runs node by node: run.continuation)."""
    w.key.append("subclass")
    if info.raw_saved:
        w.owned[i] = leave_to_node(node, info.raw_saved)
    rec.values[SUBCLASS_LAYOUTS] = (len(w.sizes), None)
    w.sizes.append(saved_layout_id(node, info.raw_saved, info.saved_tensors))


SUBCLASS_LAYOUTS = "_saved_subclass_layouts"  # the NodeRecord.values slot of a subclass node's layouts


def saved_layout_id(node, raw_attrs: tuple, tensor_attrs: tuple, a_subclass: bool = False) -> int | None:
    """The id (subclasses.layout_id) of the layouts of the node's saved values; the id of
    None where the user's saved-tensor hooks hold them
    (unpacking here would run them: the node runs as itself).  With ``a_subclass``: None
    unless one of them is a subclass (a cache-hit walker's check, for a node the capture
    found had one saved)."""
    if raw_attrs and foreign_hooks(node, raw_attrs):  # (a node that saved a subclass under them is walked otherwise)
        return None if a_subclass else subclasses.layout_id(None)
    layouts = saved_layouts(node, tensor_attrs)
    if a_subclass and all(layout is None or plain_type(layout[0]) for layout in layouts):
        return None
    return subclasses.layout_id(layouts)


def ctx_layout_id(node) -> int:
    """The id of what a traced backward of one of DTensor's Functions bakes in of its ctx
    (its global sizes among it)."""
    return subclasses.layout_id(traced_ctx_key(node))


def leave_saved(w: Walk, i: int, node) -> bool:
    """Leave an opaque custom Function's saved tensors to its node (see saved.Untouched);
    False if some carry hooks already (an earlier run's or the user's): walk_saved decides."""
    variables = node._raw_saved_tensors
    for var in variables:
        if var.unpack_hook is not None:
            return False
    node.saved_tensors  # eager's checks now, before anything runs: freed, modified in place
    w.owned[i] = Untouched(variables)
    w.key.append("untouched")
    return True


def native_offsets(node, info: TypeInfo):
    """Where the compiled part finds the node's saved variables (native/saved.cpp), or None
    where the Python lines read them: not loaded, a custom Function, a list of them."""
    reader = native.module()
    if reader is None or info.kind is not TRACED:
        return None
    raws = tuple(getattr(node, raw) for raw in info.raw_saved)
    if any(type(raw) is tuple for raw in raws):
        return None
    return reader.offsets(node, raws)


def emit_saved_check(src, i: int, node, info: TypeInfo, call) -> None:
    """Pass 1: read the saved tensors (eager's in-place check runs), check and size them."""
    mask = call.owned[i].mask
    offsets = native_offsets(node, info)
    if offsets is not None:  # the same reads and checks in one C++ call
        expected = []
        names = []
        k = 0
        for slot, defined in enumerate(mask):
            if not defined:
                expected.append(None)
                continue
            pos = call.records[i].saved[k]
            expected.append(_tensor_expected(call, pos, call.inputs[pos]))
            names.append(f"x{i}_{slot}")
            k += 1
        src.emit(f"xs = native_saved(n{i}, {src.const((offsets, tuple(expected)))}, sizes)")
        src.bail_unless("xs is not None")
        if names:
            src.emit(f"{', '.join(names)}, = xs")
        src.saved_names.setdefault(i, []).extend(names)
        return
    k = 0
    m = 0
    for slot, (raw, attr) in enumerate(zip(info.raw_saved, info.saved_tensors)):
        group = getattr(node, raw)
        if type(group) is tuple:
            src.emit(f"r{i}_{slot} = n{i}.{raw}")
            src.bail_unless(f"type(r{i}_{slot}) is tuple and len(r{i}_{slot}) == {len(group)} "
                            f"and not any_hooked(r{i}_{slot})")
            src.emit(f"g{i}_{slot} = n{i}.{attr}")
            for j in range(len(group)):
                var = f"x{i}_{slot}_{j}"
                src.emit(f"{var} = g{i}_{slot}[{j}]")
                k, m = _emit_saved_value(src, var, mask, m, i, call, k)
            continue
        src.emit(f"r{i}_{slot} = n{i}.{raw}")
        src.bail_unless(f"r{i}_{slot}.unpack_hook is None")  # ours from a retained run, or the user's
        var = f"x{i}_{slot}"
        src.emit(f"{var} = n{i}.{attr}")
        k, m = _emit_saved_value(src, var, mask, m, i, call, k)


def _emit_saved_value(src, var, mask, m, i, call, k):
    if not mask[m]:
        src.bail_unless(f"{var} is None")
        return k, m + 1
    pos = call.records[i].saved[k]
    src.bail_unless(f"{var} is not None")  # undefined now where it was saved before (index lists)
    emit_tensor(src, var, call, pos, call.inputs[pos])
    src.saved_names.setdefault(i, []).append(var)
    return k + 1, m + 1


def emit_saved_take(src, i: int, node, info: TypeInfo, call) -> None:
    """Pass 2 (every check passed): take the saved variables over."""
    mask = call.owned[i].mask
    offsets = native_offsets(node, info)
    if offsets is not None:  # read in pass 1 by the compiled part: left to the node (HeldByNode)
        src.emit(f"owned[{i}] = HeldByNode(n{i}, {src.const(offsets)}, {src.const(mask)})")
        return
    origin = Origin.of(node, info.saved_tensors, any(type(getattr(node, r)) is tuple for r in info.raw_saved))
    src.emit("o = SavedTensors()")
    m = 0
    for slot, raw in enumerate(info.raw_saved):
        group = getattr(node, raw)
        for j in range(len(group) if type(group) is tuple else 1):
            if mask[m]:
                var = f"r{i}_{slot}[{j}]" if type(group) is tuple else f"r{i}_{slot}"
                src.emit(f"{var}.register_hooks(o.tensors.append, partial(unpack, o, {sum(mask[:m])}))")
            m += 1
    src.emit(f"o.seal({src.const(mask)}, {src.const(origin)})")
    src.emit(f"owned[{i}] = o")


def _device_check(src, var: str, device) -> str:
    return f"{var}.is_cpu" if device.type == "cpu" else f"{var}.device == {src.const(device)}"


def _tensor_expected(call, pos: int, t) -> tuple:
    """What native/walk.cpp's tensor check compares: type, ndim, dtype, layout, device, contiguous."""
    _, ndim, stride_start = call.tensor_slots[pos]
    return (type(t), ndim, t.dtype, t.layout, t.device, stride_start < 0)


def emit_tensor(src, var: str, call, pos: int, t) -> None:
    """Check a tensor's structure and append its sizes as ``Walk.tensor`` does."""
    start, ndim, stride_start = call.tensor_slots[pos]
    if native.module() is not None:  # the same checks in one C++ call (capture/native/walk.cpp)
        src.bail_unless(f"native_tensor({var}, {src.const(_tensor_expected(call, pos, t))}, sizes)")
        return
    contiguous = "" if stride_start < 0 else "not "
    src.bail_unless(f"type({var}) is {src.const(type(t))}")  # a subclass: the generic walk falls back
    src.emit(f"sh = {var}.shape")
    src.bail_unless(f"len(sh) == {ndim} and {var}.dtype is {src.const(t.dtype)} and "
                    f"{var}.layout is {src.const(t.layout)} and {_device_check(src, var, t.device)} "
                    f"and {contiguous}{var}.is_contiguous()")
    src.emit("sizes += sh")
    if stride_start >= 0:
        src.emit(f"sizes += {var}.stride()")


# -- hooks ------------------------------------------------------------------------

def walk_hooks(w: Walk, rec: NodeRecord, i: int, node, var=None) -> None:
    """The node's hooks, in eager's order, as inputs; their shape to the key."""
    found = hooks.collect(node, var, w.retained.get(i, ()), w.hooks_active)
    if found is None:
        return
    spec = HookSpec()
    for nr, callables in found.tensor_pre:
        spec.tensor_pre.append((nr, [w.add_input(h, "hook", i) for h in callables]))
    for nr, tensor in found.retain:
        spec.retain.append((nr, w.add_input(tensor, "retained", i)))
    spec.pre = [w.add_input(h, "hook", i) for h in found.pre]
    spec.post = [w.add_input(h, "hook", i) for h in found.post]
    spec.post_incoming = tuple(map(hooks.hands_on_incoming, found.post))
    spec.post_accumulate = [w.add_input(h, "hook", i) for h in found.post_accumulate]
    spec.post_accumulate_alone = tuple(map(distributed.reducer_hook_alone, found.post_accumulate))
    if found.node is not None:
        spec.node = w.add_input(found.node, "node", i)
    spec.native_post = found.native_post
    rec.hooks = spec
    w.key.append(spec.key())


NATIVE_POST_ONLY = HookSpec(native_post=True).key()


def emit_hooks(src, i: int, rec: NodeRecord, var: str | None, subclass: bool = False) -> str | None:
    """Code that collects the node's hook inputs (a list variable) or checks it has none
    (``subclass``: the leaf ``var`` is a tensor subclass, its hooks read by leaf_hooks)."""
    expected = rec.hooks.key() if rec.hooks is not None else None
    leaf = var if var is not None else "None"
    call = f"collect(n{i}, {leaf}, retained.get({i}, ()), active)"
    # No hook anywhere and a leaf without tensor hooks: the common case stays cheap.
    if var is None:
        quiet = "not active"
    elif subclass:
        quiet = f"(not active and leaf_hooks({var}) == (None, None))"
    else:
        quiet = f"(not active and {var}._backward_hooks is None and {var}._post_accumulate_grad_hooks is None)"
    if expected is None:
        src.hook_check(False, f"if not ({quiet} or {call} is None): return None")
        return None
    if var is not None and expected == NATIVE_POST_ONLY:
        # C++ post-hooks alone (DDP's reducer, the common case under DDP; the walker's mask
        # check found them): the node is the one input, unless Python hooks came since.
        src.hook_check(True, f"if {quiet}:", f"    h{i} = [n{i}]", "else:", f"    h = {call}",
                       f"    if not (h is not None and h.key() == {src.const(expected)}): return None",
                       f"    h{i} = h.inputs()")
        return f"h{i}"
    src.hook_check(True, f"h = {call}", f"if not (h is not None and h.key() == {src.const(expected)}): return None",
                   f"h{i} = h.inputs()")
    return f"h{i}"


# -- nodes a tensor subclass reaches ------------------------------------------------

SUBCLASS_GRADS = "gradients of a tensor subclass"


def subclass_grads(node) -> bool:
    """Does the node take a tensor subclass's gradient?  Its input metadata says so, which
    only the compiled part reads (without it: False, and a subclass gradient that reaches
    a traced formula stops the graph there at run time)."""
    reader = native.module()
    return reader is not None and reader.subclass_inputs(node)


# -- the kinds ----------------------------------------------------------------------

class AccumulateKind:
    """A leaf's AccumulateGrad: the leaf (its sizes, whether it requires grad) and its hooks."""

    name = ACCUMULATE

    def walk(self, w: Walk, rec: NodeRecord, i: int, node, info: TypeInfo) -> str:
        var = node.variable
        if not plain_type(type(var)):
            # A subclass (DTensor, ExpandedWeight): its accumulator runs as itself, and
            # nothing is read through the leaf but its type and hooks (those without its
            # __torch_function__: hooks.leaf_hooks).
            return self.walk_subclass(w, rec, i, node, var)
        # An accumulator's one input has the leaf's shape and dtype: its metadata is
        # the leaf's own, so the leaf's sizes serve as the metadata's.
        rec.meta_start = len(w.sizes)
        structure = w.tensor(var, None, "as the leaf", node)
        if structure[1].type == "cuda":  # the stream it accumulates on (see stream_reason)
            _check_stream(node._input_metadata[0], node)
        w.key.append((structure, var.requires_grad, var.grad_dtype))
        rec.node_input = w.add_input(var, "variable", i)
        walk_hooks(w, rec, i, node, var)
        return ACCUMULATE

    def walk_subclass(self, w: Walk, rec: NodeRecord, i: int, node, var) -> str:
        """A leaf that is a tensor subclass (DTensor, ExpandedWeight): the accumulator runs
        as itself (the real node accumulates and calls the post-accumulate-grad hooks); its
        shape is read off its input metadata, nothing through the leaf but its type."""
        walk_metas(w, rec, node)
        w.key.append((OPAQUE, type(var)))
        rec.subclass = f"a tensor subclass ({type(var).__name__}) as the leaf"
        rec.node_input = w.add_input(node, "node", i)
        walk_hooks(w, rec, i, node, var)
        return OPAQUE

    def check(self, src, i, node, info, call) -> None:
        if call.records[i].kind is OPAQUE:  # a subclass leaf: its accumulator runs as itself
            emit_metas(src, f"n{i}", node)
            src.emit(f"v{i} = n{i}.variable")
            src.bail_unless(f"type(v{i}) is {src.const(type(node.variable))}")
            src.hook_lists[i] = emit_hooks(src, i, call.records[i], f"v{i}", subclass=True)
            return
        v = node.variable
        if native.module() is not None and v.device.type != "cuda":  # the reads below in one C++ call
            expected = ((type(v), v.dim(), v.dtype, v.layout, v.device, v.is_contiguous()), v.requires_grad,
                        v.grad_dtype)
            src.emit(f"v{i} = native_leaf(n{i}, {src.const(expected)}, sizes)")
            src.bail_unless(f"v{i} is not None")
            src.hook_lists[i] = emit_hooks(src, i, call.records[i], f"v{i}")
            return
        src.emit(f"v{i} = n{i}.variable")
        src.bail_unless(f"type(v{i}) is {src.const(type(v))} and v{i}.requires_grad is {v.requires_grad} "
                        f"and v{i}.grad_dtype is {src.const(v.grad_dtype)}")  # a subclass: see emit_tensor
        src.emit(f"sh = v{i}.shape")
        src.bail_unless(f"len(sh) == {v.dim()} and v{i}.dtype is {src.const(v.dtype)} "
                        f"and v{i}.layout is {src.const(v.layout)} and {_device_check(src, f'v{i}', v.device)} "
                        f"and v{i}.is_contiguous() is {v.is_contiguous()}")
        if v.device.type == "cuda":
            src.emit(f"mk = n{i}._input_metadata[0]")
            src.bail_unless(emit_stream(src, node._input_metadata[0]))
        src.emit("sizes += sh")
        if not v.is_contiguous():
            src.emit(f"sizes += v{i}.stride()")
        src.hook_lists[i] = emit_hooks(src, i, call.records[i], f"v{i}")

    def take(self, src, i, node, info, call) -> None:
        pass

    def inputs(self, src, i, call) -> list:
        return [f"n{i}"] if call.records[i].kind is OPAQUE else [f"v{i}"]


class TracedKind:
    """A builtin node: its metadata, saved values and tensors, the node itself, hooks."""

    name = TRACED

    def walk(self, w: Walk, rec: NodeRecord, i: int, node, info: TypeInfo) -> str:
        walk_metas(w, rec, node)
        walk_values(w, rec, node, info)
        if info.hidden:
            walk_hidden(w, rec, node)
        kind = TRACED
        if subclass_grads(node):
            # Gradients of a tensor subclass (DTensor's, under tensor parallelism): traced
            # through the subclass where the tracer can, else the node runs as itself.
            w.key.append(SUBCLASS_GRADS)
            walk_subclass_values(w, rec, i, node, info)
            rec.subclass = SUBCLASS_GRADS
        elif info.raw_saved and not walk_saved(w, rec, i, node, info, subclasses_too=True):
            kind = OPAQUE
        # The node itself is an input too: it runs opaquely if it cannot be traced on
        # fake tensors (and a placeholder nobody uses costs nothing).
        rec.node_input = w.add_input(node, "node", i)
        walk_hooks(w, rec, i, node)
        return kind

    def check(self, src, i, node, info, call) -> None:
        emit_metas(src, f"n{i}", node)
        emit_values(src, f"n{i}", node, info)
        if info.hidden:
            emit_hidden(src, i, call.records[i])
        if call.records[i].subclass == SUBCLASS_GRADS:
            src.bail_unless(f"subclass_grads(n{i})")
        if type(call.owned[i]) is ForeignOwned:  # under the user's saved-tensor hooks: opaque
            src.bail_unless(f"foreign_hooks(n{i}, {src.const(info.raw_saved)})")
        elif call.records[i].subclass is not None:  # a tensor subclass reaches it: walk_subclass_values
            src.emit(f"x = saved_layout_id(n{i}, {src.const(info.raw_saved)}, {src.const(info.saved_tensors)}, "
                     f"{call.records[i].subclass != SUBCLASS_GRADS})")
            src.bail_unless("x is not None")
            src.emit("sizes.append(x)")
        elif info.raw_saved:
            emit_saved_check(src, i, node, info, call)
        src.hook_lists[i] = emit_hooks(src, i, call.records[i], None)

    def take(self, src, i, node, info, call) -> None:
        if type(call.owned[i]) is ForeignOwned:
            src.emit(f"owned[{i}] = ForeignOwned(n{i})")
        elif type(call.owned[i]) is Untouched:
            src.emit(f"owned[{i}] = leave_to_node(n{i}, {src.const(info.raw_saved)})")
        elif info.raw_saved:
            emit_saved_take(src, i, node, info, call)

    def inputs(self, src, i, call) -> list:
        return src.saved_names.get(i, []) + [f"n{i}"]


class FunctionKind:
    """A custom autograd.Function's node: needs_input_grad, materialization, metadata,
    ctx attributes when its backward is traced, ctx.saved_tensors, the ctx, hooks."""

    name = FUNCTION

    def walk(self, w: Walk, rec: NodeRecord, i: int, node, info: TypeInfo) -> str:
        traceable = is_traceable(type(node))
        baked = traced_ctx_key(node) if traceable else None  # ctx attributes the traced formula bakes in
        traceable = baked is not None
        w.key.append((node.needs_input_grad, function_materializes(node), traceable))
        walk_metas(w, rec, node)
        if traceable and dtensor_function(type(node)):  # its ctx holds global sizes: see walk_subclass_values
            rec.values[SUBCLASS_LAYOUTS] = (len(w.sizes), None)
            w.sizes.append(ctx_layout_id(node))
        elif traceable:
            w.key.append(baked)
            ints = region_ints(node)
            if ints is not None:  # a compiled region's saved sizes
                rec.values[REGION_INTS] = (len(w.sizes), (None,) * len(ints))
                w.sizes.extend(ints)
        if getattr(node._forward_cls, "clear_saved_tensors_on_access", False):
            # Reading ctx.saved_tensors would free them (and leave the raw variables
            # dangling): the user's backward is the only one to read them.
            w.key.append(OPAQUE)
            owned = False
        elif not traceable and not w.take_functions and leave_saved(w, i, node):
            owned = False
        else:
            owned = walk_saved(w, rec, i, node, info)
        rec.node_input = w.add_input(node, "node", i)
        walk_hooks(w, rec, i, node)
        return FUNCTION if owned and traceable else OPAQUE

    def check(self, src, i, node, info, call) -> None:
        src.bail_unless(f"n{i}.needs_input_grad == {src.const(node.needs_input_grad)} "
                        f"and materializes(n{i}) is {function_materializes(node)}")
        emit_metas(src, f"n{i}", node)
        if is_traceable(type(node)):
            if dtensor_function(type(node)):
                src.emit(f"sizes.append(ctx_layout_id(n{i}))")
            else:
                src.bail_unless(f"traced_ctx_key(n{i}) == {src.const(traced_ctx_key(node))}")
            if REGION_INTS in call.records[i].values:
                src.emit(f"sizes += n{i}.symints")  # ints, as many as the key says
        owner = call.owned[i]
        if type(owner) is Untouched:  # left to the node, as leave_saved decided
            src.emit(f"r{i} = n{i}._raw_saved_tensors")
            src.bail_unless(f"not any_hooked(r{i})")
            src.emit(f"n{i}.saved_tensors")  # eager's checks (freed, modified in place) raise here
        elif type(owner) is ForeignOwned:
            src.bail_unless(f"foreign_hooks(n{i}, {src.const(info.raw_saved)})")
        elif owner is not None:  # taken over (None: clear_saved_tensors_on_access, never read)
            emit_saved_check(src, i, node, info, call)
        src.hook_lists[i] = emit_hooks(src, i, call.records[i], None)

    def checker(self, node, owner):
        """``check`` as one callable, for the one-call walk (walk_program): for a node that
        runs as itself with its saved tensors left to it (or never read), the callable
        takes a node object and answers False where the lines would bail, else the
        node's owner (True for none).  None for the other forms (traced, taken over,
        under the user's hooks), which the lines alone serve."""
        if is_traceable(type(node)) or (owner is not None and type(owner) is not Untouched):
            return None
        node_type, needs, materializes = type(node), node.needs_input_grad, function_materializes(node)
        untouched = owner is not None

        def check(n):
            if type(n) is not node_type or n.needs_input_grad != needs or function_materializes(n) is not materializes:
                return False
            if not untouched:
                return True
            raws = n._raw_saved_tensors
            if any_hooked(raws):
                return False
            n.saved_tensors  # eager's checks (freed, modified in place) raise here, as in the lines
            return Untouched(raws)
        return check

    def take(self, src, i, node, info, call) -> None:
        owner = call.owned[i]
        if type(owner) is Untouched:
            src.emit(f"owned[{i}] = Untouched(r{i})")
        elif type(owner) is ForeignOwned:
            src.emit(f"owned[{i}] = ForeignOwned(n{i})")
        elif owner is not None:
            emit_saved_take(src, i, node, info, call)

    def inputs(self, src, i, call) -> list:
        return src.saved_names.get(i, []) + [f"n{i}"]


KINDS = {ACCUMULATE: AccumulateKind(), TRACED: TracedKind(), FUNCTION: FunctionKind()}


def kind_of(node) -> tuple:
    """(the node type's spec, its TypeInfo)."""
    info = _type_info.get(type(node)) or type_info(type(node))
    return KINDS[info.kind], info


# -- hidden state (graph.hidden) ---------------------------------------------------

def hidden_state(node):
    """The hidden state of ``node`` (of a ``hidden.KEYED`` type) as (sizes, key): sizes that follow
    the data (nested tuples of ints, which go to the walk's sizes: guarded, or symbolic) and
    the rest, hashable, for the key.  None where the node must run as itself: the compiled
    part is not (yet) loaded, or see graph.hidden's doc."""
    reader = native.module()
    if reader is None:
        return None
    read = reader.hidden(node)
    if read is None:
        return None
    if type(node).__name__ != "CopySlices":
        return (), read  # rare ops: their hidden sizes stay in the key
    base, view, fn, replayed = read
    wrapped = _wrapped_key(fn)
    if replayed or wrapped is None:
        return None
    return (base[0], base[1], (base[2],), view[0], view[1], (view[2],)), wrapped


def _wrapped_key(fn):
    """A CopySlices' in-place node as a key (type, visible saved values), or None."""
    if fn is None:
        return None
    tp = type(fn)
    info = type_info(tp)
    if (info.kind != TRACED or info.raw_saved or tp.__name__ in RUN_REAL or tp.__name__ in hidden.KEYED
            or tp.__name__ == "CppFunction"):
        return None
    return (tp,) + tuple(value_key(getattr(fn, attr)) for attr in info.saved_values)
