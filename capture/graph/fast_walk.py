"""A walker generated for one graph structure: the cache-hit path.

The generic walk (``walk.walk_backward``) discovers an unknown graph and builds
its structure key.  Once a structure has a compiled graph, backwards of the same
structure do not need discovery: the next backward most likely has exactly that
structure.  For it gradfx generates straight-line Python that *checks* the
prediction while collecting what the graph needs:

* node types, edges (new node or the same object as an earlier one), input
  numbers, the order of sequence numbers;
* saved non-tensor values, tensor dtypes/devices/layouts/ranks, metadata;
* then takes the saved tensors over and gathers the runtime inputs and sizes in
  the generic walk's order.

Any difference returns None and the generic walk runs instead, so a generated
walker can only be faster, never different: for a graph it accepts, it returns
exactly what the generic walk would.  Graphs with hooks, ``inputs=``, several
roots or distributed training take the generic walk.
"""

from __future__ import annotations

from . import hooks
from .saved import Origin, SavedTensors, take_saved
from .walk import ACCUMULATE, FUNCTION, BackwardCall, _flatten_sizes, _value_key, function_materializes, \
    is_traceable, type_info


class _Source:
    """Accumulates generated lines with indentation."""

    def __init__(self):
        self.lines: list[str] = []
        self.consts: dict[str, object] = {}

    def const(self, value) -> str:
        for name, v in self.consts.items():
            if v is value:
                return name
        name = f"C{len(self.consts)}"
        self.consts[name] = value
        return name

    def emit(self, line: str) -> None:
        self.lines.append("    " + line)

    def bail_unless(self, cond: str) -> None:
        self.emit(f"if not ({cond}): return None")


def _device_check(src: _Source, var: str, device) -> str:
    return f"{var}.is_cpu" if device.type == "cpu" else f"{var}.device == {src.const(device)}"


def _tensor_check(src: _Source, var: str, call: BackwardCall, pos: int, t) -> None:
    """Check a tensor's structure and append its sizes as the generic walk does."""
    start, ndim, stride_start = call.tensor_slots[pos]
    contiguous = "" if stride_start < 0 else "not "
    src.emit(f"sh = {var}.shape")
    src.bail_unless(f"len(sh) == {ndim} and {var}.dtype is {src.const(t.dtype)} and "
                    f"{var}.layout is {src.const(t.layout)} and {_device_check(src, var, t.device)} "
                    f"and {contiguous}{var}.is_contiguous()")
    src.emit("sizes += sh")
    if stride_start >= 0:
        src.emit(f"sizes += {var}.stride()")


def _read_saved(src: _Source, i: int, node, info, mask, call: BackwardCall, positions) -> bool:
    """Pass 1 for a node's saved tensors: read, check and size them (nothing taken yet).

    Reading ``node._saved_x`` before gradfx's hooks are installed runs eager's
    in-place-modification check.  Returns False for nodes whose saved values
    come in groups (lists of tensors): those go through ``take_saved`` in pass 2.
    """
    groups = [getattr(node, raw) for raw in info.raw_saved]
    if any(type(g) is tuple for g in groups):
        for p in positions:  # placeholders, filled in pass 2
            start, ndim, stride_start = call.tensor_slots[p]
            src.emit(f"sizes += {src.const((0,) * (ndim if stride_start < 0 else 2 * ndim))}")
        return False
    k = 0
    for slot, (raw, attr) in enumerate(zip(info.raw_saved, info.saved_tensors)):
        src.emit(f"r{i}_{slot} = n{i}.{raw}")
        src.bail_unless(f"r{i}_{slot}.unpack_hook is None")  # ours from a retained run, or the user's
        src.emit(f"x{i}_{slot} = n{i}.{attr}")
        if not mask[slot]:
            src.bail_unless(f"x{i}_{slot} is None")
            continue
        p = positions[k]
        k += 1
        _tensor_check(src, f"x{i}_{slot}", call, p, call.inputs[p])
    return True


def _own_saved(src: _Source, i: int, node, info, mask, read: bool) -> list[str]:
    """Pass 2: take the saved tensors over; returns the names of the graph inputs."""
    if not read:  # the caller sizes what take_saved collected
        src.emit(f"o, mask = take_saved(n{i}, {src.const(info.raw_saved)}, {src.const(info.saved_tensors)})")
        src.bail_unless(f"mask == {src.const(mask)}")
        return []
    src.emit("o = SavedTensors()")
    names = []
    for slot in range(len(info.raw_saved)):
        if mask[slot]:
            src.emit(f"r{i}_{slot}.register_hooks(*o.hooks())")
            names.append(f"x{i}_{slot}")
    origin = Origin.of(node, info.saved_tensors, False)
    src.emit(f"o.seal({src.const(mask)}, {src.const(origin)})")
    return names


