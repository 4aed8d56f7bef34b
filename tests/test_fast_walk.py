"""The generated cache-hit walker returns exactly what the generic walk returns.

Every test runs twice: with the walker's reads as gradfx's compiled part does some of
them (capture/native/walk.cpp), and with Python alone (the reference, as where the
compiled part is not loaded).
"""

import gc
import inspect
import re

import pytest
import torch
import torch.nn as nn

from torch.utils.checkpoint import checkpoint

import gradfx
from gradfx.capture import native
from gradfx.capture.graph import fast_walk, hooks
from gradfx.capture.graph.walk import walk_backward
from gradfx.capture.run import self_check
from gradfx.capture.run.cache import cache
from helpers import Double, run_both, snap


@pytest.fixture(autouse=True, params=["compiled reads", "python reads"])
def fresh(request, monkeypatch):
    if request.param == "python reads":
        monkeypatch.setattr(native._state, "module", None)
        monkeypatch.setattr(native._state, "reason", "switched off by the test")
    elif native.module() is None:
        pytest.skip(f"no compiled part: {native.reason()}")
    gradfx.reset()
    yield
    gradfx.reset()


def test_the_walker_reads_as_its_variant_says(request):
    """The compiled variant reads input metadata in C++; the Python one does not."""
    torch.manual_seed(0)
    model = MODELS["mlp"][0]()
    with gradfx.compiled_autograd():
        model(torch.randn(4, 8)).sum().backward()
    source = _walker().source
    compiled = request.node.callspec.params["fresh"] == "compiled reads"
    for call in ("native_metas(", "native_structure(", "native_saved(", "HeldByNode("):
        assert (call in source) == compiled, call
    assert ("next_functions" in source) != compiled


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2)), (4, 8)),
    "shared": (lambda: nn.Sequential(*[nn.Linear(4, 4)] * 3), (2, 4)),
    "cnn": (lambda: nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten()), (2, 3, 6, 6)),
    "transformer": (lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), (2, 5, 16)),
}


def _same_input(a, b):
    """The same input: the same object, or the same saved tensor (maybe another wrapper of it)."""
    if isinstance(a, torch.Tensor) and a is not b:
        assert (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)
    else:
        assert a is b


def _same_inputs(found, reference, nodes):
    """A walker's inputs as the reference's; where the walker ran as one C++ call, a node's
    own input is None (the session gives each node the graph reads: ``node_inputs``)."""
    assert len(found) == len(reference)
    node_ids = {id(x) for x in nodes}
    for x, y in zip(found, reference):
        if x is None and id(y) in node_ids:
            continue
        _same_input(x, y)


def _captured(name):
    """One of MODELS, built and captured: (model, input shape, the walker of its structure)."""
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make()
    with gradfx.compiled_autograd():
        model(torch.randn(*shape)).sum().backward()
    return model, shape, _walker()


def _walker():
    (found,) = [w for ws in fast_walk.walkers._by_root.values() for w in ws][:1]
    return found


@pytest.mark.parametrize("name", sorted(MODELS))
def test_walker_equals_generic_walk(name):
    model, shape, walker = _captured(name)
    loss = model(torch.randn(*shape)).sum()
    nodes, owned, inputs, sizes, seq = walker((loss,), (torch.ones(()),), (), True)
    generic = walk_backward((loss,), (torch.ones(()),), (), True)  # adopts what the walker took
    assert (generic.key, walker.structure[1]) == walker.structure
    assert generic.sizes == sizes
    _same_inputs(inputs[1:], generic.inputs[1:], generic.nodes)
    assert [n is m for n, m in zip(generic.nodes, nodes)] == [True] * len(nodes)
    assert generic.seq == seq


def test_walker_rejects_other_structures():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    with gradfx.compiled_autograd():
        b(a(torch.randn(2, 4))).sum().backward()
    walker = _walker()
    x = torch.randn(2, 4)
    for loss in [a(a(x)).sum(),                      # the same parameter twice: shared node
                 b(a(x)).relu().sum(),              # another node type
                 b(a(x.t().contiguous().t())).sum(),  # input stays, but a saved tensor is non-contiguous
                 b(a(torch.randn(3, 4))).sum()]:    # other sizes: accepted, sizes differ
        found = walker((loss,), (torch.ones(()),), (), True)
        if found is not None:
            assert found[3] != walk_backward((b(a(x)).sum(),), (torch.ones(()),), (), True).sizes


def test_hits_use_the_walker_and_stay_bitwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    reference = [p.detach().clone() for p in model.parameters()]
    ref_model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    with torch.no_grad():
        for p, r in zip(ref_model.parameters(), reference):
            p.copy_(r)
    calls = []
    original = fast_walk.instantiate

    def counting(*args):
        calls.append(1)
        return original(*args)
    fast_walk.instantiate = counting
    try:
        for _ in range(3):
            x = torch.randn(5, 8)
            ref_model(x).sum().backward()
            with gradfx.compiled_autograd():
                model(x).sum().backward()
    finally:
        fast_walk.instantiate = original
    assert len(calls) == 2
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p.grad, q.grad)


class _Taken:
    """Counts the backwards the generated walker took (instantiate is its last step)."""

    def __enter__(self):
        self.count = 0
        self.original = fast_walk.instantiate

        def counting(*args):
            self.count += 1
            return self.original(*args)
        fast_walk.instantiate = counting
        return self

    def __exit__(self, *exc):
        fast_walk.instantiate = self.original


