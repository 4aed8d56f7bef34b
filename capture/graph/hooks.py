"""Finds the hooks that walking grad_fn nodes cannot see directly.

A leaf's hooks are visible on the tensor (``_backward_hooks``,
``_post_accumulate_grad_hooks``).  The others live inside C++ nodes:

* node pre- and post-hooks (``grad_fn.register_prehook`` / ``register_hook``,
  however the receiver was written: ``t.grad_fn.register_hook(h)``,
  ``out.grad_fn.next_functions[0][0].register_hook(h)``, module hooks).  Every
  registration passes the node's current hook dict (or None) to
  ``_HookMixin._register_hook`` and attaches a new dict to the node only after
  that call returns.  gradfx's wrapper of that function answers a *probe*: while
  probing (on this thread) it raises with the dict it was given, so
  ``node.register_prehook(None)`` reads the node's pre-hook dict and leaves the
  node unchanged.  Probing is needed only while some node-hook dict is alive;
  the wrapper counts them (weakly), and a walk stops probing once it has found
  them all.
* hooks on non-leaf tensors (tensor pre-hooks of their ``grad_fn``): the wrapper
  of ``Tensor.register_hook`` records the tensor's hook dict by the node's
  ``torch_releases.node_token``, with the node's type and sequence number as a
  witness against a reused id;
* ``retain_grad()`` on non-leaf tensors: the tensor, weakly; its node is read at
  walk time, because an in-place op moves the retains-grad hook to the new
  ``grad_fn``.

Outside a probe every wrapper only calls the original and takes notes, so eager
code sees the same results, errors, hook order and handles as without gradfx.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
from torch.autograd.function import _HookMixin
from torch.overrides import has_torch_function_unary

from ..torch_releases import node_token
from . import distributed, subclasses
from .saved import plain_type, unreadable


@dataclass
class _TensorHooks:
    witness: tuple  # (type, sequence number) of the node
    dicts: list  # (output_nr, weakref to the tensor's hook dict)


_tensor_pre: dict[int, _TensorHooks] = {}  # node_token(grad_fn) -> hook dicts of its outputs
_retained: dict[int, weakref.ref] = {}  # id(tensor) -> tensor, for retain_grad()
_node_dicts: dict[int, weakref.ref] = {}  # live node-hook dicts, by id


class _Probe(threading.local):
    active = False


_probe = _Probe()


class _Watch(threading.local):
    touched = None  # while a node runs opaquely: ids of the node-hook dicts given a hook


_watch = _Watch()


def watch_registrations():
    """Note the node hooks registered from now on (on this thread); returns what
    :func:`post_hook_added` needs to stop."""
    previous = _watch.touched
    _watch.touched = set()
    return previous


def post_hook_added(node, previous) -> bool:
    """Stop noting; did ``node`` get a post-hook meanwhile?  Eager runs a post-hook
    registered while its node ran (it reads them after the node): a graph cannot."""
    touched = _watch.touched
    _watch.touched = previous
    if not touched:
        return False
    if previous is not None:
        previous |= touched  # the node running around this one saw them registered too
    post = _probe_node(node)[1]
    return post is not None and id(post) in touched


class _ProbeAnswer(Exception):
    """Raised by the wrapper while probing: carries the node's current hook dict."""


def _witness(node) -> tuple:
    return (type(node), node._sequence_nr())


def _forget(table: dict, key: int, ref) -> None:
    if table.get(key) is ref:  # not an entry made since for a reused id
        del table[key]


_orig_register_hook = torch.Tensor.register_hook
_orig_retain_grad = torch.Tensor.retain_grad
_orig_node_register = _HookMixin._register_hook


def register_hook(self, hook):
    if has_torch_function_unary(self):
        # torch dispatches to the subclass, which calls back here with its
        # __torch_function__ disabled: notes are taken then, reading nothing now.
        return _orig_register_hook(self, hook)
    fresh = self._backward_hooks is None
    handle = _orig_register_hook(self, hook)
    node = self.grad_fn
    if fresh and node is not None:
        key = node_token(node)
        entry = _tensor_pre.get(key)
        if entry is None or entry.witness != _witness(node):
            entry = _tensor_pre[key] = _TensorHooks(_witness(node), [])
        entry.dicts.append((self.output_nr, weakref.ref(self._backward_hooks,
                                                        lambda _, key=key: _prune_tensor_pre(key))))
    return handle


def retain_grad(self):
    result = _orig_retain_grad(self)
    if not has_torch_function_unary(self) and self.grad_fn is not None:
        key = id(self)
        if key not in _retained or _retained[key]() is not self:
            _retained[key] = weakref.ref(self, lambda ref, key=key: _forget(_retained, key, ref))
    return result


