"""DDP's default C++ reducer inside a gradfx block, 2 gloo processes.

One spawn runs every case (a spawn costs seconds); each test reads its case.  Per case,
two DDP models built alike train side by side, one under eager autograd and one
under gradfx, and on every step and rank:
* gradients are bitwise equal (the eager backend and a user's own backend);
* the events are the same, in the same order: each parameter's post-accumulate-grad
  hook (eager runs the reducer's C++ hook right after it), each bucket's comm hook
  call (when the reducer launches the bucket, and the node running then) and a final callback queued from Python
  in an output hook, with the gradients it sees (before the reducer's own final
  callback, queued later, copies the reduced buckets back: a callback order that
  differed would show);
* no fallback warning (the block is strict about it).
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import backward, case_backend, gloo_group, record_cases, spawn_ranks, split_pieces, Wide

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

STEPS = 4  # past the first iteration: DDP rebuilds its buckets in the order hooks ran


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)
        self.spare = nn.Linear(32, 4)

    def forward(self, x, use_spare=True):
        h = torch.relu(self.b(torch.relu(self.a(x))))
        out = self.c(h)
        return out + self.spare(h) if use_spare else out


class Shared(nn.Module):
    """Two parameters handed one gradient (an add's): the second's accumulation reads the
    tensor the first's reducer call is passed, so that call may not move past it."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.w1 = nn.Parameter(torch.randn(32, 4) / 8)
        self.w2 = nn.Parameter(torch.randn(32, 4) / 8)

    def forward(self, x, use_spare=True):
        return torch.relu(self.a(x)) @ (self.w1 + self.w2)


MODELS = {"net": Net, "wide": lambda: Wide(16), "shared": Shared}


def _comm_hook(kind, events):
    """A comm hook that notes each bucket it is handed, then reduces it as ``kind`` says."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2, random_seed=0)
        inner = powerSGD_hook.powerSGD_hook
    else:
        state = None
        inner = default_hooks.fp16_compress_hook if kind == "fp16" else default_hooks.allreduce_hook

    def hook(state, bucket):
        # the node running, as eager answers it: the accumulator whose hook launched the bucket
        running = torch._C._current_autograd_node()
        events.append(("bucket", bucket.index(), [tuple(p.shape) for p in bucket.parameters()],
                       type(running).__name__, tuple(running.variable.shape)))
        return inner(state, bucket)
    return state, hook


def _build(case, events):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    options = {"bucket_cap_mb": 0.004, **case.get("ddp", {})}  # 4 KB: several buckets
    model = DDP(MODELS[case.get("model", "net")](), **options)
    for name, p in model.module.named_parameters():
        if not case.get("quiet"):  # else nothing of Python runs between the reducer's calls
            p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(("accumulated", name)))
    if "comm_hook" in case:
        model.register_comm_hook(*_comm_hook(case["comm_hook"], events))
    if case.get("collective_hooks"):  # a collective of the user's between the reducer's buckets
        model.module.b.weight.register_post_accumulate_grad_hook(
            lambda p: events.append(("broadcast", _broadcast_sum(p.grad).sum().item())))
    return model


def _broadcast_sum(grad):
    """``grad`` plus a thousandth of rank 0's sum of it: a collective at the hook's place,
    which every rank must issue at the same point of its collectives, whatever its path."""
    import torch.distributed as dist
    total = grad.sum().reshape(1)
    dist.broadcast(total, 0)
    return grad + total * 1e-3


def _step(model, events, x, use_spare, racy, collective=False):
    out = model(x, use_spare)

    def queue_final(g):
        # Where gradients are views of the buckets (gradient_as_bucket_view), the all-reduce in
        # flight writes them: what a callback sees of them then is racy, in eager too.
        params = list(model.module.parameters())
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: events.append(("final", None if racy else
                                   [None if p.grad is None else p.grad.tolist() for p in params])))
    out.register_hook(queue_final)
    if collective:  # before any of the reducer's hooks
        out.register_hook(_broadcast_sum)
    return out.square().sum()


def _run_case(rank, case):
    import gradfx
    with split_pieces(_reducer_calls) as pieces:  # per graph a split backend compiled
        runs = {under_gradfx: _events(rank, case, under_gradfx) for under_gradfx in (False, True)}
    return {"eager": runs[False], "gradfx": runs[True], "stats": gradfx.stats(), "pieces": pieces}


def _events(rank, case, under_gradfx) -> list:
    import gradfx
    backend = case_backend(case)
    events = []
    model = _build(case, events)
    for it in range(STEPS):
        torch.manual_seed(100 * rank + it)
        x = torch.randn(8, 16)
        use_spare = it % 2 == 0 or not case.get("ddp", {}).get("find_unused_parameters")
        sync = not (case.get("no_sync") and it % 2 == 0)
        if not case.get("no_sync") or not sync:  # no_sync: the synced step adds to the last one's
            model.zero_grad()
        with (model.no_sync() if not sync else torch.enable_grad()):
            loss = _step(model, events, x, use_spare, case.get("ddp", {}).get("gradient_as_bucket_view", False),
                         case.get("collective_hooks", False))
            if under_gradfx and rank in case.get("fallback_ranks", ()):
                # anomaly mode: gradfx hands this rank's backward to the eager engine
                with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True):
                    warnings.simplefilter("ignore", gradfx.FallbackWarning)
                    with gradfx.compiled_autograd(backend):
                        loss.backward()
            else:
                backward(loss, under_gradfx and rank in case.get("gradfx_ranks", (0, 1)), backend)
        events.append(("grads", [None if p.grad is None else p.grad.tolist() for p in model.module.parameters()]))
    return events


def _reducer_calls(nodes) -> int:
    from gradfx.capture.runtime import hook_ops
    return sum(n.target is hook_ops.call_node_post_hooks for n in nodes)


CASES = {
    "default": {},
    "bucket_order": {"comm_hook": "allreduce"},
    "find_unused_parameters": {"ddp": {"find_unused_parameters": True}},
    "static_graph": {"ddp": {"static_graph": True}},
    "gradient_as_bucket_view": {"ddp": {"gradient_as_bucket_view": True}},
    "no_sync": {"no_sync": True},
    "fp16_compress_hook": {"comm_hook": "fp16"},
    # One bucket: PowerSGD's chained all-reduces of several buckets in flight deadlock on
    # gloo, in eager too.
    "powersgd_hook": {"comm_hook": "powersgd", "ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 25}},
    "users_backend": {"backend": "gm"},
    "aot_eager": {"backend": "aot_eager"},
    # a compiling backend, nothing of Python between the reducer's calls: they run with the
    # accumulations after the region, the call completing a bucket cuts it
    "aot_eager_buckets": {"backend": "aot_eager", "model": "wide", "quiet": True, "comm_hook": "allreduce",
                          "ddp": {"bucket_cap_mb": 25}},
    # the same, buckets of other sizes than DDP's defaults: the calls still in eager's order
    "aot_eager_small_buckets": {"backend": "aot_eager", "model": "wide", "quiet": True, "comm_hook": "allreduce",
                                "ddp": {"bucket_cap_mb": 0.5}},
    "aot_eager_shared_gradient": {"backend": "aot_eager", "model": "shared", "quiet": True},
    # rank 0 under gradfx, rank 1 on the eager engine: the collectives still pair up
    "one_rank_under_gradfx": {"gradfx_ranks": (0,)},
    "one_rank_falls_back": {"fallback_ranks": (1,)},
    # the user's broadcasts, one before the reducer's first hook and one between its buckets
    "collective_hooks": {"collective_hooks": True},
    "collective_hooks_one_rank_falls_back": {"collective_hooks": True, "fallback_ranks": (1,)},
}


def _worker(rank, world, port, cases, results):
    import gradfx  # noqa: F401  (before the first forward registers hooks)
    from gradfx.capture import native
    assert native.wait() is not None, native.reason()  # the C++ hooks need the compiled part
    with gloo_group(rank, world, port):
        record_cases(results, rank, cases, _run_case)


@pytest.fixture(scope="module")
def results():
    return spawn_ranks(_worker, 2, CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_ddp_reducer_runs_as_in_eager(results, name):
    for rank in (0, 1):
        got = results[(name, rank)]
        assert "error" not in got, got.get("error")
        eager, captured = got["eager"], got["gradfx"]
        kinds = {e[0] for e in eager}
        assert ({"final", "grads"} | ({"bucket"} if "comm_hook" in CASES[name] else set())
                | (set() if CASES[name].get("quiet") else {"accumulated"})
                | ({"broadcast"} if CASES[name].get("collective_hooks") else set())) <= kinds
        assert captured == eager, f"rank {rank}: events or gradients differ from eager DDP's"
        falls_back = rank in CASES[name].get("fallback_ranks", ())
        under = rank in CASES[name].get("gradfx_ranks", (0, 1)) and not falls_back
        stats = got["stats"]
        assert stats["fallbacks"] == (STEPS if falls_back else 0)
        assert (stats["captures"] >= 1) == under
        if under and name not in ("find_unused_parameters", "static_graph", "no_sync"):
            assert stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1, stats
    # the reduced gradients are the same on both ranks (the reducer did reduce them)
    last = [results[(name, r)]["gradfx"][-1] for r in (0, 1)]
    assert last[0] == last[1]


# The pieces the split backend cut each case's first graph into: (kind, reducer calls in
# it).  Every graph starts with a region and the Python of the output's hook (_step).
# Wide's parameters in the order their gradients are ready: c.bias, c.weight, b.bias,
# b.weight (the first bucket, 1 MiB, is full), a.bias, a.weight.
PIECES = {
    "aot_eager_buckets": [("region", 0), ("python", 0), ("region", 0), ("python", 4), ("region", 0), ("python", 2)],
    # where DDP's buckets are not its defaults, gradfx's cuts are where the defaults would be
    "aot_eager_small_buckets": [("region", 0), ("python", 0), ("region", 0), ("python", 4), ("region", 0),
                                ("python", 2)],
    # the first of w1 and w2 whose gradient is ready: its call cuts there (the second's
    # accumulation reads the gradient it was passed); the other three go to the end
    "aot_eager_shared_gradient": [("region", 0), ("python", 1), ("region", 0), ("python", 3)],
}


@pytest.mark.parametrize("name", list(PIECES))
def test_ddp_reducer_calls_cut_a_compiled_backward_once_per_bucket(results, name):
    for rank in (0, 1):
        assert results[(name, rank)]["pieces"][0] == PIECES[name], results[(name, rank)]["pieces"]


# Inductor: the same cut per bucket; gradients within its float tolerance, everything else
# as eager's (the buckets in their order, the node running at each launch, the callback).
INDUCTOR_CASES = {"inductor_buckets": CASES["aot_eager_buckets"] | {"backend": "inductor"}}


@pytest.fixture(scope="module")
def inductor_results():
    return spawn_ranks(_worker, 2, INDUCTOR_CASES)


@pytest.mark.slow
def test_ddp_reducer_under_inductor(inductor_results):
    for rank in (0, 1):
        got = inductor_results[("inductor_buckets", rank)]
        assert "error" not in got, got.get("error")
        eager, captured = got["eager"], got["gradfx"]
        assert [e[0] for e in captured] == [e[0] for e in eager]
        for a, b in zip(eager, captured):
            if a[0] == "bucket":
                assert a == b
            else:  # the final callback's and the step's gradients
                for x, y in zip(a[1], b[1]):
                    torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=1e-5, atol=1e-6)
        assert got["pieces"][0] == PIECES["aot_eager_buckets"]
        assert got["stats"]["captures"] == 1 and got["stats"]["fallbacks"] == 0, got["stats"]
