"""Routes backward calls made inside a gradfx block to its session.

``Tensor.backward``, ``torch.autograd.backward`` and ``torch.autograd.grad`` all
call ``Variable._execution_engine.run_backward``.  gradfx puts a thin object in
its place (once, on first use) that hands calls to the innermost active session
on the calling thread and passes everything else straight to the C++ engine.
Calls torch makes for itself (AOTAutograd tracing a joint graph on fake or
functional tensors under its tracing modes, functorch transforms) the session
sends straight to the engine, uncounted (``torch_internal``).  A user's
``loss.backward()`` inside a ``torch.compile``'d function reaches here after
dynamo breaks the graph at it: that one is captured like any other, and dynamo
is kept out of gradfx's own frames.  A backward called while another runs on the
thread (a reentrant checkpoint's, one inside a custom backward or a hook) runs on the
engine, uncounted, as in eager and as PyTorch's compiled autograd runs it.
"""

from __future__ import annotations

import threading

import torch
from torch.autograd.variable import Variable

from ..runtime import counters, hook_ops


class RoutingEngine:
    """Stand-in for the C++ engine object: routes run_backward, forwards the rest."""

    def __init__(self, engine):
        self.engine = engine

    def run_backward(self, tensors, *args, **kwargs):
        # A backward inside a torch.compile'd function, after dynamo broke its graph there,
        # runs with dynamo's frame callback set: this frame and every frame it calls are
        # skipped by it (install() marks the code), so dynamo never traces gradfx.
        block = current()
        if block is None:
            return self.engine.run_backward(tensors, *args, **kwargs)
        if getattr(_running, "stack", None):
            # A backward called while a backward runs on this thread (a reentrant
            # checkpoint, a custom backward or hook that calls backward or grad): the
            # engine runs it, as a nested graph task of its own, as in eager and as
            # PyTorch's compiled autograd does.  It is part of the outer backward: not
            # captured, not counted.
            return run_on_engine(self.engine, tensors, *args, **kwargs)
        return block.run_backward(self.engine, tensors, *args, **kwargs)  # it asks torch_internal

    def queue_callback(self, callback):
        # While gradfx runs a backward there is no C++ graph task to hold final
        # callbacks; gradfx keeps them and runs them when the backward ends.
        pending = final_callbacks()
        if pending is not None:
            pending.append(callback)
            return None
        return self.engine.queue_callback(callback)

    def is_checkpoint_valid(self):
        stack = getattr(_running, "stack", None)
        if stack and stack[-1] is None:  # the engine's own backward runs innermost: its task answers
            return self.engine.is_checkpoint_valid()
        valid = hook_ops.checkpoint_valid()  # the task of a gradfx backward, if one runs
        return self.engine.is_checkpoint_valid() if valid is None else valid


def enter(block) -> None:
    """A block opens on this thread: its backward calls go to ``block.run_backward`` (and
    its counts to ``block``: the counters keep the open blocks)."""
    if type(Variable._execution_engine) is not RoutingEngine:  # install(), its common case inline
        install()
    counters.opened(block)


def leave(block) -> None:
    counters.closed(block)


current = counters.current  # the innermost open block on this thread, or None


_running = threading.local()


def final_callbacks() -> list | None:
    """The final-callback list of the gradfx backward running innermost on this thread, if
    any (None where the engine runs the innermost one, or a gradfx backward runs inside an
    engine graph task (``in_engine_task``): that task holds them)."""
    stack = getattr(_running, "stack", None)
    if not stack:
        return None
    top = stack[-1]
    return top if type(top) is list else None


class _InTask:
    """On the running stack: a gradfx backward runs inside an engine graph task of its own;
    final callbacks go to that task, the checkpoint question to gradfx's answer."""


_IN_TASK = _InTask()


class _TaskNode(torch.autograd.Function):
    """The one node of the graph task ``in_engine_task`` runs: its backward runs the body."""

    @staticmethod
    def forward(ctx, seed):
        return seed.clone()

    @staticmethod
    def backward(ctx, grad):
        slot = _task_slot
        slot.result = slot.body(*slot.args)
        return None


_task_slot = threading.local()


