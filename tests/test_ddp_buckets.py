"""DDP's Python reducer (``optimize_ddp = "python_reducer"``) with its all-reduces bucketed
by the ``bucket_allreduces`` pass, on gloo processes.

One spawn runs every case (a spawn costs seconds); each test reads its case.  Per case,
two DDP models built alike train side by side, one on the eager engine and one under
gradfx, and on every step and rank:
* gradients are bitwise equal, and so is what a user's hook sees;
* the collectives gradfx issues are the planned buckets' (counted), fewer than eager's
  one per parameter: over two ranks a bucket's sum is exact wherever a value sits, over
  three and four the bucket is laid out in gloo's ring order (``gloo_ring``), whose rule
  is checked on its own against gloo's all-reduce of each tensor alone;
* no fallback warning (the block is strict about it).
Under a compiling backend, the calls that complete no bucket run after their region and
the call completing a bucket cuts it (``PIECES``), while no comm hook makes DDP's hook
run user code; one registered later changes the structure.
"""


import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import MaybeNone, backward, case_backend, gloo_group, record_cases, spawn_ranks, split_pieces, Wide

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


class Branches(nn.Module):
    """``b`` and the head reduce before the stop, ``a`` (behind MaybeNone) after it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        h = MaybeNone.apply(self.a(x))
        return self.head(torch.relu(self.b(x)) + h)


class SharedBranches(Branches):
    """Branches whose ``a`` also reaches the head around MaybeNone: where the custom
    backward gives None on one rank alone, ``a`` still gets a gradient there, and eager
    DDP's all-reduces still pair up."""

    def forward(self, x):
        y = self.a(x)
        # MaybeNone's None reaches the product's formula: the graph stops there
        return self.head(torch.relu(self.b(x)) + MaybeNone.apply(y * 2) + y)


class Convs(nn.Module):
    """Convolutions in channels_last: their weights' gradients are not contiguous, and a
    bucket reads and writes them in their logical order, as the hook's all-reduce adds."""

    def __init__(self):
        super().__init__()
        self.first = nn.Conv2d(8, 16, 3, padding=1)
        self.second = nn.Conv2d(16, 8, 3, padding=1)
        self.head = nn.Linear(8, 4)

    def forward(self, x):  # x: (4, 8, 32), seen as 4 images of 8 channels, 4 x 8
        images = x.reshape(4, 8, 4, 8).contiguous(memory_format=torch.channels_last)
        return self.head(self.second(torch.relu(self.first(images))).mean((2, 3)))


class TwoDDPs(nn.Module):
    """Net's encoder and head, each its own DDP (Python reducer) on the default group: one
    backward reaches both, so the ranks exchange on every backward (``ddp_agreement``).
    Built under ``optimize_ddp = "python_reducer"``; seen by the steps as one DDP."""

    def __init__(self):
        super().__init__()
        from torch.nn.parallel import DistributedDataParallel as DDP
        net = Net()
        self.module = net
        self.parts = nn.ModuleList([DDP(net.encoder), DDP(net.head)])

    def forward(self, x):
        return self.parts[1](self.parts[0](x))

    def no_sync(self):
        import contextlib
        stack = contextlib.ExitStack()
        for part in self.parts:
            stack.enter_context(part.no_sync())
        return stack


class CollectiveHook(Net):
    """Net whose encoder output has a hook that broadcasts a sum of its gradient from rank 0
    and adds it in: a collective of the user's among DDP's all-reduces, which each rank
    must issue at the same place in their order, whatever path each backward takes."""

    def forward(self, x):
        h = self.encoder(x)
        if h.requires_grad:
            h.register_hook(_broadcast_sum)
        return self.head(h)


def _broadcast_sum(grad):
    total = grad.sum().reshape(1)
    dist.broadcast(total, 0)
    return grad + total * 1e-3


MODELS = {"net": Net, "collective_hook": CollectiveHook, "branches": Branches, "shared_branches": SharedBranches, "convs": Convs, "wide": lambda: Wide(32), "two_ddps": TwoDDPs}


