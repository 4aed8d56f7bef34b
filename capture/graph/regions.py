"""torch.compile'd regions as the walk reads them: which Function classes are regions
whose AOT backward graph gradfx replays (``trace.aot_regions`` replays it), and what
their ctx adds to the key and the sizes.

AOTAutograd keeps the backward graph it compiles from in
``_lazy_backward_info.bw_module`` (torch 2.11-2.14); a region loaded from inductor's FX
graph cache keeps it serialized (``bw_module_fn``).
"""

from __future__ import annotations

import weakref

import torch.fx as fx

_deserialized: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Function class -> its graph


def backward_graph(function_cls):
    """The AOT backward graph of a compiled region's Function class, or None where gradfx
    does not replay it (not a compiled region, or one of the cases in the module doc)."""
    info = getattr(function_cls, "_lazy_backward_info", None)
    module = getattr(info, "bw_module", None)
    if module is None and callable(getattr(info, "bw_module_fn", None)):
        # A region loaded from inductor's FX graph cache keeps its graph serialized.
        module = _deserialized.get(function_cls)
        if module is None:
            module = _deserialized[function_cls] = info.bw_module_fn()
    if not isinstance(module, fx.GraphModule) or not callable(getattr(function_cls, "_backward_impl", None)):
        return None
    metadata = getattr(function_cls, "metadata", None)
    if (getattr(function_cls, "maybe_subclass_metadata", None) is not None
            or getattr(metadata, "is_rng_op_functionalized", True) or getattr(metadata, "tokens", True)):
        return None
    return module


def is_region(function_cls) -> bool:
    return backward_graph(function_cls) is not None


def ctx_key(ctx) -> tuple | None:
    """A region's ctx for the key: how many ints it saved (``symints``: sizes, which go to
    the walk's sizes, guarded or symbolic); None where it holds opaque objects or saved
    something else (the node stays opaque)."""
    ints = ctx.__dict__.get("symints", ())
    if ctx.__dict__.get("opaque_objects") or any(type(v) is not int for v in ints):
        return None
    return ("aot region", len(ints))


def saved_ints(ctx) -> list:
    return list(ctx.__dict__.get("symints", ()))
