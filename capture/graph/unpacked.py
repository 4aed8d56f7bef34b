"""Saved tensors under the user's ``saved_tensors_hooks``, unpacked by gradfx.

Non-reentrant checkpointing, ``save_on_cpu`` and offloading hooks put a node's saved
tensors under the user's pack/unpack hooks.  What such a node's formula reads exists
only once the unpack hook has run, in the backward, inside the node (the engine
unpacks every saved variable at the start of the node's ``apply``).  So gradfx cannot
know it when it captures, and it cannot hand the node fakes of it by itself.

The compiled part lets gradfx run the formula on tensors of its choosing: while
``with_saved`` calls the node, the node's saved variables hold those tensors as
plain saved variables, with no hook (native/saved.cpp).  gradfx then does the node's
unpacks itself (``unpack_at``): once per variable, in the order the ``apply`` unpacks
them, so the user's hooks run as often, in the same order and at the same point of the
backward as in eager.  It then runs the formula on what the hooks gave.

* The first backward of a structure runs such a node that way for real
  (``runtime_ops.NodeUnpacking``), and the unpacked tensors' layouts are learned
  (:class:`Learner`).
* The next capture of the structure traces the node's formula on fakes of those layouts.
  The graph calls the unpacks at the node's place (``runtime_ops.SavedUnpack``) and
  checks each result against its layout; if one differs, the graph stops there and the
  rest of the backward runs node by node from those very tensors (``run.continuation``),
  and the layouts it found are learned for the next capture.

A checkpoint's recomputation happens inside its unpack hook, so it runs in the backward
as eager runs it: as often, in the same place, and with its own RNG state. A
compiler sees the formulas around it.
"""

from __future__ import annotations

import torch

from .. import native

UNFIT = "unfit"  # an unpacked value the trace cannot stand in for (a subclass, a sparse tensor, ...)


class Plan:
    """How a node type's saved variables are unpacked: ``raws`` (its ``_raw_saved_*``),
    ``attrs`` (the matching ``_saved_*`` getters) and ``offsets`` (where the variables lie in
    the node, for the compiled part), in the order its ``apply`` unpacks them."""

    __slots__ = ("raws", "attrs", "offsets")

    def __init__(self, raws: tuple, attrs: tuple, offsets: tuple):
        self.raws = raws
        self.attrs = attrs
        self.offsets = offsets

    def variables(self, node) -> tuple:
        return tuple(getattr(node, raw) for raw in self.raws)


_plans: dict = {}


def plan(node, info) -> Plan | None:
    """The unpack plan of a builtin node, or None where gradfx cannot unpack for it (the
    node then runs as itself): no compiled part, or a list of saved tensors.

    A generated node declares its saved variables in the order its ``apply`` unpacks them
    (inputs by name, then outputs by name), and C++ lays members out in declaration order.
    So the variables' offsets in the node give that order.  ``dir()`` gives it only by
    accident (alphabetically, ``result`` comes before ``self``).
    """
    reader = native.module()
    if reader is None or not info.raw_saved:
        return None  # not kept: the compiled part may load later
    key = type(node)
    if key in _plans:
        return _plans[key]
    raws = tuple(getattr(node, raw) for raw in info.raw_saved)
    offsets = None if any(type(r) is tuple for r in raws) else reader.offsets(node, raws)
    found = None
    if offsets is not None:
        order = sorted(range(len(offsets)), key=offsets.__getitem__)
        found = Plan(tuple(info.raw_saved[k] for k in order), tuple(info.saved_tensors[k] for k in order),
                     tuple(offsets[k] for k in order))
    _plans[key] = found
    return found


def unpack(node, plan: Plan) -> tuple:
    """The node's saved tensors as its ``apply`` would unpack them: each variable once, in
    order (the user's unpack hooks run here; eager's errors are raised here).  The compiled
    part's reads where it is loaded, else the getters (which unpack the same way)."""
    reader = native.module()
    if reader is not None:
        return reader.unpack_at(node, plan.offsets)
    return tuple(getattr(node, attr) for attr in plan.attrs)


def planned(node_type) -> Plan | None:
    """The plan made for this node type, if any (no new one is made)."""
    return _plans.get(node_type)


def meta(value):
    """What a trace bakes in of an unpacked value: None (undefined), the layout of a plain
    strided tensor, or UNFIT."""
    if value is None:
        return None
    if type(value) is not torch.Tensor or value.layout is not torch.strided or value.is_conj() or value.is_neg():
        return UNFIT
    return (tuple(value.shape), value.stride(), value.dtype, value.device)


def fits(metas) -> bool:
    return metas is not None and UNFIT not in metas


def with_saved(node, plan: Plan, values: tuple, fn, args: tuple):
    """``fn(*args)`` while the node's saved variables hold ``values`` (no hooks)."""
    reader = native.module()
    if reader is None:  # only where the compiled part was turned off after the capture
        raise RuntimeError(f"gradfx: {node.name()} needs gradfx's compiled part, which is no longer loaded, to "
                           "run on the saved tensors its hooks unpacked")
    return reader.with_saved(plan.variables(node), values, fn, args)


class Learner:
    """Where the unpacks of one captured graph report the layouts they found: ``learn``
    (the driver's cache, ``cache.learn``) keys the structure's next capture by them."""

    __slots__ = ("base", "known", "learn")

    def __init__(self, base, known: dict, learn=None):
        self.base = base  # the structure, without assumptions
        self.known = known  # node index -> metas the graph was traced with (or learned since)
        self.learn = learn  # learn(structure, node index, metas); None: gradfx.capture's, keys nothing

    def learned(self, i: int, values: tuple) -> None:
        metas = tuple(map(meta, values))
        if self.learn is not None and self.known.get(i) != metas:
            self.known[i] = metas
            self.learn(self.base, i, metas)
