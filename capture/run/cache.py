"""The process-wide cache of compiled backward graphs (bounded LRU).

Entries are found by the structure of the autograd graph (plus backend, passes
and dynamic mode), then by sizes: a static entry by the exact size list, a
dynamic entry by its guard.  The bound counts entries of both kinds.

Everything kept per structure (the sizes of its latest capture, the positions
made dynamic, its generated walker through ``on_forget``) goes when its last
entry is evicted, so memory is bounded by the cache size however many
structures, backends and pass lists a long run meets.

Backwards on several threads share it: one lock makes each lookup, insertion and
eviction whole (a lookup on one thread once met an entry another thread had just
evicted, between finding it and marking it used).  An entry evicted while a thread
runs its graph stays valid for that run.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from dataclasses import dataclass

DEFAULT_SIZE = 128


@dataclass(frozen=True)
class Assumed:
    """The key of a graph traced with what earlier backwards of its structure found: some
    gradients from opaque calls None (``none``: (node index, input) pairs, where a graph
    stopped), the layouts of saved tensors the user's hooks unpacked (``unpacked``:
    (node index, metas) pairs, graph.unpacked)."""

    base: object  # the structure
    none: frozenset
    unpacked: tuple = ()


class GraphCache:
    def __init__(self, max_size: int = DEFAULT_SIZE):
        self.max_size = max_size
        self._lock = threading.RLock()
        self._static: dict = {}  # (structure, sizes tuple) -> entry
        self._dynamic: dict = {}  # structure -> [entry], newest first
        self._lru: OrderedDict = OrderedDict()  # id(entry) -> (structure, sizes tuple or None, entry)
        self._per_structure: dict = {}  # structure -> number of entries
        self.last_sizes: dict = {}  # structure -> sizes of its latest capture
        self.dynamic_positions: dict = {}  # structure -> positions made dynamic so far
        self.on_forget: list = []  # callables(structure), called when a structure's last entry goes
        # structure -> the gradients from opaque calls that were None when its graph last
        # stopped: the next backward uses (or captures) the graph traced so (an Assumed key)
        self.assumed_none: dict = {}
        # structure -> {node index: layouts of the saved tensors its unpack hooks gave}
        self.unpacked: dict = {}
        self.assumes = False  # either of the two holds anything: keys are looked up
        # id(structure) -> (structure, its key): the key of a walker's structure (the same
        # object every backward) without hashing it; cleared whenever an assumption changes
        self._keys: dict = {}
        self._last = None  # (structure, its sizes, entry, the sizes list) of the last lookup that found one

    def lookup(self, structure, sizes):
        with self._lock:
            last = self._last
            # A training loop finds the same entry each step: the last hit answers while
            # nothing was put, evicted or cleared since (any of them forgets it), sparing
            # the size tuple and its hash.
            if last is not None and last[0] is structure and (last[3] is sizes or last[1] == sizes):
                entry = last[2]
                self._lru.move_to_end(id(entry))
                return entry
            entry = self._static.get((structure, tuple(sizes)))
            if entry is None:
                for candidate in self._dynamic.get(structure, ()):
                    if candidate.guard(sizes):
                        entry = candidate
                        break
            if entry is not None:
                self._lru.move_to_end(id(entry))
                # The sizes as they were, and the list itself: a one-call walk returns
                # the same list while its sizes repeat (native/program.cpp), and a
                # walk's sizes never change once returned.
                self._last = (structure, list(sizes), entry, sizes)
            return entry

    def entries(self, structure) -> list:
        """The cached entries of a structure, dynamic ones first (for explanations)."""
        with self._lock:
            found = list(self._dynamic.get(structure, ()))
            found += [e for (st, _), e in self._static.items() if st == structure]
            return found

    def known(self, structure) -> bool:
        return structure in self.last_sizes

    def put(self, structure, sizes, entry, dynamic: bool) -> None:
        with self._lock:
            self._put(structure, sizes, entry, dynamic)

    def _put(self, structure, sizes, entry, dynamic: bool) -> None:
        self._last = None
        if dynamic:
            self._dynamic.setdefault(structure, []).insert(0, entry)
            self._lru[id(entry)] = (structure, None, entry)
        else:
            key = tuple(sizes)
            old = self._static.get((structure, key))
            if old is not None:  # replaced: its LRU record must not evict the new one later
                del self._lru[id(old)]
                self._per_structure[structure] -= 1
            self._static[(structure, key)] = entry
            self._lru[id(entry)] = (structure, key, entry)
        self._per_structure[structure] = self._per_structure.get(structure, 0) + 1
        self.last_sizes[structure] = list(sizes)
        self._evict()

    def evict(self) -> None:
        """Drop the least recently used entries beyond ``max_size``."""
        with self._lock:
            self._evict()

    def _evict(self) -> None:
        while len(self._lru) > self.max_size:
            self._last = None
            _, (structure, key, entry) = self._lru.popitem(last=False)
            if key is None:
                self._dynamic[structure].remove(entry)
                if not self._dynamic[structure]:
                    del self._dynamic[structure]
            else:
                del self._static[(structure, key)]
            self._per_structure[structure] -= 1
            if not self._per_structure[structure]:
                self._forget(structure)

    def key(self, structure):
        """The key to look ``structure`` up by: its Assumed key where earlier backwards found
        something (a graph stopped, hooks unpacked saved tensors)."""
        if not self.assumes:  # every backward asks: no hashing in the common case
            return structure
        known = self._keys.get(id(structure))
        if known is not None and known[0] is structure:
            return known[1]
        with self._lock:
            none = self.assumed_none.get(structure)
            unpacked = self.unpacked.get(structure)
            key = structure
            if none is not None or unpacked:
                key = Assumed(structure, none or frozenset(), tuple(sorted(unpacked.items())) if unpacked else ())
            if len(self._keys) >= 4 * self.max_size:  # generic walks make new structure objects
                self._keys.clear()
            self._keys[id(structure)] = (structure, key)
        return key

    def learn(self, base, i: int, metas: tuple) -> None:
        """A backward of ``base`` found node ``i``'s saved tensors unpacked with these layouts:
        the next backward takes (or captures) the graph traced with them."""
        with self._lock:
            self.unpacked.setdefault(base, {})[i] = metas
            self.assumes = True
            self._keys.clear()

    def learned_for(self, walk_key) -> dict:
        """The layouts learned for structures of this walk key, under any backend and passes
        (for gradfx.capture, which has none): node index -> metas; {} where none."""
        with self._lock:
            for base, found in self.unpacked.items():
                if type(base) is tuple and base and base[0] == walk_key:
                    return dict(found)
        return {}

    def stopped(self, key, node: int, checked: tuple, none: frozenset) -> None:
        """A graph of ``key`` stopped at ``node``, whose gradients at ``checked`` came from
        opaque calls, ``none`` of them None: the next backward assumes so."""
        base, assumed = (key.base, key.none) if isinstance(key, Assumed) else (key, frozenset())
        assumed = frozenset(a for a in assumed if a[0] != node) | {(node, k) for k in none}
        with self._lock:
            if assumed:
                self.assumed_none[base] = assumed
            else:
                self.assumed_none.pop(base, None)
            self.assumes = bool(self.assumed_none or self.unpacked)
            self._keys.clear()

    def _forget(self, structure) -> None:
        base = structure.base if isinstance(structure, Assumed) else structure
        if not any(self._per_structure.get(k) for k in self._related(base) if k != structure):
            self.assumed_none.pop(base, None)
            self.unpacked.pop(base, None)
            self.assumes = bool(self.assumed_none or self.unpacked)
        self._keys.clear()  # (it holds the structures it answers for: they go with their entries)
        del self._per_structure[structure]
        self.last_sizes.pop(structure, None)
        self.dynamic_positions.pop(structure, None)
        for fn in self.on_forget:
            fn(structure)

    def clear(self) -> None:
        with self._lock:
            self._clear()

    def _clear(self) -> None:
        self._last = None
        self._static.clear()
        self._dynamic.clear()
        self._lru.clear()
        self._per_structure.clear()
        self.last_sizes.clear()
        self.dynamic_positions.clear()
        self.assumed_none.clear()
        self.unpacked.clear()
        self.assumes = False
        self._keys.clear()

    def _related(self, base) -> list:
        """The keys of ``base`` that hold entries: itself and its Assumed keys."""
        return [k for k in self._per_structure if k == base or (isinstance(k, Assumed) and k.base == base)]

    def __len__(self) -> int:
        return len(self._lru)


cache = GraphCache()


def set_cache_size(max_size: int) -> None:
    """Bound the number of cached graphs (least recently used are dropped).

    ``max_size`` is an int of at least 1: TypeError for other types (bool
    included), ValueError below 1.
    """
    if isinstance(max_size, bool):
        raise TypeError("cache size must be an int, got bool")
    try:
        size = operator.index(max_size)  # ints and int-like (numpy) integers, never floats
    except TypeError:
        raise TypeError(f"cache size must be an int, got {type(max_size).__name__} ({max_size!r})") from None
    if size < 1:
        raise ValueError(f"cache size must be at least 1, got {size}")
    cache.max_size = size
    cache.evict()