class _Scaled(torch.autograd.Function):
    """An opaque custom Function (its backward is not traced) that saves tensors."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g * w, None  # w gets no gradient from here: the graph is traced that way


def _scenario(name, log):
    """(parameters, step) for graphs the walker now takes: hooks of every kind, several
    roots, autograd.grad(inputs=), backward(inputs=); hooks change between steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    params = list(model.parameters())
    step_no = [0]
    if name == "post_accumulate_hooks":
        _log_post_accumulate(params, log)
    if name == "module_hooks":
        model[2].register_full_backward_hook(lambda m, gi, go: log.append(("full", snap(gi), snap(go))))
        model[0].register_full_backward_pre_hook(lambda m, go: log.append(("pre", snap(go))))

    def step():
        k = step_no[0]
        step_no[0] += 1
        x = torch.randn(3, 6, requires_grad=name == "grad_inputs")
        if name == "checkpoint":  # saved tensors under checkpoint's hooks: gradfx unpacks for those nodes
            h = checkpoint(lambda t: model[1](model[0](t)), x, use_reentrant=False)
        elif name == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                h = model[1](model[0](x))
        else:
            h = model[1](model[0](x))
        if name == "tensor_hooks":
            h.register_hook(lambda g: log.append(("h", snap(g))))
            if k % 2:  # toggled between steps: a new structure, then back
                h.retain_grad()
        if name == "post_accumulate_hooks" and k % 2:  # one more on odd steps: another structure, then back
            handle = params[0].register_post_accumulate_grad_hook(lambda p: log.append(("extra", snap(p.grad))))
        if name == "node_hooks":
            h.grad_fn.register_prehook(lambda go: log.append(("node pre", snap(go))))
            h.grad_fn.next_functions[0][0].register_hook(lambda gi, go: log.append(("node post", snap(gi))))
        if name == "opaque_function":  # saved tensors left to the node; a None into a formula
            h = _Scaled.apply(h, model[0].weight.sum(1).tanh().unsqueeze(0).expand(3, 8))
        out = model[2](h)
        if name == "several_roots":
            torch.autograd.backward([out.sum(), h.square().sum()])
        elif name == "grad_inputs":
            grads = torch.autograd.grad(out.sum(), [x, params[0]])
            log.append(("grads", snap(grads)))
        elif name == "backward_inputs":
            out.sum().backward(inputs=[params[0], params[3]])
        else:
            out.sum().backward()
        if name == "tensor_hooks" and k % 2:
            log.append(("retained", snap(h.grad)))
        if name == "post_accumulate_hooks" and k % 2:
            handle.remove()
    return params, step


@pytest.mark.parametrize("name", ["module_hooks", "tensor_hooks", "post_accumulate_hooks", "node_hooks",
                                  "several_roots", "grad_inputs",
                                  "backward_inputs", "opaque_function", "checkpoint", "save_on_cpu"])
def test_walker_taken_on_every_kind_of_graph(name):
    # Toggled hooks: a second structure.  An opaque Function's None: the first backward
    # stops, the second captures the graph traced with that None.
    captures = 2 if name in ("tensor_hooks", "post_accumulate_hooks", "opaque_function") else 1
    if name in ("checkpoint", "save_on_cpu") and native.module() is not None:
        captures = 2  # the first backward learns how the hooks unpack, the second traces (graph.unpacked)
    assert self_check.refusal() is None  # now: its probes' cache hits take walkers of their own
    with _Taken() as taken:
        run_both(lambda log: _scenario(name, log), iterations=5, expect_captures=captures, strict=True)
    # Every cache hit went through the generated walker (3 steps of 4 for toggled hooks;
    # the walker found the graph of the step that captured the second one too).
    assert taken.count == (3 if name in ("tensor_hooks", "post_accumulate_hooks") else 4)


def _log_post_accumulate(params, log):
    for k, p in enumerate(params):
        p.register_post_accumulate_grad_hook(lambda p, k=k: log.append(("post_acc", k, snap(p.grad))))


def _walked(walk, model):
    """``walk`` (a walker, its lines or the one C++ call) of a new backward of ``model``."""
    return walk((model(torch.randn(3, 6)).sum(),), (torch.ones(()),), (), True)


