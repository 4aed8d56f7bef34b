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
from helpers import assert_same, grads_of, hooked_captures, run_both


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


class _Counting:
    """A one-argument backend as PyTorch's compiled autograd takes: torch.compile of the
    graph (dynamo's eager backend, no graph break allowed unless ``fullgraph=False``),
    counting the dynamo graphs it compiles."""

    def __init__(self, fullgraph=True):
        self.fullgraph, self.graphs = fullgraph, 0

    def __call__(self, gm):
        def count(gm_, example_inputs):
            self.graphs += 1
            return gm_
        return torch.compile(gm, backend=count, fullgraph=self.fullgraph, dynamic=True)


def test_reentrant_checkpoint_under_torch_compile_is_one_graph():
    """PyTorch's compiled autograd compiles the graph of a reentrant checkpoint in 3 dynamo
    graphs (test_checkpointing_simple_reentrant_True); gradfx's is one, with the
    checkpoint's backward an opaque call, and the inner backward on the engine: gradients
    bitwise eager's, the recomputation run as often, the RNG state after it eager's."""
    torch._dynamo.reset()

    def run(compiled):
        torch.manual_seed(3)
        inp = torch.rand(10, 10, requires_grad=True)
        calls = []

        def fn(x):
            calls.append(1)
            y = torch.nn.functional.dropout(x.sin(), 0.2)
            return (y * y.cos()).sum()

        out = checkpoint(fn, inp, use_reentrant=True)
        if compiled is None:
            out.backward()
        else:
            with gradfx.compiled_autograd(backend=compiled) as session:
                out.backward()
            assert session.stats["captures"] == 1
        return inp.grad, len(calls), torch.rand(2)

    backend = _Counting(fullgraph=False)
    expected, got = run(None), run(backend)
    assert backend.graphs == 1
    assert torch.equal(expected[0], got[0]) and expected[1] == got[1] == 2 and torch.equal(expected[2], got[2])


def test_selective_checkpoint_under_torch_compile_is_one_graph():
    """PyTorch's compiled autograd breaks the graph of a selective checkpoint 4 times
    (test_checkpointing_sac: 5 dynamo graphs); gradfx compiles one: the unpacks run in
    Python between compiled regions (docs/SEMANTICS.md).  Gradients bitwise eager's."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    torch._dynamo.reset()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_RECOMPUTE if op is torch.ops.aten.addmm.default \
            else CheckpointPolicy.PREFER_SAVE

    def run(compiled):
        torch.manual_seed(5)
        model = nn.Sequential(*[nn.Linear(10, 10) for _ in range(4)])
        x = torch.randn(1, 10)
        for _ in range(2):
            out = checkpoint(model, x, use_reentrant=False,
                             context_fn=lambda: create_selective_checkpoint_contexts(policy))
            if compiled is None:
                out.sum().backward()
            else:
                with gradfx.compiled_autograd(backend=compiled):
                    out.sum().backward()
        return [p.grad for p in model.parameters()]

    backend = _Counting(fullgraph=False)
    expected, got = run(None), run(backend)
    assert_same(expected, got)
    # one dynamo graph per gradfx graph, no graph break (the first backward of the structure
    # learns how the hooks unpack, the second captures the formulas: hooked_captures)
    assert backend.graphs == gradfx.stats()["captures"] == hooked_captures(), (backend.graphs, gradfx.stats())


def test_sparse_gradient_of_a_custom_backward_under_torch_compile():
    """A custom backward that returns a sparse gradient for a leaf whose .grad is dense:
    dynamo breaks at torch.sparse_coo_tensor (it cannot trace sparse tensors) and the
    rest runs eagerly; one dynamo graph, as PyTorch's (test_accumulate_grad_polyfill_case_2_3_3),
    and eager's in-place accumulation into the same .grad object."""
    torch._dynamo.reset()

    class SparseGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return torch.sparse_coo_tensor(torch.tensor([[0, 1], [0, 1]]), torch.tensor([3.0, 3.0]), g.size())

    def run(compiled):
        var = torch.ones(2, 2, requires_grad=True)
        var.grad = torch.ones(2, 2)
        before = var.grad
        out = SparseGrad.apply(var)
        if compiled is None:
            out.backward(torch.ones_like(out))
        else:
            with gradfx.compiled_autograd(backend=compiled):
                out.backward(torch.ones_like(out))
        assert var.grad is before and not var.grad.is_sparse
        return var.grad

    backend = _Counting(fullgraph=False)
    expected = run(None)
    with pytest.warns(UserWarning):  # dynamo's and torch's words on sparse tensors
        got = run(backend)
    assert torch.equal(expected, got) and backend.graphs == 1
