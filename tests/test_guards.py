"""The compiled guard agrees with the ShapeEnv's own evaluation of every condition.

For graphs of the test models traced with every size symbolic, sizes are drawn
(static positions fixed; dynamic ones from 1, 2, equal pairs, multiples and
large values) and the compiled guard is compared with an independent reading of
the ShapeEnv: each symbol in its range, each replacement, each recorded guard
expression (as recorded, before simplification) evaluated by sympy.
"""

import random

import pytest
import sympy
import torch
import torch.nn as nn
import torch.nn.functional as F

from gradfx.capture.trace.shapes import Guard, SymbolicSizes, baked_positions, dynamic_candidates
from gradfx.capture.trace.size_relations import Product, relate
from gradfx.capture.trace.tracer import trace_backward
from gradfx.capture.graph.walk import walk_backward

from test_dynamic import LSTMHead, cnn, mlp, transformer


class Attention(nn.Module):
    """GPT-2-like: qkv projection split into heads, a key cache (cat), SDPA with dropout."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.d, self.heads = d, heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.heads
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in self.qkv(x).split(d, dim=-1))
        k = torch.cat([torch.zeros(b, h, 0, d // h), k], -2)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
        return self.proj(o.transpose(1, 2).reshape(b, t, d))


# model, input shape of the capture, other shapes of the same structure
MODELS = {
    "mlp": (mlp, (4, 16), [(2, 16), (3, 16), (8, 16), (5, 16)]),
    "cnn": (cnn, (4, 3, 12, 12), [(2, 3, 12, 12), (3, 3, 12, 12), (8, 3, 12, 12), (5, 3, 12, 12)]),
    "lstm": (LSTMHead, (4, 5, 8), [(2, 5, 8), (3, 5, 8), (8, 5, 8), (4, 7, 8)]),
    "transformer": (transformer, (4, 10, 32), [(2, 10, 32), (3, 16, 32), (8, 24, 32), (5, 40, 32)]),
    "attention": (Attention, (2, 12, 16), [(3, 12, 16), (4, 12, 16), (8, 12, 16), (5, 12, 16)]),
}


def _sizes_of(model, shape):
    torch.manual_seed(1)
    loss = model(torch.randn(*shape)).square().mean()
    return walk_backward((loss,), (torch.ones_like(loss),), (), True)


def _symbolic_capture(name, shared=False):
    """(symbolic sizes of a capture, size lists of the same graph at other input shapes);
    ``shared``: positions that are one size by construction share a symbol, as in a
    first capture with dynamic=True."""
    torch.manual_seed(0)
    make, shape, others = MODELS[name]
    model = make()
    call = _sizes_of(model, shape)
    positions = dynamic_candidates(call) - baked_positions(call)
    symbolic = SymbolicSizes(call.sizes, positions, relate(call, positions) if shared else None)
    trace_backward(call, symbolic)
    real = []
    for other in others:
        c = _sizes_of(model, other)
        if c.key == call.key:
            real.append(c.sizes)
    return symbolic, real


def _reference(symbolic, sizes) -> bool:
    """The ShapeEnv's conditions evaluated by sympy, independently of the compiled guard."""
    env = symbolic.shape_env
    dynamic = symbolic.dynamic
    if any(sizes[p] != v for p, v in enumerate(symbolic.sizes) if p not in dynamic):
        return False
    values = {}
    for p in symbolic.positions:  # positions that share a symbol must agree
        if values.setdefault(symbolic.symbol[p], sympy.Integer(sizes[p])) != sizes[p]:
            return False
    for p in symbolic.positions:
        sym = symbolic.symbol[p]
        if sizes[p] not in env.var_to_range[sym]:
            return False
        if env.replace(sym).xreplace(values) != values[sym]:
            return False
    for p, expr in symbolic.derived.items():  # products of other sizes
        if symbolic.symbol[p].xreplace(values) != sizes[p]:
            return False
    return all(g.expr.xreplace(values) == sympy.true for g in env.guards)


