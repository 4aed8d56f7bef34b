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
from typing import NamedTuple

import torch

from . import hook_ops

_HOOK_NAME = "compiled_accum_grad_hook"
_HOOK_MODULE = "torch.nn.parallel.distributed"


class Planned(NamedTuple):
    """What the pass plans a call of DDP's hook by, read at capture."""
    numel: int  # of the parameter
    dtype: torch.dtype
    group: int  # id() of DDP's process group: a bucket serves one group
    first_cap: int  # DDP's first bucket's bytes
    cap: int  # its other buckets' bytes
    ring: int  # the group's ranks where its all-reduce is gloo's ring over more than two, else 0


def reducer_of(hook):
    """The DistributedDataParallel whose Python-reducer hook ``hook`` is, else None."""
    if type(hook) is not functools.partial:
        return None
    code = getattr(hook.func, "__code__", None)
    if code is None or code.co_name != _HOOK_NAME or getattr(hook.func, "__module__", None) != _HOOK_MODULE:
        return None
    try:
        ddp = hook.func.__closure__[code.co_freevars.index("self")].cell_contents
    except (ValueError, IndexError, TypeError):
        return None
    return ddp if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else None


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


class Buckets:
    """One backward's buckets.  ``plan`` holds, per bucket, (numel, each member's (offset,
    numel, dtype, width), ring, gaps): with ``ring`` 0 the members follow each other;
    else the buffer is ``[ring, numel // ring]`` and a member's chunk ``c`` is row ``c``'s
    ``width`` elements from column ``offset`` (``reorder.bucket_allreduces._layout``)."""

    __slots__ = ("plan", "flat", "left", "group", "written", "works", "alone")

    def __init__(self, plan: tuple):
        self.plan = plan
        self.flat = [None] * len(plan)  # bucket -> its buffer, once a member wrote into it
        self.left = [len(members) for _, members, _, _ in plan]  # bucket -> members not yet ready
        self.group = [None] * len(plan)  # bucket -> the process group its all-reduce goes to
        self.written = [[] for _ in plan]  # bucket -> (grad, offset, numel) of each member written
        self.works = []  # (work, bucket) of the all-reduces started
        self.alone = []  # (grad, its all-reduced sum) of members reduced on their own

    def ready(self, bucket: int, member: int, hook, variable, node=None) -> None:
        """DDP's hook, called after ``variable``'s accumulation: its gradient's all-reduce
        joins the bucket (or starts on its own), to be copied back by :meth:`finish`."""
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
        total, members, ring, gaps = self.plan[bucket]
        offset, numel, dtype, width = members[member]
        if (size > 2 and (size != ring or grad.device.type != "cpu")) or self.left[bucket] <= 0 \
                or grad.numel() != numel or grad.dtype != dtype or self.group[bucket] not in (None, group):
            import torch.distributed._functional_collectives as fcol
            self.alone.append((grad, fcol.all_reduce(grad / size, "sum", group)))  # the hook's own
            return self._done(bucket)
        flat = self.flat[bucket]
        if flat is None:
            flat = self.flat[bucket] = torch.empty(total, dtype=dtype, device=grad.device)
            self.group[bucket] = group
            for start, stop in gaps:
                flat[start:stop].zero_()
        if ring:
            rows = flat.view(ring, -1)
            flat_grad = grad.reshape(-1)  # the hook's all-reduce adds in this order
            full, rest = divmod(numel, width) if width else (0, 0)
            if full:
                torch.div(flat_grad[:full * width].view(full, width), size, out=rows[:full, offset:offset + width])
            if rest:
                torch.div(flat_grad[full * width:], size, out=rows[full, offset:offset + rest])
        else:
            torch.div(grad, size, out=flat[offset:offset + numel].view(grad.shape))
        self.written[bucket].append((grad, member))
        self._done(bucket)

    def _done(self, bucket: int) -> None:
        self.left[bucket] -= 1
        if self.left[bucket] == 0:
            self._start(bucket)

    def _start(self, bucket: int) -> None:
        flat = self.flat[bucket]
        if flat is None:
            return
        _, members, ring, _ = self.plan[bucket]
        if len(self.written[bucket]) < len(members):
            # Members with nothing to reduce add zeros, not the buffer's leftovers: a rank
            # whose parameter had a gradient sums it with this rank's zeros.
            written = {member for _, member in self.written[bucket]}
            for member, (offset, numel, _, width) in enumerate(members):
                if member not in written:
                    if ring:
                        flat.view(ring, -1)[:, offset:offset + width].zero_()
                    else:
                        flat[offset:offset + numel].zero_()
        import torch.distributed as dist
        self.works.append((dist.all_reduce(flat, group=self.group[bucket], async_op=True), bucket))

    def finish(self) -> None:
        """Wait for every all-reduce started and copy each sum into its ``.grad``.

        A bucket some of whose members are still to come (a hook that is not DDP's ran
        between them) starts now; its later members are reduced on their own."""
        for bucket in range(len(self.plan)):
            if self.left[bucket] > 0 and self.flat[bucket] is not None:
                self.left[bucket] = -self.left[bucket]  # closed: see ready
                self._start(bucket)
        works, self.works = self.works, []
        for work, bucket in works:
            work.wait()
            flat = self.flat[bucket]
            _, members, ring, _ = self.plan[bucket]
            for grad, member in self.written[bucket]:
                offset, numel, _, width = members[member]
                if ring:
                    _copy_rows(grad, flat.view(ring, -1), offset, numel, width)
                else:
                    grad.copy_(flat[offset:offset + numel].view(grad.shape))
            self.flat[bucket] = None
            self.written[bucket] = []
        alone, self.alone = self.alone, []
        for grad, reduced in alone:
            grad.copy_(reduced)


def _copy_rows(grad: torch.Tensor, rows: torch.Tensor, offset: int, numel: int, width: int) -> None:
    """Copy a member's sums, its chunks in ``rows``' columns from ``offset``, into ``grad``."""
    full, rest = divmod(numel, width) if width else (0, 0)
    contiguous = grad.is_contiguous()
    into = grad.view(-1) if contiguous else torch.empty(numel, dtype=grad.dtype, device=grad.device)
    if full:
        into[:full * width].view(full, width).copy_(rows[:full, offset:offset + width])
    if rest:
        into[full * width:].copy_(rows[full, offset:offset + rest])
    if not contiguous:
        grad.copy_(into.view(grad.shape))


def open_buckets(plan: tuple) -> Buckets:
    return Buckets(plan)


# What the graph calls (the methods themselves: a frame less on every call)
ready = Buckets.ready
finish = Buckets.finish