def test_post_accumulate_hooks_are_walked_in_one_call(request):
    """Leaves whose only hooks are post-accumulate-grad hooks (an optimizer in the
    backward, DDP's Python reducer): the one C++ call reads their dicts and returns the
    callables the lines return, in registration order, and hands another count of them
    back to the lines (which find another structure)."""
    log = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    _log_post_accumulate(model.parameters(), log)
    model[0].weight.register_post_accumulate_grad_hook(lambda p: log.append(("second", snap(p.grad))))
    with gradfx.compiled_autograd():
        model(torch.randn(3, 6)).sum().backward()
    walker = _walker()
    compiled = request.node.callspec.params["fresh"] == "compiled reads"
    assert hasattr(walker, "program") == compiled

    for round_ in ("as captured", "one more hook", "removed again"):
        if round_ == "one more hook":
            extra = model[0].weight.register_post_accumulate_grad_hook(lambda p: None)
        if round_ == "removed again":
            extra.remove()  # the dict keeps its other entries: the captured count again
        expected = round_ != "one more hook"
        assert (_walked(walker.lines, model) is not None) == expected
        if compiled:  # another count of hooks: refused for sure (False), the lines spared
            one_call = _walked(lambda *a: native.module().program(*a[:2], walker.program), model)
            assert type(one_call) is tuple if expected else one_call is False
        loss = model(torch.randn(3, 6)).sum()
        found = walker((loss,), (torch.ones(()),), (), True)
        assert (found is not None) == expected
        if not expected:
            continue
        generic = walk_backward((loss,), (torch.ones(()),), (), True)
        _same_inputs(found[2][1:], generic.inputs[1:], generic.nodes)
        hooks_found = [x for x in found[2] if inspect.isfunction(x)]
        registered = [h for p in model.parameters() for h in p._post_accumulate_grad_hooks.values()]
        assert sorted(map(id, hooks_found)) == sorted(map(id, registered))
        first, second = model[0].weight._post_accumulate_grad_hooks.values()
        assert hooks_found.index(first) + 1 == hooks_found.index(second)  # registration order


def test_whether_a_hook_is_ddps_reducer_alone_is_part_of_the_structure(monkeypatch, request):
    """The key records, per post-accumulate-grad hook, whether it is DDP's Python-reducer
    hook without comm hooks (a compiled graph may run those calls later than eager).  The
    one C++ call returns the callables and the walker asks it of them: where the answer
    changed (a comm hook registered since), the lines, the call's walker and the generic
    walk all find another structure; changed back, the captured one again."""
    from gradfx.capture.graph import distributed
    alone = set()  # ids of the hooks that stand for DDP's, alone
    monkeypatch.setattr(distributed, "reducer_hook_alone", lambda hook: id(hook) in alone)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    log = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: log.append(snap(p.grad)))
    reducer = next(iter(model[0].weight._post_accumulate_grad_hooks.values()))
    alone.add(id(reducer))
    with gradfx.compiled_autograd():
        model(torch.randn(3, 6)).sum().backward()
    walker = _walker()
    assert hasattr(walker, "program") == (request.node.callspec.params["fresh"] == "compiled reads")

    for round_ in ("as captured", "a comm hook since", "gone again"):
        if round_ == "a comm hook since":
            alone.clear()
        if round_ == "gone again":
            alone.add(id(reducer))
        expected = round_ != "a comm hook since"
        assert (_walked(walker.lines, model) is not None) == expected
        assert (_walked(walker, model) is not None) == expected
        key = walk_backward((model(torch.randn(3, 6)).sum(),), (torch.ones(()),), (), True).key
        assert (key == walker.structure[0]) == expected  # (the key, the pipeline's)


# One graph structure, differentiated in every way a caller can: the walker generated
# for one kind of call must never answer another (a backward reusing an autograd.grad
# graph would return nothing and write .grad; inputs= lists of other lengths would
# read past the end).
_CALLS = {
    "grad[y, z]": lambda loss, y, z: torch.autograd.grad(loss, [y, z]),
    "grad[z, y]": lambda loss, y, z: torch.autograd.grad(loss, [z, y]),
    "grad[y]": lambda loss, y, z: torch.autograd.grad(loss, [y]),
    "backward": lambda loss, y, z: loss.backward(),
    "backward(inputs=[y, z])": lambda loss, y, z: loss.backward(inputs=[y, z]),
    "backward(inputs=[z])": lambda loss, y, z: loss.backward(inputs=[z]),
    "backward([loss, y2])": lambda loss, y, z: torch.autograd.backward([loss, (y * 2).sum()]),
}


def _differentiate(first, second, engine):
    torch.manual_seed(0)
    y = torch.randn(2, 4, requires_grad=True)
    z = torch.randn(2, 4, requires_grad=True)
    seen = []
    for name in (first, second, second):
        with engine():
            returned = _CALLS[name]((torch.sin(y) * z).sum(), y, z)
        seen.append((returned, None if y.grad is None else y.grad.clone(),
                     None if z.grad is None else z.grad.clone()))
    return seen


@pytest.mark.parametrize("first", sorted(_CALLS))
def test_walker_only_answers_its_own_kind_of_call(first):
    import contextlib
    for second in _CALLS:
        gradfx.reset()
        eager = _differentiate(first, second, contextlib.nullcontext)
        gfx = _differentiate(first, second, lambda: gradfx.compiled_autograd(backend="eager", strict=True))
        for step, (e, g) in enumerate(zip(eager, gfx)):
            assert (e[0] is None) == (g[0] is None) and len(e[0] or ()) == len(g[0] or ()), (first, second, step)
            for a, b in zip(list(e[0] or ()) + list(e[1:]), list(g[0] or ()) + list(g[1:])):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (first, second, step)


def test_walker_rejects_an_undefined_saved_tensor_where_one_was_saved():
    """Index lists of one structure may hold a tensor or None at a position (y[i, j] vs
    y[:, j]): the walker of the first must hand the second to the generic walk."""
    def build(log):
        y = torch.arange(1.0, 17).view(4, 4).requires_grad_()
        indices = [(torch.tensor([[1, 2], [3, 0]]), torch.tensor([[0, 1], [2, 3]])),
                   (slice(None), torch.tensor([2, 3]))]

        def step():
            y.grad = None
            for idx in indices:
                (y[idx] * 3).sum().backward()
                log.append(("grad", snap(y.grad)))
        return [y], step
    run_both(build, iterations=2, expect_captures=2, strict=True)


