"""How far the cache-hit walk is from the least an exact walk must read.

A cached backward reads the live autograd graph through torch's Python accessors
(``next_functions``, ``_input_metadata``, ``_raw_saved_*``, ``_saved_*``,
``register_hooks``, a leaf's ``variable``) before its graph runs.  This script times, in
one process and alternating step by step with eager backwards (as bench_backward does):

- ``walker``: the generated walker of the model's structure, inside real gradfx backwards;
- ``lines``: where the walker runs the walk as one C++ call (``walk_program``), the
  generated lines it falls back on, alone;
- ``reads only``: the same walker with every comparison removed, so only its reads and
  take-overs run (unsafe for anything but this measurement: it accepts any graph);

and prints both per autograd node and as a fraction of the eager backward.  With the
reads alone above a tenth of eager, no walker through these accessors reaches a cached
backward of 1.10x eager on that model.

``--attribute`` also prints where the walker's time goes, by what each generated line
reads (one timestamp per line, its own cost subtracted; right after a forward, no graph
run in between, so lower than in a training loop).

Usage: python bench/bench_walk_floor.py [--models mlp transformer gpt2 llama] [--threads 1|2]
       [--steps 120] [--attribute]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import time

import torch

import gradfx
from gradfx.capture.graph import fast_walk

_COMPARISON = re.compile(r"^if not \((.*)\): return None$")
_EFFECTS = ("collect(", "materializes(", "ctx_key(", "flatten(", "native_metas(", "native_tensor(")  # calls a comparison wraps


def _walker_of(model, x, loss_fn):
    gradfx.reset()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with gradfx.compiled_autograd(backend="eager"):
            loss_fn(model, x).backward()
    (walker,) = [w for ws in fast_walk.walkers._by_root.values() for w in ws]
    return walker


def _recompiled(walker, lines, **names):
    namespace = dict(walker.lines.__globals__, **names)
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<gradfx walker variant>", "exec"), namespace)
    variant = namespace["fast_walk"]
    variant.source = source
    return variant


def reads_only(walker):
    """The walker's code without its comparisons (calls inside them still run)."""
    lines = []
    for line in walker.source.splitlines():
        body = line.strip()
        match = _COMPARISON.match(body)
        if match is None:
            lines.append(line)
        elif any(call in match.group(1) for call in _EFFECTS):
            lines.append(line[: len(line) - len(body)] + match.group(1))
    return _recompiled(walker, lines)


