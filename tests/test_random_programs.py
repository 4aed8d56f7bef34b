"""Random programs: bitwise eager gradients, the same hook calls in the same order.

A program mixes views, in-place ops (also on slices), fan-in, tensor hooks, node
hooks registered through expressions (``b.grad_fn``, ``next_functions``),
``retain_grad()`` twice, hooks removed through their handles, sparse embeddings,
``masked_fill`` with a tensor value, index ops, ``prod``/``cumprod`` over
zeros, an opaque custom Function (a non-differentiable output, a number, a
gradient returned in another layout), one whose backward sometimes returns None, non-reentrant checkpoints and hooks that
return gradients laid out otherwise.  PyTorch's own compiled autograd differs from eager on about one such
program in five (summation order at fan-in, tensor pre-hook order); gradfx must
not.  Each program also runs at several sizes with symbolic sizes.

GRADFX_RANDOM_PROGRAMS=1000 runs more of them (CI runs a fixed 50);
GRADFX_RANDOM_SIZED=200 more of the sized ones.
"""

import os
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import gradfx

UNARY = [torch.sin, torch.tanh, torch.sigmoid, torch.exp, lambda t: t * 1.7, lambda t: t.relu(),
         lambda t: t.pow(2), lambda t: t / 3.0]
OPS = ["unary", "add", "mul", "view", "inplace", "slice_inplace", "fanin", "hook", "node_hook",
       "next_hook", "retain_twice", "removed_hook", "embedding", "masked_fill", "index", "prod",
       "function", "checkpoint", "odd_hook", "none_function", "norm"]


def _odd_layout(g, layout):
    """The same gradient laid out otherwise (column-major), or a stride-0 one."""
    if layout == "columns":
        return g.t().contiguous().t()
    if layout == "expanded":
        return g.sum(0, keepdim=True).expand_as(g)
    return g


