"""DP-SGD with opacus in ExpandedWeights mode (``grad_sample_mode="ew"``), under gradfx.

ExpandedWeights wraps each parameter in a tensor subclass for the forward; its layers'
backwards are custom Functions that compute the per-sample gradients into
``p.grad_sample``.  gradfx captures the backward: those Functions run as themselves (their
backward reads the subclass), the leaves' accumulators are the subclass's, and the rest is
traced.  Every step's per-sample gradients, and the parameters after opacus' clipping,
noise and SGD step, equal eager's bit for bit.
"""

import warnings

import pytest
import torch
import torch.nn as nn

import gradfx
from helpers import backward

opacus = pytest.importorskip("opacus")

STEPS = 3


class Net(nn.Module):
    """Layers ExpandedWeights computes per-sample gradients for: embedding, layer norm, linear."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, ids):
        h = self.norm(self.embed(ids)).mean(1)
        return self.out(torch.relu(self.hidden(h)))


def _train(under_gradfx: bool):
    from opacus import PrivacyEngine
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randint(0, 20, (12, 5)), torch.randint(0, 3, (12,)))
    loader = torch.utils.data.DataLoader(data, batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # opacus' notes on secure RNG and the accountant
        model, optimizer, loader = PrivacyEngine().make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
            grad_sample_mode="ew", poisson_sampling=False)
    seen = []
    for step, (ids, target) in zip(range(STEPS), loader):
        torch.manual_seed(100 + step)  # the noise opacus draws
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(ids), target)
        backward(loss, under_gradfx)
        seen.append([p.grad_sample.clone() for p in model.parameters()])
        optimizer.step()
        seen.append([p.detach().clone() for p in model.parameters()])
    return seen


def test_dp_sgd_in_expanded_weights_mode_equals_eager():
    eager = _train(False)
    gradfx.reset()
    captured = _train(True)
    assert len(captured) == len(eager) == 2 * STEPS
    for step, (a, b) in enumerate(zip(eager, captured)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"step {step // 2}: " + (
            "per-sample gradients" if step % 2 == 0 else "parameters after the step") + " differ from eager's"
    stats = gradfx.stats()
    assert stats["fallbacks"] == 0 and stats["captures"] == 1 and stats["cache_hits"] == STEPS - 1, stats
