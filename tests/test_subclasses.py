"""Tensor subclasses met in the walk fall back, never crash (and are never read).

A subclass's attributes go through its ``__torch_function__`` (or its own
properties): user code that may raise.  The walk checks ``type(t)`` of every
tensor it would read (leaves, saved tensors, root gradients, retain_grad
tensors), in the generic walk and in the generated cache-hit walker, and falls
back with one FallbackWarning naming the subclass (strict: Unsupported).
"""

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

import gradfx


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


class Passthrough(torch.Tensor):
    """Logs every call through ``__torch_function__``, and returns plain tensors: so a
    subclass leaf or saved tensor sits under a plain root."""

    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class Raising(torch.Tensor):
    """Any read through ``__torch_function__`` raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"Raising.__torch_function__({getattr(func, '__name__', func)})")


def leaf(cls, *shape, seed=0):
    torch.manual_seed(seed)
    return torch.Tensor._make_subclass(cls, torch.randn(*shape), True)


def plain_read(t):
    """``t.grad`` (cloned, as a plain tensor) without running the subclass's code."""
    with torch._C.DisableTorchFunctionSubclass():
        return None if t.grad is None else t.grad.clone().as_subclass(torch.Tensor)


def in_block(fn, **kwargs):
    """Run ``fn`` in a gradfx block: (session, FallbackWarning messages)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with gradfx.compiled_autograd("eager", **kwargs) as session:
            fn()
    return session, [str(w.message) for w in caught if issubclass(w.category, gradfx.FallbackWarning)]


def assert_equal(eager, got):
    assert len(eager) == len(got)
    for e, g in zip(eager, got):
        assert (e is None) == (g is None)
        assert e is None or torch.equal(e, g)


# -- per-sample gradients (ExpandedWeight, as opacus' grad_sample_mode="ew") --------

def per_sample_model(seed=0):
    torch.manual_seed(seed)
    return nn.Linear(4, 3), nn.Parameter(torch.full((), 0.5))


def per_sample_loss(linear, scale, seed):
    torch.manual_seed(100 + seed)
    return (call_for_per_sample_grads(linear)(torch.randn(5, 4)) * scale).sum()


def per_sample_grads(linear, scale):
    return [linear.weight.grad, linear.bias.grad, scale.grad,
            getattr(linear.weight, "grad_sample", None), getattr(linear.bias, "grad_sample", None)]


def test_per_sample_grads_are_captured_and_match_eager():
    """ExpandedWeight leaves: their accumulators (and the per-sample Functions) run as
    themselves, the rest is captured; .grad and grad_sample are eager's, bitwise."""
    eager_linear, eager_scale = per_sample_model()
    linear, scale = copy.deepcopy(eager_linear), copy.deepcopy(eager_scale)

    def steps(linear, scale):
        for step in range(2):
            linear.zero_grad(set_to_none=True)
            scale.grad = None
            for p in linear.parameters():
                p.grad_sample = None
            per_sample_loss(linear, scale, step).backward()
            yield [None if g is None else g.clone() for g in per_sample_grads(linear, scale)]

    eager = list(steps(eager_linear, eager_scale))
    got = []
    session, said = in_block(lambda: got.extend(steps(linear, scale)), strict=True)
    assert said == [] and session.stats["fallbacks"] == 0 and session.stats["captures"] == 1
    assert session.stats["cache_hits"] == 1
    assert eager[0][3] is not None and eager[0][3].shape == (5, 3, 4)  # grad_sample was written
    for e, g in zip(eager, got):
        assert_equal(e, g)


def test_per_sample_grads_capture_names_the_nodes_run_as_themselves():
    linear, scale = per_sample_model()
    graph = gradfx.capture(per_sample_loss(linear, scale, 0))
    assert any(label.startswith("torch::autograd::AccumulateGrad") for label in graph.opaque_nodes)
    assert all(g is None for g in per_sample_grads(linear, scale))  # a capture runs nothing


# -- a custom subclass as a leaf, a saved tensor, an intermediate -----------------

def run_both(program, **kwargs):
    """``program()`` -> (loss, tensors whose grads to compare), in eager and in a block:
    (eager grads, block grads, FallbackWarning messages, session)."""
    loss, tensors = program()
    loss.backward()
    eager = [plain_read(t) for t in tensors]
    loss, tensors = program()
    session, said = in_block(loss.backward, **kwargs)
    return eager, [plain_read(t) for t in tensors], said, session


