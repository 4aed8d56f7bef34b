"""The counters of API.md §2: per block (``session.stats``) and for the process (``stats()``)."""

from __future__ import annotations

import logging
from collections import Counter

from . import routing

log = logging.getLogger("gradfx")

# recompiles: a backend compiling a cached graph again for new sizes (inductor does, per shape)
COUNTERS = ("captures", "cache_hits", "fallbacks", "compiles", "recaptures", "recompiles")
totals = dict.fromkeys(COUNTERS, 0)


def stats() -> dict:
    """Counters since the last reset(), for all blocks."""
    return dict(totals)


def clear() -> None:
    for k in totals:
        totals[k] = 0


def note_recompile(backend: str, nodes: int, seconds: float, sizes: tuple, first: tuple, count: int) -> None:
    """A backend compiled a cached graph again, for new sizes (on a cache hit).

    Counted as ``recompiles`` in the innermost block on this thread (the one
    whose backward is running) and logged with how the sizes differ from the
    graph's first compile, so that a slow cache hit says why.
    """
    block = routing.current()
    if block is not None:
        block._count("recompiles")
    else:
        totals["recompiles"] += 1
    if log.isEnabledFor(logging.INFO):
        changes = Counter((a, b) for a, b in zip(first, sizes) if a != b)
        what = ", ".join(f"{a} -> {b}" + (f" ({n} sizes)" if n > 1 else "") for (a, b), n in changes.most_common(4))
        log.info("gradfx: backend %s recompiled a cached backward of %d fx nodes in %.2f s for new sizes "
                 "(%s); %d compiled versions of this graph", backend, nodes, seconds, what or "none", count)
