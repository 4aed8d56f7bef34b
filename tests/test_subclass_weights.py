"""A frozen weight that is a tensor subclass (a scaled int8 weight, as QLoRA's and
float8's wrapper subclasses are) under trainable LoRA adapters: the nodes that saved the
subclass are traced through it (its flatten protocol: the graph reads the int8 data and
the scale from the node and records the dequantizing ops its ``__torch_dispatch__``
runs), and gradients and hook calls are eager's bitwise.  A gradient that turns out a
subclass where the graph traced a plain tensor stops the graph there; the rest runs node
by node."""

import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_map

import gradfx

aten = torch.ops.aten


class Int8Weight(torch.Tensor):
    """int8 data and a per-row scale; matmuls dequantize, views (``t``, ``detach``) stay
    int8 (``transposed``: the data is the original's transpose)."""

    @staticmethod
    def __new__(cls, data, scale, transposed=False):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=scale.dtype, device=data.device)

    def __init__(self, data, scale, transposed=False):
        self.data8 = data
        self.scale = scale
        self.transposed = transposed

    @classmethod
    def quantize(cls, w):
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        return cls(torch.round(w / scale).to(torch.int8), scale)

    def dequantize(self):
        if self.transposed:
            return (self.data8.t().to(self.scale.dtype) * self.scale).t()
        return self.data8.to(self.scale.dtype) * self.scale

    def __tensor_flatten__(self):
        return ["data8", "scale"], self.transposed

    @classmethod
    def __tensor_unflatten__(cls, inner, transposed, outer_size, outer_stride):
        return cls(inner["data8"], inner["scale"], transposed)

    def __repr__(self):
        return f"Int8Weight({tuple(self.shape)}, transposed={self.transposed})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default, aten.t.default):
            w = args[0]
            if func is aten.t.default:
                out = cls(w.data8.t(), w.scale, not w.transposed)
            else:
                out = cls(w.data8, w.scale, w.transposed)
            return return_and_correct_aliasing(func, args, kwargs, out)
        plain = tree_map(lambda a: a.dequantize() if isinstance(a, Int8Weight) else a, args)
        return func(*plain, **kwargs)


class ClippedInt8Weight(Int8Weight):
    """Its dequantization decides on its data (Python branches on the largest scale): not
    traceable on fakes, so the nodes that saved it run as themselves.  (A number read and
    only computed with, ``scale.max().item() * 2``, is traced: an op of the graph.)"""

    def dequantize(self):
        w = super().dequantize()
        if self.scale.abs().max().item() > 0.01:
            w = w.clamp(-1.0, 1.0)
        return w


class LoRALinear(nn.Module):
    def __init__(self, d_in, d_out, rank=4, weight_cls=Int8Weight):
        super().__init__()
        self.weight = weight_cls.quantize(torch.randn(d_out, d_in) / d_in ** 0.5)  # frozen, not a Parameter
        self.a = nn.Parameter(torch.randn(rank, d_in) / d_in ** 0.5)
        self.b = nn.Parameter(torch.randn(d_out, rank) / rank)

    def forward(self, x):
        return F.linear(x, self.weight) + F.linear(F.linear(x, self.a), self.b)


def _model(weight_cls=Int8Weight):
    torch.manual_seed(0)
    return nn.Sequential(LoRALinear(16, 32, weight_cls=weight_cls), nn.GELU(), nn.LayerNorm(32),
                         LoRALinear(32, 8, weight_cls=weight_cls))


def _step(model, x, log):
    for name, p in model.named_parameters():
        p.grad = None
    out = model(x)
    out.register_hook(lambda g: log.append(("out", g.clone())))
    return out.square().mean()


