"""Saved tensors under the user's saved_tensors_hooks, in eager code: formulas traced.

Non-reentrant checkpointing (plain and selective), ``save_on_cpu`` and the user's own
pack/unpack hooks.  gradfx does each node's unpacks itself: one call per saved variable,
in the order the node's ``apply`` makes them.  So the hooks run as in eager (as often, in
that order, at that point of the backward), and a checkpoint recomputes as eager does,
with eager's RNG state.  The formulas are traced on fakes of the layouts the first
backward found (capture/graph/unpacked.py).  Every test compares with eager: gradients
bit for bit, and a log of the hooks' calls, the recomputations and the RNG state.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import gradfx
from gradfx.capture import native
from helpers import run_both, snap

pytestmark = pytest.mark.skipif(native.module() is None, reason="needs gradfx's compiled part (with_saved)")


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield
    gradfx.reset()


def _save_matmuls(ctx, op, *args, **kwargs):
    """A selective checkpoint policy: keep the matmuls' outputs, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


class Block(nn.Module):
    """Linear, GELU, dropout, Linear, a residual: checkpointed, and counting its forwards."""

    def __init__(self, log, selective=False):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)
        self.log, self.selective = log, selective

    def inner(self, x):
        self.log.append(("forward of the block",))
        return x + self.b(F.dropout(F.gelu(self.a(x)), 0.25, self.training)).tanh()

    def forward(self, x):
        kwargs = {}
        if self.selective:
            kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
        return checkpoint(self.inner, x, use_reentrant=False, **kwargs)


def _checkpointed(selective=False, sizes=None):
    def build(log):
        model = nn.Sequential(Block(log, selective), Block(log, selective), nn.LayerNorm(8))
        model[0].a.weight.register_hook(lambda g: log.append(("a.weight hook", snap(g))))
        model[2].register_full_backward_pre_hook(lambda m, go: log.append(("norm pre-hook", snap(go))))
        steps = iter(sizes or [4] * 10)

        def step():
            x = torch.randn(next(steps), 8, requires_grad=True)
            model(x).square().mean().backward()
            # The RNG state after the backward: a recomputation restores the forward's and
            # then puts the caller's back.
            log.append(("rng", torch.get_rng_state(), snap(x.grad)))
        return list(model.parameters()), step
    return build


def _opaque(session):
    return [label for graph in session.graphs for label in graph.opaque_nodes]


@pytest.mark.parametrize("selective", [False, True], ids=["checkpoint", "selective"])
def test_checkpoint_in_eager_code_recomputes_as_eager(selective):
    # The first backward learns how the hooks unpack, the second traces, then cache hits.
    log = run_both(_checkpointed(selective), iterations=4, expect_captures=2)
    assert sum(1 for e in log if e[0] == "forward of the block") == 4 * 2 * 2  # the forwards and the recomputes


def test_checkpointed_nodes_are_traced_not_opaque():
    log = []
    torch.manual_seed(0)
    model = nn.Sequential(Block(log), Block(log), nn.LayerNorm(8))
    for step in range(3):
        with gradfx.compiled_autograd() as session:
            model(torch.randn(4, 8)).sum().backward()
        if step == 0:  # learning: each checkpointed node runs for real, gradfx unpacking for it
            assert session.graphs and len(_opaque(session)) > 0
        elif step == 1:  # traced on what the first backward found
            (graph,) = session.graphs
            assert graph.opaque_nodes == []
            targets = {n.target for n in graph.graph_module.graph.nodes if n.op == "call_function"}
            assert torch.ops.aten.gelu_backward.default in targets  # the checkpointed formulas
        else:
            assert session.stats["cache_hits"] == 1 and not session.graphs
    # gradfx.capture shows the graph a backward now runs: the formulas traced, no call run real.
    graph = gradfx.capture(model(torch.randn(4, 8)).sum())
    assert graph.opaque_nodes == []
    gradfx.reset()  # nothing learned: the first form, each checkpointed node run for real
    assert len(gradfx.capture(model(torch.randn(4, 8)).sum()).opaque_nodes) > 0


