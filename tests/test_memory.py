"""Saved tensors are let go of during the backward, as eager lets go of them.

Counted exactly: after a backward without ``retain_graph``, nothing but the test
may still reference an activation's storage, on the capture and on cache hits.
(Peak bytes are measured by bench/bench_memory.py: 1.00x eager on the 4 x 1024 MLP.)
"""

import torch
import torch.nn as nn

import gradfx


def _storage_refs(t: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def _refs_after_backward(lin, use_gradfx: bool, **kwargs) -> int:
    h = torch.tanh(lin(torch.randn(4, 8)))
    loss = (h * h.sigmoid()).sum()  # MulBackward and SigmoidBackward save h or its sigmoid
    if use_gradfx:
        with gradfx.compiled_autograd(**kwargs):
            loss.backward()
    else:
        loss.backward()
    return _storage_refs(h)


def test_saved_tensors_released_like_eager():
    gradfx.reset()
    lin = nn.Linear(8, 8)
    eager = _refs_after_backward(lin, False)
    ours = [_refs_after_backward(lin, True) for _ in range(3)]
    assert gradfx.stats()["captures"] == 1 and gradfx.stats()["cache_hits"] == 2
    assert ours == [eager] * 3


def test_saved_tensors_released_with_every_pipeline():
    lin = nn.Linear(8, 8)
    eager = _refs_after_backward(lin, False)
    for passes in ([], ["dce"]):
        gradfx.reset()
        assert [_refs_after_backward(lin, True, passes=passes) for _ in range(2)] == [eager] * 2
