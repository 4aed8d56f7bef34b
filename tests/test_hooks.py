"""Hooks are captured into the graph and run as in eager: same calls, order, arguments."""

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn

import gradfx
from helpers import MaybeNone, run_both, snap as _snap


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def _mlp():
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _params_visible(log, params, name):
    # What a hook sees of the parameters' .grad at that moment.
    def hook(*args):
        log.append((name, _snap(args), tuple(_snap(p.grad) for p in params)))
    return hook


def test_leaf_tensor_hooks_fresh_objects_each_iteration():
    def build(log):
        model = _mlp()
        params = list(model.parameters())

        def step():
            handles = []
            for k, p in enumerate(params):
                handles.append(p.register_hook(_params_visible(log, params, f"leaf{k}")))
                if k % 2:
                    handles.append(p.register_hook(lambda g: g * 0.5))  # replaces the grad
            model(torch.randn(4, 6)).pow(2).sum().backward()
            for h in handles:
                h.remove()
        return params, step
    log = run_both(build)
    assert len(log) == 3 * 6


def test_nonleaf_tensor_hooks_and_retain_grad():
    def build(log):
        model = _mlp()
        params = list(model.parameters())

        def step():
            h = model[0](torch.randn(4, 6))
            h.register_hook(_params_visible(log, params, "h"))
            h.register_hook(lambda g: g * 2)
            a = model[1](h)
            a.retain_grad()
            b = model[2](a)
            b.register_hook(_params_visible(log, params, "b"))
            out = model[4](model[3](b)).sum()
            out.backward()
            log.append(("a.grad", _snap(a.grad)))
        return params, step
    run_both(build)


def test_node_pre_and_post_hooks_through_a_variable():
    def build(log):
        model = _mlp()
        params = list(model.parameters())

        def step():
            h = model[0](torch.randn(4, 6)).relu()
            fn = h.grad_fn
            fn.register_prehook(lambda go: log.append(("pre", _snap(go))))
            fn.register_hook(lambda gi, go: log.append(("post", _snap(gi), _snap(go))))
            y = (h * 3).sum()
            fn2 = y.grad_fn
            fn2.register_prehook(lambda go: (go[0] * 2,))
            y.backward()
        return params, step
    run_both(build)


def test_hooks_on_an_accumulator_node():
    # The Megatron/DDP-in-Python pattern: hooks on the parameters' AccumulateGrad.
    def build(log):
        model = _mlp()
        params = list(model.parameters())
        accs = []
        for k, p in enumerate(params):
            acc = p.view_as(p).grad_fn.next_functions[0][0]
            acc.register_hook(lambda gi, go, k=k: log.append((f"acc{k}", _snap(go), _snap(params[k].grad))))
            accs.append(acc)

        def step():
            model(torch.randn(4, 6)).sum().backward()
        return params, step
    run_both(build)


def test_post_accumulate_grad_hooks_optimizer_in_backward():
    def build(log):
        model = _mlp()
        params = list(model.parameters())

        def sgd(p):
            log.append(("post_acc", _snap(p.grad), tuple(_snap(q.grad) for q in params)))
            with torch.no_grad():
                p.add_(p.grad, alpha=-0.1)
            p.grad = None

        for p in params:
            p.register_post_accumulate_grad_hook(sgd)

        def step():
            model(torch.randn(4, 6)).pow(2).mean().backward()
        return params, step
    run_both(build)


@pytest.mark.parametrize("when", ["every_step", "some_steps"])
def test_post_accumulate_grad_hooks_run_where_nothing_is_accumulated(when):
    """AccumulateGrad calls a leaf's post-accumulate-grad hooks even when its gradient is
    undefined (a custom backward's None) or the leaf stopped requiring grad: the hooks
    run, and see the .grad as it was.  ``every_step``: the capture sees the None;
    ``some_steps``: the graph, captured with a gradient, stops where the None comes."""
    def build(log):
        model = _mlp()
        params = list(model.parameters())
        frozen = nn.Parameter(torch.ones(3))
        for k, p in enumerate(params + [frozen]):
            p.register_post_accumulate_grad_hook(
                lambda p, k=k: log.append(("post_acc", k, _snap(p.grad), tuple(_snap(q.grad) for q in params))))
        step_no = [0]

        def step():
            MaybeNone.drop = when == "every_step" or step_no[0] % 2 == 1
            step_no[0] += 1
            hidden = model[1](model[0](torch.randn(4, 6)))
            out = model[4](model[3](model[2](MaybeNone.apply(hidden))))
            loss = out.pow(2).sum() + (frozen * 2).sum()
            frozen.requires_grad_(False)  # its accumulator still runs, and calls its hook
            try:
                loss.backward()
            finally:
                frozen.requires_grad_(True)
        return params + [frozen], step
    # a capture traces the custom backward's result as a gradient; the None it returns then
    # stops the graph, and gradfx captures again with that None (the second capture)
    log = run_both(build, iterations=4, expect_captures=2)
    assert sum(1 for entry in log if entry[1] == 0) == 4  # the first layer's hook ran every step


