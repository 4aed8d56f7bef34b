"""Custom autograd.Functions, module hooks, checkpointing, saved-tensor hooks, compiled regions."""

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import gradfx
from helpers import assert_same, compare_training, hooked_captures, run_both, snap


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


class ScaleMul(torch.autograd.Function):
    """save_for_backward, a non-tensor ctx attribute, None for a non-tensor input."""

    @staticmethod
    def forward(ctx, x, w, k):
        ctx.save_for_backward(x, w)
        ctx.k = k
        return x * w * k

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g * w * ctx.k if ctx.needs_input_grad[0] else None
        gw = (g * x * ctx.k).sum(0) if ctx.needs_input_grad[1] else None
        return gx, gw, None


class TwoOutputs(torch.autograd.Function):
    """Several outputs, one non-differentiable, grads not materialized."""

    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        idx = x.argmax(-1)
        ctx.mark_non_differentiable(idx)
        ctx.save_for_backward(x)
        return x.exp(), x.sin(), idx

    @staticmethod
    def backward(ctx, g_exp, g_sin, g_idx):
        x, = ctx.saved_tensors
        out = None
        if g_exp is not None:
            out = g_exp * x.exp()
        if g_sin is not None:
            out = g_sin * x.cos() if out is None else out + g_sin * x.cos()
        return out


class InPlaceDouble(torch.autograd.Function):
    """mark_dirty: modifies its input in place."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class SetupContextSquare(torch.autograd.Function):
    """setup_context style and once_differentiable."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return 2 * x * g


class Nested(torch.autograd.Function):
    """A backward that itself calls other Functions."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.tanh()

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        w = torch.ones_like(x)
        return ScaleMul.apply(g, 1 - x.tanh() ** 2, 1.0) * w


class StraightThrough(torch.autograd.Function):
    """A straight-through estimator: round forward, identity backward."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, g):
        return g


class FunctionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6))
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        h = ScaleMul.apply(self.a(x), self.w, 0.5)
        e, s, idx = TwoOutputs.apply(h)
        h = SetupContextSquare.apply(e[:, :3].contiguous() + s[:, 3:].contiguous() + idx[:, None])
        h = Nested.apply(torch.cat([h, StraightThrough.apply(h * 4) / 4], 1))
        h = InPlaceDouble.apply(h.clone())
        return self.b(h)


def test_custom_functions_opaque():
    compare_training(FunctionModel, lambda: (torch.randn(5, 6),), check_opaque=False)
    graph = gradfx.capture(FunctionModel()(torch.randn(5, 6)).sum())
    names = {label.split(" ")[0] for label in graph.opaque_nodes}
    assert names == {"ScaleMulBackward", "TwoOutputsBackward", "SetupContextSquareBackward",
                     "NestedBackward", "StraightThroughBackward", "InPlaceDoubleBackward"}, names


def test_custom_functions_traced():
    for cls in (ScaleMul, TwoOutputs, SetupContextSquare, StraightThrough, InPlaceDouble):
        gradfx.traceable(cls)
    try:
        compare_training(FunctionModel, lambda: (torch.randn(5, 6),), check_opaque=False)
        graph = gradfx.capture(FunctionModel()(torch.randn(5, 6)).sum())
        assert not any(label.startswith(("ScaleMul", "TwoOutputs", "StraightThrough"))
                       for label in graph.opaque_nodes), graph.opaque_nodes
    finally:
        for cls in (ScaleMul, TwoOutputs, SetupContextSquare, StraightThrough, InPlaceDouble):
            cls._gradfx_traceable = False


def test_fresh_ctx_objects_hit_the_cache():
    w = torch.randn(4, requires_grad=True)
    with gradfx.compiled_autograd() as s:
        for _ in range(3):
            ScaleMul.apply(torch.randn(2, 4), w, 3.0).sum().backward()
    assert s.stats["captures"] == 1 and s.stats["cache_hits"] == 2


def test_custom_backward_returning_none_for_needed_input():
    class DropsGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            return x + y

        @staticmethod
        def backward(ctx, g):
            return g, None

    def run(use_gfx):
        torch.manual_seed(0)
        x = torch.randn(3, requires_grad=True)
        y = torch.randn(3, requires_grad=True)
        ctx = gradfx.compiled_autograd() if use_gfx else warnings.catch_warnings()
        with ctx:
            DropsGrad.apply(x * 2, y).sum().backward()
        return [x.grad, y.grad]
    assert_same(run(False), run(True))