def _register_node_hook(backward_hooks, hook):
    if _probe.active:
        raise _ProbeAnswer(backward_hooks)
    result = _orig_node_register(backward_hooks, hook)
    if _watch.touched is not None:  # a node runs opaquely: note which dict got a hook
        _watch.touched.add(id(result[0]))
    if backward_hooks is None:  # a new dict, attached to its node when this returns
        created = result[0]
        key = id(created)
        _node_dicts[key] = weakref.ref(created, lambda ref, key=key: _forget(_node_dicts, key, ref))
    return result


def _prune_tensor_pre(key: int) -> None:
    entry = _tensor_pre.get(key)
    if entry is not None:
        entry.dicts = [e for e in entry.dicts if e[1]() is not None]
        if not entry.dicts:
            del _tensor_pre[key]


def install() -> None:
    """Wrap the registration functions (idempotent)."""
    if torch.Tensor.register_hook is not register_hook:
        for wrapper, orig in ((register_hook, _orig_register_hook), (retain_grad, _orig_retain_grad)):
            wrapper.__doc__ = orig.__doc__
            wrapper.__qualname__ = f"Tensor.{orig.__name__}"
            wrapper.__module__ = getattr(orig, "__module__", None) or "torch._tensor"
        torch.Tensor.register_hook = register_hook
        torch.Tensor.retain_grad = retain_grad
        _HookMixin._register_hook = staticmethod(_register_node_hook)


def none_possible() -> tuple:
    """The dicts ``active`` looks at (never replaced, only changed): no node can have such
    hooks while all three are empty.  For a walker that asks on every backward, inline."""
    return _tensor_pre, _retained, _node_dicts


def active() -> "WalkState | None":
    """For one walk: None if no node of any graph can have hooks this module must find
    (the cheap, common case), else the walk's :class:`WalkState`."""
    if _tensor_pre or _retained or _node_dicts:
        return WalkState(len(_node_dicts))
    return None


class WalkState:
    """What one walk still has to find: the live node-hook dicts not yet seen.

    Every node-hook dict is created through the registration wrapper, so once a walk
    has found all of them on its nodes, no later node of the walk has one and the
    probe (two caught exceptions per node) is skipped.  Dicts of other live graphs
    are never found here; then every node is probed, as before.
    """

    __slots__ = ("unfound",)

    def __init__(self, unfound: int):
        self.unfound = unfound


def _probe_node(node) -> tuple:
    """(pre-hook dict, post-hook dict) of ``node``, each None if it has none."""
    _probe.active = True
    try:
        try:
            node.register_prehook(None)
            raise AssertionError("gradfx's node-hook probe was not answered")
        except _ProbeAnswer as answer:
            pre = answer.args[0]
        try:
            node.register_hook(None)
            raise AssertionError("gradfx's node-hook probe was not answered")
        except _ProbeAnswer as answer:
            post = answer.args[0]
    finally:
        _probe.active = False
    return pre, post


class Found:
    """The hooks of one node, each kind in eager's order (callables; tensors for retain)."""

    __slots__ = ("tensor_pre", "retain", "pre", "post", "post_accumulate", "node", "native_post")

    def __init__(self, node=None):
        self.tensor_pre = []  # (output_nr, [callables])
        self.retain = []  # (output_nr, tensor)
        self.pre = ()
        self.post = ()
        self.post_accumulate = ()
        # an accumulator itself, what its hooks see as the running node (the graph
        # takes every other node as an input anyway)
        self.node = node
        self.native_post = False  # an accumulator with C++ post-hooks (kinds.HookSpec.native_post)

    def key(self) -> tuple:
        """The hooks' shape: part of the structure key (kinds.HookSpec.key is the same)."""
        return (tuple((nr, len(c)) for nr, c in self.tensor_pre), tuple(nr for nr, _ in self.retain),
                len(self.pre), tuple(map(hands_on_incoming, self.post)),
                tuple(map(distributed.reducer_hook_alone, self.post_accumulate)), self.native_post)

    def inputs(self) -> list:
        """The runtime inputs, in the order the walk adds them."""
        out = [h for _, callables in self.tensor_pre for h in callables]
        out += [t for _, t in self.retain]
        out += self.pre
        out += self.post
        out += self.post_accumulate
        if self.node is not None:
            out.append(self.node)
        return out


_MODULE_OUTPUT_HOOK = "BackwardHook.setup_output_hook.<locals>.fn.<locals>.hook"