def test_multi_grad_hooks_all_and_any():
    def build(log):
        model = _mlp()
        params = list(model.parameters())

        def step():
            h = model[0](torch.randn(4, 6))
            a = model[2](model[1](h))
            handles = [
                torch.autograd.graph.register_multi_grad_hook(
                    (h, a, params[0]), lambda grads: log.append(("all", _snap(grads)))),
                torch.autograd.graph.register_multi_grad_hook(
                    (h, a), lambda g: log.append(("any", _snap(g))), mode="any")]
            model[4](model[3](a)).sum().backward()
            for handle in handles:
                handle.remove()
        return params, step
    run_both(build)


def test_transformer_layer_with_hooks_everywhere():
    def build(log):
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        params = list(layer.parameters())
        for k, p in enumerate(params):
            p.register_hook(lambda g, k=k: log.append((f"p{k}", _snap(g))))

        def step():
            x = torch.randn(2, 5, 16)
            y = layer(x)
            y.register_hook(lambda g: g * 1.5)
            y.sum().backward()
        return params, step
    run_both(build)


def test_removed_hook_does_not_run_and_changes_key():
    x = torch.randn(3, requires_grad=True)
    calls = []
    with gradfx.compiled_autograd() as s:
        h = x.register_hook(lambda g: calls.append(1))
        (x * 2).sum().backward()
        h.remove()
        (x * 2).sum().backward()
        h = x.register_hook(lambda g: calls.append(2))
        (x * 2).sum().backward()
    assert calls == [1, 2]
    assert s.stats["captures"] == 2 and s.stats["cache_hits"] == 1


def test_hook_exception_propagates_and_mutation_is_seen():
    class Boom(Exception):
        pass
    x = torch.randn(3, requires_grad=True)
    h = x * 2

    def bad(g):
        raise Boom("from the hook")
    h.register_hook(bad)
    with gradfx.compiled_autograd():
        with pytest.raises(Boom, match="from the hook"):
            h.sum().backward()
    seen = []
    y = torch.randn(3, requires_grad=True)
    y.register_hook(lambda g: seen.append(len(seen)))
    with gradfx.compiled_autograd():
        for _ in range(3):
            (y * 3).sum().backward()
    assert seen == [0, 1, 2]


@pytest.mark.parametrize("bad, error", [
    (lambda g: g[:2], RuntimeError),
    (lambda g: 5, TypeError),
    (lambda g: g.double(), RuntimeError),
    (lambda g: g[:2].double(), RuntimeError),  # eager names the type before the size
    (lambda g: g.to("meta"), RuntimeError),  # MetaFloatType: no legacy name
    (lambda g: g.to(torch.bfloat16), RuntimeError),  # CPUBFloat16Type
    (lambda g: g.to(torch.complex64), RuntimeError),
])
def test_wrong_hook_result_raises_like_eager(bad, error):
    def run(use_gfx):
        x = torch.randn(3, requires_grad=True)
        h = x * 2
        h.register_hook(bad)
        with (gradfx.compiled_autograd() if use_gfx else warnings.catch_warnings()):
            with pytest.raises(error) as err:
                h.sum().backward()
        return str(err.value)
    assert run(True) == run(False)


def test_steal_semantics_when_a_hook_keeps_the_gradient():
    def run(use_gfx):
        x = torch.randn(3, requires_grad=True)
        kept = []
        x.register_hook(lambda g: kept.append(g))
        with (gradfx.compiled_autograd() if use_gfx else warnings.catch_warnings()):
            (x * 2).sum().backward()
        return x.grad.data_ptr() == kept[0].data_ptr()
    assert run(True) == run(False)