def test_module_full_backward_hooks():
    def build(log):
        model = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2))
        params = list(model.parameters())
        model[0].register_full_backward_hook(lambda m, gi, go: log.append(("bw0", snap(gi), snap(go))))
        model[2].register_full_backward_pre_hook(lambda m, go: log.append(("pre2", snap(go))))
        model[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))

        def step():
            model(torch.randn(3, 5, requires_grad=True)).sum().backward()
        return params, step
    run_both(build)


def test_checkpoint_non_reentrant_and_reentrant():
    calls = {"n": 0}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            calls["n"] += 1
            return torch.tanh(self.lin(x))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.b1, self.b2, self.out = Block(), Block(), nn.Linear(8, 1)

        def forward(self, x):
            x = checkpoint(self.b1, x, use_reentrant=False)
            x = checkpoint(self.b2, x, use_reentrant=True)
            return self.out(x)

    def build(log):
        model = M()
        params = list(model.parameters())

        def step():
            calls["n"] = 0
            model(torch.randn(4, 8, requires_grad=True)).sum().backward()
            log.append(("forward calls incl. recomputation", calls["n"]))
        return params, step
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        # The outer backward (twice where the first learns how the non-reentrant checkpoint's
        # hooks unpack: hooked_captures); the reentrant inner one runs on the engine.
        run_both(build, expect_captures=hooked_captures())


def test_saved_tensors_hooks_and_save_on_cpu():
    def build(log):
        model = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 1))
        params = list(model.parameters())

        def pack(t):
            log.append(("pack", tuple(t.shape)))
            return t

        def unpack(t):
            log.append(("unpack", tuple(t.shape)))
            return t

        def step():
            with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                y = model(torch.randn(3, 4))
            with torch.autograd.graph.save_on_cpu():
                y = y + model(torch.randn(3, 4))
            y.sum().backward()
        return params, step
    run_both(build, expect_captures=hooked_captures())


def test_queue_callback_runs_after_all_nodes():
    def build(log):
        lin = nn.Linear(3, 3)
        params = list(lin.parameters())

        def hook(g):
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: log.append(("callback", snap(lin.weight.grad), snap(lin.bias.grad))))
            return g

        def step():
            out = lin(torch.randn(2, 3))
            out.register_hook(hook)
            out.sum().backward()
        return params, step
    run_both(build)


def test_create_graph_is_captured_in_strict_mode():
    x = torch.randn(3, requires_grad=True)
    with gradfx.compiled_autograd(strict=True) as s:
        (g,) = torch.autograd.grad((x ** 3).sum(), x, create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), x)
    assert s.stats["captures"] == 1 and g.requires_grad
    assert torch.equal(h, torch.autograd.grad(torch.autograd.grad((x ** 3).sum(), x, create_graph=True)[0].sum(), x)[0])


def test_mixed_model_function_compiled_submodule_checkpoint():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.compiled = torch.compile(nn.Sequential(nn.Linear(8, 8), nn.GELU()), backend="aot_eager")
            self.c = nn.Linear(8, 8)
            self.w = nn.Parameter(torch.randn(8))

        def forward(self, x):
            h = ScaleMul.apply(self.a(x), self.w, 2.0)
            h = self.compiled(h)
            h = checkpoint(self.c, h, use_reentrant=False)
            return h.relu().sum(1)

    compare_training(M, lambda: (torch.randn(4, 8),), lambda out: out.mean(), check_opaque=False,
                     expect_captures=hooked_captures())


def test_torch_compile_inside_block_is_not_counted():
    # Compiling a forward traces joint graphs, calling backward APIs on fake tensors:
    # those calls are torch's own and go straight to the engine, uncounted.
    torch.manual_seed(0)
    model = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Tanh()), backend="aot_eager")
    with gradfx.compiled_autograd() as s:
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
    assert s.stats["captures"] + s.stats["cache_hits"] + s.stats["fallbacks"] == 2
    assert s.stats["fallbacks"] == 0


class _SavesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        x, = ctx.saved_tensors
        return grad * x


