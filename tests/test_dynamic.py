"""Symbolic sizes, guards and recapture: one graph for every batch size."""

import copy
import logging

import pytest
import torch
import torch.nn as nn

import gradfx
from helpers import assert_same, grads_of


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def mlp():
    return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.LayerNorm(16)) for _ in range(3)])


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))


class LSTMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def transformer():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), 2,
                                 enable_nested_tensor=False)


BATCHES = [2, 3, 4, 8, 16, 5]
MODELS = {
    "mlp": (mlp, lambda b: (b, 16)),
    "cnn": (cnn, lambda b: (b, 3, 12, 12)),
    "lstm": (LSTMHead, lambda b: (b, 5, 8)),
    "transformer": (transformer, lambda b: (b, 10, 32)),
}


def _run(make, shapes, dynamic):
    torch.manual_seed(0)
    eager = make()
    gfx = copy.deepcopy(eager)
    for shape in shapes:
        x = torch.randn(*shape)
        eager.zero_grad()
        gfx.zero_grad()
        eager(x).sum().backward()
        with gradfx.compiled_autograd(dynamic=dynamic) as s:
            gfx(x).sum().backward()
        assert s.stats["fallbacks"] == 0
        assert_same(grads_of(eager.parameters()), grads_of(gfx.parameters()))
    return gradfx.stats()["captures"]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("dynamic, most", [("auto", 2), (True, 1)])
def test_batch_sizes(name, dynamic, most):
    make, shape = MODELS[name]
    captures = _run(make, [shape(b) for b in BATCHES], dynamic)
    assert captures <= most if dynamic == "auto" else captures == most


@pytest.mark.parametrize("name, shape", [("lstm", lambda b, n: (b, n, 8)), ("transformer", lambda b, n: (b, n, 32))])
@pytest.mark.parametrize("dynamic, most", [("auto", 2), (True, 1)])
def test_batch_sizes_then_sequence_lengths(name, shape, dynamic, most):
    # Issue 15's shapes: the batch changes, then the length; "auto" recaptures once, at
    # the batch change, with the length symbolic too.
    shapes = [shape(b, 16) for b in (2, 3, 4, 8, 5)] + [shape(4, n) for n in (16, 32, 24, 40)]
    captures = _run(MODELS[name][0], shapes, dynamic)
    assert captures <= most if dynamic == "auto" else captures == most


def test_static_mode_captures_every_size():
    make, shape = MODELS["mlp"]
    assert _run(make, [shape(b) for b in [2, 3, 2, 4]], False) == 3


def test_transformer_sequence_lengths_one_graph():
    assert _run(transformer, [(8, n, 32) for n in [16, 32, 24, 40]], True) == 1


def test_guard_strings_and_recapture_reason(caplog):
    torch.manual_seed(0)
    model = mlp()
    with caplog.at_level(logging.INFO, logger="gradfx"):
        with gradfx.compiled_autograd() as s:
            for b in (4, 6, 7):
                model(torch.randn(b, 16)).sum().backward()
    assert s.stats["captures"] == 2 and s.stats["recaptures"] == 1 and s.stats["cache_hits"] == 1
    static, dynamic = s.graphs
    assert static.guards[-1].endswith("sizes as captured")
    batch = [g for g in dynamic.guards if g.startswith("where ") and "root gradient" not in g]
    symbols = [g.split()[0] for g in dynamic.guards if g.endswith(" >= 2")]  # e.g. "s52 >= 2"
    assert dynamic.guards[0] == f"{symbols[0]} >= 2"
    batch_symbol = next(s for s in symbols
                        if any(g.startswith("sizes[") and g.endswith(f"== {s}") for g in dynamic.guards))
    assert batch and batch_symbol in dynamic.graph_module.print_readable(print_output=False)
    assert any("recapture" in r.message and "changed 4 -> 6" in r.message for r in caplog.records)


def test_guard_failure_recaptures():
    # A dynamic graph's guard keeps sizes >= 2: a batch of 1 is a new capture.
    torch.manual_seed(0)
    model = mlp()
    with gradfx.compiled_autograd(dynamic=True) as s:
        for b in (4, 6, 1, 3):
            model(torch.randn(b, 16)).sum().backward()
    assert s.stats["captures"] == 2 and s.stats["recaptures"] == 1


def test_structure_miss_is_explained(caplog):
    x = torch.randn(3, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="gradfx"):
        with gradfx.compiled_autograd():
            x.pow(2.0).sum().backward()
            x.pow(3.0).sum().backward()
    assert any("new structure" in r.message and "node" in r.message for r in caplog.records)