def in_engine_task(body, args: tuple, create_graph: bool):
    """``body(*args)`` run as the one node of a graph task of the C++ engine; returns its
    result.  C++ code it calls, the C++ post-hooks of DistributedDataParallel's reducer,
    queues final callbacks with the engine, which only a running graph task takes; the
    engine runs them after ``body``, in the order queued, Python's ``queue_callback`` calls
    among them, as it runs an eager backward's.  The task's graph is made once per thread
    and kept (retain_graph)."""
    slot = _task_slot
    root = getattr(slot, "root", None)
    if root is None:
        seed = torch.zeros((), requires_grad=True)
        with torch.enable_grad():
            root = slot.root = _TaskNode.apply(seed)
        slot.grad = torch.ones(())
    slot.body, slot.args, slot.result = body, args, None
    stack = getattr(_running, "stack", None)
    if stack is None:
        stack = _running.stack = []
    stack.append(_IN_TASK)
    engine = Variable._execution_engine
    engine = getattr(engine, "engine", engine)
    try:
        engine.run_backward((root,), (slot.grad,), True, create_graph, (), True, True)
        return slot.result
    finally:
        stack.pop()
        slot.body = slot.args = slot.result = None


def run_on_engine(engine, *args, **kwargs):
    """Run a backward on the C++ engine, marked as running on this thread: a backward called
    inside it goes to the engine as well, and its final callbacks and checkpoint question
    go to the engine's graph task (the innermost one), not to a gradfx backward around it."""
    stack = getattr(_running, "stack", None)
    if stack is None:
        stack = _running.stack = []
    stack.append(None)
    try:
        return engine.run_backward(*args, **kwargs)
    finally:
        stack.pop()


def begin_backward() -> list:
    """A gradfx backward run begins on this thread: the list its final callbacks collect
    in (``queue_callback``).  ``end_backward`` must follow, in a ``finally``.  Until then a
    backward called on this thread runs on the engine (``RoutingEngine.run_backward``)."""
    stack = getattr(_running, "stack", None)
    if stack is None:
        stack = _running.stack = []
    callbacks = []
    stack.append(callbacks)
    return callbacks


def run_callbacks(callbacks: list) -> None:
    """As in the eager engine, callbacks run in order after every node, and a callback
    may queue more."""
    i = 0
    while i < len(callbacks):
        callbacks[i]()
        i += 1


def end_backward() -> None:
    _running.stack.pop()


def torch_internal(tensors) -> bool:
    """Is this backward torch's own (tracing, functorch), not the user's?"""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue  # a GradientEdge: the block falls back for it
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and _traced_subclass(t):
            return True
        if t.is_meta or _is_functional_tensor(t) or _is_functorch_wrapped(t):
            return True
    if _dispatch_stack_len() == 0:  # counts torch's fake, proxy and functional modes too
        return False
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    return any(type(m).__name__ in _TRACING_MODES for m in _get_current_dispatch_mode_stack())


def _traced_subclass(t) -> bool:
    # Imported here: fake and functional tensors load with torch's tracing machinery.
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return isinstance(t, (FakeTensor, FunctionalTensor))


_is_functional_tensor = torch._is_functional_tensor
_is_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_dispatch_stack_len = torch._C._len_torch_dispatch_stack

# torch's own tracing modes; a user's TorchDispatchMode (FlopCounterMode, ...) is not one.
_TRACING_MODES = frozenset({"ProxyTorchDispatchMode", "FakeTensorMode", "FunctionalTensorMode"})


def install() -> None:
    if not isinstance(Variable._execution_engine, RoutingEngine):
        _skipped_by_dynamo(RoutingEngine.run_backward)
        Variable._execution_engine = RoutingEngine(Variable._execution_engine)


def _skipped_by_dynamo(fn) -> None:
    """Dynamo's frame callback skips ``fn`` and everything it calls, at no cost per call
    (what ``torch._dynamo.disable(recursive=True)`` does, without a wrapper frame and
    without importing torch._dynamo)."""
    ef = torch._C._dynamo.eval_frame
    ef.set_code_exec_strategy(fn.__code__, ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.SKIP))
