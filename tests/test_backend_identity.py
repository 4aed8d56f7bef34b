"""Backends and passes are keyed by what they are, not by the object (issue 13).

``backend=lambda gm: ...`` written inside the training loop is a new function
object each step and must still reuse the compiled graph; different code or
different captured values are different backends.
"""

import functools

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.backends.identity import callable_key
from helpers import assert_same, grads_of


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


def test_new_lambda_per_step_reuses_the_graph():
    model, expected = _model(), _eager_grads()
    for _ in range(20):
        model.zero_grad(set_to_none=True)
        with gradfx.compiled_autograd(backend=lambda gm: gm):  # a new function object each step
            model(_x()).sum().backward()
        assert_same(grads_of(model.parameters()), expected)
    assert gradfx.stats() == {"captures": 1, "cache_hits": 19, "fallbacks": 0, "compiles": 1, "recaptures": 0, "recompiles": 0,
                              "uncompiled": 0}


def test_default_captured_values_tell_backends_apart():
    calls = []
    model, expected = _model(), _eager_grads()
    for tag in ("a", "b", "a", "b", 1, 1.0, True):
        model.zero_grad(set_to_none=True)
        # One required parameter: called with the graph alone, `tag` keeps its default.
        with gradfx.compiled_autograd(backend=lambda gm, tag=tag: calls.append(tag) or gm):
            model(_x()).sum().backward()
        assert_same(grads_of(model.parameters()), expected)
    # 1, 1.0 and True are equal in Python but not the same value.
    assert calls == ["a", "b", 1, 1.0, True]
    assert [type(c) for c in calls[2:]] == [int, float, bool]
    assert gradfx.stats()["captures"] == 5 and gradfx.stats()["cache_hits"] == 2


def test_closure_cells_immutable_by_value_mutable_by_identity():
    def make(value):
        return lambda gm: (value, gm)[1]
    assert callable_key(make(3)) == callable_key(make(3))
    assert callable_key(make(3)) != callable_key(make(4))
    assert callable_key(make((1, "x", torch.float32))) == callable_key(make((1, "x", torch.float32)))
    assert callable_key(make(0.0)) != callable_key(make(-0.0))
    assert callable_key(make(float("nan"))) == callable_key(make(float("nan")))
    config = {"mode": "a"}
    assert callable_key(make(config)) == callable_key(make(config))
    assert callable_key(make(config)) != callable_key(make({"mode": "a"}))  # another dict
    # Functions in cells are keyed by the same rule, recursively.
    assert callable_key(make(make(3))) == callable_key(make(make(3)))
    assert callable_key(make(make(3))) != callable_key(make(make(5)))


def test_partials_methods_and_other_callables():
    def compile_fn(gm, example_inputs, mode):
        return gm
    assert callable_key(functools.partial(compile_fn, mode="a")) == callable_key(functools.partial(compile_fn, mode="a"))
    assert callable_key(functools.partial(compile_fn, mode="a")) != callable_key(functools.partial(compile_fn, mode="b"))

    class Compiler:
        def __init__(self):
            self.calls = 0

        def compile(self, gm):
            return gm

        def __call__(self, gm):
            return gm
    one, two = Compiler(), Compiler()
    assert callable_key(one.compile) == callable_key(one.compile)
    assert callable_key(one.compile) != callable_key(two.compile)
    assert callable_key(one) == callable_key(one) and callable_key(one) != callable_key(two)
    assert callable_key(len) == callable_key(len)


def test_recursive_nested_function_has_a_key():
    def make():
        def rec(gm, depth=0):
            return gm if depth else rec(gm, 1)
        return rec
    assert callable_key(make()) == callable_key(make())


def test_module_level_globals_are_not_in_the_key():
    # Same code, same globals dict: one backend, whatever the globals hold now.
    namespace = {}
    exec("def backend(gm):\n    return gm\n", namespace)
    first = namespace["backend"]
    exec("def backend(gm):\n    return gm\n", namespace)
    assert callable_key(first) == callable_key(namespace["backend"])
    other = {}
    exec("def backend(gm):\n    return gm\n", other)
    assert callable_key(first) != callable_key(other["backend"])  # another module's globals


def test_passes_with_the_same_name_do_not_share_graphs():
    seen = []

    def make(tag):
        def mark(graph):  # every pass made here is called "mark"
            seen.append(tag)
        return mark
    model, expected = _model(), _eager_grads()
    for tag in ("a", "b", "a"):
        model.zero_grad(set_to_none=True)
        with gradfx.compiled_autograd(passes=[make(tag), "dce"]):
            model(_x()).sum().backward()
        assert_same(grads_of(model.parameters()), expected)
    assert seen == ["a", "b"]
    assert gradfx.stats()["captures"] == 2 and gradfx.stats()["cache_hits"] == 1


def test_reregistering_a_name_recompiles():
    calls = []

    def first(gm):
        calls.append("first")
        return gm

    def second(gm):
        calls.append("second")
        return gm
    model, expected = _model(), _eager_grads()
    for fn in (first, first, second, second):
        gradfx.register_backend("issue13_mine", fn)
        model.zero_grad(set_to_none=True)
        with gradfx.compiled_autograd(backend="issue13_mine"):
            model(_x()).sum().backward()
        assert_same(grads_of(model.parameters()), expected)
    assert calls == ["first", "second"]


def test_plain_function_key_follows_changed_defaults():
    # Keys of closure-free functions are remembered per function object; a changed
    # default (or code) must still change the key.
    def backend(gm, mode="a"):
        return gm
    first = callable_key(backend)
    assert callable_key(backend) is first
    backend.__defaults__ = ("b",)
    assert callable_key(backend) != first
    backend.__defaults__ = ("a",)
    assert callable_key(backend) == first
    backend.__code__ = (lambda gm, mode="a": gm).__code__
    assert callable_key(backend) != first


@pytest.mark.slow
def test_torch_compile_lambda_in_the_training_loop_compiles_once():
    # The issue's own example: dynamo compiles the graph once, later steps hit.
    model, expected = _model(), _eager_grads()
    for _ in range(4):
        model.zero_grad(set_to_none=True)
        with gradfx.compiled_autograd(backend=lambda gm: torch.compile(gm, backend="eager")):
            model(_x()).sum().backward()
        assert_same(grads_of(model.parameters()), expected)
    assert gradfx.stats()["captures"] == 1 and gradfx.stats()["cache_hits"] == 3
