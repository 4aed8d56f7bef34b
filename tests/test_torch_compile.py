"""Captured graphs are torch.compile citizens: traced whole with fullgraph=True.

A user backend ``lambda gm: torch.compile(gm, backend=b, fullgraph=True)`` compiles
every kind of graph gradfx captures (accumulations, module hooks, custom
Functions, checkpointing, opaque nodes) with no graph break and no warning, one
dynamo compile for all steps; and a backward called inside a ``torch.compile``'d
training step is captured like any other.
"""

import contextlib
import copy
import importlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as checkpoint
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import gradfx
from gradfx.backends.traceable import accumulate
from gradfx.capture.runtime import hook_ops
from gradfx.capture.trace import aot_regions
from helpers import RetNone, hooked_captures


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


class Scale(torch.autograd.Function):
    """A custom Function with a saved tensor and a non-tensor attribute."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        ctx.save_for_backward(x)
        return x * factor + x.sin()

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return grad * ctx.factor + grad * x.cos(), None


class Blocks(nn.Module):
    """mlp blocks with an optional module hook, custom Function, checkpoint or opaque node."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.a = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16))
        self.b = nn.Linear(16, 4)
        if kind == "module_hooks":
            self.b.register_full_backward_hook(lambda m, gi, go: None)
            self.b.register_full_backward_pre_hook(lambda m, go: None)
            self.a[2].register_full_backward_hook(lambda m, gi, go: None)

    def forward(self, x):
        if self.kind == "checkpoint":
            h = checkpoint.checkpoint(self.a, x, use_reentrant=False)
            h = checkpoint.checkpoint(self.a[2], h, use_reentrant=True)
        else:
            h = self.a(x)
        if self.kind == "custom_function":
            h = Scale.apply(h, 2.0)
        if self.kind == "opaque":  # prod's backward runs as the real node
            h = h * h.prod(1, keepdim=True)
        return self.b(h)


def _cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


def _transformer():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2,
                                 enable_nested_tensor=False)


MODELS = {
    "mlp": (lambda: Blocks("mlp"), (6, 8)),
    "cnn": (_cnn, (4, 3, 8, 8)),
    "transformer": (_transformer, (3, 5, 16)),
    "module_hooks": (lambda: Blocks("module_hooks"), (6, 8)),
    "custom_function": (lambda: Blocks("custom_function"), (6, 8)),
    "checkpoint": (lambda: Blocks("checkpoint"), (6, 8)),
    "opaque": (lambda: Blocks("opaque"), (6, 8)),
}


class Inspecting:
    """A gradfx backend: ``torch.compile(gm, backend=inner, fullgraph=True)``, keeping what it received."""

    def __init__(self, inner):
        self.counter = CompileCounterWithBackend(inner)
        self.graphs = []

    def __call__(self, gm):
        self.graphs.append(gm)
        return torch.compile(gm, backend=self.counter, fullgraph=True)


def _train(name, backend, steps=5):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    eager = make()
    model = copy.deepcopy(eager)
    for step in range(steps):
        torch.manual_seed(step)
        x = torch.randn(*shape)
        for m in (eager, model):
            m.zero_grad(set_to_none=True)
        eager(x).square().mean().backward()
        with gradfx.compiled_autograd(backend=backend) as session:
            model(x).square().mean().backward()
        assert session.stats["fallbacks"] == 0
        for p, q in zip(eager.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad)
    return model


def _check(name, inner, steps=5):
    if inner == "inductor":  # its first import warns about torch.jit: not while watching
        importlib.import_module("torch._inductor.compile_fx")
    backend = Inspecting(inner)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = _train(name, backend, steps)
    assert [str(w.message) for w in caught] == []
    assert not counters["graph_break"], dict(counters["graph_break"])
    # A reentrant checkpoint runs a backward of its own inside the graph, on the engine
    # (uncounted); the outer one is captured twice where it learns how the non-reentrant
    # checkpoint's hooks unpack first (hooked_captures).
    backwards = steps
    graphs = hooked_captures() if name == "checkpoint" else 1
    stats = gradfx.stats()
    assert stats["captures"] == graphs and stats["cache_hits"] == backwards - graphs, stats
    assert backend.counter.frame_count == graphs  # one dynamo graph each, no recompile over the steps
    gm = backend.graphs[0]
    ordered_op = getattr(getattr(torch.ops, "gradfx", None), "accumulate_grad", None)
    targets = (accumulate,) + ((ordered_op.default,) if ordered_op is not None else ())
    accumulations = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]
    returned = gm.graph.output_node().args[0]
    if name in ("module_hooks", "custom_function", "checkpoint"):
        # Python that could read `.grad` runs inside: the accumulations stay in their places.
        assert len(accumulations) == len(list(model.parameters())) and returned == ()
    else:  # the graph returns the gradients; gradfx accumulates them after it
        assert accumulations == [] and len(returned) == len(list(model.parameters()))
    hooks = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in hook_ops.HOOK_CALLS]
    assert bool(hooks) == (name == "module_hooks")


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_fullgraph_compile(name, inner):
    _check(name, inner)