def hands_on_incoming(post_hook) -> bool:
    """Is this the post-hook of a module's full backward hooks on its outputs, with no
    module backward pre-hook?  It returns the node's incoming gradients as its outputs
    (None where an output of the module got none), whatever the node computed: the
    trace knows which are None (the module output that was not used)."""
    if getattr(post_hook, "__qualname__", None) != _MODULE_OUTPUT_HOOK:
        return False
    cells = dict(zip(post_hook.__code__.co_freevars, post_hook.__closure__ or ()))
    owner = cells["self"].cell_contents if "self" in cells else None
    return isinstance(owner, torch.utils.hooks.BackwardHook) and not owner.user_pre_hooks


def leaf_hooks(variable) -> tuple:
    """A leaf's (``_backward_hooks``, ``_post_accumulate_grad_hooks``), read without running a
    subclass's ``__torch_function__`` (ExpandedWeight's would refuse the read)."""
    if plain_type(type(variable)):
        return variable._backward_hooks, variable._post_accumulate_grad_hooks
    with torch._C.DisableTorchFunctionSubclass():
        return variable._backward_hooks, variable._post_accumulate_grad_hooks


def collect(node, variable, retained, active: WalkState | None) -> Found | None:
    """Every hook of ``node`` (``variable``: its leaf, for an accumulator), or None.

    ``retained``: (output_nr, tensor) of the retain_grad() tensors whose grad_fn
    is ``node``; ``active``: the walk's :func:`active` (when None only a leaf's own
    hooks are read).
    """
    leaf = node if variable is not None else None  # an accumulator: its hooks' running node
    found = None
    if variable is not None:
        backward, post_accumulate = leaf_hooks(variable)
        if backward:
            found = Found(leaf)
            found.tensor_pre.append((0, list(backward.values())))
        if post_accumulate:
            found = found or Found(leaf)
            found.post_accumulate = list(post_accumulate.values())
        if distributed.initialized() and distributed.cpp_hooked(node):
            found = found or Found(leaf)
            found.native_post = True
    if not active:
        return found
    entry = _tensor_pre.get(node_token(node)) if _tensor_pre else None
    if entry is not None and entry.witness == _witness(node):
        tensor_pre = _callables(entry)
        if tensor_pre:
            found = found or Found(leaf)
            found.tensor_pre += tensor_pre
    if retained:
        found = found or Found(leaf)
        found.retain = list(retained)
    if active.unfound and _node_dicts:
        pre, post = _probe_node(node)
        for d in (pre, post):
            if d is not None and id(d) in _node_dicts:
                active.unfound -= 1
        if pre or post:
            found = found or Found(leaf)
            found.pre = list(pre.values()) if pre else ()
            found.post = list(post.values()) if post else ()
    return found


def _callables(entry: _TensorHooks) -> list:
    """(output_nr, [callables]) per hooked output of the entry's node, in registration order."""
    return [(nr, list(d.values())) for nr, ref in entry.dicts if (d := ref())]


def tensor_pre_of_walk(nodes, seq) -> dict:
    """node index -> [(output_nr, [callables])] of the walk's nodes with tensor pre-hooks,
    as ``collect`` finds them, found from the registry's side: each entry's witness names
    the nodes of the walk it may be (by sequence number, ``seq``), and only those are
    asked for their token.  No object is made for the walk's other nodes (``nodes`` may
    make them when asked: a one-call walk's)."""
    found = {}
    for key, entry in list(_tensor_pre.items()):  # a weakref callback may prune it meanwhile
        node_type, number = entry.witness
        k = -1
        while True:
            try:
                k = seq.index(number, k + 1)
            except ValueError:
                break
            node = nodes[k]
            if type(node) is node_type and node_token(node) == key:
                callables = _callables(entry)
                if callables:
                    found[k] = callables
                break
    return found


def retained_by_node(index: dict) -> dict:
    """node index -> [(output_nr, tensor)] of the retain_grad() tensors whose grad_fn is
    in ``index`` (id(node) -> node index)."""
    found: dict = {}
    if not _retained:
        return found
    for ref in list(_retained.values()):
        tensor = ref()
        if tensor is None:
            continue
        if type(tensor) is not torch.Tensor and type(tensor) is not torch.nn.Parameter and \
                not subclasses.traceable(type(tensor)):
            # A subclass (the wrapper notes it when its __torch_function__ calls back):
            # its node read past that and its own properties; in this walk, it falls back.
            # (One traced through, a DTensor, has no __torch_function__: read as a tensor.)
            with torch._C.DisableTorchFunction():
                node = torch._C.TensorBase.grad_fn.__get__(tensor)
            if id(node) in index:
                raise unreadable(f"a tensor subclass ({type(tensor).__name__})", "retaining grad, an output", node)
            continue
        if not tensor.retains_grad:
            continue
        node = tensor.grad_fn
        if node is not None:
            i = index.get(id(node))
            if i is not None:
                found.setdefault(i, []).append((tensor.output_nr, tensor))
    return found
