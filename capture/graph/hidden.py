"""The hidden state of builtin nodes, read in C++ (``capture.native``) for the structure key.

Each node kind here keeps what its backward reads in C++ members no Python binding
shows; a graph traced through such a node bakes them in.  With them in the key (and
checked by the generated walker on every cache hit), a backward whose hidden state
differs can never reuse the graph; without the compiled part, the node runs as itself
(``trace.rules.RUN_REAL``), as it always could.

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


def state(node):
    """The hidden state of ``node`` (of a ``KEYED`` type) as (sizes, key): sizes that follow
    the data (nested tuples of ints, which go to the walk's sizes: guarded, or symbolic) and
    the rest, hashable, for the key.  None where the node must run as itself: the compiled
    part is not (yet) loaded, or see the module doc."""
    reader = native.module()
    if reader is None:
        return None
    read = reader.hidden(node)
    if read is None:
        return None
    if type(node).__name__ != "CopySlices":
        return (), read  # rare ops: their hidden sizes stay in the key
    base, view, fn, replayed = read
    wrapped = _wrapped_key(fn)
    if replayed or wrapped is None:
        return None
    return (base[0], base[1], (base[2],), view[0], view[1], (view[2],)), wrapped


def wrapped(node):
    """A CopySlices' in-place node (its formula runs on the view's gradient)."""
    return native.module().hidden(node)[2]


def copy_slices_geometry(sizes) -> tuple:
    """(base sizes, base strides, base offset, view sizes, view strides, view offset) of
    ``state``'s sizes (ints or symbols)."""
    base_sizes, base_strides, (base_offset,), view_sizes, view_strides, (view_offset,) = sizes
    return base_sizes, base_strides, base_offset, view_sizes, view_strides, view_offset


def _wrapped_key(fn):
    """A CopySlices' in-place node as a key (type, visible saved values), or None."""
    from .kinds import TRACED, type_info, value_key
    from ..trace.rules import RUN_REAL
    if fn is None:
        return None
    tp = type(fn)
    info = type_info(tp)
    if (info.kind != TRACED or info.raw_saved or tp.__name__ in RUN_REAL or tp.__name__ in KEYED
            or tp.__name__ == "CppFunction"):
        return None
    return (tp,) + tuple(value_key(getattr(fn, attr)) for attr in info.saved_values)
