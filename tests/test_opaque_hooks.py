"""Node hooks of nodes that run opaque (rules.RUN_REAL), with an input that needs no gradient.

Eager hands a post-hook whatever the node computed for an edge without a next node: None
for most formulas (they compute only outputs whose edge has one), the gradient for a list
argument's (cat, block_diag) and whatever a custom backward returns; then it drops it.
"""

import warnings

import pytest
import torch

import gradfx
from gradfx.capture import native
from helpers import assert_same, grads_of, run_both, snap

MASK = torch.tensor([True, False, True, False])


class Scaled(torch.autograd.Function):
    """Returns a gradient for its second tensor, which needs none."""

    @staticmethod
    def forward(ctx, a, c):
        return a * c

    @staticmethod
    def backward(ctx, g):
        return g * 2, g * 3


class Mixed(torch.autograd.Function):
    """Non-tensor inputs among those that need no gradient: Python places the gradient
    of the tensor among them by counting."""

    @staticmethod
    def forward(ctx, k, a, s, c):
        return a * c * s * k

    @staticmethod
    def backward(ctx, g):
        return None, g * 2, None, g * 3


def _copy_slices_into_no_grad(a, c):
    base = c.clone()
    base[1:3] = a[:2]
    return base


def _copy_slices_from_no_grad(a, c):
    base = a * 2
    base[1:3] = c[:2]
    return base


PROGRAMS = {  # (a needs grad, c needs none) -> output; the opaque node is the output's or below
    "prod_dim": lambda a, c: torch.prod(torch.stack([a, c]), 0),
    "prod_full": lambda a, c: a.prod() * c,
    "cumprod": lambda a, c: torch.cumprod(torch.stack([a, c]), 1),
    "max_full": lambda a, c: torch.stack([a, c]).max() * c,
    "min_full": lambda a, c: torch.stack([a, c]).min() * c,
    "masked_fill_value": lambda a, c: c.masked_fill(MASK, a.sum()),
    "masked_fill_self": lambda a, c: a.masked_fill(MASK, c.sum()),
    "copy_slices_base": _copy_slices_into_no_grad,
    "copy_slices_src": _copy_slices_from_no_grad,
    "index_put_values": lambda a, c: c.index_put((MASK,), a[:2]),
    "index_put_self": lambda a, c: a.index_put((MASK,), c[:2]),
    # These compute the gradient of the input that needs none: the hook sees it.
    "cat_empty": lambda a, c: torch.cat([a, torch.zeros(0), c]),
    "block_diag": lambda a, c: torch.block_diag(a.view(2, 2), c.view(2, 2)),
    "function": lambda a, c: Scaled.apply(a, c),
    "function_mixed": lambda a, c: Mixed.apply(2, a, 0.5, c),
}


def _nodes(root):
    """Every node below ``root`` but accumulators, in a fixed order."""
    seen, order, stack = set(), [], [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            order.append(node)
        stack.extend(n for n, _ in reversed(node.next_functions))
    return order


def _hook_everything(y, log):
    """A pre-hook and two post-hooks on every node: the first doubles what it is handed,
    the second logs what the first returned."""
    for node in _nodes(y.grad_fn):
        name = node.name()
        node.register_prehook(lambda go, name=name: log.append(("pre " + name, snap(go))))
        node.register_hook(lambda gi, go, name=name: log.append(("post " + name, snap(gi), snap(go))) or
                           tuple(None if g is None else g * 2 for g in gi))
        node.register_hook(lambda gi, go, name=name: log.append(("post2 " + name, snap(gi))))


def _build(program):
    def build(log):
        a = torch.randn(4, requires_grad=True)

        def step():
            c = torch.randn(4)
            y = program(a, c)
            _hook_everything(y, log)
            (y * torch.randn(y.shape)).sum().backward()
        return [a], step
    return build


# Opaque only without gradfx's compiled part, which reads their hidden state (graph.hidden).
HIDDEN_KEYED = {"copy_slices_base", "copy_slices_src", "block_diag"}


def _without_compiled_part(monkeypatch):
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "reason", "switched off by the test")


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


@pytest.mark.parametrize("part", ["as loaded", "off"])
@pytest.mark.parametrize("name", PROGRAMS)
def test_post_hooks_see_what_eager_hands(name, part, monkeypatch):
    if part == "off":
        if name not in HIDDEN_KEYED:
            pytest.skip("the compiled part changes nothing here")
        _without_compiled_part(monkeypatch)
    log = run_both(_build(PROGRAMS[name]), backend="eager")  # 3 steps: one capture, two cache hits
    assert log, "no hook ran"
    if name in ("cat_empty", "block_diag", "function", "function_mixed"):
        post = [entry for entry in log if entry[0].startswith("post ")]
        assert any(entry[1][-1] is not None for entry in post), "the computed gradient was not seen"