@pytest.mark.parametrize("dynamic", [True, "auto"])
def test_attention_block_over_sequence_lengths(dynamic):
    # qkv split into heads, a key cache (cat with an empty tensor), SDPA with dropout:
    # a guard with an `or` once accepted sizes it had to reject (a crash or worse).
    from test_guards import Attention
    torch.manual_seed(0)
    eager = Attention()
    gfx = copy.deepcopy(eager)
    for length in (16, 32, 24, 40):
        x = torch.randn(2, length, 16)
        for model, block in ((eager, None), (gfx, gradfx.compiled_autograd(dynamic=dynamic, strict=True))):
            model.zero_grad()
            torch.manual_seed(length)
            loss = model(x).square().mean()
            if block is None:
                loss.backward()
            else:
                with block:
                    loss.backward()
        assert_same(grads_of(eager.parameters()), grads_of(gfx.parameters()))


def test_auto_from_a_batch_of_one():
    # 1 is captured static (broadcasting); the next size makes the batch symbolic.
    make, shape = MODELS["mlp"]
    assert _run(make, [shape(b) for b in (1, 2, 3, 4, 1)], "auto") == 2


def test_parameters_keep_static_sizes_until_one_changes():
    # dynamic=True keeps nn.Parameters' sizes static (as torch.compile does): a batch
    # change reuses the graph, a parameter of a new size recaptures with that size
    # symbolic, and a third size reuses the recapture.  Plain leaves stay symbolic.
    def step(width, batch, under):
        torch.manual_seed(width * 100 + batch)
        layer = nn.Linear(width, 4)
        data = torch.randn(batch, width, requires_grad=True)
        loss = torch.tanh(layer(data)).pow(2).sum()
        if under:
            with gradfx.compiled_autograd(dynamic=True, strict=True):
                loss.backward()
        else:
            loss.backward()
        return [layer.weight.grad, layer.bias.grad, data.grad]

    counts = []
    for width, batch in [(6, 3), (6, 5), (7, 5), (9, 2), (6, 8)]:
        assert_same(step(width, batch, False), step(width, batch, True))
        counts.append(gradfx.stats()["captures"])
    assert counts == [1, 1, 2, 2, 2]
    graph = gradfx.capture(nn.Linear(6, 4)(torch.randn(3, 6)).sum(), dynamic=True)
    guards = "; ".join(graph.guards)
    # the weight's sizes (and the activations' features, one size with them) are
    # guarded as constants: the batch is the one free symbol
    assert guards.count("where ") == 1 and "other sizes as captured" in guards


class _Heads(nn.Module):
    """Attention written with view/reshape between (batch, length, heads, head size)."""

    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = (q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5).softmax(-1)
        o = (a @ v).transpose(1, 2).reshape(b * t, d)
        return self.proj(o).view(b, t, d)


