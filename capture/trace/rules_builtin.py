"""Backward rules for builtin autograd nodes (see gradfx.capture.rules).

Formulas are from tools/autograd/derivatives.yaml and
torch/csrc/autograd/FunctionsManual.cpp.  Branches on sizes/strides are marked
``# size branch``: they mirror a branch of the C++ formula (a guard when sizes
are symbolic).
"""

from __future__ import annotations

import contextlib

import torch

from .rules import hidden_rule, reshape_groups, rule

aten = torch.ops.aten
INT64_MAX = 2**63 - 1


def _i64(v):
    """A saved int64 as a signed int: node getters return negative ints as uint64 (-1 -> 2**64 - 1)."""
    return v - 2**64 if isinstance(v, int) and v >= 2**63 else v


def _dims(dims):
    return None if dims is None else [_i64(d) for d in dims]


def _wrap(dim, ndim):
    """at::maybe_wrap_dim."""
    return dim + ndim if dim < 0 else dim


def _maybe_multiply(t, s):
    """maybe_multiply: multiplies only when the scalar is not 1."""
    if not isinstance(s, complex) and s == 1:
        return t
    return aten.mul.Scalar(t, s)  # as the C++ formula: MulBackward1 under create_graph


def _unsqueeze_multiple(t, dims, ndim):
    """unsqueeze_multiple."""
    if len(dims) == 1:
        return t.unsqueeze(dims[0])
    wrapped = {_wrap(d, ndim) for d in dims}
    for i in range(ndim):
        if i in wrapped:
            t = t.unsqueeze(i)
    return t


def _sum_backward(grad, sizes, dims, keepdim):
    """sum_backward (OptionalIntArrayRef overload)."""
    if not keepdim and len(sizes) > 0 and dims:
        return _unsqueeze_multiple(grad, dims, len(sizes)).expand(sizes)
    return grad.expand(sizes)


def _sum_to(t, shape):
    """at::sum_to (ExpandUtils.h _sum_to, always_return_non_view=false)."""
    if len(shape) == 0:
        return t.sum()
    sizes = t.shape
    lead = len(sizes) - len(shape)
    reduce = list(range(lead))
    for i in range(lead, len(sizes)):
        if shape[i - lead] == 1 and sizes[i] != 1:  # size branch
            reduce.append(i)
    if reduce:
        t = t.sum(reduce, keepdim=True)
    return t.view(shape) if lead > 0 else t


def _unsqueeze_to(grad, dims, sizes):
    """unsqueeze_to: unsqueeze dims (all if None) whose saved size is 1."""
    ndim = len(sizes)
    mask = range(ndim) if dims is None else {_wrap(d, ndim) for d in dims}
    for d in range(ndim):
        if d in mask and sizes[d] == 1:  # size branch
            grad = grad.unsqueeze(d)
    return grad


def _mm_mat1_backward(grad, mat2, sizes, strides, alpha):
    """mm_mat1_backward (strided layouts)."""
    if strides[0] == 1 and strides[1] == sizes[0]:  # size/stride branch: column-major mat1
        return _maybe_multiply(mat2.conj().mm(grad.t()).t(), alpha)
    return _maybe_multiply(grad.mm(mat2.t().conj()), alpha)


def _mm_mat2_backward(grad, mat1, sizes, strides, alpha):
    """mm_mat2_backward (strided layouts)."""
    if strides[0] == 1 and strides[1] == sizes[0]:  # size/stride branch: column-major mat2
        return _maybe_multiply(grad.t().mm(mat1.conj()).t(), alpha)
    return _maybe_multiply(mat1.t().conj().mm(grad), alpha)


def _split_with_sizes_backward(grads, split_sizes, dim, sizes):
    """split_with_sizes_backward: cat of grads, zeros for undefined ones."""
    dim = _wrap(dim, len(sizes))
    like = next(g for g in grads if g is not None)
    full = []
    for g, length in zip(grads, split_sizes):
        if g is None:
            shape = list(sizes)
            shape[dim] = length
            g = torch.zeros(shape, dtype=like.dtype, device=like.device)
        full.append(g)
    return torch.cat(full, dim)


@rule("SumBackward0")
def sum_backward0(saved, grad):
    """grad.expand_symint(self.sym_sizes())"""
    return (grad.expand(saved.self_sym_sizes),)


