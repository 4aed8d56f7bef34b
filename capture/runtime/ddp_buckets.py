"""DistributedDataParallel's Python reducer, its all-reduces run in buckets.

With ``torch._dynamo.config.optimize_ddp = "python_reducer"`` (the set-up PyTorch
documents for compiled autograd) DDP gives every parameter a post-accumulate-grad
hook, ``compiled_accum_grad_hook``: it divides the new ``.grad`` by the group's
size, all-reduces it with a functional collective and copies the sum back into
``.grad``, which waits for it.  One collective per parameter, each waited before
the backward goes on: 1.7x eager DDP's step, whose C++ reducer buckets them.

The ``bucket_allreduces`` pass (``reorder``) plans the graph's calls of that hook
into buckets, consecutive calls of up to DDP's bucket sizes (its first bucket
smaller, as the C++ reducer's), and replaces them by :meth:`Buckets.ready`, with
one :meth:`Buckets.finish` before anything that could read a ``.grad``.  ``ready``
does what the hook does, except that the divided gradient goes into its bucket's
flat buffer, and the bucket's one all-reduce starts, asynchronously, when its last
member is ready.  ``finish`` waits for them and copies each sum into its ``.grad``.
In between, the backward goes on computing.

Each gradient is eager's, bit for bit:

* nothing reads a member's ``.grad`` between its ``ready`` and the ``finish`` (where
  the pass puts that);
* over two ranks a sum is ``a + b`` wherever the value sits in the buffer.  Over more,
  the collective's order of additions depends on the value's place (gloo's ring starts
  each chunk's sum at another rank): on gloo the pass lays the bucket out so that each
  member's chunks sit where the bucket's all-reduce adds them in the member's own order
  (``gloo_ring``); on another backend each member's all-reduce is the hook's own,
  started by ``ready`` and waited by ``finish``;
* a call whose hook is not DDP's Python reducer (the graph takes hooks as inputs),
  whose DDP has comm hooks, or whose gradient is not what was planned (another size
  or dtype, sparse, recording history) runs the hook itself, after what is pending
  has finished.
"""

from __future__ import annotations

import functools
import threading
from typing import NamedTuple

import torch

from .. import native
from ..graph import distributed
from ..graph.distributed import reducer_of
from . import ddp_agreement, hook_ops


class Planned(NamedTuple):
    """What the pass plans a call of DDP's hook by, read at capture."""
    numel: int  # of the parameter
    dtype: torch.dtype
    group: int  # id() of DDP's process group: a bucket serves one group
    first_cap: int  # DDP's first bucket's bytes
    cap: int  # its other buckets' bytes
    ring: int  # the group's ranks where its all-reduce is gloo's ring over more than two, else 0
    # the hook runs no user code (DDP has no comm hook; the structure key holds it): a call
    # that completes no bucket may run later (backends.split)
    alone: bool


def bucket_caps(ddp) -> tuple[int, int]:
    """(first bucket's bytes, later buckets' bytes), as DDP gives them to its C++ reducer."""
    cap = int(ddp.bucket_bytes_cap)
    config = getattr(ddp, "_bucket_config", None)  # 2.12 and later
    if config is not None:
        return int(config.first_bucket_bytes_cap), cap
    import torch.distributed as dist  # 2.11: the default first bucket where the cap is the default
    return (int(dist._DEFAULT_FIRST_BUCKET_BYTES) if getattr(ddp, "bucket_bytes_cap_default", True) else cap), cap


def default_caps() -> tuple[int, int]:
    """(first bucket's bytes, later buckets' bytes) of a DDP given no sizes of its own."""
    import torch.distributed as dist
    import torch.nn.parallel.distributed as ddp_module
    megabytes = getattr(ddp_module, "_DEFAULT_BUCKET_CAP_MB", 25)  # named from 2.12 on
    return int(dist._DEFAULT_FIRST_BUCKET_BYTES), int(megabytes * 1024 * 1024)