def test_walker_looks_up_hooked_nodes_first_and_probes_no_other(monkeypatch):
    # Node hooks are invisible on the node: the walker probes nodes for hook dicts until it
    # has found every live one.  Looking up the nodes that had hooks first, a cached
    # backward probes just those (one probe per dict here), not every node after them.
    from gradfx.capture.graph import hooks
    # Hook dicts of other live graphs (earlier tests') would count as not found: then every
    # node is probed, rightly.  This test's graph gets a registry of its own.
    monkeypatch.setattr(hooks, "_node_dicts", {})
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(6)])
    model[0].register_full_backward_hook(lambda m, gi, go: None)
    x = torch.randn(4, 8, requires_grad=True)
    for _ in range(2):
        with gradfx.compiled_autograd():
            model(x).sum().backward()
    probes = []
    original = hooks._probe_node
    monkeypatch.setattr(hooks, "_probe_node", lambda node: (probes.append(node), original(node))[1])
    loss = model(x).sum()
    dicts = len(hooks._node_dicts)
    with _Taken() as taken, gradfx.compiled_autograd():
        loss.backward()
    assert taken.count == 1
    assert len(probes) <= dicts


def test_floor_benchmark_measures_the_walkers_own_reads(monkeypatch):
    """bench/bench_walk_floor.py times the walker against its code without comparisons:
    that variant must collect exactly what the walker collects (else it measures
    something else) and compare nothing (else it is no floor)."""
    import os
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_walk_floor
    make, shape = MODELS["transformer"]
    torch.manual_seed(0)
    model = make()
    with gradfx.compiled_autograd():
        model(torch.randn(*shape)).sum().backward()
    walker = _walker()
    bare = bench_walk_floor.reads_only(walker)
    found = []
    # The lines, which the variant is made from (a walker may run them as one C++ call,
    # whose node inputs differ: made when asked for).
    for fn in (walker.lines, bare):
        loss = model(torch.randn(*shape)).sum()
        nodes, owned, inputs, sizes, seq = fn((loss,), (torch.ones(()),), (), True)
        found.append((sizes, [type(n) for n in nodes], [type(x) for x in inputs], len(seq)))
        for o in owned:
            if o is not None:
                o.release()
    assert found[0] == found[1]
    assert "return None" in walker.source and "return None" not in bare.source


def test_floor_benchmark_times_the_walker_the_session_calls(monkeypatch):
    """bench_walk_floor's training loop times each variant where the session calls the
    walker: every timed backward went through it, and the session's lookup is restored."""
    import os
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import bench_walk_floor
    find = fast_walk.walkers.find
    nodes, eager, times = bench_walk_floor.in_situ("mlp", 20)
    assert fast_walk.walkers.find == find
    assert nodes > 0 and eager > 0 and set(times) >= {"walker", "reads only"}
    assert all(t > 0 for t in times.values())


def _warm(kind):
    """(leaf, a fresh forward) for a structure the walker already has: hits go through it."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    lin = nn.Linear(3, 3)

    def forward():
        if kind == "output":  # exp saves its result: unpacked with the node as its grad_fn
            y = (w * 2).exp()
            return (y * 1.0).sum(), y
        if kind == "input":  # mul saves both inputs, the same tensor twice
            a = w * 2
            return (a * a).sum(), a
        h = lin(w.expand(2, 3)).tanh()  # addmm saves its input, tanh its result
        return (h * h).sum(), h
    for _ in range(2):
        with gradfx.compiled_autograd():
            forward()[0].backward()
    w.grad = None
    return w, forward


@pytest.mark.parametrize("kind", ["output", "input", "model"])
def test_a_retained_hit_leaves_the_graph_as_gradfx_or_eager_would(kind, request):
    """After a retain_graph hit the saved variables are gradfx's (Python reads: its unpack
    hook, no data) or left to their nodes as in eager (compiled reads: no hook at all), and
    further backwards, gradfx's and eager's, accumulate as eager's."""
    from gradfx.capture.graph.saved import is_ours
    w, forward = _warm(kind)
    loss, _ = forward()
    with _Taken() as taken, gradfx.compiled_autograd():
        loss.backward(retain_graph=True)
    assert taken.count == 1
    raws = [(getattr(node, name), getattr(node, "_saved_" + name[len("_raw_saved_"):]))
            for node in _graph_nodes(loss) for name in dir(node) if name.startswith("_raw_saved_")]
    defined = [r for r, value in raws if value is not None]  # an undefined one is never taken
    assert defined and all(r.unpack_hook is None for r, value in raws if value is None)
    if request.node.callspec.params["fresh"] == "compiled reads":
        assert all(r.unpack_hook is None for r in defined)
    else:
        assert all(is_ours(r.unpack_hook) and r.data is None for r in defined)
    with gradfx.compiled_autograd():
        loss.backward(retain_graph=True)  # the walker again, or the generic walk adopting
    loss.backward()  # eager's engine
    eager_w, eager_forward = _eager_twin(kind)
    ref = eager_forward()[0]
    for _ in range(3):
        ref.backward(retain_graph=True)
    assert torch.equal(w.grad, eager_w.grad)


