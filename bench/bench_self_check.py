"""What gradfx's self-check costs: once per process, before its first capture.

Each measurement is a fresh process (the check runs once per process), the two kinds
alternating:
- ``check``: the self-check alone, right after ``import gradfx`` (it pays the one-time
  set-up of fake tensors and tracing that a first capture pays anyway), and the same
  check run again in that process (its probes alone);
- ``first backward, checked``: the first backward of a small model in a block,
  self-check included (the user's view);
- ``first backward, unchecked``: the same with the check's verdict set beforehand
  (what gradfx cost before the check existed).
The difference of the last two is what the check adds to a process.

Usage: python bench/bench_self_check.py [--runs 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch
import gradfx
from gradfx.capture.run import self_check
mode = sys.argv[1]
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
loss = model(torch.randn(32, 64)).square().mean()
out = {"release": torch.__version__}
if mode == "check":
    start = time.perf_counter()
    out["verdict"] = self_check.refusal()
    out["seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    self_check._check()  # again: its probes without the one-time set-up
    out["warm"] = time.perf_counter() - start
else:
    if mode == "unchecked":
        self_check.verdict = ""
    start = time.perf_counter()
    with gradfx.compiled_autograd():
        loss.backward()
    out["seconds"] = time.perf_counter() - start
print(json.dumps(out))
"""


def _child(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="fresh processes per kind (default 7)")
    args = parser.parse_args()
    times: dict = {"check": [], "checked": [], "unchecked": []}
    warm = []
    release = verdict = None
    for _ in range(args.runs):
        for mode in times:
            out = _child(mode)
            times[mode].append(out["seconds"])
            if "warm" in out:
                warm.append(out["warm"])
            release = out["release"]
            verdict = out.get("verdict", verdict)
    med = {mode: statistics.median(values) * 1e3 for mode, values in times.items()}
    print(f"torch {release}: self-check {'passed' if verdict is None else 'failed: ' + verdict}")
    print(f"self-check alone, fresh process:  {med['check']:8.1f} ms (median of {args.runs})")
    print(f"self-check again, same process:   {statistics.median(warm) * 1e3:8.1f} ms (its probes alone)")
    print(f"first backward, checked:          {med['checked']:8.1f} ms")
    print(f"first backward, unchecked:        {med['unchecked']:8.1f} ms")
    print(f"what the check adds to a process: {med['checked'] - med['unchecked']:8.1f} ms")


if __name__ == "__main__":
    main()
