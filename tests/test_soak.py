"""Memory stays flat over long runs (issue 13).

Three loops that once grew without bound:

* a new backend callable per block (``backend=lambda gm: ...`` written inside the
  training loop): must be one capture and cache hits, nothing kept per step;
* many graph structures over a small cache (``set_cache_size(8)``);
* recaptures over sizes (static shapes, a new batch size each step) over a small cache.

After a warm-up, each loop must leave the resident set size, the number of live
tensors and GraphModules, and everything gradfx keeps (cache, walkers, sizes per
structure, its additions to torch's fake-tensor and fx-source caches) where it
was.  The short versions run in CI; ``-m slow`` runs 2000 iterations.
``python tests/test_soak.py [iterations]`` prints the measurements.
"""

from __future__ import annotations

import ctypes
import gc
import linecache
import os
import sys
import time
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.capture.graph import fast_walk
from gradfx.capture.run.cache import DEFAULT_SIZE, cache

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_mb() -> float:
    # Hand freed heap back to the OS first: what earlier tests freed would otherwise
    # come and go in RSS independently of this loop (glibc; elsewhere as measured).
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / 2**20


def _census() -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.graph_module import _loader
    gc.collect()
    tensors = modules = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on some objects warns of deprecated torch names
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                tensors += 1
            elif isinstance(obj, torch.fx.GraphModule):
                modules += 1
    return {"tensors": tensors, "graph_modules": modules, "cached_graphs": len(cache),
            "walkers": sum(map(len, fast_walk.walkers._by_root.values())), "sizes_per_structure": len(cache.last_sizes),
            "fake_tensor_cache_unowned": _unowned(FakeTensorMode.cache), "fx_sources": len(_loader.eval_cache),
            "linecache": len(linecache.cache), "finalizers": len(weakref.finalize._registry)}


def _unowned(cache: dict) -> int:
    """Entries of a torch cache that no live graph owns (gradfx removes what its graph
    added when that graph dies: see capture/trace/torch_caches.py)."""
    from gradfx.capture.trace import torch_caches
    owned = set()
    for info in list(weakref.finalize._registry.values()):
        if info.func is torch_caches._release:
            owned.update(map(id, info.args[0]))
    return sum(1 for key in cache if id(key) not in owned)


class _Loop:
    """One soak loop: ``step(i)`` runs iteration i, checking its gradients against
    eager autograd every ``check_every`` iterations."""

    cache_size = DEFAULT_SIZE
    check_every = 50

    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.reference = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.reference.load_state_dict(self.model.state_dict())

    def loss(self, model, i):
        raise NotImplementedError

    def block(self, i):
        raise NotImplementedError

    def step(self, i):
        self.model.zero_grad(set_to_none=True)
        loss = self.loss(self.model, i)
        with self.block(i):
            loss.backward()
        if i % self.check_every == 0:
            self.reference.zero_grad(set_to_none=True)
            self.loss(self.reference, i).backward()
            for p, q in zip(self.model.parameters(), self.reference.parameters()):
                assert torch.equal(p.grad, q.grad), f"iteration {i}: gradients differ from eager"


class NewBackendPerBlock(_Loop):
    def loss(self, model, i):
        torch.manual_seed(i)
        return model(torch.randn(8, 16)).square().mean()

    def block(self, i):
        return gradfx.compiled_autograd(backend=lambda gm: gm)  # a new function object each step


class ManyStructures(_Loop):
    cache_size = 8

    def loss(self, model, i):
        torch.manual_seed(i)
        # pow's exponent is a saved scalar of the graph's structure: a new structure each step
        return (model(torch.randn(8, 16)).tanh() + 2).pow(1.0 + i * 1e-4).sum()

    def block(self, i):
        return gradfx.compiled_autograd()


