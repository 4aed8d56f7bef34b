"""Runtime functions for hook calls in captured graphs, with eager's checks.

Each function mirrors what the eager engine's Python hook wrappers do with a
hook's return value: ``None`` keeps the gradient, a tensor replaces it after
checks of type, size, dtype and device (same exception types and messages as
eager).  The hook callables are graph inputs, so new hook objects of the same
shape of graph reuse the compiled graph.
"""

from __future__ import annotations

import itertools
import threading

import torch
from torch.overrides import has_torch_function_unary as _has_torch_function

from .. import native


def _hook_name(hook) -> str:
    return getattr(hook, "__name__", type(hook).__name__)


def plain_tensor(t):
    """``t`` as the engine holds a tensor a hook or backward returned: without its
    subclass's ``__torch_function__``, which must not see gradfx's checks and ops on it
    (the engine's are C++).  Subclasses without one (fake tensors while tracing, dispatch
    subclasses) stay as they are."""
    if type(t) is torch.Tensor or not _has_torch_function(t):
        return t
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.as_subclass(t, torch.Tensor)


def _check_single(original, result, hook):
    if not isinstance(result, torch.Tensor):
        raise TypeError(f"expected Variable, but hook returned '{type(result).__name__}'")
    result = plain_tensor(result)
    if original is None:
        raise RuntimeError("can't replace a None gradient with a non-None value")
    name = _hook_name(hook)
    # check_variable_result's order: the type (dtype, device, layout), then the size
    if result.dtype != original.dtype or result.device != original.device or result.layout != original.layout:
        raise RuntimeError(f"hook '{name}' has changed the type of value (was "
                           f"{_type_name(original)} got {_type_name(result)})")
    if result.shape != original.shape:
        raise RuntimeError(f"hook '{name}' has changed the size of value")
    return result


# The dtypes with a legacy tensor type name (torch.FloatTensor, torch.cuda.LongTensor).
_LEGACY = {torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int",
           torch.int64: "Long", torch.float16: "Half", torch.float32: "Float", torch.float64: "Double"}
_SCALAR = {torch.bool: "Bool", torch.bfloat16: "BFloat16", torch.complex32: "ComplexHalf",
           torch.complex64: "ComplexFloat", torch.complex128: "ComplexDouble"}
_DEVICE = {"cpu": "CPU", "cuda": "CUDA", "meta": "Meta", "mps": "MPS", "xpu": "XPU"}


def _type_name(t) -> str:
    """A tensor's type as eager's hook errors name it: the legacy name where there is
    one (``torch.FloatTensor``), else the dispatch key's (``MetaFloatType``)."""
    legacy = _LEGACY.get(t.dtype)
    if legacy is not None and t.device.type in ("cpu", "cuda") and t.layout in (torch.strided, torch.sparse_coo):
        return t.type()
    scalar = legacy or _SCALAR.get(t.dtype) or str(t.dtype).removeprefix("torch.").capitalize()
    key = _DEVICE.get(t.device.type, t.device.type.upper())
    return ("Sparse" if t.layout is torch.sparse_coo else "") + key + scalar + "Type"


def _call(node, hook, *args):
    """``hook(*args)`` with ``torch._C._current_autograd_node()`` answering ``node``, as
    in eager, where every hook of a node runs while the engine evaluates it (None: the
    graph runs compiled, where that query is not answered)."""
    if node is None:
        return hook(*args)
    previous = running_node(node)
    try:
        return hook(*args)
    finally:
        done_running(previous)


def call_tensor_hook(hook, grad, node=None):
    """A tensor hook (``t.register_hook``), of a gradient ``node`` takes: returns the
    gradient to use."""
    result = _call(node, hook, grad)
    if result is None:
        return grad
    return _check_single(grad, result, hook)


def call_pre_hook(hook, grads: tuple, node=None) -> tuple:
    """A node pre-hook (``grad_fn.register_prehook``): returns the node's inputs."""
    result = _call(node, hook, grads)
    if result is None:
        return grads
    return _check_tuple(grads, result, hook)


def call_post_hook(hook, grad_inputs: tuple, grad_outputs: tuple, node=None) -> tuple:
    """A node post-hook (``grad_fn.register_hook``): returns the node's outputs."""
    result = _call(node, hook, grad_inputs, grad_outputs)
    if result is None:
        return grad_inputs
    return _check_tuple(grad_inputs, result, hook)


def _check_tuple(original: tuple, result, hook) -> tuple:
    if not isinstance(result, tuple):
        raise TypeError(f"expected tuple, but hook returned '{type(result).__name__}'")
    if len(result) != len(original):
        raise RuntimeError(f"hook '{_hook_name(hook)}' has returned an incorrect number of values "
                           f"(got {len(result)}, but expected {len(original)})")
    out = []
    for old, new in zip(original, result):
        if new is None:
            out.append(None)
        elif old is None:
            raise RuntimeError("can't replace a None gradient with a non-None value")
        else:
            out.append(_check_single(old, new, hook))
    return tuple(out)


def retain_grad(tensor, grad) -> None:
    """The retains-grad hook of a non-leaf tensor: first grad cloned, later ones added."""
    if grad is None:
        return
    if tensor.grad is None:
        tensor.grad = grad.clone() if grad.is_sparse else grad.clone(memory_format=torch.contiguous_format)
    else:
        tensor.grad = tensor.grad + grad


