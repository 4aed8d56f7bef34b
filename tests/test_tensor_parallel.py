"""Tensor parallelism (DTensor) under gradfx, 2 gloo processes (4 for TP inside FSDP2):
captured, not sent to the eager engine, with eager's gradients bitwise and its hook
calls.

The nodes a DTensor reaches (a node taking a DTensor's gradient or holding a saved
DTensor, DTensor's own Functions) are traced through it: the graph computes on the local
shards, DTensor's redistributions become functional collectives in it, and a DTensor
leaf's real accumulator takes the gradient rebuilt as the DTensor eager hands it.  Under
symbolic sizes they run as themselves.  One spawn runs every case; each test reads its
own.
"""

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from helpers import gloo_group, record_case, spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

STEPS = 3


class Block(nn.Module):
    """Attention with separate q, k, v and output projections, then an MLP: the layout
    torch.distributed.tensor.parallel's examples parallelize."""

    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, t, -1, 8).transpose(1, 2) for proj in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _mlp(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    return parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}), (6, 8)


def _block(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
            "up": ColwiseParallel(), "down": RowwiseParallel()}
    return parallelize_module(Block(), mesh, plan), (2, 5, 16)


class _Hooked(nn.Module):
    """A DTensor activation between the parallel linears (the first keeps its output a
    DTensor) with a tensor hook, and hooks on the DTensor parameters' gradients."""

    def __init__(self, mesh, hooks=True):
        super().__init__()
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)
        parallelize_module(self, mesh, {"up": ColwiseParallel(use_local_output=False),
                                        "down": RowwiseParallel(input_layouts=Shard(-1))})
        self.hooks, self.kept = hooks, None
        for p in self.parameters() if hooks else ():
            p.register_hook(lambda g: g * 0.5)

    def forward(self, x):
        h = self.up(x)
        if self.hooks:
            h.register_hook(lambda g: g * 2.0)
        else:  # its gradient kept instead (retain_grad on a DTensor)
            h.retain_grad()
            self.kept = h
        return self.down(F.relu(h))


def _mlp_hooked(mesh):
    return _Hooked(mesh), (6, 8)


def _mlp_new_batch_sizes(mesh):
    model, _ = _mlp(mesh)
    return model, lambda it: (3 + 2 * it, 8)  # dynamic="auto": the second size recaptures, symbolic


