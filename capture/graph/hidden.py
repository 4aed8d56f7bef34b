"""The hidden state of builtin nodes, read in C++ (``capture.native``) for the structure key.

Each node kind here keeps what its backward reads in C++ members no Python binding
shows; a graph traced through such a node bakes them in.  With them in the key (and
checked by the generated walker on every cache hit), a backward whose hidden state
differs can never reuse the graph; without the compiled part, the node runs as itself
(``graph.run_real.RUN_REAL``), as it always could.  ``kinds.hidden_state`` reads it for
the key.

* ``NativeDropoutBackward0``: ``train`` (the scale: 1/(1-p), or 1 where the forward
  did not train); ``p`` is a visible saved value.
* ``AsStridedBackward0/1``, ``AsStridedBackward0_copy``: the input's geometry (sizes,
  strides, storage offset).
* ``BlockDiagBackward0``: every input's sizes and dtype.
* ``CopySlices`` (an in-place op on a view): the base's and the view's geometry, and
  the node of the in-place op it wraps (``fn``), keyed by its type and visible saved
  values.  Where ``fn`` holds saved tensors (the walk does not take them over), holds
  hidden state itself, is a node gradfx runs as itself, or the view is replayed by a
  view function (views ``as_strided`` cannot express), the node stays opaque.
"""

from __future__ import annotations

from .. import native

KEYED: frozenset = frozenset({
    "NativeDropoutBackward0", "AsStridedBackward0", "AsStridedBackward1", "AsStridedBackward0_copy",
    "BlockDiagBackward0", "CopySlices",
})


# A NodeRecord.values slot: the hidden sizes, symbolic where sizes are (named as a saved
# value, so that explanations of a size say "saved hidden_geometry (item k)").
SIZES = "_saved_hidden_geometry"


def wrapped(node):
    """A CopySlices' in-place node (its formula runs on the view's gradient)."""
    return native.module().hidden(node)[2]


def copy_slices_geometry(sizes) -> tuple:
    """(base sizes, base strides, base offset, view sizes, view strides, view offset) of
    ``state``'s sizes (ints or symbols)."""
    base_sizes, base_strides, (base_offset,), view_sizes, view_strides, (view_offset,) = sizes
    return base_sizes, base_strides, base_offset, view_sizes, view_strides, view_offset