def _eager_twin(kind):
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    lin = nn.Linear(3, 3)

    def forward():
        if kind == "output":
            y = (w * 2).exp()
            return (y * 1.0).sum(), y
        if kind == "input":
            a = w * 2
            return (a * a).sum(), a
        h = lin(w.expand(2, 3)).tanh()
        return (h * h).sum(), h
    return w, forward


def _graph_nodes(loss):
    seen, stack = [], [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or any(node is m for m in seen):
            continue
        seen.append(node)
        stack += [fn for fn, _ in node.next_functions]
    return seen


def _error(run):
    with pytest.raises(RuntimeError) as info:
        run()
    return str(info.value)


@pytest.mark.parametrize("kind", ["output", "input", "model"])
@pytest.mark.parametrize("second", ["eager", "gradfx"])
def test_after_a_hit_a_second_backward_raises_eagers_error(kind, second):
    """The saved tensors a hit took over are released as eager releases them: a second
    backward, eager's engine unpacking through gradfx's hook or gradfx's walk, says
    eager's words."""
    w, forward = _warm(kind)
    loss, _ = forward()
    with _Taken() as taken, gradfx.compiled_autograd():
        loss.backward()
    assert taken.count == 1
    grad = w.grad.clone()
    if second == "eager":
        message = _error(loss.backward)
    else:
        def again():
            with gradfx.compiled_autograd():
                loss.backward()
        message = _error(again)
    _, eager_forward = _eager_twin(kind)
    eager_loss = eager_forward()[0]
    eager_loss.backward()
    assert message == _error(eager_loss.backward)
    assert torch.equal(w.grad, grad)  # nothing written by the failed backward


@pytest.mark.parametrize("kind", ["output", "input", "model"])
@pytest.mark.parametrize("when", ["before the hit", "after a retain_graph hit"])
def test_a_saved_tensor_modified_in_place_raises_eagers_error(kind, when, request):
    """Before the hit the walker's unpack fails and the generic walk raises eager's
    error.  After one, gradfx's hook checks the version as eager would have (Python
    reads), or torch itself does (compiled reads: the node kept its tensors)."""
    w, forward = _warm(kind)
    loss, saved = forward()
    if when != "before the hit":
        with gradfx.compiled_autograd():
            loss.backward(retain_graph=True)
    with torch.no_grad():
        saved.mul_(10)

    def again():
        with gradfx.compiled_autograd():
            loss.backward()
    message = _error(again)
    _, eager_forward = _eager_twin(kind)
    eager_loss, eager_saved = eager_forward()
    if when != "before the hit":
        eager_loss.backward(retain_graph=True)
    with torch.no_grad():
        eager_saved.mul_(10)
    expected = _error(eager_loss.backward)
    if kind == "output" or when == "before the hit" or request.node.callspec.params["fresh"] == "compiled reads":
        assert message == expected
    else:  # gradfx's hook holds the saved input without its history: its creator goes unnamed
        assert ", which is output 0 of " in expected
        assert message == re.sub(r", which is output \d+ of \w+,", "", expected)


def test_the_walker_rejects_a_graph_wired_otherwise_with_the_same_node_types():
    """Same node types in the same discovery order, one edge to another node: a miss."""
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    for _ in range(2):
        with gradfx.compiled_autograd():
            ((a * 2) * (b * 3)).sum().backward()
    walker = _walker()
    x = b * 2  # the same types; the second product's inputs are swapped leaves
    loss = (x * (a * 3)).sum()
    assert walker((loss,), (torch.ones(()),), (), True) is not None  # a differently wired graph of one structure
    shared = a * 2
    loss = (shared * shared).sum()  # one MulBackward0 where two were: predicted-new node is an old one
    assert walker((loss,), (torch.ones(()),), (), True) is None


def test_a_leaf_whose_grad_dtype_or_requires_grad_changed_is_not_the_cached_leaf():
    """The leaf's grad_dtype and requires_grad are part of the key: a walker that read
    the leaf once must send a changed one to the generic walk (which recaptures), and the
    gradients stay eager's."""
    def build(log):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(3))
        b = torch.nn.Parameter(torch.randn(3))
        steps = [0]

        def step():
            k = steps[0]
            steps[0] += 1
            w.grad = b.grad = None
            w.grad_dtype = torch.float64 if k in (2, 3) else None
            loss = (w.exp() * b).sum()
            if k == 4:
                b.requires_grad_(False)  # after the forward: its AccumulateGrad stays in the graph
            loss.backward()
            b.requires_grad_(True)
            log.append(("grads", snap(w.grad), snap(b.grad)))
        return [w, b], step
    run_both(build, iterations=6, expect_captures=3, strict=True)


def test_new_sizes_of_a_known_structure_capture_after_the_walker_found_it():
    """The walker accepts a known structure at sizes with no graph yet: the capture that
    follows takes the saved tensors over (compiled reads left them to their nodes, so the
    session walks again) and traces them; gradients stay eager's at every size."""
    def build(log):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
        sizes = iter([4, 6, 4, 6, 5])

        def step():
            model.zero_grad(set_to_none=True)
            out = model(torch.randn(next(sizes), 6))
            out.register_hook(lambda g: log.append(("out", snap(g))))
            out.square().sum().backward()
        return list(model.parameters()), step
    with _Taken() as taken:
        run_both(build, iterations=5, expect_captures=3, dynamic=False, strict=True)
    assert taken.count == 4  # every backward after the first: the two new sizes and the two hits


