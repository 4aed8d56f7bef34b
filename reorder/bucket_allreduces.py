"""Bucket the all-reduces of DDP's Python reducer, start them early, wait late.

With ``optimize_ddp = "python_reducer"``, DDP all-reduces each parameter's gradient
in a post-accumulate-grad hook that waits for it before returning: one collective
per parameter, none overlapping the backward.  The tracer marks each call of that
hook with what it reduces (``meta["gradfx_allreduce"]``).  This pass cuts the
graph's marked calls into buckets in their order, as DDP's C++ reducer cuts its
gradients (a smaller first bucket, then DDP's ``bucket_cap_mb``; one dtype and one
process group each), and replaces them by ``ddp_buckets.ready``: a bucket's one
all-reduce starts when its last member is ready.  A ``ddp_buckets.finish`` waits
for them and copies the sums into ``.grad`` just before the first node after them
that could read a ``.grad``: a hook, an opaque call, a check, the output.  Pure ops
and other leaves' accumulations cannot, so they run while the sums travel.

Before::

    accumulate_grad(w2, g_w2); call_post_accumulate_hook(ddp_hook, w2)
    g_h = mm(g, w2); g_w1 = mm(g_h, x)
    accumulate_grad(w1, g_w1); call_post_accumulate_hook(ddp_hook, w1)
    return ()

After (one bucket, its last member the ranks' trailer)::

    buckets = open_buckets(((n_w2 + n_w1 + 1, ((0, n_w2, float32, 0), (n_w2, n_w1, float32, 0),
                                               (n_w2 + n_w1, 1, float32, 0)), 0, ()),), 0)
    accumulate_grad(w2, g_w2); ready(buckets, 0, 0, ddp_hook, w2)
    g_h = mm(g, w2); g_w1 = mm(g_h, x)
    accumulate_grad(w1, g_w1); ready(buckets, 0, 1, ddp_hook, w1)   # starts the all-reduce
    finish(buckets)
    return ()

Over more than two gloo ranks a bucket's members are laid out so that its one
all-reduce adds each element in the order of the member's own (``gloo_ring``).
Every gradient stays eager's bit for bit (``capture.runtime.ddp_buckets`` says why);
:func:`unbucket` turns the calls back into the hook's for compilers that trace hooks.
"""

from __future__ import annotations

import itertools
import operator

import torch
import torch.fx as fx

from ..capture.runtime import ddp_buckets, gloo_ring, hook_ops, runtime_ops

_ACCUMULATIONS = (runtime_ops.accumulate_grad, runtime_ops.accumulate_grad_unchecked,
                  runtime_ops.accumulate_grad_create_graph)


def _marked(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is hook_ops.call_post_accumulate_hook
            and "gradfx_allreduce" in node.meta)


def _reads_no_grad(node: fx.Node) -> bool:
    """Can the node not read a leaf's ``.grad``?  Aten ops compute on the graph's values
    (a gradient accumulated by stealing has no later use), an accumulation writes its own
    leaf's, and the C++ hooks of a Python-reducer DDP's idle C++ reducer (marked by the
    tracer) do nothing; anything else that calls Python may read any."""
    if node.op in ("placeholder", "get_attr"):
        return True
    if node.op != "call_function":
        return False
    target = node.target
    return (isinstance(target, torch._ops.OpOverload) or target is operator.getitem or target in _ACCUMULATIONS
            or node.meta.get("gradfx_idle_reducer", False))


def bucket_allreduces(graph: fx.Graph) -> None:
    members: list = []  # marked calls since the last node that may read a .grad
    first = [True]  # the backward's first bucket takes DDP's smaller cap
    # One process group: each run of buckets' first bucket carries the ranks' trailer
    # (capture.runtime.ddp_agreement), one element more, summed as they all-reduce it;
    # the runs are numbered in the graph's order (None: no trailer).
    next_run = [0 if len({n.meta["gradfx_allreduce"].group for n in graph.nodes if _marked(n)}) == 1 else None]
    for node in list(graph.nodes):
        if _marked(node):
            members.append(node)
        elif members and not _reads_no_grad(node):
            _bucket(graph, members, node, first, next_run)
            members = []