def _metas_check(src: _Source, node: str, live_node) -> None:
    metas = live_node._input_metadata
    src.emit(f"m = {node}._input_metadata")
    src.bail_unless(f"len(m) == {len(metas)}")
    for k, meta in enumerate(metas):
        src.emit(f"sh = m[{k}].shape")
        src.bail_unless(f"len(sh) == {len(meta.shape)} and m[{k}].dtype is {src.const(meta.dtype)} "
                        f"and m[{k}].device == {src.const(meta.device)}")
        src.emit("sizes += sh")


def generate(call: BackwardCall, tensors, structure):
    """A walker for ``call``'s structure, or None if this kind of call has none."""
    if (len(call.roots) != 1 or call.outputs is not None or call.hooks
            or any(k is None for k in call.kinds)):
        return None
    src = _Source()
    nodes = call.nodes
    n = len(nodes)
    if tensors[0].grad_fn is None:
        return None
    (root, root_nr), = call.roots
    src.emit("t = tensors[0]")
    src.emit("n0 = t.grad_fn")
    src.bail_unless(f"n0 is not None and type(n0) is {src.const(type(nodes[0]))} "
                    f"and t.output_nr == {root_nr}")

    # Discovery, in the generic walk's order: each edge is a new node or an old one.
    seen = 1
    for i in range(n):
        src.emit(f"nf = n{i}.next_functions")
        src.bail_unless(f"len(nf) == {len(call.edges[i])}")
        for k, e in enumerate(call.edges[i]):
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
    node_list = ", ".join(f"n{i}" for i in range(n))
    src.emit(f"nodes = [{node_list}]")
    src.bail_unless(f"len(set(map(id, nodes))) == {n}")  # no predicted-new node was an old one
    src.bail_unless("not hooks_active() or hooks_none_on(nodes)")

    # Sequence-number order (ties keep discovery order, as the stable sort does).
    seq = [nd._sequence_nr() for nd in nodes]
    order = sorted(range(n), key=seq.__getitem__)
    src.emit("s = [x._sequence_nr() for x in nodes]")
    chain = []
    for a, b in zip(order, order[1:]):
        chain.append(f"s[{a}] {'<=' if a < b else '<'} s[{b}]")
    if chain:
        src.bail_unless(" and ".join(chain))

    # Per node: leaf hooks, values, metadata (before anything is taken over).  Saved
    # tensors' sizes get placeholders here and are filled in once taken over, so
    # `sizes` has the generic walk's order.
    src.emit("sizes = []")
    src.emit("g = grads[0]")
    _tensor_check(src, "g", call, 0, call.inputs[0])
    saved_positions = {i: [p for p, (kind, owner) in enumerate(zip(call.input_kinds, call.input_owner))
                           if kind == "saved" and owner == i] for i in range(n)}
    read: dict[int, bool] = {}
    for i, node in enumerate(nodes):
        kind = call.walk_kinds[i]
        info = type_info(type(node))
        var = f"n{i}"
        if kind is ACCUMULATE:
            v = node.variable
            src.emit(f"v{i} = {var}.variable")
            src.bail_unless(f"v{i}._backward_hooks is None and v{i}._post_accumulate_grad_hooks is None "
                            f"and v{i}.requires_grad is {v.requires_grad}")
            src.emit(f"sh = v{i}.shape")
            src.bail_unless(f"len(sh) == {v.dim()} and v{i}.dtype is {src.const(v.dtype)} "
                            f"and v{i}.layout is {src.const(v.layout)} and {_device_check(src, f'v{i}', v.device)} "
                            f"and v{i}.is_contiguous() is {v.is_contiguous()}")
            src.emit("sizes += sh")
            if not v.is_contiguous():
                src.emit(f"sizes += v{i}.stride()")
            continue
        if info.raw_saved and call.owned[i] is None:
            return None  # saved tensors under the user's hooks: generic walk
        if info.kind is FUNCTION:
            if kind is FUNCTION:
                return None  # a traced custom Function keys its ctx: generic walk
            src.bail_unless(f"{var}.needs_input_grad == {src.const(node.needs_input_grad)} "
                            f"and materializes({var}) is {function_materializes(node)} "
                            f"and not is_traceable(type({var}))")
            _metas_check(src, var, node)
        else:
            _metas_check(src, var, node)
            for attr in info.saved_values:
                value = getattr(node, attr)
                if attr in info.size_values:
                    layout = _flatten_sizes(value, [])
                    if layout is None:  # one int
                        src.emit(f"x = {var}.{attr}")
                        src.bail_unless("type(x) is int")
                        src.emit("sizes.append(x)")
                    elif isinstance(layout, tuple) and all(e is None for e in layout):  # flat sizes
                        src.emit(f"x = {var}.{attr}")
                        src.bail_unless(f"type(x) is tuple and len(x) == {len(layout)}")
                        src.emit("sizes += x")
                    else:
                        src.bail_unless(f"flatten({var}.{attr}, sizes) == {src.const(layout)}")
                else:
                    src.bail_unless(f"value_key({var}.{attr}) == {src.const(_value_key(value))}")
        if call.owned[i] is not None:
            read[i] = _read_saved(src, i, node, info, call.owned[i].mask, call, saved_positions[i])

    # Every check passed: take the saved tensors over, then build the inputs in the
    # generic walk's order.
    src.emit(f"owned = [None] * {n}")
    inputs = ["g"]
    for i, node in enumerate(nodes):
        if call.walk_kinds[i] is ACCUMULATE:
            inputs.append(f"v{i}")
            continue
        owned = call.owned[i]
        if owned is not None:
            names = _own_saved(src, i, node, type_info(type(node)), owned.mask, read[i])
            src.emit(f"owned[{i}] = o")
            if not read[i]:  # grouped saved tensors: size them now
                for k, p in enumerate(saved_positions[i]):
                    start, ndim, stride_start = call.tensor_slots[p]
                    t = call.inputs[p]
                    src.emit(f"x = o.tensors[{k}]")
                    src.emit("sh = x.shape")
                    src.bail_unless(f"len(sh) == {ndim} and x.dtype is {src.const(t.dtype)} and x.layout is "
                                    f"{src.const(t.layout)} and {_device_check(src, 'x', t.device)} "
                                    f"and x.is_contiguous() is {stride_start < 0}")
                    src.emit(f"sizes[{start}:{start + ndim}] = sh")
                    if stride_start >= 0:
                        src.emit(f"sizes[{stride_start}:{stride_start + ndim}] = x.stride()")
                    src.emit(f"x{i}_g{k} = x")
                names = [f"x{i}_g{k}" for k in range(len(saved_positions[i]))]
            inputs.extend(names)
        inputs.append(f"n{i}")
    src.emit(f"inputs = [{', '.join(inputs)}]")
    src.emit("return nodes, owned, inputs, sizes, s")

    code = "def fast_walk(tensors, grads):\n" + "\n".join(src.lines) + "\n"
    namespace = dict(src.consts, take_saved=take_saved, flatten=_flatten_sizes, value_key=_value_key,
                     materializes=function_materializes, is_traceable=is_traceable,
                     SavedTensors=SavedTensors,
                     hooks_active=hooks.active, hooks_none_on=hooks.none_on)
    exec(compile(code, f"<gradfx fast walk {len(nodes)} nodes>", "exec"), namespace)
    walker = namespace["fast_walk"]
    walker.source = code
    walker.template = _template(call)
    walker.structure = structure
    return walker


