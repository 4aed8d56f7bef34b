"""Reshape decisions read off size expressions hold for every size the guard admits.

``plain_layout.view_strides`` decides, without the ShapeEnv, whether a symbolic
gradient reshapes as a view (and with which strides) or as a copy.  Checked against
ATen's own ``view`` on real tensors, at the captured sizes and at other sizes of the
same symbols: a decision that held only at the captured sizes would be a wrong graph
for the next batch.
"""

import itertools
import random

import pytest
import torch
from torch._dynamo.source import ConstantSource
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

from gradfx.capture.trace import plain_layout


def _symbols(env, hints):
    out = []
    for k, h in enumerate(hints):
        sym = env.create_symbol(h, ConstantSource(f"s{k}"), dynamic_dim=DimDynamic.DYNAMIC)
        out.append(env.create_symintnode(sym, hint=h, source=ConstantSource(f"s{k}")))
    return out


def _at(x, values: dict) -> int:
    if isinstance(x, int):
        return x
    return int(x.node.expr.xreplace(values))


def _aten_view(sizes, strides, shape):
    base = torch.empty_strided(sizes, strides, device="meta")
    try:
        return list(base.view(shape).stride())
    except RuntimeError:
        return None


def _case(rng, syms):
    """A permuted (non-contiguous) tensor of symbolic and static dims, and a shape that
    regroups its dims: merged neighbours, a dim split in static factors, or moved dims."""
    dims = [rng.choice(syms + [1, 2, 3, 4, 8]) for _ in range(rng.randint(1, 4))]
    contiguous = [1] * len(dims)
    for d in range(len(dims) - 2, -1, -1):
        contiguous[d] = contiguous[d + 1] * dims[d + 1]
    order = list(range(len(dims)))
    rng.shuffle(order)
    sizes = [dims[d] for d in order]
    strides = [contiguous[d] for d in order]
    shape, k = [], 0
    while k < len(sizes):
        take = rng.randint(1, len(sizes) - k)
        merged = 1
        for d in sizes[k:k + take]:
            merged = merged * d
        if take == 1 and isinstance(merged, int) and merged in (4, 8) and rng.random() < 0.5:
            shape += [2, merged // 2]
        else:
            shape.append(merged)
        k += take
    if rng.random() < 0.2:
        shape = shape[::-1]  # a shape that does not regroup in order: a copy or undecided
    return sizes, strides, shape


@pytest.mark.parametrize("seed", range(6))
def test_view_strides_agree_with_aten_at_every_admitted_size(seed):
    rng = random.Random(seed)
    env = ShapeEnv(duck_shape=False)
    syms = _symbols(env, [3, 5, 4])
    exprs = [s.node.expr for s in syms]
    others = [dict(zip(exprs, v)) for v in itertools.product([2, 3, 7], [2, 5, 16], [2, 4, 9])]
    decided = 0
    for _ in range(300):
        sizes, strides, shape = _case(rng, syms)
        numel = 1
        for d in sizes:
            numel = numel * d
        target = 1
        for d in shape:
            target = target * d
        if not plain_layout.plainly_equal(numel, target):
            continue
        got = plain_layout.view_strides(sizes, strides, shape, env)
        if got is plain_layout.UNDECIDED:
            continue
        decided += 1
        for values in others:
            want = _aten_view([_at(x, values) for x in sizes], [_at(x, values) for x in strides],
                              [_at(x, values) for x in shape])
            mine = None if got is None else [_at(x, values) for x in got]
            assert mine == want, (sizes, strides, shape, values)
    assert decided > 100
    assert not env.guards  # decided from the expressions: nothing asked of the ShapeEnv


def test_transposed_attention_gradients():
    """The cases a transformer's backward meets: heads moved back before merging (a
    copy), a gradient laid out column-major that merges its inner dims (a view)."""
    env = ShapeEnv(duck_shape=False)
    b, n = _symbols(env, [3, 6])
    copy = plain_layout.view_strides([b, n, 4, 16], [64 * n, 16, 16 * n, 1], [b, n, 64], env)
    assert copy is None
    view = plain_layout.view_strides([b, n, 4, 16], [64 * n, 1, 16 * n, n], [b, n, 64], env)
    assert [plain_layout.expr(x) for x in view] == [plain_layout.expr(64 * n), 1, plain_layout.expr(n)]
    assert plain_layout.view_strides([b, n], [1, b], [b * n], env) is None
    assert plain_layout.view_strides([b, n], [n, 1], [n, b], env) == [b, 1]  # contiguous: any split
    # dims laid out contiguously among themselves merge, whatever their order in memory
    merged = plain_layout.view_strides([b, n, 2], [1, 2 * b, b], [b, 2 * n], env)
    assert [plain_layout.expr(x) for x in merged] == [1, plain_layout.expr(b)]
    # two free symbols against each other: depends on the sizes, left to the ShapeEnv
    assert plain_layout.view_strides([b, n], [1, b], [n, b], env) is plain_layout.UNDECIDED
    assert not env.guards