class _Attention(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (proj(h).view(b, t, -1, 8).transpose(1, 2) for proj in (self.q, self.k, self.v))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class _MLP(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h):
        return self.down(F.gelu(self.up(h)))


class SPBlock(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm1, self.norm2, self.attention, self.mlp = nn.LayerNorm(d), nn.LayerNorm(d), _Attention(d), _MLP(d)

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _sequence_parallel(mesh):
    """Sequence parallelism on the norms (activations sharded on the sequence between the
    parallel regions), the recipe torch.distributed.tensor.parallel documents."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    plan = {"": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
            "norm1": SequenceParallel(), "norm2": SequenceParallel(),
            "attention": gather, "mlp": gather,
            "attention.q": ColwiseParallel(), "attention.k": ColwiseParallel(), "attention.v": ColwiseParallel(),
            "attention.o": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}
    model = parallelize_module(SPBlock(), mesh, plan)
    parallelize_module(model, mesh, PrepareModuleOutput(output_layouts=(Shard(1),),
                                                         desired_output_layouts=(Replicate(),),
                                                         use_local_output=True))
    return model, (2, 6, 16)


class _MathAttention(nn.Module):
    """A layer run under math SDPA: flash attention's CPU backward has no DTensor sharding
    strategy (eager tensor parallelism fails on it)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        with sdpa_kernel(SDPBackend.MATH):
            return self.layer(x)


def _encoder_layer(mesh):
    """nn.TransformerEncoderLayer: the MLP colwise then rowwise, the attention's output
    projection sharded on its input dimension, its packed in-projection replicated (DTensor
    refuses to unflatten q, k and v from an uneven shard of it), so are the norms."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, parallelize_module)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    parallelize_module(layer, mesh, {"linear1": ColwiseParallel(), "linear2": RowwiseParallel(use_local_output=False)})
    attention = layer.self_attn
    placed = [(attention, "in_proj_weight", Replicate()), (attention, "in_proj_bias", Replicate()),
              (attention.out_proj, "weight", Shard(1)), (attention.out_proj, "bias", Replicate())]
    placed += [(norm, name, Replicate()) for norm in (layer.norm1, layer.norm2) for name in ("weight", "bias")]
    for module, name, placement in placed:
        setattr(module, name, nn.Parameter(distribute_tensor(getattr(module, name).detach(), mesh, [placement])))
    model = _MathAttention(layer)
    parallelize_module(model, mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                        desired_input_layouts=(Replicate(),), use_local_output=False))
    parallelize_module(model, mesh, PrepareModuleOutput(output_layouts=(Replicate(),),
                                                         desired_output_layouts=(Replicate(),), use_local_output=True))
    return model, (2, 5, 16)


MODELS = {"mlp": _mlp, "sequence_parallel_norms": _sequence_parallel, "attention_and_mlp": _block,
          "mlp_new_batch_sizes": _mlp_new_batch_sizes, "mlp_hooked": _mlp_hooked}
if torch.__version__ >= "2.12":  # on 2.11 eager TP fails on the layer (a view flattening a sharded dim)
    MODELS["transformer_encoder_layer"] = _encoder_layer


def _user_backend(gm, example_inputs):
    """A user's compiler: it is given plain tensors and sizes (no DTensor, no live autograd
    object) and runs the graph as given."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and type(x) is not torch.Tensor:
            raise AssertionError(f"a user backend was given a {type(x).__name__}")
        if isinstance(x, torch.autograd.graph.Node):
            raise AssertionError("a user backend was given an autograd node")
    return gm


BACKENDS = {"eager": "eager", "aot_eager": "aot_eager", "user": _user_backend}


def _run(build, mesh, rank, under_gradfx, backend, graphs=None):
    import gradfx
    torch.manual_seed(0)
    model, shape = build(mesh)
    calls = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: calls.append(name))
    out = []
    for it in range(STEPS):
        torch.manual_seed(100 + it)  # the same batch on every rank: tensor parallelism
        x = torch.randn(*(shape(it) if callable(shape) else shape))
        model.zero_grad()
        y = model(x)
        y.register_hook(lambda g: calls.append(("out", g.sum().item())))
        loss = y.square().mean()
        if under_gradfx:
            with warnings.catch_warnings():
                # no fallback to the engine (a compiler with nothing to compile says so: allowed)
                warnings.filterwarnings("error", message=".*on the eager engine", category=gradfx.FallbackWarning)
                with gradfx.compiled_autograd(BACKENDS.get(backend, backend)) as session:
                    loss.backward()
            graphs += session.graphs
        else:
            loss.backward()
        # Each gradient's local shard and its placements (a Partial gradient copied where eager
        # takes it reduces on torch 2.12: Replicate, another shard).
        out.append([((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).clone(),
                     getattr(p.grad, "placements", None)) for p in model.parameters()])
    return out, calls


def _compare(build, mesh, rank, backend) -> dict:
    """One case on this rank: eager TP, then TP under gradfx; what the test checks."""
    import gradfx
    eager, eager_calls = _run(build, mesh, rank, False, backend)
    gradfx.reset()
    graphs = []
    got, got_calls = _run(build, mesh, rank, True, backend, graphs)
    first = graphs[0]
    ops = {str(n.target) for n in first.graph_module.graph.nodes if n.op == "call_function"}
    bitwise = backend in ("eager", "user")
    same = torch.equal if bitwise else (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))
    return {"equal": all(same(a, b) and pa == pb for ws, gs in zip(eager, got) for (a, pa), (b, pb) in zip(ws, gs)),
            "calls": eager_calls == got_calls if bitwise else
            [c if isinstance(c, str) else c[0] for c in eager_calls] ==
            [c if isinstance(c, str) else c[0] for c in got_calls],
            "stats": gradfx.stats(),
            # the first capture's (static): what runs as itself, the collectives traced
            "opaque": sorted({label.split()[0] for label in first.opaque_nodes}),
            "collectives": sorted(op for op in ops if "_c10d_functional" in op)}


