"""Sparse gradients (nn.Embedding(sparse=True), sparse custom-Function grads) as in eager."""

import copy

import pytest
import torch
import torch.nn as nn

import gradfx


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def _same_grad(a, b):
    assert (a is None) == (b is None)
    if a is None:
        return
    assert a.layout == b.layout and a.dtype == b.dtype and a.shape == b.shape
    if a.is_sparse:
        assert a.is_coalesced() == b.is_coalesced()
        assert torch.equal(a._indices(), b._indices()) and torch.equal(a._values(), b._values())
    else:
        assert torch.equal(a, b)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 4, sparse=True)
        self.head = nn.Linear(4, 1)

    def forward(self, idx, dense_use=False):
        out = self.head(self.emb(idx)).sum() + self.emb(idx[:, :2]).pow(2).sum()
        if dense_use:  # the weight also used densely: the buffer sums sparse and dense
            out = out + self.emb.weight.sum() * 0.5
        return out


def _train(model, use_gfx, steps, make_step):
    seen = []
    for step in range(steps):
        loss = make_step(model, step)
        if use_gfx:
            with gradfx.compiled_autograd() as s:
                loss.backward()
            assert s.stats["fallbacks"] == 0
        else:
            loss.backward()
        seen.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    return seen


def _compare(make_step, steps=3, prepare=None):
    torch.manual_seed(0)
    eager = Model()
    gfx = copy.deepcopy(eager)
    if prepare is not None:
        prepare(eager)
        prepare(gfx)
    for a, b in zip(_train(eager, False, steps, make_step), _train(gfx, True, steps, make_step)):
        for x, y in zip(a, b):
            _same_grad(x, y)


IDX = torch.tensor([[1, 2, 2, 5], [3, 3, 11, 1]])


def test_first_sparse_gradient_and_accumulation_into_sparse():
    _compare(lambda m, step: m((IDX + step) % 12))


def test_sparse_into_existing_dense_grad():
    def prepare(m):
        m.emb.weight.grad = torch.ones_like(m.emb.weight)
    _compare(lambda m, step: m(IDX), prepare=prepare)


def test_dense_into_existing_sparse_grad_and_mixed_buffers():
    _compare(lambda m, step: m(IDX, dense_use=step > 0))
    _compare(lambda m, step: m(IDX, dense_use=True))


def test_sparse_adam_training():
    def run(use_gfx):
        torch.manual_seed(0)
        model = Model()
        opt = torch.optim.SparseAdam(list(model.emb.parameters()), lr=0.1)
        dense_opt = torch.optim.SGD(model.head.parameters(), lr=0.1)
        for step in range(4):
            opt.zero_grad()
            dense_opt.zero_grad()
            loss = model((IDX * (step % 2) + step) % 12)
            if use_gfx:
                with gradfx.compiled_autograd():
                    loss.backward()
            else:
                loss.backward()
            opt.step()
            dense_opt.step()
        return [p.detach().clone() for p in model.parameters()]
    for a, b in zip(run(False), run(True)):
        assert torch.equal(a, b)


class SparseGrad(torch.autograd.Function):
    """Returns a coalesced sparse gradient for a dense input (eager drops the flag)."""

    @staticmethod
    def forward(ctx, w):
        return w * 1.0

    @staticmethod
    def backward(ctx, g):
        return (g * 2).to_sparse().coalesce()


def test_coalesced_sparse_gradient_flag_as_eager():
    def run(use_gfx):
        w = torch.zeros(3, 4, requires_grad=True)
        for _ in range(2):
            loss = (SparseGrad.apply(w) * torch.arange(12.0).view(3, 4)).sum()
            if use_gfx:
                with gradfx.compiled_autograd():
                    loss.backward()
            else:
                loss.backward()
        return w.grad
    _same_grad(run(False), run(True))


def test_sparse_leaf_as_root_falls_back_with_one_warning():
    """A sparse leaf has no view through which to find its accumulator: the eager
    engine runs that backward (it crashed in the walk), once warned."""
    indices, values = torch.tensor([[0, 1], [1, 0]]), torch.tensor([1.0, 2.0])
    grads = []
    for under_gradfx in (False, True):
        leaf = torch.sparse_coo_tensor(indices, values, (2, 2), requires_grad=True)
        if under_gradfx:
            with pytest.warns(gradfx.FallbackWarning, match="sparse_coo leaf"):
                with gradfx.compiled_autograd(backend="eager"):
                    leaf.backward(torch.ones(2, 2).to_sparse())
        else:
            leaf.backward(torch.ones(2, 2).to_sparse())
        grads.append(leaf.grad.to_dense())
    assert torch.equal(grads[0], grads[1])
