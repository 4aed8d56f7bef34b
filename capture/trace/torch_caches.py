"""What gradfx adds to torch's process-wide caches goes when its graph goes.

Tracing and compiling a backward fill two of torch's class-level caches that
torch never empties:

* ``FakeTensorMode.cache``, the fake-tensor dispatch cache (one entry per op and
  input metadata; static captures at many sizes add thousands);
* the source of every ``GraphModule`` compiled, in ``torch.fx``'s source loader
  and in ``linecache`` (kept so tracebacks can show generated code).

Both are shared with the user's own ``torch.compile``, so gradfx removes only
what it added: :class:`Window` records what appeared while gradfx traced and
compiled one graph, and :meth:`Window.release_with` removes it when that graph
is garbage (the cache entry and ``session.graphs`` hold it, so a graph in use
keeps its source for tracebacks and its fake-tensor entries for later traces).
Both caches are insertion-ordered dicts: what a window added is what follows
the keys that were last when it opened.
"""

from __future__ import annotations

import linecache
import threading
import weakref

from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import graph_module as _graph_module

_MARKERS = 8  # last keys remembered when a window opens
# Reentrant: a finalizer may run (garbage collection) while this thread holds it.
_lock = threading.RLock()
_open = 0  # windows open now; removals wait until none is (they would move the markers)
_pending: list = []  # removals waiting for that


def _fake_cache() -> dict:
    return FakeTensorMode.cache


def _source_cache() -> dict:
    return _graph_module._loader.eval_cache


def _tail(d: dict) -> list:
    try:
        out = []
        for key in reversed(d):
            out.append(key)
            if len(out) == _MARKERS:
                break
        return out
    except RuntimeError:  # another thread inserted meanwhile; list() copies atomically
        return list(d)[-_MARKERS:][::-1]


def _added_since(d: dict, markers: list) -> list:
    """Keys inserted after the newest marker still present ([] if none is)."""
    keys = list(d)  # one C call: another thread cannot change it underneath
    if not markers:  # empty when the window opened: everything is new
        return keys
    marks = set(markers)
    for k in range(len(keys) - 1, -1, -1):
        if keys[k] in marks:
            return keys[k + 1:]
    return []  # the cache was cleared meanwhile: what is there is not known to be ours


class Window:
    """Records what torch's caches gain between ``open`` and ``close``."""

    def __init__(self):
        self.fake_keys: list = []
        self.source_keys: list = []

    def __enter__(self) -> "Window":
        global _open
        with _lock:
            _open += 1
            self._fake = _tail(_fake_cache())
            self._source = _tail(_source_cache())
        return self

    def __exit__(self, *exc) -> None:
        global _open
        with _lock:
            self.fake_keys += _added_since(_fake_cache(), self._fake)
            self.source_keys += _added_since(_source_cache(), self._source)
            _open -= 1
            run = _take_pending() if not _open else []
        for keys in run:
            _remove(*keys)

    def release_with(self, owner) -> None:
        """Remove what this window added once ``owner`` is garbage."""
        if self.fake_keys or self.source_keys:
            weakref.finalize(owner, _release, self.fake_keys, self.source_keys).atexit = False
        self.fake_keys, self.source_keys = [], []

    def release_now(self) -> None:
        _release(self.fake_keys, self.source_keys)
        self.fake_keys, self.source_keys = [], []


def _take_pending() -> list:
    run = list(_pending)
    _pending.clear()
    return run


def _release(fake_keys: list, source_keys: list) -> None:
    with _lock:
        if _open:
            _pending.append((fake_keys, source_keys))
            return
    _remove(fake_keys, source_keys)


def _remove(fake_keys: list, source_keys: list) -> None:
    fake = _fake_cache()
    for key in fake_keys:
        fake.pop(key, None)
    sources = _source_cache()
    for key in source_keys:
        sources.pop(key, None)
        linecache.cache.pop(key, None)