@pytest.mark.parametrize("part", ["as loaded", "off"])
def test_opaque_nodes_as_expected(part, monkeypatch):
    """The programs exercise opaque nodes (a traced one would not test the fix); with the
    compiled part loaded, those whose hidden state it reads are traced."""
    if part == "off":
        _without_compiled_part(monkeypatch)
    expected = {"prod_dim": "ProdBackward1", "prod_full": "ProdBackward0", "cumprod": "CumprodBackward0",
                "max_full": "MaxBackward1", "min_full": "MinBackward1", "masked_fill_value": "MaskedFillBackward1",
                "masked_fill_self": "MaskedFillBackward1", "copy_slices_base": "torch::autograd::CopySlices",
                "copy_slices_src": "torch::autograd::CopySlices", "index_put_values": "IndexPutBackward0",
                "index_put_self": "IndexPutBackward0", "cat_empty": "CatBackward0",
                "block_diag": "BlockDiagBackward0", "function": "ScaledBackward",
                "function_mixed": "MixedBackward"}
    for name, program in PROGRAMS.items():
        a = torch.randn(4, requires_grad=True)
        y = program(a, torch.randn(4))
        _hook_everything(y, [])
        graph = gradfx.capture((y * torch.randn(y.shape)).sum())
        traced = name in HIDDEN_KEYED and native.module() is not None
        assert [label.split()[0] for label in graph.opaque_nodes] == ([] if traced else [expected[name]]), (
            name, graph.opaque_nodes)


def test_traced_rule_leaves_none_as_the_formula():
    """With symbolic sizes addmm's rule computes the bias's gradient too; the node's formula
    does not when the bias needs none, so its post-hook sees None."""
    def build(log):
        w = torch.randn(3, 4, requires_grad=True)

        def step():
            y = torch.nn.functional.linear(torch.randn(2, 4, requires_grad=True), w, torch.randn(3))
            y.grad_fn.register_hook(lambda gi, go: log.append(("post", snap(gi))))
            y.sum().backward()
        return [w], step
    log = run_both(build, backend="eager", dynamic=True)
    assert log[0][1][0] is None


def _step_pair(program, backend):
    """(eager log, gradfx log, eager grads, gradfx grads) over three steps of ``program``."""
    logs, grads = [], []
    for use_gradfx in (False, True):
        torch.manual_seed(0)
        log = []
        params, step = _build(program)(log)
        for it in range(3):
            torch.manual_seed(it)
            if use_gradfx:
                with gradfx.compiled_autograd(backend=backend) as session:
                    step()
                assert session.stats["fallbacks"] == 0, session.stats
            else:
                step()
        logs.append(log)
        grads.append(grads_of(params))
    return logs, grads


def _close(x, y):
    """Equal up to rounding, None where the other is None."""
    if isinstance(x, (tuple, list)):
        assert isinstance(y, (tuple, list)) and len(x) == len(y)
        for a, b in zip(x, y):
            _close(a, b)
    elif isinstance(x, torch.Tensor):
        torch.testing.assert_close(x, y)
    else:
        assert x == y


def _close_logs(expected, got):
    assert [e[0] for e in expected] == [e[0] for e in got]
    for e, g in zip(expected, got):
        _close(e[1:], g[1:])


def _heavy_cat(a, c):
    """A cat run opaque, between runs of aten ops long enough to compile."""
    h = (a.sin() * a.cos() + a.exp()).tanh()
    return torch.cat([h, torch.zeros(0), c]).sigmoid().exp() * 2


def test_aot_eager():
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradfx.FallbackWarning)  # its regions compile
        (expected, got), (eager_grads, gfx_grads) = _step_pair(_heavy_cat, "aot_eager")
    _close_logs(expected, got)
    assert any(e[0] == "post CatBackward0" and e[1][-1] is not None for e in got)
    assert_same(eager_grads, gfx_grads, exact=False)
    assert gradfx.stats()["captures"] == 1


@pytest.mark.parametrize("name", ["masked_fill_value", "copy_slices_base", "index_put_values", "cat_empty"])
def test_traceable_form(name, monkeypatch):
    """A backend of its own gets the graph compilers trace whole, where an opaque node is a
    custom op returning tensors of traced shapes: a post-hook is handed None for an edge
    without a next node where the node computes None; where it computes a gradient (of a
    shape known only once it ran) the backend is not given the graph (it runs on the eager
    backend, with a warning)."""
    _without_compiled_part(monkeypatch)  # copy_slices_base opaque
    computes = name == "cat_empty"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (expected, got), (eager_grads, gfx_grads) = _step_pair(PROGRAMS[name], lambda gm, example_inputs: gm)
    _close_logs(expected, got)
    assert_same(eager_grads, gfx_grads)
    failed = [w for w in caught if issubclass(w.category, gradfx.FallbackWarning)]
    assert bool(failed) == computes, [str(w.message) for w in failed]
