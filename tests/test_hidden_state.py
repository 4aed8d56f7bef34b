"""Nodes whose backward reads C++ state no Python binding shows (capture/graph/hidden.py),
traced with that state read by gradfx's compiled part (capture/native) and keyed.

For each kind: the trace is bitwise eager (values, and the generated walker's cache hit),
the node is not opaque, and a backward whose hidden state alone differs is recaptured,
never run through the old graph.  Without the compiled part the node runs as itself.
"""

from __future__ import annotations

import pytest
import torch

import gradfx
from gradfx.capture import native
from gradfx.capture.graph.kinds import hidden_state
from helpers import assert_same, autograd_nodes, grads_of

pytestmark = pytest.mark.skipif(native.wait() is None, reason=f"no compiled part: {native.reason()}")


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield
    gradfx.reset()


def leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def weighted(y):
    """A loss whose gradient differs at every element: a misplaced slice cannot go unseen."""
    return (y * torch.arange(1, y.numel() + 1, dtype=y.dtype).reshape(y.shape)).sum()


def _copy_into_slice(x, y, start=1):
    b = x * 1
    b[:, start:start + 2] = y * 2
    return b * b


def _add_into_row(x, y):
    b = x * 1
    b[1].add_(3.0, alpha=2)  # fn: AddBackward0 with visible saved values (alpha)
    b.t()[2:4].zero_()  # a transposed view: strides of the view's geometry
    return b * y.sum()


def _fill_diagonal(x, y):
    b = x * y.mean()
    b.diagonal().fill_(2.0)  # fn: FillBackward
    return b


def _native_dropout(x, y, train=True, p=0.3):
    torch.manual_seed(0)
    return torch.native_dropout(x, p, train)[0] * x


def _as_strided(x, y):
    return x.as_strided((3, 3), (2, 1), 1).exp()


def _as_strided_of_transposed(x, y):
    return x.t().as_strided((3, 3), (1, 4), 2).exp() * y.sum()


def _as_strided_in_place(x, y):
    b = x * 1
    return b.as_strided_((3, 3), (2, 1), 1).sin() * y.sum()


def _block_diag(x, y):
    return torch.block_diag(x, y, torch.ones(1, 3, dtype=torch.float64)).sin()


PROGRAMS = {
    "CopySlices (copy_)": (_copy_into_slice, "CopySlices"),
    "CopySlices (add_, zero_ on views)": (_add_into_row, "CopySlices"),
    "CopySlices (fill_ on a diagonal)": (_fill_diagonal, "CopySlices"),
    "NativeDropoutBackward0 (train)": (_native_dropout, "NativeDropoutBackward0"),
    "NativeDropoutBackward0 (not train)": (lambda x, y: _native_dropout(x, y, train=False), "NativeDropoutBackward0"),
    "AsStridedBackward0": (_as_strided, "AsStridedBackward0"),
    "AsStridedBackward0 (transposed input)": (_as_strided_of_transposed, "AsStridedBackward0"),
    "AsStridedBackward1 (as_strided_)": (_as_strided_in_place, "AsStridedBackward1"),
    "BlockDiagBackward0": (_block_diag, "BlockDiagBackward0"),
}


def _run(program, x, y, mode, **kwargs):
    x.grad = y.grad = None
    if mode == "eager":
        weighted(program(x, y)).backward()
    else:
        with gradfx.compiled_autograd(backend="eager", **kwargs) as session:
            weighted(program(x, y)).backward()
        assert session.stats["fallbacks"] == 0, session.stats
    return grads_of([x, y])


def _kinds(root):
    return {type(n).__name__ for n in autograd_nodes(root)}


@pytest.mark.parametrize("name", list(PROGRAMS))
@pytest.mark.parametrize("dynamic", [False, True])
def test_traced_bitwise_and_not_opaque(name, dynamic):
    program, kind = PROGRAMS[name]
    x, y = leaf(4, 6), leaf(4, 2)
    root = weighted(program(x, y))
    assert kind in _kinds(root.grad_fn)
    assert gradfx.capture(root).opaque_nodes == []
    for step in range(3):  # a capture, then cache hits through the generated walker
        expected = _run(program, x, y, "eager")
        assert_same(expected, _run(program, x, y, "gradfx", dynamic=dynamic))
    stats = gradfx.stats()
    assert stats["captures"] == 1 and stats["cache_hits"] == 2, stats


def _twice(first, second):
    """Backward through ``first``, then ``second`` (the same visible structure): both bitwise."""
    x, y = leaf(4, 6), leaf(4, 2)
    for program in (first, second, first):
        assert_same(_run(program, x, y, "eager"), _run(program, x, y, "gradfx"))
    return gradfx.stats()