def _twice(mesh):
    """backward(retain_graph=True) twice over one TP graph (the second walk finds the saved
    DTensors the first capture traced through), then once more; gradients as eager's."""
    import gradfx
    grads = []
    for under_gradfx in (False, True):
        torch.manual_seed(0)
        model, shape = _mlp(mesh)
        loss = model(torch.randn(*shape)).square().mean()
        for retain in (True, True, False):
            if under_gradfx:
                with gradfx.compiled_autograd():
                    loss.backward(retain_graph=retain)
            else:
                loss.backward(retain_graph=retain)
        grads.append([p.grad.to_local() for p in model.parameters()])
    return {"equal": all(torch.equal(a, b) for a, b in zip(*grads))}


def _loss_parallel(mesh, backend="eager"):
    """Vocabulary-parallel cross-entropy (``loss_parallel()``, as torchtitan trains): the
    logits stay sharded on the vocabulary, the loss is a DTensor, so is the root gradient;
    the backward is traced through it (the context's own DTensor handlers), each step
    after the first a cache hit."""
    import gradfx
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module
    runs = []
    for under_gradfx in (False, True):
        gradfx.reset()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 10))
        parallelize_module(model, mesh, {"2": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
        grads, graphs = [], []
        for it in range(STEPS):
            torch.manual_seed(100 + it)
            x, labels = torch.randn(6, 8), torch.randint(0, 10, (6,))
            model.zero_grad()
            with loss_parallel():
                loss = F.cross_entropy(model(x), labels)
                if under_gradfx:
                    with gradfx.compiled_autograd(BACKENDS[backend]) as session:
                        loss.backward()
                    graphs += session.graphs
                else:
                    loss.backward()
            grads.append([(p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad,
                           getattr(p.grad, "placements", None)) for p in model.parameters()])
        runs.append((grads, graphs, gradfx.stats()))
    (eager, _, _), (got, graphs, stats) = runs
    graph = graphs[0]  # what a notebook shows of it, and a saved script of it, work too
    views = bool(graph.to_svg()) and bool(graph.table()) and "read_saved" in graph.print_readable(print_output=False)
    with tempfile.TemporaryDirectory() as tmp:
        graph.save(os.path.join(tmp, "backward.py"))
        compile(open(os.path.join(tmp, "backward.py")).read(), "backward.py", "exec")
    return {"equal": all(torch.equal(a, b) and pa == pb for ws, gs in zip(eager, got) for (a, pa), (b, pb) in zip(ws, gs)),
            "stats": stats, "opaque": sorted({label.split()[0] for label in graph.opaque_nodes}), "views": views}


def _retained(mesh):
    """retain_grad() on a DTensor activation: its .grad is the DTensor eager keeps."""
    import gradfx
    got = []
    for under_gradfx in (False, True):
        gradfx.reset()
        torch.manual_seed(0)
        model = _Hooked(mesh, hooks=False)
        out = []
        for it in range(STEPS):
            torch.manual_seed(100 + it)
            loss = model(torch.randn(6, 8)).square().mean()
            if under_gradfx:
                with gradfx.compiled_autograd():
                    loss.backward()
            else:
                loss.backward()
            kept = model.kept.grad
            out.append((kept.to_local(), kept.placements, [p.grad.to_local() for p in model.parameters()]))
            model.zero_grad()
        got.append((out, gradfx.stats()))
    (eager, _), (mine, stats) = got
    return {"equal": all(torch.equal(a, b) and pa == pb and all(torch.equal(u, v) for u, v in zip(ga, gb))
                         for (a, pa, ga), (b, pb, gb) in zip(eager, mine)), "stats": stats}


def _grad_of_parameters(mesh):
    """torch.autograd.grad with respect to DTensor parameters (and the input): the gradients
    come back as the DTensors eager returns, placements included; nothing accumulates."""
    import gradfx
    got = []
    for under_gradfx in (False, True):
        gradfx.reset()
        torch.manual_seed(0)
        model, shape = _block(mesh)
        params = list(model.parameters())
        out = []
        for it in range(STEPS):
            torch.manual_seed(100 + it)
            x = torch.randn(*shape, requires_grad=True)
            loss = model(x).square().mean()
            if under_gradfx:
                with gradfx.compiled_autograd():
                    grads = torch.autograd.grad(loss, [x] + params)
            else:
                grads = torch.autograd.grad(loss, [x] + params)
            out.append([(g.to_local() if hasattr(g, "to_local") else g, getattr(g, "placements", None), type(g))
                        for g in grads])
        got.append((out, gradfx.stats(), all(p.grad is None for p in params)))
    (eager, _, _), (mine, stats, untouched) = got
    return {"equal": all(torch.equal(a, b) and pa == pb and ta is tb
                         for ws, gs in zip(eager, mine) for (a, pa, ta), (b, pb, tb) in zip(ws, gs)),
            "stats": stats, "untouched": untouched}


def _worker(rank, world, port, results):
    from gradfx.capture import native
    assert native.wait() is not None, native.reason()  # a DTensor's gradients are told by it
    from torch.distributed.device_mesh import init_device_mesh
    with gloo_group(rank, world, port):
        mesh = init_device_mesh("cpu", (world,))
        for name, build in MODELS.items():
            for backend in BACKENDS:
                record_case(results, (name, backend, rank), lambda: _compare(build, mesh, rank, backend))
        record_case(results, ("twice", rank), lambda: _twice(mesh))
        record_case(results, ("loss_parallel", rank), lambda: _loss_parallel(mesh))
        record_case(results, ("loss_parallel_user", rank), lambda: _loss_parallel(mesh, "user"))
        record_case(results, ("grad", rank), lambda: _grad_of_parameters(mesh))
        record_case(results, ("retained", rank), lambda: _retained(mesh))


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, 2)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("name", list(MODELS))
def test_tensor_parallel_backward_is_captured_as_eager(results, name, backend):
    for rank in (0, 1):
        got = results[(name, backend, rank)]
        assert "error" not in got, got.get("error")
        assert got["equal"], f"rank {rank}: gradients differ from eager tensor parallelism"
        assert got["calls"], f"rank {rank}: hooks ran otherwise than in eager"
        stats = got["stats"]
        captures = 2 if name == "mlp_new_batch_sizes" else 1  # one more for the new size, then symbolic
        assert stats["fallbacks"] == 0 and stats["captures"] == captures, stats
        assert stats["cache_hits"] == STEPS - captures, stats
        # traced through DTensor: only the DTensor leaves' own accumulators are called, and
        # the nodes after a hook that returned a DTensor (its placements known at run time:
        # the hooked activation's node on, not the ReLU before it)
        after_hook = ["AddmmBackward0", "RedistributeBackward", "TBackward0"] if name == "mlp_hooked" else []
        assert got["opaque"] == sorted(["torch::autograd::AccumulateGrad"] + after_hook), got["opaque"]
        if name in ("attention_and_mlp", "sequence_parallel_norms", "transformer_encoder_layer"):
            # the input gradients of the colwise projections are partial sums: all-reduced
            # (sequence parallelism: reduce-scattered), as ops of the graph
            assert got["collectives"], got


def _worker_inductor(rank, world, port, results):
    from gradfx.capture import native
    assert native.wait() is not None, native.reason()
    from torch.distributed.device_mesh import init_device_mesh
    with gloo_group(rank, world, port):
        mesh = init_device_mesh("cpu", (world,))
        for name in ("attention_and_mlp", "sequence_parallel_norms"):
            record_case(results, (name, rank), lambda: _compare(MODELS[name], mesh, rank, "inductor"))


@pytest.mark.slow
def test_tensor_parallel_compiles_with_inductor():
    """Traced through DTensor, the graph is aten ops and functional collectives on the local
    shards, which inductor compiles whole: nothing runs uncompiled."""
    results = spawn_ranks(_worker_inductor, 2)
    for (name, rank), got in results.items():
        assert "error" not in got, got.get("error")
        assert got["equal"] and got["calls"], (name, rank)
        stats = got["stats"]
        assert stats["fallbacks"] == 0 and stats["captures"] == 1 and stats["uncompiled"] == 0, (name, stats)
        assert got["opaque"] == ["torch::autograd::AccumulateGrad"] and got["collectives"], got


def _each_rank(results, case):
    """A case's result on each rank, checked: no error, gradients as eager's, and (where it
    counts) one capture, then cache hits, no fallback."""
    for rank in (0, 1):
        got = results[(case, rank)]
        assert "error" not in got, got.get("error")
        assert got["equal"], f"rank {rank}: gradients differ from eager tensor parallelism"
        stats = got.get("stats")
        if stats is not None:
            assert stats["fallbacks"] == 0 and stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1, stats
        yield got


@pytest.mark.parametrize("case", ["loss_parallel", "loss_parallel_user"])  # a user's backend: the root flattened
def test_loss_parallel_root_gradient_is_traced_through(results, case):
    for got in _each_rank(results, case):
        assert got["opaque"] == ["torch::autograd::AccumulateGrad"], got["opaque"]
        assert got["views"]


def test_autograd_grad_with_respect_to_dtensor_parameters(results):
    for got in _each_rank(results, "grad"):
        assert got["untouched"]  # nothing accumulated


def test_retain_grad_on_a_dtensor_activation(results):
    assert len(list(_each_rank(results, "retained"))) == 2


def test_retain_graph_twice_over_a_tensor_parallel_graph(results):
    assert len(list(_each_rank(results, "twice"))) == 2


def _worker_placements(rank, world, port, results):
    """One structure, one shape, two placements of the weight: each its own graph (what a
    graph bakes in of a DTensor is compared with the sizes), each found again after."""
    import gradfx
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def case():
        mesh = init_device_mesh("cpu", (world,))
        got = []
        for placement in (Shard(0), Replicate(), Shard(0), Replicate()):
            for under_gradfx in (False, True):
                torch.manual_seed(0)
                w = nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, [placement]))
                x = distribute_tensor(torch.randn(3, 4), mesh, [Replicate()])
                loss = (x @ w.t()).relu().sum().full_tensor()  # a plain root
                if under_gradfx:
                    with gradfx.compiled_autograd():
                        loss.backward()
                else:
                    loss.backward()
                got.append((w.grad.to_local(), w.grad.placements))
        pairs = list(zip(got[::2], got[1::2]))
        return {"equal": all(torch.equal(a, b) and pa == pb for (a, pa), (b, pb) in pairs),
                "stats": gradfx.stats()}
    with gloo_group(rank, world, port):
        gradfx.reset()
        record_case(results, rank, case)


