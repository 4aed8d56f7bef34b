"""torch.compile'd regions: the AOT backward graph traced into gradfx's graph.

A region torch.compile compiled with AOTAutograd runs its backward as one custom
Function node (``CompiledFunctionBackward``, a class per region) whose ``backward``
prepares the tangents (its prologue), calls the region's compiled backward through
``CompiledFunction._backward_impl`` and arranges the outputs (its epilogue).
AOTAutograd keeps the backward graph it compiles from in
``_lazy_backward_info.bw_module`` (torch 2.11-2.14).

While gradfx traces such a node, the node's own ``backward`` runs on fakes, with
``_backward_impl`` replaced, on the tracing thread only, by that graph replayed op by
op: prologue, backward graph and epilogue are recorded as aten ops, so a compiler sees
the region together with the hooks and accumulations around it.  With the eager
backend the graph computes what the region's backward graph computes run eagerly
(bitwise equal to eager autograd where the region was compiled with ``aot_eager``;
an inductor-compiled region's own kernels round differently).

A region whose backward uses what a replay cannot give (tensor subclasses, RNG
functionalization, effect tokens, opaque objects, a backward compiled ahead without
its graph kept) stays an opaque call of its real backward.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref

import torch
import torch.fx as fx

from ..graph.regions import backward_graph, is_region

aten = torch.ops.aten
log = logging.getLogger("gradfx")

_state = threading.local()  # .replaying: the Function classes replayed on this thread


_told: "weakref.WeakSet" = weakref.WeakSet()  # region classes whose replay failure was logged


def say_why_opaque(function_cls, err: Exception) -> None:
    """Once per region, at INFO: its backward graph could not be replayed on fakes, so it
    runs as itself (uncompiled by gradfx's backend, a call in the graph)."""
    if function_cls in _told or not is_region(function_cls):
        return
    _told.add(function_cls)
    first = str(err).strip().splitlines()
    log.info("gradfx: a torch.compile'd region's backward (%s) runs as itself, not traced: %s: %s",
             function_cls.__name__, type(err).__name__, first[0] if first else "")


@contextlib.contextmanager
def with_saved_ints(ctx, values):
    """Inside: the region's backward reads ``values`` (symbols while tracing) as its ints."""
    kept = ctx.__dict__.get("symints")
    ctx.symints = list(values)
    try:
        yield
    finally:
        ctx.symints = kept


class _Replay(fx.Interpreter):
    """The backward graph run op by op.  Its views become reshapes, as torch's own
    compiled autograd does: the forward it pairs with may have been compiled with views
    turned into reshapes, so a tangent need not be viewable (same values either way)."""

    def call_function(self, target, args, kwargs):
        if target is aten.view.default:
            target = aten.reshape.default
        return super().call_function(target, args, kwargs)

    def get_attr(self, target, args, kwargs):
        """A tensor constant of the graph (AOT lifts ``torch.tensor(0.0)`` and masks so), made
        by an op the trace records: ``full`` of its one value.  A constant of several values
        has no such op (the region then runs as itself, saying why)."""
        value = super().get_attr(target, args, kwargs)
        if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
            return value
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():  # read the real constant, not through the trace's fake mode
            flat = value.detach().reshape(-1)
            if flat.numel() > 0 and not bool((flat == flat[0]).all()):
                raise TypeError(f"its backward graph holds a tensor constant of {flat.numel()} different "
                                f"values ({target}), which a traced graph cannot take")
            fill = flat[0].item() if flat.numel() else 0
        return torch.full(value.shape, fill, dtype=value.dtype, device=value.device)


def _replaying(original, function_cls):
    def backward_impl(ctx, all_args):
        if function_cls not in getattr(_state, "replaying", ()):
            return original(ctx, all_args)  # another thread's real backward
        return _Replay(backward_graph(function_cls)).run(*all_args)
    backward_impl.gradfx_replay = True
    return staticmethod(backward_impl)


_lock = threading.Lock()
_installed: dict = {}  # Function class -> [users, original staticmethod]


@contextlib.contextmanager
def replayed(function_cls):
    """Inside: on this thread, the region's backward replays its graph (see module doc)."""
    with _lock:
        entry = _installed.get(function_cls)
        if entry is None:
            original = function_cls.__dict__["_backward_impl"]
            entry = _installed[function_cls] = [0, original]
            function_cls._backward_impl = _replaying(original.__func__, function_cls)
        entry[0] += 1
    mine = getattr(_state, "replaying", frozenset())
    _state.replaying = mine | {function_cls}
    try:
        yield
    finally:
        _state.replaying = mine
        with _lock:
            entry[0] -= 1
            if entry[0] == 0:
                function_cls._backward_impl = entry[1]
                del _installed[function_cls]