def _build(case, seen):
    import torch._inductor.config as inductor_config
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    saved = (inductor_config._fuse_ddp_communication, inductor_config._fuse_ddp_bucket_size)
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        module = MODELS[case.get("model", "net")]()
        if case.get("model") == "convs":
            module = module.to(memory_format=torch.channels_last)
        model = module if isinstance(module, TwoDDPs) else DDP(module, **case.get("ddp", {}))
    inductor_config._fuse_ddp_communication, inductor_config._fuse_ddp_bucket_size = saved
    if case.get("user_hook") or (dist.get_rank() in case.get("user_hook_ranks", ()) and "user_hook_at" not in case):
        _add_user_hook(model, seen)
    if case.get("comm_hook"):
        _add_comm_hook(model, seen)
    return model


def _add_user_hook(model, seen):
    """On a middle parameter, after DDP's own hook: it sees every .grad DDP has reduced so far."""
    params = list(model.module.parameters())

    def look(p):
        seen.append([None if q.grad is None else q.grad.clone() for q in params])
    model.module.encoder.linear1.weight.register_post_accumulate_grad_hook(look)


def _add_comm_hook(model, seen):
    def mean(state, grad_and_param):  # the Python reducer hands a comm hook (grad, param)
        grad, _ = grad_and_param
        seen.append(grad.clone())
        dist.all_reduce(grad)
        grad.div_(dist.get_world_size())
    model._comm_hooks.append((mean, None))  # what register_comm_hook does in this mode


class _Counted:
    """Counts the all-reduces started by ``dist.all_reduce`` (gradfx's buckets) and by
    functional collectives (the hook's own, one per parameter)."""

    def __init__(self):
        import torch.distributed._functional_collectives as fcol
        self.modules = ((dist, dist.all_reduce), (fcol, fcol.all_reduce))
        self.counts = [0, 0]

    def __enter__(self):
        for k, (module, real) in enumerate(self.modules):
            def counting(*args, k=k, real=real, **kwargs):
                self.counts[k] += 1
                return real(*args, **kwargs)
            module.all_reduce = counting
        return self

    def __exit__(self, *exc):
        for module, real in self.modules:
            module.all_reduce = real


def _run_case(rank, case):
    import gradfx
    from gradfx.capture.runtime import ddp_buckets
    from gradfx.capture import native
    divide_into, ready_native = ddp_buckets.DIVIDE_INTO, ddp_buckets.ready_native
    ddp_buckets.DIVIDE_INTO = case.get("divide_into", divide_into)
    readies = []  # what the eager backend's code calls for each ready

    def recorded():
        fn = ready_native()
        readies.append(fn.__name__)
        return fn
    ddp_buckets.ready_native = recorded
    native.wait()  # loaded now, as the parent has it: its ring copies are bound
    ring_fill, ring_read = ddp_buckets._ring_fill, ddp_buckets._ring_read
    ring_copies = set()  # (which, the compiled part's answer) of a ring bucket's copies

    def answered(name, fn):
        def copy(*args):
            answer = fn(*args)
            ring_copies.add((name, answer))
            return answer
        return copy
    if ring_fill is not None:
        ddp_buckets._ring_fill, ddp_buckets._ring_read = answered("fill", ring_fill), answered("read", ring_read)
    try:
        with split_pieces(_ready_calls) as pieces:  # per graph a split backend compiled
            runs = {under_gradfx: _steps(rank, case, under_gradfx) for under_gradfx in (False, True)}
    finally:
        ddp_buckets.DIVIDE_INTO, ddp_buckets.ready_native = divide_into, ready_native
        ddp_buckets._ring_fill, ddp_buckets._ring_read = ring_fill, ring_read
    (eager, eager_collectives, _), (captured, gradfx_collectives, model) = runs[False], runs[True]
    return {"pieces": pieces, "equal": len(eager) == len(captured) and all(_same(a, b) for a, b in zip(eager, captured)),
            "eager_collectives": eager_collectives, "gradfx_collectives": gradfx_collectives,
            "params": len(list(model.parameters())), "stats": gradfx.stats(),
            "last_grads": [p.grad.tolist() for p in model.module.parameters()],
            "readies": set(readies), "native": native.module() is not None, "ring_copies": ring_copies}


