"""Data-parallel training steps under gradfx: DDP and FSDP2 on CPU (gloo, loopback).

One table, side by side in one run: the median training step (``zero_grad``, forward,
backward, SGD step) of rank 0 for each mode and rank count, and its ratio to eager DDP's:

1. ``ddp eager``: DistributedDataParallel, its default C++ reducer (the reference, 1.00x);
2. ``ddp gradfx eager``: the same, backward in ``gradfx.compiled_autograd()``;
3. ``ddp gradfx inductor``: the same with ``backend="inductor"``;
4. ``ddp pyreducer eager``: DDP built with
   ``torch._dynamo.config.optimize_ddp = "python_reducer"`` (its all-reduces are Python
   post-accumulate-grad hooks, one per parameter), on the eager engine;
5. ``ddp pyreducer gradfx eager`` and 6. ``ddp pyreducer gradfx inductor``: the same under
   gradfx, whose ``bucket_allreduces`` pass buckets those all-reduces;
7. ``fsdp2 eager``: ``fully_shard`` on each layer and on the root, eager;
8. ``fsdp2 gradfx eager`` and 9. ``fsdp2 gradfx inductor``: the same under gradfx.

For the gradfx modes it also shows gradfx's captures/fallbacks over all steps of rank 0
(a fallback shows there), and whether the first step's gradients equal, bitwise, those of
the eager mode they stand for (``ddp gradfx eager`` against ``ddp eager``, ``ddp pyreducer
gradfx eager`` against ``ddp pyreducer eager``, ``fsdp2 gradfx eager`` against ``fsdp2
eager``; every rank compared).  Below the table: one process
alone (world 1, no process group), the backward of eager against gradfx's inductor
backend: what inductor saves on the backward alone; and the target that saving sets for
DDP: with inductor, DDP's step <= eager DDP's step minus that saving.

Models (``--models``): ``transformer``, a 4-layer d256 ``nn.TransformerEncoder`` (nhead 4,
feed-forward 1024, dropout 0) with a linear head, MSE loss on random (8, 64, 256)
inputs; ``gpt2_tiny``, bench_compile.py's tiny GPT-2 (2 layers, d64, 8x32 token ids, loss
from ``labels=input_ids``).  Each rank is a process of its own (torch.multiprocessing,
one thread each); all modes of a rank count run in one process group, their timed steps
interleaved in rounds (one step of each mode per round, in an order drawn anew each round), with a
barrier before each step so the ranks start it together.  4 ranks on a 2-core machine
are oversubscribed: the table says so, and measures anyway.  The figures go to
``bench/results.json`` (``bench_ddp``; ``--no-results`` leaves it alone).

    python bench/bench_ddp.py                       # transformer and gpt2_tiny, 2 and 4 ranks (~3 min)
    python bench/bench_ddp.py --quick               # 2 ranks, transformer, 6 steps (~1 min)
    python bench/bench_ddp.py --ranks 2 --models gpt2_tiny --steps 30
    python bench/bench_ddp.py --modes pyreducer     # eager DDP and the modes whose name has "pyreducer"
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODELS = ("transformer", "gpt2_tiny")


@dataclass(frozen=True)
class Mode:
    name: str
    wrap: str  # "ddp", "ddp_python", "fsdp2" or "none" (one process alone)
    backend: str | None  # gradfx's backend; None: eager autograd


MODES = (
    Mode("ddp eager", "ddp", None),
    Mode("ddp gradfx eager", "ddp", "eager"),
    Mode("ddp gradfx inductor", "ddp", "inductor"),
    Mode("ddp pyreducer eager", "ddp_python", None),
    Mode("ddp pyreducer gradfx eager", "ddp_python", "eager"),
    Mode("ddp pyreducer gradfx inductor", "ddp_python", "inductor"),
    Mode("fsdp2 eager", "fsdp2", None),
    Mode("fsdp2 gradfx eager", "fsdp2", "eager"),
    Mode("fsdp2 gradfx inductor", "fsdp2", "inductor"),
)
REFERENCE = MODES[0].name
# the bitwise check of the first step's gradients: mode -> the eager mode it stands for
SAME_GRADS_AS = {"ddp gradfx eager": "ddp eager", "ddp pyreducer gradfx eager": "ddp pyreducer eager",
                 "fsdp2 gradfx eager": "fsdp2 eager"}
SINGLE = (Mode("eager", "none", None), Mode("gradfx inductor", "none", "inductor"))
# inductor compiles on the first step (and may once more for what the first left): warm it longer
INDUCTOR_EXTRA_WARMUP = 2


# -- models and batches ---------------------------------------------------------------

def _transformer():
    import torch.nn as nn

    class EncoderWithHead(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0, batch_first=True)
            # no nested tensors: a training batch without padding mask never uses them
            self.encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
            self.head = nn.Linear(256, 16)

        def forward(self, x):
            return self.head(self.encoder(x))

    return EncoderWithHead()


def build_model(name: str):
    """The same weights in every mode and on every rank (seed 0)."""
    import torch
    torch.manual_seed(0)
    if name == "transformer":
        return _transformer().train()
    import bench_compile  # the repository's tiny GPT-2, as bench_compile measures it
    import transformers
    transformers.logging.set_verbosity_error()  # its config's note on loss_type, once per model and rank
    model, _ = bench_compile._model(name)
    return model.train()


def layers(name: str, model):
    """The blocks FSDP2 shards one by one (the root is sharded after them)."""
    return list(model.encoder.layers) if name == "transformer" else list(model.transformer.h)


def make_batch(name: str, rank: int):
    """Each rank its own data, the same for every mode and step (seeded by rank)."""
    import torch
    torch.manual_seed(1000 + rank)
    if name == "transformer":
        return torch.randn(8, 64, 256), torch.randn(8, 64, 16)
    import bench_compile
    config, batch, length = bench_compile.MODELS[name]
    return (torch.randint(3, config["vocab_size"], (batch, length)),)


def loss_of(name: str, model, batch):
    import torch.nn.functional as F
    if name == "transformer":
        x, target = batch
        return F.mse_loss(model(x), target)
    (ids,) = batch
    return model(ids, labels=ids).loss


# -- wrapping -------------------------------------------------------------------------

def wrap(mode: Mode, name: str, model, mesh, bucket_cap_mb=None):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    if mode.wrap == "ddp":
        return DDP(model) if bucket_cap_mb is None else DDP(model, bucket_cap_mb=bucket_cap_mb)
    if mode.wrap == "ddp_python":
        # DDP reads optimize_ddp when it is built; the Python reducer also switches on
        # inductor's fusion of DDP's all-reduces for the whole process: put that back,
        # so that the other modes' inductor graphs compile as they would without it
        import torch._inductor.config as inductor_config
        saved = (inductor_config._fuse_ddp_communication, inductor_config._fuse_ddp_bucket_size)
        with torch._dynamo.config.patch(optimize_ddp="python_reducer"):
            ddp = DDP(model) if bucket_cap_mb is None else DDP(model, bucket_cap_mb=bucket_cap_mb)
        inductor_config._fuse_ddp_communication, inductor_config._fuse_ddp_bucket_size = saved
        return ddp
    if mode.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for block in layers(name, model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    return model


def local_grads(model) -> list:
    """The gradients this rank holds (an FSDP2 gradient: its local shard)."""
    return [None if p.grad is None else (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad)
            for p in model.parameters()]


def same_grads(a: list, b: list) -> bool:
    import torch
    return len(a) == len(b) and all((x is None and y is None) or
                                    (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


# -- one mode's training step -----------------------------------------------------------

class Runner:
    """One mode: its own model and optimizer; its step times and gradfx's counters."""

    def __init__(self, mode: Mode, name: str, mesh=None, bucket_cap_mb=None):
        import torch
        self.mode, self.name = mode, name
        self.model = wrap(mode, name, build_model(name), mesh, bucket_cap_mb)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.step_s: list[float] = []
        self.backward_s: list[float] = []
        self.stats: dict[str, int] = {}
        self.fallback_reasons: list[str] = []
        self.error: str | None = None

    def step(self, batch, watch_warnings: bool = False) -> tuple[float, float]:
        """One training step: (its seconds, the backward's seconds)."""
        start = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_of(self.name, self.model, batch)
        backward_start = time.perf_counter()
        if self.mode.backend is None:
            loss.backward()
        elif watch_warnings:  # warm-up only: catching warnings costs, and says why it fell back
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                self._gradfx_backward(loss)
            self._note_fallbacks(caught)
        else:
            self._gradfx_backward(loss)
        backward_end = time.perf_counter()
        self.optimizer.step()
        return time.perf_counter() - start, backward_end - backward_start

    def _gradfx_backward(self, loss) -> None:
        import gradfx
        with gradfx.compiled_autograd(backend=self.mode.backend) as session:
            loss.backward()
        for key, count in session.stats.items():
            self.stats[key] = self.stats.get(key, 0) + count

    def _note_fallbacks(self, caught) -> None:
        import gradfx
        for w in caught:
            text = str(w.message).splitlines()[0][:300]
            if issubclass(w.category, gradfx.FallbackWarning) and text not in self.fallback_reasons:
                self.fallback_reasons.append(text)

    def summary(self) -> dict:
        out = {"error": self.error} if self.error else {}
        if self.step_s:
            out.update(step_ms=_ms(statistics.median(self.step_s)), step_iqr_ms=_quartiles_ms(self.step_s),
                       backward_ms=_ms(statistics.median(self.backward_s)), steps=len(self.step_s))
        if self.mode.backend is not None:
            out.update(stats=dict(self.stats), fallback_reasons=self.fallback_reasons)
        return out


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 2)


