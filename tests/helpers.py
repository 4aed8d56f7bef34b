"""Shared test helpers: run the same program under eager autograd and gradfx."""

from __future__ import annotations

import copy

import torch

import gradfx


def grads_of(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


def assert_same(a, b, exact=True):
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"gradient {k}: {x is None} vs {y is None}"
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, f"gradient {k}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
        if exact:
            assert torch.equal(x, y), f"gradient {k} differs: max abs diff {(x - y).abs().max()}"
        else:
            torch.testing.assert_close(x, y)


def compare_training(make_model, make_inputs, loss_fn=None, *, iterations=3, backend="eager",
                     expect_captures=1, zero_grad=True, exact=True, allow_opaque=(), **kwargs):
    """Run `iterations` steps in eager and under gradfx; grads must match each step.

    Returns the session of the last gradfx block.
    """
    torch.manual_seed(0)
    eager_model = make_model()
    gfx_model = copy.deepcopy(eager_model)
    loss_fn = loss_fn or (lambda out: out.sum())
    gradfx.reset()
    session = None
    for it in range(iterations):
        torch.manual_seed(100 + it)
        inputs = make_inputs()
        if zero_grad:
            eager_model.zero_grad(set_to_none=True)
            gfx_model.zero_grad(set_to_none=True)
        loss_fn(eager_model(*inputs)).backward()
        with gradfx.compiled_autograd(backend, **kwargs) as session:
            loss_fn(gfx_model(*inputs)).backward()
        assert session.stats["fallbacks"] == 0, session.stats
        for graph in session.graphs:
            assert graph.opaque_nodes == list(allow_opaque), graph.opaque_nodes
        assert_same(grads_of(eager_model.parameters()), grads_of(gfx_model.parameters()), exact)
    totals = gradfx.stats()
    assert totals["captures"] == expect_captures, totals
    assert totals["cache_hits"] == iterations - expect_captures, totals
    return session
