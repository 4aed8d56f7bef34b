"""The backends by name: registration, lookup (and the ``gradfx.backends`` entry points of
other packages), and how messages name a backend callable.  Imported by the package,
which re-exports it, and by the built-in backends, which register themselves."""

from __future__ import annotations

import logging
from typing import Callable

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
