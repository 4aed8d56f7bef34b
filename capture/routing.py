"""Routes backward calls made inside a gradfx block to its session.

``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad`` all
call ``Variable._execution_engine.run_backward``.  gradfx puts a thin object in
its place (once, on first use) that hands calls to the innermost active session
on the calling thread and passes everything else straight to the C++ engine.
Calls torch makes for itself (torch.compile tracing joint graphs on fake tensors,
under a dispatch mode) go straight to the engine, uncounted.
"""

from __future__ import annotations

import threading

import torch
from torch.autograd.variable import Variable


class RoutingEngine:
    """Stand-in for the C++ engine object: routes run_backward, forwards the rest."""

    def __init__(self, engine):
        self.engine = engine

    def run_backward(self, tensors, *args, **kwargs):
        from .session import current
        session = current()
        if session is None or _torch_internal(tensors):
            return self.engine.run_backward(tensors, *args, **kwargs)
        return session.run_backward(self.engine, tensors, *args, **kwargs)

    def queue_callback(self, callback):
        # While gradfx runs a backward there is no C++ graph task to hold final
        # callbacks; gradfx keeps them and runs them when the backward ends.
        pending = final_callbacks()
        if pending is not None:
            pending.append(callback)
            return None
        return self.engine.queue_callback(callback)

    def is_checkpoint_valid(self):
        return self.engine.is_checkpoint_valid()


_running = threading.local()


def final_callbacks() -> list | None:
    """The final-callback list of the gradfx backward running on this thread, if any."""
    stack = getattr(_running, "stack", None)
    return stack[-1] if stack else None


class running_backward:
    """Context around one gradfx backward run: collects and then runs final callbacks.

    As in the eager engine, callbacks run in order after every node, and a
    callback may queue more.
    """

    def __enter__(self):
        stack = getattr(_running, "stack", None)
        if stack is None:
            stack = _running.stack = []
        self.callbacks = []
        stack.append(self.callbacks)
        return self

    def __exit__(self, exc_type, *exc):
        try:
            if exc_type is None:
                i = 0
                while i < len(self.callbacks):
                    self.callbacks[i]()
                    i += 1
        finally:
            _running.stack.pop()


def _torch_internal(tensors) -> bool:
    if torch._C._len_torch_dispatch_stack() or torch.compiler.is_compiling():
        return True
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return any(isinstance(t, (FakeTensor, FunctionalTensor)) for t in tensors)


def install() -> None:
    if not isinstance(Variable._execution_engine, RoutingEngine):
        Variable._execution_engine = RoutingEngine(Variable._execution_engine)