def _draws(symbolic, real, rng, n):
    """Two thirds: sizes of the same model at other input shapes, a sixth of them
    with one class of equal sizes changed; one third: dynamic sizes drawn freely
    from 1, 2, equal pairs, multiples and large values."""
    dynamic = symbolic.positions
    for k in range(n):
        if k % 3 != 2:
            sizes = list(rng.choice(real))
            if k % 9 == 0:  # equal pairs stay equal, with a new common value
                old = sizes[rng.choice(dynamic)]
                new = rng.choice([2, 2 * old, old + 1, 1000 * old])
                sizes = [new if p in dynamic and v == old else v for p, v in enumerate(sizes)]
        else:
            sizes = list(symbolic.sizes)
            for p in dynamic:
                if rng.random() < 0.3:
                    sizes[p] = rng.choice([1, 2, 2 * sizes[p], 997, sizes[rng.choice(dynamic)]])
        yield sizes


@pytest.mark.parametrize("shared", [False, True], ids=["own symbols", "shared symbols"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_compiled_guard_matches_shape_env(name, shared):
    symbolic, real = _symbolic_capture(name, shared)
    assert len(real) >= 3
    guard = Guard.build(symbolic)
    assert guard(symbolic.sizes) and _reference(symbolic, symbolic.sizes)
    rng = random.Random(0)
    results = []
    for sizes in _draws(symbolic, real, rng, 300):
        expected = _reference(symbolic, sizes)
        assert guard(sizes) == expected, (guard.failing(sizes), sizes)
        results.append(expected)
    assert sum(results) >= len(results) // 2, f"only {sum(results)} of {len(results)} draws satisfy"
    assert not all(results)


def test_a_disjunction_stays_inside_its_condition():
    # The bug this file guards against: conditions joined as text, so `a or b and c`
    # let one true term of a disjunction accept any sizes.
    symbolic = SymbolicSizes([4, 6], {0, 1})
    s0, s1 = symbolic.symint[0], symbolic.symint[1]
    env = symbolic.shape_env
    from torch.fx.experimental.symbolic_shapes import guard_bool
    guard_bool(sympy.Or(sympy.Eq(s0.node.expr, 4), sympy.Eq(s1.node.expr, 1)) and (s0 == 4 or s1 == 1))
    assert s1 * 2 > s0  # records s0 < 2*s1
    guard = Guard.build(symbolic)
    assert guard([4, 6])
    assert not guard([4, 1]) and not guard([20, 6])
    assert _reference(symbolic, [4, 3]) == guard([4, 3])



def test_positions_sharing_a_symbol_must_stay_equal():
    symbolic = SymbolicSizes([4, 4, 6], {0, 1, 2}, groups={0: "a", 1: "a", 2: "b"})
    guard = Guard.build(symbolic)
    assert guard([4, 4, 6]) and guard([5, 5, 7])
    assert not guard([5, 6, 7]) and not guard([1, 1, 7])
    assert any(line == "sizes[1] == " + str(symbolic.symbol[0]) for line in guard.text)
    for sizes in ([4, 4, 6], [5, 5, 7], [5, 6, 7], [1, 1, 7]):
        assert guard(sizes) == _reference(symbolic, sizes)


def test_sizes_of_one_tensor_share_a_symbol_and_coincidences_do_not():
    """A saved activation, its autograd node's metadata and a later node's saved copy of
    it are one size by construction; a batch that equals the features (4 and 4) is not."""
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    x = torch.randn(4, 4, requires_grad=True)
    h = torch.tanh(first(x))
    loss = second(h).sum()
    call = walk_backward((loss,), (torch.ones_like(loss),), (), True)
    positions = dynamic_candidates(call)
    groups = relate(call, positions)
    tanh = next(i for i, n in enumerate(call.nodes) if type(n).__name__ == "TanhBackward0")
    addmm = next(i for i, n in enumerate(call.nodes) if type(n).__name__ == "AddmmBackward0")
    meta = dict(call.meta_slots())[(tanh, 0)]
    result = call.tensor_slots[call.records[tanh].saved[0]][0]  # tanh's saved output
    mat1 = next(call.tensor_slots[pos][0] for pos in call.records[addmm].saved if call.inputs[pos] is h)
    assert {meta, result, mat1} <= positions
    assert groups[meta] == groups[result] == groups[mat1]  # the batch
    # the features are the weights' size (mm's inner dim, a parameter's): static; the
    # batch, equal to them, stays a symbol
    assert call.sizes[meta] == call.sizes[meta + 1]
    assert meta + 1 not in groups and result + 1 not in groups and mat1 + 1 not in groups
    # tanh keeps its input's shape: its metadata and the first Linear's output share too
    producer = dict(call.meta_slots())[call.records[tanh].edges[0]]
    assert groups[producer] == groups[meta] and producer + 1 not in groups


def test_a_view_shares_only_the_dims_its_reshape_keeps():
    # (4, 4, 4) viewed as (16, 4): the last dim is one dim on both sides; the first two
    # merge into 16, and equal sizes alone (4 and 4) tie nothing.
    x = torch.randn(4, 4, 4, requires_grad=True)
    loss = (x * 2).view(16, 4).sin().sum()
    call = walk_backward((loss,), (torch.ones_like(loss),), (), True)
    positions = dynamic_candidates(call)
    groups = relate(call, positions)
    view = next(i for i, n in enumerate(call.nodes) if type(n).__name__ == "ViewBackward0")
    meta = dict(call.meta_slots())[(view, 0)]  # the gradient's (16, 4)
    target = call.records[view].values["_saved_self_sym_sizes"][0]  # (4, 4, 4)
    assert groups[meta + 1] == groups[target + 2]
    assert len({groups[meta + 1], groups[target], groups[target + 1]}) == 3
    # the merged 16 is no symbol of its own: the product of the two dims it merges
    assert groups[meta] == Product((1,) + tuple(sorted((groups[target], groups[target + 1]))))


def test_a_product_position_is_guarded_as_the_product():
    symbolic = SymbolicSizes([2, 3, 6], {0, 1, 2}, {0: 0, 1: 1, 2: Product((1, 0, 1))})
    assert symbolic.positions == [0, 1] and set(symbolic.derived) == {2}
    guard = Guard.build(symbolic)
    assert guard([2, 3, 6]) and guard([4, 5, 20])
    assert not guard([4, 5, 21]) and not guard([4, 5, 6])
    assert any("sizes[2] ==" in line for line in guard.text)


def test_relations_hold_in_the_previous_backward_too():
    """Recapturing, a relation is assumed only where both backwards satisfy it: sizes
    equal now by chance (8 == 8) but not before (4 != 8) stay apart."""
    x = torch.randn(8, 8, 3, requires_grad=True)
    loss = (x * 2).view(64, 3).sin().sum()
    call = walk_backward((loss,), (torch.ones_like(loss),), (), True)
    positions = dynamic_candidates(call)
    view = next(i for i, n in enumerate(call.nodes) if type(n).__name__ == "ViewBackward0")
    meta = dict(call.meta_slots())[(view, 0)]  # (64, 3)
    target = call.records[view].values["_saved_self_sym_sizes"][0]  # (8, 8, 3)
    now = relate(call, positions)
    assert isinstance(now[meta], Product)
    previous = list(call.sizes)
    previous[target] = 4  # as if the first dim was 4 and the merged one still 64: no product
    later = relate(call, positions, previous)
    assert not isinstance(later[meta], Product) and later[target] != later[target + 1]


def test_strides_of_a_transposed_saved_tensor_are_products_of_its_sizes():
    a = torch.randn(5, 7, requires_grad=True)
    b = torch.randn(6, 7, requires_grad=True)
    loss = (a * 1).mm((b * 1).t()).sum()  # mm saves b.t(): sizes (7, 6), strides (1, 7)
    call = walk_backward((loss,), (torch.ones_like(loss),), (), True)
    positions = dynamic_candidates(call)
    groups = relate(call, positions)
    slots = [s for s in call.tensor_slots.values() if s[2] >= 0]
    assert slots
    start, ndim, stride_start = slots[0]
    assert call.sizes[stride_start + 1] == 7
    assert groups[stride_start + 1] == Product((1, groups[start]))  # stride 7 is the size 7
