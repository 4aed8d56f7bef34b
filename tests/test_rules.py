"""Every backward rule equals the real autograd node, bitwise, on random inputs."""

import pytest
import torch

from gradfx.capture.rules import RULES, apply_rule

# node name -> function(seed) returning (output tensor whose grad_fn is that node, grads)
CASES = {}


def case(name):
    def add(fn):
        CASES.setdefault(name, []).append(fn)
        return fn
    return add


@case("SumBackward0")
def _sum(seed):
    torch.manual_seed(seed)
    x = torch.randn(3, 4, requires_grad=True)
    y = x.sum()
    return y, (torch.randn(()),)


def _cases():
    for name, fns in sorted(CASES.items()):
        for k, fn in enumerate(fns):
            yield pytest.param(name, fn, id=f"{name}-{k}")


@pytest.mark.parametrize("name, make", list(_cases()))
def test_rule_matches_node(name, make):
    for seed in range(3):
        out, grads = make(seed)
        node = out.grad_fn
        assert type(node).__name__ == name
        expected = node(*grads)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = apply_rule(node, grads)
        assert len(got) == len(expected)
        for e, g in zip(expected, got):
            if e is None:
                assert g is None
            else:
                assert g is not None and g.shape == e.shape and g.dtype == e.dtype
                assert g.stride() == e.stride(), (g.stride(), e.stride())
                assert torch.equal(g, e)


def test_every_rule_has_a_case():
    assert set(RULES) <= set(CASES), sorted(set(RULES) - set(CASES))
