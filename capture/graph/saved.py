"""Ownership of the saved tensors of the nodes gradfx runs.

For every node it executes, gradfx installs its own pack/unpack pair on each saved
variable (``node._raw_saved_x.register_hooks``).  Registering packs at once, so the
pack hook hands us the real tensor (a graph input), and the node drops its own
reference: from then on the ``SavedTensors`` object is the only owner.  That lets
gradfx

* feed the tensor to the compiled graph, which frees it at its last use;
* release it after a backward without ``retain_graph`` (a later unpack raises the
  eager engine's own error);
* substitute a fake tensor for it while tracing (the unpack hook reads a
  thread-local substitution table).

A saved variable that already has hooks belongs either to an earlier gradfx run
(its ``unpack_hook`` is ours; a probing unpack raises with the owner) or to the
user's ``saved_tensors_hooks``; the latter makes the node opaque.

torch does not check a hooked saved variable for in-place modification, so gradfx
does: it records each tensor's version when it takes the tensor over (right
after eager's own check passed) and raises eager's error wherever the tensor is
read again, by a later gradfx walk or by the eager engine through the unpack hook.
"""

from __future__ import annotations

import re
import threading
from functools import partial

import torch

from .. import native, torch_releases
from ..errors import _Fallback
from . import subclasses
from .unpacked import planned

FREED_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved "
    "tensors after they have already been freed). Saved intermediate values of the "
    "graph are freed when you call .backward() or autograd.grad(). Specify "
    "retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward."
)


def plain_type(tp) -> bool:
    """Is ``tp`` a plain tensor's type (Tensor or Parameter), not a subclass's?"""
    return tp is torch.Tensor or tp is torch.nn.Parameter


def readable(t, role: str, node=None):
    """``t``, if the walk can read it without running user code; else raise _Fallback.

    ``type()`` runs none; any other read of a subclass may (its ``__torch_function__``,
    its own properties).  ``role`` and ``node`` say where ``t`` was met, for the reason.
    """
    tp = type(t)
    if plain_type(tp):
        return t
    raise unreadable(f"a tensor subclass ({tp.__name__})", role, node)


def unreadable(what: str, role: str, node=None) -> _Fallback:
    """The fallback for a tensor the walk cannot read: ``what`` it is, where it was met."""
    where = f" of {type(node).__name__}" if node is not None else ""
    return _Fallback(f"{what} {role}{where}")


class _State(threading.local):
    table = None  # while tracing: (id(owner), index) -> fake tensor
    probe = False  # while adopting: unpack raises _Probe(owner)


_substitution = _State()


class SavedTensors:
    """The saved tensors of one node, owned by gradfx (weak-referenceable).

    Each saved variable gets ``tensors.append`` as its pack hook and
    ``partial(_unpack, owner, index)`` as its unpack hook: C-level callables, so
    registering them costs no Python frame (this runs for every saved tensor of
    every backward).
    """

    __slots__ = ("tensors", "released", "mask", "versions", "origin", "__weakref__")

    def __init__(self) -> None:
        self.tensors: list = []
        self.released = False
        self.mask: tuple = ()
        self.versions: list = []
        self.origin: "Origin | None" = None

    def seal(self, mask: tuple, origin: "Origin") -> None:
        """Taken over: remember the mask and each tensor's version (eager's check just passed)."""
        self.mask = mask
        self.origin = origin
        self.versions = [t._version for t in self.tensors]

    def check_versions(self) -> None:
        """Raise eager's error if a tensor was modified in place since it was taken over."""
        for index, t in enumerate(self.tensors):
            if t._version != self.versions[index]:
                raise RuntimeError(_modified_message(self, index, t))

    def release(self) -> None:
        self.released = True
        # In place: the saved variables' pack hooks are bound to this very list.
        self.tensors.clear()


class Untouched:
    """The saved variables of an opaque custom Function, left to its node.

    Its backward then unpacks them as in eager: the saved originals themselves
    (``w is W``; a hook's result would be wrapped in a new tensor), checked by
    torch.  Releasing them after a backward without ``retain_graph`` takes them
    over into an owner that is already released: the node drops its references,
    and a later unpack raises eager's error.
    """

    __slots__ = ("variables",)
    tensors = ()  # none of them is a graph input
    mask = None

    def __init__(self, variables: tuple):
        self.variables = variables

    def release(self) -> None:
        release_variables(self.variables)


