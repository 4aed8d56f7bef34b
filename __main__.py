"""``python -m gradfx demo``: train a small model under gradfx and show what it captured.

Only the standard library is imported before the arguments are parsed: torch and
gradfx load inside the command that runs, so that ``--help`` and a wrong argument
answer without importing them (:func:`build_parser`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DESCRIPTION = """gradfx: compiled autograd for PyTorch.
Each command runs a small program under gradfx and shows what it captured."""
DEMO_HELP = ("train a small MLP under gradfx (eager backend), check its gradients against eager autograd, "
             "print the captured backward graph and time the backward against eager")
DEMO_DESCRIPTION = """Train a small MLP for 3 steps under gradfx (eager backend) and check its
gradients against eager autograd; print the captured backward graph, its
summary and passes; time the backward against eager, as the benchmarks do:
eager and gradfx alternating, in pairs after warm-up, the median ratio and
its spread.  On a machine where gradfx's compiled part is not built yet, it
is built first (once per torch release; --no-wait times without it)."""
BUILD_HELP = "build gradfx's compiled part now and wait for it (ahead of time: CI, clusters, read-only homes)"
BUILD_DESCRIPTION = """Build gradfx's compiled part (one C++ extension, cached per torch and Python
release) and wait for it; print where it is and how long it took.  Without
it, the first capture on a machine starts the build in a process of its own
and Python serves until it is ready.  Exits 1, saying why, where it cannot
be built; a failed build is tried again.

The cache is $GRADFX_CACHE_DIR, else ~/.cache/gradfx ($XDG_CACHE_HOME/gradfx);
GRADFX_NATIVE=0 turns the compiled part off."""
EPILOG = """examples:
  python -m gradfx demo --steps 500 --svg graph.svg
  python -m gradfx build

In a program, wrap the backward:
  with gradfx.compiled_autograd(backend="inductor"):
      loss.backward()