def subclass_leaf(cls):
    def program():
        x = leaf(cls, 3, 4)
        w = torch.randn(4, 2, requires_grad=True)
        with torch._C.DisableTorchFunctionSubclass():
            loss = x.tanh().sum() + w.square().sum()  # tanh saves its (plain) result, not x
        return loss, (x, w)
    return program


def subclass_saved(cls):
    def program():
        torch.manual_seed(0)
        s = torch.Tensor._make_subclass(cls, torch.randn(3, 4))  # needs no grad, but is saved
        w = torch.randn(3, 4, requires_grad=True)
        with torch._C.DisableTorchFunctionSubclass():
            loss = (s * w).sum()
        return loss, (w,)
    return program


@pytest.mark.parametrize("cls", [Passthrough, Raising])
def test_a_subclass_leaf_accumulates_as_itself(cls):
    """Its accumulator runs as itself; gradfx reads nothing through the leaf's
    __torch_function__ (its hooks are read past it)."""
    Passthrough.calls = []
    eager, got, said, session = run_both(subclass_leaf(cls))
    eager_calls, Passthrough.calls = Passthrough.calls, []
    assert said == [] and session.stats["fallbacks"] == 0 and session.stats["captures"] == 1
    assert_equal(eager, got)
    loss, _ = subclass_leaf(cls)()
    with gradfx.compiled_autograd("eager", strict=True) as strict:
        loss.backward()
    assert strict.stats["fallbacks"] == 0
    assert Passthrough.calls == eager_calls == []  # gradfx read nothing through it


def _user_compiler(gm, example_inputs):
    return gm  # a user's backend: gets the graph in the form compilers trace (backends.traceable)


@pytest.mark.parametrize("failed_compile", [False, True])
@pytest.mark.parametrize("backend", ["eager", "aot_eager", _user_compiler])
@pytest.mark.parametrize("held", [False, True])
def test_a_subclass_leaf_takes_its_first_gradient_as_eager_does(held, backend, failed_compile):
    """Eager's AccumulateGrad makes the first gradient ``.grad`` itself where nothing else
    holds it, and copies it where something does (here a tensor hook that keeps it).  The
    real node, called from Python, always copies; a subclass can tell (DTensor's copy of a
    Partial gradient reduces it on torch 2.12), so gradfx takes the gradient for it.  In a
    user compiler's code, whose memory the compiler may reuse, ``.grad`` is a copy that
    nothing else sees.  Also after a failed torch.compile, whose frame evaluator stays
    installed and holds one more reference to the arguments of Python calls."""
    if failed_compile:
        def breaks(x):
            print(end="")  # fullgraph: dynamo cannot trace print(end=...)
            return x.sin()
        with pytest.raises(Exception):
            torch.compile(breaks, backend="eager", fullgraph=True)(torch.randn(3))

    def run(block):
        x = leaf(Passthrough, 3, 4)
        kept, seen = [], []
        with torch._C.DisableTorchFunctionSubclass():
            x.register_hook(lambda g: kept.append(g) if held else seen.append(g.data_ptr()))
            x.register_post_accumulate_grad_hook(lambda t: seen.append("accumulated"))
            loss = (x * torch.arange(12.0).view(3, 4)).sin().mul(2).exp().sum()  # x's gradient: computed
        if block:
            with gradfx.compiled_autograd(backend, strict=True):
                loss.backward()
        else:
            loss.backward()
        with torch._C.DisableTorchFunctionSubclass():
            grad = x.grad
            ptr = kept[0].data_ptr() if held else seen[0]
            return grad.clone(), grad.data_ptr() == ptr, type(grad), seen[-1]

    eager, got = run(False), run(True)
    assert torch.equal(eager[0], got[0]) and eager[2:] == got[2:]
    assert eager[1] is not held  # eager: the gradient itself, unless a hook keeps it
    assert got[1] == (eager[1] if isinstance(backend, str) else False)


