"""Formulas whose C++ code computes differently while traced run as the real node.

``prod``, ``cumprod`` and ``masked_fill`` with a tensor value branch on
``isTensorSubclassLike`` (always true under a dispatch mode) and, in eager, on the
data; traced, they were 1 ulp off.  Each case is compared bitwise with eager,
with and without zeros, static and symbolic.
"""

import pytest
import torch

import gradfx

from gradfx.capture.trace.rules import RUN_REAL
from helpers import bitwise_equal


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def _prod_program(name, zeros, n):
    def build():
        x = torch.randn(n, 5, dtype=torch.float32, requires_grad=True)
        with torch.no_grad():
            for i, j in zeros:
                x[i, j] = 0
        w = torch.randn(n, 5)
        out = {"prod": lambda: x.prod() * 1.3,
               "prod_dim": lambda: (x.prod(1) * w[:, 0]).sum() + (x.prod(0, keepdim=True) * w[:1]).sum(),
               "cumprod": lambda: (x.cumprod(1) * w).sum() + (x.cumprod(0) * w).sum()}[name]()
        return [x], out
    return build


def _masked_fill_program(n):
    # The shape of graph the issue found: masked_fill with a tensor value among index ops.
    def build():
        x = torch.randn(n, 6, requires_grad=True)
        v = torch.randn((), requires_grad=True)
        m = torch.rand(n, 6) > 0.5
        y = x.masked_fill(m, v)
        z = torch.where(m, y, x * 2)
        idx = torch.tensor([0, 2, 2, 1])
        a = torch.zeros(n, 6).index_add(0, idx, z[:4] * 1.5)
        s = a.scatter(1, torch.tensor([[0, 1]] * n), z[:, :2])
        s.scatter_(1, torch.tensor([[3, 4]] * n), y[:, 2:4])
        g = s.gather(1, torch.tensor([[5, 0, 5]] * n))
        sa = torch.zeros(n, 6).scatter_add(1, torch.tensor([[1, 1, 2]] * n), g)
        return [x, v], (sa * torch.randn(n, 6)).sum() + v * 3
    return build


def _compare(build, seeds=range(6), dynamic=False):
    for seed in seeds:
        torch.manual_seed(seed)
        leaves, loss = build()
        loss.backward()
        expected = [leaf.grad for leaf in leaves]
        torch.manual_seed(seed)
        leaves, loss = build()
        with gradfx.compiled_autograd(strict=True, dynamic=dynamic) as s:
            loss.backward()
        assert s.stats["fallbacks"] == 0
        for e, g in zip(expected, [leaf.grad for leaf in leaves]):
            assert bitwise_equal(e, g), f"seed {seed}: max diff {(e - g).abs().max()}"


@pytest.mark.parametrize("name", ["prod", "prod_dim", "cumprod"])
@pytest.mark.parametrize("zeros", [[], [(0, 1)], [(0, 1), (2, 0), (2, 3)], [(1, 1), (3, 1)]])
def test_prod_and_cumprod(name, zeros):
    _compare(_prod_program(name, zeros, 4))


def test_masked_fill_with_a_tensor_value():
    _compare(_masked_fill_program(5))


@pytest.mark.parametrize("dynamic", [True, "auto"])
def test_at_several_sizes(dynamic):
    for n in (4, 6, 8, 5):
        _compare(_prod_program("prod_dim", [(1, 1)], n), seeds=[n], dynamic=dynamic)
        _compare(_masked_fill_program(n), seeds=[n], dynamic=dynamic)


def test_real_nodes_are_listed_as_opaque():
    x = torch.randn(3, 4, requires_grad=True)
    graph = gradfx.capture(x.prod(1).sum())
    assert [label.split()[0] for label in graph.opaque_nodes] == ["ProdBackward1"]
    assert "ProdBackward1" in RUN_REAL


def _hidden_state_program(kind, k):
    """Programs whose node keeps sizes Python cannot read: they change, the key does not."""
    def build():
        a = torch.randn(3, 4, requires_grad=True)
        if kind == "cat":  # the widths of inputs that need no gradient move
            y = torch.cat([torch.randn(3, k), a, torch.randn(3, 5 - k)], 1)
        elif kind == "slice_assignment":  # the slice moves
            y = torch.randn(3, 12) * 1.0
            y[:, k:k + 4] = a * 2
        else:  # as_strided of a view at a moving storage offset
            base = torch.randn(3, 12, requires_grad=True)
            y = base[:, k:k + 6].as_strided((3, 4), (12, 1), k) + a
            return [a, base], (y * torch.arange(12.0).view(3, 4)).sum()
        return [a], (y * torch.arange(y.numel() * 1.0).view(y.shape)).sum()
    return build


@pytest.mark.parametrize("kind", ["cat", "slice_assignment", "as_strided"])
@pytest.mark.parametrize("dynamic", [False, True])
def test_hidden_sizes_never_reuse_a_wrong_graph(kind, dynamic):
    for k in (1, 2, 4, 1):
        _compare(_hidden_state_program(kind, k), seeds=[k], dynamic=dynamic)


def _more_hidden_state(kind, k):
    def build():
        a = torch.randn(3, 4, requires_grad=True)
        if kind == "foreach":  # CppFunction: one Python type for every op without bindings
            ys = (torch._foreach_mul([a * 1.0], float(k)) if k % 2 else torch._foreach_neg([a * 1.0]))
            y = ys[0]
        elif kind == "block_diag":
            y = torch.block_diag(torch.randn(k, k), a, torch.randn(4 - k, 1))
        elif kind == "dropout":  # the same mask, train flag changes the scale
            torch.manual_seed(0)
            y = torch.ops.aten.native_dropout(a * 1.0, 0.5, bool(k % 2))[0]
        else:  # y[mask] = v: the number of selected values is data
            y = torch.zeros(3, 4)
            mask = torch.arange(12).view(3, 4) < 3 * k
            y[mask] = (a * 2).flatten()[: int(mask.sum())]
        return [a], (y * torch.arange(y.numel() * 1.0).view(y.shape)).sum()
    return build


@pytest.mark.parametrize("kind", ["foreach", "block_diag", "dropout", "index_put_mask"])
def test_more_nodes_with_hidden_state(kind):
    for k in (1, 2, 3, 1):
        _compare(_more_hidden_state(kind, k), seeds=[k])


def _reduction_program(name, upstream):
    # max()/min()/median()/nanmedian() share the gradient among tied elements; eager on
    # the CPU fills a zero tensor, the traced formula multiplies a mask, and the two part
    # where the gradient coming in is inf or nan (0 * inf).
    def build():
        x = torch.tensor([[1.0, 3.0, 3.0], [0.5, 3.0, -2.0]], requires_grad=True)
        y = getattr(x * 1.0, name)()
        return [x], y * torch.tensor(upstream)
    return build


@pytest.mark.parametrize("upstream", [2.0, float("inf"), float("nan")], ids=["finite", "inf", "nan"])
@pytest.mark.parametrize("name", ["max", "min", "median", "nanmedian"])
def test_full_reductions_with_any_upstream_gradient(name, upstream):
    _compare(_reduction_program(name, upstream), seeds=[0])
