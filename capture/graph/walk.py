"""One backward call, read off the live autograd graph.

``walk_backward`` does what ``Engine::execute`` does before it runs anything:
find the root edges, discover every node reachable from them and count its
dependencies, and (for ``autograd.grad`` / ``backward(inputs=...)``) work out which
nodes must run (eager's ``exec_info``).  On the way it builds

* the structure key: node types, edges, sequence-number order, saved non-tensor
  values, tensor dtypes/ranks/contiguity, hooks — never state such as whether a
  leaf's ``.grad`` is None;
* the sizes: every size-like int in one flat list (shapes, strides of
  non-contiguous tensors, metadata shapes, saved sizes), guarded or made symbolic
  by ``shapes``;
* the runtime inputs of the compiled graph: root gradients, saved tensors (taken
  over from the nodes, see ``graph.saved``), leaf tensors, node objects, hooks.

Backwards of a structure seen before take the walker that ``fast_walk``
generates for it instead; this generic walk discovers new structures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction

from . import distributed, hooks
from ..errors import _Fallback
from .saved import ForeignHooks, take_saved

TRACED, ACCUMULATE, OPAQUE, FUNCTION = "traced", "accumulate", "opaque", "function"


@dataclass(frozen=True)
class TypeInfo:
    """What gradfx needs to know about an autograd node type."""

    kind: str
    raw_saved: tuple[str, ...]  # `_raw_saved_x` attributes (SavedVariables)
    saved_tensors: tuple[str, ...]  # the matching `_saved_x` attributes
    saved_values: tuple[str, ...]  # other `_saved_x`: ints, floats, sizes, ...
    size_values: frozenset  # those of saved_values that hold sizes, strides or numels


_type_info: dict[type, TypeInfo] = {}

# Saved values whose names say they hold sizes: these may become symbolic.
_SIZE_WORDS = ("sizes", "strides", "numel", "argsize", "split_size")


class StructureKey:
    """A structure key with its hash computed once (the key is a long nested tuple)."""

    __slots__ = ("items", "_hash")

    def __init__(self, items: tuple):
        self.items = items
        self._hash = hash(items)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StructureKey) and self._hash == other._hash
                                 and self.items == other.items)


class _NodeMark(int):
    """Marks where a node's part of the cache key starts (for explaining misses)."""


def _flatten_sizes(value, out: list):
    """Append the ints of a size value (int, tuple of ints, list of tuples) to ``out``;
    return its layout (None for an int, else the nested lengths) for the key."""
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return tuple(_flatten_sizes(v, out) for v in value)
    out.append(value)
    return None


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
        sized = frozenset(v for v in values if any(w in v for w in _SIZE_WORDS))
        info = _type_info[node_type] = TypeInfo(kind, raw, tensors, values, sized)
    return info


def is_traceable(function_node_type: type) -> bool:
    """Is this custom Function's backward traced into the graph (see gradfx.traceable)?"""
    return bool(getattr(function_node_type._forward_cls, "_gradfx_traceable", False))


def function_materializes(ctx) -> bool:
    # ctx.materialize_grads cannot be read back from Python; set_materialize_grads
    # is wrapped (capture.trace.functions.install) to leave a readable copy.
    return ctx.__dict__.get("_gradfx_materialize_grads", True)


def _ctx_key(ctx) -> tuple:
    items = []
    for name, value in sorted(ctx.__dict__.items()):
        if isinstance(value, torch.Tensor):
            items.append((name, "tensor") + tensor_meta(value))
        else:
            items.append((name, _value_key(value)))
    return tuple(items)


def tensor_meta(t: torch.Tensor) -> tuple:
    return (t.dtype, t.shape, t.stride(), t.device, t.layout)


def _value_key(v):
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

    def key(self) -> tuple:
        return (tuple((nr, len(p)) for nr, p in self.tensor_pre), tuple(nr for nr, _ in self.retain),
                len(self.pre), len(self.post), len(self.post_accumulate))


@dataclass
class BackwardCall:
    """Everything about one backward call that tracing and running need."""

    nodes: list
    kinds: list
    edges: list  # per node: tuple of (child index, input_nr) or None
    seq: list  # per node: sequence number
    deps: list  # per node: number of incoming edges
    roots: list  # (node index, input_nr) per root tensor
    outputs: list | None  # autograd.grad: (node index, input_nr) or None per input
    accumulate: bool
    needed: list | None  # exec_info: per node, does it run
    captures: dict  # node index -> list of (input_nr, output position)
    owned: list  # per node: SavedTensors or None
    inputs: list  # runtime inputs, in graph-placeholder order
    input_kinds: list  # per input: "grad", "saved", "variable", "node"
    input_owner: list  # per input: node index (-1 for root grads)
    node_input: dict  # node index -> input position of its node object / leaf tensor
    hooks: dict  # node index -> HookSpec
    key: tuple  # the structure: everything but sizes
    sizes: list  # every size-like int (shapes, non-contiguous strides, saved sizes)
    tensor_slots: dict  # input position -> (shape start, ndim, stride start or -1 if contiguous)
    meta_slots: dict  # (node index, input_nr) -> start of that input's shape in sizes
    value_slots: dict  # (node index, attr) -> (start, layout) of a saved size value

    def __post_init__(self):
        self.walk_kinds = tuple(self.kinds)  # tracing may turn nodes opaque; kept for a retry

    def executed_ids(self) -> frozenset:
        """ids of the nodes this backward executes (for torch._C._will_engine_execute_node)."""
        if self.needed is None:
            return frozenset(id(n) for n in self.nodes)
        return frozenset(id(n) for i, n in enumerate(self.nodes) if self.needed[i] or i in self.captures)

    def node_label(self, i: int) -> str:
        n = self.nodes[i]
        return f"{n.name()} #{self.seq[i] if self.seq[i] < 2**63 else 'leaf'}"


