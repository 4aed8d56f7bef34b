"""Words for why a cached graph was not reused (logged on the ``gradfx`` logger)."""

from __future__ import annotations

import functools
import linecache
import logging
import re

from ..graph.kinds import ACCUMULATE, FUNCTION, OPAQUE, type_info
from ..graph.walk import BackwardCall, _NodeMark
from ..runtime import hook_ops

log = logging.getLogger("gradfx")

_last_key: list = [None]


def describe_position(call: BackwardCall, pos: int) -> str:
    """Which tensor or saved value a position of ``call.sizes`` belongs to."""
    for input_pos, (start, ndim, stride_start) in call.tensor_slots.items():
        if start <= pos < start + ndim:
            return f"{_input_name(call, input_pos)} dim {pos - start}"
        if stride_start >= 0 and stride_start <= pos < stride_start + ndim:
            return f"{_input_name(call, input_pos)} stride {pos - stride_start}"
    for (i, nr), start in call.meta_slots():
        ndim = len(call.nodes[i]._input_metadata[nr].shape)
        if start <= pos < start + ndim:
            return f"gradient {nr} of {call.node_label(i)} dim {pos - start}"
    best = None  # the saved value starting last at or before `pos`
    for (i, attr), (start, _) in call.value_slots():
        if start <= pos and (best is None or start > best[2]):
            best = (i, attr, start)
    if best is not None:
        i, attr, start = best
        return f"{call.node_label(i)} saved {attr[len('_saved_'):]} (item {pos - start})"
    return f"size {pos}"


def _input_name(call, input_pos):
    kind = call.input_kinds[input_pos]
    owner = call.input_owner[input_pos]
    if owner < 0:
        return f"root gradient {input_pos}"
    return f"{kind} tensor of {call.node_label(owner)}"


def size_change(call: BackwardCall, old_sizes, limit: int = 4, *, dynamic=None, symbolic=()) -> str:
    """The sizes that differ from ``old_sizes``, in words, grouped by change:
    ``SumBackward0 #24 saved self_sym_sizes[0] changed 24 -> 37`` or ``3 sizes changed
    24 -> 37 (...)``.  With the block's ``dynamic`` (and the positions ``symbolic`` in
    its graphs so far), a note of what the capture that follows does with them."""
    changed = [p for p, (a, b) in enumerate(zip(old_sizes, call.sizes)) if a != b]
    if not changed:
        return "sizes as before"
    groups: dict = {}  # (old, new) -> positions
    for p in changed:
        groups.setdefault((old_sizes[p], call.sizes[p]), []).append(p)
    parts = []
    for (a, b), ps in list(groups.items())[:limit]:
        if len(ps) == 1:
            parts.append(f"{_size_name(call, ps[0])} changed {a} -> {b}")
            continue
        names = ", ".join(_size_name(call, p) for p in ps[:3])
        names += f" and {len(ps) - 3} more" if len(ps) > 3 else ""
        parts.append(f"{len(ps)} sizes changed {a} -> {b} ({names})")
    more = f" (and {len(groups) - limit} more changes)" if len(groups) > limit else ""
    return "; ".join(parts) + more + _dynamic_note(dynamic, set(changed) - set(symbolic))


def _size_name(call: BackwardCall, pos: int) -> str:
    return re.sub(r" \(item (\d+)\)$", r"[\1]", describe_position(call, pos))


def _dynamic_note(dynamic, static: set) -> str:
    if dynamic is None:
        return ""
    if dynamic is False:
        return " (static: under dynamic=False each new size is a new capture)"
    if static:
        return (f" (static so far: dynamic={dynamic!r} makes the sizes that changed symbolic from this "
                "capture on, except sizes of 0 or 1)")
    return " (symbolic already: the new sizes fail a guard of the graph, such as a size of 0 or 1)"


