"""The CPU engine's ready queue, reproduced exactly.

engine.cpp keeps ready nodes in a ``std::priority_queue`` ordered by sequence
number (highest first).  Ties are common: every ``AccumulateGrad`` has the same
sequence number (UINT64_MAX), so the order in which tied nodes leave the queue is
decided by libstdc++'s binary-heap algorithm.  Python's ``heapq`` sifts
differently, so we re-implement the libstdc++ push_heap / pop_heap steps here:
hook and accumulation order then match eager even among ties.
"""

from __future__ import annotations


class ReadyQueue:
    """Max-heap of ``(sequence_nr, item)`` with libstdc++ ``priority_queue`` tie order."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, object]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, seq: int, item: object) -> None:
        heap = self._heap
        heap.append((seq, item))
        self._sift_up(len(heap) - 1, 0, (seq, item))

    def pop(self) -> object:
        heap = self._heap
        top = heap[0]
        last = heap.pop()
        if heap:
            self._adjust(0, len(heap), last)
        return top[1]

    # std::__push_heap: move the hole up while its parent compares less.
    def _sift_up(self, hole: int, top: int, value: tuple) -> None:
        heap = self._heap
        parent = (hole - 1) // 2
        while hole > top and heap[parent][0] < value[0]:
            heap[hole] = heap[parent]
            hole = parent
            parent = (hole - 1) // 2
        heap[hole] = value

    # std::__adjust_heap: walk the hole to a leaf, preferring the right child
    # unless the left one is strictly greater, then sift the value back up.
    def _adjust(self, hole: int, length: int, value: tuple) -> None:
        heap = self._heap
        top = hole
        child = hole
        while child < (length - 1) // 2:
            child = 2 * (child + 1)
            if heap[child][0] < heap[child - 1][0]:
                child -= 1
            heap[hole] = heap[child]
            hole = child
        if length % 2 == 0 and child == (length - 2) // 2:
            child = 2 * (child + 1)
            heap[hole] = heap[child - 1]
            hole = child - 1
        self._sift_up(hole, top, value)
