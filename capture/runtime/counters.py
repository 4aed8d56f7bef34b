"""The counters of API.md §2: per block (``session.stats``) and for the process (``stats()``).

A count goes to the innermost block open on the thread that counts (the driver opens
and closes them, ``run.routing``), or to the process alone outside any.  Backends
count here while they compile and when a compiled graph compiles again at run time.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter

log = logging.getLogger("gradfx")

# recompiles: a backend compiling a cached graph again for new sizes (inductor does, per shape);
# uncompiled: graphs a compiling backend runs uncompiled, wholly or in part
COUNTERS = ("captures", "cache_hits", "fallbacks", "compiles", "recaptures", "recompiles", "uncompiled")
totals = dict.fromkeys(COUNTERS, 0)


def stats() -> dict:
    """Counters since the last reset(), for all blocks."""
    return dict(totals)


def clear() -> None:
    for k in totals:
        totals[k] = 0


class _Open(threading.local):
    """The open blocks of this thread, innermost last."""

    def __init__(self):
        self.stack = []


_open = _Open()


def current():
    """The innermost open block on this thread, or None."""
    stack = _open.stack
    return stack[-1] if stack else None


def opened(block) -> None:
    _open.stack.append(block)


def closed(block) -> None:
    _open.stack.remove(block)


def note(name: str) -> None:
    """Count ``name`` in the innermost block on this thread (the one whose backward is
    running or compiling), or for the process alone outside any block."""
    block = current()
    if block is not None:
        block._count(name)
    else:
        totals[name] += 1


def note_recompile(backend: str, nodes: int, seconds: float, sizes: tuple, first: tuple, count: int,
                   part: str = "a cached backward") -> None:
    """A backend compiled a cached graph again, for new sizes (on a cache hit).

    Counted as ``recompiles`` in the innermost block on this thread (the one
    whose backward is running) and logged with how the sizes differ from the
    graph's first compile, so that a slow cache hit says why.  ``part``: what was
    compiled (a backend may compile a graph in regions).
    """
    note("recompiles")
    if log.isEnabledFor(logging.INFO):
        changes = Counter((a, b) for a, b in zip(first, sizes) if a != b)
        what = ", ".join(f"{a} -> {b}" + (f" ({n} sizes)" if n > 1 else "") for (a, b), n in changes.most_common(4))
        log.info("gradfx: backend %s recompiled %s of %d fx nodes in %.2f s for new sizes "
                 "(%s); %d compiled versions of this graph", backend, part, nodes, seconds, what or "none", count)
