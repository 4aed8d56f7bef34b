"""aot_eager and inductor compile the pure regions of graphs that also call Python.

A graph with hooks, opaque nodes, custom Function backwards or checks is cut into pure
regions, each compiled, and the Python between them, run in the graph's order (eager's).
Gradients must be close to eager's, every hook must run as often, in the same order, with
close arguments, and the regions must really have been compiled.
"""

import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.backends import builtin
from gradfx.capture.run import continuation
from gradfx.capture.runtime import runtime_ops
from helpers import grads_of, snap


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


@pytest.fixture
def region_compiles(monkeypatch):
    """The region graphs the built-in compiling backends compile (both functionalize
    each region first)."""
    seen = []
    functionalized = builtin._functionalized

    def counted(gm, example_inputs):
        seen.append(gm)
        return functionalized(gm, example_inputs)
    monkeypatch.setattr(builtin, "_functionalized", counted)
    return seen


def _mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4))


class Cube(torch.autograd.Function):
    """A custom Function: its backward runs as the real one (an opaque call)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return 3 * x * x * grad


# Each takes (model, log), registers its hook and returns the forward to run.

def _leaf_hook(model, log):
    model[3].weight.register_hook(lambda g: log.append(("weight", g.clone())))
    return model


def _nonleaf_hook(model, log):
    def doubled(g):
        log.append(("h", g.clone()))
        return g * 2

    def forward(x):
        h = model[:3](x)
        h.register_hook(doubled)
        return model[3:](h)
    return forward


def _module_hook(model, log):
    model[3].register_full_backward_hook(lambda module, gi, go: log.append(("module", snap(gi), snap(go))))
    return model


def _post_accumulate_hook(model, log):
    # model[5] accumulates before model[3].bias's hook runs, model[0] after it
    model[3].bias.register_post_accumulate_grad_hook(
        lambda p: log.append(("post", snap(p.grad), snap(model[5].weight.grad), snap(model[0].weight.grad))))
    return model


def _custom_function(model, log):
    return lambda x: model[3:](Cube.apply(model[:3](x)))


def _opaque_node(model, log):
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0])  # a zero: prod's backward runs as the real node
    return lambda x: torch.prod(model(x) * mask, dim=1)


# name: (program, autograd nodes run opaquely, regions compiled at least)
PROGRAMS = {
    "leaf_hook": (_leaf_hook, [], 2),
    "nonleaf_hook": (_nonleaf_hook, [], 2),
    "module_hook": (_module_hook, [], 2),
    "post_accumulate_hook": (_post_accumulate_hook, [], 2),
    "custom_function": (_custom_function, ["CubeBackward"], 2),
    "opaque_node": (_opaque_node, ["ProdBackward1"], 1),
}


def _cases():
    for name in PROGRAMS:
        yield pytest.param(name, "aot_eager", id=f"{name}-aot_eager")
        marks = [pytest.mark.slow] + ([pytest.mark.sample] if name == "nonleaf_hook" else [])
        yield pytest.param(name, "inductor", marks=marks, id=f"{name}-inductor")


def _close(a, b, where="log"):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (where, a, b)
        torch.testing.assert_close(a, b, msg=lambda m: f"{where}: {m}")
    elif isinstance(a, (tuple, list)):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), (where, a, b)
        for k, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{k}]")
    else:
        assert a == b, (where, a, b)


def _compare(program, backend, iterations=3, batch=(8, 6), **kwargs):
    """Run ``program`` eagerly and under gradfx, each on its own copy of the model and
    log; gradients and logs must be close after every step (grads are not zeroed: later
    steps add into ``.grad``).  Returns the blocks' sessions."""
    logs, models, forwards, sessions = [], [], [], []
    for _ in range(2):
        torch.manual_seed(0)
        logs.append([])
        models.append(_mlp())
        forwards.append(program(models[-1], logs[-1]))
    for it in range(iterations):
        torch.manual_seed(it)
        forwards[0](torch.randn(*batch)).sum().backward()
        torch.manual_seed(it)
        with gradfx.compiled_autograd(backend=backend, **kwargs) as session:
            forwards[1](torch.randn(*batch)).sum().backward()
        assert session.stats["fallbacks"] == 0, session.stats
        sessions.append(session)
        _close(logs[0], logs[1])
        _close(grads_of(models[0].parameters()), grads_of(models[1].parameters()), "grads")
    return sessions


