"""What gradfx keeps is bounded by the cache or released with its graph (issue 13).

Per structure (walker, latest sizes, dynamic positions), in torch's process-wide
caches (fake-tensor dispatch cache, fx sources), per pass (no code copies).  The
long-run loops are in test_soak.py.
"""

import gc

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.capture.run.cache import cache
from helpers import grads_of


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield
    gradfx.set_cache_size(128)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def _x(seed=1):
    torch.manual_seed(seed)
    return torch.randn(3, 4)


def _eager_grads(seed=0):
    model = _model(seed)
    model(_x()).sum().backward()
    return grads_of(model.parameters())


def test_per_structure_state_is_evicted_with_the_cache():
    from gradfx.capture.graph import fast_walk
    gradfx.set_cache_size(2)
    w = torch.rand(5).add(0.5).requires_grad_()
    for k in range(6):  # six structures: the exponent is part of the key
        expected = torch.autograd.grad(w.pow(1.5 + k).sum(), w)[0]
        w.grad = None
        with gradfx.compiled_autograd(dynamic=True):
            w.pow(1.5 + k).sum().backward()
        assert torch.equal(w.grad, expected)
    assert len(cache) == 2 and len(cache.last_sizes) == 2 and len(cache.dynamic_positions) <= 2
    assert len(fast_walk.walkers) <= 2 and len(fast_walk.walkers._where) <= 2
    gradfx.reset()
    assert len(fast_walk.walkers) == 0 and not cache.last_sizes


def test_torch_caches_lose_what_gradfx_added_when_its_graphs_go():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.graph_module import _loader
    gc.collect()
    # An entry of the user's own (a fake op outside gradfx) must stay.
    with FakeTensorMode() as mode:
        mode.from_tensor(torch.randn(7, 3)).sin()
    fake_before, sources_before = set(FakeTensorMode.cache), set(_loader.eval_cache)
    assert fake_before
    lin = nn.Linear(4, 3)
    gradfx.set_cache_size(2)
    for batch in range(2, 8):  # static captures at six sizes
        with gradfx.compiled_autograd(dynamic=False):
            lin(torch.randn(batch, 4)).relu().sum().backward()
    graph = gradfx.capture(lin(torch.randn(9, 4)).sum())
    grown = len(FakeTensorMode.cache)
    assert grown > len(fake_before)
    gc.collect()
    assert len(FakeTensorMode.cache) < grown  # evicted graphs took theirs along
    del graph
    gradfx.reset()
    gc.collect()
    assert set(FakeTensorMode.cache) == fake_before
    assert set(_loader.eval_cache) <= sources_before  # every gradfx source went with its graph


def test_session_graphs_keep_no_code_per_pass():
    model = _model()
    with gradfx.compiled_autograd() as s:
        model(_x()).sum().backward()
    record = s.graphs[0].passes[0]
    assert [r.name for r in s.graphs[0].passes] == gradfx.list_passes()
    assert not any(isinstance(v, str) and "\n" in v for v in vars(record).values())
    assert str(record).startswith(f"{record.name}: ")


def test_subclass_layout_ids_are_bounded_and_never_reused(monkeypatch):
    """The numbers standing for subclass layouts among the sizes: a bounded table, whose
    forgotten entries come back with new numbers (so a graph is found again by a capture,
    never found for other layouts)."""
    from gradfx.capture.graph import subclasses
    monkeypatch.setattr(subclasses, "_layout_ids", type(subclasses._layout_ids)())
    monkeypatch.setattr(subclasses, "_LAYOUTS_KEPT", 3)
    ids = [subclasses.layout_id(("layout", k)) for k in range(5)]
    assert len(set(ids)) == 5 and len(subclasses._layout_ids) == 3
    assert subclasses.layout_id(("layout", 4)) == ids[4]  # remembered
    assert subclasses.layout_id(("layout", 0)) not in ids  # forgotten: a new number
