"""A custom backward returning None where the captured graph traced a gradient.

Eager hands the next formulas an undefined gradient: builtin formulas pass None on,
hooks see None, a custom Function further on gets zeros, a leaf is left alone.
The captured graph stops where a traced formula would take the None and the rest
of the backward runs node by node (run.continuation): every gradient and hook call
must equal eager's, on the first backward and on cached ones.
"""

import pytest
import torch

import gradfx
from gradfx.capture.run import continuation

from .helpers import RetNone, assert_same


class SometimesNone(torch.autograd.Function):
    """None when the incoming gradient's sum is negative (a data-dependent choice)."""

    @staticmethod
    def forward(ctx, x, y):
        return x * y

    @staticmethod
    def backward(ctx, grad):
        return (None if grad.sum() < 0 else grad * 3), grad


class Doubles(torch.autograd.Function):
    """Gets zeros from the engine where its gradient is undefined (materialize_grads)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        return grad * 2 + 1


def _same_log(a, b):
    assert len(a) == len(b), f"{len(a)} calls vs {len(b)}: {a} vs {b}"
    for x, y in zip(a, b):
        if isinstance(x, (tuple, list)):
            assert isinstance(y, (tuple, list)), (x, y)
            _same_log(x, y)
        elif isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), (x, y)
            assert_same([x], [y])
        else:
            assert x == y, (x, y)


@pytest.fixture
def continuations(monkeypatch):
    """How many backwards went on node by node."""
    count = [0]
    finish = continuation.finish

    def counted(*args):
        count[0] += 1
        return finish(*args)
    monkeypatch.setattr(continuation, "finish", counted)
    return count


def _compare(program, iterations=3, seed=0, **kwargs):
    """program(log) -> tensors to compare; eager and gradfx (strict) run it alike."""
    gradfx.reset()
    session = None
    for it in range(iterations):
        expected_log, got_log = [], []
        torch.manual_seed(seed + it)
        expected = program(expected_log)
        torch.manual_seed(seed + it)
        with gradfx.compiled_autograd(backend="eager", strict=True, **kwargs) as session:
            got = program(got_log)
        assert_same(got, expected)
        _same_log(got_log, expected_log)
    return session


def test_none_into_a_builtin_formula_leaves_the_leaf_alone(continuations):
    def program(log):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        (RetNone.apply(x ** 2) + w).sum().backward()
        return [x.grad, w.grad]
    session = _compare(program)
    # The first backward stops; the next captures the graph with that gradient traced
    # as None, and the third runs it.
    assert continuations[0] == 1
    assert session.stats["cache_hits"] == 1 and session.stats["fallbacks"] == 0


def test_hooks_see_none_and_a_custom_function_further_on_gets_zeros(continuations):
    def program(log):
        x = torch.randn(2, requires_grad=True)
        a = Doubles.apply(x)
        b = a ** 2
        b.register_hook(lambda g: log.append(("tensor hook", g)))
        b.grad_fn.register_prehook(lambda g: log.append(("pre-hook", g)))
        b.grad_fn.register_hook(lambda gi, go: log.append(("post-hook", gi, go)))
        x.register_post_accumulate_grad_hook(lambda p: log.append(("accumulated", p.grad.clone())))
        RetNone.apply(b).sum().backward()
        return [x.grad]
    _compare(program)
    assert continuations[0] == 1


def test_fan_in_with_a_none_branch_sums_what_eager_sums(continuations):
    def program(log):
        x = torch.randn(4, 3, requires_grad=True)
        lin = torch.nn.Linear(3, 3)
        h = lin(x).tanh()
        left = RetNone.apply(h.sin())  # None into SinBackward0
        right = (h * 3).exp()
        (left.sum() + right.sum()).backward()
        return [x.grad, lin.weight.grad, lin.bias.grad]
    _compare(program)
    assert continuations[0] == 1


def test_none_only_sometimes_takes_each_path_with_one_graph(continuations):
    def program(log):
        x = torch.randn(5, requires_grad=True)
        y = torch.randn(5, requires_grad=True)
        z = SometimesNone.apply(x.exp(), y.sin()).cos()
        z.register_hook(lambda g: log.append(("hook", g)))
        z.sum().backward(torch.tensor(-1.0 if torch.rand(()) < 0.5 else 1.0))
        return [x.grad, y.grad]
    session = _compare(program, iterations=8)
    assert 0 < continuations[0] < 8
    assert session.stats["fallbacks"] == 0


def test_autograd_grad_returns_none_for_an_input_reached_only_through_none(continuations):
    def program(log):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        out = (RetNone.apply(x.exp()) * w).sum() + (w ** 2).sum()
        return list(torch.autograd.grad(out, [x, w], allow_unused=True))
    _compare(program)

    def refused(log):
        x = torch.randn(3, requires_grad=True)
        out = RetNone.apply(x.exp()).sum() + x.sum()
        (gx,) = torch.autograd.grad(out, [x])
        return [gx]
    _compare(refused)
    assert continuations[0] == 2


def test_retain_graph_backward_twice_through_the_continuation(continuations):
    def program(log):
        x = torch.randn(3, requires_grad=True)
        y = RetNone.apply(x.sin()) + x.cos()
        y.sum().backward(retain_graph=True)
        first = x.grad.clone()
        y.sum().backward()
        try:
            y.sum().backward()
        except RuntimeError as err:
            log.append(str(err)[:60])
        return [first, x.grad]
    _compare(program)
    assert continuations[0] == 1  # the second backward runs the graph traced with the None


def test_several_roots_and_a_module_hook(continuations):
    def program(log):
        net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
        net.register_full_backward_hook(lambda m, gi, go: log.append(("module", gi, go)))
        x = torch.randn(5, 3, requires_grad=True)
        out = net(x)
        a = RetNone.apply(out[:, 0].exp()).sum()
        b = out[:, 1].sum()
        torch.autograd.backward([a, b])
        return [x.grad] + [p.grad for p in net.parameters()]
    _compare(program)
    assert continuations[0] == 1


def test_symbolic_sizes(continuations):
    def program(log):
        n = int(torch.randint(2, 9, ()))
        x = torch.randn(n, 3, requires_grad=True)
        lin = torch.nn.Linear(3, 3)
        (RetNone.apply(lin(x).relu()) + lin(x)).sum().backward()
        return [x.grad, lin.weight.grad]
    _compare(program, iterations=4, dynamic=True)
    assert continuations[0] == 1


def test_create_graph(continuations):
    def program(log):
        x = torch.randn(3, requires_grad=True)
        y = RetNone.apply(x.sin()) + x ** 3
        (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
        (ggx,) = torch.autograd.grad(gx.sum(), x)
        return [gx.detach(), ggx]
    _compare(program)


def test_module_backward_pre_hook_and_an_unused_output(continuations):
    class Two(torch.nn.Module):
        def forward(self, x):
            return x.sin(), x.cos()

    def program(log):
        m = Two()
        m.register_full_backward_pre_hook(lambda mod, go: log.append(("pre", go)))
        m.register_full_backward_hook(lambda mod, gi, go: log.append(("hook", gi, go)))
        x = torch.randn(3, requires_grad=True)
        a, b = m(x)
        a.exp().sum().backward()
        return [x.grad]
    _compare(program)
    assert continuations[0] == 1


def test_node_post_hook_replacing_a_gradient_with_none(continuations):
    def program(log):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        y = x.exp() * w
        y.grad_fn.register_hook(lambda gi, go: (gi[0], None))  # w gets no gradient from here
        (y.sin().sum() + w.sum()).backward()
        return [x.grad, w.grad]
    _compare(program)


def test_autograd_grad_of_an_input_reached_only_through_none_raises_eagers_error():
    def program(log):
        x = torch.randn(3, requires_grad=True)
        try:
            torch.autograd.grad(RetNone.apply(x.exp()).sum(), [x])
        except RuntimeError as err:
            log.append(str(err))
        return []
    _compare(program)


def test_a_stop_is_logged_at_info_once_per_graph_and_place(caplog):
    gradfx.reset()
    with caplog.at_level("INFO", logger="gradfx"), gradfx.compiled_autograd():
        for _ in range(3):
            x = torch.randn(3, requires_grad=True)
            RetNone.apply(x.exp()).sum().backward()
    stops = [r for r in caplog.records if "runs node by node" in r.getMessage() and r.levelname == "INFO"]
    assert len(stops) == 1 and "ExpBackward0" in stops[0].getMessage()


def test_a_tensor_hook_returning_a_gradient_for_none_raises_eagers_error():
    def program(log):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        b = x.exp()
        b.register_hook(lambda g: torch.ones(3))
        w.register_hook(lambda g: log.append(("w", g)))
        try:
            (RetNone.apply(b).sum() + (w * 2).sum()).backward()
        except RuntimeError as err:
            log.append(str(err))
        return [x.grad, w.grad]
    _compare(program)


class NoneWhenTold(torch.autograd.Function):
    none = False

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return None if NoneWhenTold.none else grad * 2


def test_the_graph_follows_what_the_last_backward_found(continuations):
    # A stop switches the structure to the graph traced as that backward found it (None,
    # or a gradient again): each change of pattern costs one stop, no recapture after
    # both graphs exist.
    pattern = [True, True, False, False, True, True, False]
    gradfx.reset()
    session = gradfx.compiled_autograd(strict=True)
    for k, none in enumerate(pattern):
        NoneWhenTold.none = none
        torch.manual_seed(k)
        x = torch.randn(4, requires_grad=True)
        w = torch.randn(4, requires_grad=True)
        loss = (NoneWhenTold.apply(x.exp() * w) + w.sin()).sum()
        expected = torch.autograd.grad(loss, [x, w], retain_graph=True, allow_unused=True)
        with session:
            loss.backward()
        assert_same([x.grad, w.grad], list(expected))
    assert continuations[0] == 4
    assert session.stats["captures"] == 2 and session.stats["recaptures"] == 0


def test_a_node_whose_saved_tensor_the_graph_never_reads_runs_for_real(continuations):
    # grad() of x only: the traced graph drops w's formula and never reads MulBackward0's
    # saved x, yet the real node, run after the stop, unpacks it.
    def program(log):
        x = torch.randn(3, requires_grad=True)
        w = torch.randn(3, requires_grad=True)
        z = RetNone.apply(x * w).sum() + (x * 2).sum()
        return list(torch.autograd.grad(z, [x]))
    _compare(program)
    assert continuations[0] == 1


class _Subclass(torch.Tensor):
    """A plain tensor subclass: its leaf's accumulator runs as itself."""


