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
runtime functions (``gradfx.capture.runtime_ops``): ``accumulate_grad`` writes a
leaf's ``.grad``; ``call_node`` runs a real autograd node that could not be traced.
These are Python side effects a backend must call, not trace into.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable

import torch.fx as fx

log = logging.getLogger("gradfx")

Backend = Callable[..., Callable]
_registry: dict[str, Backend] = {}
_changes = 0  # registrations so far (see changes())


def register_backend(name: str, fn: Backend | None = None):
    """Register ``fn`` as backend ``name``; as a decorator it returns ``fn`` unchanged."""
    if not isinstance(name, str):
        raise TypeError(f"a backend name must be a str, got {type(name).__name__} ({name!r})")

    def add(f: Backend) -> Backend:
        if not callable(f):
            raise TypeError(f"backend {name!r} must be callable, got {type(f).__name__}")
        global _changes
        _registry[name] = f
        _changes += 1
        return f
    return add(fn) if fn is not None else add


def changes() -> int:
    """How many times the registry has changed: what a name looked up before still means,
    while this stays the same (blocks reuse their configuration so)."""
    return _changes


def list_backends() -> list[str]:
    _load_entry_points()
    return sorted(_registry)


def lookup(backend) -> tuple[str, Backend]:
    """(name, compile function) for a name or a callable.

    ValueError for an unknown name, TypeError for anything neither a str nor callable.
    """
    if isinstance(backend, str):
        if backend not in _registry:
            _load_entry_points()
        if backend in _registry:
            return backend, _registry[backend]
        raise ValueError(f"unknown gradfx backend {backend!r}; known backends: {list_backends()}")
    if callable(backend):
        return describe(backend), backend
    raise TypeError(f"backend must be a registered name (str) or a compile function "
                    f"fn(gm, example_inputs) -> callable, got {type(backend).__name__} ({backend!r})")


def describe(fn) -> str:
    """How messages name a backend callable: its qualified name where it has one."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if isinstance(name, str):
        return name
    inner = getattr(fn, "func", None)  # functools.partial
    if inner is not None:
        return f"partial({describe(inner)})"
    return type(fn).__name__


def takes_plain_graph(fn) -> Backend:
    """Mark a backend that runs gradfx's own graph (its Python runtime calls) as it is."""
    fn._gradfx_plain_graph = True
    return fn


class CompileFailedAtRun(Exception):
    """A backend's compiled code failed to compile when first called (torch.compile
    compiles lazily); nothing of the graph ran."""

    def __init__(self, err: BaseException):
        super().__init__(f"{type(err).__name__}: {err}")
        self.error = err


def compile_with(fn: Backend, gm: fx.GraphModule, example_inputs: list, plain: bool = False) -> Callable:
    """Compile ``gm`` with a backend (two-argument protocol, or one-argument).

    gradfx's own backends take the graph as captured; every other backend gets
    the form compilers trace whole (``traceable``), and the callable it returns
    is called through the adapter of that form's inputs.  ``plain``: every backend
    gets the graph as captured (create_graph graphs: the traced form drops history).
    """
    if plain or getattr(fn, "_gradfx_plain_graph", False):
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


_entry_points_loaded = False


def _load_entry_points() -> None:
    """Backends shipped by other packages under the ``gradfx.backends`` group."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    from importlib.metadata import entry_points
    for ep in entry_points(group="gradfx.backends"):
        if ep.name not in _registry:
            try:
                register_backend(ep.name, ep.load())
            except Exception as err:  # a broken plugin must not break gradfx
                log.warning("gradfx: could not load backend entry point %s: %s", ep.name, err)


from . import builtin  # noqa: E402,F401  (registers eager, aot_eager, inductor)
