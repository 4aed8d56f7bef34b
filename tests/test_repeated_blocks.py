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


def _region_of(model, x):
    graph = gradfx.capture(model(x).sum())
    pieces = split.partition(graph.graph_module.graph)
    return graph.graph_module, [nodes for compiled, nodes in pieces if compiled]


def test_layers_are_found_as_identical_blocks():
    gm, regions = _region_of(_deep_mlp(), torch.randn(16, 32))
    assert len(regions) >= 8
    signatures = [repeated_blocks._signature(block) for block in regions]
    assert max(signatures.count(s) for s in signatures) >= 6  # the layers between the first and last


def test_blocks_cover_the_region_in_order():
    torch.manual_seed(0)
    graph = gradfx.capture(_encoder()(torch.randn(2, 5, 32)).sum())
    nodes = list(graph.graph_module.graph.nodes)
    region = [n for n in nodes if n.op == "call_function" and split._pure(n, set(nodes))]
    cut = repeated_blocks.blocks(region)
    order = [n for block in cut for n in block]
    assert sorted(order, key=nodes.index) == region  # every node once
    position = {n: k for k, n in enumerate(order)}
    assert all(position[a] < position[n] for n in order for a in n.all_input_nodes if a in position)
    assert len(cut) >= 4


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
    compiles = []

    def counting(gm, examples):
        compiles.append(len(gm.graph.nodes))
        return builtin._aot_eager_compile(gm, examples)
    backend = builtin._split_backend("counting", counting)

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