class _OddFunction(torch.autograd.Function):
    """An opaque custom Function with a non-differentiable index output and a number,
    whose backward returns its gradient in another layout."""

    @staticmethod
    def forward(ctx, x, layout, log, step):
        ctx.layout, ctx.log, ctx.step = layout, log, step
        idx = x.argmax(1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x * 2.0, idx, x.shape[0]

    @staticmethod
    def backward(ctx, g, g_idx, g_n):
        x, = ctx.saved_tensors
        ctx.log.append(("function", ctx.step, g_idx.dtype, tuple(g_idx.shape), g_n))
        return _odd_layout(g * 2.0 + x * 0.25, ctx.layout), None, None, None


class _SometimesNone(torch.autograd.Function):
    """An opaque custom Function whose backward returns None for its input when the
    incoming gradient sums below zero: eager then hands the formulas before it no
    gradient (the captured graph stops there and the rest runs node by node)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.5

    @staticmethod
    def backward(ctx, g):
        return None if g.sum() < 0 else g * 1.5


def _summary(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return round(x.to_dense().double().sum().item(), 12) if x.is_sparse else x.double().sum().item()
    return tuple(_summary(v) for v in x)


def _program(seed, log, n=4):
    """(tensors whose .grad is compared, loss) of a random program; hooks append to ``log``."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    leaves = [torch.randn(n, 6, requires_grad=True) for _ in range(3)]
    extra = []  # leaves some ops add: embedding tables, fill values
    retained = []
    for k, leaf in enumerate(leaves):
        if rng.random() < 0.5:
            leaf.register_hook(lambda g, k=k: log.append(("leaf", k, _summary(g))))
    values = [leaf * 1.0 for leaf in leaves]
    for step in range(rng.randint(4, 9)):
        op = rng.choice(OPS)
        a = rng.choice(values)
        if op == "unary":
            values.append(rng.choice(UNARY)(a))
        elif op == "add":
            values.append(a + rng.choice(values))
        elif op == "mul":
            values.append(a * rng.choice(values))
        elif op == "view":
            values.append(a.t().contiguous().view(n, 6) * 0.5 + a.reshape(2, 3 * n).view(n, 6))
        elif op == "inplace":
            b = a.clone()
            b.mul_(1.3).add_(0.1)
            values.append(b)
        elif op == "slice_inplace":
            b = a.clone()
            b[:, 1:3] = b[:, 1:3] * 2.0
            values.append(b)
        elif op == "fanin":
            values.append(sum(torch.cos(rng.choice(values)) for _ in range(3)))
        elif op == "hook":
            b = a * 1.0
            b.register_hook(lambda g, s=step: log.append(("hook", s, _summary(g))))
            values.append(b)
        elif op == "node_hook":  # through an expression, pre or post, sometimes changing grads
            b = a.sin() * 1.5
            if rng.random() < 0.5:
                b.grad_fn.register_prehook(lambda go, s=step: (log.append(("pre", s, _summary(go))),
                                                               (go[0] * 0.5,))[1])
            else:
                b.grad_fn.register_hook(lambda gi, go, s=step: log.append(("post", s, _summary(gi), _summary(go))))
            values.append(b)
        elif op == "next_hook":
            b = a.exp() + 1.0
            b.grad_fn.next_functions[0][0].register_hook(
                lambda gi, go, s=step: log.append(("next", s, _summary(gi))))
            values.append(b)
        elif op == "retain_twice":
            b = a * 1.1
            b.retain_grad()
            b.retain_grad()
            retained.append(b)
            values.append(b)
        elif op == "removed_hook":
            b = a.tanh()
            handle = b.register_hook(lambda g: log.append(("removed", _summary(g))))
            node_handle = b.grad_fn.register_hook(lambda gi, go: log.append(("removed node",)))
            handle.remove()
            node_handle.remove()
            values.append(b)
        elif op == "embedding":
            table = torch.randn(10, 6, requires_grad=True)
            extra.append(table)
            idx = torch.randint(0, 10, (n,))
            values.append(F.embedding(idx, table, sparse=True) + a)
        elif op == "masked_fill":
            fill = torch.randn((), requires_grad=True)
            extra.append(fill)
            values.append(a.masked_fill(torch.rand(n, 6) > 0.5, fill))
        elif op == "index":
            rows = torch.randint(0, n, (n,))
            cols = torch.randint(0, 6, (n, 6))
            kind = rng.choice(["index_add", "scatter", "gather", "scatter_add", "index_select"])
            if kind == "index_add":
                values.append(torch.zeros(n, 6).index_add(0, rows, a * 1.5))
            elif kind == "scatter":
                values.append(a.scatter(1, cols[:, :2], rng.choice(values)[:, :2]))
            elif kind == "gather":
                values.append(a.gather(1, cols))
            elif kind == "scatter_add":
                values.append(torch.zeros(n, 6).scatter_add(1, cols, a))
            else:
                values.append(a.index_select(0, rows))
        elif op == "function":
            y, idx, rows = _OddFunction.apply(a, rng.choice(["plain", "columns", "expanded"]), log, step)
            values.append(y + idx.unsqueeze(1) * 0.5 + rows)
        elif op == "none_function":
            values.append(_SometimesNone.apply(a) * (1.0 if rng.random() < 0.5 else -1.0))
        elif op == "checkpoint":
            values.append(checkpoint(lambda t: (t.sin() * t).tanh(), a, use_reentrant=False))
        elif op == "odd_hook":
            b = a * 1.25
            layout = rng.choice(["columns", "expanded"])
            b.register_hook(lambda g, layout=layout: _odd_layout(g * 1.0, layout))
            values.append(b)
        elif op == "norm":  # layer norm (a weight and bias or none), GELU, SiLU, a selected column, a row sum
            kind = rng.choice(["layer_norm", "gelu", "silu", "select", "sum"])
            if kind == "layer_norm":
                params = [torch.randn(6, requires_grad=True) for _ in range(2)] if rng.random() < 0.5 else [None, None]
                extra.extend(p for p in params if p is not None)
                values.append(F.layer_norm(a, (6,), *params))
            elif kind == "gelu":
                values.append(F.gelu(a, approximate=rng.choice(["none", "tanh"])))
            elif kind == "silu":
                values.append(F.silu(a))
            elif kind == "select":
                values.append(a.select(1, rng.randrange(6)).unsqueeze(1) * a)
            else:
                values.append(a.sum(1, keepdim=True) * 0.1 + a.sum(0) * 0.2)
        elif op == "prod":  # zeros where a random mask says, differentiably
            z = torch.where(torch.rand(n, 6) < 0.2, 0.0, a)
            values.append(z.prod(1, keepdim=True) * z + z.cumprod(1))
    loss = sum(v.sum() * (0.1 * k + 1) for k, v in enumerate(values[3:])) + values[-1].pow(2).sum()
    return leaves + extra + retained, loss


def _grads(tensors):
    return [None if t.grad is None else t.grad.coalesce() if t.grad.is_sparse else t.grad for t in tensors]


def _same(expected, got):
    assert len(expected) == len(got)
    for e, g in zip(expected, got):
        assert (e is None) == (g is None)
        if e is not None:
            assert e.layout == g.layout and torch.equal(e.to_dense(), g.to_dense())


def _check(seed, n=4, **block):
    eager_log, gfx_log = [], []
    tensors, loss = _program(seed, eager_log, n)
    loss.backward()
    expected = _grads(tensors)
    tensors, loss = _program(seed, gfx_log, n)
    with gradfx.compiled_autograd(strict=True, **block) as session:
        loss.backward()
    _same(expected, _grads(tensors))
    assert eager_log == gfx_log
    return session


@pytest.mark.parametrize("seed", range(int(os.environ.get("GRADFX_RANDOM_PROGRAMS", 50))))
def test_random_program(seed):
    _check(seed)


@pytest.mark.parametrize("seed", range(int(os.environ.get("GRADFX_RANDOM_SIZED", 6))))
@pytest.mark.parametrize("dynamic", [True, "auto"])
def test_random_program_at_several_sizes(seed, dynamic):
    gradfx.reset()
    for n in (4, 6, 3, 8):
        _check(1000 + seed, n, dynamic=dynamic)
