"""torch.compile'd regions: their AOT backward graph traced into gradfx's graph
(capture/trace/aot_regions.py), so that one compiler call sees the region with the hooks
and accumulations around it.

Regions compiled with ``aot_eager`` run their backward graph eagerly in eager autograd
too: gradients and hook arguments are bitwise eager's.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.capture.trace import aot_regions
from helpers import assert_same, grads_of, run_both, snap


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    torch._dynamo.reset()
    yield
    gradfx.reset()


class Block(nn.Module):
    """A compiled region between eager code: views, a matmul, an activation, a norm."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.LayerNorm(6)

    def forward(self, x):
        return self.norm(torch.nn.functional.gelu(self.lin(x)).view(x.shape[0], 2, 3).transpose(1, 2).reshape(x.shape))


def _build(compiled_backend="aot_eager", hooks=True):
    def build(log):
        torch.manual_seed(0)
        pre = nn.Linear(6, 6)
        block = Block()
        region = torch.compile(block, backend=compiled_backend)
        params = [*pre.parameters(), *block.parameters()]
        if hooks:
            block.lin.weight.register_hook(lambda g: log.append(("weight hook", snap(g))))
            block.register_full_backward_pre_hook(lambda m, go: log.append(("module pre-hook", snap(go))))

        def step():
            x = torch.randn(4, 6)
            h = pre(x)
            if hooks:
                h.register_hook(lambda g: log.append(("region input", snap(g))))
            (region(h) * torch.arange(24.0).view(4, 6)).sum().backward()
        return params, step
    return build


def _region_nodes(loss):
    return [label for label in gradfx.capture(loss).opaque_nodes if "CompiledFunction" in label]


@pytest.mark.parametrize("hooks", [False, True])
def test_region_backward_is_traced_bitwise(hooks):
    run_both(_build(hooks=hooks), iterations=3, backend="eager")  # a capture, then cache hits
    stats = gradfx.stats()
    assert stats["cache_hits"] == 2 and stats["fallbacks"] == 0, stats


def test_the_graph_holds_the_region_ops_not_a_call():
    torch.manual_seed(0)
    block = torch.compile(Block(), backend="aot_eager")
    loss = block(torch.randn(4, 6, requires_grad=True)).sum()
    graph = gradfx.capture(loss)
    assert graph.opaque_nodes == []
    code = graph.code
    assert "native_layer_norm_backward" in code and "mm" in code and "call_backward" not in code
    # The replay is undone: the region's own backward is torch's again.
    assert not getattr(type(loss.grad_fn.next_functions[0][0])._forward_cls._backward_impl,
                       "gradfx_replay", False)


def test_without_its_backward_graph_a_region_runs_opaque(monkeypatch):
    monkeypatch.setattr(aot_regions, "backward_graph", lambda cls: None)
    torch.manual_seed(0)
    block = torch.compile(Block(), backend="aot_eager")
    assert _region_nodes(block(torch.randn(4, 6, requires_grad=True)).sum())
    run_both(_build(), iterations=2, backend="eager")


def test_a_region_from_inductors_cache_keeps_its_graph_serialized(monkeypatch):
    """Loaded from the FX graph cache, a region holds ``bw_module_fn`` (which deserializes
    its graph) instead of ``bw_module``: the graph is deserialized once and replayed."""
    import types
    torch.manual_seed(0)
    block = torch.compile(Block(), backend="aot_eager")
    x = torch.randn(4, 6, requires_grad=True)
    loss = block(x).sum()
    node = loss.grad_fn if hasattr(loss.grad_fn, "_forward_cls") else loss.grad_fn.next_functions[0][0]
    cls = node._forward_cls
    module, calls = cls._lazy_backward_info.bw_module, []
    serialized = types.SimpleNamespace(bw_module=None, bw_module_fn=lambda: calls.append(1) or module)
    monkeypatch.setattr(cls, "_lazy_backward_info", serialized)
    assert gradfx.capture(loss).opaque_nodes == [] and gradfx.capture(block(x).sum()).opaque_nodes == []
    assert calls == [1]


