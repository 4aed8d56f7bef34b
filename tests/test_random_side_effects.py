"""Random draws in a backward happen as in eager: the generators' state after every
backward, and the gradients, are eager's.

A draw is a side effect even where its result is unused (it advances the generator, and
every later draw, the next dropout mask included, depends on that): no trace step, pass
or backend may drop or reorder one.  The matrix: eager and torch.compile'd forwards x
gradfx's backends x five kinds of draw x where the draw is (a custom Function's backward,
traced; inside a compiled region that backward is part of the region's AOT graph; a
tensor hook).  Each case runs twice under gradfx (capture, then a cache hit) and is
compared with eager autograd: bitwise for the eager backend and a user backend returning
the graph, equal RNG states for every backend.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

import gradfx

GENERATOR = torch.Generator().manual_seed(1234)


def _draw(kind: str, g: torch.Tensor) -> torch.Tensor:
    """A draw shaped like ``g``: a value in (0, 2] the gradient is scaled by."""
    if kind == "randn":
        return 1.0 + torch.randn(g.shape).abs().clamp(max=1.0)
    if kind == "rand":
        return 1.0 + torch.rand(g.shape)
    if kind == "bernoulli":
        return 1.0 + torch.bernoulli(torch.full(g.shape, 0.5))
    if kind == "dropout":
        return 1.0 + F.dropout(torch.ones(g.shape), 0.5, training=True)
    if kind == "generator":
        return 1.0 + torch.rand(g.shape, generator=GENERATOR)
    raise AssertionError(kind)


DRAWS = ("randn", "rand", "bernoulli", "dropout", "generator")


def _function(kind: str):
    """A custom Function whose backward draws twice: once for the gradient, once only
    for the side effect (as PyTorch's test_dont_dce_side_effects has it)."""

    @gradfx.traceable
    class Draws(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            _draw(kind, torch.empty(3, 3))  # unused: only the generator sees it
            return g * _draw(kind, g)

    Draws.__name__ = Draws.__qualname__ = f"Draws_{kind}"
    return Draws


FUNCTIONS = {kind: _function(kind) for kind in DRAWS}


def _program(kind: str, where: str, x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x) * 3
    if where == "custom backward":
        h = FUNCTIONS[kind].apply(h)
    else:
        h = h * 2
        if h.requires_grad:
            h.register_hook(lambda g: g * _draw(kind, g))
    return (h.sin() * x).sum()


@functools.cache
def _compiled_program(kind: str, where: str):
    # A hook is registered on a tensor outside the compiled region: dynamo graph-breaks there.
    return torch.compile(functools.partial(_program, kind, where), backend="aot_eager")


def _user_backend(gm, example_inputs):
    return gm


def _user_compile_backend(gm, example_inputs):
    return torch.compile(gm, backend="aot_eager")


BACKENDS = {"eager": "eager", "aot_eager": "aot_eager", "user": _user_backend,
            "user torch.compile": _user_compile_backend}


def _states():
    return torch.get_rng_state(), GENERATOR.get_state()


def _one_backward(kind, where, compiled, backend, seed):
    """(gradient of x, generator states after the backward, the next dropout mask)."""
    program = _compiled_program(kind, where) if compiled else functools.partial(_program, kind, where)
    x = torch.linspace(-1.0, 1.0, 12).reshape(3, 4).requires_grad_()
    # AOT's partitioner may move a draw that needs no gradient into the region's forward:
    # the forward starts from a known state too.
    torch.manual_seed(seed + 100)
    GENERATOR.manual_seed(seed + 200)
    loss = program(x)
    torch.manual_seed(seed)
    GENERATOR.manual_seed(seed + 1)
    if backend is None:
        loss.backward()
    else:
        with gradfx.compiled_autograd(backend=backend, strict=True):
            loss.backward()
    states = _states()
    mask = F.dropout(torch.ones(16), 0.5, training=True)
    return x.grad, states, mask


def _check(kind, where, compiled, backend, exact):
    if compiled:
        torch._dynamo.reset()
        _compiled_program.cache_clear()
        _one_backward(kind, where, compiled, None, 0)  # compiled ahead, the region's backward too
    for seed in (3, 4):  # a capture, then a cache hit
        expected = _one_backward(kind, where, compiled, None, seed)
        got = _one_backward(kind, where, compiled, backend, seed)
        assert torch.equal(expected[1][0], got[1][0]), "the default generator's state after the backward differs"
        assert torch.equal(expected[1][1], got[1][1]), "the user's generator's state after the backward differs"
        assert torch.equal(expected[2], got[2]), "the next dropout mask differs"
        if exact:
            assert torch.equal(expected[0], got[0])
        else:
            torch.testing.assert_close(got[0], expected[0])


@pytest.fixture(autouse=True)
def _fallback_random():
    # A user's torch.compile backend draws through inductor's own RNG unless told to fall back.
    with torch._inductor.config.patch(fallback_random=True):
        yield


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("where", ["custom backward", "hook"])
@pytest.mark.parametrize("kind", DRAWS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager forward", "compiled forward"])
def test_draws_as_eager(compiled, kind, where, backend):
    _check(kind, where, compiled, BACKENDS[backend], exact=backend in ("eager", "user"))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["custom backward", "hook"])
@pytest.mark.parametrize("kind", DRAWS)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager forward", "compiled forward"])
def test_draws_as_eager_inductor(compiled, kind, where):
    _check(kind, where, compiled, "inductor", exact=False)


@pytest.mark.slow
@pytest.mark.sample
def test_draws_as_eager_inductor_sample():
    _check("dropout", "custom backward", True, "inductor", exact=False)


def test_draw_kept_in_the_graph_a_backend_gets():
    """The unused draw reaches the backend's graph, in eager's order with the other one."""
    seen = []

    def backend(gm, example_inputs):
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm

    x = torch.ones(3, 4, requires_grad=True)
    loss = FUNCTIONS["randn"].apply(x).sum()
    with gradfx.compiled_autograd(backend=backend):
        loss.backward()
    draws = [t for t in seen[0] if t is torch.ops.aten.randn.default]
    assert len(draws) == 2


def test_dce_keeps_random_ops():
    from gradfx.capture.trace.fx_kinds import op_has_side_effect
    aten = torch.ops.aten
    for op in (aten.randn.default, aten.rand.generator, aten.bernoulli.p, aten.native_dropout.default,
               aten.randint.low, aten.normal_.default, aten.add_.Tensor, aten.copy_.default):
        assert op_has_side_effect(op), op
    for op in (aten.mm.default, aten.expand.default, aten.empty.memory_format, aten.zeros_like.default):
        assert not op_has_side_effect(op), op


def test_backward_that_seeds_runs_as_itself():
    """A traceable backward that sets the generator's state: tracing would do it once, at
    trace time; the backward runs as itself instead, and the state is eager's."""

    @gradfx.traceable
    class Seeds(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            torch.manual_seed(7)
            return g * 2

    def run(use):
        x = torch.ones(3, requires_grad=True)
        loss = Seeds.apply(x).sum()
        torch.manual_seed(0)
        if use:
            with gradfx.compiled_autograd(backend="eager") as session:
                loss.backward()
            assert session.graphs[0].opaque_nodes
        else:
            loss.backward()
        return x.grad, torch.rand(4)

    expected, got = run(False), run(True)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