@rule("SumBackward1")
def sum_backward1(saved, grad):
    """sum_backward(grad, self.sym_sizes(), dim, keepdim)"""
    return (_sum_backward(grad, saved.self_sym_sizes, _dims(saved.dim), saved.keepdim),)


@rule("MeanBackward0")
def mean_backward0(saved, grad):
    """grad.expand_symint(self.sym_sizes()) / self.sym_numel()"""
    return (aten.div.Scalar(grad.expand(saved.self_sym_sizes), saved.self_sym_numel),)


@rule("MeanBackward1")
def mean_backward1(saved, grad):
    """mean_backward(grad, self.sym_sizes(), dim, self.sym_numel(), keepdim)"""
    sizes, dims = saved.self_sym_sizes, _dims(saved.dim)
    if not dims:
        n = saved.self_sym_numel
    else:  # _safe_size
        n = 1
        for d in dims if len(sizes) > 0 else ():
            n = n * sizes[_wrap(d, len(sizes))]
    return (aten.div.Scalar(_sum_backward(grad, sizes, dims, saved.keepdim), n),)


@rule("ViewBackward0")
@rule("UnsafeViewBackward0")
@rule("ReshapeAliasBackward0")
def view_backward0(saved, grad):
    """grad.reshape_symint(self.sym_sizes())"""
    target = saved.self_sym_sizes
    _tie_matching_dims(grad.shape, target)
    out = saved.reshape(grad, target)
    return (grad.reshape(target) if out is None else out,)


def _atoms(dims, shape_env):
    """Each dim as (sympy expression, size); a product of factors of distinct sizes as its
    factors (s3*s4 -> (s3, 4), (s4, 2)).  sympy orders factors by name, not as the
    memory lays them out: factors of equal sizes could be told apart only by luck, so
    such a product stays one dim."""
    import sympy  # here: this module loads at import, sympy with the first trace
    out = []
    for d in dims:
        expr = d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d)
        expr = shape_env.replace(expr)
        atoms = [(expr, int(expr.xreplace(shape_env.backed_var_to_val)))]
        if isinstance(expr, sympy.Mul):
            factors = [(f, int(f.xreplace(shape_env.backed_var_to_val))) for f in expr.args]
            if len({h for _, h in factors}) == len(factors):
                atoms = factors
        out += atoms
    return out


def _tie_matching_dims(source, target) -> None:
    """Before a symbolic reshape, equate the dims that correspond.

    Walked as reshape groups dims (consecutive runs with equal products), a source
    factor and a target factor alone in their group are the same dim, and a lone
    target symbol whose group holds several source factors is their product:
    guarding these (true for these sizes) lets the ShapeEnv replace symbols, so the
    reshape decides its groups at once instead of reasoning about products of
    unrelated symbols (the larger part of a first symbolic capture of a transformer).
    """
    import sympy
    syms = [d for d in (*source, *target) if isinstance(d, torch.SymInt)]
    if not syms:
        return
    env = syms[0].node.shape_env
    try:
        src, dst = _atoms(source, env), _atoms(target, env)
    except TypeError:  # a size without a value (data-dependent): reshape decides alone
        return
    for ga, gb in reshape_groups([h for _, h in src], [h for _, h in dst]):
        a, b = src[ga[0]][0], dst[gb[0]][0]
        if len(ga) == 1 and len(gb) == 1:
            if a != b:
                env.evaluate_expr(sympy.Eq(a, b))  # size branch: guards the equality (true here)
        elif len(gb) == 1 and isinstance(b, sympy.Symbol):
            env.evaluate_expr(sympy.Eq(b, sympy.Mul(*(src[k][0] for k in ga))))  # size branch: as above


@rule("ExpandBackward0")
def expand_backward0(saved, grad):
    """at::sum_to(grad, self.sym_sizes())"""
    return (_sum_to(grad, saved.self_sym_sizes),)