def left_to_node(owner) -> bool:
    """Is ``owner`` a HeldByNode: the saved tensors of a builtin node that a cache hit read
    and left to the node?

    The compiled part's walker (native/saved.cpp, where the type lives) reads them with
    eager's checks and takes nothing over: no hooks, so the node keeps them exactly as in
    eager (a ``retain_graph`` backward leaves the graph as eager leaves it), a real run of
    the node unpacks them itself, and every later error is torch's own.  ``release``
    frees them as the engine does once a node has run: before the graph runs where the
    graph holds them (it frees each at its last use), else after the backward.  A
    capture needs gradfx's own owners (tracing substitutes fakes through them): the
    session walks such a backward again with the generic walk.
    """
    module = native.module()
    return module is not None and type(owner) is module.HeldByNode


class ForeignOwned:
    """The saved variables of a node under the user's ``saved_tensors_hooks``, left to them.

    Releasing does what the engine does right after running the node: the compiled part
    drops each variable's data and hooks (``reset_at``), so what the hooks packed goes
    (a checkpoint's frame, with the block's saved inputs) and a later unpack raises
    eager's error.  Without the compiled part Python cannot release them: releasing
    marks the node instead, in its ``metadata`` (which lives and dies with it), so that a
    later gradfx backward through it raises eager's error when it is walked, and a
    pre-hook raises it if the eager engine reaches the node.
    """

    __slots__ = ("node",)
    tensors = ()  # none of them is a graph input
    mask = None

    def __init__(self, node):
        self.node = node

    def release(self) -> None:
        release_hooked(self.node)


def release_hooked(node) -> None:
    """Release the saved variables of a node under the user's hooks (see ForeignOwned)."""
    reader = native.module()
    if reader is not None:
        plan = planned(type(node))
        if plan is not None:  # where they lie is known: one C++ call
            reader.reset_at(node, plan.offsets)
            return
    raws = _raw_variables(node) if reader is not None else None
    if raws is not None:
        reader.reset_saved(raws)
    elif not node.metadata.get(RELEASED_KEY):
        node.metadata[RELEASED_KEY] = True
        node.register_prehook(_freed)


def _raw_variables(node):
    """The node's saved variables (``_raw_saved_*``, lists flattened), or None for a custom
    Function's (those are marked released instead, as without the compiled part)."""
    names = _raw_names.get(type(node))
    if names is None:
        names = _raw_names[type(node)] = () if hasattr(node, "_forward_cls") else \
            tuple(n for n in dir(type(node)) if n.startswith("_raw_saved_"))
    if not names:
        return None
    found = []
    for name in names:
        raw = getattr(node, name)
        found.extend(raw if type(raw) is tuple else (raw,))
    return tuple(found)


_raw_names: dict = {}  # node type -> its _raw_saved_* attributes (none for a custom Function)


def _freed(grad_outputs):
    raise RuntimeError(FREED_MESSAGE)


RELEASED_KEY = "_gradfx_released"  # in a node's metadata: its hooked saved tensors were released


def release_variables(variables) -> None:
    """Eager's release of saved variables, for those gradfx leaves to their node or owns:
    a later unpack raises eager's error.  The user's saved-tensor hooks are left alone."""
    for var in variables:
        hook = var.unpack_hook
        if hook is None:
            try:
                var.register_hooks(_released.tensors.append, partial(_unpack, _released, 0))
            except RuntimeError:  # a None entry, or freed already
                continue
            _released.tensors.clear()
        elif is_ours(hook):
            hook.args[0].release()


_released = SavedTensors()  # the owner of every variable released by taking it over
_released.released = True


def _unpack(owner: SavedTensors, index: int, packed):
    if _substitution.probe:
        raise _Probe(owner)
    table = _substitution.table
    if table is not None:
        fake = table.get((id(owner), index))
        if fake is not None:
            return fake
    if owner.released:
        raise RuntimeError(FREED_MESSAGE)
    t = owner.tensors[index]
    if t._version != owner.versions[index]:
        raise RuntimeError(_modified_message(owner, index, t))
    return t


