"""Ops whose output layout the size expressions give, recorded without fake dispatch.

In a symbolic trace every op a backward formula calls goes through torch's proxy
mode and fake-tensor kernel: 0.3-1 ms each, most of it building the output fake's
symbolic metadata.  For the ops backward formulas call most (``t``, ``transpose``,
``detach``, ``mm``, ``bmm``, and elementwise ops on tensors of one contiguous layout:
two thirds of T5's) the output's sizes and strides are the inputs' rearranged, so
the tracer makes a fake of that layout itself
(``_Tracer.new_fake``) and records the fx node.  Anything these cannot decide from
the expressions alone (a storage offset, sizes equal only by value, mixed dtypes,
keyword arguments) goes to torch as before, guards and errors included.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental import proxy_tensor

from .plain_layout import expr, plainly_contiguous, plainly_equal
from .scoped_patch import ScopedPatch

aten = torch.ops.aten


def _plain_view_source(x) -> bool:
    return type(x) is FakeTensor and x.layout is torch.strided and expr(x.storage_offset()) == 0


def _t(x):
    if not _plain_view_source(x) or x.dim() != 2:
        return None
    return x.shape[::-1], x.stride()[::-1]


def _transpose(x, d0, d1):
    n = x.dim()
    if not _plain_view_source(x) or n == 0 or type(d0) is not int or type(d1) is not int:
        return None
    d0, d1 = d0 % n, d1 % n
    shape, strides = list(x.shape), list(x.stride())
    shape[d0], shape[d1] = shape[d1], shape[d0]
    strides[d0], strides[d1] = strides[d1], strides[d0]
    return shape, strides


def _detach(x):
    if not _plain_view_source(x):
        return None
    return x.shape, x.stride()


def _same_kind(a, b) -> bool:
    return (type(a) is FakeTensor and type(b) is FakeTensor and a.dtype == b.dtype and a.device == b.device
            and a.layout is torch.strided and b.layout is torch.strided and a.is_floating_point())


def _mm(a, b):
    if not _same_kind(a, b) or a.dim() != 2 or b.dim() != 2 or not plainly_equal(a.shape[1], b.shape[0]):
        return None
    return (a.shape[0], b.shape[1]), "contiguous"


def _bmm(a, b):
    if (not _same_kind(a, b) or a.dim() != 3 or b.dim() != 3 or not plainly_equal(a.shape[0], b.shape[0])
            or not plainly_equal(a.shape[2], b.shape[1])):
        return None
    return (a.shape[0], a.shape[1], b.shape[2]), "contiguous"


def _elementwise(*tensors):
    """Tensors of one dtype and device, each contiguous and of the same sizes as written:
    the output is another such tensor (no broadcasting, no type promotion)."""
    first = tensors[0]
    for t in tensors:
        if not (_same_kind(first, t) and len(t.shape) == len(first.shape) and plainly_contiguous(t)
                and all(map(plainly_equal, t.shape, first.shape))):
            return None
    return first.shape, "contiguous"


def _with_scalar(x, scalar, *rest):
    # a Python number does not change a floating tensor's dtype
    if rest or type(scalar) not in (int, float):
        return None
    return _elementwise(x)


def _softmax_backward(grad, output, dim, input_dtype):
    return _elementwise(grad, output) if input_dtype == grad.dtype else None


def _threshold_backward(grad, x, threshold):
    return _elementwise(grad, x)


_LAYOUTS = {aten.t.default: _t, aten.transpose.int: _transpose, aten.detach.default: _detach,
            aten.mm.default: _mm, aten.bmm.default: _bmm,
            aten.mul.Tensor: _elementwise, aten.add.Tensor: _elementwise, aten.sub.Tensor: _elementwise,
            aten.div.Tensor: _elementwise, aten.neg.default: _elementwise,
            aten.tanh_backward.default: _elementwise, aten.sigmoid_backward.default: _elementwise,
            aten.mul.Scalar: _with_scalar, aten.div.Scalar: _with_scalar, aten.pow.Tensor_Scalar: _with_scalar,
            aten.threshold_backward.default: _threshold_backward,
            aten._softmax_backward_data.default: _softmax_backward}


_tracers: dict = {}  # id(fx tracer) -> its gradfx _Tracer, while it traces


def _replacement(original):
    def proxy_call(proxy_mode, func, pre_dispatch, args, kwargs):
        layout = _LAYOUTS.get(func)
        if layout is not None and not kwargs and not pre_dispatch:
            tracer = _tracers.get(id(proxy_mode.tracer))
            if tracer is not None:
                found = layout(*args)
                if found is not None:
                    return tracer.record_op(func, args, *found)
        return original(proxy_mode, func, pre_dispatch, args, kwargs)
    return proxy_call


_patch = ScopedPatch(proxy_tensor, "proxy_call", _replacement)


@contextlib.contextmanager
def recorded_directly(tracer):
    """While ``tracer`` (a ``_Tracer``) traces, the ops above skip fake dispatch.  torch's
    ``proxy_call`` is replaced while some trace needs it; other tracers go to torch's."""
    _tracers[id(tracer.tracer)] = tracer
    try:
        with _patch.active():
            yield
    finally:
        del _tracers[id(tracer.tracer)]
