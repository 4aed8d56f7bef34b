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


def register_backend(name: str, fn: Backend | None = None):
    """Register ``fn`` as backend ``name``; as a decorator it returns ``fn`` unchanged."""
    if not isinstance(name, str):
        raise TypeError(f"a backend name must be a str, got {type(name).__name__}")

    def add(f: Backend) -> Backend:
        if not callable(f):
            raise TypeError(f"backend {name!r} must be callable, got {type(f).__name__}")
        _registry[name] = f
        return f
    return add(fn) if fn is not None else add


def list_backends() -> list[str]:
    _load_entry_points()
    return sorted(_registry)


def lookup(backend) -> tuple[str, Backend]:
    """(name, compile function) for a name or a callable; ValueError if unknown."""
    if callable(backend):
        return getattr(backend, "__name__", type(backend).__name__), backend
    if isinstance(backend, str):
        if backend not in _registry:
            _load_entry_points()
        if backend in _registry:
            return backend, _registry[backend]
    raise ValueError(f"unknown gradfx backend {backend!r}; known backends: {list_backends()}")


def compile_with(fn: Backend, gm: fx.GraphModule, example_inputs: list) -> Callable:
    """Call a backend with the two-argument protocol, or the one-argument one."""
    if _takes_one_argument(fn):
        return fn(gm)
    return fn(gm, example_inputs)


def _takes_one_argument(fn) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    return len(positional) == 1 or (len(required) == 1 and len(positional) == 1 and not has_varargs)


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
                _registry[ep.name] = ep.load()
            except Exception as err:  # a broken plugin must not break gradfx
                log.warning("gradfx: could not load backend entry point %s: %s", ep.name, err)


from . import builtin  # noqa: E402,F401  (registers eager, aot_eager, inductor)