@pytest.mark.parametrize("dynamic, captures", [(True, 1), ("auto", 2)])
def test_custom_function_sizes_are_symbolic(dynamic, captures):
    # An opaque custom Function's sizes become symbols like every other node's.
    gradfx.reset()
    for n in (10, 100, 10, 15):
        torch.manual_seed(n)
        x = torch.randn(n, requires_grad=True)
        _SavesInput.apply(x).sin().sum().backward()
        expected = x.grad
        x.grad = None
        with gradfx.compiled_autograd(dynamic=dynamic, strict=True):
            _SavesInput.apply(x).sin().sum().backward()
        assert torch.equal(x.grad, expected)
    assert gradfx.stats()["captures"] == captures


def _returning(name, gradients):
    """A custom Function x * y whose backward returns ``gradients(grad)``."""
    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(lambda ctx, x, y: x * y),
        "backward": staticmethod(lambda ctx, grad: gradients(grad)),
    })


_TooManyGradients = _returning("_TooManyGradients", lambda g: (g, g, g))  # one more than the inputs
_TrailingNones = _returning("_TrailingNones", lambda g: (g * 2, g * 3, None, None))  # dropped as eager drops them


@pytest.mark.parametrize("fn", [_TooManyGradients, _TrailingNones])
def test_backward_result_count_as_eager(fn):
    def run(block):
        x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        try:
            with block():
                fn.apply(x, y).sum().backward()
        except RuntimeError as e:
            return str(e)
        return [x.grad, y.grad]

    import contextlib
    expected = run(contextlib.nullcontext)
    got = run(lambda: gradfx.compiled_autograd(strict=True))
    if isinstance(expected, str):
        assert got == expected and "incorrect number of gradients" in expected
    else:
        assert all(torch.equal(a, b) for a, b in zip(expected, got))


class WithSideOutputs(torch.autograd.Function):
    """Outputs without gradient edges: an int index tensor and a float tensor marked
    non-differentiable, a Python number; plus a differentiable float scalar."""

    @staticmethod
    def forward(ctx, x, materialize_non_diff):
        ctx._materialize_non_diff_grads = materialize_non_diff
        idx = x.argmax(-1)
        stats = x.detach().mean(-1, keepdim=True)
        ctx.mark_non_differentiable(idx, stats)
        ctx.save_for_backward(x)
        return x.exp(), idx, stats, x.shape[0], x.sum()

    @staticmethod
    def backward(ctx, g_exp, g_idx, g_stats, g_n, g_sum):
        ctx.log.append(("received",) + tuple(None if g is None else (g.shape, g.dtype, g) for g in
                                             (g_exp, g_idx, g_stats, g_n, g_sum)))
        x, = ctx.saved_tensors
        return g_exp * x.exp() + g_sum, None


@pytest.mark.parametrize("materialize_non_diff", [True, False])
def test_function_backward_receives_eager_zeros_for_outputs_without_edges(materialize_non_diff):
    """Eager passes zeros of the forward output's own shape and dtype for an output marked
    non-differentiable (None with _materialize_non_diff_grads=False) and None for a
    non-tensor output; their metadata entries are stand-ins that Python cannot read,
    so gradfx asks the engine.  Batch sizes change between steps (cache hits)."""

    def build(log):
        w = torch.randn(5, 3, requires_grad=True)

        def step():
            rows = 4 + len(log) % 3
            x = torch.randn(rows, 5) @ w
            out, idx, stats, n, total = WithSideOutputs.apply(x, materialize_non_diff)
            out.grad_fn.log = log
            out.sum().backward()
        return [w], step

    log = run_both(build, iterations=4, expect_captures=3, dynamic=False)  # the 4th step hits
    g_idx, g_stats, g_n = log[0][2:5]
    if materialize_non_diff:
        assert g_idx[0] == (4,) and g_idx[1] is torch.int64 and g_stats[0] == (4, 1)
    else:
        assert g_idx is None and g_stats is None
    assert g_n is None and log[0][5][0] == ()  # the unused differentiable scalar: zeros


def test_function_with_hooked_outputs_without_edges_falls_back():
    """Asking the engine would run the node's hooks a second time: that backward runs eagerly."""
    w = torch.randn(5, 3, requires_grad=True)
    x = torch.randn(4, 5)
    results = []
    for under_gradfx in (False, True):
        w.grad, calls, log = None, [], []
        out, *_ = WithSideOutputs.apply(x @ w, True)
        out.grad_fn.log = log
        out.register_hook(lambda g: calls.append(snap(g)))
        if under_gradfx:
            with pytest.warns(gradfx.FallbackWarning, match="not a differentiable tensor"):
                with gradfx.compiled_autograd(backend="eager"):
                    out.sum().backward()
        else:
            out.sum().backward()
        results.append((snap(w.grad), calls, log))
    assert_same(results[0][0], results[1][0])
    assert len(results[1][1]) == 1 and torch.equal(results[0][1][0], results[1][1][0])
    assert results[1][2][0][2][1] is torch.int64


