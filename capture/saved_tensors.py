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
"""

from __future__ import annotations

import threading
from functools import partial

FREED_MESSAGE = (
    "Trying to backward through the graph a second time (or directly access saved "
    "tensors after they have already been freed). Saved intermediate values of the "
    "graph are freed when you call .backward() or autograd.grad(). Specify "
    "retain_graph=True if you need to backward through the graph a second time or "
    "if you need to access saved tensors after calling backward."
)


class _State(threading.local):
    table = None  # while tracing: (id(owner), index) -> fake tensor
    probe = False  # while adopting: unpack raises _Probe(owner)


_substitution = _State()


class SavedTensors:
    """The saved tensors of one node, owned by gradfx (weak-referenceable)."""

    __slots__ = ("tensors", "released", "mask", "__weakref__")

    def __init__(self) -> None:
        self.tensors: list = []
        self.released = False
        self.mask: tuple = ()

    def hooks(self):
        """(pack, unpack) for the next saved variable.

        Both are C-level callables (a bound ``list.append`` and a ``partial``), so
        registering them costs no Python frame: this runs for every saved tensor
        of every backward.
        """
        return self.tensors.append, partial(_unpack, self, len(self.tensors))

    def release(self) -> None:
        self.released = True
        # In place: the saved variables' pack hooks are bound to this very list.
        self.tensors.clear()


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
    return owner.tensors[index]


def is_ours(unpack_hook) -> bool:
    return type(unpack_hook) is partial and unpack_hook.func is _unpack


class _Probe(Exception):
    def __init__(self, owner):
        self.owner = owner


class ForeignHooks(Exception):
    """A saved variable of this node carries the user's saved-tensor hooks."""


def take_saved(node, raw_attrs: tuple[str, ...], tensor_attrs: tuple[str, ...]):
    """Own the saved tensors of ``node``; return (SavedTensors, defined-mask).

    ``raw_attrs`` lists the node type's ``_raw_saved_*`` attributes (one
    SavedVariable or a tuple of them) and ``tensor_attrs`` the matching
    ``_saved_*`` ones.  Undefined (None) saved tensors are ``False`` in the mask.
    Raises eager's own RuntimeError if the saved tensors were freed or modified in
    place, ForeignHooks if the user's saved-tensor hooks own them.
    """
    owned = SavedTensors()
    mask = []
    for raw_attr, attr in zip(raw_attrs, tensor_attrs):
        raw = getattr(node, raw_attr)
        group = raw if type(raw) is tuple else (raw,)
        for var in group:
            if var.unpack_hook is not None:
                return _adopt(node, var, attr, tensor_attrs)
        # Unpacking without hooks runs eager's check that the tensor was not
        # modified in place since it was saved (and raises eager's error); once
        # hooks are registered the engine no longer checks.
        values = getattr(node, attr)
        if type(values) is not tuple:
            values = (values,)
        for var, value in zip(group, values):
            if value is None:
                mask.append(False)
                continue
            try:
                var.register_hooks(*owned.hooks())
            except RuntimeError:  # freed by the eager engine: eager's own error
                raise RuntimeError(FREED_MESSAGE) from None
            mask.append(True)
    owned.mask = tuple(mask)
    return owned, owned.mask


def _adopt(node, var, attr, tensor_attrs):
    """The saved variables already have hooks: an earlier gradfx run's, or the user's."""
    if not is_ours(var.unpack_hook):
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
    for attr in tensor_attrs:
        getattr(node, attr)  # eager's in-place modification check
    return owned, owned.mask


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