class RecapturesOverSizes(_Loop):
    cache_size = 8

    def __init__(self):
        torch.manual_seed(0)
        self.model = nn.Linear(16, 1)
        self.reference = nn.Linear(16, 1)
        self.reference.load_state_dict(self.model.state_dict())

    def loss(self, model, i):
        torch.manual_seed(i)
        # 1000 batch sizes in shuffled order: each step recaptures (8 graphs cached),
        # and the largest input comes early, so growing inputs do not grow the heap.
        return model(torch.randn(2 + (i * 7919) % 1000, 16)).sum()

    def block(self, i):
        return gradfx.compiled_autograd(dynamic=False)


LOOPS = [NewBackendPerBlock, ManyStructures, RecapturesOverSizes]


def soak(loop_cls, iterations: int, warm_up: int) -> dict:
    """Run ``warm_up`` then ``iterations`` steps; the census and RSS around the latter."""
    gradfx.reset()
    loop = loop_cls()
    gradfx.set_cache_size(loop.cache_size)
    try:
        for i in range(warm_up):
            loop.step(i)
        before, rss_before = _census(), _rss_mb()
        start = time.perf_counter()
        for i in range(warm_up, warm_up + iterations):
            loop.step(i)
        seconds = time.perf_counter() - start
        after, rss_after = _census(), _rss_mb()
        stats = gradfx.stats()
    finally:
        gradfx.set_cache_size(DEFAULT_SIZE)
        gradfx.reset()
    return {"before": before, "after": after, "rss_growth_mb": rss_after - rss_before,
            "seconds": seconds, "stats": stats, "steps": warm_up + iterations}


def _check(result: dict, rss_limit_mb: float) -> None:
    before, after = result["before"], result["after"]
    for name in ("tensors", "graph_modules", "cached_graphs", "walkers", "sizes_per_structure", "finalizers"):
        assert after[name] == before[name], (name, before, after)
    # A fake-tensor entry belongs to the graph whose trace added it, and moves to a later
    # graph when its owner is evicted (whole graphs' worth at once, depending on when the
    # collector ran): entries no live graph owns must not accumulate.  Sources: one per graph.
    assert after["fake_tensor_cache_unowned"] <= before["fake_tensor_cache_unowned"], (before, after)
    for name in ("fx_sources", "linecache"):
        assert after[name] <= before[name] + 16, (name, before, after)
    assert result["rss_growth_mb"] < rss_limit_mb, result


def _check_stats(loop_cls, result: dict) -> None:
    stats, steps = result["stats"], result["steps"]
    assert stats["fallbacks"] == 0 and stats["captures"] + stats["cache_hits"] == steps
    if loop_cls is NewBackendPerBlock:
        assert stats["captures"] == 1 and stats["cache_hits"] == steps - 1 and stats["compiles"] == 1
    else:
        assert stats["captures"] == steps


@pytest.mark.parametrize("loop_cls", LOOPS, ids=[c.__name__ for c in LOOPS])
def test_soak_short(loop_cls):
    result = soak(loop_cls, iterations=200, warm_up=250)
    _check_stats(loop_cls, result)
    _check(result, rss_limit_mb=5.0)


@pytest.mark.slow
@pytest.mark.parametrize("loop_cls", LOOPS, ids=[c.__name__ for c in LOOPS])
def test_soak_long(loop_cls):
    result = soak(loop_cls, iterations=2000, warm_up=300)
    _check_stats(loop_cls, result)
    _check(result, rss_limit_mb=5.0)


if __name__ == "__main__":
    # python tests/test_soak.py [iterations [warm-up [loop names...]]]; run one loop per
    # process to measure it alone (freed memory of an earlier loop hides growth).
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    warm = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    names = sys.argv[3:] or [c.__name__ for c in LOOPS]
    for loop_cls in [c for c in LOOPS if c.__name__ in names]:
        r = soak(loop_cls, n, warm)
        growth = {k: r["after"][k] - r["before"][k] for k in r["before"]}
        print(f"{loop_cls.__name__}: {n} iterations after {warm} in {r['seconds']:.1f} s: "
              f"RSS {r['rss_growth_mb']:+.2f} MB ({r['rss_growth_mb'] * 1024 / n:.1f} KB/iteration); "
              f"growth {growth}; stats {r['stats']}", flush=True)
