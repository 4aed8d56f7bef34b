"""Finds the hooks that walking grad_fn nodes cannot see.

A leaf's hooks are visible on the tensor (``_backward_hooks``,
``_post_accumulate_grad_hooks``).  The others live inside C++ nodes, which Python
cannot read back: hooks on non-leaf tensors, ``retain_grad()`` on non-leaf
tensors, and ``grad_fn.register_hook`` / ``register_prehook``.  Every one of those
registrations goes through a Python function, so gradfx wraps those functions (at
import) and records what was registered on which node:

* tensor hooks on a non-leaf: its hook dict, by ``id(grad_fn)``, with the node's
  type and sequence number as a witness against a reused id;
* ``retain_grad()``: the tensor (a weak set); its node is read at walk time,
  because an in-place op moves the retains-grad hook to the new ``grad_fn``;
* node hooks: the registration does not say which node.  gradfx reads the
  caller's bytecode: for ``name.register_hook(...)`` (``name`` a local, global
  or closure variable: e.g. ``acc = p.view_as(p).grad_fn.next_functions[0][0];
  acc.register_hook(h)``, or torch's module backward hooks) the receiver is known
  exactly.  Anything else is recorded as unattributed, and a backward that might
  meet it falls back to eager instead of running without it.
"""

from __future__ import annotations

import dis
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch.autograd.function import _HookMixin
from torch.overrides import has_torch_function_unary


class _HookDict(OrderedDict):
    """An OrderedDict that can be weakly referenced by identity (hook dicts)."""

    __hash__ = object.__hash__


@dataclass
class NodeHooks:
    """Hooks registered on one autograd node, in registration order."""

    witness: tuple  # (type, sequence number) of the node
    tensor_pre: list = field(default_factory=list)  # (output_nr, dict ref)
    pre: list = field(default_factory=list)  # dict refs
    post: list = field(default_factory=list)  # dict refs

    def prune(self) -> bool:
        """Drop dead dicts; True if nothing is left."""
        self.tensor_pre = [e for e in self.tensor_pre if e[1]() is not None]
        self.pre = [r for r in self.pre if r() is not None]
        self.post = [r for r in self.post if r() is not None]
        return not (self.tensor_pre or self.pre or self.post)


_by_node: dict[int, NodeHooks] = {}
_retained: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
# Node hook dicts whose node could not be told, by id (entries die with the dict).
_unattributed: dict[int, weakref.ref] = {}
_attribution_cache: dict[tuple, tuple | None] = {}


def _witness(node) -> tuple:
    return (type(node), node._sequence_nr())


def _entry(node) -> NodeHooks:
    key = id(node)
    entry = _by_node.get(key)
    if entry is None or entry.witness != _witness(node) or entry.prune():
        entry = _by_node[key] = NodeHooks(_witness(node))
    return entry


def _drop_if_dead(key: int) -> None:
    entry = _by_node.get(key)
    if entry is not None and entry.prune():
        del _by_node[key]


_orig_register_hook = torch.Tensor.register_hook
_orig_retain_grad = torch.Tensor.retain_grad
_orig_node_register = _HookMixin._register_hook


def _register_hook(self, hook):
    fresh = (self.grad_fn is not None and self._backward_hooks is None
             and not has_torch_function_unary(self))
    if fresh:
        # Give the node a dict we can weakly reference; torch registers it as is.
        self._backward_hooks = _HookDict()
        self.grad_fn._register_hook_dict(self)
        key = id(self.grad_fn)
        _entry(self.grad_fn).tensor_pre.append(
            (self.output_nr, weakref.ref(self._backward_hooks, lambda _: _drop_if_dead(key))))
    return _orig_register_hook(self, hook)


def _retain_grad(self):
    _orig_retain_grad(self)
    if self.grad_fn is not None:
        _retained.add(self)


