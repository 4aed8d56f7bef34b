"""What the ranks' agreement on DDP's Python-reducer buckets costs a training step.

Under ``optimize_ddp = "python_reducer"`` the ranks agree that every one of them sends
gradfx's buckets (``capture/runtime/ddp_agreement.py``): one small all-reduce until
they have agreed on a plan, then one element more in the first bucket.  This script
measures, side by side on gloo ranks over loopback (1 thread each), modes interleaved
in an order drawn anew each round (the same on every rank), rank 0's median:

* ``ddp eager``: eager DDP with its default C++ reducer, the reference;
* ``pyreducer gradfx eager``: the Python reducer under gradfx's eager backend, as
  shipped (the plan agreed once, the trailer after);
* ``pyreducer gradfx eager, exchange each backward``: the same, the agreement forgotten
  before each backward, so that the ranks exchange every time: what the trailer spares;
* ``pyreducer gradfx eager, no agreement``: the same with no word between the ranks at
  all (gradfx before the agreement: ranks on different paths abort gloo), the baseline
  of the agreement's cost.

It prints each mode's step and backward, as ratios to the reference, and writes them to
``bench/results.json`` (``bench_ddp_agreement``).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from datetime import timedelta

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_ddp  # noqa: E402  (the models, batches, modes and steps of the DDP benchmark)

MODES = ("ddp eager", "pyreducer gradfx eager", "pyreducer gradfx eager, exchange each backward",
         "pyreducer gradfx eager, no agreement")


class Exchanging(bench_ddp.Runner):
    """The Python reducer under gradfx, its ranks' agreement forgotten before each backward."""

    def _gradfx_backward(self, loss) -> None:
        from gradfx.capture.runtime import ddp_agreement
        ddp_agreement.agreed.pop(self.model, None)
        super()._gradfx_backward(loss)


class Unagreed(bench_ddp.Runner):
    """The Python reducer under gradfx, its graphs starting no agreement (every rank runs
    this mode at once, so their buckets pair up anyway)."""

    def _gradfx_backward(self, loss) -> None:
        from gradfx.capture.runtime import ddp_agreement
        start = ddp_agreement.Handshake.start
        ddp_agreement.Handshake.start = lambda handshake, inputs: None
        try:
            super()._gradfx_backward(loss)
        finally:
            ddp_agreement.Handshake.start = start


def _runners(name: str, cap) -> dict:
    by_name = {m.name: m for m in bench_ddp.MODES}
    python_reducer = by_name["ddp pyreducer gradfx eager"]
    return {MODES[0]: bench_ddp.Runner(by_name["ddp eager"], name, bucket_cap_mb=cap),
            MODES[1]: bench_ddp.Runner(python_reducer, name, bucket_cap_mb=cap),
            MODES[2]: Exchanging(python_reducer, name, bucket_cap_mb=cap),
            MODES[3]: Unagreed(python_reducer, name, bucket_cap_mb=cap)}


def rank_main(rank: int, world: int, port: int, args, results) -> None:
    import torch.distributed as dist
    bench_ddp._init_rank(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args.timeout))
    try:
        out = {}
        for name in args.models:
            runners = _runners(name, args.bucket_cap_mb)
            batch = bench_ddp.make_batch(name, rank)
            for _ in range(args.warmup):
                for runner in runners.values():
                    bench_ddp._guarded_step(runner, batch, record=False, watch_warnings=True)
            order = list(runners.values())
            for round_ in range(args.steps):
                random.Random(round_).shuffle(order)
                for runner in order:
                    if not runner.error:
                        bench_ddp._guarded_step(runner, batch, record=True)
            out[name] = {mode: runner.summary() for mode, runner in runners.items()}
        if rank == 0:
            results[world] = out
    finally:
        dist.destroy_process_group()


def _entries(world: int, measured: dict, cap=None) -> dict:
    entries = {}
    for name, modes in measured.items():
        reference = modes[MODES[0]]
        entry = {"modes": modes, "ranks": world}
        if all("step_ms" in modes[m] for m in MODES):
            for mode in MODES[1:]:
                key = mode.replace(",", "").replace(" ", "_")
                entry[f"ratio_step_{key}"] = round(modes[mode]["step_ms"] / reference["step_ms"], 2)
                entry[f"ratio_backward_{key}"] = round(modes[mode]["backward_ms"] / reference["backward_ms"], 2)
            entry["exchange_costs_backward_ms"] = round(modes[MODES[2]]["backward_ms"] - modes[MODES[1]]["backward_ms"], 2)
            entry["agreement_costs_backward_ms"] = round(modes[MODES[1]]["backward_ms"] - modes[MODES[3]]["backward_ms"], 2)
        entries[f"{name} {world} ranks" + (f" bucket_cap_mb {cap}" if cap is not None else "")] = entry
    return entries


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (default %(default)s)")
    parser.add_argument("--models", nargs="+", default=["gpt2_tiny"], choices=bench_ddp.MODELS)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per mode (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps per mode (default %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=float, default=None,
                        help="DDP's bucket_cap_mb in every mode (default: DDP's own; small caps make many buckets, "
                             "each run's second waiting for its first's trailer)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a collective may wait")
    parser.add_argument("--no-results", action="store_true", help="do not write bench/results.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import gradfx  # noqa: F401  (its compiled part, built before the ranks start)
    from gradfx.capture import native
    native.build_now()
    start = time.perf_counter()
    measured = bench_ddp._spawn(rank_main, args.ranks, args.ranks, bench_ddp._free_port(), args).get(args.ranks, {})
    print(f"median of rank 0 over {args.steps} interleaved steps per mode, {args.ranks} gloo ranks; "
          f"ratios to '{MODES[0]}'")
    print(f"{'model':12s} {'mode':48s} {'step ms':>8s} {'ratio':>6s} {'backward ms':>12s} {'ratio':>6s}  gradfx")
    for name, modes in measured.items():
        reference = modes[MODES[0]]
        for mode in MODES:
            s = modes[mode]
            if "step_ms" not in s:
                print(f"{name:12s} {mode:48s} error: {s.get('error')}")
                continue
            stats = s.get("stats") or {}
            counts = f"{stats.get('captures', 0)} captures, {stats.get('fallbacks', 0)} fallbacks" if stats else "-"
            print(f"{name:12s} {mode:48s} {s['step_ms']:8.2f} {s['step_ms'] / reference['step_ms']:5.2f}x "
                  f"{s['backward_ms']:12.2f} {s['backward_ms'] / reference['backward_ms']:5.2f}x  {counts}")
    print(f"[bench_ddp_agreement] wall time {time.perf_counter() - start:.0f} s")
    if not args.no_results:
        import results_file
        results_file.record("bench_ddp_agreement", _entries(args.ranks, measured, args.bucket_cap_mb), steps=args.steps,
                            warmup=args.warmup)


if __name__ == "__main__":
    main()
