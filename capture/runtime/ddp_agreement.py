"""The ranks agree on how DDP's Python reducer all-reduces a backward: buckets or alone.

Under ``optimize_ddp = "python_reducer"`` eager DDP all-reduces each parameter alone,
while a graph of gradfx's sends buckets (``ddp_buckets``).  Collectives pair up only
where every rank issues the same ones: a rank whose backward falls back to the eager
engine, or that captured a graph cut into other buckets (a hook or an opaque call on
that rank alone), would pair a bucket with a single parameter, and gloo aborts.  No
rank can tell beforehand what the others do, so the ranks say it (kept per DDP):

* **Exchange.**  Where the ranks have not yet agreed on a plan, each sends one small
  all-reduce as the backward starts: a graph with buckets its plan's fingerprint, a
  graph that calls DDP's hook without buckets (a pipeline without
  ``bucket_allreduces``, a compiler tracing the hook) and the eager engine 0.  The
  buckets go out only where every rank sent the same non-zero fingerprint (the
  maximum of ``(f, -f)`` over the ranks is ``(f, -f)``).
* **Trailer.**  Once they have, a further exchange would cost each backward a
  collective (on a machine with as many ranks as cores, 0.6 ms of the compute it
  interrupts: ``bench/bench_ddp_agreement.py``).  Instead the first bucket of each run
  of buckets carries one element more, the trailer: 1 from a rank that sends the
  agreed plan's buckets.  Every bucket of such a run goes out, even with nothing to
  reduce.  A rank that does not send them sends zeros of each one's size (a trailer of
  0), then an exchange: a rank that falls back or captured another plan in place of the
  backward's first run (``begin``), a rank whose graph stopped part-way in place of the
  next run it has not started (``Agreement.turn_away``).  Every size still pairs up.
  The buckets go out as they fill; before anything else (an all-reduce alone, a foreign
  hook, the run's end) the trailer is read, and where it sums to less than the ranks
  the bucketing ranks drop the run's sums, send zeros for its buckets not yet started,
  exchange, and all-reduce each gradient alone.
* Either way, where the ranks do not agree, every rank all-reduces each parameter
  alone, in the order of its hook calls, as eager does; the next backward exchanges.

Only backwards that all-reduce take part: a process group of one rank, DDP's
``no_sync()`` and DDP's comm hooks (which run for each parameter on every path) send
nothing, on any rank alike.  Every rank must run its backwards inside a gradfx block:
the eager engine outside one neither exchanges nor sends a trailer.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import NamedTuple

import torch
import torch.fx as fx

from ..graph.distributed import initialized, reducer_of
from ..torch_releases import node_token
from . import gloo_ring

_FINGERPRINT_BITS = 62


class FirstRun(NamedTuple):
    """The first run of buckets of the plan a DDP's ranks last agreed on: what a rank that
    turns away sends zeros of."""
    fingerprint: int
    buckets: tuple  # (numel, dtype) of each bucket, the trailer's first
    device: torch.device


def run_of(fingerprint: int, plan: tuple, device: torch.device) -> FirstRun:
    """The FirstRun of a run of buckets' ``plan`` (``ddp_buckets``)."""
    return FirstRun(fingerprint, tuple((total, members[0][2]) for total, members, _, _ in plan), device)


