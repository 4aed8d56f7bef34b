"""Capture-core scenarios: real models, gradients bitwise equal to eager autograd."""

import torch
import torch.nn as nn

import gradfx
from helpers import compare_training


def mlp():
    return nn.Sequential(*[nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32)) for _ in range(4)])


def test_mlp():
    compare_training(mlp, lambda: (torch.randn(8, 32),))
    assert gradfx.stats()["compiles"] == 1


def test_mlp_relu_mse():
    model = lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    target = torch.randn(8, 4)
    compare_training(model, lambda: (torch.randn(8, 16),), lambda out: nn.functional.mse_loss(out, target))


def test_conv_batchnorm_pool():
    model = lambda: nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.MaxPool2d(2), nn.Conv2d(8, 4, 3), nn.AdaptiveAvgPool2d(1),
                                  nn.Flatten(), nn.Linear(4, 3))
    compare_training(model, lambda: (torch.randn(4, 3, 12, 12),))


def test_layernorm_embedding():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 16)
            self.norm = nn.LayerNorm(16)
            self.out = nn.Linear(16, 50)

        def forward(self, idx):
            return self.out(self.norm(self.emb(idx)))
    compare_training(M, lambda: (torch.randint(0, 50, (4, 7)),),
                     lambda out: nn.functional.cross_entropy(out.reshape(-1, 50), torch.arange(28) % 50))


def test_lstm():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.LSTM(8, 16, num_layers=2, batch_first=True)
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            return self.head(self.rnn(x)[0][:, -1])
    compare_training(M, lambda: (torch.randn(3, 5, 8),))


def test_gru():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(8, 12, batch_first=True)

        def forward(self, x):
            return self.rnn(x)[0]
    compare_training(M, lambda: (torch.randn(2, 6, 8),), lambda out: (out ** 2).mean())


def test_transformer_encoder_layer():
    model = lambda: nn.TransformerEncoder(
        nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True), num_layers=2,
        enable_nested_tensor=False)
    compare_training(model, lambda: (torch.randn(2, 10, 32),))


def test_softmax_cross_entropy():
    target = torch.tensor([1, 0, 3, 2])
    compare_training(lambda: nn.Linear(10, 4), lambda: (torch.randn(4, 10),),
                     lambda out: nn.functional.cross_entropy(out, target) + out.softmax(-1).max(),
                     allow_opaque=("MaxBackward1",))  # runs as the real node (capture.rules.RUN_REAL)


def test_broadcasting_sum_to():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(1, 5))
            self.bias = nn.Parameter(torch.randn(5))
            self.scalar = nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return (x * self.scale + self.bias) * self.scalar
    compare_training(M, lambda: (torch.randn(4, 3, 5),))


def test_shared_parameters():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(self.lin(x))))
    compare_training(M, lambda: (torch.randn(4, 8),))


def test_fan_in_three_consumers():
    # A tensor feeding several consumers: eager's summation order must be kept.
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(16, 16)

        def forward(self, x):
            h = self.a(x)
            return h.sin() * 3.1 + h.cos() * h.exp() + h * 0.7 + h.sigmoid()
    compare_training(M, lambda: (torch.randn(8, 16),))


def test_views_and_inplace_on_views():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 4))

        def forward(self, x):
            y = x @ self.w.t()
            y = y.clone()
            y[:, 1:3].mul_(2.0)      # in-place on a view: CopySlices
            y.view(-1)[::2].add_(1.0)
            return y.transpose(0, 1).reshape(-1)[3:]
    compare_training(M, lambda: (torch.randn(5, 4),), check_opaque=False)
    # In-place ops on views run as the real CopySlices node (its view geometry is hidden).
    graph = gradfx.capture(M()(torch.randn(5, 4)).sum())
    assert {label.split(" ")[0] for label in graph.opaque_nodes} == {"torch::autograd::CopySlices"}


def test_mixed_dtypes():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
            self.b = nn.Parameter(torch.randn(4, 4))
            self.c = nn.Parameter(torch.randn(4, 4).to(torch.bfloat16))

        def forward(self, x):
            return (x.double() @ self.a).float() @ self.b + (x.bfloat16() @ self.c).float()
    compare_training(M, lambda: (torch.randn(3, 4),))


def test_gradient_accumulation_does_not_recapture():
    # .grad None on the first micro-batch, set afterwards: one capture (not keyed).
    compare_training(mlp, lambda: (torch.randn(8, 32),), iterations=4, zero_grad=False)


def test_deep_chain_no_recursion_limit():
    model = lambda: nn.Sequential(*[nn.Linear(4, 4) for _ in range(400)])
    compare_training(model, lambda: (torch.randn(2, 4),), iterations=2)


def test_user_dispatch_modes_around_backward_see_the_backward_as_in_eager():
    """A TorchDispatchMode (a logging mode, FlopCounterMode) entered around backward()
    sees the same aten calls as in eager, on the capturing call and on cache hits; it
    does not see gradfx's walk or tracing (under such a mode, the walk's take-over of
    saved tensors used to fail and the backward raised)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class Log(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 2))
    for make_mode, seen in ((Log, lambda m: m.ops), (lambda: FlopCounterMode(display=False),
                                                     lambda m: m.get_total_flops())):
        gradfx.reset()
        results = []
        for engine in ("eager", "gradfx", "gradfx"):
            model.zero_grad(set_to_none=True)
            loss = model(torch.randn(3, 4, generator=torch.Generator().manual_seed(1))).sum()
            with make_mode() as mode:
                if engine == "gradfx":
                    with gradfx.compiled_autograd(backend="eager", strict=True):
                        loss.backward()
                else:
                    loss.backward()
            results.append((seen(mode), [p.grad.clone() for p in model.parameters()]))
        for got in results[1:]:
            assert got[0] == results[0][0]
            assert all(torch.equal(a, b) for a, b in zip(got[1], results[0][1]))
        assert gradfx.stats()["cache_hits"] == 1
