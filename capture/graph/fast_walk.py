"""A walker generated for one graph structure: the cache-hit path.

The generic walk (``walk.walk_backward``) discovers an unknown graph and builds
its structure key.  Once a structure has a compiled graph, the next backward most
likely has exactly that structure, so gradfx generates straight-line Python
that *checks* the prediction while collecting what the graph needs, node by node
from the same specifications (``kinds``) the generic walk follows:

* roots, node types, edges (a new node or the same object as an earlier one),
  input numbers, the order of sequence numbers, the inputs of ``autograd.grad``;
* per node, its kind's checks: saved values, metadata, tensor structure, hooks;
* then, every check passed, the saved tensors are taken over, and the runtime
  inputs and sizes come out in the generic walk's order.

Any difference returns None and the generic walk runs instead, so a generated
walker can only be faster, never different.  Graphs with several roots, hooks,
``inputs=`` or distributed training take it too.  For structures of builtin nodes and
leaves (and the few custom Functions and tensor pre-hooks FSDP2 adds), the same walk
runs first as one C++ call (``walk_program``); these lines answer wherever it does not.
"""

from __future__ import annotations

import threading
from functools import cached_property, partial

from .. import native
from . import distributed, hidden, hooks, walk_program
from .kinds import (ACCUMULATE, ctx_layout_id, emit_hooks, emit_metas, emit_tensor, flatten_sizes,
                    function_materializes, hidden_state, kind_of, saved_layout_id, stream_ok, subclass_grads,
                    traced_ctx_key, value_key)
from .saved import (ForeignOwned, SavedTensors, Untouched, _unpack, any_hooked, foreign_hooks, leave_to_node,
                    readable)
from .walk import BackwardCall, root_edge, root_layout_id


class _Source:
    """Generated lines, the constants they refer to, and names per node."""

    def __init__(self):
        self.lines: list[str] = []
        self.consts: dict[str, object] = {}
        self._const_names: dict[int, str] = {}
        self.saved_names: dict[int, list] = {}  # node index -> variables of its saved tensors
        self.hook_lists: dict[int, str | None] = {}  # node index -> variable of its hook inputs
        self.hooked: list[str] = []  # hook lookups of nodes that had hooks (see hook_check)
        self.unhooked: list[str] = []

    def const(self, value) -> str:
        name = self._const_names.get(id(value))
        if name is None or self.consts[name] is not value:
            name = f"C{len(self.consts)}"
            self.consts[name] = value
            self._const_names[id(value)] = name
        return name

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def hook_check(self, hooked: bool, *lines: str) -> None:
        """Hook lookups run after every other check, those of the nodes that had hooks
        first: a lookup that finds every live node-hook dict spares the rest their probe
        (hooks.WalkState), and nothing in the first pass depends on their order."""
        (self.hooked if hooked else self.unhooked).extend("    " + line for line in lines)

    def bail_unless(self, cond: str) -> None:
        self.emit(f"if not ({cond}): return None")