@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.sample) if n == "mlp" else n
                                  for n in sorted(MODELS)])
def test_fullgraph_compile_inductor(name):
    _check(name, "inductor", steps=3)


def test_accumulation_keeps_grad_identity_and_layout():
    # Without zero_grad the compiled graph adds into the same .grad tensor, as eager does.
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    backend = Inspecting("aot_eager")
    ids = []
    for step in range(3):
        with gradfx.compiled_autograd(backend=backend):
            conv(torch.randn(2, 3, 6, 6)).sum().backward()
        ids.append(id(conv.weight.grad))
        assert conv.weight.grad.stride() == conv.weight.stride()
    assert ids[1] == ids[2]


def test_backward_inside_a_compiled_training_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    eager = copy.deepcopy(model)

    @torch.compile(backend="aot_eager")
    def step(m, x):
        loss = m(x).square().mean()
        loss.backward()
        return loss

    for it in range(3):
        x = torch.randn(4, 8)
        model.zero_grad()
        eager.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gradfx.compiled_autograd() as session:
                step(model, x)
        # dynamo, still watching frames after its graph break at backward(), skips gradfx's
        assert not [w for w in caught if "Dynamo" in str(w.message)], [str(w.message) for w in caught]
        eager(x).square().mean().backward()
        assert session.stats == {**session.stats, "captures": int(it == 0), "cache_hits": int(it > 0),
                                 "fallbacks": 0}
        for p, q in zip(eager.parameters(), model.parameters()):
            torch.testing.assert_close(q.grad, p.grad)


