"""Saved tensors are let go of during the backward, as eager lets go of them.

Counted exactly: after a backward without ``retain_graph``, nothing but the test
may still reference an activation's storage, on the capture and on cache hits.
(Peak bytes are measured by bench/bench_memory.py: 1.00x eager on the 4 x 1024 MLP.)
"""

import pytest
import torch
import torch.nn as nn

import gradfx


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _refs_after_backward(lin, use_gradfx: bool, **kwargs) -> int:
    h = torch.tanh(lin(torch.randn(4, 8)))
    loss = (h * h.sigmoid()).sum()  # MulBackward and SigmoidBackward save h or its sigmoid
    if use_gradfx:
        with gradfx.compiled_autograd(**kwargs):
            loss.backward()
    else:
        loss.backward()
    return _storage_refs(h)


def test_saved_tensors_released_like_eager():
    gradfx.reset()
    lin = nn.Linear(8, 8)
    eager = _refs_after_backward(lin, False)
    ours = [_refs_after_backward(lin, True) for _ in range(3)]
    assert gradfx.stats()["captures"] == 1 and gradfx.stats()["cache_hits"] == 2
    assert ours == [eager] * 3


def test_saved_tensors_released_with_every_pipeline():
    lin = nn.Linear(8, 8)
    eager = _refs_after_backward(lin, False)
    for passes in ([], ["dce"]):
        gradfx.reset()
        assert [_refs_after_backward(lin, True, passes=passes) for _ in range(2)] == [eager] * 2


class _SavesItsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return g * x.cos()


def _alive_at_the_leaf(make_x, block, retain: bool, gradfx_runs: int) -> dict:
    """Four blocks ``y = block(k, h)`` on ``h = y * 1.0``, the backward run by eager and then
    ``gradfx_runs`` times by gradfx: per engine, [(how many of the four ``h`` are alive when
    the leaf's gradient arrives, the leaf's gradient)]."""
    import weakref
    seen = {}
    for engine in ("eager",) + ("gradfx",) * gradfx_runs:
        torch.manual_seed(0)
        x = make_x()
        refs, y = [], x
        for k in range(4):
            h = y * 1.0
            refs.append(weakref.ref(h))
            y = block(k, h)
            del h
        alive = []
        x.register_hook(lambda g: alive.append(sum(r() is not None for r in refs)))
        if engine == "gradfx":
            with gradfx.compiled_autograd(backend="eager"):
                y.sum().backward(retain_graph=retain)
        else:
            y.sum().backward(retain_graph=retain)
        if retain:  # kept: a second backward works, in both
            y.sum().backward()
        seen.setdefault(engine, []).append((alive[0], x.grad.clone()))
    assert seen["eager"][0][0] == (4 if retain else 0)
    for _, grad in seen["gradfx"]:
        assert torch.equal(grad, seen["eager"][0][1])
    return seen


@pytest.mark.parametrize("retain", [False, True])
@pytest.mark.parametrize("op", ["function", "run_real"])
def test_nodes_run_opaquely_free_their_saved_tensors_as_they_go(op, retain):
    """The engine frees each node's saved tensors right after it runs (without
    retain_graph); so must gradfx for nodes it runs opaquely (an opaque custom Function,
    a builtin node run for real), not only when the backward ends."""
    def block(k, h):
        return _SavesItsInput.apply(h) if op == "function" else torch.cumprod(h, 0) * 0.5
    seen = _alive_at_the_leaf(lambda: torch.randn(1000, requires_grad=True), block, retain, 2)
    if not retain:  # (kept, gradfx's owner may hold them under another tensor object)
        assert [alive for alive, _ in seen["gradfx"]] == [0, 0]


@pytest.mark.parametrize("retain", [False, True])
def test_checkpointed_blocks_free_what_their_hooks_packed_as_they_go(retain):
    """A non-reentrant checkpoint keeps its block's inputs in a frame its saved variables'
    hooks refer to; the engine releases those variables right after each node runs, so a
    block's inputs go once its nodes have run.  gradfx does the same: when learning, when
    traced (graph.unpacked) and on cache hits."""
    from torch.utils.checkpoint import checkpoint
    gradfx.reset()
    torch.manual_seed(0)
    lins = [nn.Linear(16, 16) for _ in range(4)]

    def block(k, h):
        return checkpoint(lambda t: torch.tanh(lins[k](t)), h, use_reentrant=False)
    seen = _alive_at_the_leaf(lambda: torch.randn(64, 16, requires_grad=True), block, retain, 3)
    assert [alive for alive, _ in seen["gradfx"]] == [seen["eager"][0][0]] * 3


class _MayDrop(torch.autograd.Function):
    """Identity run as itself: its backward could return None, so a graph through it may
    stop there and finish node by node."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


@pytest.mark.parametrize("retain", [False, True])
def test_a_graph_that_may_stop_frees_saved_tensors_as_it_goes(retain):
    """Where a graph may stop (an opaque backward's gradient could be None), the nodes
    still to run need their saved tensors: gradfx keeps them in the graph, not in the
    nodes, so each still goes at its last use (on cache hits, where the compiled part
    leaves them to their nodes, too) and the rest of a stopped backward gets them back."""
    gradfx.reset()

    def block(k, h):
        return torch.sin(_MayDrop.apply(h)) * h  # SinBackward and MulBackward save h
    seen = _alive_at_the_leaf(lambda: torch.randn(1000, requires_grad=True), block, retain, 3)
    if not retain:  # (kept, gradfx's owner may hold them under another tensor object)
        assert [alive for alive, _ in seen["gradfx"]] == [0, 0, 0]