def _steps(rank, case, under_gradfx) -> tuple:
    """(what a hook saw and the gradients, per step; the collectives per step; the model)."""
    import gradfx
    backend = case_backend(case)
    seen, collectives = [], []
    model = _build(case, seen)
    for it in range(STEPS):
        if it == case.get("comm_hook_at"):
            _add_comm_hook(model, seen)
        if it == case.get("user_hook_at") and rank in case.get("user_hook_ranks", (0, 1)):
            _add_user_hook(model, seen)
        torch.manual_seed(100 * rank + it)
        x = torch.randn(4, 8, 32)
        sync = not (case.get("no_sync") and it == 0)
        if sync and it != 1:  # no_sync: the synced step adds to the step before
            model.zero_grad()
        MaybeNone.drop = case.get("stop", False) and it == case.get("stop_step", 1) \
            and rank in case.get("stop_ranks", range(dist.get_world_size()))
        with (model.no_sync() if not sync else torch.enable_grad()):
            loss = model(x).square().sum()
            with _Counted() as counted:
                if under_gradfx and rank in case.get("fallback_ranks", ()) \
                        and it in case.get("fallback_steps", range(STEPS)):
                    # anomaly mode: gradfx hands this rank's backward to the eager engine
                    with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True):
                        warnings.simplefilter("ignore", gradfx.FallbackWarning)
                        with gradfx.compiled_autograd(backend):
                            loss.backward()
                else:
                    backward(loss, under_gradfx, backend)
        collectives.append(tuple(counted.counts))
        seen.append([None if p.grad is None else p.grad.clone() for p in model.module.parameters()])
    return seen, collectives, model


def _ready_calls(nodes) -> int:
    from gradfx.capture.runtime import ddp_buckets
    return sum(n.target is ddp_buckets.ready for n in nodes)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return len(a) == len(b) and all((x is None and y is None) or _same(x, y) for x, y in zip(a, b))


CASES = {
    "one_bucket": {},  # DDP's caps (1 MB first, 25 MB): the whole model in one bucket
    "buckets": {"ddp": {"bucket_cap_mb": 0.004}},  # 4 KB: several
    "no_sync": {"no_sync": True, "ddp": {"bucket_cap_mb": 0.004}},
    "user_hook_reads_grads": {"user_hook": True},
    "comm_hook": {"comm_hook": True},
    # channels_last weights: gradients that are not contiguous, in one bucket and in several
    "channels_last": {"model": "convs"},
    "channels_last_buckets": {"model": "convs", "ddp": {"bucket_cap_mb": 0.004}},
    "users_backend": {"backend": "gm"},
    # a compiling backend: the calls that complete no bucket run after the region with
    # the accumulations, the one completing a bucket cuts it (PIECES)
    "aot_eager": {"backend": "aot_eager", "model": "wide"},
    # a comm hook comes in the third step: the hook's calls run user code now, so the
    # structure key changed and the new graph calls each in its place
    "aot_eager_comm_hook_later": {"backend": "aot_eager", "model": "wide", "comm_hook_at": 2},
    # the graph stops in the second step (a custom backward's None): what is bucketed
    # before the stop is reduced before the rest runs node by node
    "stop": {"stop": True, "model": "branches"},
    # each gradient divided straight into its bucket, as larger members are (DIVIDE_INTO)
    "buckets_divided_into": {"ddp": {"bucket_cap_mb": 0.004}, "divide_into": 1},
    "stop_divided_into": {"stop": True, "model": "branches", "divide_into": 1},
    # Ranks on different paths: rank 0 captures buckets, rank 1 runs the eager engine (one
    # all-reduce per parameter) or a graph cut elsewhere by its own hook.  Told by the
    # ranks' exchange, every rank all-reduces each parameter alone, as eager does.
    "one_rank_falls_back": {"ddp": {"bucket_cap_mb": 0.004}, "fallback_ranks": (1,)},
    "one_rank_cuts_elsewhere": {"user_hook_ranks": (1,)},
    # The same after two steps of buckets the ranks agreed on: the first bucket carries the
    # trailer, the rank that turns away sends a dummy of its size instead, and they exchange.
    "one_rank_falls_back_later": {"ddp": {"bucket_cap_mb": 0.004}, "fallback_ranks": (1,), "fallback_steps": (2,)},
    "one_rank_cuts_elsewhere_later": {"user_hook_ranks": (1,), "user_hook_at": 2},
    # every rank turns to another plan at once: after the dummy, they agree on the new one
    "all_ranks_cut_elsewhere_later": {"user_hook_at": 2},
    # one backward reaching two DDPs: an exchange every time, rank 1 on the eager engine at last
    "two_ddps_falls_back_later": {"model": "two_ddps", "fallback_ranks": (1,), "fallback_steps": (2,)},
    # a compiling backend: the calls that complete no bucket run after their region
    "aot_eager_falls_back_later": {"backend": "aot_eager", "model": "wide", "fallback_ranks": (1,),
                                   "fallback_steps": (2,)},
    # the graph stops on rank 1 alone, the ranks agreed by the exchange (first step) or by
    # the trailer (third): rank 1 sends zeros for the next run's first bucket, and every
    # rank all-reduces the rest alone
    "stop_on_one_rank_first": {"stop": True, "model": "shared_branches", "stop_ranks": (1,), "stop_step": 0},
    "stop_on_one_rank_later": {"stop": True, "model": "shared_branches", "stop_ranks": (1,), "stop_step": 2},
    # a user's hook with a collective of its own between the buckets: what is pending goes out
    # before it on every rank, on every path
    "collective_hook": {"model": "collective_hook", "ddp": {"bucket_cap_mb": 0.004}},
    "collective_hook_falls_back": {"model": "collective_hook", "ddp": {"bucket_cap_mb": 0.004},
                                   "fallback_ranks": (1,)},
    "collective_hook_falls_back_later": {"model": "collective_hook", "ddp": {"bucket_cap_mb": 0.004},
                                         "fallback_ranks": (1,), "fallback_steps": (2,)},
}
# The collectives each rank issues where ranks take different paths: (buckets, alone) per step.
# The eager engine's rank: one per parameter (functional collectives); the bucketing rank: the
# run's buckets (the rank that turned away sends zeros for each, not counted), then one per
# parameter.
TURNING = {"one_rank_falls_back_later": lambda params: [[(4, 0), (4, 0), (4, params)], [(4, 0), (4, 0), (0, params)]],
           "one_rank_cuts_elsewhere_later": lambda params: [[(1, 0), (1, 0), (1, params)], [(1, 0), (1, 0), (0, params)]],
           "all_ranks_cut_elsewhere_later": lambda params: [[(1, 0), (1, 0), (2, 0)], [(1, 0), (1, 0), (2, 0)]],
           # the exchange says no: no bucket goes out on any rank
           "two_ddps_falls_back_later": lambda params: [[(1, 0), (1, 0), (0, params)], [(1, 0), (1, 0), (0, params)]],
           "aot_eager_falls_back_later": lambda params: [[(2, 0), (2, 0), (2, params)], [(2, 0), (2, 0), (0, params)]],
           # the trailer's bucket goes out before the user's broadcast, the rest alone after the exchange
           "collective_hook_falls_back_later": lambda params: [[(5, 0), (5, 0), (1, params)],
                                                               [(5, 0), (5, 0), (0, params)]]}