@pytest.mark.parametrize("name, backend", list(_cases()))
def test_regions_are_compiled_around_python(name, backend, region_compiles):
    program, opaque, regions = PROGRAMS[name]
    first = _compare(program, backend)[0]
    assert [label.split()[0] for label in first.graphs[0].opaque_nodes] == opaque
    stats = gradfx.stats()
    assert stats["captures"] == 1 and stats["cache_hits"] == 2, stats
    assert stats["recompiles"] == 0 and stats["uncompiled"] == 0, stats
    assert len(region_compiles) >= regions


def test_accumulations_steal_then_add_in_place(monkeypatch):
    """accumulate_grad's semantics, as in eager: the first gradient becomes ``.grad``
    (no copy for a dense leaf), later ones are added in place (``.grad`` keeps its
    identity)."""
    clones = []
    clone = runtime_ops._clone_obey_contract
    monkeypatch.setattr(runtime_ops, "_clone_obey_contract", lambda g, v: clones.append(v.shape) or clone(g, v))
    torch.manual_seed(0)
    model = _mlp()
    forward = _nonleaf_hook(model, [])
    for _ in range(2):
        before = [p.grad for p in model.parameters()]
        with gradfx.compiled_autograd(backend="aot_eager"):
            forward(torch.randn(8, 6)).sum().backward()
        assert clones == []
        assert all(b is None or p.grad is b for p, b in zip(model.parameters(), before))


def test_saved_tensors_are_freed_as_the_regions_run():
    """A hook between two regions finds the tensors saved by the nodes before it freed
    and those of the nodes after it alive, as eager's does."""
    seen = []
    for engine in ("eager", "aot_eager", "aot_eager"):
        torch.manual_seed(0)
        model = _mlp()
        h0 = model[0](torch.randn(8, 6))  # saved by GELU, which runs after the hook
        h1 = model[1](h0)  # saved by LayerNorm, after the hook
        h2 = model[2](h1)  # saved by model[3], before the hook
        h4 = model[4](model[3](h2))  # saved by Tanh and model[5], before the hook
        refs = [weakref.ref(t) for t in (h0, h1, h2, h4)]
        alive = []
        h2.register_hook(lambda g: alive.append([r() is not None for r in refs]))
        loss = model[5](h4).sum()
        del h0, h1, h2, h4
        if engine == "eager":
            loss.backward()
        else:
            with gradfx.compiled_autograd(backend=engine):
                loss.backward()
        seen.append(alive)
    assert seen == [[[True, True, False, False]]] * 3


def test_hook_returning_another_layout_recompiles_the_region_after_it():
    """Compiled code is specialized to its inputs' strides; a hook may return any."""
    flip = [False]

    def program(model, log):
        def hook(g):
            log.append(("h", g.clone()))
            return g.t().contiguous().t() if flip[0] else None

        def forward(x):
            h = model[:2](x)
            h.register_hook(hook)
            return model[2:](h)
        return forward
    _compare(program, "aot_eager", iterations=2)
    flip[0] = True
    _compare(program, "aot_eager", iterations=2)
    assert gradfx.stats()["recompiles"] == 1 and gradfx.stats()["uncompiled"] == 0


@pytest.mark.slow
def test_inductor_hook_returning_another_layout():
    flip = [False]

    def program(model, log):
        def forward(x):
            h = model[:2](x)
            h.register_hook(lambda g: g.t().contiguous().t() if flip[0] else None)
            return model[2:](h)
        return forward
    _compare(program, "inductor", iterations=1)
    flip[0] = True
    _compare(program, "inductor", iterations=2)
    assert gradfx.stats()["recompiles"] == 1


def test_dynamic_sizes_with_hooks(region_compiles):
    """A graph of symbolic sizes compiles each region once, for all sizes."""
    recompiles = []
    for batch in (8, 12, 5, 12):
        session, = _compare(_module_hook, "aot_eager", iterations=1, batch=(batch, 6), dynamic=True)
        recompiles.append(session.stats["recompiles"])
    assert len(region_compiles) >= 2 and recompiles == [0, 0, 0, 0]
    assert gradfx.stats()["captures"] == 1 and gradfx.stats()["uncompiled"] == 0


