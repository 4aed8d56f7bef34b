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

from dataclasses import dataclass

import torch

from .. import native
from ..errors import _Fallback
from . import distributed, subclasses
from .kinds import ACCUMULATE, NodeRecord, Walk, kind_of, walk_hooks, walk_metas
from .saved import readable

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


@dataclass
class BackwardCall:
    """One backward call: what holds for its structure, and what this call brings.

    For the structure (shared by every backward a generated walker accepts):
    ``records`` (one :class:`NodeRecord` per node), roots, outputs and captures of
    ``autograd.grad``, where each input comes from, the key.  For this call:
    the live nodes, their sequence numbers, the saved tensors taken over, the
    runtime inputs and the sizes.
    """

    records: list  # per node: NodeRecord
    roots: list  # (node index, input_nr) per root tensor
    outputs: list | None  # autograd.grad: (node index, input_nr) or None per input
    accumulate: bool
    captures: dict  # node index -> list of (input_nr, output position)
    input_kinds: list  # per input: "grad", "saved", "variable", "node", "hook", "retained"
    input_owner: list  # per input: node index (-1 for root grads)
    tensor_slots: dict  # input position -> (shape start, ndim, stride start or -1 if contiguous)
    key: StructureKey  # the structure: everything but sizes
    # this call
    nodes: list
    seq: list  # per node: sequence number
    owned: list  # per node: SavedTensors or None
    inputs: list  # runtime inputs, in graph-placeholder order
    sizes: list  # every size-like int (shapes, non-contiguous strides, saved sizes)
    create_graph: bool = False  # the graph records its own autograd history (double backward)
    owner_indices: tuple | None = None  # the nodes with an owner in ``owned`` (a walker's: fixed)

    def __post_init__(self):
        # Tracing may turn a node opaque; the records keep the kind as walked (for a retry).
        self.kinds = [r.kind for r in self.records]

    @property
    def hooks(self) -> dict:
        """node index -> HookSpec, for the nodes that have hooks."""
        return {i: r.hooks for i, r in enumerate(self.records) if r.hooks is not None}

    def value_slots(self):
        """((node index, attribute), (start in sizes, layout)) of every saved size value."""
        for i, r in enumerate(self.records):
            for attr, slot in r.values.items():
                yield (i, attr), slot

    def meta_slots(self):
        """((node index, input_nr), start in sizes) of every input metadata shape."""
        for i, r in enumerate(self.records):
            if r.meta_start is None:
                continue
            start = r.meta_start
            for nr, meta in enumerate(self.nodes[i]._input_metadata):
                yield (i, nr), start
                start += len(meta.shape)

    def executed_ids(self) -> frozenset:
        """ids of the nodes this backward executes (for torch._C._will_engine_execute_node)."""
        return frozenset(id(n) for i, n in enumerate(self.nodes) if self.records[i].runs or i in self.captures)

    def node_label(self, i: int) -> str:
        n = self.nodes[i]
        return f"{n.name()} #{self.seq[i] if self.seq[i] < 2**63 else 'leaf'}"


def root_edge(t: torch.Tensor):
    """(node, input_nr) of the gradient edge of a root or input tensor."""
    fn = t.grad_fn
    if fn is not None:
        return fn, t.output_nr
    if t.requires_grad:
        try:
            edge = torch.autograd.graph.get_gradient_edge(t)
        except (NotImplementedError, RuntimeError) as err:  # e.g. a sparse leaf: no view to find it through
            raise _Fallback(f"a {t.layout} leaf as a root or input ({type(err).__name__})") from None
        return edge.node, edge.output_nr
    return None, 0


def discover(tensors):
    """Engine::execute's discovery: nodes (roots first, then breadth first), their
    edges and dependency counts, and the root edges."""
    nodes: list = []
    index: dict[int, int] = {}
    roots = []
    for t in tensors:
        fn, nr = root_edge(t)
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
    return nodes, index, roots, edges, deps