def _quartiles_ms(values: list) -> list:
    if len(values) < 2:
        return [_ms(values[0])] * 2
    low, _, high = statistics.quantiles(values, n=4)
    return [_ms(low), _ms(high)]


# -- one rank --------------------------------------------------------------------------

def _agree_failed(failed: bool) -> bool:
    """Did this step fail on any rank?  All ranks then drop the mode together, so that none
    waits in a collective the others will never join."""
    import torch
    import torch.distributed as dist
    flag = torch.tensor([int(failed)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _guarded_step(runner: Runner, batch, record: bool, watch_warnings: bool = False) -> None:
    """A step of every rank together (a barrier before it); an exception marks the mode failed."""
    import torch.distributed as dist
    dist.barrier()
    failed = False
    try:
        seconds, backward = runner.step(batch, watch_warnings)
    except Exception as e:  # a mode that breaks is reported, the others still measured
        failed = True
        runner.error = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if _agree_failed(failed):
        runner.error = runner.error or "failed on another rank"
        return
    if record:
        runner.step_s.append(seconds)
        runner.backward_s.append(backward)


def _check_first_grads(runners: dict) -> dict:
    """After the first step: each gradfx mode's gradients against its eager mode's, on
    every rank (a rank that differs makes it NOT EQUAL)."""
    import torch
    import torch.distributed as dist
    checks = {}
    for mode, reference in SAME_GRADS_AS.items():
        if mode not in runners or reference not in runners or runners[mode].error or runners[reference].error:
            continue
        differs = torch.tensor([int(not same_grads(local_grads(runners[mode].model),
                                                   local_grads(runners[reference].model)))])
        dist.all_reduce(differs)
        checks[mode] = {"equal": differs.item() == 0, "ranks_differing": int(differs.item()),
                        "against": reference}
    return checks


def selected(words) -> tuple:
    """The modes whose name contains one of ``words`` (all for None), and eager DDP, the reference."""
    return tuple(m for m in MODES if not words or m.name == REFERENCE or any(w in m.name for w in words))


def run_model(name: str, rank: int, world: int, steps: int, warmup: int, mesh, args_modes=None) -> dict:
    """All modes of one model in this process group: warm-up, then interleaved timed rounds."""
    import torch.distributed as dist
    runners = {m.name: Runner(m, name, mesh) for m in selected(args_modes)}
    batch = make_batch(name, rank)
    checks = {}
    for round_ in range(warmup + INDUCTOR_EXTRA_WARMUP):
        for runner in runners.values():
            extra = round_ >= warmup
            if runner.error or (extra and runner.mode.backend != "inductor"):
                continue
            _guarded_step(runner, batch, record=False, watch_warnings=True)
        if round_ == 0:
            checks = _check_first_grads(runners)
    order = list(runners.values())
    for round_ in range(steps):
        # A new order each round, the same on every rank (their collectives pair up): a step
        # runs after each other mode in turn.  (A rotation kept each mode after the same one,
        # whose leftovers, a heavy mode's threads and memory, then weighed on it alone.)
        random.Random(round_).shuffle(order)
        for runner in order:
            if not runner.error:
                _guarded_step(runner, batch, record=True)
    summaries = {m: r.summary() for m, r in runners.items()}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {m: s.get("stats") for m, s in summaries.items()})
    for m, s in summaries.items():
        if m in checks:
            s["first_step_grads"] = checks[m]
        if s.get("stats") is not None:
            s["fallbacks_per_rank"] = [(r[m] or {}).get("fallbacks", 0) for r in per_rank]
    return summaries


def _init_rank(threads: int) -> None:
    import torch
    torch.set_num_threads(threads)
    # FSDP2 warns on every forward that the root returns a view (the head's output): an
    # in-place op on it would skip its hook, and no step here makes one
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    from gradfx.capture import native
    # gradfx's compiled part runs DDP's C++ reducer hooks: without it the backward falls
    # back; it is built ahead (main) and only loaded here
    if native.wait(timeout=600) is None:
        print(f"[bench_ddp] gradfx's compiled part is not loaded: {native.reason()}", flush=True)


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    _init_rank(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    try:
        mesh = init_device_mesh("cpu", (world,))
        out = {}
        for name in args.models:
            start = time.perf_counter()
            out[name] = run_model(name, rank, world, args.steps, args.warmup, mesh, args.modes)
            if rank == 0:
                print(f"[bench_ddp] {world} ranks, {name}: {time.perf_counter() - start:.0f} s", flush=True)
        if rank == 0:
            results[world] = out
    finally:
        dist.destroy_process_group()


# -- one process alone: what inductor saves on the backward ---------------------------------

def single_main(_index: int, args, results) -> None:
    """Eager against gradfx's inductor backend, world 1, no process group: interleaved steps."""
    _init_rank(1)
    out = {}
    for name in args.models:
        runners = [Runner(m, name) for m in SINGLE]
        batch = make_batch(name, 0)
        for round_ in range(args.warmup + INDUCTOR_EXTRA_WARMUP):
            for runner in runners:
                if round_ < args.warmup or runner.mode.backend == "inductor":
                    runner.step(batch, watch_warnings=True)
        for round_ in range(args.steps):
            for runner in (runners if round_ % 2 else runners[::-1]):
                seconds, backward = runner.step(batch)
                runner.step_s.append(seconds)
                runner.backward_s.append(backward)
        eager, inductor = (r.summary() for r in runners)
        out[name] = {"eager": eager, "gradfx inductor": inductor,
                     "backward_saving_ms": round(eager["backward_ms"] - inductor["backward_ms"], 2),
                     "ratio_backward": round(inductor["backward_ms"] / eager["backward_ms"], 2),
                     "ratio_step": round(inductor["step_ms"] / eager["step_ms"], 2)}
    results["single"] = out


# -- the run ---------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, nprocs: int, *args) -> dict:
    import torch.multiprocessing as mp
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(fn, args=(*args, results), nprocs=nprocs, join=True)
    return dict(results)


def _oversubscribed(world: int) -> bool:
    return world > (os.cpu_count() or 1)


def _table(models, ranks, worlds: dict, single: dict, modes=MODES) -> str:
    """The table: a row per (model, mode), for each rank count: step ms, ratio to eager DDP,
    gradfx's captures/fallbacks (rank 0) and the first step's gradient check."""
    cell = f"{'step ms':>9} {'vs ddp':>7} {'cap/fb':>7} {'grads':>9}"
    width = len(cell)
    head = [f"{'model':<12} {'mode':<30}" + "".join(
        f" | {f'{w} ranks' + (' (oversubscribed)' if _oversubscribed(w) else ''):<{width}}" for w in ranks),
            f"{'':<12} {'':<30}" + "".join(f" | {cell}" for _ in ranks)]
    lines = head + ["-" * len(head[0])]
    for name in models:
        for mode in modes:
            row = f"{name:<12} {mode.name:<30}"
            for w in ranks:
                row += " | " + _cell(worlds.get(w, {}).get(name, {}), mode.name)
            lines.append(row)
        lines.append("")
    lines.append("one process alone (world 1, no process group): backward and step, median ms")
    for name in models:
        s = single.get(name)
        if s:
            lines.append(f"{name:<12} backward: eager {s['eager']['backward_ms']:.1f}, gradfx inductor "
                         f"{s['gradfx inductor']['backward_ms']:.1f} ({s['ratio_backward']:.2f}x): inductor saves "
                         f"{s['backward_saving_ms']:.1f} ms; step: eager {s['eager']['step_ms']:.1f}, gradfx "
                         f"inductor {s['gradfx inductor']['step_ms']:.1f} ({s['ratio_step']:.2f}x)")
    lines.append("target: ddp gradfx inductor step <= ddp eager step - that saving")
    for name in models:
        for w in ranks:
            target = _target(worlds.get(w, {}).get(name, {}), single.get(name))
            if target:
                lines.append(f"{name:<12} {w} ranks: {target['inductor_ms']:.1f} <= {target['eager_ms']:.1f} - "
                             f"{target['saving_ms']:.1f} = {target['target_ms']:.1f} ms: "
                             f"{'met' if target['met'] else 'NOT met'}")
    return "\n".join(lines)


def _cell(modes: dict, name: str) -> str:
    s = modes.get(name)
    if not s:
        return f"{'-':>9} {'':>7} {'':>7} {'':>9}"
    if "step_ms" not in s:
        return f"{'error':>9} {'':>7} {'':>7} {'':>9}"
    reference = modes.get(REFERENCE, {}).get("step_ms")
    ratio = f"{s['step_ms'] / reference:.2f}x" if reference else "-"
    stats = s.get("stats")
    counts = f"{stats['captures']}/{stats['fallbacks']}" if stats else "-"
    if stats and len(set(s.get("fallbacks_per_rank", ()))) > 1:
        counts += "*"  # the ranks fell back different numbers of times
    check = s.get("first_step_grads")
    grads = ("equal" if check["equal"] else "NOT EQUAL") if check else "-"
    return f"{s['step_ms']:>9.1f} {ratio:>7} {counts:>7} {grads:>9}"


def _target(modes: dict, single: dict | None) -> dict | None:
    eager = modes.get(REFERENCE, {}).get("step_ms")
    inductor = modes.get("ddp gradfx inductor", {}).get("step_ms")
    if eager is None or inductor is None or not single:
        return None
    saving = single["backward_saving_ms"]
    return {"eager_ms": eager, "inductor_ms": inductor, "saving_ms": saving,
            "target_ms": round(eager - saving, 2), "met": inductor <= eager - saving}


def _entries(models, worlds: dict, single: dict) -> dict:
    """The results file's entries: one per (model, rank count), one per model alone."""
    entries = {}
    for name in models:
        for w, per_model in worlds.items():
            modes = per_model.get(name)
            if not modes:
                continue
            reference = modes.get(REFERENCE, {}).get("step_ms")
            ratios = {}  # at the top of the entry too, where the results file's readers look for them
            for mode, s in modes.items():
                if reference and "step_ms" in s:
                    s["ratio_vs_ddp_eager"] = round(s["step_ms"] / reference, 2)
                    ratios["ratio_" + mode.replace(" ", "_")] = s["ratio_vs_ddp_eager"]
            entries[f"{name} {w} ranks"] = {"ranks": w, "oversubscribed": _oversubscribed(w), **ratios,
                                            "modes": modes, "target": _target(modes, single.get(name))}
        if name in single:
            entries[f"{name} one process"] = single[name]
    return entries


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="2,4", help="rank counts, comma-separated (default %(default)s)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--steps", type=int, default=15, help="timed steps per mode (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help=f"warm-up steps per mode, {INDUCTOR_EXTRA_WARMUP} more for inductor (default %(default)s)")
    parser.add_argument("--quick", action="store_true", help="2 ranks, transformer, 6 steps")
    parser.add_argument("--modes", nargs="+", metavar="WORD",
                        help="only the modes whose name contains a WORD (eager DDP always runs)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    parser.add_argument("--no-results", action="store_true", help="do not write bench/results.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.ranks, args.models, args.steps = "2", ["transformer"], min(args.steps, 6)
    ranks = [int(r) for r in args.ranks.split(",")]
    # one thread per rank, inductor compiling in the rank's own process: on a small machine
    # a pool of compile workers per rank would only fight the ranks for the cores
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    import gradfx  # noqa: F401  (its compiled part, built before the ranks start)
    from gradfx.capture import native
    native.build_now()

    start = time.perf_counter()
    single = _spawn(single_main, 1, args).get("single", {})
    print(f"[bench_ddp] one process alone: {time.perf_counter() - start:.0f} s", flush=True)
    worlds = {}
    for w in ranks:
        if _oversubscribed(w):
            print(f"[bench_ddp] {w} ranks on {os.cpu_count()} cores: oversubscribed, measured anyway", flush=True)
        worlds[w] = _spawn(rank_main, w, w, _free_port(), args).get(w, {})
    print()
    print(f"median training step of rank 0 over {args.steps} interleaved steps per mode, ms; "
          f"vs ddp: ratio to 'ddp eager'; cap/fb: gradfx captures/fallbacks on rank 0, all steps; "
          f"grads: first step bitwise vs the eager mode, every rank")
    print(_table(args.models, ranks, worlds, single, selected(args.modes)))
    for w in ranks:
        if _oversubscribed(w):
            print(f"note: {w} ranks on {os.cpu_count()} cores are oversubscribed: their times measure "
                  f"contention as much as the step")
    for w in ranks:
        for name, modes in worlds.get(w, {}).items():
            for mode, s in modes.items():
                if s.get("error"):
                    print(f"error: {name}, {w} ranks, {mode}: {s['error']}")
                for reason in s.get("fallback_reasons", []):
                    print(f"fallback: {name}, {w} ranks, {mode}: {reason}")
    print(f"[bench_ddp] wall time {time.perf_counter() - start:.0f} s")
    if not args.no_results:
        import results_file
        key = "bench_ddp" + (" --quick" if args.quick else "")
        results_file.record(key, _entries(args.models, worlds, single), steps=args.steps, warmup=args.warmup)


if __name__ == "__main__":
    main()