def test_a_dtensor_placement_is_part_of_what_finds_a_graph():
    got = spawn_ranks(_worker_placements, 1)[0]
    assert "error" not in got, got.get("error")
    assert got["equal"]
    stats = got["stats"]
    assert stats["captures"] == 2 and stats["cache_hits"] == 2 and stats["fallbacks"] == 0, stats


# -- 2-D: tensor parallelism inside FSDP2, 4 ranks on a 2 x 2 mesh ---------------------

def _worker_2d(rank, world, port, results):
    import gradfx
    from gradfx.capture import native
    assert native.wait() is not None, native.reason()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    with gloo_group(rank, world, port):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

        def build():
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            m = parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
            fully_shard(m, mesh=mesh["dp"])
            return m
        eager, under = build(), build()
        equal, opaque = True, None
        for it in range(STEPS):
            torch.manual_seed(10 * mesh["dp"].get_local_rank() + it)  # a batch per data-parallel rank
            x = torch.randn(3, 8)
            eager.zero_grad()
            eager(x).sum().backward()
            under.zero_grad()
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*on the eager engine", category=gradfx.FallbackWarning)
                with gradfx.compiled_autograd() as session:
                    under(x).sum().backward()
            if session.graphs:
                opaque = sorted({label.split()[0] for label in session.graphs[0].opaque_nodes})
            equal &= all(torch.equal(a.grad.to_local(), b.grad.to_local()) and a.grad.placements == b.grad.placements
                         for a, b in zip(eager.parameters(), under.parameters()))
        results[rank] = {"equal": equal, "stats": gradfx.stats(), "opaque": opaque}


def test_tensor_parallel_inside_fsdp2_is_captured_as_eager():
    results = spawn_ranks(_worker_2d, 4)
    for rank in range(4):
        got = results[rank]
        assert got["equal"], f"rank {rank}: gradients differ from eager TP inside FSDP2"
        stats = got["stats"]
        assert stats["fallbacks"] == 0 and stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1, stats
        assert got["opaque"] == ["torch::autograd::AccumulateGrad"], got["opaque"]  # traced through DTensor