def log_structure_miss(call: BackwardCall) -> None:
    """Log, in words, how this graph's structure differs from the last one captured, e.g.
    ``new structure (vs the last capture): node 1 (PowBackward0 #2): saved exponent
    changed from 2.0 to 3.0``."""
    previous, _last_key[0] = _last_key[0], call.key
    if previous is None or not log.isEnabledFor(logging.INFO):
        return
    try:
        words = structure_change(previous.items, call.key.items, call)
    except Exception:  # words only: a key this code does not read still gets the generic line
        log.debug("gradfx: explaining a new structure failed", exc_info=True)
        words = _generic_change(previous.items, call.key.items, call)
    log.info("gradfx: new structure (vs the last capture): %s", words)


# -- reading a structure key (capture/graph/walk.py, kinds.py) -----------------------
#
# The key is a flat tuple: the head (roots, outputs, accumulate, create_graph, one
# tensor structure per root gradient), then per autograd node a _NodeMark(i), its
# header (type, next edges, rank in sequence-number order, runs) and what its kind
# walks: input metadata, saved values, the saved tensors' mask and structures, the
# ctx of a traced Function, the leaf of an AccumulateGrad, hooks (last, if any).

_HEAD = ("roots", "outputs", "accumulate", "create_graph")


def _split_key(items):
    """(head items, [(node index, header, [(role, value), ...])])."""
    head, nodes = [], []
    for item in items:
        if type(item) is _NodeMark:
            nodes.append([int(item), None, []])
        elif not nodes:
            head.append(item)
        elif nodes[-1][1] is None:
            nodes[-1][1] = item
        else:
            nodes[-1][2].append(item)
    return head, [(i, header, _node_roles(header, rest)) for i, header, rest in nodes]


def _node_roles(header, rest: list) -> list:
    """The node's key items after its header, each with what it holds (a role)."""
    typ, _, _, runs = header
    info = type_info(typ)
    plan: list = []
    if not runs:  # a capture of autograd.grad's inputs: metadata and hooks only
        plan = ["metas"]
    elif info.kind == ACCUMULATE:
        plan = ["leaf"]
    elif info.kind == FUNCTION:
        plan = ["function", "metas"]
        if rest and isinstance(rest[0], tuple) and len(rest[0]) == 3 and rest[0][2]:
            plan.append("ctx")
        plan.append("mask")
    else:
        plan = ["metas"] + [("value", attr) for attr in info.saved_values]
        if info.raw_saved:
            plan.append("mask")
    out = []
    k = 0
    for role in plan:
        if k == len(rest):
            return out
        out.append((role, rest[k]))
        k += 1
        if role == "mask" and isinstance(out[-1][1], tuple):
            names = _saved_names(typ, info, out[-1][1])
            for name in names:
                if k == len(rest):
                    return out
                out.append((("saved", name), rest[k]))
                k += 1
    if k < len(rest):
        out.append(("hooks", rest[k]))
        k += 1
    out += [("item", v) for v in rest[k:]]
    return out


def _saved_names(typ, info, mask) -> list:
    """Names of the defined saved tensors, in the key's order."""
    if info.kind == FUNCTION:
        return [f"ctx.saved_tensors[{j}]" for j, defined in enumerate(mask) if defined]
    names = [a[len("_saved_"):] for a in info.saved_tensors]
    if len(names) != len(mask):  # a list of tensors among them: by position
        names = [f"tensor {j}" for j in range(len(mask))]
    return [n for n, defined in zip(names, mask) if defined]


# -- words for a difference -----------------------------------------------------------

