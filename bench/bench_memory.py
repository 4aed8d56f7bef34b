"""Peak memory of one backward: eager autograd vs gradfx, with and without the memory pass.

Peak = the highest number of live bytes allocated by torch on the CPU during
``loss.backward()``, relative to what was live when the backward started.  Counted by
a CPU allocator that wraps torch's own and tracks every block it hands out (built at
the first run with ``torch.utils.cpp_extension``, installed before the model exists,
so every block the backward frees was counted when it was allocated).  The profiler's
memory events (``--profiler``) gave peaks that varied from run to run for eager and
gradfx alike (frees of blocks allocated before the window landing in it unevenly), so
they are kept only as a fallback where no compiler is found.

``--checkpoint half`` (or ``all``) runs every other block (or every block) under a
non-reentrant ``torch.utils.checkpoint``: saved tensors under checkpoint's hooks beside
plain ones (capture/graph/unpacked.py).  ``--residual`` adds each block's input to its
output (``x + block(x)``), so that two gradients meet at every block's input: sums the
engine makes in place (reorder/inplace_sums.py; a row without that pass shows what it
saves).

Usage: python bench/bench_memory.py [--batch 512] [--width 1024] [--layers 4] [--checkpoint none|half|all]
       [--residual] [--profiler] [--no-results]

Each run merges its peaks and ratios to eager, with date, machine and torch release,
into ``bench/results.json`` (``bench/results_file.py``) under ``bench_memory`` and its
flags; ``--no-results`` leaves the file alone.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import gradfx


_COUNTING = r"""
#include <torch/extension.h>
#include <c10/core/CPUAllocator.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

namespace {

// torch's CPU allocator, wrapped: every block counted while it lives.  The data pointer
// is the context too (some callers ask for raw allocations): the block's own DataPtr
// waits in a table until the block is freed.
struct Counting final : c10::Allocator {
  c10::Allocator* base = nullptr;
  std::mutex lock;
  std::unordered_map<void*, std::pair<c10::DataPtr, size_t>> blocks;
  int64_t live = 0;
  int64_t peak = 0;

  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr inner = base->allocate(n);
    void* data = inner.get();
    if (data == nullptr) {
      return inner;  // an empty block: nothing to count
    }
    {
      std::lock_guard<std::mutex> guard(lock);
      live += static_cast<int64_t>(n);
      peak = std::max(peak, live);
      blocks.emplace(data, std::make_pair(std::move(inner), n));
    }
    return {data, data, &Counting::release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &Counting::release;
  }
  static void release(void* data);
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

Counting counting;

void Counting::release(void* data) {
  c10::DataPtr inner;
  {
    std::lock_guard<std::mutex> guard(counting.lock);
    auto found = counting.blocks.find(data);
    if (found == counting.blocks.end()) {
      return;
    }
    counting.live -= static_cast<int64_t>(found->second.second);
    inner = std::move(found->second.first);
    counting.blocks.erase(found);
  }
  // inner frees the block through torch's own deleter, outside the lock
}

}  // namespace

void install() {
  if (counting.base == nullptr) {
    counting.base = c10::GetCPUAllocator();
    c10::SetCPUAllocator(&counting, /*priority=*/100);
  }
}
int64_t live() {
  std::lock_guard<std::mutex> guard(counting.lock);
  return counting.live;
}
void reset_peak() {
  std::lock_guard<std::mutex> guard(counting.lock);
  counting.peak = counting.live;
}
int64_t peak() {
  std::lock_guard<std::mutex> guard(counting.lock);
  return counting.peak;
}
"""


def counting_allocator():
    """The counting allocator's module (install, live, reset_peak, peak), or None where it
    cannot be built."""
    try:
        from torch.utils.cpp_extension import load_inline
        return load_inline("gradfx_bench_counting_allocator", cpp_sources=_COUNTING,
                           functions=["install", "live", "reset_peak", "peak"], verbose=False)
    except Exception as err:  # no compiler: the profiler's events instead
        print(f"(no counting allocator: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''};"
              " peaks from the profiler's memory events)")
        return None


def counted_peak(counter, run) -> int:
    counter.reset_peak()
    start = counter.live()
    run()
    return counter.peak() - start


def peak_bytes(run) -> int:
    """The profiler's measure (the fallback): live bytes from its memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()  # negative for a free
        peak = max(peak, live)
    return peak


class _Residual(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        return x + self.block(x)


class _Checkpointed(nn.Module):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, x, use_reentrant=False)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--checkpoint", choices=["none", "half", "all"], default="none",
                   help="run every other block (half) or every block (all) under a non-reentrant checkpoint")
    p.add_argument("--residual", action="store_true", help="each block as x + block(x)")
    p.add_argument("--profiler", action="store_true", help="measure with the profiler's memory events")
    p.add_argument("--no-results", action="store_true", help="do not write bench/results.json")
    args = p.parse_args()
    counter = None if args.profiler else counting_allocator()
    if counter is not None:
        counter.install()  # before the model: every block the backward frees is counted
    measure = (lambda run: counted_peak(counter, run)) if counter is not None else peak_bytes
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(args.width, args.width), nn.GELU(), nn.LayerNorm(args.width))
              for _ in range(args.layers)]
    if args.residual:
        blocks = [_Residual(b) for b in blocks]
    every = {"none": 0, "half": 2, "all": 1}[args.checkpoint]
    model = nn.Sequential(*[_Checkpointed(b) if every and k % every == 0 else b for k, b in enumerate(blocks)])
    x = torch.randn(args.batch, args.width)

    def step(ctx):
        def run():
            with ctx():
                loss.backward()
        model.zero_grad(set_to_none=True)
        loss = model(x).sum()
        return measure(run)

    import contextlib
    engines = {
        "eager": contextlib.nullcontext,
        "gradfx": lambda: gradfx.compiled_autograd(),
        "gradfx passes=[]": lambda: gradfx.compiled_autograd(passes=[]),
        "gradfx without free_inputs_early": lambda: gradfx.compiled_autograd(
            passes=[p for p in gradfx.list_passes() if p != "free_inputs_early"]),
        "gradfx without inplace_sums": lambda: gradfx.compiled_autograd(
            passes=[p for p in gradfx.list_passes() if p != "inplace_sums"]),
    }
    for ctx in engines.values():  # capture and warm up
        step(ctx)
    peaks = {name: min(step(ctx) for _ in range(3)) for name, ctx in engines.items()}
    base = peaks["eager"]
    how = "counting allocator" if counter is not None else "profiler memory events"
    print(f"model: {args.layers} x (Linear({args.width}) + GELU + LayerNorm){', residual' if args.residual else ''}, "
          f"batch {args.batch}, checkpoint {args.checkpoint} ({how})")
    for name, value in peaks.items():
        print(f"  {name:34s} peak {value / 2**20:8.2f} MiB  ({value / base:.3f}x eager)")
    if not args.no_results:
        import results_file
        key = (f"bench_memory --batch {args.batch} --width {args.width} --layers {args.layers} "
               f"--checkpoint {args.checkpoint}" + (" --residual" if args.residual else "")
               + (" --profiler" if args.profiler else ""))
        results_file.record(key, {name: {"peak_mib": round(value / 2**20, 3), "ratio": round(value / base, 3)}
                                  for name, value in peaks.items()}, measured_with=how)


if __name__ == "__main__":
    main()