def generate(call: BackwardCall, tensors, structure):
    """A walker for ``call``'s structure, or None if this kind of call has none."""
    records = call.records
    if any(t.grad_fn is None for t in tensors):
        return None  # leaf roots
    src = _Source()
    nodes = call.nodes
    n = len(nodes)

    # The call itself: backward or autograd.grad, how many roots and inputs (part of
    # the generic walk's key; a walker that skipped them would answer another call).
    n_inputs = 0 if call.outputs is None else len(call.outputs)
    src.bail_unless(f"accumulate is {call.accumulate} and len(tensors) == {len(call.roots)} "
                    f"and len(grads) == {len(call.roots)} and len(inputs) == {n_inputs}")
    # Roots, node types, edges and the sequence-number order: one C++ call where the
    # compiled part is loaded (native/structure.cpp), else the same checks in Python.
    seq = [nd._sequence_nr() for nd in nodes]
    order = sorted(range(n), key=seq.__getitem__)  # ties keep discovery order, as the stable sort does
    links = [(a, b, a >= b) for a, b in zip(order, order[1:])]  # seq[a] <= seq[b], < where a comes later
    plan = None
    if native.module() is not None:
        plan = (tuple(tuple(r) for r in call.roots), tuple(type(x) for x in nodes),
                tuple(tuple(None if e is None else tuple(e) for e in r.edges) for r in records), tuple(links))
        src.emit(f"found = native_structure(tensors, {src.const(native.module().compile_structure(plan))})")
        src.bail_unless("found is not None")
        src.emit("nodes, s = found")
        src.emit(f"{', '.join(f'n{i}' for i in range(n))}, = nodes")
    else:
        _emit_structure(src, call, nodes, links)

    if call.outputs is not None:  # autograd.grad / backward(inputs=): where each input's edge is
        for pos, out in enumerate(call.outputs):
            src.emit(f"fn, nr = edge(inputs[{pos}])")
            if call.accumulate:
                src.bail_unless(f"inputs[{pos}].grad_fn is None")
            if out is None:
                src.bail_unless("fn is not None and all(fn is not x for x in nodes)")
            else:
                src.bail_unless(f"fn is n{out[0]} and nr == {out[1]}")

    accumulators = [i for i in range(n) if records[i].kind is ACCUMULATE]
    if accumulators:  # DistributedDataParallel's C++ reducer hooks: where they were
        mask = tuple(records[i].hooks is not None and records[i].hooks.native_post for i in accumulators)
        src.bail_unless(f"not dist_initialized() or cpp_hooked_mask([{', '.join(f'n{i}' for i in accumulators)}])"
                        f" == {mask!r}")
    src.emit("active = hooks_active()")
    src.emit("retained = retained_by_node({id(x): k for k, x in enumerate(nodes)}) if active else {}")

    # Pass 1, per node: its kind's checks, sizes and reads; nothing taken over yet.
    src.emit("sizes = []")
    for k in range(len(call.roots)):
        src.emit(f"g{k} = grads[{k}]")
        if k in call.tensor_slots:
            emit_tensor(src, f"g{k}", call, k, call.inputs[k])
        else:  # a subclass, traced through (walk.root_layout_id)
            src.bail_unless(f"type(g{k}) is {src.const(type(call.inputs[k]))}")
            src.emit(f"sizes.append(root_layout_id(g{k}))")
    specs = {}
    for i, node in enumerate(nodes):
        rec = records[i]
        if not rec.runs:
            if i in call.captures:  # its metadata (as the generic walk reads it), and tensor
                emit_metas(src, f"n{i}", node)  # pre-hooks, which still run before the capture
                leaf = None
                if rec.kind is ACCUMULATE:
                    leaf = f"v{i}"
                    src.emit(f"{leaf} = n{i}.variable")
                    src.bail_unless(f"type({leaf}) is {src.const(type(node.variable))}")
                src.hook_lists[i] = emit_hooks(src, i, rec, leaf)
            continue
        spec, info = kind_of(node)
        specs[i] = (spec, info)
        spec.check(src, i, node, info, call)

    src.lines += src.hooked + src.unhooked

    # Pass 2: every check passed; take the saved tensors over, gather the inputs.
    src.emit(f"owned = [None] * {n}")
    for i, (spec, info) in specs.items():
        spec.take(src, i, nodes[i], info, call)
    inputs = [f"g{k}" for k in range(len(call.roots))]
    for i in range(n):
        if i in specs:
            inputs += specs[i][0].inputs(src, i, call)
        hook_list = src.hook_lists.get(i)
        if hook_list is not None:
            inputs.append(f"*{hook_list}")
    src.emit(f"inputs = [{', '.join(inputs)}]")
    src.emit("return nodes, owned, inputs, sizes, s")

    code = "def fast_walk(tensors, grads, inputs, accumulate):\n" + "\n".join(src.lines) + "\n"
    namespace = dict(src.consts, flatten=flatten_sizes, value_key=value_key, traced_ctx_key=traced_ctx_key,
                     materializes=function_materializes, SavedTensors=SavedTensors, Untouched=Untouched, HeldByNode=getattr(native.module(), "HeldByNode", None),
                     ForeignOwned=ForeignOwned, foreign_hooks=foreign_hooks, saved_layout_id=saved_layout_id, ctx_layout_id=ctx_layout_id, root_layout_id=root_layout_id,
                     leave_to_node=leave_to_node, subclass_grads=subclass_grads,
                     partial=partial, stream_ok=stream_ok, hidden_state=hidden_state, native_metas=_native('metas'), native_tensor=_native('tensor'),
                     native_structure=_native('structure'), native_saved=_native('saved'),
                     native_leaf=_native('leaf'),
                     unpack=_unpack, any_hooked=any_hooked, edge=root_edge,
                     collect=hooks.collect, hooks_active=hooks.active, leaf_hooks=hooks.leaf_hooks, retained_by_node=hooks.retained_by_node,
                     dist_initialized=distributed.initialized, cpp_hooked_mask=_accumulators_hooked)
    exec(compile(code, f"<gradfx fast walk {n} nodes>", "exec"), namespace)
    lines = namespace["fast_walk"]
    lines.source = code
    program = walk_program.plan(call, plan) if native.module() is not None else None
    walker = lines if program is None else _with_program(lines, program, call)
    walker.source = code
    walker.lines = lines
    walker.template = _template(call)
    walker.structure = structure
    return walker