@pytest.mark.parametrize("dynamic, captures", [(False, 3), ("auto", 2), (True, 1)])
def test_saved_sizes_of_a_dynamic_region_are_sizes(dynamic, captures):
    """A region compiled for dynamic batch sizes saves the batch as an int (ctx.symints):
    one of the walk's sizes, guarded when static (another batch recaptures, never runs the
    old one's sizes), symbolic under dynamic sizes."""
    torch.manual_seed(0)
    lin = nn.Linear(6, 6)

    @torch.compile(backend="aot_eager", dynamic=True)
    def region(x):
        return torch.nn.functional.gelu(lin(x)).sum(0) / x.shape[0]

    for n in (3, 5, 7, 3):
        x = torch.randn(n, 6)
        lin.zero_grad(set_to_none=True)
        region(x).sum().backward()
        expected = grads_of(lin.parameters())
        lin.zero_grad(set_to_none=True)
        with gradfx.compiled_autograd(backend="eager", dynamic=dynamic) as session:
            region(x).sum().backward()
        assert session.stats["fallbacks"] == 0
        assert_same(expected, grads_of(lin.parameters()))
    stats = gradfx.stats()
    assert stats["captures"] == captures and stats["cache_hits"] == 4 - captures, stats


def test_another_thread_runs_the_real_backward_while_one_traces(monkeypatch):
    """The replay is installed for the tracing thread only: a backward on another thread
    meanwhile runs the region's own compiled backward."""
    replays = []
    run = aot_regions._Replay.run
    monkeypatch.setattr(aot_regions._Replay, "run", lambda self, *a: replays.append(1) or run(self, *a))
    torch.manual_seed(0)
    block = torch.compile(Block(), backend="aot_eager")
    x = torch.randn(4, 6)
    block(x).sum().backward()
    expected = grads_of(block.parameters())
    block.zero_grad(set_to_none=True)
    loss = block(x).sum()
    node = loss.grad_fn if hasattr(loss.grad_fn, "_forward_cls") else loss.grad_fn.next_functions[0][0]
    got = []
    with aot_regions.replayed(node._forward_cls):
        worker = threading.Thread(target=lambda: (loss.backward(), got.append(grads_of(block.parameters()))))
        worker.start()
        worker.join()
    assert replays == [] and got
    assert_same(expected, got[0])
    assert not getattr(node._forward_cls._backward_impl, "gradfx_replay", False)


@pytest.mark.slow
@pytest.mark.sample
def test_inductor_region_inside_inductor_graph():
    """A region compiled by inductor, the backward by gradfx's inductor backend: one graph,
    close to eager (inductor's kernels round their own way)."""
    run_both_close = []
    for use_gradfx in (False, True):
        log = []
        params, step = _build("inductor")(log)
        for it in range(2):
            torch.manual_seed(it)
            if use_gradfx:
                with gradfx.compiled_autograd(backend="inductor") as session:
                    step()
                assert session.stats["fallbacks"] == 0 and session.stats["uncompiled"] == 0, session.stats
            else:
                step()
        run_both_close.append((grads_of(params), [e[0] for e in log]))
    (eager, eager_log), (gfx, gfx_log) = run_both_close
    assert eager_log == gfx_log
    assert_same(eager, gfx, exact=False)


def _masked(x):
    """AOT lifts the masks' and scalars' tensor constants into the backward graph."""
    keep = torch.tril(torch.ones(4, 4, dtype=torch.bool))
    return (torch.where(keep, x, torch.tensor(0.0)) * torch.tensor(3.0)).sum()


def _weighted(x):
    return (x * torch.tensor([1.0, 2.0, 3.0, 4.0])).sum()


@pytest.mark.parametrize("fn, traced", [(_masked, True), (_weighted, False)])
def test_tensor_constants_in_a_region_backward(fn, traced, caplog):
    """A one-valued constant is made by an op in the graph (the region is traced); one of
    several values keeps the region a call of itself, said once at INFO. Bitwise both ways."""
    region = torch.compile(fn, backend="aot_eager")
    results = []
    for use in (False, True, True):
        x = torch.linspace(-2.0, 2.0, 16).reshape(4, 4).requires_grad_()
        loss = region(x)
        if use:
            with caplog.at_level("INFO", logger="gradfx"), gradfx.compiled_autograd(backend="eager") as session:
                loss.backward()
            if session.graphs:
                assert (session.graphs[0].opaque_nodes == []) == traced
        else:
            loss.backward()
        results.append(x.grad)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    said = [r for r in caplog.records if "runs as itself, not traced" in r.getMessage()]
    assert len(said) == (0 if traced else 1)