# -- the walk as one C++ call (walk_program, native/program.cpp) -------------------------

def _compiled_only(request):
    if request.node.callspec.params["fresh"] != "compiled reads":
        pytest.skip("the one-call walk needs the compiled part")


def _same_walk(one_call, lines):
    """The one-call walk's answer and its lines': the same nodes (the call makes each
    node's object when asked for), owners, inputs (the same objects or the same saved
    tensors; a node's own input None, for the session to give where its graph reads it),
    sizes and sequence numbers."""
    assert (one_call is None) == (lines is None)
    if one_call is None:
        return
    (nodes, owned, inputs, sizes, seq), (nodes2, owned2, inputs2, sizes2, seq2) = one_call, lines
    assert type(nodes) is not list and type(nodes2) is list
    assert len(nodes) == len(nodes2) and all(x is y for x, y in zip(nodes, nodes2))
    assert [(type(o), getattr(o, "offsets", None), getattr(o, "mask", None)) for o in owned] == \
        [(type(o), getattr(o, "offsets", None), getattr(o, "mask", None)) for o in owned2]
    assert all(getattr(o, "node", None) is getattr(p, "node", None) for o, p in zip(owned, owned2) if o is not None)
    assert [len(getattr(o, "variables", ())) for o in owned] == [len(getattr(o, "variables", ())) for o in owned2]
    _same_inputs(inputs, inputs2, nodes2)
    assert sizes == sizes2 and seq == seq2


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_one_call_walk_answers_as_its_lines(name, request):
    _compiled_only(request)
    model, shape, walker = _captured(name)
    assert walker.lines is not walker and walker.program is not None
    run = native.module().program
    for batch in (shape[0], shape[0] + 1):  # the same sizes, then others: both accept, other sizes
        loss, grad = model(torch.randn(batch, *shape[1:])).sum(), torch.ones(())
        _same_walk(run((loss,), (grad,), walker.program), walker.lines((loss,), (grad,), (), True))
    # a gradient of another dtype: the lines' own check refuses it, so the call says so for sure
    loss = model(torch.randn(*shape)).sum()
    assert run((loss,), (torch.ones((), dtype=torch.float64),), walker.program) is False
    assert walker.lines((loss,), (torch.ones((), dtype=torch.float64),), (), True) is None
    # another structure under the same root type: both refuse
    loss = model[:-1](torch.randn(*shape)).sum() if isinstance(model, nn.Sequential) else \
        (model(torch.randn(*shape)) * 2).sum()
    assert run((loss,), (torch.ones(()),), walker.program) is None
    assert walker.lines((loss,), (torch.ones(()),), (), True) is None


def test_the_one_call_walk_takes_nodes_under_the_users_saved_tensor_hooks(request):
    """A checkpointed structure: the call finds the hooked saved variables, its walker tells the
    user's hooks from gradfx's in Python and makes their owners; it answers as the lines do."""
    _compiled_only(request)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))

    def loss_of():
        return checkpoint(model, torch.randn(3, 6), use_reentrant=False).sum()
    for _ in range(2):
        with gradfx.compiled_autograd():
            loss_of().backward()
    walker = _walker()
    assert walker.program is not None
    loss, grad = loss_of(), torch.ones(())
    assert native.module().program((loss,), (grad,), walker.program) is not None  # the call accepts it
    gc.collect()
    live = dict(hooks._node_dicts)  # node hooks of earlier tests' live graphs send a walker to its lines
    hooks._node_dicts.clear()
    try:
        assert not any(hooks.none_possible())
        found = walker((loss,), (grad,), (), True)
    finally:
        hooks._node_dicts.update(live)
    assert found is not None and type(found[0]) is not list  # the one-call walk answered
    _same_walk(found, walker.lines((loss,), (grad,), (), True))
    assert sum(type(o).__name__ == "ForeignOwned" for o in found[1]) > 0
    with gradfx.compiled_autograd():
        loss.backward()
    # Released by that backward: the walker leaves it to its lines, which refuse it, and the
    # backward raises eager's error.
    assert walker.lines((loss,), (grad,), (), True) is None
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with gradfx.compiled_autograd():
            loss.backward()


def test_the_one_call_walk_leaves_what_it_cannot_see_to_its_lines(request):
    """A saved value that differs, and a leaf that gained a tensor hook: the call answers
    None; the lines refuse the first and find the hook (the walker then captures)."""
    _compiled_only(request)
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)

    def loss_of(dim):
        return (x.softmax(dim) * 2).sum()
    with gradfx.compiled_autograd():
        loss_of(1).backward()
    walker = _walker()
    run = native.module().program
    assert run((loss_of(1),), (torch.ones(()),), walker.program) is not None
    loss = loss_of(0)  # SoftmaxBackward0's saved dim
    assert run((loss,), (torch.ones(()),), walker.program) is None
    assert walker.lines((loss,), (torch.ones(()),), (), True) is None
    x.register_hook(lambda g: g * 3)
    loss = loss_of(1)
    assert run((loss,), (torch.ones(()),), walker.program) is None
    eager_x = x.detach().clone().requires_grad_(True)
    eager_x.register_hook(lambda g: g * 3)
    x.grad = None
    with gradfx.compiled_autograd():
        loss.backward()
    (eager_x.softmax(1) * 2).sum().backward()
    assert torch.equal(x.grad, eager_x.grad)