def _template(call: BackwardCall) -> BackwardCall:
    """``call`` without its live parts: a walker must not keep a graph (or, after a
    retain_graph backward, its saved tensors) alive."""
    template = BackwardCall.__new__(BackwardCall)
    template.__dict__.update(call.__dict__)
    template.nodes = template.owned = template.inputs = template.sizes = template.seq = None
    template.hooks = {}
    return template


def instantiate(template: BackwardCall, nodes, owned, inputs, sizes, seq) -> BackwardCall:
    """A BackwardCall for a new backward of the template's structure."""
    call = BackwardCall.__new__(BackwardCall)
    call.__dict__.update(template.__dict__)
    call.nodes, call.owned, call.inputs, call.sizes, call.seq = nodes, owned, inputs, sizes, seq
    call.kinds = list(template.walk_kinds)
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

    def candidates(self, root_type, config) -> list:
        return self._by_root.get((root_type, config), ())

    def add(self, root_type, config, walker) -> None:
        key = (root_type, config)
        found = self._by_root.setdefault(key, [])
        found.insert(0, walker)
        self._where[walker.structure] = key
        for dropped in found[self.per_root:]:
            self._where.pop(dropped.structure, None)
        del found[self.per_root:]

    def forget(self, structure) -> None:
        key = self._where.pop(structure, None)
        if key is None:
            return
        found = self._by_root[key]
        found[:] = [w for w in found if w.structure != structure]
        if not found:
            del self._by_root[key]

    def clear(self) -> None:
        self._by_root.clear()
        self._where.clear()

    def __len__(self) -> int:
        return sum(map(len, self._by_root.values()))


walkers = Walkers()