def call_node_post_hooks(node, grads: tuple) -> None:
    """Every post-hook of a builtin node, in registration order, C++ hooks among them (the
    reducer of DistributedDataParallel on a parameter's accumulator), as the engine calls
    them: through gradfx's compiled part, which alone can reach a C++ hook.  The graph
    calls this only inside an engine graph task (``routing.in_engine_task``), where the C++
    hooks can queue the final callbacks they queue.  The compiled part's function makes
    ``node`` the running one (:func:`running_node`) while they run; the eager backend's
    graphs call it directly (:func:`node_post_hooks_native`)."""
    native.module().call_node_post_hooks(node, grads)  # loaded: the walk asked it of the node's hooks


def node_post_hooks_native():
    """:func:`call_node_post_hooks` as the compiled part's C function, as fx's code can name
    it; where the compiled part is loaded (a graph that calls the hooks needs it)."""
    if not _native_post_hooks:
        _native_post_hooks.append(native.named(native.module().call_node_post_hooks, "call_node_post_hooks_native"))
    return _native_post_hooks[0]


_native_post_hooks: list = []


def call_post_accumulate_hook(hook, variable, node=None) -> None:
    if _call(node, hook, variable) is not None:
        raise RuntimeError("Tensor post accumulate grad hooks should return None.")


# While a graph runs Python code, torch._C's graph-task queries (used by
# register_multi_grad_hook, checkpointing, compiled regions, FSDP) answer for the
# backward gradfx is running.
_task_ids = itertools.count(1 << 40)
_task = threading.local()
_real_task_id = torch._C._current_graph_task_id
_real_will_execute = torch._C._will_engine_execute_node
_real_keep_graph = torch._C._autograd._get_current_graph_task_keep_graph
_real_current_node = torch._C._current_autograd_node


def _current_autograd_node():
    node = getattr(_task, "node", None)
    return node if node is not None else _real_current_node()


def running_node(node):
    """Make ``node`` what ``torch._C._current_autograd_node()`` answers while it runs as
    an opaque call (the engine's ``current_evaluating_node``); returns the previous one,
    for :func:`done_running`."""
    previous = getattr(_task, "node", None)
    _task.node = node
    return previous


def done_running(previous) -> None:
    _task.node = previous


native.when_loaded(lambda module: module.set_running(_task))  # its call_node_post_hooks sets _task.node


def _get_current_graph_task_keep_graph():
    state = getattr(_task, "state", None)
    return state[2] if state is not None else _real_keep_graph()


def _current_graph_task_id():
    state = getattr(_task, "state", None)
    return state[0] if state is not None else _real_task_id()


def _will_engine_execute_node(node):
    state = getattr(_task, "state", None)
    if state is None:
        return _real_will_execute(node)
    if isinstance(node, torch.autograd.graph.GradientEdge):
        node = node.node
    if state[4] is not None and id(node) in state[4] and type(node).__name__ == "AccumulateGrad":
        raise RuntimeError("A leaf node was passed to _will_engine_execute_node but we are currently running "
                           "autograd.grad(). This is currently not supported.")
    return id(node) in state[1]()


def keeps_graph() -> bool | None:
    """Does the gradfx backward running Python on this thread keep its graph
    (retain_graph)?  None outside one."""
    state = getattr(_task, "state", None)
    return state[2] if state is not None else None


def checkpoint_valid() -> bool | None:
    """For the engine's is_checkpoint_valid: the answer of the gradfx backward running
    Python on this thread, or None outside one."""
    state = getattr(_task, "state", None)
    return state[3] if state is not None else None


class _Once:
    """``fn()``, computed on the first call and kept (functools.cache's wrapper costs more to
    make than a backward that never asks)."""

    __slots__ = ("fn", "value")

    def __init__(self, fn):
        self.fn, self.value = fn, None

    def __call__(self):
        if self.value is None:
            self.value = self.fn()
        return self.value


class graph_task:
    """Context: Python code running inside it (hooks, custom backwards, checkpoint's
    recomputation) sees one backward task, executing the nodes ``executed_ids()``
    names (computed on first use)."""

    def __init__(self, executed_ids, keep_graph: bool, checkpoint_valid: bool = True, grad_inputs=None):
        # checkpoint_valid: eager's answer for a task without `inputs` (its exec_info is
        # empty); a reentrant checkpoint refuses to run inside grad() / backward(inputs=).
        # grad_inputs: for autograd.grad(), ids of its inputs' nodes; eager refuses to
        # answer for the accumulator of a leaf among them.
        self.state = (next(_task_ids), _Once(executed_ids), keep_graph, checkpoint_valid, grad_inputs)

    def __enter__(self):
        self.prev = getattr(_task, "state", None)
        _task.state = self.state
        torch._C._current_graph_task_id = _current_graph_task_id
        torch._C._will_engine_execute_node = _will_engine_execute_node
        torch._C._autograd._get_current_graph_task_keep_graph = _get_current_graph_task_keep_graph
        torch._C._current_autograd_node = _current_autograd_node
        return self

    def __exit__(self, *exc):
        _task.state = self.prev
        if self.prev is None:  # outside gradfx's backwards torch answers for itself
            torch._C._current_graph_task_id = _real_task_id
            torch._C._will_engine_execute_node = _real_will_execute
            torch._C._autograd._get_current_graph_task_keep_graph = _real_keep_graph
            torch._C._current_autograd_node = _real_current_node


HOOK_CALLS = {call_tensor_hook, call_pre_hook, call_post_hook, retain_grad, call_post_accumulate_hook,
              call_node_post_hooks}