def test_code_for_all_sizes_holds_where_its_guards_do():
    """The guards of a region compiled for all sizes: sizes symbolic in the captured graph
    may change, as long as what the trace assumed of them holds (a matrix product's inner
    sizes equal); sizes static there may not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def region(n, x, y):
        return (torch.mm(x, y).view(n, -1) * 2,)
    examples = [8, torch.randn(8, 16), torch.randn(16, 4)]
    symbolic = make_fx(region, tracing_mode="symbolic")(*examples)  # every size symbolic, as captured
    fn, holds = builtin._aot_eager_compile(symbolic, examples, dynamic=True)
    x, y = torch.randn(5, 7), torch.randn(7, 3)
    assert holds([5, x, y])
    torch.testing.assert_close(fn([5, x, y])[0], (x @ y) * 2)
    assert not holds([5, torch.randn(6, 7), y])  # n is not x's first size
    assert not holds([5, x, torch.randn(8, 3)])  # x's second size is not y's first
    static = make_fx(region, tracing_mode="fake")(*examples)  # every size as captured: static
    _, holds = builtin._aot_eager_compile(static, examples, dynamic=True)
    assert holds(examples) and not holds([8, torch.randn(8, 16), torch.randn(16, 5)])


def test_autograd_grad_returns_what_regions_and_hooks_compute():
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(8, 6, requires_grad=True)
    results = []
    for engine in ("eager", "aot_eager"):
        h = model[:3](x)
        h.register_hook(lambda g: g * 2)
        out = model[3:](h).sum()
        wanted = (x, model[0].weight, model[5].bias)
        if engine == "eager":
            results.append(torch.autograd.grad(out, wanted))
        else:
            with gradfx.compiled_autograd(backend=engine):
                results.append(torch.autograd.grad(out, wanted))
    _close(results[0], results[1], "grads")


class NoneWhenNegative(torch.autograd.Function):
    """Returns None where the graph traced a gradient: the graph stops at its check."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return None if grad.sum() < 0 else grad * 3


def test_a_graph_that_stops_at_a_check_finishes_like_eager(monkeypatch):
    stops = []
    finish = continuation.finish
    monkeypatch.setattr(continuation, "finish", lambda *args: stops.append(1) or finish(*args))

    def program(model, log):
        model[3].weight.register_hook(lambda g: log.append(("weight", g.clone())))
        sign = iter([1.0, -1.0, 1.0, -1.0])
        return lambda x: model[3:](NoneWhenNegative.apply(model[:3](x))) * next(sign)
    _compare(program, "aot_eager", iterations=2)
    assert stops


def test_a_graph_with_nothing_to_compile_warns_once_and_counts_uncompiled():
    x = torch.randn(5, requires_grad=True)
    said = []
    for step in range(3):
        h = x * 2
        h.register_hook(lambda g: g + 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gradfx.compiled_autograd(backend="aot_eager") as session:
                h.exp().sum().backward()
        fallbacks = [w for w in caught if issubclass(w.category, gradfx.FallbackWarning)]
        assert all(w.filename == __file__ for w in fallbacks)  # it points at the backward call
        said += [str(w.message) for w in fallbacks]
        assert len(said) == 1 and session.stats["uncompiled"] == (1 if step == 0 else 0)
    assert "'aot_eager' runs a backward graph uncompiled" in said[0] and "no run of 3 or more aten ops" in said[0]
    assert gradfx.stats()["uncompiled"] == 1 and gradfx.stats()["cache_hits"] == 2
    torch.testing.assert_close(x.grad, 3 * 2 * ((2 * x).exp() + 1).detach())


def _flaky(fail_from):
    """aot_eager's compile, failing from call number ``fail_from[0]`` on (a list: the
    test may move it)."""
    calls = []

    def compile_region(gm, example_inputs):
        calls.append(gm)
        if len(calls) >= fail_from[0]:
            raise RuntimeError("this region does not compile")
        return builtin._aot_eager_compile(gm, example_inputs)
    return builtin._split_backend("flaky", compile_region), calls


def test_a_region_failing_to_compile_for_new_sizes_runs_uncompiled_with_one_warning():
    fail_from = [100]
    backend, calls = _flaky(fail_from)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in (8, 12, 5, 5):
            _compare(_nonleaf_hook, backend, iterations=1, batch=(batch, 6), dynamic=True)
            fail_from[0] = len(calls) + 2  # the first region compiles for 12, the second does not
    said = [str(w.message) for w in caught if issubclass(w.category, gradfx.FallbackWarning)]
    assert len(said) == 1 and "does not compile" in said[0] and "that region runs uncompiled" in said[0], said
    assert gradfx.stats()["uncompiled"] == 1 and gradfx.stats()["captures"] == 1


def test_a_region_failing_its_first_compile_runs_the_graph_on_eager_hooks_once():
    backend, calls = _flaky([2])  # the graph's second region fails
    with pytest.warns(gradfx.FallbackWarning, match="does not compile"):
        _compare(_nonleaf_hook, backend, iterations=2)
    assert len(calls) == 2
    with gradfx.compiled_autograd(backend=backend, strict=True):
        with pytest.raises(gradfx.Unsupported, match="does not compile"):
            _mlp()(torch.randn(3, 6)).sum().backward()  # without hooks: one region, which fails
