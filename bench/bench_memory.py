"""Peak memory of one backward: eager autograd vs gradfx, with and without the memory pass.

Peak = the highest number of live bytes allocated by torch on the CPU during
``loss.backward()``, from the profiler's memory events (allocations and frees
in order), relative to what was live when the backward started.

Usage: python bench/bench_memory.py [--batch 512] [--width 1024] [--layers 4]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import gradfx


def peak_bytes(run) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(args.width, args.width), nn.GELU(), nn.LayerNorm(args.width))
                            for _ in range(args.layers)])
    x = torch.randn(args.batch, args.width)

    def step(ctx):
        def run():
            with ctx():
                loss.backward()
        model.zero_grad(set_to_none=True)
        loss = model(x).sum()
        return peak_bytes(run)

    import contextlib
    engines = {
        "eager": contextlib.nullcontext,
        "gradfx": lambda: gradfx.compiled_autograd(),
        "gradfx passes=[]": lambda: gradfx.compiled_autograd(passes=[]),
        "gradfx without free_inputs_early": lambda: gradfx.compiled_autograd(
            passes=[p for p in gradfx.list_passes() if p != "free_inputs_early"]),
    }
    for ctx in engines.values():  # capture and warm up
        step(ctx)
    peaks = {name: min(step(ctx) for _ in range(3)) for name, ctx in engines.items()}
    base = peaks["eager"]
    print(f"model: {args.layers} x (Linear({args.width}) + GELU + LayerNorm), batch {args.batch}")
    for name, value in peaks.items():
        print(f"  {name:34s} peak {value / 2**20:8.2f} MiB  ({value / base:.3f}x eager)")


if __name__ == "__main__":
    main()
