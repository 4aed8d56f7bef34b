"""Bad input gets a clear answer, a failed backend loses nothing (issue 13).

Argument validation.
"""

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.capture.cache import cache
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


# -- arguments -------------------------------------------------------------------

@pytest.mark.parametrize("backend", [123, 1.5, None, ["eager"], b"eager"])
def test_backend_of_another_type_is_a_type_error(backend):
    with pytest.raises(TypeError, match="backend must be a registered name"):
        gradfx.compiled_autograd(backend=backend)


def test_unknown_backend_name_is_still_a_value_error():
    with pytest.raises(ValueError, match="known backends"):
        gradfx.compiled_autograd(backend="no-such-backend")


def test_register_backend_refuses_non_string_names():
    with pytest.raises(TypeError, match="backend name must be a str"):
        gradfx.register_backend(5, lambda gm: gm)
    with pytest.raises(TypeError, match="backend name must be a str"):
        gradfx.register_backend(("a",))(lambda gm: gm)
    assert "eager" in gradfx.list_backends()  # still sortable


def test_passes_as_a_single_name():
    model = _model()
    with gradfx.compiled_autograd(passes="dce") as s:
        model(_x()).sum().backward()
    assert [r.name for r in s.graphs[0].passes] == ["dce"]
    assert_same(grads_of(model.parameters()), _eager_grads())
    model.zero_grad(set_to_none=True)
    with gradfx.compiled_autograd(passes=["dce"]) as s:  # the same pipeline
        model(_x()).sum().backward()
    assert s.stats["cache_hits"] == 1


@pytest.mark.parametrize("passes, error", [(5, TypeError), ([5], TypeError), (["d"], ValueError),
                                           ("no_such_pass", ValueError), ({"dce": 1}, TypeError)])
def test_bad_passes(passes, error):
    with pytest.raises(error, match="pass"):
        gradfx.compiled_autograd(passes=passes)


@pytest.mark.parametrize("strict", ["no", 1, 0, None])
def test_strict_must_be_a_bool(strict):
    with pytest.raises(TypeError, match="strict must be True or False"):
        gradfx.compiled_autograd(strict=strict)


@pytest.mark.parametrize("dynamic", [1, 0, "yes", None])
def test_dynamic_must_be_one_of_three(dynamic):
    with pytest.raises(ValueError, match="dynamic must be"):
        gradfx.compiled_autograd(dynamic=dynamic)


@pytest.mark.parametrize("size, error", [(2.5, TypeError), (True, TypeError), ("8", TypeError),
                                         (0, ValueError), (-3, ValueError)])
def test_set_cache_size_validates(size, error):
    with pytest.raises(error, match="cache size"):
        gradfx.set_cache_size(size)
    assert cache.max_size == 128


def test_set_cache_size_accepts_integer_types():
    np = pytest.importorskip("numpy")
    gradfx.set_cache_size(np.int64(4))
    assert cache.max_size == 4 and type(cache.max_size) is int
