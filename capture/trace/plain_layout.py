"""Layout questions about symbolic tensors answered from their size expressions alone.

Asked through the ShapeEnv, "is this tensor contiguous?" or "can this gradient be
viewed as that shape?" is a sympy proof and a guard per comparison: most of what a
symbolic trace spends on reshapes.  Sizes related before tracing
(``size_relations``) are monomials of a few free symbols, each at least 2 (the
guard checks that range), so most comparisons are decided by what the expressions
are: equal as written, or one side a constant below the other's least value.
What these functions cannot decide that way they leave to the ShapeEnv (they
answer ``UNDECIDED`` or False), so a result here holds for every size the graph's
guard admits, and the ShapeEnv records nothing.
"""

from __future__ import annotations

import sympy
import torch

UNDECIDED = object()


class _Undecided(Exception):
    pass


def expr(x):
    """A size as sympy would hold it: a SymInt's expression, or the int."""
    return x.node.expr if isinstance(x, torch.SymInt) else x


def plainly_equal(a, b) -> bool:
    """Equal as written (one sympy expression, or one int): no guard needed to know."""
    return expr(a) == expr(b)


def plainly_contiguous(t) -> bool:
    """Contiguous as written: each stride is the product of the sizes after it (dims of
    size 1 aside), without asking the ShapeEnv."""
    expected = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if expr(size) == 1:
            continue
        if expr(stride) != expr(expected):
            return False
        expected = expected * size
    return True


def _monomial(e):
    """``e`` as (constant, {symbol: power}), or raise _Undecided (a sum, a division...)."""
    if isinstance(e, int):
        return e, {}
    if isinstance(e, sympy.Integer):
        return int(e), {}
    if isinstance(e, sympy.Symbol):
        return 1, {e: 1}
    if isinstance(e, sympy.Pow) and isinstance(e.base, sympy.Symbol) and e.exp.is_Integer and e.exp > 0:
        return 1, {e.base: int(e.exp)}
    if isinstance(e, sympy.Mul):
        const, powers = 1, {}
        for factor in e.args:
            c, p = _monomial(factor)
            const *= c
            for s, k in p.items():
                powers[s] = powers.get(s, 0) + k
        return const, powers
    raise _Undecided


def _hint(x) -> int:
    return x.node.hint if isinstance(x, torch.SymInt) else x


class _Compare:
    """Orders two sizes for every value of their symbols the guard admits."""

    def __init__(self, shape_env):
        self.env = shape_env

    def _least(self, symbol) -> int:
        vr = self.env.var_to_range.get(symbol)
        lower = vr.lower if vr is not None else None
        if lower is None or not lower.is_Integer or int(lower) < 2:
            raise _Undecided
        return int(lower)

    def sign(self, a, b) -> int:
        """-1, 0 or 1 as ``a`` is below, equal to or above ``b`` at every admitted size."""
        result = self._sign(expr(a), expr(b))
        ha, hb = _hint(a), _hint(b)
        if (ha > hb) - (ha < hb) != result:  # cannot be: a bug here must not become a graph
            raise _Undecided
        return result

    def _sign(self, a, b) -> int:
        if a == b:
            return 0
        ca, pa = _monomial(a)
        cb, pb = _monomial(b)
        if ca <= 0 or cb <= 0:
            raise _Undecided
        for s in set(pa) & set(pb):  # a common factor (positive) changes no order
            k = min(pa[s], pb[s])
            pa[s] -= k
            pb[s] -= k
        pa = {s: k for s, k in pa.items() if k}
        pb = {s: k for s, k in pb.items() if k}
        if not pa and not pb:
            return (ca > cb) - (ca < cb)
        if pa and pb:
            raise _Undecided  # s0 against s1: either way, depending on the sizes
        if not pa:  # a constant against cb times a product at least cb * least
            least = cb
            for s, k in pb.items():
                least *= self._least(s) ** k
            if ca < least:
                return -1
            raise _Undecided
        return -self._sign(b, a)


def view_strides(sizes, strides, shape, shape_env):
    """The strides of ``shape`` viewing a tensor of ``sizes`` and ``strides`` without a
    copy, None where no view exists (reshape copies), UNDECIDED where that depends on
    the sizes.  The chunk walk of ATen's ``computeStride``: runs of dims laid out
    contiguously among themselves map onto runs of target dims of equal size."""
    try:
        return _view_strides(list(sizes), list(strides), list(shape), _Compare(shape_env))
    except _Undecided:
        return UNDECIDED


def _view_strides(sizes, strides, shape, cmp: _Compare):
    if not sizes:
        return [1] * len(shape)
    if any(expr(s) == 0 for s in (*sizes, *shape)):
        raise _Undecided  # empty tensors: ATen's own rules for strides
    new = [None] * len(shape)
    view_d = len(shape) - 1
    base = strides[-1]
    tensor_numel = view_numel = 1
    for d in range(len(sizes) - 1, -1, -1):
        tensor_numel = tensor_numel * sizes[d]
        if d == 0 or (cmp.sign(sizes[d - 1], 1) != 0 and cmp.sign(strides[d - 1], tensor_numel * base) != 0):
            while view_d >= 0 and (cmp.sign(view_numel, tensor_numel) < 0 or cmp.sign(shape[view_d], 1) == 0):
                new[view_d] = view_numel * base
                view_numel = view_numel * shape[view_d]
                view_d -= 1
            if cmp.sign(view_numel, tensor_numel) != 0:
                return None
            if d > 0:
                base = strides[d - 1]
                tensor_numel = view_numel = 1
    return new if view_d == -1 else None
