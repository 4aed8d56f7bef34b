"""Backward entry points, errors, fallbacks, counters and the cache (API.md §1-3, §5-6)."""

import threading
import warnings

import pytest
import torch
import torch.nn as nn

import gradfx
from helpers import assert_same


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def _leaf(*shape, seed=0):
    torch.manual_seed(seed)
    return torch.randn(*shape, requires_grad=True)


def test_several_roots_and_grad_outputs():
    def run(use_gfx):
        x, w = _leaf(4, 3), _leaf(3, 5, seed=1)
        y = x @ w
        z = y.tanh()
        g1, g2 = torch.ones(4, 5) * 0.3, torch.linspace(0, 1, 20).reshape(4, 5)
        if use_gfx:
            with gradfx.compiled_autograd() as s:
                torch.autograd.backward([y, z], [g1, g2])
            assert s.stats["captures"] == 1
        else:
            torch.autograd.backward([y, z], [g1, g2])
        return [x.grad, w.grad]
    assert_same(run(False), run(True))


def test_autograd_grad_inputs_and_allow_unused():
    def run(use_gfx):
        x, w, unused = _leaf(4, 3), _leaf(3, 5, seed=1), _leaf(2, seed=2)
        h = (x @ w).relu()
        out = (h * h).sum()
        args = dict(allow_unused=True)
        if use_gfx:
            with gradfx.compiled_autograd():
                res = torch.autograd.grad(out, [w, h, unused], **args)
        else:
            res = torch.autograd.grad(out, [w, h, unused], **args)
        assert x.grad is None and w.grad is None  # grad() never writes .grad
        return list(res)
    assert_same(run(False), run(True))


def test_autograd_grad_unused_raises_like_eager():
    x, unused = _leaf(3), _leaf(3, seed=1)
    with pytest.raises(RuntimeError) as eager_err:
        torch.autograd.grad((x * 2).sum(), [x, unused])
    with gradfx.compiled_autograd():
        with pytest.raises(type(eager_err.value), match="allow_unused=True"):
            torch.autograd.grad((x * 2).sum(), [x, unused])


def test_backward_inputs_accumulates_only_those():
    def run(use_gfx):
        a, b = _leaf(3), _leaf(3, seed=1)
        loss = (a * b).sum()
        if use_gfx:
            with gradfx.compiled_autograd():
                loss.backward(inputs=[a])
        else:
            loss.backward(inputs=[a])
        return [a.grad, b.grad]
    assert_same(run(False), run(True))


def test_non_scalar_output_with_grad_output():
    def run(use_gfx):
        x = _leaf(2, 3)
        y = x.exp() * x
        g = torch.arange(6.0).reshape(2, 3)
        if use_gfx:
            with gradfx.compiled_autograd():
                y.backward(g)
        else:
            y.backward(g)
        return [x.grad]
    assert_same(run(False), run(True))


def test_retain_graph_twice_then_freed_error():
    def run(use_gfx):
        torch.manual_seed(3)
        lin = nn.Linear(4, 4)
        loss = lin(torch.randn(2, 4)).tanh().sum()
        ctx = gradfx.compiled_autograd() if use_gfx else _null()
        with ctx:
            loss.backward(retain_graph=True)
            loss.backward()
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()
        return [lin.weight.grad, lin.bias.grad]
    assert_same(run(False), run(True))


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        pass


def test_saved_tensor_modified_inplace_same_error():
    x = _leaf(3)
    a = x * 1
    loss = (a * a).sum()
    a.add_(1)
    with gradfx.compiled_autograd():
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    assert x.grad is None


def test_second_backward_after_eager_backward_raises():
    x = _leaf(3)
    loss = (x * x).sum()
    loss.backward()
    with gradfx.compiled_autograd():
        with pytest.raises(RuntimeError, match="second time"):
            loss.backward()


