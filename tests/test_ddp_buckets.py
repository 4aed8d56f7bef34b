"""DDP's Python reducer (``optimize_ddp = "python_reducer"``) with its all-reduces bucketed
by the ``bucket_allreduces`` pass, on gloo processes.

One spawn runs every case (a spawn costs seconds); each test reads its case.  Per case,
two DDP models built alike train side by side, one on the eager engine and one under
gradfx, and on every step and rank:
* gradients are bitwise equal, and so is what a user's hook sees;
* the collectives gradfx issues are the planned buckets' (counted), fewer than eager's
  one per parameter, where two ranks make a bucket's sum exact; over three ranks each
  parameter's all-reduce is its own, as eager's;
* no fallback warning (the block is strict about it).
"""


import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import backward, case_backend, gloo_group, record_cases, spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

STEPS = 3


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.encoder(x))


class MaybeNone(torch.autograd.Function):
    """Identity whose backward returns None while ``drop`` is set: the graph, traced with a
    gradient there, stops at run time and the rest of the backward runs node by node."""
    drop = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None if MaybeNone.drop else grad


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


def _build(case, seen):
    import torch._inductor.config as inductor_config
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    saved = (inductor_config._fuse_ddp_communication, inductor_config._fuse_ddp_bucket_size)
    with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
        model = DDP(Branches() if case.get("stop") else Net(), **case.get("ddp", {}))
    inductor_config._fuse_ddp_communication, inductor_config._fuse_ddp_bucket_size = saved
    if case.get("user_hook"):
        # on a middle parameter, after DDP's own hook: it sees every .grad DDP has reduced so far
        params = list(model.module.parameters())

        def look(p):
            seen.append([None if q.grad is None else q.grad.clone() for q in params])
        model.module.encoder.linear1.weight.register_post_accumulate_grad_hook(look)
    if case.get("comm_hook"):
        def mean(state, grad_and_param):  # the Python reducer hands a comm hook (grad, param)
            grad, _ = grad_and_param
            seen.append(grad.clone())
            dist.all_reduce(grad)
            grad.div_(dist.get_world_size())
        model._comm_hooks.append((mean, None))  # what register_comm_hook does in this mode
    return model


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
    backend = case_backend(case)
    runs = {}
    for under_gradfx in (False, True):
        seen, collectives = [], []
        model = _build(case, seen)
        for it in range(STEPS):
            torch.manual_seed(100 * rank + it)
            x = torch.randn(4, 8, 32)
            sync = not (case.get("no_sync") and it == 0)
            if sync and it != 1:  # no_sync: the synced step adds to the step before
                model.zero_grad()
            MaybeNone.drop = case.get("stop", False) and it == 1
            with (model.no_sync() if not sync else torch.enable_grad()):
                loss = model(x).square().sum()
                with _Counted() as counted:
                    backward(loss, under_gradfx, backend)
            collectives.append(tuple(counted.counts))
            seen.append([None if p.grad is None else p.grad.clone() for p in model.module.parameters()])
        runs[under_gradfx] = (seen, collectives)
    (eager, eager_collectives), (captured, gradfx_collectives) = runs[False], runs[True]
    return {"equal": len(eager) == len(captured) and all(_same(a, b) for a, b in zip(eager, captured)),
            "eager_collectives": eager_collectives, "gradfx_collectives": gradfx_collectives,
            "params": len(list(model.parameters())), "stats": gradfx.stats(),
            "last_grads": [p.grad.tolist() for p in model.module.parameters()]}


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
    "users_backend": {"backend": "gm"},
    "aot_eager": {"backend": "aot_eager", "ddp": {"bucket_cap_mb": 0.004}},
    # the graph stops in the second step (a custom backward's None): what is bucketed
    # before the stop is reduced before the rest runs node by node
    "stop": {"stop": True},
}
THREE_RANK_CASES = {"buckets": CASES["buckets"]}


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
        if name == "stop":  # the stop teaches the cache that the custom backward may give None
            assert stats["fallbacks"] == 0 and stats["captures"] + stats["cache_hits"] == STEPS, stats
        else:
            assert stats["fallbacks"] == 0 and stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1, stats
        if name not in ("no_sync", "comm_hook"):
            assert got["eager_collectives"] == [(0, got["params"])] * STEPS, got["eager_collectives"]
    # the reducer did reduce: every rank ends with the same gradients
    assert all(results[(name, r)]["last_grads"] == results[(name, 0)]["last_grads"] for r in range(world))
    return [results[(name, r)]["gradfx_collectives"] for r in range(world)]


@pytest.mark.parametrize("name", list(CASES))
def test_python_reducer_buckets_equal_eager(results, name):
    per_rank = _check_common(results, name, 2)
    assert per_rank[0] == per_rank[1]  # the ranks' collectives pair up
    collectives = per_rank[0]
    params = results[(name, 0)]["params"]
    if name == "one_bucket":
        assert collectives == [(1, 0)] * STEPS
    elif name == "comm_hook":
        assert collectives == results[(name, 0)]["eager_collectives"] == [(params, 0)] * STEPS  # the hook's own
    elif name == "buckets":
        assert all(1 < buckets < params and alone == 0 for buckets, alone in collectives), collectives
    elif name == "no_sync":
        assert collectives[0] == (0, 0) and collectives[1][0] > 1, collectives  # nothing reduced under no_sync
    elif name == "user_hook_reads_grads":
        # the user's hook waits for what is pending: one bucket before it, one after
        assert collectives == [(2, 0)] * STEPS, collectives
    elif name == "users_backend":
        assert collectives == [(0, params)] * STEPS  # a compiler traces DDP's hook as it is
    elif name == "aot_eager":
        assert all(buckets > 1 and alone == 0 for buckets, alone in collectives), collectives


def test_three_ranks_reduce_each_parameter_alone():
    """Over three ranks a bucket's sum would add in another order than each parameter's:
    gradfx starts the hook's own all-reduces early instead, and stays bitwise."""
    results = spawn_ranks(_worker, 3, THREE_RANK_CASES)
    per_rank = _check_common(results, "buckets", 3)
    params = results[("buckets", 0)]["params"]
    assert per_rank[0] == [(0, params)] * STEPS
