"""Backend compilers for captured backward graphs.

A backend follows torch.compile's custom-backend protocol,
``fn(gm: torch.fx.GraphModule, example_inputs: list) -> callable``; a one-argument
``fn(gm) -> callable`` (what PyTorch's compiled autograd takes) is accepted too.
The callable is called with the runtime inputs as positional arguments.

The graph a backend receives has one placeholder per runtime input: sizes
(``size_*``, symbolic graphs only), root gradients (``grad_*``), saved tensors
(``saved_*``), leaf tensors (``leaf_*``, or ``l_<name>`` when named with
``names=``), autograd node objects (``node_*``), hook callables (``hook_*``) and
retained tensors (``retained_*``).  Besides aten ops it calls gradfx's
runtime functions (``gradfx.capture.runtime.runtime_ops``): ``accumulate_grad`` writes a
leaf's ``.grad``; ``call_node`` runs a real autograd node that could not be traced.
These are Python side effects a backend must call, not trace into.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch.fx as fx

from .registry import (Backend, changes, describe, list_backends, lookup, register_backend,  # noqa: F401
                       takes_plain_graph)


class CompileFailedAtRun(Exception):
    """A backend's compiled code failed to compile when first called (torch.compile
    compiles lazily); nothing of the graph ran."""

    def __init__(self, err: BaseException):
        super().__init__(f"{type(err).__name__}: {err}")
        self.error = err


def gets_captured_graph(fn: Backend, plain: bool = False) -> bool:
    """Does ``fn`` compile the graph as captured (gradfx's runtime calls, DDP's buckets
    among them), rather than the form compilers trace whole (``traceable``)?"""
    return plain or getattr(fn, "_gradfx_plain_graph", False)


def compile_with(fn: Backend, gm: fx.GraphModule, example_inputs: list, plain: bool = False) -> Callable:
    """Compile ``gm`` with a backend (two-argument protocol, or one-argument).

    gradfx's own backends take the graph as captured; every other backend gets
    the form compilers trace whole (``traceable``), and the callable it returns
    is called through the adapter of that form's inputs.  ``plain``: every backend
    gets the graph as captured (create_graph graphs: the traced form drops history).
    """
    if gets_captured_graph(fn, plain):
        return _call(fn, gm, example_inputs)
    from .traceable import prepare
    traced_gm, adapt = prepare(gm, example_inputs)
    compiled = _call(fn, traced_gm, adapt(example_inputs))
    if not callable(compiled):
        text = repr(compiled)
        raise TypeError(f"it returned {type(compiled).__name__} ({text[:60]}), not a callable")

    def run(*args):
        leaves = adapt.leaves(args)
        box = []  # what it returns, held nowhere else: gradients the run accumulates may be stolen
        try:
            box.append(compiled(*adapt(args)))
        except Exception as err:
            if not _is_compile_error(err):
                raise
            cause = _runtime_cause(err)
            if cause is not None:  # dynamo failed while handling an error of the running code
                raise cause from err
            raise CompileFailedAtRun(err) from err
        return adapt.finish(box, leaves)
    run._gradfx_compiled = compiled
    return run


def _call(fn, gm, example_inputs):
    """Call a backend with the two-argument protocol, or the one-argument one.

    One argument (the graph alone) when ``fn`` has exactly one required positional
    parameter and no ``*args``: other parameters with defaults keep them, as in
    ``lambda gm, b=b: torch.compile(gm, backend=b)`` written in a loop.
    """
    if _takes_one_argument(fn):
        return fn(gm)
    return fn(gm, example_inputs)


def _runtime_cause(err: BaseException) -> BaseException | None:
    """The first error in ``err``'s context that dynamo did not raise, if any.

    None for a failure to run the graph on fake tensors while tracing (whatever
    errors it wraps, nothing real ran then)."""
    import sys
    exc = sys.modules["torch._dynamo.exc"]
    if isinstance(err, exc.TorchRuntimeError):
        return None
    seen = set()
    cause = err.__context__
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if not _is_compile_error(cause):
            return cause
        cause = cause.__context__
    return None


def _is_compile_error(err: BaseException) -> bool:
    """Did dynamo fail while compiling (before any of the graph ran)?  Its own errors, and
    a size the user marked dynamic (``mark_dynamic``) that the graph has static: dynamo
    refuses that while building its guards."""
    import sys
    exc = sys.modules.get("torch._dynamo.exc")
    if exc is None:
        return False
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError
    return isinstance(err, (exc.TorchDynamoException, ConstraintViolationError))


def _takes_one_argument(fn) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    return len(positional) == 1 or (len(required) == 1 and not has_varargs)


from . import builtin  # noqa: E402,F401  (registers eager, aot_eager, inductor)
