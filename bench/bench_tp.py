"""Tensor parallelism (DTensor) under gradfx against eager TP: training steps on 2 gloo ranks.

A stack of transformer blocks (separate q, k, v, o projections and an MLP, the layout
torch.distributed.tensor.parallel parallelizes: q, k, v and the MLP's first linear
``ColwiseParallel``, o and the second ``RowwiseParallel``), d 256, 4 heads, batch 8 x 64,
1 thread per rank.  Models built alike train side by side, one step each in turn (eager
TP, then TP whose backward runs in ``gradfx.compiled_autograd()`` on the eager backend,
then on inductor); it prints the first backward of each, the median step and backward of
rank 0, their ratio to eager, gradfx's counters and how many autograd nodes its graph
runs as themselves, and whether the first step's gradients are bitwise equal on every
rank (the eager backend; inductor's within 1e-5).  Figures go to ``bench/results.json``
under ``bench_tp``.

Usage: python bench/bench_tp.py [--layers 2] [--steps 20] [--modes eager gradfx gradfx_inductor] [--no-results]
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


BACKENDS = {"gradfx": "eager", "gradfx_inductor": "inductor"}


def _worker(rank, world, port, layers, steps, modes, results):
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
    for mode in modes:
        torch.manual_seed(0)
        models[mode] = _model(layers, mesh)
    optimizers = {m: torch.optim.SGD(models[m].parameters(), lr=1e-3) for m in models}
    times = {m: {"step": [], "backward": []} for m in models}
    first = {}
    grads = {}
    counters, opaque = {}, {}
    for it in range(steps + 3):
        torch.manual_seed(it)
        x = torch.randn(8, 64, 256)
        for mode, model in models.items():
            dist.barrier()
            start = time.perf_counter()
            optimizers[mode].zero_grad(set_to_none=True)
            loss = model(x).square().mean()
            mid = time.perf_counter()
            if mode in BACKENDS:
                with gradfx.compiled_autograd(BACKENDS[mode]) as session:
                    loss.backward()
                if it == 0:
                    opaque[mode] = [len(g.opaque_nodes) for g in session.graphs]
                counters[mode] = {k: counters.get(mode, {}).get(k, 0) + v for k, v in session.stats.items()}
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
    equal = {m: all((torch.equal if m == "gradfx" else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5))(a, b)
                    for a, b in zip(grads["eager"], grads[m])) for m in modes if m in BACKENDS}
    results[rank] = {"first": first, "equal": equal, "stats": counters, "opaque": opaque,
                     "median": {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}}
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", nargs="+", default=["eager", *BACKENDS], choices=["eager", *BACKENDS])
    p.add_argument("--no-results", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    modes = ["eager"] + [m for m in args.modes if m in BACKENDS]
    mp.spawn(_worker, args=(2, port, args.layers, args.steps, modes, results), nprocs=2, join=True)
    r0 = results[0]
    eager = r0["median"]["eager"]
    equal = {m: all(results[r]["equal"][m] for r in (0, 1)) for m in modes if m in BACKENDS}
    print(f"tensor parallelism, 2 gloo ranks, {args.layers} blocks d256, batch 8x64; median of {args.steps} "
          "interleaved steps, rank 0")
    print(f"  {'mode':17s} {'step':>9s} {'ratio':>6s} {'backward':>9s} {'ratio':>6s} {'first bwd':>10s}")
    for m in modes:
        t = r0["median"][m]
        print(f"  {m:17s} {t['step'] * 1e3:7.1f}ms {t['step'] / eager['step']:5.2f}x {t['backward'] * 1e3:7.1f}ms "
              f"{t['backward'] / eager['backward']:5.2f}x {r0['first'][m] * 1e3:8.1f}ms")
    for m in equal:
        print(f"  {m}: {r0['stats'][m]}; nodes run as themselves per graph {r0['opaque'][m]}; first-step gradients "
              f"{'bitwise equal' if m == 'gradfx' else 'within 1e-5'} on every rank: {equal[m]}")
    if not args.no_results:
        sys.path.insert(0, HERE)
        import results_file
        entry = {"ranks": 2, "layers": args.layers, "steps": args.steps, "equal": equal, "stats": r0["stats"],
                 "opaque": r0["opaque"],
                 **{f"ratio_step_{m}": round(r0["median"][m]["step"] / eager["step"], 2) for m in modes},
                 **{f"ratio_backward_{m}": round(r0["median"][m]["backward"] / eager["backward"], 2) for m in modes},
                 "step_ms": {m: round(v["step"] * 1e3, 2) for m, v in r0["median"].items()},
                 "backward_ms": {m: round(v["backward"] * 1e3, 2) for m, v in r0["median"].items()},
                 "first_backward_ms": {m: round(v * 1e3, 1) for m, v in r0["first"].items()}}
        results_file.record("bench_tp", {f"{args.layers} blocks": entry})


if __name__ == "__main__":
    main()