def structure_change(old: tuple, new: tuple, call: BackwardCall) -> str:
    """What differs first between two structure keys (``StructureKey.items``), in
    words; ``call`` is the backward of ``new`` (it names the nodes)."""
    old_head, old_nodes = _split_key(old)
    new_head, new_nodes = _split_key(new)
    names = _Names(call, old_nodes)
    words = _head_change(old_head, new_head, names)
    if words is not None:
        return words
    pairs = list(zip(old_nodes, new_nodes))
    # What changes the graph's shape first (node types, edges, which nodes run), then
    # what the nodes hold, then the order the forward created them in (which moves
    # with any node added or removed).
    for differs in (lambda a, b: a[1][0] is not b[1][0], lambda a, b: a[1][1:2] != b[1][1:2],
                    lambda a, b: a[1][3] != b[1][3], lambda a, b: a[2] != b[2], lambda a, b: a[1:] != b[1:]):
        found = [k for k, (a, b) in enumerate(pairs) if differs(a, b)]
        if found:
            words = _node_change(*pairs[found[0]], names)
            others = sum(a[1:] != b[1:] for a, b in pairs) - 1
            if len(old_nodes) != len(new_nodes):
                words += f" ({len(new_nodes)} nodes now, {len(old_nodes)} before)"
            elif others:
                words += f" (and {others} more node{'s differ' if others > 1 else ' differs'})"
            return words
    if len(old_nodes) != len(new_nodes):
        more = new_nodes[len(old_nodes):] or old_nodes[len(new_nodes):]
        kinds = ", ".join(dict.fromkeys(_type_name(header[0]) for _, header, _ in more))
        return (f"the graph has {len(new_nodes)} autograd nodes now, {len(old_nodes)} before "
                f"({'new' if len(new_nodes) > len(old_nodes) else 'gone'}: {kinds})")
    return ("the autograd graph is the one captured last; the block differs (backend, passes "
            "or dynamic), or gradfx.reset() emptied the cache")


class _Names:
    """How a message names node ``j``: this backward's label (``MulBackward0 #4``), or
    the type the last capture had there."""

    def __init__(self, call: BackwardCall, old_nodes):
        self.call = call
        self.old = {i: header[0] for i, header, _ in old_nodes}

    def new(self, j: int) -> str:
        if 0 <= j < len(self.call.nodes):
            return f"node {j} ({self.label(j)})"
        return f"node {j}"

    def label(self, j: int) -> str:
        return self.call.node_label(j).replace("torch::autograd::", "")

    def before(self, j: int) -> str:
        return f"node {j} ({_type_name(self.old[j])})" if j in self.old else f"node {j}"


def _type_name(typ) -> str:
    return getattr(typ, "__name__", str(typ))


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _head_change(old: list, new: list, names: _Names) -> str | None:
    if old[:1] != new[:1]:
        return _roots_change(old[0], new[0], names)
    for k, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        if k == 1:
            return _outputs_change(a, b, names)
        if k == 2:
            return ("backward() now (gradients into .grad), autograd.grad before" if b else
                    "autograd.grad now (gradients returned), backward() before")
        if k == 3:
            return f"create_graph={b} now, {a} before"
        return f"the gradient of root {k - len(_HEAD)} is {_tensor_change(a, b)}"
    return None


def _roots_change(a: tuple, b: tuple, names: _Names) -> str:
    if len(a) != len(b):
        return f"the roots changed: the backward started at {_count(len(a), 'tensor')}, now {len(b)}"
    k = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
    (j0, nr0), (j, nr) = a[k], b[k]
    return (f"the roots changed: root {k} is now output {nr} of {names.new(j)}, "
            f"before output {nr0} of {names.before(j0)}")


def _outputs_change(a, b, names: _Names) -> str:
    if a is None:
        return (f"the backward now computes the gradients of {_count(len(b), 'input')} (autograd.grad or "
                "backward(inputs=...)); before, of every leaf")
    if b is None:
        return (f"the backward now computes the gradients of every leaf; before, of "
                f"{_count(len(a), 'input')} (autograd.grad or backward(inputs=...))")
    if len(a) != len(b):
        return f"the gradients asked for changed: {_count(len(b), 'input')} now, {len(a)} before"
    k = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
    where_new = "unreachable from the roots" if b[k] is None else f"at {names.new(b[k][0])}"
    where_old = "unreachable" if a[k] is None else f"at {names.before(a[k][0])}"
    return f"input {k} of the gradients asked for is {where_new} now, {where_old} before"


def _tensor_change(a, b) -> str:
    """Two tensor structures (dtype, device, layout, ndim, contiguous) in words."""
    if not (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) == 5):
        return f"{_short(b)} now, {_short(a)} before"
    parts = []
    if a[0] != b[0]:
        parts.append(f"{_dtype(b[0])} now, {_dtype(a[0])} before")
    if a[1] != b[1]:
        parts.append(f"on {b[1]} now, on {a[1]} before")
    if a[2] != b[2]:
        parts.append(f"{b[2]} now, {a[2]} before")
    if a[3] != b[3]:
        parts.append(f"{b[3]}-d now, {a[3]}-d before (a size changed: its number of dims)")
    if a[4] != b[4]:
        parts.append("contiguous now, not before" if b[4] else "not contiguous now, contiguous before")
    return "; ".join(parts)


