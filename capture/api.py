"""The public entry points: ``compiled_autograd`` and ``capture``."""

from __future__ import annotations

import torch

from .. import reorder
from . import pipeline
from .errors import Unsupported, _Fallback
from .graph import subclasses
from .graph.unpacked import Learner
from .graph.walk import walk_backward
from .run import self_check
from .run.cache import cache
from .run.session import Session, check_dynamic, unused_input_message
from .view import annotate
from .view.captured_graph import CapturedGraph


def compiled_autograd(backend="eager", *, dynamic="auto", strict=False, passes=None, names=None) -> Session:
    """Context manager: backward calls on this thread inside the block go through gradfx.

    ``backend``: a registered name or a compiler callable ``fn(gm, example_inputs)``
    (or ``fn(gm)``).  ``dynamic``: ``"auto"``, ``True`` or ``False``.  ``strict``:
    raise :class:`Unsupported` instead of falling back to eager.  ``passes``: the
    pass pipeline (names or callables), ``None`` for the default.  ``names``: an
    ``nn.Module`` or a mapping tensor -> name; leaves are shown under those names
    (display only: never part of the cache key).
    """
    return Session(backend, dynamic=dynamic, strict=strict, passes=passes, names=names)


def capture(outputs, grad_outputs=None, *, inputs=None, dynamic=False, names=None) -> CapturedGraph:
    """Trace the backward of ``outputs`` and return the graph, without running it.

    No gradient math runs, no hook is called, no ``.grad`` changes; a later
    ``backward()`` on the same outputs behaves as if ``capture`` was never called.
    Arguments that ``torch.autograd.grad(outputs, inputs)`` refuses raise its error
    here, before anything is captured: an output that does not require grad, an
    input that does not require grad, an input the outputs do not depend on.
    ``names``: as for :func:`compiled_autograd`.
    """
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    for t in outputs + ((inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs or ())):
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and not (
                isinstance(t, torch.Tensor) and subclasses.traceable(type(t))):
            # Reading a subclass's autograd graph would call its __torch_function__ (one
            # traced through, a DTensor loss or parameter, has none).
            raise Unsupported(f"gradfx.capture of a tensor subclass ({type(t).__name__})")
    for k, out in enumerate(outputs):
        if isinstance(out, torch.Tensor) and out.grad_fn is None and not out.requires_grad:
            raise RuntimeError(f"element {k} of tensors does not require grad and does not have a grad_fn")
    if grad_outputs is None:
        grad_outputs = (None,) * len(outputs)
    elif isinstance(grad_outputs, torch.Tensor):
        grad_outputs = (grad_outputs,)
    grads = []
    for out, g in zip(outputs, grad_outputs):
        if g is None:
            if out.numel() != 1:
                raise RuntimeError("grad can be implicitly created only for scalar outputs; "
                                   "pass grad_outputs for non-scalar outputs")
            g = torch.ones_like(out, memory_format=torch.preserve_format)
        grads.append(g)
    if inputs is not None:
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        if any(isinstance(t, torch.Tensor) and not t.requires_grad for t in inputs):
            raise RuntimeError("One of the differentiated Tensors does not require grad")
    check_dynamic(dynamic)
    refused = self_check.refusal()
    if refused is not None:
        raise Unsupported(refused)
    try:
        call = walk_backward(outputs, grads, inputs or (), accumulate=inputs is None)
    except _Fallback as fb:
        raise Unsupported(fb.reason) from None
    for k, found in enumerate(call.outputs or ()):
        if found is None:  # the graph would return None for it, where torch.autograd.grad raises
            raise RuntimeError(unused_input_message(k))
    positions = {}
    if dynamic is True:
        from .trace.shapes import baked_positions, dynamic_candidates
        from .trace.size_relations import relate
        positions = relate(call, dynamic_candidates(call) - baked_positions(call))
    try:
        # Saved tensors under the user's hooks as a backward of this structure found them
        # (graph.unpacked): the graph a later backward would run.
        known = cache.learned_for(call.key)
        made = pipeline.capture_call(call, positions, reorder.resolve(None),
                                     names=annotate.Names(names) if names is not None else None,
                                     grad_inputs=inputs or (), keep_code=True,
                                     learner=Learner(None, known) if known else None)
    except _Fallback as fb:
        raise Unsupported(fb.reason) from None
    return made.graph
