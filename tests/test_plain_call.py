"""The compiled part's ``plain_call`` against the Python checks it stands in for.

A cached backward asks one C function whether its roots, inputs and gradients are a
user's plain call; where it says yes, the session skips ``routing.torch_internal``,
``_eager_refuses``, ``_check_call`` and the dispatch-mode look-up.  So every call it
passes must be one all of those pass, and every call one of them stops must be one it
does not pass.  The calls are the ones torch's own entry points hand the engine, recorded
as they reach the session, in every form the tests know of.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gradfx
from gradfx.capture import native
from gradfx.capture.errors import _Fallback
from gradfx.capture.run import routing, session

pytestmark = [pytest.mark.skipif(native.wait() is None, reason="needs gradfx's compiled part"),
              pytest.mark.filterwarnings("ignore::gradfx.FallbackWarning")]


def _python_passes(tensors, grads, inputs) -> bool:
    """What the Python checks say of a call: it is a user's, eager accepts it, gradfx takes it."""
    if routing.torch_internal(tensors) or session._eager_refuses(tensors, inputs):
        return False
    if torch._C._len_torch_dispatch_stack():
        return False
    try:
        session._check_call(tensors, grads, inputs)
    except _Fallback:
        return False
    return True


@pytest.fixture
def recorded(monkeypatch):
    """(plain_call's verdict, the Python checks') of every call that reaches a session, as it
    reaches it (a dispatch mode is active then)."""
    calls = []
    run = session.Session.run_backward

    def record(self, engine, tensors, grad_tensors, keep_graph, create_graph, inputs=(), *args, **kwargs):
        calls.append((bool(session._plain_call(tensors, grad_tensors, inputs)),
                      _python_passes(tensors, grad_tensors, inputs)))
        return run(self, engine, tensors, grad_tensors, keep_graph, create_graph, inputs, *args, **kwargs)

    monkeypatch.setattr(session.Session, "run_backward", record)
    return calls


class _Seen(torch.Tensor):
    """A tensor subclass (the user's): its calls go the Python way."""


class _Counting(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _programs():
    """Backward calls of every form: name -> a function making them inside a block."""
    def plain():
        w = torch.randn(3, 3, requires_grad=True)
        (torch.randn(2, 3) @ w).sum().backward()

    def leaf_root():
        p = torch.nn.Parameter(torch.randn(3))
        torch.autograd.backward(p, torch.ones(3))

    def grad_inputs():
        x = torch.randn(3, requires_grad=True)
        torch.autograd.grad((x * x).sum(), [x])

    def backward_inputs():
        x, y = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
        (x * y).sum().backward(inputs=[x])

    def two_roots():
        x = torch.randn(3, requires_grad=True)
        torch.autograd.backward([(x * 2).sum(), (x * 3).sum()])

    def batched_grads():
        x = torch.randn(3, requires_grad=True)
        y = x * 2
        torch.autograd.grad(y, x, torch.eye(3), is_grads_batched=True)

    def functorch_grad():
        torch.func.grad(lambda x: (x.sin() * 2).sum())(torch.randn(3))

    def user_mode():
        x = torch.randn(3, requires_grad=True)
        with _Counting():
            (x * 2).sum().backward()

    def subclass_root():
        x = torch.randn(3, requires_grad=True)
        (x * 2).sum().as_subclass(_Seen).backward()

    def gradient_edge():
        x = torch.randn(3, requires_grad=True)
        y = x * 2
        torch.autograd.grad(y.sum(), [torch.autograd.graph.get_gradient_edge(y)])

    def unused_input():
        x, z = torch.randn(3, requires_grad=True), torch.randn(3)
        torch.autograd.grad((x * 2).sum(), [x, z], allow_unused=True)

    return {f.__name__: f for f in (plain, leaf_root, grad_inputs, backward_inputs, two_roots, batched_grads,
                                      functorch_grad, user_mode, subclass_root, gradient_edge, unused_input)}


PROGRAMS = _programs()
NOT_PLAIN = {"batched_grads", "functorch_grad", "user_mode", "subclass_root", "gradient_edge", "unused_input"}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_plain_call_passes_only_what_the_python_checks_pass(name, recorded):
    with gradfx.compiled_autograd(backend="eager"):
        try:
            PROGRAMS[name]()
        except RuntimeError:
            pass  # eager's own error (an input that does not require grad): the call was recorded
    assert recorded, "no call reached the session"
    for fast, python in recorded:
        assert python or not fast  # what the C check passes, the Python checks pass
    if name in NOT_PLAIN:
        assert not recorded[0][0] and not recorded[0][1]
    else:
        assert all(fast and python for fast, python in recorded)


def test_without_plain_call_the_python_checks_decide_alike(monkeypatch):
    """Gradients, counters and warnings are the same with the C check switched off."""
    def run():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        x = torch.randn(5, 4)
        grads = []
        with gradfx.compiled_autograd(backend="eager") as s:
            for _ in range(3):
                model.zero_grad()
                model(x).sum().backward()
                grads.append([p.grad.clone() for p in model.parameters()])
            g = torch.autograd.grad(model(x).sum(), list(model.parameters()))
        return grads + [list(g)], s.stats

    gradfx.reset()
    with_c = run()
    gradfx.reset()
    monkeypatch.setattr(session, "_plain_call", None)
    without = run()
    assert with_c[1] == without[1] and with_c[1]["cache_hits"] >= 2
    for a, b in zip(with_c[0], without[0]):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_plain_call_refuses_what_torch_never_hands_it():
    """Bad shapes of arguments (a list, a missing gradient, lengths that differ) go the
    Python way, which says what is wrong."""
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).sum()
    one = torch.ones(())
    assert session._plain_call((y,), (one,), ())
    assert not session._plain_call([y], (one,), ())
    assert not session._plain_call((y,), (None,), ())
    assert not session._plain_call((y,), (one, one), ())
    assert not session._plain_call((), (), ())
    assert not session._plain_call((y,), (one,), [x])
    assert not session._plain_call((x.detach(),), (torch.ones(3),), ())
    assert not session._plain_call((y,), (one,), (x.detach(),))
    assert not session._plain_call((torch.empty(3, device="meta", requires_grad=True),), (torch.ones(3),), ())
    with pytest.raises(TypeError):
        session._plain_call((y,), (one,))
