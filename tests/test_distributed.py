"""DDP with gloo, 2 processes: gradients equal eager DDP's on every rank.

Without gradfx's compiled part, which alone can call them, DDP's default C++ reducer
hooks are detected and the backward falls back (never silently skipped;
test_ddp_reducer has them captured); with the Python reducer its hooks are captured.
"""

import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from helpers import gloo_group, spawn_ranks

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")


def _compare_steps(rank, eager_model, gfx_model, full, steps=3) -> dict:
    """Train both models ``steps`` steps, the second under gradfx; compare every grad."""
    import gradfx  # in the spawned process, before the first forward registers hooks
    from gradfx.capture.graph import fast_walk
    from gradfx.capture.run import self_check
    assert self_check.refusal() is None  # now: its probes' cache hits take walkers of their own
    out = {"equal": True, "fallback_warned": False, "walker_taken": 0}
    instantiate = fast_walk.instantiate

    def counting(*args):  # the generated walker's last step: it took this backward
        out["walker_taken"] += 1
        return instantiate(*args)
    fast_walk.instantiate = counting
    from gradfx.capture import native
    compiled = native.module()
    if compiled is not None:  # count the one-call walks that answered
        out["one_call"] = 0
        program = compiled.program

        def counted(*args):
            found = program(*args)
            out["one_call"] += found is not None
            return found
        compiled.program = counted  # before the first capture generates a walker
    for it in range(steps):
        torch.manual_seed(100 * rank + it)
        x = torch.randn(3, 4)
        eager_model.zero_grad()
        eager_model(x).sum().backward()
        gfx_model.zero_grad()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with gradfx.compiled_autograd():
                gfx_model(x).sum().backward()
        out["fallback_warned"] |= any(issubclass(w.category, gradfx.FallbackWarning) for w in caught)
        for a, b in zip(eager_model.parameters(), gfx_model.parameters()):
            out["equal"] &= torch.equal(full(a.grad), full(b.grad))
    out["stats"] = gradfx.stats()
    return out


def _worker(rank, world, port, python_reducer, results):
    from torch.nn.parallel import DistributedDataParallel as DDP
    os.environ["GRADFX_NATIVE"] = "0"  # before gradfx loads its compiled part
    with gloo_group(rank, world, port):
        if python_reducer:
            torch._dynamo.config.optimize_ddp = "python_reducer"
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        eager_model = DDP(base)
        torch.manual_seed(0)
        gfx_model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        out = _compare_steps(rank, eager_model, gfx_model, lambda g: g)
        out["grad0"] = gfx_model.module[0].weight.grad.flatten()[:3].tolist()
        results[rank] = out


def _run(python_reducer):
    return spawn_ranks(_worker, 2, python_reducer)


def test_ddp_cpp_reducer_without_the_compiled_part_is_detected_and_falls_back():
    results = _run(python_reducer=False)
    for rank in (0, 1):
        assert results[rank]["equal"], results
        assert results[rank]["fallback_warned"], results
        assert results[rank]["stats"]["fallbacks"] == 3
    assert results[0]["grad0"] == results[1]["grad0"]  # all-reduced


def test_ddp_python_reducer_is_captured():
    results = _run(python_reducer=True)
    for rank in (0, 1):
        assert results[rank]["equal"], results
        assert results[rank]["stats"]["fallbacks"] == 0, results
        assert results[rank]["stats"]["captures"] == 1, results
        assert results[rank]["walker_taken"] == 2, results  # the cached steps
    assert results[0]["grad0"] == results[1]["grad0"]


def _fsdp_worker(rank, world, port, results):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    with gloo_group(rank, world, port):
        mesh = init_device_mesh("cpu", (world,))
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
            fully_shard(m[0], mesh=mesh)
            fully_shard(m, mesh=mesh)
            models.append(m)
        eager_model, gfx_model = models
        results[rank] = _compare_steps(rank, eager_model, gfx_model, lambda g: g.full_tensor())


def test_fsdp2_gradients_equal_eager():
    results = spawn_ranks(_fsdp_worker, 2)
    for rank in (0, 1):
        assert results[rank]["equal"], dict(results)
        assert results[rank]["stats"]["fallbacks"] == 0, dict(results)
        assert results[rank]["stats"]["captures"] >= 1, dict(results)
        assert results[rank]["walker_taken"] == 3 - results[rank]["stats"]["captures"], dict(results)
        # FSDP2's post-backward Functions and pre-backward tensor hooks: walked in one C++ call
        assert results[rank].get("one_call", results[rank]["walker_taken"]) == results[rank]["walker_taken"], \
            dict(results)


@pytest.mark.parametrize("python_reducer", [False, True])
def test_reducer_probe_does_not_go_through_compiled_autograd_enable(monkeypatch, python_reducer):
    # A harness that runs torch's compiled-autograd tests on gradfx points
    # `compiled_autograd._enable` at gradfx: the probe for DDP's C++ hooks must not use it.
    from torch._dynamo import compiled_autograd
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import gradfx
    from gradfx.capture import native
    from gradfx.capture.graph import distributed
    monkeypatch.setattr(native._state, "module", None)  # the probe serves where the compiled part does not
    monkeypatch.setattr(native._state, "reason", "off for this test")

    def refuse(*args, **kwargs):
        raise AssertionError("the probe went through compiled_autograd._enable")
    monkeypatch.setattr(compiled_autograd, "_enable", refuse)
    monkeypatch.setattr(distributed, "_checked", {})
    torch._dynamo.utils.counters.clear()
    dist.init_process_group(backend="fake", rank=0, world_size=2, store=FakeStore())
    try:
        with torch._dynamo.config.patch(optimize_ddp="python_reducer" if python_reducer else True):
            torch.manual_seed(0)
            model = DDP(nn.Sequential(nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 10)))
        loss = model(torch.randn(10, 10)).sum()
        # strict: the C++ reducer is refused before anything runs (the fake process
        # group could not run its all-reduce)
        with gradfx.compiled_autograd(strict=True) as session:
            if python_reducer:
                loss.backward()
            else:
                with pytest.raises(gradfx.Unsupported, match="C\\+\\+ hooks"):
                    loss.backward()
    finally:
        dist.destroy_process_group()
    assert session.stats["captures"] == int(python_reducer)
    assert not torch._dynamo.utils.counters["compiled_autograd"]  # the probe's capture is not counted


def test_initialized_follows_the_default_process_group():
    """What every cached backward asks (read off torch's registry): as torch's own answer."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gradfx.capture.graph import distributed
    assert distributed.initialized() is False is dist.is_initialized()
    dist.init_process_group(backend="fake", rank=0, world_size=2, store=FakeStore())
    try:
        assert distributed.initialized() is True is dist.is_initialized()
    finally:
        dist.destroy_process_group()
    assert distributed.initialized() is False is dist.is_initialized()