class SavingMatmul(torch.autograd.Function):
    """x @ w, saving both; subclasses say what the backward does."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w


class ClearedOnAccess(SavingMatmul):
    """clear_saved_tensors_on_access: reading ctx.saved_tensors frees them."""

    clear_saved_tensors_on_access = True

    @staticmethod
    def backward(ctx, g):
        import weakref
        x, w = ctx.saved_tensors
        gx, gw = g @ w.t(), x.t() @ g
        ref = weakref.ref(w)
        del w
        ctx.log.append(("saved weight freed after del", ref() is None))
        return gx, gw


def test_function_clearing_saved_tensors_on_access():
    """gradfx must not read them first (that freed them under its raw handles: a segfault)."""

    def build(log):
        lin = nn.Linear(4, 4)
        w = torch.randn(4, 3, requires_grad=True)

        def step():
            y = ClearedOnAccess.apply(lin(torch.randn(5, 4)), w * 1.0)
            y.grad_fn.log = log
            y.sin().sum().backward()
            # Both raise; eager names the first node it runs, gradfx the first one it reads.
            log.append(("second backward raises", _error_of(lambda: y.sum().backward()) is not None))
        return [w] + list(lin.parameters()), step

    run_both(build)


def _error_of(fn):
    try:
        fn()
    except RuntimeError as err:
        return str(err).split("\n")[0]
    return None


class TransposedGrad(torch.autograd.Function):
    """Returns its gradient in column-major layout: same values, other strides."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g.t().contiguous().t()


class ExpandedGrad(torch.autograd.Function):
    """A sum over the last dimension whose backward returns an expanded (stride-0) gradient."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape = x.shape
        return x.sum(-1)

    @staticmethod
    def backward(ctx, g):
        return g.unsqueeze(-1).expand(ctx.shape)


@pytest.mark.parametrize("source", ["function", "expand", "hook"])
def test_gradients_laid_out_otherwise_by_python_reach_views(source):
    """A gradient from Python is traced as if contiguous; the formula after it reshapes
    it (traced as a view), which must copy at run time as eager's reshape does."""

    def build(log):
        w = torch.randn(4, 6, requires_grad=True)

        def step():
            x = w.view(6, 4).t().contiguous().t()  # ViewBackward0 will reshape a (6, 4) gradient
            if source == "function":
                y = TransposedGrad.apply(x)
            elif source == "expand":  # a (3, 8) gradient with strides (1, 0) into w.view's backward
                y = ExpandedGrad.apply(w.view(3, 8)).unsqueeze(-1).expand(3, 8).reshape(6, 4)
            else:
                y = x * 1
                y.register_hook(lambda g: log.append(("hook", g)) or g.t().contiguous().t())
            (y * torch.randn(6, 4)).sum().backward()
            log.append(("grad strides", w.grad.stride()))
        return [w], step

    run_both(build)


class ToFloat64(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.float64) * 2


def _as_given(gm, example_inputs):
    return gm  # a user's backend: gets the compiler-facing graph


@pytest.mark.parametrize("backend", ["eager", _as_given])
@pytest.mark.parametrize("through", ["function", "builtin"])
def test_leaf_grad_dtype_is_what_accumulation_casts_to(through, backend):
    """Tensor.grad_dtype: the leaf's gradient is cast to it (None: kept as it comes);
    changed between steps, it must not reuse a graph built for another."""
    dtypes = ["default", torch.float16, None, torch.float16, "default", torch.float64]

    def build(log):
        w = torch.randn(3, 4, requires_grad=True)

        def step():
            w.grad = None
            setting = dtypes[len(log)]
            w.grad_dtype = w.dtype if setting == "default" else setting
            y = ToFloat64.apply(w) if through == "function" else (w.double() * 3).float()
            (y * torch.randn(3, 4)).sum().backward()
            log.append(("grad", w.grad))
        return [w], step

    run_both(build, iterations=len(dtypes), expect_captures=4, backend=backend)