def test_node_hooks_registered_through_expressions():
    # However the receiver is written, the hooks are read from the node itself.
    def build(log):
        model = _mlp()
        params = list(model.parameters())

        def step():
            h = model[0](torch.randn(4, 6)).relu()
            h.grad_fn.register_prehook(lambda go: log.append(("pre", _snap(go))))
            h.grad_fn.register_hook(lambda gi, go: log.append(("post", _snap(gi), _snap(go))))
            y = model[2](h).tanh()
            y.grad_fn.next_functions[0][0].register_hook(lambda gi, go: log.append(("addmm", _snap(gi))))
            model[4].weight.view_as(model[4].weight).grad_fn.next_functions[0][0].register_prehook(
                lambda go: log.append(("acc pre", _snap(go))))
            [y.grad_fn][0].register_prehook(lambda go: (go[0] * 2,))
            model[4](y).sum().backward()
        return params, step
    run_both(build, strict=True)


def test_node_hooks_added_and_removed_between_cached_steps():
    def build(log):
        model = _mlp()
        params = list(model.parameters())
        handles = []

        def step():
            h = model[0](torch.randn(4, 6)).relu()
            if len(log) % 2 == 0:
                handles.append(h.grad_fn.register_hook(lambda gi, go: log.append(("post", _snap(gi)))))
            handles.append(h.grad_fn.register_prehook(lambda go: log.append(("pre", _snap(go)))))
            handles.pop().remove()
            model[4](model[2](h).tanh()).sum().backward()
        return params, step
    run_both(build, iterations=4, expect_captures=2, strict=True)