@pytest.mark.parametrize("held", [False, True])
def test_a_subclass_leaf_after_a_stop_takes_its_first_gradient_as_eager_does(continuations, held):
    """The accumulator of a tensor-subclass leaf, run node by node after a stop: ``.grad`` is
    the gradient itself where nothing else holds it, as eager steals it (the real node,
    called from Python, would copy it; a DTensor's copy can differ from it), and a copy
    where a hook keeps it."""
    def run(block):
        torch.manual_seed(0)
        x = torch.Tensor._make_subclass(_Subclass, torch.randn(3), True)
        kept, seen = [], []
        with torch._C.DisableTorchFunctionSubclass():
            x.register_hook(lambda g: kept.append(g) if held else seen.append(g.data_ptr()))
            h = x * 2
            loss = RetNone.apply(h.sin()).sum() + (h * 3).sum()  # the None stops the graph at sin
        if block:
            with gradfx.compiled_autograd(backend="eager", strict=True):
                loss.backward()
        else:
            loss.backward()
        with torch._C.DisableTorchFunctionSubclass():
            ptr = kept[0].data_ptr() if held else seen[0]
            return x.grad.clone(), x.grad.data_ptr() == ptr

    gradfx.reset()
    eager, got = run(False), run(True)
    assert continuations[0] == 1
    assert torch.equal(eager[0], got[0])
    assert eager[1] is not held and got[1] == eager[1]