@rule("MmBackward0")
def mm_backward0(saved, grad):
    """mm_mat1_backward / mm_mat2_backward with alpha 1 (an input's grad is None when it was not saved for)."""
    g_self = g_mat2 = None
    if saved.mat2 is not None:  # saved only if self needs grad
        g_self = _mm_mat1_backward(grad, saved.mat2, saved.self_sym_sizes, saved.self_sym_strides, 1)
    if saved.self is not None:  # saved only if mat2 needs grad
        g_mat2 = _mm_mat2_backward(grad, saved.self, saved.mat2_sym_sizes, saved.mat2_sym_strides, 1)
    return (g_self, g_mat2)


@rule("AddmmBackward0")
def addmm_backward0(saved, grad):
    """maybe_multiply(grad, beta) / mm_mat1_backward / mm_mat2_backward with alpha (self's grad always computed)."""
    alpha = saved.alpha
    alpha = alpha.conjugate() if isinstance(alpha, complex) else alpha
    beta = saved.beta
    beta = beta.conjugate() if isinstance(beta, complex) else beta
    g_mat1 = g_mat2 = None
    if saved.mat2 is not None:
        g_mat1 = _mm_mat1_backward(grad, saved.mat2, saved.mat1_sym_sizes, saved.mat1_sym_strides, alpha)
    if saved.mat1 is not None:
        g_mat2 = _mm_mat2_backward(grad, saved.mat1, saved.mat2_sym_sizes, saved.mat2_sym_strides, alpha)
    return (_maybe_multiply(grad, beta), g_mat1, g_mat2)


@rule("SelectBackward0")
def select_backward0(saved, grad):
    """select_backward_symint(grad, self.sym_sizes(), dim, index)"""
    return (aten.select_backward.default(grad, saved.self_sym_sizes, _i64(saved.dim), _i64(saved.index)),)


@rule("SliceBackward0")
def slice_backward0(saved, grad):
    """slice_backward_wrapper: slice_backward with start None -> 0, end None -> INT64_MAX."""
    start = 0 if saved.start is None else _i64(saved.start)
    end = INT64_MAX if saved.end is None else _i64(saved.end)
    return (aten.slice_backward.default(grad, saved.self_sym_sizes, _i64(saved.dim), start, end, saved.step),)


@rule("SqueezeBackward0")
@rule("SqueezeBackward3")  # squeeze_
def squeeze_backward0(saved, grad):
    """unsqueeze_to(grad, self.sym_sizes())"""
    return (_unsqueeze_to(grad, None, saved.self_sym_sizes),)


@rule("SqueezeBackward1")
@rule("SqueezeBackward4")  # squeeze_.dim
def squeeze_backward1(saved, grad):
    """unsqueeze_to(grad, dim, self.sym_sizes())"""
    return (_unsqueeze_to(grad, [_i64(saved.dim)], saved.self_sym_sizes),)


@rule("SqueezeBackward2")
@rule("SqueezeBackward5")  # squeeze_.dims
def squeeze_backward2(saved, grad):
    """unsqueeze_to(grad, dim, self.sym_sizes()) with a dim list"""
    return (_unsqueeze_to(grad, _dims(saved.dim), saved.self_sym_sizes),)


@rule("UnsqueezeBackward0")
@rule("UnsqueezeBackward1")  # unsqueeze_
def unsqueeze_backward0(saved, grad):
    """grad.squeeze(dim)"""
    return (grad.squeeze(_i64(saved.dim)),)


@rule("SplitBackward0")
@rule("UnsafeSplitBackward0")
def split_backward0(saved, *grads):
    """split_backward: split_with_sizes_backward with the last chunk's size computed from the dim size."""
    sizes, split_size, n = saved.self_sym_sizes, saved.split_size, len(grads)
    dim = _wrap(_i64(saved.dim), len(sizes))
    split_sizes = [split_size] * n
    split_sizes[-1] = split_size - (split_size * n - sizes[dim])
    return (_split_with_sizes_backward(grads, split_sizes, dim, sizes),)


@rule("SplitWithSizesBackward0")
@rule("UnsafeSplitWithSizesBackward0")
def split_with_sizes_backward0(saved, *grads):
    """split_with_sizes_backward(grads, split_sizes, dim, self.sym_sizes(), self.options())"""
    return (_split_with_sizes_backward(grads, saved.split_sizes, _i64(saved.dim), saved.self_sym_sizes),)


