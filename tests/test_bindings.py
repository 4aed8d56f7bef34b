"""The eager backend's public bindings (backends/bindings.py).

A call site of a graph that calls only aten ops and accumulations takes torch's public
binding (``torch.mm``, ``Tensor.view``) where, on meta twins of its arguments, the
binding makes exactly the aten calls the overload's C function makes; the graph then
runs without ``__torch_function__``, as eager's engine computes.  Elsewhere the C
function serves.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.fx as fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode

import gradfx
from gradfx.backends import bindings, builtin
from gradfx.capture import native
from helpers import assert_same, grads_of

aten = torch.ops.aten


def _site(op, *args, **kwargs):
    """A one-op graph calling ``op`` on placeholders for the tensors among ``args``."""
    graph = fx.Graph()
    vals = []

    def arg(a):
        if isinstance(a, torch.Tensor):
            p = graph.placeholder(f"x{len(vals)}")
            p.meta["val"] = a
            vals.append(a)
            return p
        return a
    node = graph.call_function(op, tuple(arg(a) for a in args), {k: arg(v) for k, v in kwargs.items()})
    graph.output(node)
    return node


def test_a_binding_is_taken_only_where_it_runs_the_same_overload():
    x, w = torch.randn(4, 3), torch.randn(3, 5)
    assert bindings.fastest(_site(aten.mm.default, x, w)).func is torch._C._VariableFunctions.mm
    assert bindings.fastest(_site(aten.view.default, x, [12])).func is torch.Tensor.view
    assert bindings.fastest(_site(aten.sum.dim_IntList, x, [0], True)).func is torch._C._VariableFunctions.sum
    # torch.add(x, 2) runs add.Tensor on a wrapped number, not add.Scalar: the C function serves
    assert bindings.fastest(_site(aten.add.Scalar, x, 2)) is None
    # a number where the schema takes a tensor is converted by each entry its own way
    assert bindings.fastest(_site(aten.mul.Tensor, x, 2.0)) is None
    # split's binding, never torch.split (a Python wrapper of it)
    split = bindings.fastest(_site(aten.split.Tensor, x, 2))
    assert split is None or split.func is torch._C._VariableFunctions.split


def test_symbolic_sizes_keep_the_c_function():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = mode.from_tensor(torch.randn(4, 3), symbolic_context=StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC]))
    assert type(x.shape[0]) is not int
    assert bindings.fastest(_site(aten.t.default, x)) is None


def _mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _code(compiled) -> str:
    """The code of what the eager backend returned (its module sits in the closures)."""
    found, todo = [], [compiled]
    while todo:
        fn = todo.pop()
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, fx.GraphModule):
            found.append(owner.code)
        todo += [c.cell_contents for c in getattr(fn, "__closure__", None) or () if callable(c.cell_contents)]
        todo += [f for f in (getattr(fn, "_boxed", None),) if f is not None]
        if isinstance(fn, functools.partial):  # run_without_torch_function's
            todo += [a for a in fn.args if callable(a)]
    (code,) = set(found)
    return code


class _Counting(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _plain_graph() -> fx.GraphModule:
    """mm of two inputs, its transpose, and the sum of its view: a graph that takes bindings."""
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"], b.meta["val"] = torch.empty(4, 3), torch.empty(3, 5)
    mm = graph.call_function(aten.mm.default, (a, b))
    mm.meta["val"] = torch.empty(4, 5)
    t = graph.call_function(aten.t.default, (mm,))
    t.meta["val"] = torch.empty(5, 4)
    flat = graph.call_function(aten.view.default, (mm, [20]))
    flat.meta["val"] = torch.empty(20)
    graph.output((graph.call_function(aten.sum.dim_IntList, (flat, [0], True)), t))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_graph_with_bindings_runs_without_torch_function():
    """As eager's engine computes: no __torch_function__ for the backward's ops, even with
    a mode on the stack while the graph runs (one a hook entered, say)."""
    compiled = builtin.eager(_plain_graph(), [])
    code = _code(compiled)
    assert "bindings_torch_mm(" in code and "bindings_Tensor_view(" in code, code
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    mode = _Counting()
    with mode:
        total, t = compiled(a, b)
    assert mode.calls == []
    assert torch.equal(total, aten.sum.dim_IntList(aten.mm.default(a, b).view(20), [0], True))
    assert torch.equal(t, aten.mm.default(a, b).t())


def test_a_plain_graph_calls_bindings_and_a_hooked_one_does_where_its_hooks_get_the_state_back(monkeypatch):
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(8, 16)
    code = _code(builtin.eager(gradfx.capture(model(x).sum()).graph_module, []))
    assert "bindings_torch_mm(" in code and "bindings_Tensor_view(" in code, code
    model[0].weight.register_hook(lambda g: g * 2)
    hooked = gradfx.capture(model(x).sum()).graph_module
    if native.module() is not None:
        code = _code(builtin.eager(hooked, []))
        assert "bindings_torch_mm(" in code and "_as_user(" in code, code
    # Without the compiled part (its as_user), a hooked graph keeps the C functions.
    monkeypatch.setattr(native, "module", lambda: None)
    code = _code(builtin.eager(hooked, []))
    assert "bindings_torch_" not in code and "bindings_aten_mm_default(" in code and "_as_user" not in code, code


class _Scale(torch.autograd.Function):
    log: list = []

    @staticmethod
    def forward(ctx, t):
        return t * 1.5

    @staticmethod
    def backward(ctx, g):
        _Scale.log.append(("backward", torch._C._is_torch_function_enabled()))
        return torch.mul(g, 1.5)


def _hooked_backward(model, x, log, under_gradfx: bool, *, raise_in_hook=False, around=contextlib.nullcontext):
    """A backward whose tensor hook, custom backward and post-accumulate hook each compute
    with torch (what a mode sees) and note whether torch functions are on."""
    _Scale.log = log

    def tensor_hook(g):
        log.append(("tensor hook", torch._C._is_torch_function_enabled()))
        if raise_in_hook:
            raise ValueError("from the hook")
        return torch.add(g, 1.0)

    def post_hook(p):
        log.append(("post hook", torch._C._is_torch_function_enabled()))
        torch.sum(p.grad)

    handles = [model[0].weight.register_post_accumulate_grad_hook(post_hook)]
    h = model(x)
    h.register_hook(tensor_hook)
    loss = _Scale.apply(h).square().sum()
    # The engine's entry, where Tensor.backward ends: a mode's handler of Tensor.backward would
    # run it with the mode off, and the backward would compute without it.
    engine = torch.autograd.variable.Variable._execution_engine
    seed = torch.ones_like(loss)
    try:
        with around():
            if under_gradfx:
                with gradfx.compiled_autograd(backend="eager", strict=True):
                    engine.run_backward((loss,), (seed,), False, False, (), True, True)
            else:
                engine.run_backward((loss,), (seed,), False, False, (), True, True)
    finally:
        for handle in handles:
            handle.remove()


def test_hooks_find_torch_functions_on_or_off_as_in_eager():
    """Handlers on, or off around the backward: the hooks and the custom backward find them
    so, as in eager, while the graph's own ops run with them off."""
    torch.manual_seed(0)
    eager = _mlp()
    gfx = copy.deepcopy(eager)
    x = torch.randn(8, 16)
    for around in (contextlib.nullcontext, torch._C.DisableTorchFunction, contextlib.nullcontext):
        logs = []
        for model, under in ((eager, False), (gfx, True)):
            model.zero_grad(set_to_none=True)
            log = []
            _hooked_backward(model, x, log, under, around=around)
            logs.append(log)
        assert logs[0] == logs[1] and len(logs[0]) == 3, logs
        assert all(on is (around is contextlib.nullcontext) for _, on in logs[0]), logs
        assert_same(grads_of(eager.parameters()), grads_of(gfx.parameters()))
    assert torch._C._is_torch_function_enabled()