def _dtype(d) -> str:
    return str(d).replace("torch.", "")


def _node_change(a, b, names: _Names) -> str:
    i, (typ0, edges0, rank0, runs0), roles0 = a
    _, (typ, edges, rank, runs), roles = b
    if typ0 is not typ:
        now = names.label(i) if i < len(names.call.nodes) else _type_name(typ)
        return f"node {i} is now {now} instead of {_type_name(typ0)}"
    where = names.new(i)
    if edges0 != edges:
        return f"{where}: {_edges_change(edges0, edges, names)}"
    if runs0 != runs:
        return (f"{where} runs now (the gradients asked for need it), before it did not" if runs else
                f"{where} no longer runs (the gradients asked for do not need it)")
    for (role0, v0), (role1, v1) in zip(roles0, roles):
        if (role0, v0) != (role1, v1):
            return f"{where}: {_role_change(role0, v0, role1, v1, typ)}"
    if len(roles0) > len(roles):
        return f"{where}: {_gone(roles0[len(roles)][0])}"
    if len(roles0) < len(roles):
        return f"{where}: {_added(roles[len(roles0)][0], roles[len(roles0)][1])}"
    return (f"{where}: the forward created the nodes in another order: this one is number {rank} in "
            f"creation order now, {rank0} before")


def _edges_change(a: tuple, b: tuple, names: _Names) -> str:
    if len(a) != len(b):
        return f"it passes gradients on to {_count(len(b), 'edge')} now, {len(a)} before"
    k = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
    if a[k] is None:
        return f"its gradient for input {k} is needed now (it goes to {names.new(b[k][0])}), before it was not"
    if b[k] is None:
        return f"its gradient for input {k} is no longer needed (it went to {names.before(a[k][0])})"
    return f"its gradient for input {k} goes to {names.new(b[k][0])} now, to {names.before(a[k][0])} before"


def _role_change(role0, v0, role, v, typ) -> str:
    if role0 != role:
        if role0 == "hooks":
            return f"{_gone('hooks')} ({_hooks(v0)} before)"
        if role == "hooks":
            return _added("hooks", v)
        if role0 == "mask" or role == "mask":
            return _mask_change(v0, v)
        return f"{_describe_role(role)} {_short(v)} now, {_describe_role(role0)} {_short(v0)} before"
    if role == "metas":
        return _metas_change(v0, v)
    if isinstance(role, tuple) and role[0] == "value":
        return _value_change(role[1], v0, v, typ)
    if isinstance(role, tuple) and role[0] == "saved":
        return f"saved {role[1]} is {_tensor_change(v0, v)}"
    if role == "mask":
        return _mask_change(v0, v)
    if role == "hooks":
        return f"its hooks changed: {_hooks(v)} now, {_hooks(v0)} before"
    if role == "leaf" and isinstance(v, tuple) and isinstance(v0, tuple) and len(v) == len(v0) == 3:
        if v0[0] != v[0]:
            return f"the leaf is {_tensor_change(v0[0], v[0])}"
        if v0[1] != v[1]:
            return "the leaf requires grad now, not before" if v[1] else "the leaf no longer requires grad"
        return f"the leaf's grad_dtype is {_dtype(v[2])} now, {_dtype(v0[2])} before"
    if role == "function" and isinstance(v, tuple) and isinstance(v0, tuple) and len(v) == len(v0) == 3:
        what = ("needs_input_grad", "materialize_grads", "traceable")
        k = next(k for k in range(3) if v0[k] != v[k])
        return f"its {what[k]} is {v[k]} now, {v0[k]} before"
    if role == "ctx":
        return _ctx_change(v0, v)
    return f"{_describe_role(role)} changed: {_short(v0)} -> {_short(v)}"