@pytest.mark.parametrize("cls", [Passthrough, Raising])
def test_a_node_that_saved_a_subclass_runs_as_itself_and_the_rest_is_captured(cls):
    """The node runs as eager runs it (the real node, on its saved subclass); gradfx
    reads nothing through the subclass, in a block, in strict mode and in a capture."""
    Passthrough.calls = []
    eager, got, said, session = run_both(subclass_saved(cls))
    eager_calls, Passthrough.calls = Passthrough.calls, []
    assert said == [] and session.stats["fallbacks"] == 0 and session.stats["captures"] == 1
    assert_equal(eager, got)
    loss, _ = subclass_saved(cls)()
    with gradfx.compiled_autograd("eager", strict=True) as strict:
        loss.backward()
    assert strict.stats["captures"] + strict.stats["cache_hits"] == 1
    loss, _ = subclass_saved(cls)()
    assert [label.split(" ")[0] for label in gradfx.capture(loss).opaque_nodes] == ["MulBackward0"]
    assert Passthrough.calls == eager_calls == []  # gradfx read nothing through it


def test_subclass_intermediate_is_captured_where_never_read():
    """An intermediate the walk never reads (not saved, not retained) does not matter:
    the backward is captured, bitwise eager, its tensor hook included."""
    def program():
        x = torch.randn(3, 4, requires_grad=True)
        with torch._C.DisableTorchFunctionSubclass():
            s = x.as_subclass(Passthrough)  # AliasBackward0: saves nothing
            s.register_hook(lambda g: g * 3)
            loss = (s * 2).sum()
        return loss, (x,)
    Passthrough.calls = []
    eager, got, said, session = run_both(program)
    assert said == [] and session.stats["captures"] == 1
    assert_equal(eager, got)
    assert Passthrough.calls == []


@pytest.mark.parametrize("cls", [Passthrough, Raising])
def test_retained_subclass_falls_back(cls):
    def program():
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        with torch._C.DisableTorchFunctionSubclass():
            s = (x * 2).as_subclass(cls)
            s.retain_grad()
            loss = (s * s).sum()  # saves s: the leaf's check would catch it anyway
            t = (x * 3).as_subclass(cls)
            t.retain_grad()
            loss = loss + t.sum()  # t: only retained
        return loss, (x, s, t)
    eager, got, said, _ = run_both(program)
    assert len(said) == 1 and f"a tensor subclass ({cls.__name__})" in said[0]
    assert_equal(eager, got)
    # retained alone (t) is enough
    x = torch.randn(3, requires_grad=True)
    with torch._C.DisableTorchFunctionSubclass():
        t = (x * 3).as_subclass(cls)
        t.retain_grad()
        loss = t.sum()
    with pytest.raises(gradfx.Unsupported, match=rf"subclass \({cls.__name__}\) retaining grad, an output of"):
        with gradfx.compiled_autograd("eager", strict=True):
            loss.backward()
    assert x.grad is None


def test_subclass_root_gradient_falls_back():
    def program():
        torch.manual_seed(0)
        x = torch.randn(3, requires_grad=True)
        y = x * 2
        g = torch.Tensor._make_subclass(Passthrough, torch.arange(3.0))
        return y, g, x

    y, g, x = program()
    y.backward(g)
    eager = plain_read(x)
    y, g, x = program()
    session, said = in_block(lambda: y.backward(g))
    assert said == ["gradfx: running this backward on the eager engine: a tensor subclass (Passthrough) "
                    "as a root's gradient"]
    assert torch.equal(eager, plain_read(x))


def test_nested_tensor_falls_back():
    """Not a subclass, but a tensor without strided sizes: reading them would raise."""
    def program():
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nested tensors are a prototype
            a = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], requires_grad=True)
            b = torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)])
        return torch.nested.to_padded_tensor(a * b, 0.0).sum(), a

    loss, a = program()
    loss.backward()
    eager = a.grad.unbind()
    loss, a = program()
    session, said = in_block(loss.backward)
    assert len(said) == 1 and "a nested tensor" in said[0] and session.stats["fallbacks"] == 1
    assert_equal(eager, a.grad.unbind())


# -- the cache-hit walker --------------------------------------------------------

@pytest.mark.parametrize("where,cls", [("leaf", Raising), ("saved", Raising), ("retained", Raising),
                                       ("grad", Passthrough)])  # backward() reads a gradient's size
