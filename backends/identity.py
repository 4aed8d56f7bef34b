"""What makes two backends (or two passes) the same: ``callable_key``.

The cache is keyed by the backend and the passes that produced a graph.  Keying
by the function object would recapture on every step of the everyday training
loop ``with gradfx.compiled_autograd(backend=lambda gm: torch.compile(gm)):``,
which creates a new function object each time.  So a callable is keyed by what
it is:

* a plain function (lambdas and nested functions included): its code object,
  its globals dict (by identity), ``__defaults__``, ``__kwdefaults__`` and the
  values in its closure cells;
* ``functools.partial``: the key of its function plus its arguments;
* a bound method: the key of its function plus its ``__self__`` by identity;
* anything else (objects with ``__call__``, builtins, classes): the object
  itself, by identity.

Values (defaults, closure cells, partial arguments) are compared by equality
when they are immutable (None, bool, int, float, complex, str, bytes, torch
dtypes/devices/layouts/memory formats, enum members, and tuples or frozensets
of those), by the rule above when they are functions, partials or bound
methods, and by identity otherwise.  Identity keys hold the object, so its id
cannot be reused while a cache entry keyed by it lives.  Values reached
through the globals dict are not part of the key.
"""

from __future__ import annotations

import enum
import functools
import math
import types
import weakref

import torch

_SCALARS = (type(None), bool, int, str, bytes, torch.dtype, torch.device, torch.layout,
            torch.memory_format, type(Ellipsis), type(NotImplemented))
_MAX_DEPTH = 8  # nested callables deeper than this are keyed by identity


class _Identity:
    """Hashes and compares an object by identity, and keeps it alive."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other) -> bool:
        return type(other) is _Identity and other.obj is self.obj

    def __repr__(self) -> str:
        return f"<identity of {type(self.obj).__name__} at {id(self.obj):#x}>"


class Key:
    """A computed key with its hash cached: it is hashed on every cache lookup."""

    __slots__ = ("parts", "_hash")

    def __init__(self, parts: tuple):
        self.parts = parts
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (type(other) is Key and other._hash == self._hash and other.parts == self.parts)

    def __repr__(self) -> str:
        return f"Key{self.parts!r}"


def callable_key(fn) -> Key:
    """A hashable key: equal for callables that behave the same by the rule above."""
    plain = type(fn) is types.FunctionType and fn.__closure__ is None
    if plain:
        # Registered backends and passes are the same module-level functions in every
        # block: reuse their key while code and defaults are the very same objects.
        known = _plain_keys.get(fn)
        if known is not None and known[0] is fn.__code__ and known[1] is fn.__defaults__ \
                and known[2] is fn.__kwdefaults__:
            return known[3]
    key = Key(_callable(fn, []))
    if plain:
        _plain_keys[fn] = (fn.__code__, fn.__defaults__, fn.__kwdefaults__, key)
    return key


_plain_keys: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _callable(fn, stack: list):
    # `stack` holds the functions being keyed, so a function that reaches itself
    # (a recursive nested function) is keyed by its position, not endlessly.
    for depth, outer in enumerate(stack):
        if outer is fn:
            return ("recursion", depth)
    if len(stack) >= _MAX_DEPTH:
        return _Identity(fn)
    stack.append(fn)
    try:
        if type(fn) is types.FunctionType:
            closure = fn.__closure__ or ()
            cells = []
            for cell in closure:
                try:
                    cells.append(_value(cell.cell_contents, stack))
                except ValueError:  # an empty cell (a name assigned later in the outer scope)
                    cells.append(("empty cell",))
            defaults = tuple(_value(v, stack) for v in fn.__defaults__ or ())
            kwdefaults = tuple(sorted((k, _value(v, stack)) for k, v in (fn.__kwdefaults__ or {}).items()))
            return ("function", fn.__code__, _Identity(fn.__globals__), defaults, kwdefaults, tuple(cells))
        if type(fn) is functools.partial:
            return ("partial", _callable(fn.func, stack), tuple(_value(v, stack) for v in fn.args),
                    tuple(sorted((k, _value(v, stack)) for k, v in fn.keywords.items())))
        if type(fn) is types.MethodType:
            return ("method", _callable(fn.__func__, stack), _Identity(fn.__self__))
        return _Identity(fn)
    finally:
        stack.pop()


def _value(v, stack: list):
    t = type(v)
    if t in _SCALARS:
        return (t, v)  # the type too: 1, 1.0 and True are equal but not the same value
    if t is float:
        return (t, v.hex() if math.isfinite(v) else repr(v))  # -0.0 is not 0.0; nan equals nan
    if t is complex:
        return (t, _value(v.real, stack), _value(v.imag, stack))
    if isinstance(v, enum.Enum):
        return _Identity(v)  # members are singletons
    if t is tuple:
        return (t, tuple(_value(x, stack) for x in v))
    if t is frozenset:
        return (t, frozenset(_value(x, stack) for x in v))
    if t in (types.FunctionType, functools.partial, types.MethodType):
        return ("callable", _callable(v, stack))
    return _Identity(v)
