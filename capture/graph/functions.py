"""Custom ``torch.autograd.Function`` support: the traceable marker and ctx facts.

By default a custom Function's backward runs as an opaque ``call_backward`` node
that calls the user's ``backward`` with the real ctx at run time.  A Function
whose backward is plain tensor code can be marked traceable::

    @gradfx.traceable
    class ScaledGelu(torch.autograd.Function):
        ...

and its backward is then traced into aten ops in the graph (ctx's saved tensors
become graph inputs, its other attributes are part of the cache key), so a
backend can fuse it.  A traced backward that fails on fake tensors runs opaquely.
A custom op's ``register_autograd`` backward is traced the same way: torch requires it
to be traceable.
"""

from __future__ import annotations

from torch.autograd.function import FunctionCtx


def traceable(function_class):
    """Mark a custom autograd.Function so that gradfx traces its backward."""
    function_class._gradfx_traceable = True
    return function_class


def promised_traceable(function_class) -> bool:
    """Is this Function's backward promised traceable: marked with :func:`traceable`, or the
    Function torch.library makes for a custom op's ``register_autograd``?  torch requires
    that backward to be traceable (no ``data_ptr``, no global state read or written), the
    promise ``traceable`` asks for; custom ops it calls stay calls of those ops."""
    if getattr(function_class, "_gradfx_traceable", False):
        return True
    return ((function_class.__module__ == _CUSTOM_OP_AUTOGRAD
             and function_class.__name__.startswith("GeneratedBackwardFor_"))
            or dtensor_function(function_class))


def dtensor_function(node_or_function_class) -> bool:
    """Is this one of DTensor's own Functions (or its backward node's type)?"""
    cls = getattr(node_or_function_class, "_forward_cls", node_or_function_class)
    return (cls.__module__, cls.__name__) in _DTENSOR_FUNCTIONS


# Where torch.library builds a custom op's autograd.Function (torch 2.11-2.14).
_CUSTOM_OP_AUTOGRAD = "torch._library.autograd"

# DTensor's own Functions (to_local, from_local, redistribute; torch 2.11-2.14): their
# backwards wrap, unwrap and redistribute DTensor gradients, with no state but their
# ctx, which the tracer traces through (graph.subclasses).
_DTENSOR_FUNCTIONS = frozenset({("torch.distributed.tensor._api", "_ToTorchTensor"),
                                ("torch.distributed.tensor._api", "_FromTorchTensor"),
                                ("torch.distributed.tensor._redistribute", "Redistribute")})


_orig_set_materialize_grads = FunctionCtx.set_materialize_grads


def _set_materialize_grads(self, value: bool):
    self.__dict__["_gradfx_materialize_grads"] = bool(value)
    return _orig_set_materialize_grads(self, value)


def install() -> None:
    """Keep a readable copy of ctx.materialize_grads (the C++ field is write-only)."""
    if FunctionCtx.set_materialize_grads is not _set_materialize_grads:
        _set_materialize_grads.__doc__ = _orig_set_materialize_grads.__doc__
        FunctionCtx.set_materialize_grads = _set_materialize_grads
    # torch's own identity Function behind module backward hooks is traceable.
    from torch.nn.modules._functions import BackwardHookFunction
    traceable(BackwardHookFunction)