def _logging_hooks(log):
    counter = [0]

    def pack(t):
        counter[0] += 1
        log.append(("pack", counter[0], tuple(t.shape)))
        return counter[0], t

    def unpack(packed):
        log.append(("unpack", packed[0]))
        return packed[1]
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _many_ops(x, w, conv_w, emb_w, ids):
    """Formulas that save inputs, outputs (sigmoid, tanh, exp, softmax), several tensors
    (layer_norm, conv, group_norm, max_pool's indices) and undefined ones."""
    y = torch.addmm(torch.zeros(4, 8), x @ w, w.t().contiguous())
    y = y * x + y / (x.abs() + 1)
    y = y.tanh().pow(2).exp().sigmoid()
    y = F.layer_norm(y, (8,))
    y = F.gelu(y) + F.silu(y) + F.softmax(y, -1) + F.log_softmax(y, -1)
    z = F.conv2d(y.reshape(1, 4, 2, 4), conv_w, padding=1)
    z = F.group_norm(F.max_pool2d(z, 2, ceil_mode=True), 2)
    v = torch.gather(y, 1, ids.reshape(4, 2)).sum() + F.embedding(ids, emb_w).sqrt().sum() + z.sum()
    v = v + y.norm() + y.var() + torch.cumsum(y, 0).sum() + torch.topk(y, 3).values.sum()
    v = v + torch.where(y > 0.5, y, x).abs().rsqrt().sum() + torch.bmm(y.reshape(2, 2, 8), y.reshape(2, 8, 2)).sum()
    return v + torch.clamp(y, 0.1, 0.5).sum() + torch.sort(y, 1).values.sum()


def test_the_users_hooks_unpack_in_eager_order():
    def build(log):
        torch.manual_seed(0)
        w = torch.randn(8, 8, requires_grad=True)
        conv_w = torch.randn(4, 4, 3, 3, requires_grad=True)
        emb_w = torch.rand(10, 3, requires_grad=True)

        def step():
            x = torch.rand(4, 8, requires_grad=True)
            with _logging_hooks(log):
                v = _many_ops(x + 0.5, w, conv_w, emb_w, torch.tensor([1, 2, 3, 4, 5, 6, 7, 0]))
            v.backward()
            log.append(("x.grad", snap(x.grad)))
        return [w, conv_w, emb_w], step
    log = run_both(build, iterations=3, expect_captures=2)
    assert sum(1 for e in log if e[0] == "unpack") >= 3 * 40


def test_save_on_cpu_and_logging_hooks_together():
    def build(log):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 6), nn.Sigmoid(), nn.Linear(6, 1))

        def step():
            x = torch.randn(5, 6)
            with torch.autograd.graph.save_on_cpu():
                h = model[:2](x)
            with _logging_hooks(log):
                out = model[2:](h)
            out.sum().backward()
        return list(model.parameters()), step
    run_both(build, iterations=3, expect_captures=2)


class _Transposing:
    """Hooks that hand back a saved matrix laid out transposed (the same values) on chosen
    steps: a layout the trace did not see."""

    def __init__(self, log, steps):
        self.log, self.steps, self.step = log, steps, 0

    def hooks(self):
        def unpack(t):
            self.log.append(("unpack", tuple(t.shape)))
            if self.step in self.steps and t.dim() == 2:
                return t.t().contiguous().t()
            return t
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack)


def test_a_layout_the_trace_did_not_see_stops_the_graph(caplog):
    def build(log):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
        model[0].weight.register_hook(lambda g: log.append(("weight hook", snap(g))))
        hooks = _Transposing(log, steps={2})

        def step():
            with hooks.hooks():
                out = model(torch.randn(5, 6))
            out.square().sum().backward()
            hooks.step += 1
        return list(model.parameters()), step
    with caplog.at_level(logging.INFO, logger="gradfx"):
        # 0 learns, 1 traces, 2 stops (the rest node by node, learning the new layouts),
        # 3 traces those, 4 finds the transposing hooks gone: stops, and its layouts' graph exists.
        run_both(build, iterations=5, expect_captures=3)
    assert "unpacked tensors laid out otherwise" in caplog.text


