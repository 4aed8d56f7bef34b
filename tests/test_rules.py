"""Every backward rule equals the real autograd node, bitwise, on random inputs."""

import pytest
import torch

from gradfx.capture.trace.rules import RULES, apply_rule

# node name -> function(seed) returning (output tensor whose grad_fn is that node, grads)
CASES = {}


def case(name):
    def add(fn):
        CASES.setdefault(name, []).append(fn)
        return fn
    return add


def leaf(*shape):
    return torch.randn(*shape).requires_grad_()


def like(out):
    """Random incoming grads, one per output."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return tuple(torch.randn(o.shape, dtype=o.dtype) for o in outs)


def simple(name, *fns):
    """One case per fn() -> output (a tuple for multi-output ops); grads are random."""
    for fn in fns:
        def make(seed, fn=fn):
            torch.manual_seed(seed)
            out = fn()
            grads = like(out)
            return (out[0] if isinstance(out, (tuple, list)) else out), grads
        case(name)(make)


simple("SumBackward0", lambda: leaf(3, 4).sum(), lambda: leaf(4, 2).t().sum())
simple("SumBackward1",
       lambda: leaf(3, 4, 5).sum(-1),
       lambda: leaf(3, 4, 5).sum((0, -1), keepdim=True),
       lambda: leaf(3, 4, 5).sum((2, 0)),
       lambda: leaf(3, 4).sum(dim=None),
       lambda: leaf(3, 4).sum(dim=[]))
simple("MeanBackward0", lambda: leaf(3, 4).mean(), lambda: leaf(()).mean(), lambda: leaf(4, 3).t().mean())
simple("MeanBackward1",
       lambda: leaf(3, 4, 5).mean(-1),
       lambda: leaf(2, 8, 4, 4).mean((-1, -2), keepdim=True),
       lambda: leaf(3, 4, 5).mean((2, 0)),
       lambda: leaf(3, 4).mean(dim=[]))
simple("ViewBackward0", lambda: leaf(3, 4, 5).view(12, 5), lambda: leaf(2, 8, 1, 1).flatten(1))
simple("UnsafeViewBackward0", lambda: leaf(3, 4, 5).transpose(0, 1).reshape(12, 5),
       lambda: torch.matmul(leaf(2, 3, 4), leaf(4, 5)))
simple("ReshapeAliasBackward0", lambda: torch.ops.aten._reshape_alias(leaf(3, 4), (4, 3), (3, 1)),
       lambda: torch.ops.aten._reshape_alias(leaf(2, 6), (3, 2, 2), (4, 2, 1)))
simple("ExpandBackward0",
       lambda: leaf(3, 1, 5).expand(2, 3, 4, 5),
       lambda: leaf(1, 4).expand(3, 4),
       lambda: leaf(()).expand(2, 3),
       lambda: leaf(3, 4).expand(3, 4))
simple("MmBackward0",
       lambda: leaf(5, 4).mm(leaf(4, 3)),
       lambda: leaf(4, 5).t().mm(leaf(3, 4).t()),          # column-major inputs
       lambda: torch.randn(5, 4).mm(leaf(3, 4).t()),        # self needs no grad
       lambda: leaf(5, 4).mm(torch.randn(4, 3)))            # mat2 needs no grad
simple("AddmmBackward0",
       lambda: torch.addmm(leaf(3), leaf(5, 4), leaf(3, 4).t()),
       lambda: torch.addmm(leaf(5, 3), leaf(4, 5).t(), leaf(4, 3), beta=0.5, alpha=2.0),
       lambda: torch.nn.functional.linear(torch.randn(6, 4), leaf(3, 4), leaf(3)),
       lambda: torch.addmm(torch.randn(3), leaf(5, 4), torch.randn(4, 3), alpha=3))
simple("SelectBackward0", lambda: leaf(3, 4, 5)[:, -1], lambda: leaf(3, 4, 5).select(-1, 2),
       lambda: leaf(4, 3).t()[1])
simple("SliceBackward0", lambda: leaf(3, 4, 5)[:, 1:3], lambda: leaf(3, 4, 5)[:, -3:],
       lambda: leaf(3, 4, 5)[..., ::2], lambda: leaf(6, 4)[-5:-1:2])
simple("SqueezeBackward0", lambda: leaf(3, 1, 5, 1).squeeze(), lambda: leaf(1, 1).squeeze())
simple("SqueezeBackward1", lambda: leaf(3, 1, 5).squeeze(1), lambda: leaf(3, 1, 5).squeeze(-2),
       lambda: leaf(3, 4).squeeze(0))
simple("SqueezeBackward2", lambda: leaf(3, 1, 5, 1).squeeze((1, -1)), lambda: leaf(1, 4, 1).squeeze((0, 1)))
simple("SqueezeBackward3", lambda: leaf(3, 1, 5, 1).clone().squeeze_(), lambda: leaf(1, 4).clone().squeeze_())
simple("SqueezeBackward4", lambda: leaf(3, 1, 5).clone().squeeze_(-2), lambda: leaf(3, 4).clone().squeeze_(1))
simple("SqueezeBackward5", lambda: leaf(3, 1, 1).clone().squeeze_((1, -1)), lambda: leaf(1, 4).clone().squeeze_((0, 1)))
simple("UnsqueezeBackward1", lambda: leaf(3, 4).clone().unsqueeze_(-1), lambda: leaf(3, 4).clone().unsqueeze_(1))
simple("UnsqueezeBackward0", lambda: leaf(3, 4).unsqueeze(-1), lambda: leaf(3, 4).unsqueeze(0))
simple("SplitBackward0", lambda: leaf(3, 5, 2).split(2, 1), lambda: leaf(6, 3).split(3),
       lambda: leaf(4, 7).chunk(3, -1))
simple("UnsafeSplitBackward0", lambda: leaf(4, 48).unsafe_split(16, 1), lambda: leaf(5, 3).unsafe_split(2, -2))
simple("SplitWithSizesBackward0", lambda: leaf(3, 4, 5).split([1, 3], 1), lambda: leaf(6, 2).split([2, 0, 4], -2))
simple("UnsafeSplitWithSizesBackward0", lambda: leaf(3, 4).unsafe_split_with_sizes([1, 3], 1),
       lambda: leaf(5, 2).unsafe_split_with_sizes([2, 3]))
simple("StackBackward0", lambda: torch.stack([leaf(3, 4), leaf(3, 4)], -1),
       lambda: torch.stack([leaf(2), leaf(2), torch.randn(2)]))
simple("UnbindBackward0", lambda: leaf(3, 4).unbind(1), lambda: leaf(4, 3, 2).transpose(0, 2).unbind(-1))
simple("IndexBackward0",
       lambda: leaf(3, 4, 5)[torch.tensor([0, 2, 0])],
       lambda: leaf(3, 4, 5)[:, [0, 1, 1]],
       lambda: (lambda x: x[x.detach() > 0])(leaf(3, 4)))
simple("EmbeddingBackward0",
       lambda: torch.nn.functional.embedding(torch.tensor([[1, 2, 1], [0, 3, 3]]), leaf(5, 4)),
       lambda: torch.nn.functional.embedding(torch.tensor([1, 4, 1]), leaf(5, 2), padding_idx=-1),
       lambda: torch.nn.functional.embedding(torch.tensor([1, 4, 1]), leaf(5, 2), padding_idx=1,
                                             scale_grad_by_freq=True))

simple("MaxBackward0", lambda: leaf(5, 4).max(1)[0], lambda: leaf(5, 4).max(0, keepdim=True)[0], lambda: leaf(()).max(0)[0],
       lambda: leaf(3, 4, 2).max(-2)[0])
simple("MinBackward0", lambda: leaf(5, 4).min(-1)[0], lambda: leaf(5, 4).min(1, keepdim=True)[0])
simple("KthvalueBackward0", lambda: leaf(5, 4).kthvalue(2, 1)[0], lambda: leaf(5, 4).kthvalue(3, 0, keepdim=True)[0])
simple("ModeBackward0", lambda: leaf(5, 4).mode(1)[0], lambda: leaf(5, 4).round().mode(0, keepdim=True)[0])
simple("MedianBackward1", lambda: leaf(5, 4).median(1)[0], lambda: leaf(5, 4).median(0, keepdim=True)[0])
simple("NanmedianBackward1", lambda: leaf(5, 4).nanmedian(1)[0], lambda: leaf(5, 4).nanmedian(-1, keepdim=True)[0])
simple("TopkBackward0", lambda: leaf(5, 6).topk(2, 1)[0], lambda: leaf(5, 6).topk(3, 0, largest=False)[0],
       lambda: leaf(6).topk(6)[0])
simple("SortBackward0", lambda: leaf(5, 6).sort(1)[0], lambda: leaf(5, 6).sort(0, descending=True)[0], lambda: leaf(()).sort()[0])
simple("SortBackward1", lambda: leaf(5, 6).sort(stable=True, dim=1)[0], lambda: leaf(4, 3).t().sort(stable=True, dim=0)[0])

simple("RepeatBackward0", lambda: leaf(3, 2).repeat(2, 1), lambda: leaf(2, 3, 4).repeat(4, 1, 9, 3),
       lambda: leaf(3).repeat(2, 2), lambda: leaf(3, 2).repeat(1, 1), lambda: leaf(3, 2).repeat(0, 2),
       lambda: leaf(()).repeat(3), lambda: leaf(2, 4).t().repeat(3, 1, 2))

_interp = torch.nn.functional.interpolate
simple("UpsampleNearest1DBackward0", lambda: _interp(leaf(2, 3, 4), scale_factor=2), lambda: _interp(leaf(2, 3, 4), size=7))
simple("UpsampleNearestExact1DBackward0", lambda: _interp(leaf(2, 3, 4), scale_factor=1.5, mode="nearest-exact"))
simple("UpsampleNearest2DBackward0", lambda: _interp(leaf(2, 3, 4, 4), scale_factor=2),
       lambda: _interp(leaf(2, 3, 4, 5), size=(5, 7)),
       lambda: _interp(leaf(2, 3, 4, 4).to(memory_format=torch.channels_last), scale_factor=2))
simple("UpsampleNearestExact2DBackward0", lambda: _interp(leaf(2, 3, 4, 4), size=(6, 9), mode="nearest-exact"))
simple("UpsampleNearest3DBackward0", lambda: _interp(leaf(2, 1, 3, 3, 2), scale_factor=2))
simple("UpsampleNearestExact3DBackward0", lambda: _interp(leaf(2, 1, 3, 3, 2), size=(4, 5, 3), mode="nearest-exact"))
simple("UpsampleLinear1DBackward0", lambda: _interp(leaf(2, 3, 4), scale_factor=2, mode="linear"),
       lambda: _interp(leaf(2, 3, 4), size=9, mode="linear", align_corners=True))
simple("UpsampleBilinear2DBackward0", lambda: _interp(leaf(2, 3, 4, 4), scale_factor=2, mode="bilinear"),
       lambda: _interp(leaf(2, 3, 4, 5), size=(7, 3), mode="bilinear", align_corners=True),
       lambda: _interp(leaf(2, 3, 4, 4).to(memory_format=torch.channels_last), scale_factor=2, mode="bilinear"))
simple("UpsampleBicubic2DBackward0", lambda: _interp(leaf(2, 3, 4, 4), scale_factor=2, mode="bicubic"),
       lambda: _interp(leaf(1, 2, 5, 4), size=(7, 9), mode="bicubic", align_corners=True))
simple("UpsampleTrilinear3DBackward0", lambda: _interp(leaf(2, 1, 3, 3, 2), scale_factor=2, mode="trilinear"),
       lambda: _interp(leaf(1, 2, 3, 2, 4), size=(4, 3, 5), mode="trilinear", align_corners=True))

simple("UnfoldBackward0", lambda: leaf(5, 8).unfold(1, 3, 2), lambda: leaf(7).unfold(0, 2, 2),
       lambda: leaf(4, 6).t().unfold(-1, 2, 1), lambda: leaf(()).unfold(0, 1, 1))


def _split_none_grad(seed):
    torch.manual_seed(seed)
    outs = leaf(3, 5).split(2, 1)
    return outs[0], (torch.randn(3, 2), None, torch.randn(3, 1))


def _unbind_none_grad(seed):
    torch.manual_seed(seed)
    outs = leaf(3, 4).unbind(0)
    return outs[0], (None, torch.randn(4), None)


case("SplitBackward0")(_split_none_grad)
case("UnbindBackward0")(_unbind_none_grad)


def _noncontig_grad(seed):
    torch.manual_seed(seed)
    return leaf(3, 4, 5).view(12, 5), (torch.randn(5, 12).t(),)


case("ViewBackward0")(_noncontig_grad)


def _repeat_noncontig_grad(seed):
    torch.manual_seed(seed)
    return leaf(3, 2).repeat(2, 2), (torch.randn(4, 6).t(),)


case("RepeatBackward0")(_repeat_noncontig_grad)


def _group_norm(shape, groups, affine=True, channels_last=False, input_grad=True):
    """``affine``: True (weight and bias), False (neither) or "weight only"."""
    def fn():
        x = torch.randn(*shape)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        x.requires_grad_(input_grad)
        c = shape[1]
        w = leaf(c) if affine else None
        b = leaf(c) if affine is True else None
        return torch.nn.functional.group_norm(x, groups, w, b)
    return fn


def _group_norm_case(fn, channels_last_grad=False):
    def make(seed):
        torch.manual_seed(seed)
        out = fn()
        g = torch.randn(out.shape)
        if channels_last_grad:
            g = g.to(memory_format=torch.channels_last)
        return out, (g, None, None)
    return make


for _fn, _cl in ((_group_norm((4, 6, 5, 3), 3), False), (_group_norm((4, 6, 5, 3), 2, affine=False), False),
                 (_group_norm((3, 4, 7), 4), False), (_group_norm((2, 6), 3), False),
                 (_group_norm((3, 4, 2, 2), 2, affine="weight only"), False),
                 (_group_norm((3, 4, 5), 2, input_grad=False), False),
                 (_group_norm((4, 6, 5, 3), 3, channels_last=True), False),
                 (_group_norm((4, 6, 5, 3), 3), True),
                 (_group_norm((2, 4, 3, 2, 2), 2), False)):
    case("NativeGroupNormBackward0")(_group_norm_case(_fn, _cl))

simple("IndexSelectBackward0",
       lambda: leaf(5, 4).index_select(0, torch.tensor([0, 4, 0, 2])),
       lambda: leaf(3, 6, 2).index_select(1, torch.tensor([5, 1, 1])),
       lambda: leaf(4, 3).t().index_select(-1, torch.tensor([3, 3])),
       lambda: leaf(5).index_select(0, torch.tensor(2)),
       lambda: leaf(()).index_select(0, torch.tensor([0])),
       lambda: leaf(4, 3).index_select(0, torch.tensor([], dtype=torch.long)))


from test_data_sizes import RULE_CASES  # noqa: E402  (the rules for sizes that follow the data)

for _name, _fns in RULE_CASES.items():
    simple(_name, *_fns)


def _cases():
    for name, fns in sorted(CASES.items()):
        for k, fn in enumerate(fns):
            yield pytest.param(name, fn, id=f"{name}-{k}")


# Rules for formulas that branch on grad mode mirror the path a backward without
# create_graph takes (under create_graph the node runs as itself): compared with grad mode off.
GRAD_MODE_OFF = {"NativeGroupNormBackward0"}


@pytest.mark.parametrize("name, make", list(_cases()))
def test_rule_matches_node(name, make):
    for seed in range(3):
        out, grads = make(seed)
        node = out.grad_fn
        assert type(node).__name__ == name
        with torch.set_grad_enabled(name not in GRAD_MODE_OFF):
            expected = node(*grads)
            expected = expected if isinstance(expected, tuple) else (expected,)
            got = apply_rule(node, grads)
        assert len(got) == len(expected)
        for (fn, _), e, g in zip(node.next_functions, expected, got):
            if e is None:
                # a rule cannot always know which inputs need no grad; its output
                # for an input without a next node is dropped anyway
                assert g is None or fn is None
            else:
                assert g is not None and g.shape == e.shape and g.dtype == e.dtype
                assert g.stride() == e.stride(), (g.stride(), e.stride())
                assert torch.equal(g, e)


def test_every_rule_has_a_case():
    assert set(RULES) <= set(CASES), sorted(set(RULES) - set(CASES))