def _describe_role(role) -> str:
    if isinstance(role, tuple):
        return f"saved {role[1][len('_saved_'):] if role[0] == 'value' else role[1]}"
    return {"metas": "the gradients it receives", "mask": "its saved tensors", "leaf": "the leaf",
            "function": "the Function's flags", "ctx": "the ctx", "hooks": "its hooks"}.get(role, "a key item")


def _gone(role) -> str:
    return "it has no hooks now" if role == "hooks" else f"{_describe_role(role)}: gone now"


def _added(role, value) -> str:
    if role == "hooks":
        return f"it has hooks now: {_hooks(value)}; none before"
    return f"{_describe_role(role)}: new ({_short(value)})"


def _metas_change(a, b) -> str:
    if not (isinstance(a, tuple) and isinstance(b, tuple)) or len(a) != len(b):
        n0 = len(a) if isinstance(a, tuple) else "?"
        n1 = len(b) if isinstance(b, tuple) else "?"
        return f"it receives {n1} gradients now, {n0} before"
    k = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
    (nd0, dt0, dev0), (nd, dt, dev) = a[k], b[k]
    parts = []
    if nd0 != nd:
        parts.append(f"{nd}-d now, {nd0}-d before (a size changed: its number of dims)")
    if dt0 != dt:
        parts.append(f"{_dtype(dt)} now, {_dtype(dt0)} before")
    if dev0 != dev:
        parts.append(f"on {dev} now, on {dev0} before")
    return f"the gradient it receives for output {k} is {'; '.join(parts)}"


def _value_change(attr: str, a, b, typ) -> str:
    name = attr[len("_saved_"):]
    if attr in type_info(typ).size_values:  # sizes go to the sizes: the key holds their layout
        return f"a size changed: saved {name} holds {_layout(b)} now, {_layout(a)} before"
    old, new = _value(a), _value(b)
    if _value_type(a) != _value_type(b):  # 2 and 2.0, or True and 1: another trace
        return f"saved {name} changed from {old} ({_value_type(a)}) to {new} ({_value_type(b)})"
    return f"saved {name} changed from {old} to {new}"


def _layout(layout) -> str:
    if layout == "none":
        return "None"
    if layout is None:
        return "one size"
    flat = sum(1 for _ in _leaves(layout))
    return _count(flat, "size")


def _leaves(layout):
    for item in layout:
        if isinstance(item, tuple):
            yield from _leaves(item)
        elif item != "none":
            yield item


def _value(v) -> str:
    """A saved value as value_key keeps it, as the user wrote it."""
    if type(v) is str:  # a float, by repr
        return v
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], type):
        return repr(v[1])
    if isinstance(v, tuple) and v[:1] == ("tensor",) and len(v) == 6:
        return f"a {_dtype(v[1])} tensor of shape {list(v[2])}"
    return _short(v)


def _value_type(v) -> str:
    if type(v) is str:
        return "a float"
    if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], type):
        return f"a{'n' if v[0].__name__[:1] in 'aeiou' else ''} {v[0].__name__}"
    return type(v).__name__


def _mask_change(a, b) -> str:
    if b == OPAQUE:
        return "its saved tensors are under saved-tensor hooks now (it runs as its own backward, opaque)"
    if a == OPAQUE:
        return "its saved tensors are no longer under saved-tensor hooks"
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        k = next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)
        now, before = ("defined" if v[k] else "None" for v in (b, a))
        return f"its saved tensor {k} is {now} now, {before} before"
    return f"its saved tensors changed: {_short(a)} -> {_short(b)}"


def _hooks(spec) -> str:
    """A HookSpec.key() in words."""
    if not (isinstance(spec, tuple) and len(spec) == 6):
        return _short(spec)
    tensor_pre, retain, pre, post, post_accumulate, native_post = spec
    counts = [(sum(n for _, n in tensor_pre), "tensor hook"), (len(retain), "retain_grad"),
              (pre, "pre-hook"), (len(post), "post-hook"), (len(post_accumulate), "post-accumulate-grad hook")]
    words = [_count(n, word) for n, word in counts if n]
    if any(post_accumulate):  # graph.distributed.reducer_hook_alone
        k = sum(post_accumulate)
        words.append(f"{k} of them DDP's Python-reducer hook{'s' if k > 1 else ''} (its DDP has no comm hook)")
    if native_post:
        words.append("C++ post-hooks (DDP's reducer)")
    return ", ".join(words) or "none"