def test_counters_every_call_counts_once():
    lin = nn.Linear(3, 3)
    with gradfx.compiled_autograd() as s:
        for _ in range(3):
            lin(torch.randn(2, 3)).sum().backward()
        with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True):
            warnings.simplefilter("ignore")
            x = _leaf(3)
            (x * x).sum().backward()  # falls back: anomaly detection
    assert s.stats == {"captures": 1, "cache_hits": 2, "fallbacks": 1, "compiles": 1, "recaptures": 0,
                       "recompiles": 0, "uncompiled": 0}
    assert gradfx.stats() == s.stats
    gradfx.reset()
    assert gradfx.stats() == dict.fromkeys(s.stats, 0)


def test_fallback_warns_once_per_reason_and_strict_raises():
    x = _leaf(3)
    with gradfx.compiled_autograd(), torch.autograd.set_detect_anomaly(True):
        with pytest.warns(gradfx.FallbackWarning, match="anomaly"):
            (x * x).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            (x * x).sum().backward()  # no second warning in this block
    with gradfx.compiled_autograd(strict=True), torch.autograd.set_detect_anomaly(True):
        with pytest.raises(gradfx.Unsupported, match="anomaly"):
            (x * x).sum().backward()


def test_unknown_backend_raises_before_any_gradient():
    x = _leaf(3)
    with pytest.raises(ValueError, match="eager"):
        with gradfx.compiled_autograd(backend="no-such-backend"):
            (x * 2).sum().backward()
    assert x.grad is None


def test_backend_name_must_be_a_str():
    with pytest.raises(TypeError, match="str"):
        gradfx.register_backend(3, lambda gm, example_inputs: gm)
    with pytest.raises(TypeError, match="str"):
        gradfx.register_backend(None)
    assert None not in gradfx.list_backends()


def test_user_backend_two_and_one_argument_forms():
    calls = []

    def two(gm, example_inputs):
        calls.append(("two", len(example_inputs)))
        return gm

    @gradfx.register_backend("counting")
    def one(gm):
        calls.append(("one",))
        return gm

    assert "counting" in gradfx.list_backends()
    lin = nn.Linear(3, 2)
    for backend in (two, "counting"):
        for _ in range(3):
            with gradfx.compiled_autograd(backend=backend):
                lin(torch.randn(4, 3)).sum().backward()
    assert [c[0] for c in calls] == ["two", "one"]


def test_backend_compile_failure_falls_back_to_eager_backend():
    def broken(gm, example_inputs):
        raise RuntimeError("boom")
    lin = nn.Linear(3, 2)
    torch.manual_seed(0)
    x = torch.randn(4, 3)
    with pytest.warns(gradfx.FallbackWarning, match="boom"):
        with gradfx.compiled_autograd(backend=broken):
            lin(x).sum().backward()
    expected = torch.ones(4, 2).t() @ x
    assert torch.equal(lin.weight.grad, expected)
    with gradfx.compiled_autograd(backend=lambda gm, ex: (_ for _ in ()).throw(RuntimeError("bad")),
                                  strict=True):
        lin2 = nn.Linear(3, 2)
        with pytest.raises(gradfx.Unsupported) as err:
            lin2(x).sum().backward()
        assert isinstance(err.value.__cause__, RuntimeError)


def test_nested_blocks_innermost_counts():
    lin = nn.Linear(3, 3)
    with gradfx.compiled_autograd() as outer:
        lin(torch.randn(1, 3)).sum().backward()
        with gradfx.compiled_autograd() as inner:
            lin(torch.randn(1, 3)).sum().backward()
    assert outer.stats["captures"] + outer.stats["cache_hits"] == 1
    assert inner.stats["captures"] + inner.stats["cache_hits"] == 1
    assert gradfx.stats()["captures"] + gradfx.stats()["cache_hits"] == 2


def test_other_threads_are_not_routed():
    lin = nn.Linear(3, 3)
    done = []

    def worker():
        lin(torch.randn(1, 3)).sum().backward()
        done.append(True)
    with gradfx.compiled_autograd() as s:
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert done and s.stats == dict.fromkeys(s.stats, 0)