def test_gpt2_with_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32)

    def build(log):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.train()  # dropout on, recomputed with the forward's RNG state

        def step():
            ids = torch.randint(0, 64, (2, 12))
            model(input_ids=ids, labels=ids).loss.backward()
            log.append(("rng", torch.get_rng_state()))
        return list(model.parameters()), step
    run_both(build, iterations=3, expect_captures=2)
    gradfx.reset()
    step = build([])[1]
    for _ in range(2):  # learns, then traces
        with gradfx.compiled_autograd() as session:
            step()
    (graph,) = session.graphs
    assert graph.opaque_nodes == []
    assert graph.autograd_nodes > 100


def test_create_graph_through_a_checkpoint():
    def build(log):
        torch.manual_seed(0)
        lin = nn.Linear(4, 4)

        def step():
            x = torch.randn(3, 4, requires_grad=True)
            y = checkpoint(lambda t: torch.tanh(lin(t)), x, use_reentrant=False)
            (g,) = torch.autograd.grad(y.sum(), x, create_graph=True)
            g.square().sum().backward()
            log.append(("x.grad", snap(x.grad)))
        return list(lin.parameters()), step
    # The first-order graph (create_graph: its checkpointed nodes run as themselves), and the
    # second-order one, whose nodes from the recomputation are under checkpoint's hooks too:
    # learned, then traced.
    run_both(build, iterations=3, expect_captures=3)


def test_retain_graph_recomputes_per_backward_and_a_second_backward_without_it_raises():
    results = {}
    for use_gradfx in (False, True):
        torch.manual_seed(0)
        calls = []
        lin = nn.Linear(4, 4)
        x = torch.randn(3, 4)
        out = checkpoint(lambda t: calls.append(1) or torch.tanh(lin(t)), x, use_reentrant=False).sum()
        with gradfx.compiled_autograd(strict=True) if use_gradfx else torch.enable_grad():
            out.backward(retain_graph=True)
            out.backward(retain_graph=True)
            out.backward()
            with pytest.raises(RuntimeError) as err:
                out.backward()
        results[use_gradfx] = (len(calls), lin.weight.grad.clone(), str(err.value).splitlines()[0])
    assert results[True][0] == results[False][0] == 4  # the forward and one recompute per backward
    assert torch.equal(results[True][1], results[False][1])
    assert results[True][2] == results[False][2]


def test_sizes_that_change_keep_eager_results():
    # A new batch size: the static graph's layouts do not apply; the symbolic capture runs the
    # checkpointed nodes as themselves (a symbolic graph would learn one layout per size).
    run_both(_checkpointed(sizes=[4, 4, 6, 4, 7, 9]), iterations=6, expect_captures=3)


def test_without_the_compiled_part_the_nodes_run_as_themselves(monkeypatch):
    monkeypatch.setattr(native, "module", lambda: None)
    run_both(_checkpointed(), iterations=3, expect_captures=1)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("inductor", marks=pytest.mark.sample), "aot_eager", "user"])
def test_compilers_compile_the_checkpointed_formulas(backend):
    compiler = (lambda gm, example: torch.compile(gm, backend="aot_eager")) if backend == "user" else backend
    torch._dynamo.reset()
    calls = {True: [], False: []}
    torch.manual_seed(0)
    models = {key: nn.Sequential(Block(calls[key]), Block(calls[key]), nn.LayerNorm(8)) for key in calls}
    models[True].load_state_dict(models[False].state_dict())
    for step in range(3):
        x = torch.randn(4, 8)
        for use_gradfx, model in models.items():
            model.zero_grad(set_to_none=True)
            torch.manual_seed(step)
            if use_gradfx:
                with gradfx.compiled_autograd(backend=compiler) as session:
                    model(x).square().mean().backward()
                assert session.stats["uncompiled"] == 0 and session.stats["fallbacks"] == 0, session.stats
                if step == 1:
                    assert _opaque(session) == []
            else:
                model(x).square().mean().backward()
        assert len(calls[True]) == len(calls[False])
        for p, q in zip(models[False].parameters(), models[True].parameters()):
            torch.testing.assert_close(q.grad, p.grad)
    torch._dynamo.reset()
