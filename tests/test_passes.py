"""Each pass on small hand-built graphs, and the pipeline end to end."""

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import gradfx
from gradfx.capture.runtime import runtime_ops
from gradfx.capture.trace import fx_kinds as kinds
from gradfx.capture.trace.fx_kinds import BUFFER_SUM
from gradfx.capture.runtime.hook_ops import call_tensor_hook
from gradfx.reorder import resolve, run_pipeline
from gradfx.reorder.dce import eliminate_dead_code
from gradfx.reorder.memory import free_inputs_early, frees_inputs_early
from gradfx.reorder.schedule import early_side_effects
from gradfx.reorder.strip_detach import strip_detach
from helpers import compare_training, run_both, snap

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def _check_invariants(before: fx.Graph, after: fx.Graph, inputs):
    """Placeholders unchanged, no dangling users, same outputs, same side-effect order."""
    after.lint()
    assert [n.name for n in before.nodes if n.op == "placeholder"] == \
        [n.name for n in after.nodes if n.op == "placeholder"]
    for node in after.nodes:
        for user in node.users:
            assert user.graph is after
    effects = lambda g: [n.name for n in g.nodes if n.op == "call_function" and  # noqa: E731
                         kinds.kind_of(n) in kinds.SIDE_EFFECTS]
    assert effects(before) == effects(after)
    a = fx.GraphModule(torch.nn.Module(), before)(*[i.clone() for i in inputs])
    b = fx.GraphModule(torch.nn.Module(), after)(*[i.clone() for i in inputs])
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _graph(with_leaf=False):
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    leaf = g.placeholder("leaf") if with_leaf else None
    d = g.call_function(aten.detach.default, (w,))
    t = g.call_function(aten.t.default, (d,))
    unused = g.call_function(aten.sum.default, (t,))  # noqa: F841
    mm = g.call_function(aten.mm.default, (x, t))
    if with_leaf:
        g.call_function(runtime_ops.accumulate_grad, (leaf, mm, False))
    g.output((mm,))
    return g


def _copy(g):
    new = fx.Graph()
    out = new.graph_copy(g, {})
    new.output(out)
    return new


def test_strip_detach():
    g = _graph()
    before = _copy(g)
    strip_detach(g)
    assert not g.find_nodes(op="call_function", target=aten.detach.default)
    _check_invariants(before, g, [torch.randn(2, 3), torch.randn(4, 3)])


def test_dce_keeps_side_effects_removes_dead_views():
    g = _graph(with_leaf=True)
    before = _copy(g)
    eliminate_dead_code(g)
    assert not g.find_nodes(op="call_function", target=aten.sum.default)
    assert g.find_nodes(op="call_function", target=runtime_ops.accumulate_grad)
    leaf_value = torch.zeros(2, 4, requires_grad=True)
    g.lint()
    assert len(before.nodes) - len(g.nodes) == 1
    gm = fx.GraphModule(torch.nn.Module(), g)
    with torch.no_grad():
        gm(torch.randn(2, 3), torch.randn(4, 3), leaf_value)
    assert leaf_value.grad is not None


def test_early_side_effects_moves_accumulation_up_and_keeps_order():
    g = fx.Graph()
    grad, w, b_leaf, w_leaf = (g.placeholder(n) for n in ("grad", "w", "b_leaf", "w_leaf"))
    gb = g.call_function(aten.sum.dim_IntList, (grad, [0]))
    gw = g.call_function(aten.mm.default, (g.call_function(aten.t.default, (grad,)), w))
    gx = g.call_function(aten.mm.default, (grad, w))
    acc_b = g.call_function(runtime_ops.accumulate_grad, (b_leaf, gb, True))
    acc_w = g.call_function(runtime_ops.accumulate_grad, (w_leaf, gw, True))
    g.output((gx,))
    early_side_effects(g)
    order = list(g.nodes)
    assert order.index(acc_b) < order.index(gw) and order.index(acc_w) < order.index(gx)
    assert order.index(acc_b) < order.index(acc_w)


def test_early_side_effects_does_not_pass_a_reader_of_a_hooked_tensor():
    g = fx.Graph()
    grad, hook = g.placeholder("grad"), g.placeholder("hook")
    reader = g.call_function(aten.sum.default, (grad,))
    call = g.call_function(call_tensor_hook, (hook, grad))
    g.output((reader, call))
    early_side_effects(g)
    order = list(g.nodes)
    assert order.index(reader) < order.index(call)  # the hook may change grad in place


def test_free_inputs_early_marks_graph_for_boxed_calls():
    g = _graph()
    free_inputs_early(g)
    assert frees_inputs_early(g)


def test_pipeline_records_each_pass():
    g = _graph()
    records = run_pipeline(g, resolve(None))
    assert [r.name for r in records] == gradfx.list_passes()
    assert records[0].removed == 1 and records[1].removed == 1
    assert not any(n.target is aten.detach.default for n in g.nodes)
    # Counts only: a long block keeps its graphs, not a copy of their code per pass.
    assert all(not isinstance(v, str) or v == r.name for r in records for v in vars(r).values())


def test_unknown_pass_name_is_a_clear_error():
    with pytest.raises(ValueError, match="strip_detach"):
        gradfx.compiled_autograd(passes=["no_such_pass"])


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 2))


@pytest.mark.parametrize("passes", [[], ["dce"], ["early_side_effects"], None])
def test_any_pipeline_gives_eager_gradients(passes):
    compare_training(mlp, lambda: (torch.randn(4, 8),), passes=passes)


