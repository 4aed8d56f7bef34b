"""Sizes that follow the data (batch sizes, node and edge counts) stay symbolic when a
node saves them as plain ints (group_norm's N, C, HxW) or reads them in its formula
(index_select's self sizes): one graph with dynamic=True, two with "auto"."""

import copy

import pytest
import torch
import torch.nn as nn

import gradfx
from helpers import assert_same, grads_of


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def _run(model, batches, dynamic):
    """Train a copy of ``model`` under gradfx beside eager on ``batches`` (each a tuple of
    forward arguments); gradients must be bitwise equal every step.  Returns the captures."""
    eager, gfx = model, copy.deepcopy(model)
    for args in batches:
        eager.zero_grad()
        gfx.zero_grad()
        eager(*args).sum().backward()
        with gradfx.compiled_autograd(dynamic=dynamic) as s:
            gfx(*args).sum().backward()
        assert s.stats["fallbacks"] == 0
        assert_same(grads_of(eager.parameters()), grads_of(gfx.parameters()))
    return gradfx.stats()["captures"]


def group_norm_cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(4, 8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3), nn.GroupNorm(2, 8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))


class GNN(nn.Module):
    """Message passing on an edge list: gather the sources' features (index_select),
    sum them into the targets (index_add / scatter_add)."""

    def __init__(self, d=8):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x, src, dst):
        n = x.shape[0]
        h = self.lin1(x).index_select(0, src)
        agg = torch.zeros(n, h.shape[1]).index_add_(0, dst, h)
        h = torch.relu(agg)
        msg = self.lin2(h).index_select(0, src)
        out = torch.zeros(n, msg.shape[1]).scatter_add(0, dst.unsqueeze(1).expand_as(msg), msg)
        return out


def _graphs(count, seed=0, d=8):
    g = torch.Generator().manual_seed(seed)
    out, seen = [], set()
    while len(out) < count:
        n, e = (int(v) for v in torch.randint(3, 40, (2,), generator=g))
        e += n
        if (n, e) in seen:
            continue
        seen.add((n, e))
        out.append((torch.randn(n, d, generator=g), torch.randint(0, n, (e,), generator=g),
                    torch.randint(0, n, (e,), generator=g)))
    return out


@pytest.mark.parametrize("dynamic, captures", [(True, 1), ("auto", 2)])
def test_group_norm_cnn_over_batch_sizes(dynamic, captures):
    torch.manual_seed(0)
    batches = [(torch.randn(b, 3, 10, 10),) for b in (2, 3, 5, 8, 4, 7)]
    assert _run(group_norm_cnn(), batches, dynamic) == captures


def test_group_norm_over_spatial_sizes():
    # HxW is a product of the spatial sizes: both may change.
    torch.manual_seed(0)
    batches = [(torch.randn(b, 3, h, w),) for b, h, w in ((2, 6, 6), (3, 8, 5), (4, 7, 9), (5, 6, 11))]
    assert _run(group_norm_cnn(), batches, True) == 1


@pytest.mark.parametrize("dynamic, captures", [(True, 1), ("auto", 2)])
def test_gnn_over_node_and_edge_counts(dynamic, captures):
    torch.manual_seed(0)
    assert _run(GNN(), _graphs(10), dynamic) == captures