def test_structures_with_node_hooks_or_traced_functions_keep_their_lines(request):
    _compiled_only(request)
    x = torch.randn(3, requires_grad=True)
    with gradfx.compiled_autograd():
        y = x * 2
        y.grad_fn.register_prehook(lambda gs: None)
        y.sum().backward()
    walker = _walker()
    assert walker.lines is walker and not hasattr(walker, "program")
    gradfx.reset()
    with gradfx.compiled_autograd():
        gradfx.traceable(_Traced).apply(x).sum().backward()
    walker = _walker()
    assert walker.lines is walker and not hasattr(walker, "program")


class _Traced(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.exp()


class _Gated(torch.autograd.Function):
    """An opaque custom Function whose saved tensor stays with its node (saved.Untouched)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clamp(min=0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * (x > 0)


class _Passed(_Gated):
    """Another class of the same node shape: the call's C++ type check cannot tell it from
    _Gated (both are PyNodes), the Python check does."""


def _layered(log, hooked=(0,), function=_Gated):
    """FSDP2's shape of graph: an opaque custom Function per layer and a tensor pre-hook on
    the chosen layers' outputs, registered anew on every forward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3))

    def loss_of(x):
        h = x
        for k, layer in enumerate(model):
            h = layer(function.apply(h) if k else h)
            if k in hooked:
                h.register_hook(lambda g, k=k: log.append((k, g.clone())))
        return h.square().sum()
    return model, loss_of


def test_the_one_call_walk_takes_opaque_functions_and_tensor_pre_hooks(request):
    """Custom Functions' nodes checked in Python from the call, and tensor pre-hooks found
    from the registry's side: the call answers as the lines do, hooks filled in."""
    _compiled_only(request)
    log = []
    model, loss_of = _layered(log, hooked=(0, 2))
    for _ in range(2):
        with gradfx.compiled_autograd():
            loss_of(torch.randn(4, 6)).backward()
    walker = _walker()
    assert walker.program is not None
    loss, grad = loss_of(torch.randn(4, 6)), torch.ones(())
    gc.collect()
    live = dict(hooks._node_dicts)  # node hooks of earlier tests' live graphs send a walker to its lines
    hooks._node_dicts.clear()
    try:
        found = walker((loss,), (grad,), (), True)
    finally:
        hooks._node_dicts.update(live)
    assert found is not None and type(found[0]) is not list  # the one-call walk answered
    _same_walk(found, walker.lines((loss,), (grad,), (), True))
    assert sum(type(o).__name__ == "Untouched" for o in found[1]) == 2
    assert sum(callable(x) and not isinstance(x, torch.Tensor) for x in found[2]) == 2  # the two hooks


@pytest.mark.parametrize("change", ["none", "hook elsewhere", "one more hook", "no hook", "other function"])
def test_hits_of_functions_and_tensor_pre_hooks_stay_eagers(change, request):
    """Every step bitwise eager's, hooks called as in eager; a step whose hooks or Function
    differ from the captured ones is not taken as a hit of that structure."""
    captures = 1 if change == "none" else 2

    def build(log):
        step_no = [0]
        model, plain = _layered(log)
        changed = {"hook elsewhere": dict(hooked=(1,)), "one more hook": dict(hooked=(0, 1)),
                   "no hook": dict(hooked=()), "other function": dict(function=_Passed)}.get(change, {})
        other = _layered(log, **changed)[1]

        def step():
            k = step_no[0]
            step_no[0] += 1
            model.zero_grad(set_to_none=True)
            (other if k == 2 else plain)(torch.randn(4, 6)).backward()  # the third step differs
        return list(model.parameters()), step
    with _Taken() as taken:
        run_both(build, iterations=5, expect_captures=captures, strict=True)
    assert taken.count == 5 - captures


def test_a_second_backward_through_an_opaque_function_raises_eagers_error_from_the_call(request):
    _compiled_only(request)
    model, loss_of = _layered([], hooked=())
    for _ in range(2):
        with gradfx.compiled_autograd():
            loss_of(torch.randn(4, 6)).backward()
    loss = loss_of(torch.randn(4, 6))
    with gradfx.compiled_autograd():
        loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        with gradfx.compiled_autograd():
            loss.backward()


def test_a_node_the_trace_ran_opaque_gets_its_object_from_the_one_call_walk(monkeypatch, request):
    """A builtin node whose formula the trace could not run stays a real call in the graph,
    which then reads the node's object: the one-call walk leaves node inputs None, and the
    session gives the graph those it reads.  Gradients stay bitwise eager's on every hit."""
    _compiled_only(request)
    from gradfx.capture.trace.tracer import _Tracer
    traced = _Tracer.run_traced

    def gelu_opaque(self, i, node, grads):
        return None if type(node).__name__ == "GeluBackward0" else traced(self, i, node, grads)
    monkeypatch.setattr(_Tracer, "run_traced", gelu_opaque)

    def build(log):
        model = MODELS["mlp"][0]()

        def step():
            model.zero_grad(set_to_none=True)
            model(torch.randn(4, 8)).sum().backward()
        return list(model.parameters()), step
    with _Taken() as taken:
        run_both(build, iterations=4, expect_captures=1, strict=True)
    assert taken.count == 3
    walker = _walker()
    assert walker.lines is not walker  # the structure's hits ran as one C++ call
    (entry,) = cache.entries(cache.key(walker.structure))
    assert entry.release_after and entry.node_inputs  # the graph calls the node: it reads its object


def test_a_repeated_walk_returns_its_last_sizes_while_they_repeat():
    """The one-call walk hands back the list it made last time while the sizes are equal
    (a new one with the new sizes when they change); the cache finds each size's entry."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    for _ in range(2):
        with gradfx.compiled_autograd(dynamic=False):
            model(torch.randn(4, 8)).sum().backward()
    walker = _walker()
    plan = getattr(walker, "program", None)
    # The one-call walk itself, where there is one (the walker may defer to its lines).
    walk = walker if plan is None else lambda *args: native.module().program(args[0], args[1], plan)
    found = []
    for batch in (4, 4, 5, 5, 4):
        loss = model(torch.randn(batch, 8)).sum()
        nodes, owned, inputs, sizes, seq = walk((loss,), (torch.ones(()),), (), True)
        found.append(sizes)
        for o in owned:
            if o is not None:
                o.release()
    assert [4 in s for s in found] == [True, True, False, False, True]
    assert [5 in s for s in found] == [False, False, True, True, False]
    if plan is not None:
        assert found[0] is found[1] and found[2] is found[3] and found[1] is not found[2]
    for batch in (4, 5, 4, 5):
        torch.manual_seed(batch)
        x = torch.randn(batch, 8)
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        with gradfx.compiled_autograd(dynamic=False):
            model(x).sum().backward()
        assert all(torch.equal(p.grad, e) for p, e in zip(model.parameters(), expected))


@pytest.mark.parametrize("hook", ["register_hook", "register_post_accumulate_grad_hook"])
def test_a_leaf_hook_added_after_capture_runs(hook):
    """A leaf's new tensor hook makes the cached walk defer to its lines, which see it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    for _ in range(2):
        with gradfx.compiled_autograd():
            model(torch.randn(4, 8)).sum().backward()
    calls = []
    getattr(model[0].weight, hook)(lambda t: calls.append(t.clone()))
    x = torch.randn(4, 8)
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    eager = calls.pop()
    model.zero_grad(set_to_none=True)
    with gradfx.compiled_autograd():
        model(x).sum().backward()
    assert len(calls) == 1 and torch.equal(calls[0], eager)


@pytest.mark.parametrize("kind", ["tensor", "prehook", "posthook", "retain"])
def test_a_hook_added_to_a_node_that_had_none_runs_while_others_are_live(kind):
    """Hooks live on one layer (as FSDP2's are on every one): a hook that comes later, of
    any kind, on a node that had none when captured is found by the cache-hit walk (it
    collects every node's hooks while any are live) and runs as in eager."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2))
    model[0].register_full_backward_hook(lambda m, gi, go: None)

    def backward(under_gradfx, add_hook):
        calls = []
        mid = model[2](model[1](model[0](torch.ones(4, 8))))  # the same graph, one tensor at hand
        out = model[4](model[3](mid)).sum()
        if add_hook:
            if kind == "tensor":
                mid.register_hook(lambda g: calls.append(g.clone()))
            elif kind == "prehook":
                mid.grad_fn.register_prehook(lambda gs: calls.append(gs[0].clone()))
            elif kind == "posthook":
                mid.grad_fn.register_hook(lambda gi, go: calls.append(go[0].clone()))
            else:
                mid.retain_grad()
        model.zero_grad(set_to_none=True)
        if under_gradfx:
            with gradfx.compiled_autograd():
                out.backward()
        else:
            out.backward()
        if kind == "retain" and add_hook:
            calls.append(mid.grad.clone())
        return calls, [p.grad.clone() for p in model.parameters()]

    for _ in range(2):
        backward(True, False)  # captured without that hook, then a cache hit
    eager = backward(False, True)
    got = backward(True, True)
    assert len(got[0]) == len(eager[0]) == 1 and torch.equal(got[0][0], eager[0][0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], eager[1]))


def test_saved_values_read_from_their_fields_tell_other_values_apart():
    """The one-call walk reads some saved values from the node's C++ field (native/
    fields.cpp) rather than through torch's getter: a transpose's dims, an add's and a
    matmul's alpha, their sizes.  The same structure with another value is another graph,
    and a known value a hit; the gradients stay eager's."""
    def build(log):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(4, 4, 4))
        b = torch.nn.Parameter(torch.randn(4, 4))
        m = torch.nn.Parameter(torch.randn(4, 4))
        variants = iter([(0, 1, 2), (0, 1, 2), (1, 2, 2), (0, 1, 3), (1, 2, 2), (0, 1, 2)])

        def step():
            d0, d1, alpha = next(variants)
            for p in (w, b, m):
                p.grad = None
            x = torch.add(w, w.sin(), alpha=alpha).transpose(d0, d1)
            y = torch.addmm(b, x.reshape(16, 4)[:4], m, alpha=alpha)
            (x.sum(0) * y).sum().backward()
            log.append(("grads", snap(w.grad), snap(b.grad), snap(m.grad)))
        return [w, b, m], step
    run_both(build, iterations=6, expect_captures=3, strict=True)
