"""SymInt arithmetic done once per operation and operands while tracing.

Each fake-tensor op computes its output's numel, strides, storage size and
contiguity in SymInt arithmetic: some 20,000 binary operations for T5's backward,
10-20 us each (a sympy expression, a hint, a new ``SymNode``), over fewer than 400
distinct ones, because the sizes were related before tracing and the same few
expressions recur in every layer.  While a symbolic trace runs, a binary operation
of its ShapeEnv's nodes returns the node it returned before for the same operands
(by identity; constants by value).  ``SymNode``s are values: sharing one changes
nothing but the cost.  Operations traced into the graph (under the proxy mode) and
those of any other ShapeEnv (another thread's compile) go to torch as before.
"""

from __future__ import annotations

import contextlib

from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.fx.experimental.sym_node import SymNode

from .scoped_patch import ScopedPatch

_METHODS = ("add", "sub", "mul", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "sym_max", "sym_min",
            "floordiv", "mod")

_memos: dict = {}  # id(shape env) -> {(method, operand keys) -> result}, while it traces


def _key(node):
    constant = node.constant
    return id(node) if constant is None else (type(constant), constant)


def _wrapper(method: str, original):
    def op(self, other):
        memo = _memos.get(id(self.shape_env))
        if memo is None or not isinstance(other, SymNode) or get_proxy_mode() is not None:
            return original(self, other)
        key = (method, _key(self), _key(other))
        hit = memo.get(key)
        if hit is not None:
            return hit[0]
        out = original(self, other)
        memo[key] = (out, self, other)  # the operands stay alive: their ids stay theirs
        return out
    op.__name__ = op.__qualname__ = method
    return op


_PATCHES = [ScopedPatch(SymNode, method, lambda original, method=method: _wrapper(method, original))
            for method in _METHODS if method in SymNode.__dict__]


@contextlib.contextmanager
def memoized(shape_env):
    """Memoize ``shape_env``'s SymNode arithmetic for the duration of the block."""
    _memos[id(shape_env)] = {}
    try:
        with contextlib.ExitStack() as stack:
            for patch in _PATCHES:
                stack.enter_context(patch.active())
            yield
    finally:
        del _memos[id(shape_env)]