@rule("StackBackward0")
def stack_backward0(saved, grad):
    """stack_tensors_backward: grad.select(dim, i) per input (count = grad.size(dim), a list length)."""
    assert not grad.is_complex()
    dim = _i64(saved.dim)
    return tuple(grad.select(dim, i) for i in range(grad.shape[dim]))


@rule("UnbindBackward0")
def unbind_backward0(saved, *grads):
    """unbind_backward: stack of grads, zeros({}).expand(sizes) for undefined ones."""
    like = next(g for g in grads if g is not None)
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    full = [zero.expand(like.shape) if g is None else g for g in grads]
    return (torch.stack(full, _i64(saved.dim)),)


@rule("IndexBackward0")
def index_backward0(saved, grad):
    """index_backward(grad.new_zeros_symint(self.sym_sizes()), indices, grad): _index_put_impl_(accumulate, unsafe)."""
    zeros = grad.new_zeros(saved.self_sym_sizes)
    return (aten._index_put_impl_.default(zeros, list(saved.indices), grad, True, True),)


@rule("EmbeddingBackward0")
def embedding_backward0(saved, grad):
    """embedding_backward_symint(grad, indices, weight.sym_size(0), padding_idx, scale_grad_by_freq, sparse)"""
    return (aten.embedding_backward.default(
        grad, saved.indices, saved.weight_sym_argsize_0, _i64(saved.padding_idx),
        saved.scale_grad_by_freq, saved.sparse),)


def _legacy_empty(shape) -> bool:
    """A 1-D tensor of no elements: cat skips it (a legacy rule) whatever the dim."""
    return len(shape) == 1 and shape[0] == 0


def _cat_inputs(node, out, inputs, observed):
    """What cat_tensors_backward reads of each input, from metadata: (dim, per input its
    size along dim (None: a legacy empty tensor) and dtype (None: its gradient goes
    unseen)), or None where the metadata leaves that open.

    An input that needs no grad has no next node to describe it: alone, it holds what
    the others leave of the output's size.  The sizes must add up to the output's: a
    tensor whose shape changed after its node recorded it (``.data``) would not.
    """
    (out_shape, out_dtype), ndim = out, len(out[0])
    dim = _wrap(_i64(node._saved_dim), ndim)
    if not 0 <= dim < ndim:  # a cat of legacy empty tensors alone keeps any dim
        return None
    pieces, known, unknown = [], 0, []
    for k, meta in enumerate(inputs):
        if meta is None:
            unknown.append(k)
            pieces.append(None)
            continue
        shape, dtype = meta
        if _legacy_empty(shape):
            pieces.append((None, dtype))
        elif len(shape) != ndim:
            return None
        else:
            pieces.append((shape[dim], dtype))
            known = known + shape[dim]
    rest = out_shape[dim] - known
    if not unknown:
        return (dim, pieces) if rest == 0 else None  # size branch
    if len(unknown) > 1 or rest < 0:  # size branch
        return None
    # A post-hook sees its gradient too: open where it may be a legacy empty tensor's, or
    # where the gradient is complex (its own dtype picks real or complex).
    if observed and (rest == 0 or out_dtype.is_complex):  # size branch
        return None
    pieces[unknown[0]] = (rest, out_dtype if observed else None)
    return dim, pieces


@hidden_rule("CatBackward0", _cat_inputs)
def cat_backward0(recovered, grad):
    """cat_tensors_backward: each input's part of grad along dim (of its real part for a
    real input of a complex cat); a legacy empty input gets zeros((0,)) and no part."""
    dim, pieces = recovered
    if grad is None:
        return (None,) * len(pieces)
    real = torch.real(grad) if grad.is_complex() else None
    out, offset = [], 0
    for size, dtype in pieces:
        if dtype is None:  # an input without a next node whose gradient nobody sees
            out.append(None)
            offset = offset + size
            continue
        source = real if real is not None and not dtype.is_complex else grad
        if size is None:
            out.append(torch.zeros((0,), dtype=source.dtype, device=source.device))
            continue
        out.append(source.narrow(dim, offset, size))
        offset = offset + size
    return tuple(out)