# DDP -> the FirstRun of the plan its ranks last all sent, for backwards that reach it
# alone (weak: a DDP built later at the same address starts unknown on every rank)
agreed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Agreement:
    """One backward's answer: may its all-reduces go in buckets?  ``answer`` is None until
    known: from the exchanges (:meth:`settle`), or, where ``first`` (the agreed plan's
    first bucket, this backward's too), from that bucket's trailer (``ddp_buckets``).  A
    later run's trailer may still turn it to False: a rank's graph stopped there."""

    __slots__ = ("fingerprint", "ddp", "groups", "owner", "sent", "first", "answer", "opened")

    def __init__(self, fingerprint: int, ddp, groups: list, owner, sent: list, first: FirstRun | None = None):
        self.fingerprint = fingerprint
        self.ddp = ddp  # the one DDP this backward reaches; None for several
        self.groups = groups
        self.owner = owner  # the first group's DDP: where its gradients are (``device``)
        self.sent = sent  # (work, its tensor, an exchange?) per collective this rank sent
        self.first = first
        self.answer = None
        self.opened = []  # the graph's runs of buckets, in the graph's order (ddp_buckets)

    @property
    def by_trailer(self) -> bool:
        return self.first is not None

    @property
    def device(self) -> torch.device:
        """Where what this rank sends goes (made when something is sent, not per backward)."""
        return torch.device(self.owner.device_type)

    def settle(self) -> None:
        """Wait for what this rank sent; an exchange's answer is known then."""
        if not self.sent:
            return
        agreed_all = self.fingerprint != 0
        for work, tensor, exchanged in self.sent:
            work.wait()
            if exchanged:
                high, low = tensor.tolist()
                agreed_all = agreed_all and high == self.fingerprint and -low == self.fingerprint
        self.sent = []
        if self.answer is None:
            self.answer = agreed_all

    def trailer(self, total: float, ranks: int, dtype: torch.dtype, first: FirstRun | None) -> bool:
        """A run's trailer summed to ``total`` over ``ranks``: did all send its buckets?
        (``first``: the backward's first run where an exchange agreed on its plan, which the
        next backward may then keep; None where it is kept already, or for a later run.)  Where
        some did not, none buckets from here: the caller sends zeros for the run's buckets it
        has not started, then :meth:`say_no`.  A count the dtype cannot hold exactly reads
        as "not all"."""
        if total == ranks and _counts_exactly(dtype, ranks):
            self.answer = True if self.answer is None else self.answer
            if self.answer and first is not None and self.ddp is not None:
                agreed[self.ddp] = first
            return True
        self.answer = False
        self.forget()
        return False

    def send_zeros(self, numel: int, dtype: torch.dtype) -> None:
        """Zeros in place of a bucket: its size pairs up, its trailer (if any) says "not I"."""
        zeros = torch.zeros(numel, dtype=dtype, device=self.device)
        self.sent.append((self.groups[0].allreduce([zeros]), zeros, False))

    def say_no(self) -> None:
        """The exchange that follows a run some rank turned away from: this rank says 0."""
        self.sent.append(_exchange(self.groups[0], 0, self.device))

    def turn_away(self) -> None:
        """This rank's graph stopped; the rest of its backward runs node by node, DDP's hook
        all-reducing each parameter alone.  The other ranks' next collectives are the buckets
        of the next run of buckets not started here: zeros in their place (a trailer of 0),
        then the exchange they make on reading it."""
        if self.answer is False:
            return  # every rank all-reduces alone already
        waiting = next((b for b in self.opened if b.trailer and not any(b.launched)), None)
        self.answer = False
        self.forget()
        if waiting is None:
            return  # no all-reduce of the graph's is left
        for total, members, _, _ in waiting.plan:
            self.send_zeros(total, members[0][2])
        self.say_no()

    def forget(self) -> None:
        if self.ddp is not None:
            agreed.pop(self.ddp, None)


def _counts_exactly(dtype: torch.dtype, ranks: int) -> bool:
    """Is every count of ranks up to ``ranks`` exact in ``dtype`` (256 in bfloat16, 2048 in
    half)?  Else one rank's 0 could round to a full count, which therefore reads "not all"."""
    return dtype.is_floating_point and ranks <= 2 / torch.finfo(dtype).eps


def _exchange(group, fingerprint: int, device: torch.device) -> tuple:
    import torch.distributed as dist
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    # the group's own method, not dist.all_reduce: five frames less, and not counted among
    # the user's all_reduce calls; on the device DDP's gradients are on (NCCL takes no CPU)
    tensor = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    return group.allreduce([tensor], options), tensor, True


class Handshake:
    """What a captured graph says before it runs: its plans' fingerprint, whether its runs of
    buckets carry the trailer, and the input positions of one DDP hook per DDP whose hook
    the graph calls (the DDP and its group are read from the hook at each run: they are
    the user's, and may change flags between backwards)."""

    __slots__ = ("fingerprint", "trailer", "positions")

    def __init__(self, fingerprint: int, trailer: bool, positions: tuple):
        self.fingerprint = fingerprint
        self.trailer = trailer
        self.positions = positions

    def start(self, inputs) -> Agreement | None:
        return begin([reducer_of(inputs[pos]) for pos in self.positions], self.fingerprint, self.trailer)