def test_custom_pass_callable_runs():
    seen = []
    compare_training(mlp, lambda: (torch.randn(4, 8),), passes=[lambda graph: seen.append(len(graph.nodes))])
    assert len(seen) == 1


def test_post_accumulate_hook_sees_fresh_grad_before_the_rest_of_backward():
    # The hook on the last layer's weight runs before the first layer's gradient exists.
    def build(log):
        model = mlp()
        params = list(model.parameters())
        params[-2].register_post_accumulate_grad_hook(
            lambda p: log.append(("post_acc", snap(p.grad), params[0].grad is None)))

        def step():
            for p in params:
                p.grad = None
            model(torch.randn(4, 8)).sum().backward()
        return params, step
    log = run_both(build)
    assert all(entry[2] for entry in log)


class _TwoBranches(nn.Module):
    """h feeds two branches: its gradient is the sum of theirs (a buffer sum), which eager
    makes in place into the first, a fresh tensor nothing else holds.  ``shared``: the
    first branch's gradient also reaches another input (an add hands one tensor to both),
    so that it is not the sum's alone."""

    def __init__(self, shared=False):
        super().__init__()
        self.shared = shared
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        left = self.b(h) + x if self.shared else self.b(h)
        return (left * self.c(h).sigmoid()).sum()


def _sums(graph):
    nodes = [n for n in graph.nodes if n.meta.get(BUFFER_SUM)]
    return [n.target for n in nodes]


@pytest.mark.parametrize("shared", [False, True])
def test_inplace_sums_sums_into_a_gradient_the_graph_alone_holds(shared):
    """The recorded buffer sum becomes aten.add_ where its first operand is a fresh tensor
    nothing else uses (eager adds in place there too); gradients bitwise either way."""
    torch.manual_seed(0)
    model = _TwoBranches(shared)
    x = torch.randn(4, 8, requires_grad=True)
    graph = gradfx.capture(model(x)).graph_module.graph
    assert aten.add_.Tensor in _sums(graph) or shared
    compare_training(lambda: _TwoBranches(shared), lambda: (torch.randn(4, 8, requires_grad=True),))


def test_inplace_sums_leaves_a_first_operand_read_later_or_elsewhere_alone():
    """In place where the first operand is a fresh tensor every other reader of which (and
    of its views) is an aten op before the sum; not where a reader comes after it (of the
    tensor or of a view of it), the reader is a hook, or the operand is an input or a view."""
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    mul = lambda: g.call_function(aten.mul.Tensor, (x, y))  # noqa: E731
    fresh, kept, read_first, viewed_first, viewed_later, hooked = (mul() for _ in range(6))
    early = g.call_function(aten.neg.default, (read_first,))  # read before its sum
    alias = g.call_function(aten.view.default, (viewed_first, [16]))
    early_view = g.call_function(aten.neg.default, (alias,))  # a view of it read before its sum
    alias_later = g.call_function(aten.view.default, (viewed_later, [16]))
    hook_call = g.call_function(_hook_call, (hooked,))  # a hook may keep it
    view = g.call_function(aten.t.default, (mul(),))
    firsts = (fresh, kept, x, view, read_first, viewed_first, viewed_later, hooked)
    sums = [g.call_function(aten.add.Tensor, (first, y)) for first in firsts]
    other = g.call_function(aten.neg.default, (kept,))  # read after its sum
    late_view = g.call_function(aten.neg.default, (alias_later,))  # its view read after the sum
    g.output((*sums, other, early, early_view, late_view, hook_call))
    fake = torch._subclasses.FakeTensorMode()
    with fake:
        vals = {"x": torch.empty(4, 4), "y": torch.empty(4, 4)}
    for n in g.nodes:
        if n.op == "placeholder" and n.name in vals:
            n.meta["val"] = vals[n.name]
        elif n.op == "call_function" and n.target is not _hook_call:
            with fake:
                n.meta["val"] = n.target(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args])
    for s in sums:
        s.meta[BUFFER_SUM] = True
    before = _copy(g)
    run_pipeline(g, resolve(["inplace_sums"]))
    assert [s.target is aten.add_.Tensor for s in sums] == [True, False, False, False, True, True, False, False]
    _check_invariants(before, g, [torch.randn(4, 4), torch.randn(4, 4)])


def _hook_call(t):
    """A stand-in for a hook's call in the graph (not an aten op): it may keep the tensor."""
    return t.clone()


class _PreNorm(nn.Module):
    """Residual blocks as a transformer's: the gradient at each norm's input is the sum of
    the residual path's and the branch's, and the branch also reads the gradient that the
    residual path hands on (an add gives both inputs one tensor)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList([nn.LayerNorm(8), nn.Linear(8, 8)]) for _ in range(2))

    def forward(self, x):
        for norm, linear in self.blocks:
            x = x + linear(norm(x)).relu()
        return x.square().sum()


def test_inplace_sums_sums_in_place_where_the_branch_read_the_gradient_first():
    torch.manual_seed(0)
    model = _PreNorm()
    x = torch.randn(4, 8, requires_grad=True)
    graph = gradfx.capture(model(x)).graph_module.graph
    sums = _sums(graph)
    assert sums and all(t is aten.add_.Tensor for t in sums), sums  # eager sums each in place too
    compare_training(_PreNorm, lambda: (torch.randn(4, 8, requires_grad=True),))