def test_dropout_that_did_not_train_is_another_graph():
    """train=False keeps p and the all-true mask: only the hidden flag (scale 1, not 1/(1-p))
    differs."""
    x = leaf(4, 6)
    keys = [hidden_state(torch.native_dropout(x, 0.3, train)[0].grad_fn) for train in (True, False)]
    assert keys[0] != keys[1]
    stats = _twice(lambda x, y: _native_dropout(x, y, p=0.0), lambda x, y: _native_dropout(x, y, False, p=0.0))
    assert stats["captures"] == 2 and stats["cache_hits"] == 1, stats


def test_another_slice_of_the_same_shape_is_another_graph():
    """b[:, 1:3] = ..., then b[:, 3:5] = ...: the view's storage offset alone differs."""
    stats = _twice(lambda x, y: _copy_into_slice(x, y, 1), lambda x, y: _copy_into_slice(x, y, 3))
    assert stats["captures"] == 2 and stats["cache_hits"] == 1, stats


def test_another_input_geometry_of_as_strided_is_another_graph():
    """as_strided at storage offset 7 of a leaf that starts at offset 0, then of one that
    starts at 6: every visible saved value is the same, the input's geometry differs."""
    storage = torch.randn(40)

    def leaf_at(offset):
        return storage[offset:offset + 24].view(4, 6).requires_grad_()

    def program(x, y):
        return x.as_strided((3, 3), (2, 1), 7).exp() * y.sum()
    a, b = (program(leaf_at(k), leaf(1)).grad_fn.next_functions[0][0].next_functions[0][0] for k in (0, 6))
    assert type(a).__name__ == "AsStridedBackward0" and hidden_state(a) != hidden_state(b)
    y = leaf(1)
    for offset in (0, 6, 0):
        x = leaf_at(offset)
        assert_same(_run(program, x, y, "eager"), _run(program, x, y, "gradfx"))
    stats = gradfx.stats()
    assert stats["captures"] == 2 and stats["cache_hits"] == 1, stats


def test_in_place_op_with_saved_tensors_on_a_view_stays_opaque():
    """b[:, 1:3].mul_(y): the wrapped MulBackward0 saves tensors the walk does not own."""
    def program(x, y):
        b = x * 1
        b[:, 1:3].mul_(y)
        return b * b
    x, y = leaf(4, 6), leaf(4, 2)
    assert [label.split()[0] for label in gradfx.capture(weighted(program(x, y))).opaque_nodes] == [
        "torch::autograd::CopySlices"]
    assert_same(_run(program, x, y, "eager"), _run(program, x, y, "gradfx"))


def test_without_the_compiled_part_the_nodes_run_as_themselves(monkeypatch):
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "reason", "switched off by the test")
    for program, kind in PROGRAMS.values():
        x, y = leaf(4, 6), leaf(4, 2)
        opaque = gradfx.capture(weighted(program(x, y))).opaque_nodes
        assert {label.split()[0].split("::")[-1] for label in opaque} == {kind}
        assert_same(_run(program, x, y, "eager"), _run(program, x, y, "gradfx"))


def test_a_graph_captured_before_the_compiled_part_loaded_stays_exact(monkeypatch):
    """Loaded half-way: the old graph (the node opaque) is not reused, a new one traces it."""
    x, y = leaf(4, 6), leaf(4, 2)
    loaded = native._state.module
    monkeypatch.setattr(native._state, "module", None)
    monkeypatch.setattr(native._state, "reason", "not built yet")
    assert_same(_run(_copy_into_slice, x, y, "eager"), _run(_copy_into_slice, x, y, "gradfx"))
    monkeypatch.setattr(native._state, "module", loaded)
    monkeypatch.setattr(native._state, "reason", None)
    for _ in range(2):
        assert_same(_run(_copy_into_slice, x, y, "eager"), _run(_copy_into_slice, x, y, "gradfx"))
    stats = gradfx.stats()
    assert stats["captures"] == 2 and stats["cache_hits"] == 1, stats
    assert gradfx.capture(weighted(_copy_into_slice(x, y))).opaque_nodes == []


@pytest.mark.parametrize("dynamic, captures", [(True, 1), ("auto", 2)])
def test_slice_assignments_over_batch_sizes(dynamic, captures):
    """CopySlices' base and view geometry follow the batch: symbolic, as the sizes around it
    (a copy_, a transposed view's fill, an in-place scale of the first half)."""
    w = leaf(8)

    def program(x, y):
        b = x * w
        b[:, 1:3] = x[:, :2] * 2
        b[1:].t()[3:5] = 1.0
        b[:x.shape[0] // 2].mul_(3)
        return b * b * y.sum()
    y = leaf(1)
    for n in (3, 5, 7, 9, 5):
        x = leaf(n, 8)
        w.grad = None
        expected = _run(program, x, y, "eager") + [w.grad.clone()]
        w.grad = None
        assert_same(expected, _run(program, x, y, "gradfx", dynamic=dynamic) + [w.grad.clone()])
    stats = gradfx.stats()
    assert stats["captures"] == captures and stats["fallbacks"] == 0, stats