def handshake_of(graph, sizes: int, inputs, opener) -> Handshake | None:
    """The handshake of a captured graph whose placeholders after the first ``sizes`` are
    ``inputs``; None where it calls no DDP hook.  ``opener``: the function that opens a
    run of buckets, whose plans the fingerprint covers (None: the code compiled from the
    graph calls DDP's hooks as they are)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][sizes:]
    position = {ph: pos for pos, ph in enumerate(placeholders)}
    plans, positions, ddps, trailer = [], [], [], False
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if opener is not None and node.target is opener:
            plans.append(node.args)
            trailer = trailer or node.args[1] is not None
        if "gradfx_allreduce" not in node.meta:
            continue
        for arg in node.args:
            ddp = reducer_of(inputs[position[arg]]) if isinstance(arg, fx.Node) and arg in position else None
            if ddp is not None:
                if all(ddp is not seen for seen in ddps):
                    ddps.append(ddp)
                    positions.append(position[arg])
                break
    if not positions:
        return None
    return Handshake(fingerprint(plans) if plans else 0, trailer, tuple(positions))


def fingerprint(plans: list) -> int:
    """A non-zero number that the same plans give on every rank (not ``hash``: salted)."""
    digest = hashlib.blake2b(repr(plans).encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") & ((1 << _FINGERPRINT_BITS) - 1)) | 1


def _all_reducing(ddps) -> tuple[list, list]:
    """(the DDPs that all-reduce in this backward, their process groups), in buckets where
    the ranks agree: not over more than two ranks where each parameter keeps its own
    all-reduce anyway (``ddp_buckets``: another backend than gloo's ring), as in eager."""
    kept: list = []
    groups: list = []  # (group, its first DDP)
    for ddp in ddps:
        if ddp is None or not ddp.require_backward_grad_sync or ddp._comm_hooks or any(ddp is d for d in kept):
            continue
        group = ddp.process_group
        size = group.size()
        if size < 2 or (size > 2 and gloo_ring.ranks_of(group, torch.device(ddp.device_type)) != size):
            continue
        kept.append(ddp)
        if all(group is not g for g, _ in groups):
            groups.append((group, ddp))
    return kept, groups


def begin(ddps, fingerprint: int, trailer: bool) -> Agreement | None:
    """This rank's first word on a backward: nothing where its buckets carry the trailer of
    the plan agreed; else, first, a dummy of that plan's first bucket where there is one
    (zeros: its trailer says "not I"), then an exchange."""
    ddps, groups = _all_reducing(ddps)
    if not groups:
        return None
    ddp = ddps[0] if len(ddps) == 1 else None
    first = agreed.get(ddp) if ddp is not None else None
    owner = groups[0][1]
    if first is not None and trailer and first.fingerprint == fingerprint:
        return Agreement(fingerprint, ddp, [groups[0][0]], owner, [], first)
    sent = []
    if first is not None:  # zeros for each bucket of the agreed plan's first run
        del agreed[ddp]
        for numel, dtype in first.buckets:
            zeros = torch.zeros(numel, dtype=dtype, device=first.device)
            sent.append((groups[0][0].allreduce([zeros]), zeros, False))
    sent.extend(_exchange(group, fingerprint, torch.device(d.device_type)) for group, d in groups)
    return Agreement(fingerprint, ddp, [g for g, _ in groups], owner, sent)


def before_eager_engine(tensors, inputs, accumulate_grad: bool) -> Agreement | None:
    """A backward about to run on the eager engine inside a gradfx block: where it reaches
    a Python-reducer DDP's hooks, this rank says it does not bucket (to be settled after
    the engine's run: its collectives follow what it sent)."""
    if not accumulate_grad or not initialized():
        return None
    return begin(_reducers_reached(tensors, inputs), 0, False)


def _reducers_reached(tensors, inputs) -> list:
    """The DDPs whose Python-reducer hooks the engine will call: those on the gradient
    accumulators this backward reaches (of ``inputs`` alone where given)."""
    wanted = None if not inputs else {id(t) for t in inputs}
    leaves = [t for t in tensors if t.grad_fn is None and t.requires_grad]
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set()  # node_token: before 2.13 a node's Python object is made anew on each read
    while stack:
        node = stack.pop()
        token = node_token(node)
        if token in seen:
            continue
        seen.add(token)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
            continue
        stack.extend(n for n, _ in node.next_functions if n is not None)
    ddps = []
    for leaf in leaves:
        if wanted is not None and id(leaf) not in wanted:
            continue
        for hook in (getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values():
            ddp = reducer_of(hook)
            if ddp is not None and all(ddp is not seen for seen in ddps):
                ddps.append(ddp)
    return ddps
