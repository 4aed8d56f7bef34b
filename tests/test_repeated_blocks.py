"""A compiled region cut into its repeated blocks (backends/repeated_blocks.py): a deep
model's layers compile once, and the gradients are those of the region compiled whole."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import gradfx
from gradfx.backends import builtin, repeated_blocks, split
from helpers import assert_same, compare_training


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield
    gradfx.reset()


def _deep_mlp(depth=8, width=32):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width))
                           for _ in range(depth)])


def _encoder(layers=4):
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _counting_aot_eager():
    """(the sizes of the regions it compiled, a split backend compiling with aot_eager)."""
    compiles = []

    def counting(gm, examples):
        compiles.append(len(gm.graph.nodes))
        return builtin._aot_eager_compile(gm, examples)
    return compiles, builtin._split_backend("counting", counting)


def _region_of(model, x):
    graph = gradfx.capture(model(x).sum())
    pieces = split.partition(graph.graph_module.graph)
    return graph.graph_module, [nodes for compiled, nodes in pieces if compiled]


def test_layers_are_found_as_identical_blocks():
    gm, regions = _region_of(_deep_mlp(), torch.randn(16, 32))
    assert len(regions) >= 8
    signatures = [repeated_blocks._signature(block) for block in regions]
    assert max(signatures.count(s) for s in signatures) >= 6  # the layers between the first and last


@pytest.mark.parametrize("dynamic", [False, True])
def test_blocks_cover_the_region_in_order(dynamic):
    """Every node once, each after what it reads; what a compiled block hands on is tensors
    (inductor returns nothing else): a symbolic graph's size arithmetic comes first, in
    Python, and a tuple stays with its getitems."""
    torch.manual_seed(0)
    graph = gradfx.capture(_encoder(6)(torch.randn(2, 5, 32)).sum(), dynamic=dynamic)
    nodes = list(graph.graph_module.graph.nodes)
    pure: set = set()
    for n in nodes:
        if split._pure(n, pure):
            pure.add(n)
    region = [n for n in nodes if n in pure]
    cut = repeated_blocks.blocks(region)
    order = [n for block in cut for n in block]
    assert sorted(order, key=nodes.index) == region  # every node once
    position = {n: k for k, n in enumerate(order)}
    assert all(position[a] < position[n] for n in order for a in n.all_input_nodes if a in position)
    assert len(cut) >= 4
    for block in cut:
        if not any(map(split.aten_work, block)):
            continue  # sizes, run in Python
        inside = set(block)
        handed_on = {n for n in block for user in n.users if user not in inside}
        assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in handed_on), handed_on


def test_symbolic_graph_blocks_compile_once_per_size():
    """dynamic=True: the layers of a symbolic graph are blocks too, compiled once per size."""
    compiles, backend = _counting_aot_eager()
    torch.manual_seed(0)
    model = _encoder(6)
    reference = copy.deepcopy(model)
    for length in (5, 7, 6):
        x = torch.randn(2, length, 32)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        reference(x).sum().backward()
        with gradfx.compiled_autograd(backend=backend, dynamic=True):
            model(x).sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    _, regions = _region_of(_encoder(6), torch.randn(2, 5, 32))
    assert gradfx.stats()["captures"] == 1
    assert len(compiles) < 3 * len(regions)  # each size compiles the distinct blocks only


def test_small_or_unrepeated_regions_stay_whole():
    nodes = [fx.Node(fx.Graph(), f"n{k}", "call_function", torch.ops.aten.relu.default, (), {}) for k in range(20)]
    assert repeated_blocks.blocks(nodes) == [nodes]


def test_canonical_key_ignores_names_but_not_shapes():
    def piece(name, shape):
        g = fx.Graph()
        x = g.placeholder(name)
        g.output(g.call_function(torch.ops.aten.relu.default, (x,)))
        return fx.GraphModule(torch.nn.Module(), g), [torch.empty(shape)]
    a, b, c = piece("a", (2, 3)), piece("b", (2, 3)), piece("a", (3, 3))
    assert repeated_blocks.canonical_key(*a) == repeated_blocks.canonical_key(*b)
    assert repeated_blocks.canonical_key(*a) != repeated_blocks.canonical_key(*c)


@pytest.mark.parametrize("make, shape", [(_deep_mlp, (16, 32)), (_encoder, (2, 5, 32))])
def test_each_distinct_block_compiles_once(make, shape):
    """aot_eager's region compile, counted: fewer compiles than compiled regions, and the
    gradients equal the region compiled whole (blocks off) bit for bit."""
    compiles, backend = _counting_aot_eager()

    torch.manual_seed(0)
    model = make()
    x = torch.randn(*shape)
    whole = copy.deepcopy(model)
    with gradfx.compiled_autograd(backend=backend):
        model(x).sum().backward()
    blocks_compiled = len(compiles)
    compiles.clear()
    gradfx.reset()
    kept, repeated_blocks.MIN_NODES = repeated_blocks.MIN_NODES, 10 ** 9
    try:
        with gradfx.compiled_autograd(backend=backend):
            whole(x).sum().backward()
    finally:
        repeated_blocks.MIN_NODES = kept
    assert len(compiles) == 1  # the region whole
    assert 1 < blocks_compiled < len(_region_of(make(), x)[1])  # its distinct blocks, once each
    assert_same([p.grad for p in model.parameters()], [p.grad for p in whole.parameters()])


def test_training_with_blocks_matches_eager():
    compare_training(_encoder, lambda: (torch.randn(2, 5, 32),), backend="aot_eager", exact=False)


@pytest.mark.slow
@pytest.mark.sample
def test_inductor_compiles_a_layer_once(caplog):
    """Four identical encoder layers: inductor compiles fewer regions than there are blocks."""
    with caplog.at_level("INFO", logger="gradfx"):
        compare_training(lambda: _encoder(4), lambda: (torch.randn(2, 5, 32),), backend="inductor", exact=False)
    started = [r for r in caplog.records if "inductor compiling a region" in r.getMessage()]
    _, regions = _region_of(_encoder(4), torch.randn(2, 5, 32))
    assert 0 < len(started) < len(regions)