def test_a_hook_dynamo_cannot_trace_falls_back_to_the_eager_backend():
    torch.manual_seed(0)
    model = Blocks("mlp")
    model.b.register_full_backward_hook(lambda m, gi, go: print(end=""))  # print: a graph break
    backend = Inspecting("eager")
    with pytest.warns(gradfx.FallbackWarning, match="failed to compile"):
        with gradfx.compiled_autograd(backend=backend):
            model(torch.randn(6, 8)).sum().backward()
    eager = copy.deepcopy(model)
    for p in eager.parameters():
        p.grad = None
    eager(torch.randn(6, 8)).sum()  # same structure, grads compared below on a fresh run
    torch.manual_seed(1)
    x = torch.randn(6, 8)
    model.zero_grad()
    eager.zero_grad()
    eager(x).sum().backward()
    with pytest.raises(gradfx.Unsupported, match="failed to compile"):
        with gradfx.compiled_autograd(backend=backend, strict=True):
            model(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # strict: nothing ran
    with gradfx.compiled_autograd(backend=backend):
        model(x).sum().backward()
    for p, q in zip(eager.parameters(), model.parameters()):
        assert torch.equal(q.grad, p.grad)


def test_torch_internal_backward_calls_pass_through_uncounted():
    # AOTAutograd traces a joint graph (backward calls on fake tensors) while
    # compiling a forward inside a block: torch's business, not a user's backward.
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    compiled = torch.compile(lin, backend="aot_eager")
    with gradfx.compiled_autograd() as session:
        out = compiled(torch.randn(2, 4)).sum()
        assert session.stats["captures"] == 0 and session.stats["fallbacks"] == 0
        out.backward()
    assert session.stats["captures"] == 1


def test_non_dense_leaf_gets_a_contiguous_grad():
    # AccumulateGrad's layout contract: a leaf that is not dense gets a contiguous copy.
    base = torch.randn(4, 4)
    var = base[::2, ::2].requires_grad_(True)
    kept = []
    var.register_hook(lambda g: kept.append(g))
    with gradfx.compiled_autograd(backend=Inspecting("aot_eager")):
        (var * 7.0).sum().backward()
    assert var.grad.is_contiguous() and torch.equal(var.grad, torch.full((2, 2), 7.0))
    assert kept[0].untyped_storage().data_ptr() != var.grad.untyped_storage().data_ptr()


def test_accumulator_hooks_read_grad_under_a_compiled_forward():
    # The forward compiled by torch.compile is an opaque node of the backward; hooks on
    # the accumulators read .grad right after it is written, as in eager.
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
        keep = []
        for param in model.parameters():
            acc = param.expand_as(param).grad_fn.next_functions[0][0]

            def divide(*_, param=param):
                param.grad = param.grad / 4.0
            keep.append((acc, acc.register_hook(divide)))
        return model, keep
    x = torch.randn(8, 16)
    eager, _ = build()
    eager(x).sum().backward()
    model, _ = build()
    compiled = torch.compile(model, backend="aot_eager")
    with gradfx.compiled_autograd(backend=Inspecting("eager")) as session:
        compiled(x).sum().backward()
    assert session.stats["fallbacks"] == 0
    for p, q in zip(eager.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad)


def test_a_custom_backward_returning_none_runs_as_in_eager():
    # Traced before its backward was seen, the first graph takes the gradient as a tensor;
    # dynamo then inlines the backward, finds None, and fails to compile that graph (the
    # eager backend runs it, stopping where the None appears).  The graph captured next,
    # with that gradient None, compiles.
    def step(model, x):
        h = model(x)
        (RetNone.apply(h.exp()).sin().sum() + h.sum()).backward()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    eager = copy.deepcopy(model)
    xs = [torch.randn(3, 4) for _ in range(3)]
    backend = Inspecting("aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradfx.compiled_autograd(backend=backend) as session:
            for x in xs:
                step(model, x)
    for x in xs:
        step(eager, x)
    for p, q in zip(eager.parameters(), model.parameters()):
        assert torch.equal(q.grad, p.grad)
    messages = [str(w.message) for w in caught if issubclass(w.category, gradfx.FallbackWarning)]
    assert len(messages) == 1 and "failed to compile" in messages[0] and "got None" in messages[0]
    assert "\n" not in messages[0]  # dynamo's advice goes to the log, not the warning
    assert session.stats["captures"] == 2 and session.stats["cache_hits"] == 1


@pytest.mark.parametrize("replayed", [False, True])
def test_a_leaf_marked_dynamic_never_breaks_the_backward(replayed, monkeypatch):
    # The user marks a leaf's size dynamic for the compiled forward.  Where the region's
    # backward stays an opaque call, dynamo, compiling gradfx's graph (static in that size
    # at first), refuses with a ConstraintViolationError while building its guards.  That
    # is a failed compile: the eager backend runs the graph.  Where gradfx replays the
    # region's backward graph (trace.aot_regions), dynamo compiles it.
    if not replayed:
        monkeypatch.setattr(aot_regions, "backward_graph", lambda cls: None)
    @torch.compile(backend="aot_eager")
    def f(x):
        return x.sin().sin()

    def leaf(n):
        torch.manual_seed(n)
        x = torch.randn(n, 3, requires_grad=True)
        torch._dynamo.mark_dynamic(x, 0)
        return x

    got = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradfx.compiled_autograd(backend=Inspecting("aot_eager"), dynamic=True):
            for n in (2, 4):
                x = leaf(n)
                f(x).sum().backward()
                got.append(x.grad)
    for n, g in zip((2, 4), got):
        x = leaf(n)
        f(x).sum().backward()
        assert torch.equal(g, x.grad)
    failed = [w for w in caught if issubclass(w.category, gradfx.FallbackWarning)]
    if replayed:
        assert failed == [] and gradfx.stats()["uncompiled"] == 0
    else:
        assert any("ConstraintViolationError" in str(w.message) for w in failed)


@pytest.mark.parametrize("hooked", [False, True])
def test_no_recompile_when_grad_appears(hooked):
    # Without zero_grad, .grad is None at the first backward and a tensor at the next:
    # gradfx leaves that out of its key, and the compiler must not specialise on it.
    torch.manual_seed(0)
    eager = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    model = copy.deepcopy(eager)
    if hooked:
        for m in (eager, model):
            m[0].weight.register_hook(lambda g: g * 2)
    backend = Inspecting("eager")
    for step in range(3):
        x = torch.randn(4, 8)
        eager(x).sum().backward()
        with gradfx.compiled_autograd(backend=backend) as session:
            model(x).sum().backward()
        for p, q in zip(eager.parameters(), model.parameters()):
            assert torch.equal(q.grad, p.grad)
    assert session.stats["recompiles"] == 0
    # A graph with hooks keeps its accumulations inside (a hook could read .grad); dynamo
    # then compiles once for `.grad is None` and once for a tensor there.
    assert backend.counter.frame_count == (2 if hooked else 1)


def test_first_gradient_is_stolen():
    # As in eager, .grad becomes the gradient the compiled code returned: no copy.
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    seen = {}

    def backend(gm):
        compiled = torch.compile(gm, backend="eager", fullgraph=True)

        def run(*args):
            out = compiled(*args)
            seen["ptrs"] = {t.data_ptr() for t in out}
            return out
        return run
    with gradfx.compiled_autograd(backend=backend):
        lin(torch.randn(2, 4)).sum().backward()
    assert seen["ptrs"] == {lin.weight.grad.data_ptr(), lin.bias.grad.data_ptr()}


@pytest.mark.parametrize("hooked", [False, True])
def test_backend_that_computes_nothing(hooked):
    lin = nn.Linear(4, 3)
    if hooked:
        lin.weight.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match=r"backend '[\w.<>]*lambda>' returned None instead of a tuple"):
        with gradfx.compiled_autograd(backend=lambda gm: (lambda *args: None)):
            lin(torch.randn(2, 4)).sum().backward()
    assert lin.weight.grad is None and lin.bias.grad is None


def test_backend_returning_wrong_gradients_writes_nothing():
    lin = nn.Linear(4, 3)
    lin(torch.randn(2, 4)).sum().backward()
    before = [p.grad.clone() for p in lin.parameters()]

    def backend(gm):
        def run(*args):
            return tuple(torch.zeros(7) for _ in gm(*args))  # the right count, wrong shapes
        return run
    with pytest.raises(RuntimeError, match=r"gave a gradient \[7\] .* to accumulate into a leaf \[3(, 4)?\]"):
        with gradfx.compiled_autograd(backend=backend):
            lin(torch.randn(2, 4)).sum().backward()
    assert all(torch.equal(p.grad, b) for p, b in zip(lin.parameters(), before))


@pytest.mark.parametrize("layout", ["transposed", "channels_last", "strided"])
def test_a_non_contiguous_leaf_compiles_under_dynamic_sizes(layout):
    """AccumulateGrad's layout contract checks a leaf's strides; a plain tensor leaf's
    strides are symbolic under ``dynamic=True`` (a Parameter's are static), where dynamo
    cannot sort by them: the check compares instead, and the graph compiles.  (A hook
    keeps the accumulation inside the graph, where the check runs.)"""
    torch.manual_seed(0)
    make = {"transposed": lambda: torch.randn(6, 4).t(),
            "channels_last": lambda: torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
            "strided": lambda: torch.randn(4, 12)[:, ::2]}[layout]
    leaf = make().requires_grad_()
    eager_leaf = leaf.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    counter = CompileCounterWithBackend("aot_eager")
    backend = lambda gm: torch.compile(gm, backend=counter, dynamic=True, fullgraph=True)  # noqa: E731
    double = lambda g: g * 2  # noqa: E731  (one hook object: dynamo guards on it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            weight = torch.randn(leaf.shape)
            for x, block in ((eager_leaf, contextlib.nullcontext()), (leaf, gradfx.compiled_autograd(backend=backend))):
                h = x * weight
                h.register_hook(double)  # Python in the graph: the accumulation stays in it
                with block as session:
                    h.sin().sum().backward()
            assert session.stats["uncompiled"] == 0 and session.stats["fallbacks"] == 0, session.stats
            assert leaf.grad.stride() == eager_leaf.grad.stride()
            torch.testing.assert_close(leaf.grad, eager_leaf.grad)
    assert [str(w.message) for w in caught] == []
    assert counter.frame_count == 2  # dynamo's graphs for .grad None (the first step) and set