def _run(model, backend, steps=3):
    log = []
    grads = []
    for k in range(steps):
        torch.manual_seed(10 + k)
        x = torch.randn(4, 16, requires_grad=True)
        loss = _step(model, x, log)
        if backend is None:
            loss.backward()
        else:
            with gradfx.compiled_autograd(backend):
                loss.backward()
        grads.append([x.grad] + [p.grad for p in model.parameters()])
    return grads, log


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
@pytest.mark.parametrize("weight_cls, said", [
    (Int8Weight, "gradfx: the 2 nodes a tensor subclass reaches are traced through it"),
    (ClippedInt8Weight, "gradfx: 2 of the 2 nodes a tensor subclass reaches run as themselves (a tensor subclass "
                        "(ClippedInt8Weight) among the saved tensors): MmBackward0"),
])
def test_frozen_subclass_weight_is_captured(backend, weight_cls, said, caplog):
    """Traced through the int8 weight; one whose dispatch branches on its data leaves its
    nodes to run as themselves (the rest captured).  Bitwise, hooks alike, one capture."""
    model = _model(weight_cls)
    expected, expected_log = _run(model, None)
    gradfx.reset()
    with caplog.at_level(logging.INFO, logger="gradfx"):
        got, got_log = _run(model, backend)
    same = torch.equal if backend == "eager" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    for want, have in zip(expected, got):
        assert all(same(a, b) for a, b in zip(want, have))
    assert len(got_log) == len(expected_log) and all(same(a[1], b[1]) for a, b in zip(expected_log, got_log))
    stats = gradfx.stats()
    assert stats["fallbacks"] == 0 and stats["captures"] == 1 and stats["cache_hits"] == 2, stats
    told = [r.getMessage() for r in caplog.records if "a tensor subclass reaches" in r.getMessage()]
    assert len(told) == 1 and told[0].startswith(said), told


def test_captured_graph_traces_through_the_subclass_weight():
    """No node runs as itself: the two that saved the weight read its int8 data and scale
    from the node (read_saved) and dequantize them as its __torch_dispatch__ does."""
    model = _model()
    x = torch.randn(4, 16, requires_grad=True)
    graph = gradfx.capture(model(x).square().mean())
    assert graph.opaque_nodes == []
    nodes = list(graph.graph_module.graph.nodes)
    reads = [n for n in nodes if getattr(n.target, "__name__", "") == "read_saved"]
    assert len(reads) == 2
    data = [item for r in reads for item in r.users if item.meta["val"].dtype is torch.int8]
    assert len(data) == 2  # the int8 data, dequantized in the graph (a view of it cast)
    assert all(any(v.target is aten._to_copy.default for u in item.users for v in [u, *u.users]) for item in data)


_HAND_BACK = {"subclass": False}


class _SubclassGrad(torch.autograd.Function):
    """Hands its gradient back as the subclass when told to (a plain tensor otherwise)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        q = Int8Weight.quantize(g)
        return q if _HAND_BACK["subclass"] else q.dequantize()


def test_a_subclass_gradient_stops_the_graph_and_the_rest_runs_as_eager(caplog):
    """Captured while the custom backward hands back plain tensors; then it hands back the
    subclass, which the traced formula after it (x * 3's) was not traced for: the graph
    stops there and the rest runs node by node, as eager would run it."""
    w = Int8Weight.quantize(torch.randn(8, 6))
    x = torch.randn(3, 6, requires_grad=True)

    def backward(subclass, under_gradfx):
        _HAND_BACK["subclass"] = subclass
        x.grad = None
        loss = F.linear(_SubclassGrad.apply(x * 3), w).square().sum()
        if under_gradfx:
            with gradfx.compiled_autograd():
                loss.backward()
        else:
            loss.backward()
        return x.grad

    gradfx.reset()
    try:
        backward(False, True)  # the capture: a plain gradient
        with caplog.at_level(logging.INFO, logger="gradfx"):
            got = backward(True, True)
        expected = backward(True, False)
    finally:
        _HAND_BACK["subclass"] = False
    assert type(got) is torch.Tensor and torch.equal(got, expected)
    assert any("tensor subclass where the graph traced a plain gradient" in r.getMessage() for r in caplog.records)
    stats = gradfx.stats()
    assert stats["fallbacks"] == 0 and stats["captures"] == 1 and stats["cache_hits"] == 1, stats