def copy_slices(geometry, fn, node, grad):
    """CopySlices (an in-place op on a view of ``base``): the gradient laid out as the base,
    the wrapped node's formula ``fn`` run on a contiguous copy of the view's part, its first
    gradient written back into that part.  ``geometry``: graph.hidden.copy_slices_geometry
    (symbolic where sizes are).  An output whose edge has no next node is None, as in eager."""
    n = len(node.next_functions)
    if grad is None:
        return (None,) * n
    base_sizes, base_strides, base_offset, view_sizes, view_strides, view_offset = geometry
    result = grad.new_empty_strided(base_sizes, base_strides)
    result.copy_(grad)
    grad_slice = result.as_strided(view_sizes, view_strides, view_offset - base_offset)
    res = fn(grad_slice.clone(memory_format=torch.contiguous_format))
    res = res if type(res) is tuple else (res,)
    out = [None] * n
    for k, (g, (next_node, _)) in enumerate(zip(res, node.next_functions)):
        if g is None or next_node is None:
            continue
        if k == 0:
            grad_slice.copy_(g)
            out[0] = result
        else:
            out[k] = g
    return tuple(out)


def _suggest_memory_format(t):
    """Tensor.suggest_memory_format (channels-last strides for 4-D / 5-D tensors)."""
    from torch._prims_common import suggest_memory_format  # lazily: a private module
    return suggest_memory_format(t)


@rule("NativeGroupNormBackward0")
def native_group_norm_backward0(saved, grad, grad_mean=None, grad_rstd=None):
    """native_group_norm_backward_symint on grad and input made contiguous in the input's
    suggested memory format, with the saved N, C, HxW (sizes: symbolic when traced).
    The formula takes a differentiable path under grad mode (create_graph: the node runs
    as itself, rules.RUN_REAL_WITH_HISTORY) and where mean or rstd have gradients: the
    rule raises there, and the node runs as itself, never with baked sizes."""
    if grad_mean is not None or grad_rstd is not None:
        raise NotImplementedError("group_norm's double-differentiable backward is not mirrored")
    if grad is None:
        return (None, None, None)
    x = saved.input
    fmt = _suggest_memory_format(x)
    # The formula's mask comes from the next edges, which a rule does not see: every output
    # is computed (each independently of the others) and one without an edge is dropped.
    # Without a weight, neither weight's nor bias's is (eager fails on a bias alone).
    weight = saved.weight
    return aten.native_group_norm_backward.default(
        grad.contiguous(memory_format=fmt), x.contiguous(memory_format=fmt), saved.result1, saved.result2,
        weight, saved.N, saved.C, saved.HxW, saved.group, [True, weight is not None, weight is not None])


@rule("IndexSelectBackward0")
def index_select_backward0(saved, grad):
    """index_select_backward_symint: zeros of self's sizes, index_add of grad along dim."""
    zeros = grad.new_zeros(saved.self_sym_sizes)
    return (zeros.index_add_(_i64(saved.dim), saved.index, grad),)


def _value_selecting_backward(grad, dim, indices, sizes, keepdim):
    """value_selecting_reduction_backward_symint: grad scattered at the indices into zeros of self's sizes."""
    out = grad.new_zeros(sizes)
    if not keepdim and len(sizes) > 0:  # size branch (a rank, fixed by the key)
        grad, indices = grad.unsqueeze(dim), indices.unsqueeze(dim)
    return out.scatter_(dim, indices, grad)


@rule("MaxBackward0")
@rule("MinBackward0")
@rule("KthvalueBackward0")
@rule("ModeBackward0")
@rule("MedianBackward1")
@rule("NanmedianBackward1")
def value_selecting_dim_backward(saved, grad):
    """value_selecting_reduction_backward_symint(grad, dim, indices, self.sym_sizes(), keepdim)"""
    return (_value_selecting_backward(grad, _i64(saved.dim), saved.indices, saved.self_sym_sizes, saved.keepdim),)


@rule("TopkBackward0")
@rule("SortBackward0")
@rule("SortBackward1")
def value_selecting_keepdim_backward(saved, grad):
    """value_selecting_reduction_backward_symint(grad, dim, indices, self.sym_sizes(), true)"""
    return (_value_selecting_backward(grad, _i64(saved.dim), saved.indices, saved.self_sym_sizes, True),)