def _count_nodes(root) -> int:
    seen, todo = set(), [root.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is not None and fn not in seen:
            seen.add(fn)
            todo += [f for f, _ in fn.next_functions]
    return len(seen)


def test_node_hooks_found_when_the_walk_stops_probing_early(monkeypatch):
    """A walk probes nodes for hook dicts only until it has found every live one; a dict
    on another live graph keeps it probing to the end.  The hooks sit on the root, on
    the first layer (discovered late) and, emptied by a removed handle, in between."""
    from gradfx.capture.graph import hooks as hook_finder
    probed = []
    real_probe = hook_finder._probe_node
    monkeypatch.setattr(hook_finder, "_probe_node", lambda node: probed.append(node) or real_probe(node))

    def build(log):
        model = _mlp()
        other = []

        def step():
            x = torch.randn(4, 6)
            h = model[0](x)
            h.grad_fn.register_prehook(lambda go: log.append(("first layer pre", _snap(go))))
            mid = model[2](h.relu())
            mid.grad_fn.register_hook(lambda gi, go: None).remove()  # an empty, live dict
            out = model[4](mid.tanh()).sum()
            out.grad_fn.register_hook(lambda gi, go: log.append(("root post", _snap(gi), _snap(go))))
            other.clear()
            if len(log) % 4 == 2:  # another live graph with a hook dict of its own
                other.append(model[0](x).sum())
                other[0].grad_fn.register_prehook(lambda go: None)
            out.backward()
        return list(model.parameters()), step
    run_both(build, iterations=4, strict=True)

    # Graphs of earlier tests may still be alive with hook dicts of their own, which
    # would rightly keep the walk probing: count only this graph's.
    monkeypatch.setattr(hook_finder, "_node_dicts", {})
    model = _mlp()
    h = model[0](torch.randn(4, 6))
    h.grad_fn.register_prehook(lambda go: None)
    out = model[4](model[2](h.relu()).tanh()).sum()
    total = _count_nodes(out)
    probed.clear()
    with gradfx.compiled_autograd(backend="eager", strict=True):
        out.backward()
    assert 0 < len(probed) < total - 2, f"probed {len(probed)} of {total} nodes after finding the only dict"


def test_accumulator_post_hook_sees_the_stolen_gradient():
    """Eager steals the first gradient into .grad even when the accumulator has post-hooks
    (it expects the reference it keeps for them), so a post-hook's grad_outputs[0] is
    .grad itself and sees what a post-accumulate-grad hook did to it in place."""

    def build(log):
        t = torch.rand(3, requires_grad=True)

        def post_accumulate(tt):
            log.append(("post acc", _snap(tt.grad)))
            tt.grad.add_(0.5)

        def step():
            t.grad = None
            acc = t.view_as(t).grad_fn.next_functions[0][0]
            handles = [
                t.register_hook(lambda g: log.append(("tensor pre", _snap(g))) or g.sub(2.0)),
                acc.register_prehook(lambda go: log.append(("pre", _snap(go))) or (go[0].div(5.0),)),
                t.register_post_accumulate_grad_hook(post_accumulate),
                acc.register_hook(lambda gi, go: log.append(("post", _snap(gi), _snap(go)))
                                  or setattr(t, "grad", go[0].mul(10))),
            ]
            (t * 1).sum().backward()
            log.append(("grad", _snap(t.grad)))
            for h in handles:
                h.remove()
        return [t], step

    run_both(build)


def test_multi_grad_hook_on_leaves_under_grad_raises_as_in_eager():
    """register_multi_grad_hook asks _will_engine_execute_node about each tensor; for the
    accumulator of a leaf that autograd.grad() captures, eager refuses with an error."""

    def build(log):
        a, b, c = (torch.rand(2, requires_grad=True) for _ in range(3))
        handle = [None]

        def step():
            if handle[0] is not None:
                handle[0].remove()
            handle[0] = torch.autograd.graph.register_multi_grad_hook(
                (a, b, c), lambda grads: log.append(("multi", [None if g is None else _snap(g) for g in grads])))
            (a * b).sum().backward()
            try:
                torch.autograd.grad((a * 3).sum(), (a,))
                log.append(("grad() ran", None))
            except RuntimeError as err:
                log.append(("grad() raised", str(err)))
        return [a, b, c], step

    log = run_both(build, expect_captures=2)
    assert log[1][0] == "grad() raised" and "_will_engine_execute_node" in log[1][1]


@pytest.mark.parametrize("call", ["grad", "backward_inputs"])
@pytest.mark.parametrize("op", ["mm", "mul", "add", "addmm"])
def test_post_hooks_of_a_partial_graph_see_none_where_eager_computes_nothing(call, op):
    """autograd.grad / backward(inputs=): a builtin node computes only the gradients
    whose next node runs; its post-hooks see None for the others, as in eager."""
    def run(use_gradfx):
        torch.manual_seed(0)
        x = torch.randn(2, 3, requires_grad=True)
        w = torch.randn(3, 3, requires_grad=True)
        b = torch.randn(3, requires_grad=True)
        h = {"mm": lambda: x @ w, "mul": lambda: x * w[0], "add": lambda: x + w[0],
             "addmm": lambda: torch.addmm(b, x, w)}[op]()
        seen = []
        h.grad_fn.register_hook(lambda gi, go: seen.append([None if g is None else g.clone() for g in gi]))
        loss = h.sin().sum()
        with gradfx.compiled_autograd(strict=True) if use_gradfx else contextlib.nullcontext():
            for _ in range(2):  # capture, then the cached graph
                if call == "grad":
                    got = torch.autograd.grad(loss, [w], retain_graph=True)
                else:
                    loss.backward(inputs=[w], retain_graph=True)
                    got = (w.grad,)
        return got, seen

    (want, want_seen), (got, got_seen) = run(False), run(True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert len(want_seen) == len(got_seen) == 2
    for a, b in zip(want_seen, got_seen):
        assert [g is None for g in a] == [g is None for g in b]
        assert all(g is None or torch.equal(g, h) for g, h in zip(a, b))


def test_module_full_backward_hook_with_an_unused_output():
    """A module with two outputs and a full backward hook; the loss uses one. The hook on
    the module's outputs hands on None for the unused one (eager: a.grad from the used
    output only, the hook sees (grad, None)); over cached steps and with both used."""
    class Two(nn.Module):
        def forward(self, a):
            return a * 2, a.sin()

    def run(use_gradfx, both):
        torch.manual_seed(0)
        m = Two()
        seen = []
        m.register_full_backward_hook(lambda mod, gi, go: seen.append(_snap((gi, go))))
        grads = []
        with gradfx.compiled_autograd(strict=True) if use_gradfx else contextlib.nullcontext():
            for _ in range(3):
                a = torch.randn(4, requires_grad=True)
                y1, y2 = m(a)
                (y1.sum() + (y2.sum() if both else 0)).backward()
                grads.append(a.grad)
        return grads, seen

    for both in (False, True):
        (want, want_seen), (got, got_seen) = run(False, both), run(True, both)
        assert all(torch.equal(w, g) for w, g in zip(want, got))
        assert _same_nested(want_seen, got_seen)


def _same_nested(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, (tuple, list)):
        return isinstance(b, (tuple, list)) and len(a) == len(b) and all(map(_same_nested, a, b))
    return a == b


def test_post_hook_registered_on_a_node_while_it_runs_raises():
    """Eager runs a post-hook registered on a node while that node runs (it reads them
    after the node); a captured graph cannot, so gradfx says so instead of leaving it
    out. A hook registered meanwhile on another node is fine."""
    class Registers(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, on_itself):
            ctx.on_itself = on_itself
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            node = ctx if ctx.on_itself else other.grad_fn
            node.register_hook(lambda gi, go: None)
            return grad * 2, None

    other = torch.randn(3, requires_grad=True) * 1
    x = torch.randn(3, requires_grad=True)
    with gradfx.compiled_autograd():
        Registers.apply(x, False).sum().backward()
        assert torch.equal(x.grad, torch.full((3,), 2.0))
        with pytest.raises(RuntimeError, match="post-hook was registered on RegistersBackward while it ran"):
            Registers.apply(x, True).sum().backward()


def _running():
    node = torch._C._current_autograd_node()
    return None if node is None else node.name()


def test_hooks_see_their_node_running():
    # Every hook of a node runs while the engine evaluates that node: tensor hooks,
    # pre- and post-hooks, a leaf's hooks and post-accumulate hooks (its AccumulateGrad),
    # module full backward hooks.
    def build(log):
        model = _mlp()
        params = list(model.parameters())
        model[2].register_full_backward_hook(lambda m, gi, go: log.append(("module", _running())))
        model[2].register_full_backward_pre_hook(lambda m, go: log.append(("module pre", _running())))
        params[0].register_hook(lambda g: log.append(("leaf", _running())))
        params[1].register_post_accumulate_grad_hook(lambda p: log.append(("post accumulate", _running())))

        def step():
            h = model[1](model[0](torch.randn(4, 6)))
            h.register_hook(lambda g: log.append(("tensor", _running())))
            out = model[4](model[3](model[2](h))).exp()
            out.grad_fn.register_prehook(lambda g: log.append(("pre", _running())))
            out.grad_fn.register_hook(lambda gi, go: log.append(("post", _running())))
            out.sum().backward()
        return params, step

    log = run_both(build)
    assert all(name is not None for _, name in log) and len(log) == 3 * 7, log


def test_autograd_debug_logging_names_each_node(caplog):
    # torch's autograd DEBUG log registers a pre-hook on every node that names the
    # node running (torch.autograd.graph): captured like any pre-hook, eager's lines.
    import re
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(4, 6)

    def lines():
        caplog.clear()
        with caplog.at_level("DEBUG", logger="torch.autograd.graph"):
            model(x).sum().backward()
        return [re.sub(r" at 0x[0-9a-f]+", "", r.getMessage()) for r in caplog.records
                if r.name == "torch.autograd.graph"]

    eager = lines()
    with gradfx.compiled_autograd() as session:
        got = [lines() for _ in range(2)]
    assert eager and "None" not in eager[0]
    assert got == [eager, eager]
    assert session.stats["captures"] == 1 and session.stats["cache_hits"] == 1


def test_a_nodes_post_hooks_call_runs_as_that_node_and_restores_the_one_before_on_errors():
    """The compiled part's call of a node's whole post-hook list (the eager backend's graphs
    call it for DDP's reducer hooks): the hooks get eager's arguments, and while they run
    torch._C._current_autograd_node() answers the node, as the engine's running node; after
    them the one before, also where a hook raised (a stale answer would reach the next
    backward's hooks)."""
    from gradfx.capture import native
    from gradfx.capture.runtime import hook_ops
    if native.module() is None:
        pytest.skip(f"gradfx's compiled part is not loaded: {native.reason()}")
    w = torch.ones(3, requires_grad=True)
    acc = w.view_as(w).grad_fn.next_functions[0][0]
    seen, raising = [], []

    def hook(grad_inputs, grad_outputs):
        seen.append((torch._C._current_autograd_node(), grad_inputs, [g.tolist() for g in grad_outputs]))
        if raising:
            raise ValueError("raised by the hook")

    acc.register_hook(hook)
    outer = w.sum().grad_fn
    with hook_ops.graph_task(lambda: set(), keep_graph=False):
        hook_ops.call_node_post_hooks(acc, (torch.full((3,), 2.0),))
        assert seen == [(acc, (), [[2.0, 2.0, 2.0]])]
        assert torch._C._current_autograd_node() is None
        raising.append(True)
        for running in (None, outer):  # no node running around the call, then one
            previous = hook_ops.running_node(running)
            try:
                with pytest.raises(ValueError, match="raised by the hook"):
                    hook_ops.node_post_hooks_native()(acc, (torch.ones(3),))
                assert seen[-1][0] is acc
                assert torch._C._current_autograd_node() is running
            finally:
                hook_ops.done_running(previous)
