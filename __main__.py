"""``python -m gradfx demo``: train a small model under gradfx and show what it captured."""

from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.nn as nn

import gradfx


def _model():
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10))


def _time_backward(model, x, y, use_gradfx, steps):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    for _ in range(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        start = time.perf_counter()
        if use_gradfx:
            with gradfx.compiled_autograd(backend="eager"):
                loss.backward()
        else:
            loss.backward()
        times.append(time.perf_counter() - start)
        opt.step()
    return sorted(times)[len(times) // 2]


def demo(steps: int = 20, svg: str | None = None) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    model = _model()
    reference = copy.deepcopy(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    print(f"Training a {len(list(model.modules())) - 1}-layer MLP for 3 steps under gradfx (eager backend)")
    for step in range(3):
        for m, o, use in ((model, opt, True), (reference, ref_opt, False)):
            o.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            if use:
                with gradfx.compiled_autograd(backend="eager", names=model):
                    loss.backward()
            else:
                loss.backward()
        same = all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), reference.parameters()))
        print(f"  step {step}: loss {loss.item():.4f}, gradients bitwise equal to eager: {same}")
        opt.step()
        ref_opt.step()
    graph = gradfx.capture(nn.functional.cross_entropy(model(x), y), names=model)
    print("\nThe captured backward graph:\n")
    graph.print_readable()
    print(graph.summary())
    print("Passes:", repr(graph.passes), sep="\n")
    if svg:
        with open(svg, "w") as f:
            f.write(graph.to_svg())
        print(f"Picture of the graph: {svg}")
    print("\nCounters:", gradfx.stats())
    eager_t = _time_backward(copy.deepcopy(reference), x, y, False, steps)
    gfx_t = _time_backward(copy.deepcopy(reference), x, y, True, steps)
    print(f"\nBackward (median of {steps}): eager {eager_t * 1e3:.3f} ms, gradfx {gfx_t * 1e3:.3f} ms "
          f"({gfx_t / eager_t:.2f}x eager)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gradfx")
    parser.add_argument("command", choices=["demo"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--svg", metavar="PATH", help="also write the graph's picture (SVG) to PATH")
    args = parser.parse_args(argv)
    demo(args.steps, args.svg)


if __name__ == "__main__":
    main()
