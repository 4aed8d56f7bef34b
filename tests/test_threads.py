"""Training loops on several threads at once, each in its own gradfx block.

Threads share the process-wide cache (graphs, generated walkers) and capture,
recapture, hit and evict concurrently.  Every step's gradients must be eager's,
bit for bit: each thread checks them against an eager twin of its model.
"""

import copy
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import gradfx


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield
    gradfx.set_cache_size(128)
    gradfx.reset()


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 1))


def _encoder():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0), 1)


def _batch(kind, seed, step):
    g = torch.Generator().manual_seed(1000 * seed + step)
    shape = (4 + step % 3, 8) if kind is _mlp else (2, 3 + step % 2, 16)
    return torch.randn(*shape, generator=g)


@pytest.mark.parametrize("cache_size", [128, 3])  # 3: graphs evicted while other threads run them
def test_concurrent_training_loops_match_eager(cache_size):
    gradfx.set_cache_size(cache_size)
    kinds = [_mlp, _encoder, _mlp, _encoder, _mlp, _mlp]
    models = []
    for seed, kind in enumerate(kinds):
        torch.manual_seed(seed)  # here, not in the threads: the default generator is shared
        models.append(kind())
    mismatches, errors = [], []
    barrier = threading.Barrier(len(kinds))

    def train(seed):
        kind, model = kinds[seed], models[seed]
        twin = copy.deepcopy(model)
        opts = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (model, twin)]
        try:
            barrier.wait()
            for step in range(12):
                x = _batch(kind, seed, step)
                twin(x).pow(2).mean().backward()
                loss = model(x).pow(2).mean()
                with gradfx.compiled_autograd(dynamic="auto" if step % 2 else False):
                    loss.backward()
                for (name, p), q in zip(model.named_parameters(), twin.parameters()):
                    if not torch.equal(p.grad, q.grad):
                        mismatches.append((seed, step, name))
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    with warnings.catch_warnings():
        warnings.simplefilter("error", gradfx.FallbackWarning)
        threads = [threading.Thread(target=train, args=(seed,)) for seed in range(len(kinds))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    assert not mismatches, mismatches
    stats = gradfx.stats()
    assert stats["fallbacks"] == 0 and stats["cache_hits"] > 0


def test_cache_lookups_and_evictions_on_many_threads():
    """The cache's lookup, insertion and eviction are whole: a lookup once met an entry
    another thread had just evicted (KeyError on marking it used), seen in
    test_concurrent_training_loops_match_eager[3].  Threads switch every microsecond here."""
    import sys
    from gradfx.capture.run.cache import GraphCache

    class Entry:
        def guard(self, sizes):
            return True

    cache, errors = GraphCache(2), []

    def work(seed):
        try:
            for k in range(20000):
                structure = (seed * 7 + k) % 5
                if cache.lookup(structure, [k % 3]) is None:
                    cache.put(structure, [k % 3], Entry(), dynamic=bool(k % 2))
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert len(cache) <= 2