def _with_program(lines, planned: tuple, call: BackwardCall):
    """The walker that runs the whole walk as one C++ call (walk_program), its lines where
    that answers None and wherever hooks other than tensor pre-hooks may be live."""
    run = _native("program")
    program, foreign, alone, tensor_hooked = planned
    reducer_hook_alone = distributed.reducer_hook_alone
    tensor_pre_of_walk = hooks.tensor_pre_of_walk
    roots = len(call.roots)
    hooked_nodes = {i for i, _, _ in tensor_hooked}
    pre, retained, node_dicts = hooks.none_possible()

    def fast_walk(tensors, grads, inputs, accumulate):
        if (accumulate is True and len(tensors) == roots and len(grads) == roots and not inputs
                and not (retained or node_dicts) and (pre or not tensor_hooked)):
            found = run(tensors, grads, program)
            if found is False:  # the lines would refuse it for sure (program.cpp says when)
                return None
            if found is not None:
                if alone:  # the key's part the call leaves to Python (walk_program.plan)
                    hooks_in = found[2]
                    for k, expected in alone:
                        if reducer_hook_alone(hooks_in[k]) is not expected:
                            return lines(tensors, grads, inputs, accumulate)
                if pre:  # tensor pre-hooks: on the expected nodes alone, of the expected shape
                    live = tensor_pre_of_walk(found[0], found[4])
                    if live.keys() != hooked_nodes:
                        return lines(tensors, grads, inputs, accumulate)
                    filled = found[2]
                    for i, key, start in tensor_hooked:
                        hooked = live[i]
                        if tuple((nr, len(c)) for nr, c in hooked) != key:
                            return lines(tensors, grads, inputs, accumulate)
                        for _, callables in hooked:
                            filled[start:start + len(callables)] = callables
                            start += len(callables)
                if foreign:  # hooked saved tensors: the user's (not gradfx's, not released)?
                    nodes, owned = found[0], found[1]
                    for i, raws in foreign:
                        node = nodes[i]
                        if not foreign_hooks(node, raws):
                            return lines(tensors, grads, inputs, accumulate)
                        owned[i] = ForeignOwned(node)
                return found
        return lines(tensors, grads, inputs, accumulate)
    fast_walk.program = program
    return fast_walk


def _emit_structure(src: _Source, call: BackwardCall, nodes, links) -> None:
    """The Python form of native/structure.cpp: roots, then discovery in the generic walk's
    order (each edge a new node or an old one), then the sequence-number order."""
    records = call.records
    n = len(nodes)
    named = set()
    for k, (j, nr) in enumerate(call.roots):
        src.emit(f"t = tensors[{k}]")
        if j in named:
            src.bail_unless(f"t.grad_fn is n{j} and t.output_nr == {nr}")
            continue
        named.add(j)
        src.emit(f"n{j} = t.grad_fn")
        src.bail_unless(f"n{j} is not None and type(n{j}) is {src.const(type(nodes[j]))} "
                        f"and t.output_nr == {nr}")
    seen = len(named)
    for i in range(n):
        src.emit(f"nf = n{i}.next_functions")
        src.bail_unless(f"len(nf) == {len(records[i].edges)}")
        for k, e in enumerate(records[i].edges):
            if e is None:
                src.bail_unless(f"nf[{k}][0] is None")
                continue
            j, nr = e
            if j == seen:  # first sighting
                src.emit(f"n{j}, nr = nf[{k}]")
                src.bail_unless(f"type(n{j}) is {src.const(type(nodes[j]))} and nr == {nr}")
                seen += 1
            else:
                src.bail_unless(f"nf[{k}][0] is n{j} and nf[{k}][1] == {nr}")
    src.emit(f"nodes = [{', '.join(f'n{i}' for i in range(n))}]")
    src.bail_unless(f"len(set(map(id, nodes))) == {n}")  # no predicted-new node was an old one

    src.emit("s = [x._sequence_nr() for x in nodes]")
    chain = [f"s[{a}] {'<' if strict else '<='} s[{b}]" for a, b, strict in links]
    if chain:
        src.bail_unless(" and ".join(chain))