@rule("RepeatBackward0")
def repeat_backward0(saved, grad):
    """repeat_backward: zeros where a repeat is 0; else sum out the leading new dims, then
    one reshape that splits each repeated dim into (repeat, size) and one sum over the repeats."""
    repeats, sizes = saved.repeats, saved.self_sym_sizes
    if 0 in repeats:
        return (grad.new_zeros(sizes),)
    lead = grad.dim() - len(sizes)
    for _ in range(lead):
        grad = grad.sum(0, False)
    shape, dims = [], []
    for d, size in enumerate(sizes):
        r = repeats[d + lead]
        if r != 1:
            shape.append(r)
            dims.append(len(shape) - 1)
        shape.append(size)
    if dims:  # all repeats 1: an empty dim list would sum everything
        grad = grad.reshape(shape).sum(dims)
    return (grad,)


# node name -> (its backward op, whether it takes align_corners, its scale attributes)
_UPSAMPLE = {
    "UpsampleNearest1DBackward0": (aten.upsample_nearest1d_backward.default, False, ("scales",)),
    "UpsampleNearestExact1DBackward0": (aten._upsample_nearest_exact1d_backward.default, False, ("scales",)),
    "UpsampleNearest2DBackward0": (aten.upsample_nearest2d_backward.default, False, ("scales_h", "scales_w")),
    "UpsampleNearestExact2DBackward0": (aten._upsample_nearest_exact2d_backward.default, False,
                                        ("scales_h", "scales_w")),
    "UpsampleNearest3DBackward0": (aten.upsample_nearest3d_backward.default, False,
                                   ("scales_d", "scales_h", "scales_w")),
    "UpsampleNearestExact3DBackward0": (aten._upsample_nearest_exact3d_backward.default, False,
                                        ("scales_d", "scales_h", "scales_w")),
    "UpsampleLinear1DBackward0": (aten.upsample_linear1d_backward.default, True, ("scales",)),
    "UpsampleBilinear2DBackward0": (aten.upsample_bilinear2d_backward.default, True, ("scales_h", "scales_w")),
    "UpsampleBicubic2DBackward0": (aten.upsample_bicubic2d_backward.default, True, ("scales_h", "scales_w")),
    "UpsampleTrilinear3DBackward0": (aten.upsample_trilinear3d_backward.default, True,
                                     ("scales_d", "scales_h", "scales_w")),
    "UpsampleBilinear2DAaBackward0": (aten._upsample_bilinear2d_aa_backward.default, True, ("scales_h", "scales_w")),
    "UpsampleBicubic2DAaBackward0": (aten._upsample_bicubic2d_aa_backward.default, True, ("scales_h", "scales_w")),
}


def _upsample_rule(name):
    op, align, scales = _UPSAMPLE[name]

    @rule(name)
    def upsample_backward(saved, grad):
        """upsample_*_backward_symint(grad, output_size, self.sym_sizes(), [align_corners,] scales...).
        The linear, bilinear, bicubic (also antialiased) and trilinear ops have only a C++ meta
        function, which takes no symbolic sizes: it raises on them, and the node runs as itself."""
        args = (saved.align_corners,) if align else ()
        return (op(grad, list(saved.output_size), saved.self_sym_sizes, *args,
                   *(getattr(saved, s) for s in scales)),)
    return upsample_backward


for _name in _UPSAMPLE:
    _upsample_rule(_name)


@rule("UnfoldBackward0")
def unfold_backward0(saved, grad):
    """unfold_backward_symint(grad, self.sym_sizes(), dimension, size, step)"""
    return (aten.unfold_backward.default(grad, saved.self_sym_sizes, _i64(saved.dimension), saved.size, saved.step),)


# -- formulas whose ops keep symbolic sizes only under torch's Python dispatcher ------

def _fake_kernels(t):
    """Context for a rule's aten calls: while tracing (``t`` a fake tensor), torch's Python
    dispatcher.  Without it the fake kernels of constant_pad_nd, im2col and the FFTs run
    their C++ meta functions, which read plain sizes: the fake tensor falls back to running
    the op on the sizes' hints and specializes every size it touches.  With it they run
    their Python meta functions (symbolic).  The graph records the op itself either way
    (each rule calls the op the C++ formula calls), and on real tensors nothing changes."""
    from torch._subclasses.fake_tensor import is_fake
    if not is_fake(t):
        return contextlib.nullcontext()
    from torch._dispatch.python import enable_python_dispatcher
    return enable_python_dispatcher()