# Elements per member from which a bucket's members are divided straight into its buffer
# (Buckets._start): a call per member then costs less than a second pass over the buffer.
# Measured on 2 cores with cold caches: a call about 2.7 us, a pass 0.3 ns per element, so
# the two meet near 9000 elements (tiny GPT-2's bucket, 28 members of 4300 elements on
# average: 112 us a call each, 77 us copied then divided; the transformer's 63000 divided).
DIVIDE_INTO = 8192


class Buckets:
    """One backward's buckets.  ``plan`` holds, per bucket, (numel, each member's (offset,
    numel, dtype, width), ring, gaps): with ``ring`` 0 the members follow each other;
    else the buffer is ``[ring, numel // ring]`` and a member's chunk ``c`` is row ``c``'s
    ``width`` elements from column ``offset`` (``reorder.bucket_allreduces._layout``).
    With a ``segment`` (the run's index in the backward), bucket 0's last member is the
    ranks' trailer (``ddp_agreement``): 1 from each rank that sends these buckets, which
    ``agreement`` decides by.  Where the ranks have not turned to all-reducing alone, every
    bucket of such a run goes out, even with nothing to reduce (a rank that turns away sends
    zeros of each one's size), and the trailer is read before anything else than these
    buckets: an all-reduce alone, a foreign hook, the run's end."""

    __slots__ = ("plan", "left", "group", "written", "works", "alone", "agreement", "segment", "trailer",
                 "first", "launched")

    def __init__(self, plan: tuple, segment: int | None = None, agreement=None):
        self.plan = plan
        self.left = [len(members) for _, members, _, _ in plan]  # bucket -> members not yet ready
        self.segment = segment
        self.trailer = segment is not None
        if self.trailer:
            self.left[0] -= 1  # no call makes the trailer ready
        self.agreement = agreement  # None: no rank's word on this backward was asked for
        # the trailer's bucket: None before it starts, its (work, buffer, trailer) until read, then False
        self.first = None
        self.launched = [False] * len(plan)  # bucket -> its all-reduce started (or zeros sent for it)
        self.group = [None] * len(plan)  # bucket -> the process group its all-reduce goes to
        self.written = [[] for _ in plan]  # bucket -> (grad, member) of each member it reduces
        self.works = []  # (work, bucket, buffer, in_order) of the all-reduces started
        self.alone = []  # (grad, its all-reduced sum) of members reduced on their own

    def ready(self, bucket: int, member: int, hook, variable, node=None) -> None:
        """DDP's hook, called after ``variable``'s accumulation: its gradient joins the
        bucket (or starts its all-reduce on its own), to be copied back by :meth:`finish`.
        Nothing reads or writes the ``.grad`` before then (the pass sees to it): the
        bucket's last member copies them all in."""
        ddp = reducer_of(hook)
        grad = None
        if ddp is not None and not ddp._comm_hooks:
            if not ddp.require_backward_grad_sync:
                return self._done(bucket)  # no_sync(): the hook does nothing
            grad = variable.grad
            if grad is None:
                return self._done(bucket)  # as the hook: nothing to reduce
        if grad is None or grad.requires_grad or grad.layout is not torch.strided \
                or type(grad) is not torch.Tensor:
            self.finish()  # the hook sees every earlier .grad reduced, as in eager
            hook_ops.call_post_accumulate_hook(hook, variable, node)
            return self._done(bucket)
        group = ddp.process_group
        size = group.size()
        _, members, ring, _ = self.plan[bucket]
        _, numel, dtype, _ = members[member]
        agreement = self.agreement
        if (agreement is not None and agreement.answer is False) or self.left[bucket] <= 0 \
                or (size > 2 and (size != ring or grad.device.type != "cpu")) \
                or grad.numel() != numel or grad.dtype != dtype or self.group[bucket] not in (None, group):
            if agreement is not None:
                self._may_bucket(None)  # the ranks' word goes before any all-reduce alone
            self._alone(grad, group)
            return self._done(bucket)
        self.group[bucket] = group
        self.written[bucket].append((grad, member))
        self._done(bucket)

    def _alone(self, grad, group) -> None:
        """The hook's own all-reduce of one gradient, started now, copied back by finish."""
        import torch.distributed._functional_collectives as fcol
        self.alone.append((grad, fcol.all_reduce(grad / group.size(), "sum", group)))

    def _may_bucket(self, bucket) -> bool:
        """Asked before starting ``bucket``'s all-reduce (None: one alone, a foreign hook's
        call, the run's end): do the ranks send these buckets?  The run's buckets go out as
        they fill; anything else waits for the trailer.  Where they do not, every gradient
        written so far is all-reduced alone, in the order of its call (buckets fill in that
        order)."""
        agreement = self.agreement
        if agreement.answer is None and not agreement.by_trailer:
            agreement.settle()  # the exchange's answer
        if bucket is None and agreement.answer is not False and self.trailer and self.first is not False:
            self._read_trailer()
        if agreement.answer is False:
            for b, written in enumerate(self.written):
                for grad, _ in written:
                    self._alone(grad, self.group[b] or agreement.groups[0])
                written.clear()
            return False
        return True

    def _read_trailer(self) -> None:
        """Start the trailer's bucket if it has not started (later members go alone), wait
        for it and read its trailer.  Where it tells that not every rank sent the buckets,
        their sums are dropped, zeros go out for the run's buckets not started (as the rank
        that turned away sent for each), then the exchange, and each gradient is
        all-reduced alone."""
        if self.first is None:
            self._close(0)
            self._start(0)
        work, flat, piece = self.first
        self.first = False
        work.wait()
        agreement = self.agreement
        ranks = (self.group[0] or agreement.groups[0]).size()
        run = ddp_agreement.run_of(agreement.fingerprint, self.plan, flat.device) \
            if self.segment == 0 and not agreement.by_trailer else None  # kept already where by_trailer
        if agreement.trailer(piece.item(), ranks, flat.dtype, run):
            return
        self.works = []
        for bucket, planned in enumerate(self.plan):
            if not self.launched[bucket]:
                self._close(bucket)
                self.launched[bucket] = True
                agreement.send_zeros(planned[0], planned[1][0][2])
        agreement.say_no()

    def _close(self, bucket: int) -> None:
        """No later member joins the bucket: it starts with what it has (see ready)."""
        if self.left[bucket] > 0:
            self.left[bucket] = -self.left[bucket]

    def _done(self, bucket: int) -> None:
        self.left[bucket] -= 1
        if self.left[bucket] == 0:
            self._start(bucket)

    def _start(self, bucket: int) -> None:
        """Fill the bucket's buffer with its members' gradients divided by the group's size, as
        the hook divides each (elementwise: the same quotients), and start its all-reduce.

        Members of some size are divided straight into the buffer, one pass over the memory
        (the C++ reducer's copy divides as it copies too); many small ones are copied in one
        call and the buffer divided after, two passes where per-member calls would cost more.
        In a run with the trailer every bucket goes out, even with nothing to reduce: the
        ranks' sizes pair up."""
        written = self.written[bucket]
        trailer = self.trailer and bucket == 0
        agreement = self.agreement
        if self.launched[bucket] or (not written and not (self.trailer and agreement is not None)) \
                or (agreement is not None and not self._may_bucket(bucket)):
            return
        total, members, ring, gaps = self.plan[bucket]
        group = self.group[bucket] or agreement.groups[0]
        size = group.size()
        complete = len(written) == len(members) - trailer
        in_order = complete and not ring  # the members follow each other in the buffer, as written
        if in_order and 1 < len(written) + trailer and total < DIVIDE_INTO * len(members):
            # The common case: the members' gradients flattened in order into a new buffer in
            # one call (a copy: of two tensors or more; the trailer's place one more), divided.
            grads = [grad for grad, _ in written]
            if trailer:
                grads.append(grads[0].new_empty(1))
            flat = _flatten(grads)
            flat.div_(size)
        else:
            flat = self._filled(bucket, trailer, complete, in_order, size)
        if trailer:
            (piece,), _ = _pieces(flat, self.plan[0], [(None, len(members) - 1)], ())
            piece.fill_(1)
        work = self._launch(bucket, flat, group, in_order)
        if trailer:
            self.first = (work, flat, piece)

    def _filled(self, bucket: int, trailer: bool, complete: bool, in_order: bool, size: int) -> torch.Tensor:
        """The bucket's buffer, each written member's gradient divided in its place, the places
        of members with nothing to reduce and the layout's gaps zeroed (the trailer's left to
        the caller).  A ring bucket's float gradients the compiled part copies in one pass;
        what follows is its reference."""
        written = self.written[bucket]
        total, members, ring, gaps = self.plan[bucket]
        if written:
            flat = torch.empty(total, dtype=written[0][0].dtype, device=written[0][0].device)
        else:  # a bucket of a run with the trailer, nothing to reduce
            flat = torch.empty(total, dtype=members[0][2], device=self.agreement.device)
        if ring and _ring_fill is not None and _ring_fill(flat, members, ring, written, size):
            return flat  # in one pass, where the compiled part takes the gradients (native/ring_copy.cpp)
        if not complete or ring:
            for begin, stop in gaps:
                flat[begin:stop].zero_()
            if not complete:
                # Members with nothing to reduce add zeros, not the buffer's leftovers: a rank
                # whose parameter had a gradient sums it with this rank's zeros.
                missing = sorted(set(range(len(members) - trailer)) - {m for _, m in written})
                for piece in _pieces(flat, self.plan[bucket], [(None, m) for m in missing], ())[0]:
                    piece.zero_()
        grads = [grad.reshape(-1) for grad, _ in written]
        if total >= DIVIDE_INTO * len(members):
            into, values = _pieces(flat, self.plan[bucket], written, grads)
            for piece, value in zip(into, values):
                torch.div(value, size, out=piece)
        else:
            if in_order:
                torch.cat(grads, out=flat[:total - trailer])
            else:
                into, values = _pieces(flat, self.plan[bucket], written, grads)
                if into:
                    torch._foreach_copy_(into, values)
            flat.div_(size)
        return flat

    def _launch(self, bucket: int, flat: torch.Tensor, group, in_order: bool):
        """Start the bucket's all-reduce; ``in_order``: its members' sums lie in the buffer in
        the order written, one after the other (finish copies them back in one call)."""
        work = torch.distributed.all_reduce(flat, group=group, async_op=True)
        self.works.append((work, bucket, flat, in_order))
        self.launched[bucket] = True
        return work

    def finish(self) -> None:
        """Wait for every all-reduce started and copy each sum into its ``.grad``.

        A bucket some of whose members are still to come (a hook that is not DDP's ran
        between them) starts now; its later members are reduced on their own.  The ranks'
        word is had first (:meth:`_may_bucket`)."""
        every = self.trailer and self.agreement is not None  # each bucket goes out
        for bucket in range(len(self.plan)):
            if not self.launched[bucket] and (self.written[bucket] or every):
                self._close(bucket)
                self._start(bucket)
        if self.agreement is not None:
            self._may_bucket(None)
        works, self.works = self.works, []
        for work, bucket, flat, in_order in works:
            work.wait()
            if in_order:  # each sum a view of the buffer in its gradient's shape
                grads = [grad for grad, _ in self.written[bucket]]
                torch._foreach_copy_(grads, _unflatten(flat, grads))
                self.written[bucket] = []
                continue
            _, members, ring, _ = self.plan[bucket]
            if ring and _ring_read is not None and _ring_read(flat, members, ring, self.written[bucket]):
                self.written[bucket] = []
                continue
            targets, later = [], []
            for grad, _ in self.written[bucket]:
                if grad.is_contiguous():
                    targets.append(grad.view(-1))
                else:  # the sums into a contiguous copy first, then into the strided .grad
                    targets.append(torch.empty(grad.numel(), dtype=grad.dtype, device=grad.device))
                    later.append((grad, targets[-1]))
            sums, into = _pieces(flat, self.plan[bucket], self.written[bucket], targets)
            if into:
                torch._foreach_copy_(into, sums)
            for grad, target in later:
                grad.copy_(target.view(grad.shape))
            self.written[bucket] = []
        alone, self.alone = self.alone, []
        for grad, reduced in alone:
            grad.copy_(reduced)


