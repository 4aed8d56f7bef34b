"""Ops whose output layout the size expressions give, recorded without fake dispatch.

Every op a backward formula calls goes through torch's proxy mode and fake-tensor
kernel: 0.3-1 ms each (3 ms for layer norm's backward, which fakes decompose), most
of it building the output fake's metadata, symbolic or not.  For the ops backward
formulas call most (``t``, ``transpose``, ``detach``, ``mm``, ``bmm``, elementwise
ops on tensors of one contiguous layout: two thirds of T5's; views and copies of
contiguous tensors, sums over dims, layer norm's backward) the output's sizes and
strides are the inputs' rearranged, so the tracer makes a fake of that layout itself
(``_Tracer.new_fake``) and records the fx node.  Anything these cannot decide from
the expressions alone (a storage offset, sizes equal only by value, mixed dtypes,
keyword arguments) goes to torch as before, guards and errors included.
"""

from __future__ import annotations

import contextlib
import math

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


def _static(sizes) -> bool:
    return all(type(n) is int for n in sizes)


def _view(x, size):
    """A contiguous tensor viewed as ``size`` (``view``, ``_unsafe_view``): contiguous.
    Static sizes only; a size list that does not hold the tensor's elements goes to
    torch, which raises its error."""
    if (not _plain_view_source(x) or type(size) not in (list, tuple) or not _static(size)
            or not _static(x.shape) or not plainly_contiguous(x)):
        return None
    numel = math.prod(x.shape)
    size = list(size)
    if size.count(-1) == 1:
        rest = math.prod(n for n in size if n != -1)
        if rest <= 0 or numel % rest:
            return None
        size[size.index(-1)] = numel // rest
    if numel == 0 or any(n < 0 for n in size) or math.prod(size) != numel:
        return None
    return tuple(size), "contiguous"


def _clone(x, memory_format=None):
    """A contiguous copy: of any strided tensor in contiguous format, of a contiguous one
    in the format it keeps."""
    if not (type(x) is FakeTensor and x.layout is torch.strided):
        return None
    if memory_format is torch.contiguous_format or (memory_format in (None, torch.preserve_format)
                                                    and plainly_contiguous(x)):
        return x.shape, "contiguous"
    return None


def _sum_dims(x, dims, keepdim=False):
    """A floating tensor summed over the dims listed (without a dtype): a new contiguous tensor."""
    n = x.dim()
    if (type(x) is not FakeTensor or x.layout is not torch.strided or not x.is_floating_point()
            or type(dims) not in (list, tuple) or not dims or not all(type(d) is int for d in dims)
            or type(keepdim) is not bool or n == 0):
        return None
    dims = {d % n for d in dims}
    shape = [1 if d in dims else size for d, size in enumerate(x.shape) if keepdim or d not in dims]
    return shape, "contiguous"


def _select_backward(grad, input_sizes, dim, index):
    """Zeros of the input's sizes with the gradient copied into one slice: contiguous."""
    if type(grad) is not FakeTensor or grad.layout is not torch.strided or type(input_sizes) not in (list, tuple):
        return None
    return tuple(input_sizes), "contiguous"


def _gelu_backward(grad, x, approximate="none"):
    return _elementwise(grad, x) if type(approximate) is str else None


class Several(tuple):
    """A layout function's answer for an op with several outputs: per output
    ``(shape, strides, like)`` (a fake of ``like``'s dtype and device), or None where
    the op returns an undefined tensor."""


def _layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
    """The input's, weight's and bias's gradients, each a new contiguous tensor (as the
    CPU kernel allocates them), None where ``output_mask`` says or the parameter is None."""
    params = [t for t in (weight, bias) if t is not None]
    if (not _elementwise(grad, x) or not all(_same_kind(x, t) and plainly_contiguous(t) for t in params)
            or type(output_mask) not in (list, tuple) or len(output_mask) != 3):
        return None
    wanted = [(x, output_mask[0]), (weight, output_mask[1]), (bias, output_mask[2])]
    return Several(None if t is None or not want else (t.shape, "contiguous", t) for t, want in wanted)


# Ops whose keyword arguments the layout functions take (others go to torch with any).
_KEYWORDS = {aten.clone.default: {"memory_format"}, aten.sum.dim_IntList: {"keepdim"},
             aten.gelu_backward.default: {"approximate"}}


_LAYOUTS = {aten.t.default: _t, aten.transpose.int: _transpose, aten.detach.default: _detach,
            aten.mm.default: _mm, aten.bmm.default: _bmm,
            aten.mul.Tensor: _elementwise, aten.add.Tensor: _elementwise, aten.sub.Tensor: _elementwise,
            aten.div.Tensor: _elementwise, aten.neg.default: _elementwise,
            aten.tanh_backward.default: _elementwise, aten.sigmoid_backward.default: _elementwise,
            aten.mul.Scalar: _with_scalar, aten.div.Scalar: _with_scalar, aten.pow.Tensor_Scalar: _with_scalar,
            aten.threshold_backward.default: _threshold_backward,
            aten._softmax_backward_data.default: _softmax_backward,
            aten.view.default: _view, aten._unsafe_view.default: _view, aten.clone.default: _clone,
            aten.sum.dim_IntList: _sum_dims, aten.select_backward.default: _select_backward,
            aten.gelu_backward.default: _gelu_backward, aten.silu_backward.default: _elementwise,
            aten.native_layer_norm_backward.default: _layer_norm_backward}


_tracers: dict = {}  # id(fx tracer) -> its gradfx _Tracer, while it traces


def _replacement(original):
    def proxy_call(proxy_mode, func, pre_dispatch, args, kwargs):
        layout = _LAYOUTS.get(func)
        if layout is not None and not pre_dispatch and (not kwargs or kwargs.keys() <= _KEYWORDS.get(func, ())):
            tracer = _tracers.get(id(proxy_mode.tracer))
            if tracer is not None:
                found = layout(*args, **kwargs)
                if type(found) is Several:
                    return tracer.record_several(func, args, found, kwargs)
                if found is not None:
                    return tracer.record_op(func, args, *found, kwargs)
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
