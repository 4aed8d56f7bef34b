"""A backward called while another runs on the thread runs on the eager engine.

A reentrant checkpoint's recomputed backward, a custom backward that calls ``backward``
or ``grad``, a hook that does: eager runs each as a nested graph task of its own, and so
does PyTorch's compiled autograd.  gradfx runs them on the engine too (uncaptured,
uncounted), inside the graph of the outer backward, which is captured as usual.  Each
test compares with eager autograd: gradients bitwise, hook and callback order, forward
recomputations, and the counters.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import gradfx
from helpers import assert_same, grads_of, run_both


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def _queue_callback(fn):
    torch.autograd.Variable._execution_engine.queue_callback(fn)


def test_custom_backward_calls_backward():
    def build(log):
        w = torch.randn(4, 4, requires_grad=True)
        side = torch.randn(5, 5, requires_grad=True)

        class Inner(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                # final callback of the inner graph task: runs when the inner backward ends
                _queue_callback(lambda: log.append(("inner callback",)))
                log.append(("inner node",))
                return g * 2

        class Outer(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                _queue_callback(lambda: log.append(("outer callback",)))
                with torch.enable_grad():
                    loss = Inner.apply(side.sin()).sum()
                    loss.backward()
                log.append(("after inner backward", side.grad.clone()))
                return g * 3

        def step():
            out = Outer.apply(w @ w).tanh().sum()
            out.register_hook(lambda g: log.append(("root hook",)))
            out.backward()
            log.append(("after backward",))
        return [w, side], step

    log = run_both(build, expect_captures=1)  # the outer backward alone
    names = [entry[0] for entry in log[:6]]
    assert names == ["root hook", "inner node", "inner callback", "after inner backward", "outer callback",
                     "after backward"]


def test_hook_calls_grad():
    """A tensor hook that computes a gradient with torch.autograd.grad (a penalty term)."""

    def build(log):
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))
        params = list(model.parameters())
        probe = torch.randn(3, 6, requires_grad=True)

        def hook(g):
            with torch.enable_grad():
                (gp,) = torch.autograd.grad(model(probe).square().sum(), probe)
            log.append(("penalty", gp))
            return g + gp.sum()

        def step():
            h = model[0](torch.randn(3, 6))
            h.register_hook(hook)
            model[2](model[1](h)).sum().backward()
        return params, step

    run_both(build, expect_captures=1)


def test_reentrant_checkpoint():
    calls = {"n": 0}

    def build(log):
        lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 1)
        params = list(lin1.parameters()) + list(lin2.parameters())

        def block(t):
            calls["n"] += 1
            return torch.nn.functional.dropout(torch.tanh(lin1(t)), 0.3, training=True)

        def step():
            calls["n"] = 0
            x = torch.randn(4, 8, requires_grad=True)
            lin2(checkpoint(block, x, use_reentrant=True)).sum().backward()
            log.append(("forward calls incl. recomputation", calls["n"]))
            log.append(("rng after backward", torch.rand(1)))
        return params, step

    log = run_both(build, expect_captures=1)  # the reentrant inner backward runs on the engine
    assert ("forward calls incl. recomputation", 2) in log


@pytest.mark.parametrize("create_graph", [False, True])
def test_nested_backward_counts_nowhere(create_graph):
    """PyTorch's test_no_nested_compiled_autograd: one capture for the outer backward."""

    class MyFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            a = torch.randn(5, 5, requires_grad=True)
            with torch.enable_grad():
                torch.matmul(a, a).sum().backward()
            return g

    x = torch.randn(4, 4, requires_grad=True)
    with gradfx.compiled_autograd() as session:
        for _ in range(2):
            MyFn.apply(x).sum().backward(create_graph=create_graph)
    assert session.stats["captures"] == 1 and session.stats["cache_hits"] == 1, session.stats
    assert session.stats["fallbacks"] == 0


def test_backward_inside_a_fallback_runs_on_the_engine():
    """An outer backward that falls back (anomaly mode) runs its inner one on the engine too."""

    class MyFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1.0

        @staticmethod
        def backward(ctx, g):
            a = torch.ones(3, requires_grad=True)
            with torch.enable_grad():
                (a * 2).sum().backward()
            return g * a.grad.sum()

    x = torch.randn(3, requires_grad=True)
    expected_x = x.detach().clone().requires_grad_()
    MyFn.apply(expected_x).sum().backward()
    with torch.autograd.detect_anomaly(), pytest.warns(gradfx.FallbackWarning):
        with gradfx.compiled_autograd() as session:
            MyFn.apply(x).sum().backward()
    assert session.stats == dict(session.stats, captures=0, fallbacks=1)
    assert_same(grads_of([x]), grads_of([expected_x]))
