"""Bad input gets a clear answer, a failed backend loses nothing (issue 13).

Argument validation; eager's own errors for calls eager refuses.
"""

import warnings

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


def _error_of(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the point is to see what eager raises
        return err
    raise AssertionError("expected an error")


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


# -- calls eager refuses ---------------------------------------------------------

@pytest.mark.parametrize("strict", [False, True])
def test_backward_of_a_tensor_without_grad_raises_eagers_error_uncounted(strict):
    plain = torch.randn(3).sum()
    eager = _error_of(plain.backward)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no FallbackWarning
        with gradfx.compiled_autograd(strict=strict) as s:
            with pytest.raises(RuntimeError) as err:
                plain.backward()
            assert type(err.value) is type(eager) and str(err.value) == str(eager)
            model = _model()
            x = torch.randn(3, 4)  # does not require grad
            eager_grad = _error_of(lambda: torch.autograd.grad(model(x).sum(), [x]))
            with pytest.raises(RuntimeError) as err:
                torch.autograd.grad(model(x).sum(), [x])
            assert type(err.value) is type(eager_grad) and str(err.value) == str(eager_grad)
    assert s.stats == dict.fromkeys(s.stats, 0) and gradfx.stats() == s.stats
    assert all(p.grad is None for p in model.parameters())


def test_autograd_grad_unused_input_raises_eagers_exact_error():
    x, unused = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    eager = _error_of(lambda: torch.autograd.grad((x * 2).sum(), [x, unused]))
    for backend in ("eager", lambda gm: gm):
        with gradfx.compiled_autograd(backend=backend):
            with pytest.raises(type(eager)) as err:
                torch.autograd.grad((x * 2).sum(), [x, unused])
        assert str(err.value) == str(eager)


def test_capture_of_an_unused_input_raises_eagers_error():
    model = _model()
    unused = torch.randn(3, requires_grad=True)
    eager = _error_of(lambda: torch.autograd.grad(model(_x()).sum(), [model[0].weight, unused]))
    with pytest.raises(type(eager)) as err:
        gradfx.capture(model(_x()).sum(), inputs=[model[0].weight, unused])
    assert str(err.value) == str(eager)


def test_capture_of_tensors_without_grad_raises_eagers_errors():
    model = _model()
    plain = torch.randn(3)
    for outputs, inputs in ((plain.sum(), None), (model(_x()).sum(), [plain])):
        if inputs is None:
            eager = _error_of(lambda: torch.autograd.backward(outputs))
        else:
            eager = _error_of(lambda: torch.autograd.grad(outputs, inputs))
        with pytest.raises(type(eager)) as err:
            gradfx.capture(outputs, inputs=inputs)
        assert str(err.value) == str(eager)