"""
WARMUP = 20  # pairs of backwards run before the timed ones
BUSY = 0.2  # a middle half of the pairs' ratios wider than this share of their median: too busy to measure


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _writable_file(text: str) -> str:
    """A path a file can be written to: checked before the demo runs, not after its capture."""
    path = os.path.abspath(os.path.expanduser(text))
    folder = os.path.dirname(path)
    if os.path.isdir(path):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name, e.g. {os.path.join(text, 'graph.svg')!r}")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"no such directory: {folder!r}")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"directory not writable: {folder!r}")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise argparse.ArgumentTypeError(f"file not writable: {text!r}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """The command line, built from the standard library alone."""
    parser = argparse.ArgumentParser(prog="python -m gradfx", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    demo_parser = commands.add_parser("demo", help=DEMO_HELP, description=DEMO_DESCRIPTION,
                                      epilog="example:\n  python -m gradfx demo --steps 500 --svg graph.svg\n",
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
    demo_parser.add_argument("--steps", type=_positive_int, default=200, metavar="N",
                             help=f"pairs of backwards to time (an eager one, then a gradfx one, after {WARMUP} "
                                  "pairs of warm-up); the median ratio and its spread are printed "
                                  "(default: %(default)s)")
    demo_parser.add_argument("--svg", metavar="PATH", type=_writable_file,
                             help="also write a picture of the captured graph (SVG) to PATH")
    demo_parser.add_argument("--no-wait", action="store_true",
                             help="do not wait for gradfx's compiled part where it is still building: time "
                                  "what serves now (the timing line says which)")
    commands.add_parser("build", help=BUILD_HELP, description=BUILD_DESCRIPTION,
                        epilog="example (CI, a cluster's shared cache):\n"
                               "  GRADFX_CACHE_DIR=/shared/gradfx python -m gradfx build\n",
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    return parser


def _model(nn):
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10))


def _quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def time_pairs(model, x, y, steps: int, warmup: int = WARMUP) -> dict:
    """Time the backward as bench/bench_backward.py does: ``warmup`` pairs, then ``steps``
    pairs of one eager backward and one gradfx backward (eager backend) of the same model,
    alternating.  Each engine's median time, the median of the pairs' ratios and their
    middle half (25th to 75th percentile)."""
    import torch.nn as nn

    import gradfx

    def backward(use_gradfx):
        model.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        start = time.perf_counter()
        if use_gradfx:
            with gradfx.compiled_autograd(backend="eager"):
                loss.backward()
        else:
            loss.backward()
        return time.perf_counter() - start

    eager, ours = [], []
    for step in range(warmup + steps):
        e, g = backward(False), backward(True)
        if step >= warmup:
            eager.append(e)
            ours.append(g)
    ratios = [g / e for g, e in zip(ours, eager)]
    return {"eager": _quantile(eager, 0.5), "gradfx": _quantile(ours, 0.5), "ratio": _quantile(ratios, 0.5),
            "low": _quantile(ratios, 0.25), "high": _quantile(ratios, 0.75), "pairs": steps}


def timing_lines(t: dict, served: str) -> list[str]:
    """The demo's last lines: the times, the ratio with its spread, what served, and a note
    where the spread says the machine was too busy to measure."""
    lines = [f"Backward, {t['pairs']} pairs (eager, gradfx) after {WARMUP} of warm-up: eager {t['eager'] * 1e3:.3f} "
             f"ms, gradfx {t['gradfx'] * 1e3:.3f} ms (medians); gradfx/eager {t['ratio']:.2f}x (median of the "
             f"pairs; middle half {t['low']:.2f}-{t['high']:.2f}x)",
             f"  {served}"]
    if t["high"] - t["low"] > BUSY * t["ratio"]:
        lines.append(f"  note: the machine was too busy to measure: the middle half of the pairs spans "
                     f"{t['low']:.2f}-{t['high']:.2f}x, wider than {BUSY:.0%} of the median; the ratio is noise. "
                     "Run it again on an idle machine, or with more --steps.")
    return lines


class _Progress:
    """One line that counts the seconds waited: rewritten in place on a terminal, else a
    line every 15 s."""

    def __init__(self, what: str, stream=None):
        self.what, self.stream = what, stream or sys.stdout
        self.tty = self.stream.isatty()
        self.shown = float("-inf")

    def __call__(self, waited: float) -> None:
        if self.tty:
            self.stream.write(f"\r  {self.what}: {waited:.0f} s ")
        elif waited - self.shown >= 15.0:
            self.stream.write(f"  {self.what}: {waited:.0f} s\n")
            self.shown = waited
        self.stream.flush()

    def end(self, text: str) -> None:
        self.stream.write(("\r" if self.tty else "") + f"  {text}" + (" " * 20 if self.tty else "") + "\n")
        self.stream.flush()


def _served(native) -> str:
    if native.module() is not None:
        return f"gradfx's compiled part served (loaded from {native.directory()})"
    why = native.reason() or "it is still building (--no-wait)"
    return f"Python served, without gradfx's compiled part: {why}"


def wait_for_native(native, out=None) -> None:
    """On a first run (the compiled part not built for this release yet), build it and
    wait, with a progress line; say so where it cannot be had."""
    out = out or sys.stdout
    if native.module() is not None or native.reason() is not None:
        return
    print(f"First run with this torch release: building gradfx's compiled part once, before timing "
          f"(log: {os.path.join(native.directory(), 'build.log')}; `python -m gradfx build` does it ahead "
          "of time, GRADFX_NATIVE=0 turns it off)", file=out, flush=True)
    progress = _Progress("building", out)
    started = time.monotonic()
    loaded = native.build_now(progress)
    if loaded is not None:
        progress.end(f"built and loaded in {time.monotonic() - started:.0f} s")
    else:
        progress.end(f"not built: {native.reason() or 'timed out'}; Python serves")


def demo(steps: int = 200, svg: str | None = None, wait: bool = True) -> None:
    import copy

    import torch
    import torch.nn as nn

    import gradfx
    from gradfx.capture import native

    if wait:
        wait_for_native(native)
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
    timed = time_pairs(copy.deepcopy(reference), x, y, steps)
    print("", *timing_lines(timed, _served(native)), sep="\n")


def build() -> int:
    """``python -m gradfx build``: build the compiled part now; 0 once it is loaded."""
    from gradfx.capture import native

    where = native.directory()
    if native.module() is not None:
        report = native.report() or {}
        print(f"gradfx's compiled part is built: {os.path.join(where, report.get('library', ''))} "
              f"(built earlier, in {report.get('seconds', '?')} s)")
        return 0
    why = native.reason()
    if why is not None and not why.startswith("its build"):  # switched off, an untested torch: nothing to build
        print(f"python -m gradfx build: error: gradfx's compiled part cannot be had: {why}", file=sys.stderr)
        return 1
    print(f"Building gradfx's compiled part in {where} (log: {os.path.join(where, 'build.log')})", flush=True)
    progress = _Progress("building")
    started = time.monotonic()
    try:
        loaded = native.build_now(progress)
    except KeyboardInterrupt:
        progress.end("interrupted" + ("; the build goes on in its own process" if native.building() else ""))
        return 130
    if loaded is None:
        progress.end("failed")
        print(f"python -m gradfx build: error: gradfx's compiled part cannot be had: "
              f"{native.reason() or 'timed out'}", file=sys.stderr)
        return 1
    report = native.report() or {}
    progress.end(f"built in {time.monotonic() - started:.1f} s")
    print(f"gradfx's compiled part is built and loads: {os.path.join(where, report.get('library', ''))} "
          f"({report.get('bytes', 0) // 1024} KB; the compiler took {report.get('seconds', '?')} s)")
    return 0


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)  # --help and wrong arguments exit here, before torch loads
    if args.command is None:  # a bare `python -m gradfx`: what it can do
        parser.print_help()
        return
    if args.command == "demo":
        demo(args.steps, args.svg, wait=not args.no_wait)
    elif args.command == "build":
        sys.exit(build())


if __name__ == "__main__":
    main()
