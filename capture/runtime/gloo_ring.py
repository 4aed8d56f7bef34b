"""Where gloo's ring all-reduce adds each element, and a bucket that keeps each member's order.

Over more than two ranks a float sum depends on the order of its additions, and gloo's
ring all-reduce (the CPU all-reduce of a gloo process group) adds different parts of a
tensor in different orders.  It cuts ``n`` elements into ``segments`` equal pieces:
twice the ranks at least, more when a piece would pass gloo's 1 MiB I/O size
(``AllreduceOptionsImpl::kMaxSegmentSize``), rounded up to a multiple of the ranks.
Consecutive pieces make one chunk per rank; the sum of chunk ``c`` starts at rank
``c - 1`` and runs down the ring (``c - 1``, ``c - 2``, ...), each rank adding its
value to the partial sum it received.

A parameter's own all-reduce therefore adds its chunk ``c`` starting at rank ``c - 1``.
:func:`layout` places the members of a bucket so that one all-reduce of the bucket
adds every element in that same order: the bucket is a ``[ranks, row]`` buffer whose
row ``c`` is exactly the bucket's chunk ``c``, and member ``p``'s chunk ``c`` lies in
row ``c`` at the member's own columns.  The sums are then bitwise those of the
members' own all-reduces (``tests/test_ddp_buckets.py`` checks it over 3 and 4 ranks,
the rule itself on sizes that cross the 1 MiB pieces).
"""

from __future__ import annotations

import torch

from .. import torch_releases

_MAX_SEGMENT_BYTES = 1 << 20


def ranks_of(group, device: torch.device) -> int:
    """The ranks of ``group`` when an all-reduce of a tensor on ``device`` runs gloo's ring
    over more than two of them; else 0 (two ranks add ``a + b`` in any order, other
    collectives' orders are not modelled here, nor gloo's on an untested torch)."""
    if device.type != "cpu" or not torch_releases.GLOO_RING_ORDER_KNOWN:
        return 0
    import torch.distributed as dist
    try:
        size = group.size()
        backend = group._get_backend(device)
    except (AttributeError, RuntimeError):
        return 0
    return size if size > 2 and isinstance(backend, dist.ProcessGroupGloo) else 0


def chunk_length(numel: int, itemsize: int, ranks: int) -> int:
    """Elements per chunk of gloo's ring all-reduce of ``numel`` elements over ``ranks``."""
    segments = max(-(-numel * itemsize // _MAX_SEGMENT_BYTES), 2 * ranks)
    segments = -(-segments // ranks) * ranks
    return segments // ranks * -(-numel // segments)


def layout(numels, itemsize: int, ranks: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """(row, (column, width) of each member) of a bucket of ``ranks`` rows: member ``p``'s
    chunk ``c`` goes to row ``c`` at ``column``, ``width`` wide (its own chunk length)."""
    places, row = [], 0
    for numel in numels:
        width = chunk_length(numel, itemsize, ranks)
        places.append((row, width))
        row += width
    # the bucket's own chunk must be one row: pad the row to a whole number of its pieces
    while (chunk := chunk_length(ranks * row, itemsize, ranks)) != row:
        row = chunk  # a whole number of the (possibly more) pieces of the longer row
    return row, tuple(places)


def gaps(row: int, places, numels, ranks: int) -> tuple[tuple[int, int], ...]:
    """The (start, stop) ranges of the ``[ranks, row]`` buffer no member writes, merged:
    zeros there add nothing to any sum."""
    holes = []
    for r in range(ranks):
        for (column, width), numel in zip(places, numels):
            written = min(max(numel - r * width, 0), width)
            if written < width:
                holes.append((r * row + column + written, r * row + column + width))
        used = places[-1][0] + places[-1][1] if places else 0
        if used < row:
            holes.append((r * row + used, (r + 1) * row))
    merged = []
    for start, stop in holes:
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], stop)
        else:
            merged.append((start, stop))
    return tuple(merged)