def find_outputs(inputs, index, accumulate: bool):
    """For ``autograd.grad(inputs=)`` / ``backward(inputs=)``: per input, its edge in
    the graph (or None), and which nodes capture a gradient for the result."""
    outputs = []
    captures: dict = {}
    for pos, t in enumerate(inputs):
        fn, nr = root_edge(t)
        if fn is None:
            raise _Fallback("an input does not require grad")  # eager raises
        if accumulate and t.grad_fn is not None:
            raise _Fallback("backward(inputs=...) with a non-leaf input")
        j = index.get(id(fn))
        outputs.append(None if j is None else (j, nr))
        if j is not None and not accumulate:
            captures.setdefault(j, []).append((nr, pos))
    return outputs, captures


def root_layout_id(g) -> int:
    """The id of what a graph traced through a subclass root gradient bakes in of it: one
    more size, as for a node a subclass reaches (kinds.walk_subclass_values)."""
    return subclasses.layout_id(subclasses.layout(g))


def walk_backward(tensors, grads, inputs, accumulate: bool, create_graph: bool = False,
                  take_functions: bool = True) -> BackwardCall:
    """Discover the graph of one backward call and collect its runtime inputs.

    ``take_functions``: take opaque custom Functions' saved tensors over (for a
    backend that inlines their backward) rather than leave them to the node."""
    nodes, index, roots, edges, deps = discover(tensors)
    outputs, captures, needed = None, {}, None
    if inputs:
        outputs, captures = find_outputs(inputs, index, accumulate)
        needed = _exec_info(edges, outputs, accumulate)

    n = len(nodes)
    seq = [node._sequence_nr() for node in nodes]
    order = sorted(range(n), key=seq.__getitem__)
    rank = [0] * n
    for r, j in enumerate(order):
        rank[j] = r

    if distributed.initialized() and native.module() is None:  # C++ hooks gradfx could not run
        accumulators = [node for node in nodes if type(node).__name__ == "AccumulateGrad"]
        for node in accumulators:  # the probe runs ops on the leaves
            readable(node.variable, "as the leaf", node)
        reason = distributed.cpp_hooks_reason(accumulators)
        if reason:
            raise _Fallback(reason)

    w = Walk(grads, index)
    w.take_functions = take_functions
    w.key += [tuple(roots), tuple(outputs) if outputs is not None else None, accumulate, create_graph]
    for k, g in enumerate(grads):
        layout = None if type(g) in (torch.Tensor, torch.nn.Parameter) else subclasses.layout(g)
        if layout is None or len(layout) == 1:
            w.key.append(w.tensor(g, k, "as a root's gradient"))  # (another subclass falls back)
        else:  # traced through where a static trace can (a DTensor loss's, under loss_parallel)
            w.key.append(("subclass", type(g)))
            w.sizes.append(subclasses.layout_id(layout))
    records = []
    for i, node in enumerate(nodes):
        runs = needed is None or needed[i]
        spec, info = kind_of(node)
        rec = NodeRecord(info.kind, edges[i], deps[i], runs)
        records.append(rec)
        w.key.append(_NodeMark(i))
        w.key.append((type(node), edges[i], rank[i], runs))
        if runs:
            rec.kind = spec.walk(w, rec, i, node, info)
        elif i in captures:  # tensor pre-hooks still run before the capture
            walk_metas(w, rec, node)  # what the gradients captured there are validated against
            leaf = _captured_leaf(node) if info.kind is ACCUMULATE else None
            walk_hooks(w, rec, i, node, leaf)
    owned = [w.owned.get(i) for i in range(n)]
    return BackwardCall(records, roots, outputs, accumulate, captures, w.input_kinds, w.input_owner,
                        w.tensor_slots, StructureKey(tuple(w.key)), nodes, seq, owned, w.inputs, w.sizes,
                        create_graph)


def _captured_leaf(node):
    """The leaf of an accumulator autograd.grad captures at: a plain tensor, or a subclass
    traced through (a DTensor parameter: only its hooks are read, past nothing)."""
    leaf = node.variable
    if subclasses.traceable(type(leaf)):
        return leaf
    return readable(leaf, "as the leaf", node)


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
