"""Custom ops (``torch.library.custom_op``) with ``register_autograd``: their backward traced.

torch requires a custom op's registered backward to be traceable (no ``data_ptr``, no
global state read or written), which is the promise ``gradfx.traceable`` asks for, so
gradfx traces it into the graph like a ``traceable`` Function's: its aten ops and the
custom ops it calls are graph nodes beside the hooks and accumulations, and the compilers
see them.  A custom op called inside that mutates its input stays a call of that op (the
built-in compilers functionalize it).  A backward that cannot run on fake tensors (a
custom op it calls has no fake implementation) runs as itself.
"""

from __future__ import annotations

import pytest
import torch

import gradfx
from helpers import run_both, snap


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield
    gradfx.reset()


@torch.library.custom_op("gradfx_tests::scaled_sin", mutates_args=())
def scaled_sin(x: torch.Tensor, k: float) -> torch.Tensor:
    return torch.sin(x) * k


@scaled_sin.register_fake
def _(x, k):
    return torch.empty_like(x)


def _setup_sin(ctx, inputs, output):
    x, k = inputs
    ctx.save_for_backward(x)
    ctx.k = k  # a ctx attribute the traced backward bakes in: part of the key


def _backward_sin(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad * x.cos() * ctx.k, None


scaled_sin.register_autograd(_backward_sin, setup_context=_setup_sin)


@torch.library.custom_op("gradfx_tests::scale_", mutates_args={"x"})
def scale_(x: torch.Tensor, k: float) -> None:
    x.mul_(k)


@scale_.register_fake
def _(x, k):
    return None


@torch.library.custom_op("gradfx_tests::doubled", mutates_args=())
def doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@doubled.register_fake
def _(x):
    return torch.empty_like(x)


def _backward_doubled(ctx, grad):
    out = grad.clone()
    torch.ops.gradfx_tests.scale_(out, 2.0)  # mutates a tensor of its own
    return out


doubled.register_autograd(_backward_doubled)


@torch.library.custom_op("gradfx_tests::real_only", mutates_args=())
def real_only(x: torch.Tensor) -> torch.Tensor:  # no fake implementation
    return x * 3


@torch.library.custom_op("gradfx_tests::tripled", mutates_args=())
def tripled(x: torch.Tensor) -> torch.Tensor:
    return x * 3


@tripled.register_fake
def _(x):
    return torch.empty_like(x)


tripled.register_autograd(lambda ctx, grad: real_only(grad))


@torch.library.custom_op("gradfx_tests::weighted_sum", mutates_args=())
def weighted_sum(xs: list[torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    return sum(x * w for x in xs)


@weighted_sum.register_fake
def _(xs, w):
    return torch.empty_like(xs[0])


def _setup_weighted(ctx, inputs, output):
    xs, w = inputs
    ctx.save_for_backward(w, *xs)


def _backward_weighted(ctx, grad):
    w, *xs = ctx.saved_tensors
    return [grad * w for _ in xs], sum(grad * x for x in xs)


weighted_sum.register_autograd(_backward_weighted, setup_context=_setup_weighted)


def _build(op, k=None):
    def build(log):
        torch.manual_seed(0)
        lin = torch.nn.Linear(6, 6)

        def step():
            h = lin(torch.randn(4, 6))
            h.register_hook(lambda g: log.append(("into the op", snap(g))))
            y = op(h) if k is None else op(h, k)
            y.register_hook(lambda g: log.append(("out of the op", snap(g))))
            y.square().mean().backward()
        return list(lin.parameters()), step
    return build


def _graph(op, *args):
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    return gradfx.capture(op(x, *args).square().mean())


def _targets(graph):
    return {n.target for n in graph.graph_module.graph.nodes if n.op == "call_function"}


def test_a_registered_backward_is_traced_bitwise():
    run_both(_build(scaled_sin, 0.5), iterations=3, backend="eager")  # a capture, then cache hits
    assert gradfx.stats()["cache_hits"] == 2
    graph = _graph(scaled_sin, 0.5)
    assert graph.opaque_nodes == []
    assert torch.ops.aten.cos.default in _targets(graph)
    assert "call_backward" not in graph.code


def test_a_ctx_attribute_the_backward_reads_is_keyed():
    """ctx.k is baked into the traced backward: another k recaptures, never reuses."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, requires_grad=True)
    for k in (0.5, 0.5, 2.0, 0.5):
        x.grad = None
        scaled_sin(x, k).sum().backward()
        expected = x.grad
        x.grad = None
        with gradfx.compiled_autograd(backend="eager", strict=True):
            scaled_sin(x, k).sum().backward()
        assert torch.equal(x.grad, expected)
    stats = gradfx.stats()
    assert stats["captures"] == 2 and stats["cache_hits"] == 2, stats


def test_a_mutating_custom_op_inside_stays_a_call_of_it():
    run_both(_build(doubled), iterations=3, backend="eager")
    graph = _graph(doubled)
    assert graph.opaque_nodes == []
    assert torch.ops.gradfx_tests.scale_.default in _targets(graph)


def test_a_backward_without_fakes_runs_as_itself():
    run_both(_build(tripled), iterations=2, backend="eager")
    assert [label.split(" #")[0] for label in _graph(tripled).opaque_nodes] == [
        "GeneratedBackwardFor_gradfx_tests_tripled_defaultBackward"]


def test_a_tensor_list_op():
    def build(log):
        torch.manual_seed(0)
        w = torch.randn(3, requires_grad=True)
        xs = [torch.randn(3, requires_grad=True) for _ in range(2)]
        for t in (w, *xs):
            t.register_hook(lambda g: log.append(("leaf", snap(g))))

        def step():
            weighted_sum(xs, w).square().sum().backward()
        return [w, *xs], step
    run_both(build, iterations=3, backend="eager")
    torch.manual_seed(0)
    xs = [torch.randn(3, requires_grad=True) for _ in range(2)]
    assert gradfx.capture(weighted_sum(xs, torch.randn(3, requires_grad=True)).sum()).opaque_nodes == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("inductor", marks=pytest.mark.sample), "aot_eager"])
def test_compilers_compile_the_backward_with_the_rest(backend):
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 6)
    for step in range(2):
        x = torch.randn(4, 6)
        lin.zero_grad(set_to_none=True)
        doubled(scaled_sin(lin(x), 0.5)).square().mean().backward()
        expected = [p.grad for p in lin.parameters()]
        lin.zero_grad(set_to_none=True)
        with gradfx.compiled_autograd(backend=backend) as session:
            doubled(scaled_sin(lin(x), 0.5)).square().mean().backward()
        assert session.stats["uncompiled"] == 0 and session.stats["fallbacks"] == 0, session.stats
        for got, want in zip((p.grad for p in lin.parameters()), expected):
            torch.testing.assert_close(got, want)
