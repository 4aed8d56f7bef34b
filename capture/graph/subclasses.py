"""Tensor subclasses that follow torch's flatten protocol, read as their inner tensors.

A wrapper subclass with ``__tensor_flatten__`` / ``__tensor_unflatten__`` (DTensor, a
quantized weight) and no ``__torch_function__`` of its own is a context (for DTensor its
mesh, placements and global shape) around plain inner tensors.  Such a value can be
traced: the graph takes its inner tensors, the subclass's ``__torch_dispatch__`` runs
at trace time on fakes wrapped the same way and records its ops on the inner ones, and
the graph rebuilds the subclass wherever a runtime call (a hook, an accumulation, a node
run as itself) must see it as eager would.  An inner value that is no tensor (DTensor's
device mesh, from torch 2.13) is a constant of the graph, like the context.

``layout`` describes a value for a cache key: a graph traced for one context is valid
only for that context and those inner layouts.  Reading it calls the subclass's
``__tensor_flatten__``, which by the protocol reads attributes and nothing else.
"""

from __future__ import annotations

import itertools
import sys
from collections import OrderedDict

import torch

# A subclass's __torch_function__ runs on Python calls alone (a formula's ops come from
# C++): torch's default one, or none, reads nothing gradfx does; any other may.
_HARMLESS = (torch._C._disabled_torch_function_impl, torch.Tensor.__torch_function__.__func__)


def traceable(tp: type) -> bool:
    """Is ``tp`` a subclass gradfx traces through: the flatten protocol, and no
    ``__torch_function__`` of its own?"""
    return (hasattr(tp, "__tensor_flatten__") and hasattr(tp, "__tensor_unflatten__")
            and getattr(tp.__torch_function__, "__func__", tp.__torch_function__) in _HARMLESS)


def flatten(t: torch.Tensor) -> tuple:
    """(inner attribute names, context) of a traceable subclass value."""
    names, ctx = t.__tensor_flatten__()
    return tuple(names), ctx


def layout(t: torch.Tensor):
    """What a trace bakes in of ``t``: for a plain tensor its type, sizes, strides, dtype and
    device; for a traceable subclass also its context and its inner tensors' layouts; for
    any other subclass its type alone (nodes it reaches run as themselves).  None where
    the context cannot be part of a key (unhashable)."""
    tp = type(t)
    if tp is torch.Tensor or tp is torch.nn.Parameter:
        if t.layout is not torch.strided:
            return (tp,)
        return (tp, tuple(t.shape), t.stride(), t.dtype, t.device)
    if not traceable(tp):
        return (tp,)
    names, ctx = flatten(t)
    inner = tuple(_inner_layout(getattr(t, n)) for n in names)
    key = (tp, names, ctx, tuple(t.shape), t.stride(), inner)
    try:
        hash(key)
    except TypeError:
        return (tp,)
    return key


def dispatch_state():
    """What DTensor's ``__torch_dispatch__`` reads besides the values, which a graph traced
    through it bakes in: its custom op handlers (``loss_parallel()`` adds its own while it
    is open) and whether implicit replication is allowed (None before DTensor is
    imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return None
    dispatcher = module.DTensor._op_dispatcher
    # the handlers themselves, not only their ops: a context may swap one op's handler
    return frozenset(dispatcher._custom_op_handlers.items()), dispatcher._allow_implicit_replication


def _inner_layout(value):
    return layout(value) if isinstance(value, torch.Tensor) else ("object", value)


def map_inner(t: torch.Tensor, fn):
    """``fn(t)`` for a plain tensor; for a traceable subclass, the subclass rebuilt (its
    ``__tensor_unflatten__``) around ``map_inner`` of each inner tensor, in order (its
    other inner values as they are)."""
    if not traceable(type(t)):
        return fn(t)
    names, ctx = flatten(t)
    parts = {}
    for n in names:
        part = getattr(t, n)
        parts[n] = map_inner(part, fn) if isinstance(part, torch.Tensor) else part
    return type(t).__tensor_unflatten__(parts, ctx, tuple(t.shape), tuple(t.stride()))


def flat_inner(t: torch.Tensor, out: list) -> None:
    """Append the plain tensors ``t`` consists of (``t`` itself if plain), depth first."""
    if not traceable(type(t)):
        out.append(t)
        return
    names, _ = flatten(t)
    for n in names:
        value = getattr(t, n)
        if isinstance(value, torch.Tensor):
            flat_inner(value, out)


_layout_ids: OrderedDict = OrderedDict()  # layouts -> id, the most recently asked last
_LAYOUTS_KEPT = 4096  # bounded: a forgotten one gets a new id (a capture), never a wrong graph
_FIRST_ID = 1 << 40  # far from any size, so that no size is ever related to one
_next_id = itertools.count(_FIRST_ID)


def layout_id(layouts) -> int:
    """A number standing for what a graph traced through subclasses bakes in: ``layouts``
    and DTensor's :func:`dispatch_state` (equal ones, equal numbers while remembered; a
    number is never given to others), among a backward's sizes: a static graph is found
    by its exact sizes."""
    layouts = (layouts, dispatch_state())
    found = _layout_ids.get(layouts)
    if found is None:
        found = _layout_ids[layouts] = next(_next_id)
        if len(_layout_ids) > _LAYOUTS_KEPT:
            _layout_ids.popitem(last=False)
    else:
        _layout_ids.move_to_end(layouts)
    return found
