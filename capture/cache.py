"""The process-wide cache of compiled backward graphs (bounded LRU)."""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_SIZE = 128


class GraphCache:
    """LRU map from (structure key, backend, passes, dynamic) to compiled entries."""

    def __init__(self, max_size: int = DEFAULT_SIZE):
        self.max_size = max_size
        self._entries: OrderedDict = OrderedDict()

    def get(self, key):
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key, entry) -> None:
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


cache = GraphCache()


def set_cache_size(max_size: int) -> None:
    """Bound the number of cached graphs (least recently used are dropped)."""
    if max_size < 1:
        raise ValueError(f"cache size must be at least 1, got {max_size}")
    cache.max_size = max_size
    while len(cache) > max_size:
        cache._entries.popitem(last=False)
