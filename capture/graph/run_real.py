"""The builtin nodes the tracer runs as themselves (the real node, called from the graph)
rather than tracing their formula, and why.  The walk reads this too: such a node is
keyed by its type alone (and a CopySlices wrapping one stays opaque).
"""

from __future__ import annotations

# Node types whose C++ formula computes differently while being traced, so the
# graph calls the real node instead (bitwise eager by construction).  Their
# formulas branch on ``isTensorSubclassLike``, which is true whenever a dispatch
# mode is active (always, while tracing), and take a composite path there that
# rounds differently from eager's; eager's path also branches on the data
# (whether an input holds zeros), which no traced graph can replay.
RUN_REAL: dict[str, str] = {
    # Formulas that read saved state Python cannot see: a traced graph would bake it
    # in while the cache key, built from what Python sees, stayed the same.
    "CopySlices": "reads the base and view geometry and a wrapped node, hidden in C++",
    "AsStridedBackward0": "reads the input's geometry (its storage offset), hidden in C++",
    "AsStridedBackward0_copy": "as AsStridedBackward0 (as_strided_copy)",
    "AsStridedBackward1": "as AsStridedBackward0 (as_strided_)",
    "BlockDiagBackward0": "reads the sizes of every input, hidden in C++",
    "NativeDropoutBackward0": "reads the train flag (the scale), hidden in C++",
    "ToDenseBackward0": "reads masked_grad, hidden in C++",
    "PackPaddedSequenceBackward0": "reads the batch sizes' data (a saved tensor): fakes hold none",
    "CppFunction": "every node without Python bindings (foreach ops, C++ custom Functions): one type, "
                   "no saved values to key",
    # The cached graph would fix the size of the values a boolean mask selects (data).
    "IndexPutBackward0": "the values' size follows the data of a boolean index",
    "IndexPutImplBackward0": "the values' size follows the data of a boolean index",
    "UnsafeIndexPutBackward0": "the values' size follows the data of a boolean index",
    "MaskedFillBackward1": "masked_fill_backward: masked_select(mask).sum() in eager, where(mask).sum() traced",
    "ProdBackward0": "prod_backward: branches on zeros in the input; result / input in eager",
    "ProdBackward1": "prod_backward (dim): branches on zeros in the input; result / input in eager",
    "CumprodBackward0": "cumprod_backward: branches on zeros in the input",
    # evenly_distribute_backward: masked_fill on a zero tensor in eager (CPU), mask * grad
    # traced; the two part where the incoming gradient is inf or nan.
    "MaxBackward1": "evenly_distribute_backward: masked_fill in eager, mask * grad traced",
    "MinBackward1": "evenly_distribute_backward: masked_fill in eager, mask * grad traced",
    "MedianBackward0": "evenly_distribute_backward: masked_fill in eager, mask * grad traced",
    "NanmedianBackward0": "evenly_distribute_backward: masked_fill in eager, mask * grad traced",
}


# Under create_graph only: the formula branches on the data under grad mode.
RUN_REAL_WITH_HISTORY: dict[str, str] = {
    "LinalgDetBackward0": "det's backward takes a data-dependent path when it must be differentiable",
    "NativeGroupNormBackward0": "group_norm's backward takes a differentiable path (other rounding) under grad mode",
}