def test_cache_survives_block_and_structure_change_recaptures():
    lin = nn.Linear(3, 3)
    with gradfx.compiled_autograd():
        lin(torch.randn(2, 3)).sum().backward()
    with gradfx.compiled_autograd() as s:
        lin(torch.randn(2, 3)).sum().backward()
        lin(torch.randn(2, 3)).relu().sum().backward()
    assert s.stats["cache_hits"] == 1 and s.stats["captures"] == 1
    assert len(s.graphs) == 1


def test_scalar_value_change_recaptures():
    # pow's exponent is a saved scalar baked into the graph: part of the cache key.
    x = _leaf(3)
    for k in (2.0, 2.0, 3.0, 3):
        expected = torch.autograd.grad(x.pow(k).sum(), x)[0]
        x.grad = None
        with gradfx.compiled_autograd() as s:
            x.pow(k).sum().backward()
        assert torch.equal(x.grad, expected)
    s = gradfx
    assert s.stats()["captures"] == 3 and s.stats()["cache_hits"] == 1


def test_lru_bound():
    from gradfx.capture.run.cache import cache
    gradfx.set_cache_size(2)
    try:
        x = _leaf(3)
        with gradfx.compiled_autograd() as s:
            for k in (1.0, 2.0, 3.0, 1.0):
                x.pow(k).sum().backward()
        assert len(cache) == 2 and s.stats["captures"] == 4
    finally:
        gradfx.set_cache_size(128)


def test_capture_runs_nothing_and_changes_nothing():
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    loss = lin(x).relu().sum()
    graph = gradfx.capture(loss)
    assert isinstance(graph, gradfx.CapturedGraph)
    assert lin.weight.grad is None and lin.bias.grad is None
    assert "accumulate_grad" in graph.code
    loss.backward()  # a later real backward behaves as usual
    lin2 = nn.Linear(4, 3)
    lin2.load_state_dict(lin.state_dict())
    lin2(x).relu().sum().backward()
    assert torch.equal(lin.weight.grad, lin2.weight.grad)
    g = gradfx.capture(lin(x).sum(), inputs=[lin.weight])
    assert "accumulate_grad" not in g.code


def test_public_names():
    for name in ["compiled_autograd", "stats", "reset", "capture", "register_backend",
                 "list_backends", "list_passes", "Unsupported", "FallbackWarning", "CapturedGraph"]:
        assert hasattr(gradfx, name)
    assert {"eager", "inductor", "aot_eager"} <= set(gradfx.list_backends())


def test_batched_gradients_fall_back_to_the_eager_engine():
    # autograd.grad(is_grads_batched=True) and vectorized jacobians run the backward under
    # vmap with batched gradients: the eager engine runs them, with one clear warning.
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    y = (x @ w).tanh()
    seeds = torch.eye(12).reshape(12, 3, 4)
    expected = torch.autograd.grad(y, (x, w), seeds, is_grads_batched=True, retain_graph=True)
    with gradfx.compiled_autograd() as s:
        with pytest.warns(gradfx.FallbackWarning, match="is_grads_batched"):
            got = torch.autograd.grad(y, (x, w), seeds, is_grads_batched=True, retain_graph=True)
        jac = torch.autograd.functional.jacobian(lambda v: (v @ w).tanh(), x.detach(), vectorize=True)
    assert all(torch.equal(a, b) for a, b in zip(expected, got))
    assert torch.equal(jac, torch.autograd.functional.jacobian(lambda v: (v @ w).tanh(), x.detach(), vectorize=True))
    assert s.stats["fallbacks"] == 2 and s.stats["captures"] == 0
    with gradfx.compiled_autograd(strict=True):
        with pytest.raises(gradfx.Unsupported, match="batched gradients"):
            torch.autograd.grad(y, x, seeds, is_grads_batched=True, retain_graph=True)
