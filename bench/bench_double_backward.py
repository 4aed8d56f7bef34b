"""Double-backward benchmark: a WGAN-GP critic step under gradfx and eager autograd.

The step differentiates the critic at interpolated inputs with
``torch.autograd.grad(..., create_graph=True)``, penalises the gradient norm and runs
``backward()`` through that gradient: two backward calls per step, the first
captured with its own autograd history. Prints the steady-state time of one step
(median after warm-up, engines alternating in one process) as a ratio to eager, the
gradfx captures per step after the first, and the same for PyTorch's compiled autograd
where it runs the step.

Usage: python bench/bench_double_backward.py [--steps 200] [--threads 1|2] [--width 256]
"""

from __future__ import annotations

import argparse
import contextlib
import time
import warnings

import torch
import torch.nn as nn


def make_critic(width):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, width), nn.LeakyReLU(0.2), nn.Linear(width, width), nn.LeakyReLU(0.2),
                         nn.Linear(width, 1))


def step(critic, block, batch=64):
    real, fake, eps = torch.randn(batch, 64), torch.randn(batch, 64), torch.rand(batch, 1)
    inter = (eps * real + (1 - eps) * fake).requires_grad_(True)
    critic.zero_grad(set_to_none=True)
    start = time.perf_counter()
    with block():
        g, = torch.autograd.grad(critic(inter).sum(), inter, create_graph=True)
        penalty = ((g.norm(2, dim=1) - 1) ** 2).mean()
        (critic(fake).mean() - critic(real).mean() + 10 * penalty).backward()
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--threads", type=int, choices=[1, 2])
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import gradfx
    engines = {"eager": contextlib.nullcontext, "gradfx": lambda: gradfx.compiled_autograd(backend="eager")}
    try:
        from torch._dynamo import compiled_autograd
        critic = make_critic(args.width)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(critic, lambda: compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager")))
        engines["torch_ca"] = lambda: compiled_autograd._enable(lambda gm: torch.compile(gm, backend="eager"))
    except Exception as e:  # noqa: BLE001 (reported, then left out)
        print(f"torch compiled autograd cannot run the step: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    critics = {k: make_critic(args.width) for k in engines}
    times = {k: [] for k in engines}
    captures_before = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(args.steps + 10):
            if i == 10:
                captures_before = gradfx.stats()["captures"]
            for k, block in engines.items():
                torch.manual_seed(i)
                t = step(critics[k], block)
                if i >= 10:
                    times[k].append(t)
    for k, c in critics.items():  # the same gradients, bit for bit, as eager's (same seeds)
        if k == "gradfx":
            same = all(torch.equal(a.grad, b.grad) for a, b in zip(critics["eager"].parameters(), c.parameters()))
            print(f"gradfx gradients bitwise equal to eager after the last step: {same}")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    stats = gradfx.stats()
    print(f"WGAN-GP critic step (width {args.width}, batch 64, threads {torch.get_num_threads()}), "
          f"median of {args.steps} steps:")
    print(f"  eager {med['eager'] * 1e3:.3f} ms, gradfx {med['gradfx'] * 1e3:.3f} ms "
          f"({med['gradfx'] / med['eager']:.2f}x)"
          + (f", torch compiled autograd {med['torch_ca'] * 1e3:.3f} ms ({med['torch_ca'] / med['eager']:.2f}x)"
             if "torch_ca" in med else ""))
    print(f"  gradfx captures: {captures_before} in the first 10 steps (two backward calls per step), "
          f"{stats['captures'] - captures_before} in the {args.steps} after; "
          f"cache hits {stats['cache_hits']}, fallbacks {stats['fallbacks']}")


if __name__ == "__main__":
    main()
