"""``python -m gradfx demo``: train a small model under gradfx and show what it captured.

Only the standard library is imported before the arguments are parsed: torch and
gradfx load inside the command that runs, so that ``--help`` and a wrong argument
answer without importing them (:func:`build_parser`).
"""

from __future__ import annotations

import argparse
import time

DESCRIPTION = """gradfx: compiled autograd for PyTorch.
Each command runs a small program under gradfx and shows what it captured."""
DEMO_HELP = ("train a small MLP for 3 steps under gradfx (eager backend), check its gradients against "
             "eager autograd, print the captured backward graph and time the backward against eager")
DEMO_DESCRIPTION = """Train a small MLP for 3 steps under gradfx (eager backend) and check its
gradients against eager autograd; print the captured backward graph, its
summary and passes; time the backward against eager."""
EPILOG = """example:
  python -m gradfx demo --steps 50 --svg graph.svg

In a program, wrap the backward:
  with gradfx.compiled_autograd(backend="inductor"):
      loss.backward()
"""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command line, built from the standard library alone."""
    parser = argparse.ArgumentParser(prog="python -m gradfx", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    demo_parser = commands.add_parser("demo", help=DEMO_HELP, description=DEMO_DESCRIPTION,
                                      epilog="example:\n  python -m gradfx demo --steps 50 --svg graph.svg\n",
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_parser.add_argument("--steps", type=_positive_int, default=20, metavar="N",
                             help="backward passes to time, eager and gradfx each; the median is printed "
                                  "(default: %(default)s)")
    demo_parser.add_argument("--svg", metavar="PATH",
                             help="also write a picture of the captured graph (SVG) to PATH")
    return parser


def _model(nn):
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10))


def _time_backward(model, x, y, use_gradfx, steps):
    import torch
    import torch.nn as nn

    import gradfx

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
    import copy

    import torch
    import torch.nn as nn

    import gradfx

    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    model = _model(nn)
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
    args = build_parser().parse_args(argv)  # --help and wrong arguments exit here, before torch loads
    if args.command == "demo":
        demo(args.steps, args.svg)


if __name__ == "__main__":
    main()