def _ctx_change(a, b) -> str:
    if isinstance(a, tuple) and isinstance(b, tuple):
        old, new = dict(x[:2] if len(x) == 2 else (x[0], x[1:]) for x in a), \
            dict(x[:2] if len(x) == 2 else (x[0], x[1:]) for x in b)
        for name in sorted(set(old) | set(new)):
            if name not in old:
                return f"ctx.{name} is new ({_value(new[name])})"
            if name not in new:
                return f"ctx.{name} is gone"
            if old[name] != new[name]:
                return f"ctx.{name} changed from {_value(old[name])} to {_value(new[name])}"
    return f"the ctx changed: {_short(a)} -> {_short(b)}"


def _short(v, limit: int = 80) -> str:
    text = re.sub(r"<class '(?:[\w.]*\.)?(\w+)'>", r"\1", repr(v))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _generic_change(old: tuple, new: tuple, call: BackwardCall) -> str:
    """The first differing key item, where in the key it is (a fallback)."""
    node = None
    for a, b in zip(old, new):
        if type(b) is _NodeMark:
            node = int(b)
        if a != b:
            where = f"node {node} ({call.node_label(node)})" if node is not None else "the roots"
            return f"at {where}: {_short(a)} -> {_short(b)}"
    return f"{len(new)} key items now, {len(old)} before"


def annotate_error(err: BaseException, graph_module, backend: str | None = None) -> None:
    """Add to ``err`` (its type is kept) one note: the autograd node of the failing graph op,
    and for a hook that raised, the hook (by qualified name) and its tensor (by its
    ``names=`` name, else its shape) or node; ``backend``: the block's backend, named
    where it is not the built-in eager one (a compiled callable that raised)."""
    tb = err.__traceback__
    line = None
    hook = _NO_HOOK
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith("<eval_with_key>"):
            line = linecache.getline(code.co_filename, tb.tb_lineno)
        elif code is hook_ops._call.__code__:
            hook = tb.tb_frame.f_locals.get("hook", _NO_HOOK)  # the hook object this call ran
        tb = tb.tb_next
    compiled = f"in the graph compiled by backend {backend!r}" if backend and backend != "eager" else None
    where = None
    if line and " = " in line:
        name = line.strip().split(" = ")[0].split(":")[0].strip()
        node = next((n for n in graph_module.graph.nodes if n.name == name), None)
        label = node.meta.get("gradfx_node") if node is not None else None
        if label:
            if node.target in _HOOK_CALLS:
                where = _hook_words(node, label, hook, graph_module, f"graph node {name}")
            else:
                where = f"raised while running the backward of {label} (graph node {name})"
    if where is None and compiled is None:
        return
    err.add_note("gradfx: " + (f"{where}, {compiled}" if where and compiled else where or f"raised {compiled}"))


_NO_HOOK = object()


_HOOK_CALLS = {hook_ops.call_tensor_hook: "tensor hook", hook_ops.call_pre_hook: "pre-hook",
               hook_ops.call_post_hook: "post-hook", hook_ops.call_post_accumulate_hook: "post-accumulate-grad hook",
               hook_ops.call_node_post_hooks: "post-hook (C++ or Python)"}


def hook_name(hook) -> str:
    """A hook's qualified name: ``module.Class.method``, ``module.f.<locals>.hook``."""
    if isinstance(hook, functools.partial):
        return f"functools.partial({hook_name(hook.func)})"
    target = hook if hasattr(hook, "__qualname__") else type(hook)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    module = getattr(target, "__module__", None)
    return f"{module}.{qualname}" if module and module != "builtins" else qualname