@rule("ConstantPadNdBackward0")
def constant_pad_nd_backward0(saved, grad):
    """constant_pad_nd_backward: constant_pad_nd_symint(grad, the pads negated, 0)"""
    with _fake_kernels(grad):
        return (aten.constant_pad_nd.default(grad, [-p for p in _dims(saved.pad)]),)


@rule("Im2ColBackward0")
def im2col_backward0(saved, grad):
    """col2im_symint(grad, {self.sym_size(-2), self.sym_size(-1)}, kernel_size, dilation, padding, stride)"""
    with _fake_kernels(grad):
        return (aten.col2im.default(grad, [saved.self_sym_argsize_minus_2, saved.self_sym_argsize_minus_1],
                                    list(saved.kernel_size), list(saved.dilation), list(saved.padding),
                                    list(saved.stride)),)


@rule("Col2ImBackward0")
def col2im_backward0(saved, grad):
    """im2col(grad, kernel_size, dilation, padding, stride)"""
    with _fake_kernels(grad):
        return (aten.im2col.default(grad, list(saved.kernel_size), list(saved.dilation), list(saved.padding),
                                    list(saved.stride)),)


@rule("FftR2CBackward0")
def fft_r2c_backward0(saved, grad):
    """fft_r2c_backward(grad, dim, normalization, onesided, self.sym_size(dim.back())): one-sided,
    the gradient copied into zeros of the full last dim; then the inverse c2c transform's real part."""
    dims = _dims(saved.dim)
    with _fake_kernels(grad):
        if saved.onesided:
            last = _wrap(dims[-1], grad.dim())
            shape = list(grad.shape)
            half, shape[last] = shape[last], saved.self.shape[last]
            full = grad.new_zeros(shape)
            full.narrow(last, 0, half).copy_(grad)
            grad = full
        return (torch.real(aten._fft_c2c.default(grad, dims, saved.normalization, False)),)


@rule("FftC2RBackward0")
def fft_c2r_backward0(saved, grad):
    """fft_c2r_backward: the one-sided r2c transform of grad, its entries that stand for a
    mirrored pair too (1 .. grad's last size - its own) doubled in place."""
    dims = _dims(saved.dim)
    with _fake_kernels(grad):
        g = aten._fft_r2c.default(grad, dims, saved.normalization, True)
        last = _wrap(dims[-1], grad.dim())
        double = grad.shape[last] - g.shape[last]
        if double > 0:  # size branch
            aten.mul_.Scalar(g.narrow(last, 1, double), 2)
    return (g,)


@rule("FftC2CBackward0")
def fft_c2c_backward0(saved, grad):
    """_fft_c2c_symint(grad, dim, normalization, !forward)"""
    with _fake_kernels(grad):
        return (aten._fft_c2c.default(grad, _dims(saved.dim), saved.normalization, not saved.forward),)


# -- formulas that read saved sizes -----------------------------------------------------

@rule("DiagonalBackward0")
def diagonal_backward0(saved, grad):
    """diagonal_backward_symint(grad, self.sym_sizes(), offset, dim1, dim2)"""
    with _fake_kernels(grad):
        return (aten.diagonal_backward.default(grad, saved.self_sym_sizes, _i64(saved.offset), _i64(saved.dim1),
                                               _i64(saved.dim2)),)


@rule("TraceBackward0")
def trace_backward0(saved, grad):
    """trace_backward_symint(grad, self.sym_sizes()) (a composite: zeros, arange, index_fill, view)"""
    return (aten.trace_backward.default(grad, saved.self_sym_sizes),)


@rule("MaskedScatterBackward0")
def masked_scatter_backward0(saved, grad):
    """self: grad.masked_fill(mask, 0); source: masked_scatter_backward_symint(grad, mask, source.sym_sizes())"""
    mask = saved.mask
    return (grad.masked_fill(mask, 0), aten.masked_scatter_backward.default(grad, mask, saved.source_sym_sizes))


