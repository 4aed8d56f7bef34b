"""Sees hook registrations that cannot be discovered by walking grad_fn nodes.

A leaf's hooks are visible on the tensor (``_backward_hooks``,
``_post_accumulate_grad_hooks``), but a hook on a non-leaf tensor, ``retain_grad()``
on a non-leaf, and ``grad_fn.register_hook``/``register_prehook`` are stored inside
the C++ node, which Python cannot read back.  Every one of those registrations goes
through a Python function, so gradfx wraps those functions (once, at import) and
records what was registered:

* tensor hooks / retain_grad on non-leaf tensors: by ``id(grad_fn)``, with weak
  references to the tensor and its hook dict (the node keeps the dict alive, so a
  live dict means a live node and the id cannot have been reused);
* node hooks: the registration does not say which node, so gradfx only knows that
  *some* node has hooks (the dicts are tracked weakly while non-empty).

The walker asks :func:`hooks_on` whether a graph contains hooks gradfx did not
capture, and falls back rather than run without them.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch.autograd.function import _HookMixin

# id(grad_fn) -> list of (tensor weakref, hooks-dict weakref or None, kind)
_by_node: dict[int, list] = {}
# Tensors with retain_grad()/hooks, to catch a grad_fn replaced by an in-place op.
_tensors: "weakref.WeakSet[torch.Tensor]" = weakref.WeakSet()
# Hook dicts created for grad_fn.register_hook / register_prehook, by id (dicts
# compare by content, so they cannot go in a WeakSet); entries drop when they die.
_node_hook_dicts: dict[int, weakref.ref] = {}


class _NodeHookDict(OrderedDict):
    """Marks a dict as holding hooks of some autograd node."""


def _record(tensor: torch.Tensor, hooks_dict, kind: str) -> None:
    node = tensor.grad_fn
    if node is None:
        return
    entries = _by_node.setdefault(id(node), [])
    entries[:] = [e for e in entries if e[0]() is not None or (e[1] is not None and e[1]() is not None)]
    entries.append((weakref.ref(tensor), None if hooks_dict is None else weakref.ref(hooks_dict), kind))
    _tensors.add(tensor)


_orig_register_hook = torch.Tensor.register_hook
_orig_retain_grad = torch.Tensor.retain_grad
_orig_node_register = _HookMixin._register_hook


def _register_hook(self, hook):
    handle = _orig_register_hook(self, hook)
    if self.grad_fn is not None:
        _record(self, self._backward_hooks, "tensor_hook")
    return handle


def _retain_grad(self):
    _orig_retain_grad(self)
    if self.grad_fn is not None:
        _record(self, None, "retain_grad")


def _node_register(backward_hooks, hook):
    if backward_hooks is None:
        backward_hooks = _NodeHookDict()
        key = id(backward_hooks)
        _node_hook_dicts[key] = weakref.ref(backward_hooks, lambda _: _node_hook_dicts.pop(key, None))
    return _orig_node_register(backward_hooks, hook)


def install() -> None:
    """Wrap the registration functions (idempotent)."""
    if torch.Tensor.register_hook is not _register_hook:
        _register_hook.__doc__ = _orig_register_hook.__doc__
        torch.Tensor.register_hook = _register_hook
        torch.Tensor.retain_grad = _retain_grad
        _HookMixin._register_hook = staticmethod(_node_register)


def _live(entry, node) -> bool:
    tensor_ref, dict_ref, kind = entry
    tensor = tensor_ref()
    if tensor is not None and tensor.grad_fn is not node:
        return False  # the tensor moved on (in-place op); its new node is checked below
    if kind == "retain_grad":
        return tensor is not None
    hooks = dict_ref() if dict_ref is not None else None
    return bool(hooks)


def active() -> bool:
    """Cheap test: has any hook gradfx cannot see on nodes ever been registered?"""
    return bool(_by_node) or bool(_node_hook_dicts)


def hooks_on(nodes) -> str | None:
    """Name the first hook gradfx cannot capture on any of ``nodes``, or None."""
    if any(ref() for ref in list(_node_hook_dicts.values())):
        return "a grad_fn.register_hook/register_prehook hook is registered on some node"
    if _by_node:
        ids = {id(n): n for n in nodes}
        for node_id, entries in _by_node.items():
            node = ids.get(node_id)
            if node is not None and any(_live(e, node) for e in entries):
                return f"a hook or retain_grad() on the output of {node.name()}"
        for tensor in list(_tensors):
            node = tensor.grad_fn
            if node is not None and id(node) in ids and (tensor.retains_grad or tensor._backward_hooks):
                return f"a hook or retain_grad() on the output of {node.name()}"
    return None