def _node_register(backward_hooks, hook):
    if backward_hooks is None:
        backward_hooks = _HookDict()
        target = _receiver(sys._getframe(1))
        if target is None:
            key = id(backward_hooks)
            _unattributed[key] = weakref.ref(backward_hooks, lambda _: _unattributed.pop(key, None))
        else:
            node, kind = target
            key = id(node)
            getattr(_entry(node), kind).append(weakref.ref(backward_hooks, lambda _: _drop_if_dead(key)))
    return _orig_node_register(backward_hooks, hook)


_LOADS = {"LOAD_FAST", "LOAD_DEREF", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_CLOSURE"}
_METHODS = {"register_hook": "post", "register_prehook": "pre"}


def _receiver(frame):
    """(node, "pre"|"post") for a call ``name.register_hook(...)`` in ``frame``, else None."""
    code, lasti = frame.f_code, frame.f_lasti
    key = (code, lasti)
    if key not in _attribution_cache:
        _attribution_cache[key] = _call_pattern(code, lasti)
    pattern = _attribution_cache[key]
    if pattern is None:
        return None
    opname, name, kind = pattern
    if opname == "LOAD_FAST" or opname == "LOAD_NAME":
        obj = frame.f_locals.get(name, frame.f_globals.get(name))
    elif opname == "LOAD_GLOBAL":
        obj = frame.f_globals.get(name)
    else:
        obj = frame.f_locals.get(name)
    if obj is None or not isinstance(obj, torch.autograd.graph.Node):
        return None
    return obj, kind


def _call_pattern(code, lasti):
    instructions = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "EXTENDED_ARG")]
    at = [k for k, ins in enumerate(instructions) if ins.offset <= lasti]
    if not at:
        return None
    k = at[-1]
    # Walk back from the call to the method load; the instruction before it loads
    # the receiver.  Only a plain variable is accepted.
    while k > 0:
        ins = instructions[k]
        if ins.opname in ("LOAD_METHOD", "LOAD_ATTR") and ins.argval in _METHODS:
            prev = instructions[k - 1]
            if prev.opname in _LOADS:
                return prev.opname, prev.argval, _METHODS[ins.argval]
            return None
        k -= 1
    return None


def install() -> None:
    """Wrap the registration functions (idempotent)."""
    if torch.Tensor.register_hook is not _register_hook:
        _register_hook.__doc__ = _orig_register_hook.__doc__
        _retain_grad.__doc__ = _orig_retain_grad.__doc__
        torch.Tensor.register_hook = _register_hook
        torch.Tensor.retain_grad = _retain_grad
        _HookMixin._register_hook = staticmethod(_node_register)


def active() -> bool:
    """Cheap test: could any node of a graph have hooks recorded here?"""
    return bool(_by_node) or bool(_unattributed) or bool(_retained)


def none_on(nodes) -> bool:
    """True if no recorded hook or retain_grad() applies to any of ``nodes``."""
    if unattributed():
        return False
    if _by_node:
        for node in nodes:
            if id(node) in _by_node and node_hooks(node) is not None:
                return False
    if _retained:
        ids = set(map(id, nodes))
        for tensor in list(_retained):
            if tensor.retains_grad and id(tensor.grad_fn) in ids:
                return False
    return True


def unattributed() -> bool:
    """Is some node hook registered on a node gradfx could not identify?"""
    return any(ref() for ref in list(_unattributed.values()))


def node_hooks(node) -> NodeHooks | None:
    """The recorded hooks of ``node`` (None if it has none)."""
    entry = _by_node.get(id(node))
    if entry is None:
        return None
    if entry.witness != _witness(node) or entry.prune():
        del _by_node[id(node)]
        return None
    return entry


def retained_in(index: dict) -> list:
    """(node index, output_nr, tensor) for retain_grad() tensors whose node is in ``index``."""
    found = []
    for tensor in list(_retained):
        node = tensor.grad_fn
        if node is not None and tensor.retains_grad:
            i = index.get(id(node))
            if i is not None:
                found.append((i, tensor.output_nr, tensor))
    return found