def test_a_size_relation_that_stops_holding_costs_a_recapture_never_a_result():
    # (B, 12) <-> (B*H, 12/H) with 12 a weight's size: the first capture takes the
    # moved factor H for a constant (as attention's heads are).  Here H changes: the
    # guard rejects the graph, the recapture sees both backwards and assumes nothing
    # of H, and every gradient stays bitwise equal to eager.
    def step(batch, heads, under):
        torch.manual_seed(batch * 10 + heads)
        layer = nn.Linear(5, 12)
        x = torch.randn(batch, 5)
        loss = (layer(x).view(batch * heads, 12 // heads).sin() * 3).sum()
        if under:
            with gradfx.compiled_autograd(dynamic=True, strict=True):
                loss.backward()
        else:
            loss.backward()
        return [layer.weight.grad, layer.bias.grad]

    captures = []
    for batch, heads in [(4, 2), (3, 2), (4, 3), (5, 4), (2, 6), (6, 3)]:
        assert_same(step(batch, heads, False), step(batch, heads, True))
        captures.append(gradfx.stats()["captures"])
    assert captures == [1, 1, 2, 2, 2, 2]  # a new batch fits; new heads recapture once


def test_reshapes_stay_symbolic_when_a_batch_equals_the_heads():
    # The first capture has batch 4 and 4 heads: the reshapes' dims are tied where they
    # correspond, never by an equal size alone, so one graph fits every later shape.
    torch.manual_seed(0)
    eager_model = _Heads()
    model = copy.deepcopy(eager_model)
    for b, t in [(4, 8), (2, 8), (8, 8), (3, 12), (5, 20)]:
        x = torch.randn(b, t, 32)
        eager_model.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        eager_model(x).square().mean().backward()
        with gradfx.compiled_autograd(dynamic=True, strict=True):
            model(x).square().mean().backward()
        assert_same(grads_of(eager_model.parameters()), grads_of(model.parameters()))
    assert gradfx.stats()["captures"] == 1


@pytest.mark.parametrize("shapes", [[(4, 4), (2, 4), (4, 2), (3, 5), (6, 6), (2, 2), (5, 3)],
                                    [(2, 3), (3, 2), (5, 5), (4, 7)]], ids=["equal-first", "distinct-first"])
def test_merges_splits_and_transposes_over_shapes(shapes):
    # Views that merge, split and transpose dims, first captured where the two dims are
    # equal (a tie by size alone would fix them equal) or distinct: one graph, bitwise.
    def program(n, m):
        torch.manual_seed(n * 10 + m)
        x = torch.randn(n, m, 6, requires_grad=True)
        y = x.view(n * m, 6).sin().view(n, m * 6).view(n, m, 2, 3).transpose(1, 2).reshape(n * 2, m * 3)
        return x, (y.reshape(n, m * 6).cos() * y.reshape(n, m * 6)).sum()

    for n, m in shapes:
        x, loss = program(n, m)
        loss.backward()
        expected = x.grad
        x, loss = program(n, m)
        with gradfx.compiled_autograd(dynamic=True, strict=True):
            loss.backward()
        assert torch.equal(expected, x.grad), (n, m)
    assert gradfx.stats()["captures"] == 1


def test_symbolic_graphs_carry_torchs_own_tensor_meta():
    # A symbolic trace answers "contiguous?" for tensors contiguous as written without
    # sympy: the metadata must be what torch's own function says, and the function
    # torch's again once the trace is over.
    from torch.fx.experimental import proxy_tensor
    from torch.fx.passes.shape_prop import _extract_tensor_metadata
    before = proxy_tensor._extract_tensor_metadata
    torch.manual_seed(0)
    model = _Heads()
    graph = gradfx.capture(model(torch.randn(3, 8, 32)).square().mean(), dynamic=True)
    assert proxy_tensor._extract_tensor_metadata is before is _extract_tensor_metadata
    # SymInt arithmetic is memoized for the trace only: torch's own methods again after it
    from torch.fx.experimental.sym_node import SymNode
    assert SymNode.mul.__qualname__ == "SymNode.mul" and SymNode.eq.__qualname__ == "SymNode.eq"
    checked = 0
    for node in graph.graph_module.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and "tensor_meta" in node.meta:
            assert node.meta["tensor_meta"] == _extract_tensor_metadata(val), node
            checked += 1
    assert checked > 50


def test_views_of_contiguous_and_of_transposed_gradients_over_sizes():
    # A view's gradient laid out contiguously is viewed directly (no fake reshape in the
    # trace); one that arrives transposed goes through reshape (a view here too).
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            b, t, d = x.shape
            h = self.lin(x).view(b * t, d)  # its backward views the transposed gradient
            z = h.t().reshape(d, b, t)  # its backward views a contiguous gradient
            return (z * z.sin()).sum()

    torch.manual_seed(0)
    eager_model = Model()
    model = copy.deepcopy(eager_model)
    graphs = []
    for shape in [(2, 3, 8), (3, 5, 8), (4, 4, 8), (5, 2, 8), (8, 8, 8)]:
        x = torch.randn(*shape, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        eager_model.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        eager_model(x).backward()
        with gradfx.compiled_autograd(dynamic=True, strict=True) as s:
            model(x2).backward()
        assert_same(grads_of(eager_model.parameters()), grads_of(model.parameters()))
        assert torch.equal(x.grad, x2.grad)
        graphs += s.graphs
    assert gradfx.stats()["captures"] == 1
    views = graphs[0].graph_module.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default)
    sources = {v.args[0].target for v in views}
    assert torch.ops.aten.t.default in sources and torch.ops.aten.add.Tensor in sources


def test_size_relations_that_fail_cost_speed_not_the_backward(monkeypatch):
    # Relations only spare the trace work: one kind's rule raising, or the whole
    # analysis raising, leaves a symbol per size and the same gradients.
    from gradfx.capture.trace import size_relations

    def broken(*args):
        raise IndexError("a layout this rule did not expect")

    for patch in ("rule", "all"):
        gradfx.reset()
        with monkeypatch.context() as m:
            if patch == "rule":
                m.setitem(size_relations.RELATIONS, "ViewBackward0", broken)
            else:
                m.setattr(size_relations, "relate", broken)
            for b in (4, 6):
                torch.manual_seed(b)
                eager_model = _Heads()
                model = copy.deepcopy(eager_model)
                x = torch.randn(b, 8, 32)
                eager_model(x).square().mean().backward()
                with gradfx.compiled_autograd(dynamic=True, strict=True):
                    model(x).square().mean().backward()
                assert_same(grads_of(eager_model.parameters()), grads_of(model.parameters()))
        assert gradfx.stats()["captures"] == 1, patch


def test_broadcast_gradients_reduced_over_sizes():
    # A gradient broadcast over batch and length reaches a parameter-sized or
    # size-1 input: the trace sums it to the input's shape as the engine does, for
    # every size the graph is reused for (a scale of shape (d,), a gate of (1, t, 1)).
    torch.manual_seed(0)
    scale = torch.randn(16, requires_grad=True)

    def program(b, t):
        torch.manual_seed(b * 100 + t)
        x = torch.randn(b, t, 16, requires_grad=True)
        gate = torch.randn(1, t, 1, requires_grad=True)
        return x, gate, ((x * scale).tanh() * gate).square().sum()

    for b, t in [(2, 3), (3, 5), (4, 4), (5, 2), (2, 7)]:
        x, gate, loss = program(b, t)
        want = torch.autograd.grad(loss, [x, gate, scale])
        x, gate, loss = program(b, t)
        with gradfx.compiled_autograd(dynamic=True, strict=True):
            got = torch.autograd.grad(loss, [x, gate, scale])
        assert all(torch.equal(w, g) for w, g in zip(want, got)), (b, t)
    assert gradfx.stats()["captures"] == 1


@pytest.mark.parametrize("dynamic", [False, True])
def test_ops_recorded_without_fake_dispatch_carry_torchs_metadata(dynamic):
    # t, transpose, detach, mm, bmm, elementwise ops, views, copies, sums and layer
    # norm's backward are recorded with a fake the tracer lays out itself: each must
    # have the sizes, strides and dtype torch's own kernel gives, and torch's
    # proxy_call is back once the trace is over.
    from torch.fx.experimental import proxy_tensor
    from gradfx.capture.trace import fast_ops, plain_layout
    before = proxy_tensor.proxy_call
    torch.manual_seed(0)
    graph = gradfx.capture(_Heads()(torch.randn(3, 8, 32)).square().mean(), dynamic=dynamic)
    norm, bias = nn.LayerNorm(32), torch.randn(32, requires_grad=True)
    x = torch.randn(3, 8, 32, requires_grad=True)
    h = nn.functional.silu(nn.functional.gelu(norm(x), approximate="tanh")) + bias  # bias: a sum over dims
    mixed = gradfx.capture((h[:, 0] * h.reshape(24, 32).sum(0)).square().mean(), dynamic=dynamic)
    assert proxy_tensor.proxy_call is before
    checked = set()
    for node in [*graph.graph_module.graph.nodes, *mixed.graph_module.graph.nodes]:
        if node.op != "call_function" or node.target not in fast_ops._LAYOUTS:
            continue
        args = torch.fx.node.map_arg(node.args, lambda a: a.meta["val"])  # in lists too (symbolic sizes)
        val = node.meta["val"]
        fake_mode = next(v for v in (val if isinstance(val, (tuple, list)) else (val,)) if v is not None).fake_mode
        with fake_mode:
            want = node.target(*args, **node.kwargs)
        def layout(t):  # as expressions: equal as written, not only at these sizes
            return [str(plain_layout.expr(x)) for x in (*t.shape, *t.stride())], t.dtype
        if isinstance(val, (tuple, list)):  # several outputs (layer norm's backward)
            assert [None if v is None else layout(v) for v in val] == \
                [None if w is None else layout(w) for w in want], node
        else:
            assert layout(want) == layout(val), node
        checked.add(node.target)
    aten = torch.ops.aten
    assert {aten.t.default, aten.mm.default, aten.bmm.default, aten.mul.Tensor, aten.mul.Scalar,
            aten._softmax_backward_data.default, aten.gelu_backward.default, aten.silu_backward.default,
            aten.native_layer_norm_backward.default, aten.select_backward.default, aten.sum.dim_IntList} <= checked


def test_symbolic_captures_in_two_threads_leave_torch_as_it_was():
    # Traces on two threads at once share gradfx's replacements of torch functions
    # (proxy_call, the tensor-metadata extractor, SymNode arithmetic): the results are
    # eager's, and once both are done torch has its own functions back.
    import threading
    from torch.fx.experimental import proxy_tensor
    from torch.fx.experimental.sym_node import SymNode
    before = (proxy_tensor.proxy_call, proxy_tensor._extract_tensor_metadata, SymNode.__dict__["mul"])
    barrier = threading.Barrier(2)
    results, errors = {}, []

    def work(k):
        try:
            torch.manual_seed(k)
            model = _Heads()
            x = torch.randn(2 + k, 8, 32)
            want = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
            barrier.wait()
            with gradfx.compiled_autograd(dynamic=True, strict=True):
                got = torch.autograd.grad(model(x).square().mean(), list(model.parameters()))
            results[k] = all(torch.equal(w, g) for w, g in zip(want, got))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == {0: True, 1: True}
    assert (proxy_tensor.proxy_call, proxy_tensor._extract_tensor_metadata, SymNode.__dict__["mul"]) == before
