"""The compiled part's copies of a bucket laid out for gloo's ring (native/ring_copy.cpp)
against the reference, ``Buckets._filled``'s and ``Buckets.finish``'s copies through
``_pieces``: the same buffer and the same gradients, bit for bit, and where the compiled
part declines the gradients, it writes nothing.  The buckets' all-reduces over 3 and 4
gloo ranks, with the copies in use, are test_ddp_buckets'."""

import importlib

import pytest
import torch

from gradfx.capture import native
from gradfx.capture.runtime import ddp_buckets

layout_of = importlib.import_module("gradfx.reorder.bucket_allreduces")._layout

pytestmark = pytest.mark.skipif(native.wait() is None, reason="gradfx's compiled part is not loaded")

# parameters of real layers: whole chunks, partial last chunks, one element, empty
SHAPES = [(64, 32), (32,), (7, 5), (1,), (0,), (3, 3, 3, 3), (100,), (513,), (4, 64)]


def _plan(shapes, dtype, ring):
    planned = [ddp_buckets.Planned(int(torch.Size(s).numel()), dtype, 0, 1 << 20, 25 << 20, ring, True)
               for s in shapes]
    return layout_of(planned)


def _filled(plan, written, size, compiled, monkeypatch):
    with monkeypatch.context() as m:
        if not compiled:
            m.setattr(ddp_buckets, "_ring_fill", None)
        buckets = ddp_buckets.Buckets((plan,))
        buckets.written[0] = list(written)
        return buckets._filled(0, False, len(written) == len(plan[1]), False, size)


def _read_reference(flat, plan, written):
    sums, into = ddp_buckets._pieces(flat, plan, written, [g.view(-1) for g, _ in written])
    if into:
        torch._foreach_copy_(into, sums)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("ring", [3, 4, 5])
@pytest.mark.parametrize("missing", [(), (1,), (0, 5)])
def test_ring_copies_are_the_references(dtype, ring, missing, monkeypatch):
    torch.manual_seed(ring)
    plan = _plan(SHAPES, dtype, ring)
    grads = [torch.randn(s, dtype=dtype) * 1e3 for s in SHAPES]
    grads[2][0, 0] = torch.finfo(dtype).tiny / 3  # a subnormal quotient
    written = [(g, k) for k, g in enumerate(grads) if k not in missing]
    reference = _filled(plan, written, ring, False, monkeypatch)
    flat = torch.full((plan[0],), float("nan"), dtype=dtype)  # no leftover survives: every cell written
    assert ddp_buckets._ring_fill(flat, plan[1], ring, written, ring)
    assert torch.equal(flat, reference)
    assert torch.equal(_filled(plan, written, ring, True, monkeypatch), reference)  # Buckets._filled takes it
    sums = torch.randn(plan[0], dtype=dtype)
    ours = [(torch.zeros_like(g), k) for g, k in written]
    theirs = [(torch.zeros_like(g), k) for g, k in written]
    assert ddp_buckets._ring_read(sums, plan[1], ring, ours)
    _read_reference(sums, plan, theirs)
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(ours, theirs))


def test_divided_as_the_hook_divides():
    """Each element is ``grad / size`` as the hook computes it: true division where the
    size is no power of two, and the product with the inverse (the same number) where it is."""
    dtype, ring = torch.float32, 3
    shapes = [(1000,), (37,)]
    plan = _plan(shapes, dtype, ring)
    grads = [torch.randn(s) for s in shapes]
    for size in (3, 4, 6):
        flat = torch.empty(plan[0])
        assert ddp_buckets._ring_fill(flat, plan[1], ring, [(g, k) for k, g in enumerate(grads)], size)
        back = [torch.empty_like(g) for g in grads]
        assert ddp_buckets._ring_read(flat, plan[1], ring, [(b, k) for k, b in enumerate(back)])
        assert all(torch.equal(b, g / size) for b, g in zip(back, grads))


@pytest.mark.parametrize("case", ["bfloat16", "strided", "size", "subclass", "member", "requires_grad"])
def test_declined_gradients_leave_the_buffer_alone(case):
    """What the compiled part does not copy (another dtype, a strided or wrong-sized
    gradient, a subclass, a member the plan lacks) it answers False for, before writing:
    the reference copies it."""
    ring, dtype = 3, torch.bfloat16 if case == "bfloat16" else torch.float32
    shapes = [(8, 6), (5,)]
    plan = _plan(shapes, dtype, ring)
    grads = [torch.randn(s, dtype=dtype) for s in shapes]
    if case == "strided":
        grads[0] = torch.randn(6, 8).t()
    elif case == "size":
        grads[1] = torch.randn(6)
    elif case == "subclass":
        grads[1] = torch.nn.Parameter(grads[1])
    elif case == "requires_grad":
        grads[1].requires_grad_()
    written = [(g, k) for k, g in enumerate(grads)]
    if case == "member":
        written[1] = (grads[1], 2)
    flat = torch.full((plan[0],), 7.0, dtype=dtype)
    assert ddp_buckets._ring_fill(flat, plan[1], ring, written, ring) is False
    assert ddp_buckets._ring_read(flat, plan[1], ring, written) is False
    assert bool((flat == 7.0).all())
    assert all(not torch.equal(g, torch.full_like(g, 7.0)) for g, _ in written if g.numel())


def test_large_buckets_go_to_atens_threads():
    """A bucket of more than 2**18 elements is ATen's to copy (in parallel) where it has
    threads; with one thread the compiled part copies it."""
    ring = 3
    plan = _plan([(300_000,)], torch.float32, ring)
    grad = torch.randn(300_000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert ddp_buckets._ring_fill(torch.empty(plan[0]), plan[1], ring, [(grad, 0)], ring) is False
        torch.set_num_threads(1)
        assert ddp_buckets._ring_fill(torch.empty(plan[0]), plan[1], ring, [(grad, 0)], ring) is True
    finally:
        torch.set_num_threads(threads)