class MainGradLinear(SavingMatmul):
    """Megatron's pattern: the backward adds into an attribute of the saved weight."""

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        ctx.log.append(("saved weight is the weight", w is ctx.weight))
        w.main_grad.add_(x.t() @ g)
        return g @ w.t(), None


def test_opaque_function_backward_unpacks_the_saved_originals():
    """ctx.saved_tensors gives the saved tensors themselves, as in eager (gradfx's own
    unpack hook would hand back new tensor objects, and main_grad would go to a copy);
    without retain_graph they are released after the backward, with it they stay."""
    import weakref

    def build(log):
        lin = nn.Linear(3, 3)
        w = torch.randn(3, 3, requires_grad=True)
        w.main_grad = torch.zeros(3, 3)

        def step():
            h = lin(torch.randn(2, 3)) * 2
            y = MainGradLinear.apply(h, w)
            y.grad_fn.log, y.grad_fn.weight = log, w
            y.sum().backward(retain_graph=True)
            y.sum().backward()  # the saved tensors were retained
            log.append(("main_grad", w.main_grad.clone()))
            saved = weakref.ref(h)
            del h  # y's node is alive, its saved tensors released
            log.append(("saved activation freed", saved() is None))
            log.append(("third backward raises", _error_of(lambda: y.sum().backward())))
        return [w] + list(lin.parameters()), step

    log = run_both(build)
    assert ("saved weight is the weight", True) in log and ("saved activation freed", True) in log


def test_stand_in_metadata_follows_the_default_dtype():
    """The stand-in entry of a non-differentiable output has the default dtype of the
    time (float64 here), not float32: eager still passes zeros of the output's shape."""

    def build(log):
        w = torch.randn(5, 5, requires_grad=True)

        def step():
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch.float64)
            try:
                out, idx, stats, n, total = WithSideOutputs.apply(w * 1, True)
            finally:
                torch.set_default_dtype(previous)
            out.grad_fn.log = log
            out.sum().backward()
        return [w], step

    log = run_both(build)
    assert log[0][3][0] == (5, 1)  # the non-differentiable float output's own shape


def test_reentrant_checkpoint_refuses_grad_as_in_eager():
    """A reentrant checkpoint asks the engine whether it may run (not inside grad() or
    backward(inputs=)); gradfx answers for the backward it runs."""

    def build(log):
        a = torch.randn(2, 2, requires_grad=True)

        def step():
            b = checkpoint(torch.exp, a, use_reentrant=True).sum()
            log.append(("grad() raises", _error_of(lambda: torch.autograd.grad(b, (a,)))))
            b = checkpoint(torch.exp, a, use_reentrant=True).sum()
            log.append(("backward(inputs=) raises", _error_of(lambda: b.backward(inputs=[a]))))
            checkpoint(torch.exp, a, use_reentrant=True).sum().backward()
        return [a], step

    log = run_both(build, expect_captures=3)  # grad, backward(inputs=), backward; the inner one runs on the engine
    assert "incompatible with .grad()" in log[0][1]


class SavesNones(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(None, x, None)
        return x * x

    @staticmethod
    def backward(ctx, g):
        none_before, x, none_after = ctx.saved_tensors
        ctx.log.append(("saved Nones", none_before, none_after))
        return 2 * x * g


def test_opaque_function_saving_none_is_released_after_the_backward():
    """None entries among an opaque Function's saved tensors are skipped when they are
    released (torch refuses hooks on them); a second backward raises as in eager."""

    def build(log):
        w = torch.randn(5, 5, requires_grad=True)

        def step():
            y = SavesNones.apply(w * 1.0)
            y.grad_fn.log = log
            y.sum().backward()
            log.append(("second backward raises", _error_of(lambda: y.sum().backward()) is not None))
        return [w], step

    run_both(build)


def test_current_autograd_node_inside_a_custom_backward():
    """torch._C._current_autograd_node() names the node whose backward runs, as in eager
    (DebugMode and the engine's debug logging read it)."""
    seen = []

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            node = torch._C._current_autograd_node()
            seen.append((type(node).__name__, node is ctx))
            return grad * 2

    def run():
        x = torch.randn(3, requires_grad=True)
        Twice.apply(x).sin().sum().backward()

    run()
    with gradfx.compiled_autograd():
        for _ in range(2):
            run()
    assert seen == [("TwiceBackward", True)] * 3
    assert torch._C._current_autograd_node() is None