def test_cache_hit_walker_does_not_serve_a_subclass(where, cls):
    """A plain capture, then the same structure with a subclass: the generated walker
    hands it to the generic walk, which falls back (a subclass leaf or a node that saved
    one: which captures the node to run as itself); a plain one after hits the cache."""
    def program(sub):
        torch.manual_seed(0)
        a = torch.Tensor._make_subclass(sub if where in ("leaf", "saved") else torch.Tensor, torch.randn(3, 4),
                                        where == "leaf")  # saved: needs no grad, saved for w's
        w = torch.randn(3, 4, requires_grad=True)
        with torch._C.DisableTorchFunctionSubclass():
            out = a * w
            if where == "retained":
                a = out.as_subclass(sub)
                a.retain_grad()
                out = a * 2
        g = torch.Tensor._make_subclass(sub if where == "grad" else torch.Tensor, torch.arange(12.0).view(3, 4))
        return out, g, (a, w)

    results = {}
    for name, sub in [("plain", torch.Tensor), ("subclass", cls), ("plain again", torch.Tensor)]:
        out, g, tensors = program(sub)
        out.backward(g)
        eager = [plain_read(t) for t in tensors]
        out, g, tensors = program(sub)
        session, said = in_block(lambda: out.backward(g))
        results[name] = session.stats, said
        assert_equal(eager, [plain_read(t) for t in tensors])
    assert results["plain"][0]["captures"] == 1
    stats, said = results["subclass"]
    if where in ("saved", "leaf"):
        assert stats["fallbacks"] == stats["cache_hits"] == 0 and stats["captures"] == 1 and said == []
    else:
        assert stats["fallbacks"] == 1 and stats["cache_hits"] == stats["captures"] == 0
        assert len(said) == 1 and f"a tensor subclass ({cls.__name__})" in said[0]
    assert results["plain again"][0]["cache_hits"] == 1 and results["plain again"][1] == []


# -- what stays captured ---------------------------------------------------------

def test_parameters_and_buffers_are_captured():
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 3)
            self.shift = nn.Buffer(torch.randn(3))
            self.register_buffer("scale", torch.randn(3))

        def forward(self, x):
            return (self.linear(x) + self.shift) * self.scale

    torch.manual_seed(0)
    eager_model = Model()
    model = copy.deepcopy(eager_model)
    assert type(model.shift) is torch.Tensor and type(model.linear.weight) is nn.Parameter
    for step in range(2):
        torch.manual_seed(step)
        x = torch.randn(5, 4)
        eager_model(x).square().sum().backward()
        session, said = in_block(lambda: model(x).square().sum().backward(), strict=True)
        assert said == [] and session.stats["captures" if step == 0 else "cache_hits"] == 1
        assert_equal([p.grad for p in eager_model.parameters()], [p.grad for p in model.parameters()])


# -- gradients a hook or a custom backward returns at run time -------------------

def raising_copy(t):
    with torch._C.DisableTorchFunctionSubclass():
        return (t * 1).as_subclass(Raising)


class ReturnsSubclass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return raising_copy(g * 2)


def hooked_program(kind):
    def program():
        torch.manual_seed(0)
        x = torch.randn(3, 4, requires_grad=True)
        w = torch.randn(4, 2, requires_grad=True)
        y = ReturnsSubclass.apply(x) if kind == "function" else x * 2
        z = y @ w
        if kind == "tensor hook":
            y.register_hook(raising_copy)
        elif kind == "leaf hook":
            w.register_hook(raising_copy)
        elif kind == "pre-hook":
            z.grad_fn.register_prehook(lambda go: (raising_copy(go[0]),))
        elif kind == "post-hook":
            z.grad_fn.register_hook(lambda gi, go: tuple(raising_copy(g) for g in gi))
        elif kind == "retain_grad":
            y.register_hook(raising_copy)
            y.retain_grad()
        tensors = (x, w, y) if kind == "retain_grad" else (x, w)
        return z.tanh().sum(), tensors
    return program


@pytest.mark.parametrize("kind", ["tensor hook", "leaf hook", "pre-hook", "post-hook", "retain_grad", "function"])
def test_subclass_returned_at_run_time_computes_as_eager(kind):
    loss, tensors = hooked_program(kind)()
    loss.backward()
    eager = [plain_read(t) for t in tensors]
    loss, tensors = hooked_program(kind)()
    session, said = in_block(loss.backward)
    assert said == [] and session.stats["captures"] == 1
    assert all(type(t.grad) is torch.Tensor for t in tensors)  # as eager: never the hook's subclass
    assert_equal(eager, [plain_read(t) for t in tensors])
