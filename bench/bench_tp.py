"""Tensor parallelism (DTensor) under gradfx against eager TP: training steps on 2 gloo ranks.

A stack of transformer blocks (separate q, k, v, o projections and an MLP, the layout
torch.distributed.tensor.parallel parallelizes: q, k, v and the MLP's first linear
``ColwiseParallel``, o and the second ``RowwiseParallel``), d 256, 4 heads, batch 8 x 64,
1 thread per rank.  Two models built alike train side by side, one step each in turn
(eager TP, then TP whose backward runs in ``gradfx.compiled_autograd()``); it prints the
first backward of each, the median step and backward of rank 0, their ratio to eager,
gradfx's counters, and whether the first step's gradients are bitwise equal on every
rank.  Figures go to ``bench/results.json`` under ``bench_tp``.

Usage: python bench/bench_tp.py [--layers 2] [--steps 20] [--no-results]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))


def _model(layers: int, mesh):
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Block(nn.Module):
        def __init__(self, d=256, heads=4):
            super().__init__()
            self.heads = heads
            self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, t, d = x.shape
            h = self.norm1(x)
            q, k, v = (p(h).view(b, t, -1, d // self.heads).transpose(1, 2) for p in (self.q, self.k, self.v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
            return x + self.down(F.gelu(self.up(self.norm2(x))))

    model = nn.Sequential(*(Block() for _ in range(layers)))
    plan = {}
    for i in range(layers):
        for name in ("q", "k", "v", "up"):
            plan[f"{i}.{name}"] = ColwiseParallel()
        for name in ("o", "down"):
            plan[f"{i}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _worker(rank, world, port, layers, steps, results):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    import gradfx
    from gradfx.capture import native
    from torch.distributed.device_mesh import init_device_mesh
    native.wait()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    models = {}
    for mode in ("eager", "gradfx"):
        torch.manual_seed(0)
        models[mode] = _model(layers, mesh)
    optimizers = {m: torch.optim.SGD(models[m].parameters(), lr=1e-3) for m in models}
    times = {m: {"step": [], "backward": []} for m in models}
    first = {}
    grads = {}
    for it in range(steps + 3):
        torch.manual_seed(it)
        x = torch.randn(8, 64, 256)
        for mode, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            optimizers[mode].zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            mid = time.perf_counter()
            if mode == "gradfx":
                with gradfx.compiled_autograd():
                    loss.backward()
            else:
                loss.backward()
            end = time.perf_counter()
            if it == 0:
                first[mode] = end - mid
                grads[mode] = [p.grad.to_local().clone() if hasattr(p.grad, "to_local") else p.grad.clone()
                               for p in model.parameters()]
            optimizers[mode].step()
            if it >= 3:
                times[mode]["step"].append(time.perf_counter() - start)
                times[mode]["backward"].append(end - mid)
    equal = all(torch.equal(a, b) for a, b in zip(grads["eager"], grads["gradfx"]))
    results[rank] = {"first": first, "equal": equal, "stats": gradfx.stats(),
                     "median": {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}}
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--no-results", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, args.layers, args.steps, results), nprocs=2, join=True)
    r0 = results[0]
    eager, gfx = r0["median"]["eager"], r0["median"]["gradfx"]
    equal = all(results[r]["equal"] for r in (0, 1))
    print(f"tensor parallelism, 2 gloo ranks, {args.layers} blocks d256, batch 8x64; median of {args.steps} "
          "interleaved steps, rank 0")
    print(f"  step:     eager {eager['step'] * 1e3:7.1f} ms  gradfx {gfx['step'] * 1e3:7.1f} ms  "
          f"{gfx['step'] / eager['step']:.2f}x")
    print(f"  backward: eager {eager['backward'] * 1e3:7.1f} ms  gradfx {gfx['backward'] * 1e3:7.1f} ms  "
          f"{gfx['backward'] / eager['backward']:.2f}x")
    print(f"  first backward: eager {r0['first']['eager'] * 1e3:.1f} ms, gradfx {r0['first']['gradfx'] * 1e3:.1f} ms "
          "(capture included)")
    print(f"  gradfx {r0['stats']}; first-step gradients bitwise equal on every rank: {equal}")
    if not args.no_results:
        sys.path.insert(0, HERE)
        import results_file
        entry = {"ranks": 2, "layers": args.layers, "steps": args.steps, "equal": equal, "stats": r0["stats"],
                 "ratio_step": round(gfx["step"] / eager["step"], 2),
                 "ratio_backward": round(gfx["backward"] / eager["backward"], 2),
                 "step_ms": {m: round(v["step"] * 1e3, 2) for m, v in r0["median"].items()},
                 "backward_ms": {m: round(v["backward"] * 1e3, 2) for m, v in r0["median"].items()},
                 "first_backward_ms": {m: round(v * 1e3, 1) for m, v in r0["first"].items()}}
        results_file.record("bench_tp", {f"{args.layers} blocks": entry})


if __name__ == "__main__":
    main()