def _hook_words(node, label: str, hook, graph_module, graph_node: str) -> str:
    """``raised in the tensor hook m.f of leaf '0.weight'`` and the like."""
    kind = _HOOK_CALLS[node.target]
    if hook is _NO_HOOK:  # not seen in the traceback (a compiled region): the one it was captured with
        first = node.args[0] if node.args else None
        named = getattr(first, "meta", {}).get("gradfx_name") if first is not None else None
        what = f"the {kind} {named}" if named else f"a {kind}"
    else:
        what = f"the {kind} {hook_name(hook)}"
    short = label.replace("torch::autograd::", "")
    if kind in ("tensor hook", "post-accumulate-grad hook"):
        index = node.meta.get("gradfx_node_index")
        leaf = next((p for p in graph_module.graph.find_nodes(op="placeholder")
                     if p.meta.get("gradfx_kind") == "variable" and p.meta.get("gradfx_node_index") == index), None)
        if leaf is not None:
            name = leaf.meta.get("gradfx_name")
            shape = leaf.meta.get("gradfx_shape")
            tensor = f"leaf {name!r}" if name else f"a leaf of shape {list(shape) if shape is not None else '?'}"
            return f"raised in {what} of {tensor} ({short}, {graph_node})"
        grad = node.args[1] if len(node.args) > 1 else None
        value = getattr(grad, "meta", {}).get("val") if grad is not None else None
        shape = f" of shape {list(value.shape)}" if hasattr(value, "shape") else ""
        return f"raised in {what} of a tensor{shape} (its gradient goes into {short}; {graph_node})"
    return f"raised in {what} of {short} ({graph_node})"


COMPACT_AFTER = 12  # guard lines; more are grouped

_EQUAL = re.compile(r"^sizes\[(\d+)\] == (.+)$")
_WHERE = re.compile(r"^where (s\d+) is sizes\[(\d+)\]: (.*?)(?: (dim|stride) (\d+)| \(item (\d+)\))$")


def compact_guards(lines: list[str], limit: int | None = None) -> list[str]:
    """Guard lines as they are, or grouped when there are more than ``limit``.

    Grouped: positions equal to the same expression share a line
    (``sizes[2..5, 17] == s0``), and symbols read from one tensor or saved value
    share their explanation (``where s3, s4 are sizes[9, 10]: saved tensor of
    AddmmBackward0 #11 dims 0, 1``).  Other lines (each symbol's range first)
    stay as they are, in order.
    """
    if len(lines) <= (COMPACT_AFTER if limit is None else limit):
        return list(lines)
    groups: dict = {}  # group key -> [first line index, members]
    plain = []
    for k, line in enumerate(lines):
        if m := _EQUAL.match(line):
            key, member = ("equal", m.group(2)), int(m.group(1))
        elif m := _WHERE.match(line):
            word = "item" if m.group(6) is not None else m.group(4)
            index = m.group(6) if m.group(6) is not None else m.group(5)
            key, member = ("where", m.group(3), word), (m.group(1), int(m.group(2)), index)
        else:
            plain.append((k, line))
            continue
        groups.setdefault(key, [k, []])[1].append(member)
    out = plain + [(first, _group_line(key, members)) for key, (first, members) in groups.items()]
    return [line for _, line in sorted(out, key=lambda t: t[0])]


def _group_line(key, members) -> str:
    if key[0] == "equal":
        return f"sizes[{_positions(members)}] == {key[1]}"
    _, subject, word = key
    symbols = ", ".join(s for s, _, _ in members)
    where = _positions([p for _, p, _ in members])
    indices = ", ".join(i for _, _, i in members)
    if len(members) == 1:
        tail = f"({word} {indices})" if word == "item" else f"{word} {indices}"
        return f"where {symbols} is sizes[{where}]: {subject} {tail}"
    tail = f"(items {indices})" if word == "item" else f"{word}s {indices}"
    return f"where {symbols} are sizes[{where}]: {subject} {tail}"


def _positions(ps) -> str:
    """``[2, 3, 4, 5, 9]`` -> ``2..5, 9`` (runs of three or more)."""
    ps = sorted(ps)
    parts, k = [], 0
    while k < len(ps):
        j = k
        while j + 1 < len(ps) and ps[j + 1] == ps[j] + 1:
            j += 1
        if j - k >= 2:
            parts.append(f"{ps[k]}..{ps[j]}")
        else:
            parts.extend(str(p) for p in ps[k:j + 1])
        k = j + 1
    return ", ".join(parts)