MORE_RANK_CASES = {"buckets": CASES["buckets"], "one_bucket": CASES["one_bucket"], "stop": CASES["stop"],
                   "channels_last": {"model": "convs", "ddp": {"bucket_cap_mb": 0.004}},
                   "channels_last_divided_into": {"model": "convs", "ddp": {"bucket_cap_mb": 0.004}, "divide_into": 1},
                   "stop_divided_into": CASES["stop_divided_into"], "one_rank_falls_back": CASES["one_rank_falls_back"],
                   "one_rank_falls_back_later": CASES["one_rank_falls_back_later"],
                   "stop_on_one_rank_later": CASES["stop_on_one_rank_later"]}


def _worker(rank, world, port, cases, results):
    with gloo_group(rank, world, port):
        record_cases(results, rank, cases, _run_case)


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, 2, CASES)


def _check_common(results, name, world):
    for rank in range(world):
        got = results[(name, rank)]
        assert "error" not in got, got.get("error")
        assert got["equal"], f"rank {rank}: gradients (or what a hook saw) differ from eager's"
        stats = got["stats"]
        case = CASES.get(name, {})
        if rank in case.get("fallback_ranks", ()):
            steps = len(case.get("fallback_steps", range(STEPS)))
            assert stats["fallbacks"] == steps and stats["captures"] == (0 if steps == STEPS else 1), stats
        elif "user_hook_at" in case and rank in case.get("user_hook_ranks", (0, 1)):  # its new hook: a new key
            assert stats["fallbacks"] == 0 and stats["captures"] == 2 and stats["cache_hits"] == STEPS - 2, stats
        elif name.startswith("stop"):  # the stop teaches the cache that the custom backward may give None
            assert stats["fallbacks"] == 0 and stats["captures"] + stats["cache_hits"] == STEPS, stats
        elif "comm_hook_at" in CASES.get(name, {}):  # the hook's new comm hook changed the key
            assert stats["fallbacks"] == 0 and stats["captures"] == 2 and stats["cache_hits"] == STEPS - 2, stats
        else:
            assert stats["fallbacks"] == 0 and stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1, stats
        if "comm_hook" not in name and name != "no_sync":
            assert got["eager_collectives"] == [(0, got["params"])] * STEPS, got["eager_collectives"]
    # the reducer did reduce: every rank ends with the same gradients
    assert all(results[(name, r)]["last_grads"] == results[(name, 0)]["last_grads"] for r in range(world))
    return [results[(name, r)]["gradfx_collectives"] for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_python_reducer_buckets_equal_eager(results, name):
    per_rank = _check_common(results, name, 2)
    params = results[(name, 0)]["params"]
    if name in TURNING:
        assert per_rank == TURNING[name](params), per_rank
        return
    if case_backend(CASES[name]) == "eager" and "comm_hook" not in name:
        # the eager backend's graphs call the compiled part's ready (its common case in C++)
        got = results[(name, 0)]
        assert got["readies"] == ({"bucket_ready_native"} if got["native"] else {"ready"}), got["readies"]
    if name.startswith("stop_on_one_rank"):
        _check_one_rank_stopped(name, per_rank)
        return
    assert per_rank[0] == per_rank[1]  # the ranks' collectives pair up
    collectives = per_rank[0]
    if name == "one_bucket":
        assert collectives == [(1, 0)] * STEPS
    elif name == "buckets_divided_into":
        assert collectives == results[("buckets", 0)]["gradfx_collectives"], collectives
    elif name == "comm_hook":
        assert collectives == results[(name, 0)]["eager_collectives"] == [(params, 0)] * STEPS  # the hook's own
    elif name in ("buckets", "collective_hook"):
        assert all(1 < buckets < params and alone == 0 for buckets, alone in collectives), collectives
    elif name == "no_sync":
        assert collectives[0] == (0, 0) and collectives[1][0] > 1, collectives  # nothing reduced under no_sync
    elif name == "user_hook_reads_grads":
        # the user's hook waits for what is pending: one bucket before it, one after
        assert collectives == [(2, 0)] * STEPS, collectives
    elif name == "users_backend":
        assert collectives == [(0, params)] * STEPS  # a compiler traces DDP's hook as it is
    elif name == "aot_eager":
        assert collectives == [(2, 0)] * STEPS, collectives
    elif name == "aot_eager_comm_hook_later":  # the comm hook's own all-reduces, one per parameter
        assert collectives == [(2, 0), (2, 0), (params, 0)], collectives
    elif name in ("one_rank_falls_back", "one_rank_cuts_elsewhere", "collective_hook_falls_back"):
        assert collectives == [(0, params)] * STEPS, collectives  # each parameter alone, on every rank


def _check_one_rank_stopped(name, per_rank) -> None:
    """Rank 1's graph stopped at its case's step: the steps before pair up bucket for bucket;
    at the stop it sends zeros (not counted) for the buckets of the run the others start
    next, then every rank all-reduces the rest alone, one per parameter each."""
    stop = CASES[name]["stop_step"]
    assert all(p[:stop] == per_rank[0][:stop] for p in per_rank), per_rank
    others = [p[stop] for r, p in enumerate(per_rank) if r != 1]
    stopped = per_rank[1][stop]
    assert all(o[0] > stopped[0] and o[1] == stopped[1] > 0 for o in others), per_rank


# The pieces the split backend cut each compiled graph into: (kind, bucketed calls in it).
# Wide's parameters in the order their gradients are ready: c.bias, c.weight, b.bias,
# b.weight (the first bucket, 1 MiB, is full), a.bias, a.weight.  Every graph starts with
# the buckets' opening (Python) and its first region.
PIECES = {
    # the calls completing each bucket cut; the three before b.weight's run after its region
    "aot_eager": [[("python", 0), ("region", 0), ("python", 4), ("region", 0), ("python", 2)]],
    # with a comm hook (user code) each call stays where eager makes it: a cut per layer
    # (a bias's and its weight's calls have no op between them)
    "aot_eager_comm_hook_later": [[("python", 0), ("region", 0), ("python", 4), ("region", 0), ("python", 2)],
                                  [("python", 0), ("region", 0), ("python", 2), ("region", 0), ("python", 2),
                                   ("region", 0), ("python", 2)]],
}


@pytest.mark.parametrize("name", list(PIECES))
def test_python_reducer_calls_cut_a_compiled_backward_once_per_bucket(results, name):
    for rank in (0, 1):
        assert results[(name, rank)]["pieces"] == PIECES[name], results[(name, rank)]["pieces"]


# Sizes around gloo's pieces: smaller than the ranks, odd, one of 10.8 MB (three pieces per
# rank over four ranks), and a bucket of about 13 MB (four pieces per rank)
RING_SIZES = (0, 1, 3, 5, 11, 100, 1000, 65536, 600001, 2700001)


def _order_revealing(world, dtype):
    """One value per rank whose sums, started at each rank and run down the ring, all
    differ: a tensor holding them everywhere shows, at every element, where its sum began."""
    import random
    pick = random.Random(world)
    bits = {torch.float32: 24, torch.float64: 53}[dtype]  # significand bits
    while True:
        values = torch.tensor([pick.choice((1, -1)) * 2.0 ** pick.randint(0, bits + 2) + pick.choice((0, 1, 3))
                               for _ in range(world)], dtype=dtype)
        if len(set(_ring_sum(values, s).item() for s in range(world))) == world:
            return values


def _ring_sum(values, start):
    """The sum of ``values[r]`` (a tensor per rank, or one value each) as gloo's ring adds a
    chunk whose sum starts at rank ``start``: ``start``, ``start - 1``, ... down the ring."""
    world = len(values)
    total = values[start]
    for k in range(1, world):
        total = total + values[(start - k) % world]
    return total


def _ring_layout_case(rank):
    """The rule of ``gloo_ring`` against gloo's all-reduce: each tensor all-reduced alone
    starts each chunk's sum where ``chunk_length`` says, and the same tensors in one buffer
    laid out by ``layout`` sum bitwise as alone, where a buffer of them one after another
    does not.  Values that reveal each element's order, and random ones (each member's
    place)."""
    from gradfx.capture.runtime import gloo_ring
    world = dist.get_world_size()
    assert gloo_ring.ranks_of(dist.group.WORLD, torch.device("cpu")) == world
    out = {}
    for dtype in (torch.float32, torch.float64):
        sizes = RING_SIZES if dtype is torch.float32 else RING_SIZES[:-2]
        revealing = _order_revealing(world, dtype)
        g = torch.Generator().manual_seed(rank)
        for kind in ("revealing", "random"):
            if kind == "revealing":
                xs = [torch.full((n,), revealing[rank].item(), dtype=dtype) for n in sizes]
            else:
                xs = [torch.randn(n, generator=g, dtype=dtype) for n in sizes]
            alone = [x.clone() for x in xs]
            for x in alone:
                dist.all_reduce(x)
            row, places = gloo_ring.layout(sizes, dtype.itemsize, world)
            flat = torch.full((world * row,), float("nan"), dtype=dtype)
            for begin, stop in gloo_ring.gaps(row, places, sizes, world):
                flat[begin:stop] = 0
            rows = flat.view(world, row)
            for x, (column, width) in zip(xs, places):
                full, rest = divmod(x.numel(), width) if width else (0, 0)
                rows[:full, column:column + width] = x[:full * width].view(full, width)
                if rest:
                    rows[full, column:column + rest] = x[full * width:]
            covered = not flat.isnan().any()
            dist.all_reduce(flat)
            together = []
            for x, (column, width) in zip(xs, places):
                full, rest = divmod(x.numel(), width) if width else (0, 0)
                together.append(torch.cat([rows[:full, column:column + width].reshape(-1),
                                           rows[full, column:column + rest] if rest else rows[:0, 0]]))
            following = torch.cat([x.reshape(-1) for x in xs])
            dist.all_reduce(following)
            got = {"covered": covered, "differ": _differ(sizes, alone, together),
                   "following_differ": _differ(sizes, alone, following.split(list(sizes)))}
            if kind == "revealing":
                sums = torch.stack([_ring_sum(revealing, s) for s in range(world)])
                expected = [sums[(torch.arange(n) // max(gloo_ring.chunk_length(n, dtype.itemsize, world), 1)
                                  + world - 1) % world] for n in sizes]
                got["rule_differs"] = _differ(sizes, alone, expected)
            out[f"{dtype} {kind}"] = got
    return out


def _differ(sizes, a, b) -> list:
    return [n for n, x, y in zip(sizes, a, b) if not torch.equal(x, y)]


def _more_ranks_worker(rank, world, port, cases, results):
    with gloo_group(rank, world, port):
        record_cases(results, rank, cases, _run_case)
        results[("ring_layout", rank)] = _ring_layout_case(rank)


@pytest.mark.parametrize("world", [3, 4])
def test_more_ranks_buckets_keep_each_parameters_order(world):
    """Over three and four ranks the buckets add every gradient in the order of its own
    all-reduce: bitwise eager's, with one collective per bucket."""
    results = spawn_ranks(_more_ranks_worker, world, MORE_RANK_CASES)
    for name in MORE_RANK_CASES:
        per_rank = _check_common(results, name, world)
        params = results[(name, 0)]["params"]
        if name in TURNING:  # rank 1 on the eager engine; the others bucket, read the trailer, go alone
            bucketing, eager = TURNING[name](params)
            assert per_rank == [eager if r == 1 else bucketing for r in range(world)], per_rank
            continue
        if name.startswith("stop_on_one_rank"):
            _check_one_rank_stopped(name, per_rank)
            continue
        assert all(p == per_rank[0] for p in per_rank), (name, per_rank)
        got = results[(name, 0)]
        if name in ("buckets", "one_bucket") and got["native"]:  # float gradients: the compiled part copies
            assert got["ring_copies"] == {("fill", True), ("read", True)}, got["ring_copies"]
        elif name.startswith("channels_last") and got["native"]:  # buckets of strided ones: the reference
            assert {("fill", False), ("read", False)} <= got["ring_copies"], got["ring_copies"]
        if name == "one_bucket":
            assert per_rank[0] == [(1, 0)] * STEPS
        elif name in ("buckets", "channels_last", "channels_last_divided_into"):
            assert all(1 < buckets < params and alone == 0 for buckets, alone in per_rank[0]), per_rank[0]
        elif name == "one_rank_falls_back":
            assert per_rank[0] == [(0, params)] * STEPS, per_rank[0]
        else:  # the stop: the bucket open there is reduced as it is, the members after it alone
            assert per_rank[0][1][0] >= 1 and per_rank[0][1][1] > 0, per_rank[0]
    for rank in range(world):
        for what, got in results[("ring_layout", rank)].items():
            assert got["covered"] and got["differ"] == [] and got.get("rule_differs", []) == [], (rank, what, got)
            assert got["following_differ"], (rank, what, got)  # the order does matter


def test_ring_layout_only_where_the_gloo_order_was_checked(monkeypatch):
    """On a torch release the suite has not checked gloo's ring order on, a bucket over
    more than two ranks is not laid out by it: each parameter keeps its own all-reduce."""
    from types import SimpleNamespace

    from gradfx.capture import torch_releases
    from gradfx.capture.runtime import gloo_ring

    class Gloo:
        pass

    monkeypatch.setattr(dist, "ProcessGroupGloo", Gloo)
    group = SimpleNamespace(size=lambda: 3, _get_backend=lambda device: Gloo())
    assert gloo_ring.ranks_of(group, torch.device("cpu")) == (3 if torch_releases.TESTED_RELEASE else 0)
    assert gloo_ring.ranks_of(group, torch.device("meta")) == 0
    monkeypatch.setattr(torch_releases, "GLOO_RING_ORDER_KNOWN", False)
    assert gloo_ring.ranks_of(group, torch.device("cpu")) == 0


@pytest.mark.parametrize("dtype, ranks, kept", [(torch.float32, 4, True), (torch.bfloat16, 256, True),
                                                (torch.bfloat16, 257, False), (torch.float16, 2049, False)])
def test_a_trailer_is_relied_on_only_where_its_count_is_exact(dtype, ranks, kept):
    """The trailer sums one 1 per rank in the bucket's dtype: past 256 ranks in bfloat16
    (2048 in half) a rank's 0 could round to a full count, so a full count there reads as
    "not all": the ranks all-reduce alone rather than trust it."""
    from gradfx.capture.runtime import ddp_agreement

    ddp = nn.Linear(1, 1)  # stands for the DDP the agreement is kept under
    agreement = ddp_agreement.Agreement(7, ddp, [None], ddp, [])
    all_sent = agreement.trailer(float(ranks), ranks, dtype,
                                 ddp_agreement.FirstRun(7, ((10, dtype),), torch.device("cpu")))
    assert all_sent is kept and agreement.answer is kept
    assert (ddp in ddp_agreement.agreed) is kept
    ddp_agreement.agreed.pop(ddp, None)