# The copies of a ring bucket in the compiled part (None until it loads), which answer False
# where they decline the gradients (not float or double, not contiguous): then _pieces'.
_ring_fill = _ring_read = None


def _bind_ring_copy(module) -> None:
    global _ring_fill, _ring_read
    _ring_fill, _ring_read = module.ring_fill, module.ring_read


native.when_loaded(_bind_ring_copy)

_flatten = torch._C._nn.flatten_dense_tensors  # one tensor: a view of it; more: one new tensor (cat)
_unflatten = torch._C._nn.unflatten_dense_tensors  # views of the buffer, one per tensor, in its shape


def _pieces(flat: torch.Tensor, planned: tuple, written: list, flat_grads) -> tuple[list, list]:
    """(pieces of a bucket's buffer, the matching pieces of the flattened gradients) of the
    ``written`` members, ``flat_grads`` one per member (empty: the buffer's side alone).
    Following members: one piece each.  In ring rows: a member's full chunks as one
    ``[rows, width]`` piece (all of its columns where its chunks fill them), and its
    partial last chunk."""
    _, members, ring, _ = planned
    ours, theirs = [], []
    if not ring:
        for k, (_, member) in enumerate(written):
            offset, numel, _, _ = members[member]
            ours.append(flat[offset:offset + numel])
            if flat_grads:
                theirs.append(flat_grads[k])
        return ours, theirs
    rows = flat.view(ring, -1)
    widths = [width for _, _, _, width in members]
    spare = rows.shape[1] - sum(widths)
    blocks = rows.split(widths + [spare] if spare else widths, dim=1)  # member -> its columns
    for k, (_, member) in enumerate(written):
        _, numel, _, width = members[member]
        if numel == ring * width:
            ours.append(blocks[member])
            if flat_grads:
                theirs.append(flat_grads[k].view(ring, width))
            continue
        full, rest = divmod(numel, width) if width else (0, 0)
        if full:
            ours.append(blocks[member][:full])
            if flat_grads:
                theirs.append(flat_grads[k][:full * width].view(full, width))
        if rest:
            ours.append(blocks[member][full, :rest])
            if flat_grads:
                theirs.append(flat_grads[k][full * width:])
    return ours, theirs


def open_buckets(plan: tuple, segment: int | None = None) -> Buckets:
    agreement = getattr(starting, "agreement", None)
    buckets = Buckets(plan, segment, agreement)
    if agreement is not None:
        agreement.opened.append(buckets)
    return buckets


# The ranks' agreement of the backward now starting on this thread (set by the driver
# around a graph that calls DDP's hook): the graph's runs of buckets open at its start,
# before any of its hooks could start another backward.
starting = threading.local()


# What the graph calls (the methods themselves: a frame less on every call)
ready = Buckets.ready
finish = Buckets.finish


def ready_native():
    """What the eager backend's graphs call for :func:`ready`: the compiled part's C function
    (native/buckets.cpp: the common case in C++, ``Buckets.ready`` for every other) as fx's
    code can name it, where the compiled part is loaded; else ``Buckets.ready``."""
    module = native.module()
    if module is None:
        return ready
    if not _native:
        module.set_bucket_fallback(Buckets.ready, distributed.recognized_hook, torch.nn.parallel.DistributedDataParallel,
                                   functools.partial, torch.nn.Parameter)
        _native.append(native.named(module.bucket_ready, "bucket_ready_native"))
    return _native[0]


_native: list = []