class Gather(nn.Module):
    """index_select on its own (a node count and an index length that change)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, idx):
        return self.lin(x).index_select(0, idx) * 2


@pytest.mark.parametrize("dynamic, captures", [(True, 1), ("auto", 2)])
def test_index_select_over_sizes(dynamic, captures):
    torch.manual_seed(0)
    batches = [(torch.randn(n, 4), torch.randint(0, n, (k,))) for n, k in ((3, 5), (6, 2), (9, 9), (4, 12))]
    assert _run(Gather(), batches, dynamic) == captures


def test_group_norm_create_graph_runs_its_node():
    # Under create_graph the node's formula takes its differentiable path: the node runs
    # as itself, and a second backward through it matches eager.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.GroupNorm(2, 4))
    x = torch.randn(3, 2, 6, 6, requires_grad=True)
    (g,) = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
    expected = torch.autograd.grad(g.sum(), x)
    with gradfx.compiled_autograd(dynamic=True):
        (g2,) = torch.autograd.grad(model(x).pow(2).sum(), x, create_graph=True)
    assert torch.equal(g, g2)
    assert torch.equal(torch.autograd.grad(g2.sum(), x)[0], expected[0])


def _leaf(*shape):
    return torch.randn(*shape).requires_grad_()


# op family -> program(b) over a size b that changes: (output, leaves)
FAMILIES = {
    "group_norm": lambda b: (lambda x, w: (nn.functional.group_norm(x, 2, w, None), [x, w]))(_leaf(b, 4, 3, b), _leaf(4)),
    "group_norm_channels_last": lambda b: (lambda x: (nn.functional.group_norm(x, 2), [x]))(
        torch.randn(b, 4, 3, 3).to(memory_format=torch.channels_last).requires_grad_()),
    "index_select": lambda b: (lambda x: (x.index_select(1, torch.randint(0, b, (b + 2,))), [x]))(_leaf(3, b)),
    "max_dim": lambda b: (lambda x: (x.max(0)[0], [x]))(_leaf(b, 3)),
    "min_keepdim": lambda b: (lambda x: (x.min(1, keepdim=True)[0], [x]))(_leaf(b, 3)),
    "kthvalue": lambda b: (lambda x: (x.kthvalue(2, 0)[0], [x]))(_leaf(b, 3)),
    "median": lambda b: (lambda x: (x.median(1)[0], [x]))(_leaf(3, b)),
    "topk": lambda b: (lambda x: (x.topk(2, 1)[0], [x]))(_leaf(b, 5)),
    "sort": lambda b: (lambda x: (x.sort(0)[0], [x]))(_leaf(b, 3)),
    "tensor_unfold": lambda b: (lambda x: (x.unfold(1, 3, 2), [x]))(_leaf(2, 2 * b + 1)),
    "repeat": lambda b: (lambda x: (x.repeat(2, 1, 3), [x]))(_leaf(b, 3)),
    "upsample_nearest": lambda b: (lambda x: (nn.functional.interpolate(x, scale_factor=2), [x]))(_leaf(b, 2, 3, 3)),
    "upsample_bilinear": lambda b: (lambda x: (nn.functional.interpolate(x, size=(5, 4), mode="bilinear"), [x]))(
        _leaf(b, 2, 3, 3)),
    "upsample_linear": lambda b: (lambda x: (nn.functional.interpolate(x, scale_factor=2, mode="linear"), [x]))(
        _leaf(b, 2, 3)),
    # already symbolic before: kept so (no saved size, or one with a rule)
    "gather": lambda b: (lambda x: (x.gather(0, torch.randint(0, b, (b + 1, 4))), [x]))(_leaf(b, 4)),
    "scatter_add": lambda b: (lambda s: (torch.zeros(b, 4).scatter_add(0, torch.randint(0, b, (b, 4)), s), [s]))(
        _leaf(b, 4)),
    "index_add": lambda b: (lambda s: (torch.zeros(b, 4).index_add(0, torch.randint(0, b, (b + 2,)), s), [s]))(
        _leaf(b + 2, 4)),
    "embedding": lambda b: (lambda w: (nn.functional.embedding(torch.randint(0, 7, (b, 3)), w), [w]))(_leaf(7, 4)),
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_op_family_over_sizes(name):
    """One graph with dynamic=True over three sizes, gradients bitwise equal to eager."""
    for b in (3, 5, 4):
        torch.manual_seed(b)
        out, leaves = FAMILIES[name](b)
        g = torch.randn(out.shape)
        expected = torch.autograd.grad(out, leaves, g, retain_graph=True)
        with gradfx.compiled_autograd(dynamic=True) as s:
            got = torch.autograd.grad(out, leaves, g)
        assert s.stats["fallbacks"] == 0
        assert_same(list(expected), list(got))
    assert gradfx.stats()["captures"] == 1
