"""Backward-pass benchmark: gradfx vs eager autograd vs PyTorch's compiled autograd.

For each model it prints, in one run:
- first backward (capture + compile), each engine in a fresh process;
- steady-state backward time (median, after warm-up), engines alternating in one
  process, as a ratio to eager;
- autograd node count and opaque node count of gradfx's graph.

Usage: python bench/bench_backward.py [--models mlp transformer] [--backend eager]
       [--skip-torch] [--steps 50]
``--backend whole-inductor`` hands gradfx's whole graph to
``torch.compile(gm, backend="inductor", fullgraph=True)`` (``--backend inductor``
is gradfx's built-in split: the pure part compiled, accumulation in Python).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn

MODELS = {
    # 8 x (Linear(256) + GELU + LayerNorm), batch 64
    "mlp": (lambda: nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256))
                                    for _ in range(8)]), (64, 256)),
    # 2-layer TransformerEncoder, d=128, 4 heads, ff 256, input 8x32x128
    "transformer": (lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True), 2,
        enable_nested_tensor=False), (8, 32, 128)),
    # 4 x (Linear(1024) + GELU + LayerNorm), batch 512 (compute-bound)
    "mlp_large": (lambda: nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.LayerNorm(1024))
                                          for _ in range(4)]), (512, 1024)),
}


def _setup(name):
    torch.manual_seed(0)
    make, shape = MODELS[name]
    return make(), torch.randn(*shape)


def _engine(kind, backend):
    import contextlib
    if kind == "eager":
        return contextlib.nullcontext
    if kind == "gradfx":
        import gradfx
        if backend.startswith("whole-"):  # the whole graph through torch.compile, as users write it
            inner = backend[len("whole-"):]
            return lambda: gradfx.compiled_autograd(
                backend=lambda gm: torch.compile(gm, backend=inner, fullgraph=True))
        return lambda: gradfx.compiled_autograd(backend=backend)
    from torch._dynamo import compiled_autograd
    tbackend = backend[len("whole-"):] if backend.startswith("whole-") else backend
    return lambda: compiled_autograd._enable(lambda gm: torch.compile(gm, backend=tbackend))


def first_backward(name, kind, backend):
    """Child process: time the first backward of a fresh process."""
    ctx = _engine(kind, backend)
    model, x = _setup(name)
    loss = model(x).sum()
    start = time.perf_counter()
    with ctx():
        loss.backward()
    out = {"seconds": time.perf_counter() - start}
    if kind == "gradfx":
        import gradfx
        loss = model(x).sum()
        g = gradfx.capture(loss)
        out["autograd_nodes"] = g.autograd_nodes
        out["opaque_nodes"] = len(g.opaque_nodes)
        out["fx_nodes"] = len(g.graph_module.graph.nodes)
    print(json.dumps(out))


def _child(name, kind, backend):
    env = dict(os.environ)
    res = subprocess.run([sys.executable, __file__, "--child", name, kind, backend],
                         capture_output=True, text=True, env=env, timeout=900)
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr else "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def steady_state(name, kinds, backend, steps):
    model, x = _setup(name)
    ctxs = {k: _engine(k, backend) for k in kinds}
    times = {k: [] for k in kinds}
    for step in range(steps + 5):
        for k in kinds:
            model.zero_grad(set_to_none=True)
            loss = model(x).sum()
            start = time.perf_counter()
            with ctxs[k]():
                loss.backward()
            if step >= 5:
                times[k].append(time.perf_counter() - start)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=3)
    p.add_argument("--models", nargs="+", default=["mlp", "transformer"])
    p.add_argument("--backend", default="eager")
    p.add_argument("--skip-torch", action="store_true", help="skip PyTorch's compiled autograd")
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    if args.child:
        first_backward(*args.child)
        return
    kinds = ["eager", "gradfx"] + ([] if args.skip_torch else ["torch_ca"])
    print(f"backend={args.backend} torch={torch.__version__} threads={torch.get_num_threads()}")
    for name in args.models:
        first = {k: _child(name, k, args.backend) for k in kinds if k != "eager"}
        steady = steady_state(name, kinds, args.backend, args.steps)
        g = first["gradfx"]
        print(f"\n[{name}] autograd nodes {g.get('autograd_nodes')}, opaque {g.get('opaque_nodes')}, "
              f"fx nodes {g.get('fx_nodes')}")
        line = f"  first backward: gradfx {g.get('seconds', float('nan')):.3f} s"
        if "torch_ca" in first:
            t = first["torch_ca"].get("seconds", float("nan"))
            line += f", torch compiled autograd {t:.3f} s (gradfx = 1/{t / g['seconds']:.1f} of it)"
        print(line)
        e = steady["eager"]
        line = f"  steady backward: eager {e * 1e3:.3f} ms, gradfx {steady['gradfx'] * 1e3:.3f} ms ({steady['gradfx'] / e:.2f}x)"
        if "torch_ca" in steady:
            line += f", torch compiled autograd {steady['torch_ca'] * 1e3:.3f} ms ({steady['torch_ca'] / e:.2f}x)"
        print(line)


if __name__ == "__main__":
    main()