def _native(name: str):
    """A check of the compiled part (kinds emits it where the part is loaded)."""
    reader = native.module()
    return None if reader is None else getattr(reader, name)


def _accumulators_hooked(accumulators) -> tuple:
    if native.module() is None:
        for node in accumulators:  # the probe runs ops on the leaves: the generic walk's fallback
            readable(node.variable, "as the leaf", node)
    return distributed.cpp_hooked_mask(accumulators)


def _template(call: BackwardCall) -> type:
    """A class for ``call``'s structure: a BackwardCall subclass that holds what every
    backward of the structure shares, so that a new backward's call sets only its own
    parts (``instantiate``).  Without the live parts: a walker must not keep a graph (or,
    after a retain_graph backward, its saved tensors) alive."""
    shared = dict(getattr(type(call), "_shared", {}))  # ``call`` may itself be a walker's
    shared.update(call.__dict__)
    for live in ("nodes", "owned", "inputs", "sizes", "seq", "kinds"):
        shared.pop(live, None)
    shared["walk_kinds"] = tuple(r.kind for r in call.records)
    # The walker sets an owner exactly where the generic walk had one (kinds' take).
    shared["owner_indices"] = tuple(i for i, o in enumerate(call.owned) if o is not None)
    return type("WalkedCall", (BackwardCall,), {**shared, "_shared": shared, "kinds": _kinds})


# Only tracing reads (and changes) a call's kinds: made for a call when first asked for.
_kinds = cached_property(lambda call: list(call.walk_kinds))
_kinds.__set_name__(BackwardCall, "kinds")


def instantiate(template: type, nodes, owned, inputs, sizes, seq) -> BackwardCall:
    """A BackwardCall for a new backward of the template's structure."""
    call = object.__new__(template)
    call.nodes, call.owned, call.inputs, call.sizes, call.seq = nodes, owned, inputs, sizes, seq
    return call


class Walkers:
    """Generated walkers by root node type, most recently used first (bounded).

    A walker lives while its structure has a cached graph: the cache calls
    :meth:`forget` when it evicts a structure's last entry.
    """

    def __init__(self, per_root: int = 8):
        self.per_root = per_root
        self._by_root: dict = {}
        self._where: dict = {}  # structure -> its (root type, config) list key
        self._lock = threading.Lock()  # threads add and forget walkers (candidates reads)
        self.find = self._by_root.get  # the dict is kept (cleared, never replaced)

    def candidates(self, root_type, config) -> list:
        return self._by_root.get((root_type, config), ())


    def add(self, root_type, config, walker) -> None:
        key = (root_type, config)
        with self._lock:
            found = list(self._by_root.get(key, ()))
            found.insert(0, walker)
            self._where[walker.structure] = key
            for dropped in found[self.per_root:]:
                self._where.pop(dropped.structure, None)
            self._by_root[key] = found[:self.per_root]  # a new list: candidates() may iterate the old

    def forget(self, structure) -> None:
        with self._lock:
            key = self._where.pop(structure, None)
            if key is None:
                return
            found = [w for w in self._by_root.get(key, ()) if w.structure != structure]
            if found:
                self._by_root[key] = found
            else:
                self._by_root.pop(key, None)

    def clear(self) -> None:
        with self._lock:
            self._by_root.clear()
            self._where.clear()

    def __len__(self) -> int:
        return sum(map(len, self._by_root.values()))


walkers = Walkers()