def _infer_size(a, b):
    """at::infer_size: the broadcast of two shapes (right-aligned, a 1 gives way)."""
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + list(a), [1] * (n - len(b)) + list(b)
    return [y if x == 1 else x for x, y in zip(a, b)]  # size branch


@rule("MaskedSelectBackward0")
def masked_select_backward0(saved, grad):
    """masked_select_backward: zeros like self expanded to the broadcast of self and mask,
    grad scattered into them where the mask holds (the broadcast is summed out after)."""
    x, mask = saved.self, saved.mask
    zeros = torch.zeros_like(x.expand(_infer_size(x.shape, mask.shape)), memory_format=torch.preserve_format)
    return (zeros.masked_scatter_(mask, grad),)


# -- formulas that read a hidden input's sizes (``src_info``): the sizes are grad's part ----
# The C++ formulas make their zeros from sizes the node keeps hidden from Python (the
# source's TypeAndSize), which a symbolic trace would bake in without a guard.  Those
# sizes are the sizes of the part of grad the source was scattered into (or, for put,
# of the saved source): the rules read them there.  The zeros' dtype is grad's: the
# scatter copies them into grad's dtype either way.

def _zeros_of(like, grad):
    return torch.zeros(like.shape, dtype=grad.dtype, device=grad.device)


@rule("SelectScatterBackward0")
def select_scatter_backward0(saved, grad):
    """self: select_scatter(grad, zeros_like(src), dim, index); src: grad.select(dim, index)"""
    dim, index = _i64(saved.dim), _i64(saved.index)
    part = grad.select(dim, index)
    return (aten.select_scatter.default(grad, _zeros_of(part, grad), dim, index), part)


@rule("SliceScatterBackward0")
def slice_scatter_backward0(saved, grad):
    """self: slice_scatter(grad, zeros_like(src), dim, start, end, step); src: grad.slice(dim, start, end, step)"""
    start = None if saved.start is None else _i64(saved.start)
    end = None if saved.end is None else _i64(saved.end)
    dim, step = _i64(saved.dim), saved.step
    part = aten.slice.Tensor(grad, dim, start, end, step)
    return (aten.slice_scatter.default(grad, _zeros_of(part, grad), dim, start, end, step), part)


@rule("DiagonalScatterBackward0")
def diagonal_scatter_backward0(saved, grad):
    """self: diagonal_scatter(grad, zeros_like(src), offset, dim1, dim2); src: grad.diagonal(offset, dim1, dim2)"""
    offset, dim1, dim2 = _i64(saved.offset), _i64(saved.dim1), _i64(saved.dim2)
    part = grad.diagonal(offset, dim1, dim2)
    return (aten.diagonal_scatter.default(grad, _zeros_of(part, grad), offset, dim1, dim2), part)


@rule("PutBackward0")
def put_backward0(saved, grad):
    """self: grad (accumulate) or grad.put(index, zeros_like(source), false); source:
    grad.take(index).reshape_as(source).  put reads its source flattened: without a saved
    source, zeros of the index's shape (as many elements) put the same."""
    index, source = saved.index, saved.source
    self_grad = grad
    if not saved.accumulate:
        self_grad = aten.put.default(grad, index, _zeros_of(source if source is not None else index, grad), False)
    source_grad = None if source is None else aten.take.default(grad, index).reshape_as(source)
    return (self_grad, source_grad)


def _fractional_max_pool_rule(name, op):
    @rule(name)
    def fractional_max_pool_backward(saved, grad):
        """fractional_max_pool{2,3}d_backward(grad, self, kernel_size, output_size, result1).  The
        op's fake kernel is its C++ meta function, which reads plain sizes: traced with symbolic
        sizes it would specialize every one, so the rule raises there and the node runs as
        itself (its neighbours keep their symbols)."""
        x = saved.self
        if any(isinstance(d, torch.SymInt) for t in (grad, x) for d in t.shape):
            raise NotImplementedError(f"{op} has no symbolic meta function")
        return (op(grad, x, list(saved.kernel_size), list(saved.output_size), saved.result1),)
    return fractional_max_pool_backward


_fractional_max_pool_rule("FractionalMaxPool2DBackward0", aten.fractional_max_pool2d_backward.default)
_fractional_max_pool_rule("FractionalMaxPool3DBackward0", aten.fractional_max_pool3d_backward.default)
