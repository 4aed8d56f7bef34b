"""Saved tensors gradfx has taken over keep eager's checks: in-place changes and freed graphs.

torch skips its version check for saved variables with hooks, and gradfx's own
hooks stay on a saved variable once it has read it (a ``retain_graph`` backward,
``gradfx.capture``).  Every later backward, in a block or not, must still raise
eager's error.
"""

import pytest
import torch
import torch.nn as nn

import gradfx


def _program(kind):
    """(leaf, loss, the saved tensor to modify)."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    if kind == "output":  # exp saves its result
        y = (w * 2).exp()
        return w, (y * 1.0).sum(), y
    if kind == "input":  # mul saves its inputs
        a = w * 2
        return w, (a * a).sum(), a
    lin = nn.Linear(3, 3)  # a model: addmm saves its input
    h = lin(w.expand(2, 3)).tanh()
    return w, (h * h).sum(), h


def _first(how, loss):
    if how == "eager":
        loss.backward(retain_graph=True)
    elif how == "capture":
        gradfx.capture(loss)
    else:
        with gradfx.compiled_autograd():
            loss.backward(retain_graph=True)


def _second(how, loss):
    if how == "eager":
        loss.backward()
    else:
        with gradfx.compiled_autograd():
            loss.backward()


def _outcome(first, second, kind):
    w, loss, saved = _program(kind)
    _first(first, loss)
    before = None if w.grad is None else w.grad.clone()
    with torch.no_grad():
        saved.mul_(10)
    with pytest.raises(RuntimeError) as info:
        _second(second, loss)
    after = None if w.grad is None else w.grad.clone()
    return str(info.value), (before is None and after is None) or torch.equal(before, after)


@pytest.mark.parametrize("kind", ["output", "input", "model"])
@pytest.mark.parametrize("first", ["block", "capture"])
@pytest.mark.parametrize("second", ["eager", "block"])
def test_inplace_change_after_gradfx_raises_eagers_error(kind, first, second):
    gradfx.reset()
    expected, _ = _outcome("eager", "eager", kind)
    message, unchanged = _outcome(first, second, kind)
    assert "modified by an inplace operation" in message and "is at version" in message
    if kind == "output":
        assert message == expected
    else:  # the same words, the producer of a saved input is not always named
        assert message.split(":")[0] == expected.split(":")[0]
        assert message.split(" is at version")[1] == expected.split(" is at version")[1]
    if second == "block":
        assert unchanged  # gradfx raises before anything is accumulated


def test_inplace_change_after_cached_backward_raises():
    gradfx.reset()
    lin = nn.Linear(4, 4)
    with gradfx.compiled_autograd() as s:
        for _ in range(3):
            h = lin(torch.randn(2, 4)).exp()
            loss = h.sum()
            loss.backward(retain_graph=True)
        assert s.stats["cache_hits"] == 2
        with torch.no_grad():
            h.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as ours:
            loss.backward()
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as eagers:
        loss.backward()
    assert str(ours.value) == str(eagers.value)  # "output 0 of Exp" in this release's words


def test_untouched_retained_graph_still_runs_and_matches_eager():
    def run(use_gfx):
        w, loss, saved = _program("model")
        for _ in range(3):
            if use_gfx:
                with gradfx.compiled_autograd():
                    loss.backward(retain_graph=True)
            else:
                loss.backward(retain_graph=True)
        return w.grad
    assert torch.equal(run(False), run(True))


def test_hooks_on_one_saved_variable_of_a_node_leave_the_others_alone():
    """The user's pack/unpack hooks on one saved variable of a node that saves two: the
    node runs as itself, its other variable untouched (it was left with an unpack hook
    into an owner nobody kept: IndexError)."""
    def run(block):
        log = []
        a = torch.tensor([1.0, 2.0], requires_grad=True)
        b = torch.tensor([3.0, -1.0], requires_grad=True)
        out = (a * 2) * b
        out.grad_fn._raw_saved_self.register_hooks(lambda t: log.append("pack") or t,
                                                   lambda t: log.append("unpack") or t)
        with block():
            out.sum().backward()
        return a.grad, b.grad, log
    import contextlib
    expected = run(contextlib.nullcontext)
    got = run(lambda: gradfx.compiled_autograd(backend="eager"))
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])
    assert expected[2] == got[2] == ["pack", "unpack"]


def _hooked_program(kind):
    """(leaf, loss) whose saved tensors the user's saved_tensors_hooks own."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    if kind == "saved_tensors_hooks":
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            return w, (x @ w).tanh().sum()
    from torch.utils.checkpoint import checkpoint
    return w, checkpoint(lambda a: (a @ w).tanh(), x.requires_grad_(), use_reentrant=False).sum()


@pytest.mark.parametrize("kind", ["saved_tensors_hooks", "checkpoint"])
def test_backward_twice_through_hooked_saved_tensors_raises(kind):
    """Python cannot release a saved variable the user's hooks own; eager does, and its
    second backward raises: so must gradfx's, and the eager engine's after gradfx's,
    without accumulating a second gradient."""
    w, loss = _hooked_program(kind)
    loss.backward()
    expected = w.grad.clone()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()

    w, loss = _hooked_program(kind)
    with gradfx.compiled_autograd():
        loss.backward()
        assert torch.equal(w.grad, expected)
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()
    assert torch.equal(w.grad, expected)


def test_retained_graph_with_hooked_saved_tensors_runs_again():
    w, loss = _hooked_program("saved_tensors_hooks")
    with gradfx.compiled_autograd():
        loss.backward(retain_graph=True)
        first = w.grad.clone()
        loss.backward(retain_graph=True)
    loss.backward()  # the eager engine, on the graph gradfx kept
    assert torch.equal(w.grad, 3 * first)


def test_failed_inplace_check_leaves_the_node_as_it_was():
    """The second saved tensor of a node fails eager's in-place check: the first must not
    be taken over either, so every later backward raises eager's error again."""
    torch.manual_seed(0)
    a = torch.randn(5, requires_grad=True)
    w = torch.randn(5, requires_grad=True)
    h = a * 1
    y = w * h  # MulBackward0 saves w and h
    h.add_(1)
    with gradfx.compiled_autograd():
        for _ in range(2):
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    assert a.grad is None and w.grad is None