def _seen_by_hook(log):
    def hook(t):
        log.append(torch._C._is_torch_function_enabled())
        return torch.add(t, 1.0)
    return hook


def test_a_hooked_graph_hides_its_ops_from_a_mode_and_shows_it_the_hooks():
    """A mode on the stack while the graph runs (one a hook entered, or one around a
    backward that gradfx found cached) sees what a hook computes, as eager's hooks would
    show it, and none of the graph's ops, as none of eager's engine's.  Without the
    compiled part the graph's ops keep the C functions, which a mode sees."""
    if native.module() is None:
        return
    log = []
    hook = _seen_by_hook(log)
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    a.meta["val"], b.meta["val"] = torch.empty(4, 3), torch.empty(3, 5)
    mm = graph.call_function(aten.mm.default, (a, b))
    mm.meta["val"] = torch.empty(4, 5)
    hooked = graph.call_function(hook, (mm,))
    hooked.meta["val"] = torch.empty(4, 5)
    flat = graph.call_function(aten.view.default, (hooked, [20]))
    flat.meta["val"] = torch.empty(20)
    graph.output((graph.call_function(aten.sum.dim_IntList, (flat, [0], True)),))
    compiled = builtin.eager(fx.GraphModule(torch.nn.Module(), graph), [])
    code = _code(compiled)
    assert "bindings_torch_mm(" in code and "hook_as_user(" in code, code
    x, y = torch.randn(4, 3), torch.randn(3, 5)
    expected = aten.sum.dim_IntList(aten.view.default(aten.add.Tensor(aten.mm.default(x, y), 1.0), [20]), [0], True)
    mode = _Counting()
    with mode:
        (seen,) = compiled(x, y)
    assert mode.calls == ["add"] and log == [True], (mode.calls, log)
    with torch._C.DisableTorchFunction():
        (off,) = compiled(x, y)
    (on,) = compiled(x, y)
    assert log == [True, False, True], log
    for out in (seen, off, on):
        assert torch.equal(out, expected)
    assert torch._C._is_torch_function_enabled()


def test_a_hook_that_raises_leaves_torch_functions_on():
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(8, 16)
    for under in (False, True):
        log = []
        try:
            _hooked_backward(model, x, log, under, raise_in_hook=True)
        except ValueError as err:
            assert "from the hook" in str(err)
        else:
            raise AssertionError("the hook's error was lost")
        assert log == [("backward", True), ("tensor hook", True)], log
        assert torch._C._is_torch_function_enabled() and not torch._C._is_torch_function_all_disabled()


def test_training_with_bindings_is_bitwise_eager():
    torch.manual_seed(0)
    eager = _mlp()
    gfx = copy.deepcopy(eager)
    for step in range(3):
        x = torch.randn(8 + step, 16)
        for model in (eager, gfx):
            model.zero_grad(set_to_none=True)
        eager(x).square().sum().backward()
        with gradfx.compiled_autograd(backend="eager", strict=True):
            gfx(x).square().sum().backward()
        assert_same(grads_of(eager.parameters()), grads_of(gfx.parameters()))


def test_the_check_is_made_once_per_argument_types_not_per_shape():
    bindings._verified.clear()
    for n in range(2, 12):
        assert bindings.fastest(_site(aten.mm.default, torch.randn(n, 3), torch.randn(3, n))) is not None
        assert bindings.fastest(_site(aten.view.default, torch.randn(n, 2), [2 * n])) is not None
    assert len(bindings._verified) == 2