class Origin:
    """What eager's in-place error says about the saved tensors of one node type."""

    __slots__ = ("node_name", "attrs", "grouped")

    _by_type: dict = {}

    def __init__(self, node_name: str, attrs: tuple, grouped: bool):
        self.node_name = node_name
        self.attrs = attrs
        self.grouped = grouped

    @classmethod
    def of(cls, node, tensor_attrs: tuple, grouped: bool) -> "Origin":
        key = (type(node), grouped)
        origin = cls._by_type.get(key)
        if origin is None:
            # Eager names the forward op (ExpBackward0 -> Exp), before 2.13 the node.
            name = node.name()
            if torch_releases.MODIFIED_OUTPUT_NAMES_FORWARD_OP:
                name = re.sub(r"Backward\d*$", "", name)
            origin = cls._by_type[key] = cls(name, tensor_attrs, grouped)
        return origin

    def clause(self, mask: tuple, index: int) -> str:
        """", which is output k of Op," for a saved result of the node; "" where unknown."""
        if self.grouped:
            return ""
        defined = [attr for attr, m in zip(self.attrs, mask) if m]
        if index >= len(defined):
            return ""
        match = re.fullmatch(r"_saved_result(\d*)", defined[index])
        if match is None:
            return ""
        return f", which is output {int(match.group(1) or 0)} of {self.node_name},"


def _modified_message(owner: SavedTensors, index: int, t) -> str:
    clause = owner.origin.clause(owner.mask, index) if owner.origin is not None else ""
    return ("one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{t.type()} {list(t.shape)}]{clause} is at version {t._version}; expected "
            f"version {owner.versions[index]} instead. Hint: enable anomaly detection to find the "
            "operation that failed to compute its gradient, with "
            "torch.autograd.set_detect_anomaly(True, check_nan=False).")


def is_ours(unpack_hook) -> bool:
    return type(unpack_hook) is partial and unpack_hook.func is _unpack


class _Probe(Exception):
    def __init__(self, owner):
        self.owner = owner


class ForeignHooks(Exception):
    """A saved variable of this node carries the user's saved-tensor hooks."""


class SubclassSaved(Exception):
    """A saved tensor of this node is a tensor subclass: its saved variables are left to it
    (``Untouched``) and the graph reads them when the node runs; ``types`` are the saved
    values' types."""

    def __init__(self, types: tuple):
        super().__init__(", ".join(sorted({t.__name__ for t in types if t is not None and t is not torch.Tensor})))
        self.types = types


def saved_layouts(node, tensor_attrs: tuple) -> tuple:
    """Per saved value of the node (lists flattened), its :func:`subclasses.layout`, None
    for an undefined one: what a graph traced through a subclass bakes in of them."""
    found = []
    for attr in tensor_attrs:
        values = getattr(node, attr)
        for value in (values if type(values) is tuple else (values,)):
            found.append(None if value is None else subclasses.layout(value))
    return tuple(found)


def _subclass_types(unpacked: list):
    """The types of the values unpacked (None for an undefined one) if one is a tensor
    subclass, else None (reading ``type()`` runs no user code)."""
    types = []
    for values in unpacked:
        for value in (values if type(values) is tuple else (values,)):
            types.append(None if value is None else type(value))
    if all(t is None or plain_type(t) for t in types):
        return None
    return tuple(types)


def leave_to_node(node, raw_attrs: tuple) -> Untouched:
    """An owner that leaves the node's saved variables to it and releases them as eager."""
    variables = []
    for attr in raw_attrs:
        raw = getattr(node, attr)
        variables.extend(raw if type(raw) is tuple else (raw,))
    return Untouched(tuple(variables))


def take_saved(node, raw_attrs: tuple[str, ...], tensor_attrs: tuple[str, ...], subclasses_too: bool = False):
    """Own the saved tensors of ``node``: (SavedTensors, defined-mask, tensors).

    ``raw_attrs`` lists the node type's ``_raw_saved_*`` attributes (one
    SavedVariable or a tuple of them) and ``tensor_attrs`` the matching
    ``_saved_*`` ones.  Undefined (None) saved tensors are ``False`` in the mask;
    ``tensors`` are the defined ones as the node unpacks them.  Raises eager's own
    RuntimeError if the saved tensors were freed or modified in place,
    ForeignHooks if the user's saved-tensor hooks own them, SubclassSaved if one is a
    tensor subclass (before any is taken: sealing reads their versions), unless
    ``subclasses_too`` (the tracer, substituting fakes for a node whose saved subclass
    values the graph reads at run time).
    """
    owned = SavedTensors()
    mask = []
    tensors = []
    grouped = False
    # Every variable is looked at before any is taken: one under the user's hooks (or
    # an earlier run's) decides for the whole node, and a variable taken over by then
    # would be left with an unpack hook into an owner nobody keeps.
    raws = [getattr(node, raw_attr) for raw_attr in raw_attrs]
    hooked = first_hooked(raws, tensor_attrs)
    if hooked is not None:
        return _adopt(node, *hooked, raw_attrs, tensor_attrs, subclasses_too)
    # Unpacking without hooks runs eager's check that the tensor was not modified in
    # place since it was saved (and raises eager's error); once hooks are registered
    # the engine no longer checks.  Every variable is checked before any is taken: a
    # failing check leaves the node as it was, and the next backward raises again.
    unpacked = [getattr(node, attr) for attr in tensor_attrs]
    types = _subclass_types(unpacked)
    if types is not None and not subclasses_too:
        raise SubclassSaved(types)
    if types is None:
        for values in unpacked:
            for value in (values if type(values) is tuple else (values,)):
                if value is not None:
                    readable(value, "among the saved tensors", node)
    for raw, values in zip(raws, unpacked):
        grouped |= type(raw) is tuple
        group = raw if type(raw) is tuple else (raw,)
        if type(values) is not tuple:
            values = (values,)
        for var, value in zip(group, values):
            if value is None:
                mask.append(False)
                continue
            try:
                var.register_hooks(owned.tensors.append, partial(_unpack, owned, len(owned.tensors)))
            except RuntimeError:  # freed by the eager engine: eager's own error
                raise RuntimeError(FREED_MESSAGE) from None
            mask.append(True)
            tensors.append(value)
    owned.seal(tuple(mask), Origin.of(node, tensor_attrs, grouped))
    return owned, owned.mask, tensors