def _models():
    """bench_backward's models and losses (imported on use: it sets warning filters)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_backward
    return bench_backward


def in_situ(name, steps):
    model, x, loss_fn = _models()._setup(name)
    walker = _walker_of(model, x, loss_fn)
    variants = {"walker": walker, "reads only": reads_only(walker)}
    if walker.lines is not walker:  # the walk as one C++ call (walk_program): its lines too
        variants["lines"] = walker.lines
    order = list(variants)
    times = {k: [] for k in variants}
    eager = []
    current = ["walker"]

    class Timed:
        """The walker the session finds (fast_walk.walkers.find), running the current variant."""
        template, structure = walker.template, walker.structure

        def __call__(self, tensors, grads, inputs, accumulate):
            start = time.perf_counter()
            found = variants[current[0]](tensors, grads, inputs, accumulate)
            times[current[0]].append(time.perf_counter() - start)
            return found

    original = fast_walk.walkers.find
    fast_walk.walkers.find = lambda key, found=[Timed()]: found
    try:
        for step in range(steps + 10):
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, x)
            start = time.perf_counter()
            loss.backward()
            eager.append(time.perf_counter() - start)
            current[0] = order[step % len(order)]
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model, x)
            with gradfx.compiled_autograd(backend="eager"):
                loss.backward()
    finally:
        fast_walk.walkers.find = original
    med = lambda v: statistics.median(v[5:]) * 1e6  # noqa: E731
    return len(walker.template.records), med(eager), {k: med(v) for k, v in times.items()}


def _kind(body: str) -> str:
    """What a generated line reads, for the attribution."""
    rules = [
        ("structure (C++: roots, edges, sequence numbers)", r"native_structure\(|^nodes, s = |^n0, "),
        ("register_hooks (take-over)", r"register_hooks|native_take\("),
        ("hooks", r"collect\(|\bactive\b"),
        ("_raw_saved_* reads", r"^r\d+_\d+ = |unpack_hook|any_hooked"),
        ("saved tensors (C++: reads, unpacks, checks)", r"native_saved\(|^xs is not None|^if not \(xs is|^x\d+_\d+, "),
        ("saved tensor unpacks", r"^[xg]\d+_\d+(_\d+)? = "),
        ("_input_metadata", r"^(m|mk) = |^sh = mk|mk\.dtype|len\(m\)|native_metas\("),
        ("next_functions", r"\bnf\b"),
        ("saved values", r"^x = n|type\(x\)|flatten\(|value_key\(|^if not \(x is None"),
        ("saved tensor checks", r"\bx\d+_\d+"),
        ("leaves", r"\bv\d+\b"),
        ("owners", r"SavedTensors\(\)|\.seal\(|^owned\["),
        ("sequence numbers", r"_sequence_nr|^if not \(s\["),
        ("sizes list", r"^sizes"),
    ]
    for kind, pattern in rules:
        if re.search(pattern, body):
            return kind
    return "other Python"


def attribute(name, steps):
    model, x, loss_fn = _models()._setup(name)
    walker = _walker_of(model, x, loss_fn)
    source = walker.source.splitlines()
    lines, kinds = [source[0], "    _stamp = _clock; _log = _stamps"], []
    for line in source[1:]:
        lines.append(line)
        if line.strip().startswith("return "):
            continue
        kinds.append(_kind(line.strip()))
        lines.append(line[: len(line) - len(line.lstrip())] + "_log.append(_stamp())")
    stamps = []
    timed = _recompiled(walker, lines, _clock=time.perf_counter_ns, _stamps=stamps)
    start = time.perf_counter_ns()
    for _ in range(1000):
        stamps.append(time.perf_counter_ns())
    own = (time.perf_counter_ns() - start) / 1000
    totals = collections.Counter()
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = loss_fn(model, x)
        stamps.clear()
        before = time.perf_counter_ns()
        found = timed((loss,), (torch.ones(()),), (), True)
        for owner in found[1]:
            if owner is not None:
                owner.release()
        if step >= 5:
            for kind, stamp in zip(kinds, stamps):
                totals[kind] += stamp - before - own
                before = stamp
    n = steps - 5
    return {kind: ns / n / 1e3 for kind, ns in totals.most_common()}


def main():
    bb = _models()
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["mlp", "transformer", "gpt2", "llama"], choices=sorted(bb.MODELS))
    p.add_argument("--threads", type=int, choices=[1, 2], default=1)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--attribute", action="store_true", help="also print where the walker's time goes")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch={torch.__version__} threads={args.threads}; medians over {args.steps} backwards, the variants taking turns")
    for name in args.models:
        if not bb._available(name):
            print(f"[{name}] skipped: transformers is not installed (pip install -e \".[models]\")")
            continue
        n, eager, t = in_situ(name, args.steps)
        w, r = t["walker"], t["reads only"]
        print(f"[{name}] {n} autograd nodes, eager backward {eager:.0f} us: walker {w:.0f} us ({w / n:.1f} us/node, "
              f"{w / eager:.2f} of eager), reads only {r:.0f} us ({r / n:.1f} us/node, {r / eager:.2f} of eager)"
              + (f", its lines alone {t['lines']:.0f} us ({t['lines'] / n:.1f} us/node)" if "lines" in t else ""))
        if args.attribute:
            parts = attribute(name, 60)
            print("    walker right after a forward, by what each line reads (us): " + ", ".join(
                f"{kind} {us:.0f}" for kind, us in parts.items() if us >= 0.5) + f"; total {sum(parts.values()):.0f}")


if __name__ == "__main__":
    main()