def _root_edge(t: torch.Tensor):
    fn = t.grad_fn
    if fn is not None:
        return fn, t.output_nr
    if t.requires_grad:
        edge = torch.autograd.graph.get_gradient_edge(t)
        return edge.node, edge.output_nr
    return None, 0


def walk_backward(tensors, grads, inputs, accumulate: bool) -> BackwardCall:
    """Discover the graph of one backward call and collect its runtime inputs."""
    nodes: list = []
    index: dict[int, int] = {}
    roots = []
    for t in tensors:
        fn, nr = _root_edge(t)
        if fn is None:
            raise _Fallback("a root tensor does not require grad")  # eager raises
        j = index.get(id(fn))
        if j is None:
            j = index[id(fn)] = len(nodes)
            nodes.append(fn)
        roots.append((j, nr))

    edges: list = []
    deps = [0] * len(nodes)
    if len(roots) > 1:  # GraphRoot holds one edge per root
        for j, _ in roots:
            deps[j] += 1
    i = 0
    while i < len(nodes):
        es = []
        for child, nr in nodes[i].next_functions:
            if child is None:
                es.append(None)
                continue
            j = index.get(id(child))
            if j is None:
                j = index[id(child)] = len(nodes)
                nodes.append(child)
                deps.append(0)
            deps[j] += 1
            es.append((j, nr))
        edges.append(tuple(es))
        i += 1

    outputs = None
    needed = None
    captures: dict = {}
    if inputs:
        outputs = []
        for pos, t in enumerate(inputs):
            fn, nr = _root_edge(t)
            if fn is None:
                raise _Fallback("an input does not require grad")  # eager raises
            if accumulate and t.grad_fn is not None:
                raise _Fallback("backward(inputs=...) with a non-leaf input")
            j = index.get(id(fn))
            outputs.append(None if j is None else (j, nr))
            if j is not None and not accumulate:
                captures.setdefault(j, []).append((nr, pos))
        needed = _exec_info(edges, outputs, accumulate)

    hooks_seen = hooks.active()
    retained: dict[int, list] = {}
    if hooks_seen:
        for i, nr, tensor in hooks.retained_in(index):
            retained.setdefault(i, []).append((nr, tensor))

    n = len(nodes)
    seq = [node._sequence_nr() for node in nodes]
    order = sorted(range(n), key=seq.__getitem__)
    rank = [0] * n
    for r, j in enumerate(order):
        rank[j] = r

    if distributed.initialized():
        reason = distributed.cpp_hooks_reason(
            [node for node in nodes if type(node).__name__ == "AccumulateGrad"])
        if reason:
            raise _Fallback(reason)

    kinds = [None] * n
    owned = [None] * n
    run_inputs = list(grads)
    input_kinds = ["grad"] * len(grads)
    input_owner = [-1] * len(grads)
    node_input = {}
    hook_specs = {}

    sizes: list = []
    tensor_slots: dict = {}
    meta_slots: dict = {}
    value_slots: dict = {}

    def tensor_key(t, pos):
        # Structure of a tensor input; its sizes (and strides unless contiguous) go
        # to `sizes`, so that they can be guarded or made symbolic.
        start = len(sizes)
        sizes.extend(t.shape)
        if t.layout is not torch.strided:
            raise _Fallback(f"a {t.layout} tensor among the saved tensors, leaves or gradients")
        if t.is_contiguous():
            stride_start = -1
        else:
            stride_start = len(sizes)
            sizes.extend(t.stride())
        if pos is not None:
            tensor_slots[pos] = (start, t.dim(), stride_start)
        return (t.dtype, t.device, t.layout, t.dim(), stride_start < 0)

    def metas_key(i, node):
        out = []
        for nr, meta in enumerate(node._input_metadata):
            shape = meta.shape
            meta_slots[(i, nr)] = len(sizes)
            sizes.extend(shape)
            out.append((len(shape), meta.dtype, meta.device))
        return tuple(out)

    def value_key(i, attr, value):
        if attr in info_sizes:
            start = len(sizes)
            layout = _flatten_sizes(value, sizes)
            value_slots[(i, attr)] = (start, layout)
            return layout
        return _value_key(value)

    def add_input(value, kind, owner):
        run_inputs.append(value)
        input_kinds.append(kind)
        input_owner.append(owner)
        return len(run_inputs) - 1

    def own_saved(i, node, info) -> bool:
        """Take the node's saved tensors over as inputs; False if the user's hooks own them."""
        try:
            saved, mask = take_saved(node, info.raw_saved, info.saved_tensors)
        except ForeignHooks:
            key.append(OPAQUE)
            return False
        owned[i] = saved
        key.append(mask)
        for t in saved.tensors:
            key.append(tensor_key(t, add_input(t, "saved", i)))
        return True

    def add_hooks(i, node, var=None):
        spec = HookSpec()
        if var is not None:
            if var._backward_hooks:
                spec.tensor_pre.append((0, [add_input(h, "hook", i) for h in var._backward_hooks.values()]))
            if var._post_accumulate_grad_hooks:
                spec.post_accumulate = [add_input(h, "hook", i)
                                        for h in var._post_accumulate_grad_hooks.values()]
        recorded = hooks.node_hooks(node) if hooks_seen else None
        if recorded is not None:
            for nr, d in recorded.tensor_pre:
                spec.tensor_pre.append((nr, [add_input(h, "hook", i) for h in d.values()]))
            if recorded.pre:
                spec.pre = [add_input(h, "hook", i) for h in recorded.pre.values()]
            if recorded.post:
                spec.post = [add_input(h, "hook", i) for h in recorded.post.values()]
        for nr, tensor in retained.get(i, ()):
            spec.retain.append((nr, add_input(tensor, "retained", i)))
        if spec.tensor_pre or spec.retain or spec.pre or spec.post or spec.post_accumulate:
            hook_specs[i] = spec
            key.append(spec.key())
    key = [tuple(roots), tuple(outputs) if outputs is not None else None, accumulate]
    for k, g in enumerate(grads):
        key.append(tensor_key(g, k))
    for i, node in enumerate(nodes):
        runs = needed is None or needed[i]
        tnode = type(node)
        info = _type_info.get(tnode) or type_info(tnode)
        info_sizes = info.size_values
        kind = info.kind
        key.append(_NodeMark(i))
        key.append((tnode, edges[i], rank[i], runs))
        if not runs:
            if i in captures:  # tensor pre-hooks still run before the capture
                add_hooks(i, node, node.variable if kind is ACCUMULATE else None)
            continue
        if kind is ACCUMULATE:
            var = node.variable
            # An accumulator's one input has the leaf's shape and dtype: its metadata
            # is the leaf's own, so the leaf's sizes serve as the metadata's.
            meta_slots[(i, 0)] = len(sizes)
            key.append((tensor_key(var, None), var.requires_grad))
            node_input[i] = add_input(var, "variable", i)
            add_hooks(i, node, var)
        elif kind is TRACED:
            key.append(metas_key(i, node))
            for attr in info.saved_values:
                key.append(value_key(i, attr, getattr(node, attr)))
            if info.raw_saved and not own_saved(i, node, info):
                kind = OPAQUE
            # The node itself is an input too: it runs opaquely if it cannot be
            # traced on fake tensors (and a placeholder nobody uses costs nothing).
            node_input[i] = add_input(node, "node", i)
            add_hooks(i, node)
        else:  # FUNCTION
            traceable = is_traceable(tnode)
            key.append((node.needs_input_grad, function_materializes(node), traceable))
            key.append(metas_key(i, node))
            if traceable:  # ctx attributes are baked into the traced formula
                key.append(_ctx_key(node))
            kind = FUNCTION if own_saved(i, node, info) and traceable else OPAQUE
            node_input[i] = add_input(node, "node", i)
            add_hooks(i, node)
        kinds[i] = kind

    return BackwardCall(nodes, kinds, edges, seq, deps, roots, outputs, accumulate,
                        needed, captures, owned, run_inputs, input_kinds, input_owner,
                        node_input, hook_specs, StructureKey(tuple(key)), sizes, tensor_slots, meta_slots,
                        value_slots)


def _exec_info(edges, outputs, accumulate):
    """Per node: must it run (eager's ``needed_``).  Outputs that only capture don't."""
    n = len(edges)
    is_output = [False] * n
    for o in outputs:
        if o is not None:
            is_output[o[0]] = True
    # should_execute = is an output, or can reach one.  Edges point from a node to
    # nodes discovered later or earlier, so iterate to a fixed point over a
    # reverse topological order.
    order = _topo_order(edges)
    reach = [False] * n
    needed = [False] * n
    for i in reversed(order):
        child_reaches = any(e is not None and reach[e[0]] for e in edges[i])
        reach[i] = is_output[i] or child_reaches
        needed[i] = child_reaches or (accumulate and is_output[i])
    return needed


def _topo_order(edges):
    n = len(edges)
    indeg = [0] * n
    for es in edges:
        for e in es:
            if e is not None:
                indeg[e[0]] += 1
    ready = [i for i in range(n) if indeg[i] == 0]
    order = []
    while ready:
        i = ready.pop()
        order.append(i)
        for e in edges[i]:
            if e is not None:
                indeg[e[0]] -= 1
                if indeg[e[0]] == 0:
                    ready.append(e[0])
    return order