def any_hooked(saved_variables) -> bool:
    """Has any of these saved variables an unpack hook (a custom Function's, left to its node)?"""
    return any(v.unpack_hook is not None for v in saved_variables)


def first_hooked(raws, tensor_attrs):
    """(variable, its ``_saved_*`` attribute): the first saved variable with an unpack hook,
    which decides whose the node's saved tensors are (take_saved); None if none has one."""
    for raw, attr in zip(raws, tensor_attrs):
        for var in (raw if type(raw) is tuple else (raw,)):
            if var.unpack_hook is not None:
                return var, attr
    return None


def foreign_hooks(node, raw_attrs: tuple) -> bool:
    """Would take_saved find the node's saved tensors under the user's hooks (ForeignHooks)?"""
    hooked = first_hooked([getattr(node, attr) for attr in raw_attrs], raw_attrs)
    return hooked is not None and not is_ours(hooked[0].unpack_hook) and not node.metadata.get(RELEASED_KEY)


def _adopt(node, var, attr, raw_attrs, tensor_attrs, subclasses_too=False):
    """The saved variables already have hooks: an earlier gradfx run's, or the user's.  An
    earlier trace through a tensor subclass hooked them too: they stay the node's
    (SubclassSaved) unless ``subclasses_too``."""
    if not is_ours(var.unpack_hook):
        if node.metadata.get(RELEASED_KEY):  # released by an earlier backward (ForeignOwned)
            raise RuntimeError(FREED_MESSAGE)
        raise ForeignHooks(f"{node.name()} has saved tensors under saved_tensors_hooks")
    _substitution.probe = True
    try:
        getattr(node, attr)
        raise AssertionError("gradfx's unpack hook did not answer the probe")
    except _Probe as probe:  # our unpack hands back its owner while probing
        owned = probe.owner
    finally:
        _substitution.probe = False
    if owned.released:
        raise RuntimeError(FREED_MESSAGE)
    types = _subclass_types([tuple(owned.tensors)])
    if types is not None and not subclasses_too:
        raise SubclassSaved(types)
    owned.check_versions()
    # As the node unpacks them (through gradfx's hook): with their autograd history,
    # which a create_graph backward's graph needs.
    tensors = []
    for attr in tensor_attrs:
        values = getattr(node, attr)
        tensors += [v for v in (values if type(values) is tuple else (values,)) if v is not None]
    return owned, owned.mask, tensors


def substituted(node, name: str):
    """The fake standing for ``node``'s saved tensor ``name`` while tracing, read without
    unpacking (which records a detach, a fake-tensor op of its own); None where there is
    none (not a gradfx-owned tensor, an undefined or a list entry)."""
    table = _substitution.table
    raw = getattr(node, "_raw_saved_" + name, None)
    hook = getattr(raw, "unpack_hook", None)
    if table is None or hook is None or not is_ours(hook):
        return None
    return table.get((id(hook.args[0]), hook.args[1]))


class substitute:
    """Context: while tracing, unpacking a gradfx-owned saved tensor yields a fake."""

    def __init__(self, table: dict):
        self.table = table

    def __enter__(self):
        self.prev = _substitution.table
        _substitution.table = self.table
        return self

    def __exit__(self, *exc):
        _substitution.table = self.prev
