"""Checkpoint recompute inside a torch.compile'd forward: traced into gradfx's graph.

A non-reentrant ``torch.utils.checkpoint`` (plain or selective, with
``create_selective_checkpoint_contexts``) inside a compiled forward has its recompute in
the region's AOT backward graph, under dynamo's guards on the Python it traced; gradfx
traces that graph (capture/trace/aot_regions.py), so the recompute's ops, its RNG replay
included, are ops of gradfx's graph beside the hooks and accumulations, and one compiler
call sees them all.  Gradients and hook arguments are eager's bit for bit with the eager
backend (the region compiled with ``aot_eager``), and dropout's mask is eager's.

A checkpoint in eager code keeps its recompute in Python (docs/SEMANTICS.md says why).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import gradfx
from helpers import run_both, snap


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    torch._dynamo.reset()
    yield
    gradfx.reset()
    torch._dynamo.reset()


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective checkpoint policy: keep the matmuls' outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Checkpointed(nn.Module):
    """Linear, GELU, dropout, Linear under one checkpoint, then a norm outside it."""

    def __init__(self, selective: bool):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.norm = nn.LayerNorm(8)
        self.selective = selective

    def block(self, x):  # no side effect: dynamo would run the checkpoint eagerly
        return self.b(F.dropout(F.gelu(self.a(x)), 0.25, self.training)).tanh()

    def forward(self, x):
        context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls) if self.selective \
            else None
        kwargs = {"context_fn": context} if context is not None else {}
        return self.norm(checkpoint(self.block, x, use_reentrant=False, **kwargs))


def _build(selective: bool):
    def build(log):
        torch.manual_seed(0)
        model = Checkpointed(selective)
        region = torch.compile(model, backend="aot_eager")
        model.a.weight.register_hook(lambda g: log.append(("a.weight hook", snap(g))))
        model.norm.register_full_backward_pre_hook(lambda m, go: log.append(("norm pre-hook", snap(go))))

        def step():
            x = torch.randn(4, 8)
            region(x).square().mean().backward()
        return list(model.parameters()), step
    return build


def _captured(selective: bool):
    torch.manual_seed(0)
    model = Checkpointed(selective)
    loss = torch.compile(model, backend="aot_eager")(torch.randn(4, 8)).square().mean()
    return gradfx.capture(loss)


@pytest.mark.parametrize("selective", [False, True], ids=["checkpoint", "selective"])
def test_recompute_in_a_compiled_region_is_bitwise_eager(selective):
    run_both(_build(selective), iterations=3, backend="eager")  # a capture, then cache hits
    stats = gradfx.stats()
    assert stats["cache_hits"] == 2 and stats["uncompiled"] == 0, stats


@pytest.mark.parametrize("selective", [False, True], ids=["checkpoint", "selective"])
def test_the_recompute_is_ops_of_the_graph(selective):
    graph = _captured(selective)
    assert graph.opaque_nodes == []
    targets = {n.target for n in graph.graph_module.graph.nodes if n.op == "call_function"}
    names = {getattr(t, "__name__", str(t)) for t in targets}
    # The forward's GELU and dropout, replayed with the forward's RNG state.
    assert torch.ops.aten.gelu.default in targets
    assert any("run_with_rng_state" in str(t) for t in targets), names
    # The selective policy saved the matmuls: the recompute has none of the forward's addmm.
    assert (torch.ops.aten.addmm.default in targets) is (not selective)


def test_another_dropout_draws_a_mask_eager_draws():
    """The recomputed dropout replays the forward's RNG state, step after step."""
    run_both(_build(False), iterations=4, backend="eager")


@pytest.mark.slow
@pytest.mark.parametrize("selective", [False, pytest.param(True, marks=pytest.mark.sample)],
                         ids=["checkpoint", "selective"])
def test_inductor_compiles_the_recompute_with_the_rest(selective):
    torch.manual_seed(0)
    eager, model = Checkpointed(selective), Checkpointed(selective)
    model.load_state_dict(eager.state_dict())
    regions = [torch.compile(m, backend="aot_eager") for m in (eager, model)]
    for step in range(2):
        x = torch.randn(4, 8)
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        regions[0](x).square().mean().backward()
        torch.manual_seed(step)
        with gradfx.compiled_autograd(backend="inductor") as session:
            regions[1](x).square().mean().backward()
        assert session.stats["uncompiled"] == 0 and session.stats["fallbacks"] == 0, session.stats
        for p, q in zip(eager.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad)
