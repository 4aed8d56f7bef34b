"""create_graph=True is captured: gradients carry eager's autograd history, bitwise.

Each program runs eagerly and under gradfx (strict: no fallback), three
iterations; every gradient of both orders, what requires grad and the grad_fn
types of the first-order results are compared with eager.
"""

import contextlib
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import gradfx


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
        else:
            assert x == y


def _describe(t):
    """What eager's history looks like from outside: requires_grad and the grad_fn type."""
    return (t.requires_grad, type(t.grad_fn).__name__ if t.grad_fn is not None else None)


def _mlp():
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 1))


def hvp(block, batch=5):
    """Hessian-vector product of an MLP."""
    torch.manual_seed(0)
    model = _mlp()
    params = list(model.parameters())
    out = []
    for it in range(3):
        torch.manual_seed(10 + it)
        x = torch.randn(batch, 4)
        v = [torch.randn_like(p) for p in params]
        with block():
            g = torch.autograd.grad(model(x).square().mean(), params, create_graph=True)
            dot = sum((a * b).sum() for a, b in zip(g, v))
            h = torch.autograd.grad(dot, params)
        out += [t.detach() for t in g] + list(h) + [_describe(t) for t in g]
    return out


def wgan_gp(block, batch=8):
    """A WGAN-GP critic step: the penalty on the gradient norm at interpolated inputs."""
    torch.manual_seed(1)
    critic = nn.Sequential(nn.Linear(6, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt = torch.optim.SGD(critic.parameters(), lr=0.01)
    out = []
    for it in range(3):
        torch.manual_seed(20 + it)
        real, fake, eps = torch.randn(batch, 6), torch.randn(batch, 6), torch.rand(batch, 1)
        inter = (eps * real + (1 - eps) * fake).requires_grad_(True)
        opt.zero_grad()
        with block():
            g, = torch.autograd.grad(critic(inter).sum(), inter, create_graph=True)
            penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
            (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
        out += [p.grad.clone() for p in critic.parameters()] + [_describe(g)]
        opt.step()
    return out


def maml(block, batch=5):
    """A two-step inner loop MAML update on a small MLP (functional, torch.func)."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    meta = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for it in range(3):
        torch.manual_seed(30 + it)
        xs, ys, xq, yq = torch.randn(batch, 3), torch.randn(batch, 1), torch.randn(batch, 3), torch.randn(batch, 1)
        meta.zero_grad()
        with block():
            fast = dict(model.named_parameters())
            for _ in range(2):
                loss = (torch.func.functional_call(model, fast, (xs,)) - ys).square().mean()
                grads = torch.autograd.grad(loss, list(fast.values()), create_graph=True)
                fast = {k: w - 0.1 * g for (k, w), g in zip(fast.items(), grads)}
            (torch.func.functional_call(model, fast, (xq,)) - yq).square().mean().backward()
        out += [p.grad.clone() for p in model.parameters()]
        meta.step()
    return out


def grad_of_grad(block, batch=4):
    """``.grad`` set by backward(create_graph=True), then differentiated."""
    torch.manual_seed(3)
    w = torch.randn(3, 3, requires_grad=True)
    out = []
    for it in range(3):
        torch.manual_seed(40 + it)
        x = torch.randn(batch, 3)
        w.grad = None
        with block():
            (x @ w).tanh().sum().backward(create_graph=True)
            first = w.grad
            (first ** 2).sum().backward()
        out += [first.detach().clone(), w.grad.detach().clone(), _describe(first), _describe(w.grad)]
    return out


class Cube(torch.autograd.Function):
    """A custom Function whose backward is differentiable."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return 3 * x ** 2 * grad


def custom_function(block, batch=4):
    torch.manual_seed(4)
    lin = nn.Linear(3, 3)
    out = []
    for it in range(3):
        torch.manual_seed(50 + it)
        x = torch.randn(batch, 3, requires_grad=True)
        with block():
            g, = torch.autograd.grad(Cube.apply(lin(x)).sum(), x, create_graph=True)
            gg, = torch.autograd.grad(g.sum(), x)
        out += [g.detach(), gg, _describe(g)]
    return out


PROGRAMS = {"hvp": (hvp, 2), "wgan_gp": (wgan_gp, 2), "maml": (maml, 3), "grad_of_grad": (grad_of_grad, 2),
            "custom_function": (custom_function, 2)}


class _Eager:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_both_orders_bitwise(name):
    program, calls = PROGRAMS[name]
    expected = program(_Eager)
    got = program(lambda: gradfx.compiled_autograd(strict=True))
    _same(expected, got)
    stats = gradfx.stats()
    assert stats["fallbacks"] == 0 and stats["captures"] == calls, stats  # one capture per distinct call
    assert stats["cache_hits"] == 2 * calls


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_symbolic_sizes_over_two_batch_sizes(name):
    program, calls = PROGRAMS[name]
    for batch in (5, 7):
        expected = program(_Eager, batch)
        got = program(lambda: gradfx.compiled_autograd(strict=True, dynamic=True), batch)
        _same(expected, got)
    assert gradfx.stats()["fallbacks"] == 0


def test_alternating_plain_and_create_graph_keeps_two_graphs():
    torch.manual_seed(5)
    model = _mlp()
    reference = copy.deepcopy(model)
    for it in range(4):
        x = torch.randn(5, 4)
        create = it % 2 == 1
        for m, use in ((reference, False), (model, True)):
            m.zero_grad()
            if use:
                with gradfx.compiled_autograd(strict=True):
                    m(x).sum().backward(create_graph=create)
            else:
                m(x).sum().backward(create_graph=create)
        for p, q in zip(reference.parameters(), model.parameters()):
            assert torch.equal(p.grad, q.grad) and _describe(p.grad) == _describe(q.grad)
    stats = gradfx.stats()
    assert stats["captures"] == 2 and stats["cache_hits"] == 2 and stats["recaptures"] == 0, stats


def test_eagers_one_time_warning_is_given_as_eager_gives_it():
    script = """
import warnings, torch, gradfx
w = torch.randn(3, requires_grad=True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if {use}:
        with gradfx.compiled_autograd(strict=True):
            (w * w).sum().backward(create_graph=True)
            (w * w).sum().backward(create_graph=True)
    else:
        (w * w).sum().backward(create_graph=True)
        (w * w).sum().backward(create_graph=True)
    torch.autograd.grad((w * w).sum(), w, create_graph=True)
    (w * 2).sum().backward(create_graph=True)  # eager, after the block
print([(type(c.message).__name__, str(c.message).split(" (Triggered")[0], c.filename.split("torch/")[-1])
       for c in caught])
"""
    outs = [subprocess.run([sys.executable, "-c", script.format(use=use)], capture_output=True, text=True,
                           timeout=300).stdout for use in (False, True)]
    assert outs[0] and outs[0] == outs[1]
    assert "reference cycle" in outs[0] and outs[0].count("UserWarning") == 1


def test_a_users_backend_compiles_create_graph_graphs():
    # Its code records history (the graph's own Python here): both orders bitwise eager.
    compiled = []

    def backend(gm, example_inputs):
        compiled.append(len(gm.graph.nodes))
        return gm.forward

    expected = hvp(lambda: contextlib.nullcontext())
    gradfx.reset()
    got = hvp(lambda: gradfx.compiled_autograd(backend=backend, strict=True))
    _same(expected, got)
    assert len(compiled) == 2  # the create_graph graph and the plain one (cached after)


def test_built_in_compilers_run_create_graph_graphs_on_the_eager_backend(caplog):
    expected = hvp(lambda: contextlib.nullcontext())
    gradfx.reset()
    with caplog.at_level("INFO", logger="gradfx"):
        got = hvp(lambda: gradfx.compiled_autograd(backend="aot_eager", strict=True))
    _same(expected[:4], got[:4])  # the create_graph gradients: the eager backend's, bitwise
    said = [r for r in caplog.records if "create_graph backwards run on the eager backend" in r.getMessage()]
    assert len(said) == 1  # at its compile (the later iterations are cache hits)