def _plan(members: list, first: list) -> list:
    """Bucket index of each member: consecutive members of one dtype and group, a bucket
    closed once it holds its cap's bytes (the C++ reducer's rule)."""
    out = []
    bucket, size, key, cap = -1, 0, None, 0
    for node in members:
        p = node.meta["gradfx_allreduce"]
        if bucket < 0 or (p.dtype, p.group, p.ring) != key or size >= cap:
            bucket, size, key = bucket + 1, 0, (p.dtype, p.group, p.ring)
            cap = p.first_cap if first[0] else p.cap
            first[0] = False
        size += p.numel * p.dtype.itemsize
        out.append(bucket)
    return out


def _layout(planned: list) -> tuple:
    """One bucket's plan: (numel, (offset, numel, dtype, width) of each member, ring, gaps).
    Members follow each other (width 0), or, where the all-reduce is gloo's ring over more
    than two ranks, sit in the rows of a ``[ring, numel // ring]`` buffer that keep each
    one's order of additions (``capture.runtime.gloo_ring``), the unwritten ``gaps`` zeroed."""
    numels = [p.numel for p in planned]
    ring, dtype = planned[0].ring, planned[0].dtype
    if not ring:
        offsets = (0, *itertools.accumulate(numels))
        return sum(numels), tuple((o, n, dtype, 0) for o, n in zip(offsets, numels)), 0, ()
    row, places = gloo_ring.layout(numels, dtype.itemsize, ring)
    members = tuple((column, n, dtype, width) for (column, width), n in zip(places, numels))
    return ring * row, members, ring, gloo_ring.gaps(row, places, numels, ring)


def _bucket(graph: fx.Graph, members: list, before: fx.Node, first: list, next_run: list) -> None:
    where = _plan(members, first)
    planned = [[] for _ in range(where[-1] + 1)]
    slots = []
    for node, bucket in zip(members, where):
        slots.append((bucket, len(planned[bucket])))
        planned[bucket].append(node.meta["gradfx_allreduce"])
    segment = next_run[0]
    if segment is not None:  # the first bucket's last member, of one element
        planned[0].append(planned[0][0]._replace(numel=1))
        next_run[0] = segment + 1
    plan = tuple(_layout(each) for each in planned)
    # at the graph's start, after the runs opened before (a call that reads nothing, which
    # would cut a compiled region)
    with graph.inserting_before(next(n for n in graph.nodes
                                     if n.op != "placeholder" and n.target is not ddp_buckets.open_buckets)):
        state = graph.call_function(ddp_buckets.open_buckets, (plan, segment))
    _stamp(state, members[0])
    for node, (bucket, k) in zip(members, slots):
        hook, variable, running = node.args
        with graph.inserting_before(node):
            ready = graph.call_function(ddp_buckets.ready, (state, bucket, k, hook, variable, running))
        _stamp(ready, node)
        ready.meta["gradfx_allreduce"] = node.meta["gradfx_allreduce"]
        graph.erase_node(node)
    with graph.inserting_before(before):
        done = graph.call_function(ddp_buckets.finish, (state,))
    _stamp(done, members[-1])


def _stamp(new: fx.Node, like: fx.Node) -> None:
    new.meta["gradfx_kind"] = "hook"
    for key in ("gradfx_node", "gradfx_node_index"):
        if key in like.meta:
            new.meta[key] = like.meta[key]


def unbucket(graph: fx.Graph) -> None:
    """Undo :func:`bucket_allreduces`: each ``ready`` is the hook's call again, in its place."""
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is ddp_buckets.ready:
            _, _, _, hook, variable, running = node.args
            node.target = hook_ops.call_post_accumulate_hook
            node.args = (hook, variable, running)
        elif node.target is ddp_buckets.finish:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is ddp_buckets.open_buckets:
            graph.erase_node(node)
