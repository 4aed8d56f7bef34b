"""Passes over captured backward graphs, and the pipeline that runs them.

A pass is a plain function ``fn(graph: torch.fx.Graph) -> None`` that edits the
graph in place.  Passes are registered by name; :data:`DEFAULT_PIPELINE` names the
default order.  No pass may change a result or anything a hook can observe:
they are about order, memory and speed, never correctness.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch.fx as fx

from .bucket_allreduces import bucket_allreduces
from .dce import eliminate_dead_code
from .inplace_sums import inplace_sums
from .memory import free_inputs_early
from .schedule import early_side_effects
from .strip_detach import strip_detach

Pass = Callable[[fx.Graph], None]

_registry: dict[str, Pass] = {}
_changes = 0  # registrations so far (see changes())


def register_pass(name: str, fn: Pass | None = None):
    """Register ``fn`` under ``name`` (usable as a decorator)."""
    if not isinstance(name, str):
        raise TypeError(f"a pass name must be a str, got {type(name).__name__} ({name!r})")

    def add(f: Pass) -> Pass:
        if not callable(f):
            raise TypeError(f"pass {name!r} must be callable, got {type(f).__name__}")
        global _changes
        _registry[name] = f
        _changes += 1
        return f
    return add(fn) if fn is not None else add


def changes() -> tuple:
    """What ``resolve(None)`` depends on: the registrations so far and the default pipeline."""
    return _changes, DEFAULT_PIPELINE


register_pass("strip_detach", strip_detach)
register_pass("dce", eliminate_dead_code)
register_pass("early_side_effects", early_side_effects)
register_pass("bucket_allreduces", bucket_allreduces)
register_pass("inplace_sums", inplace_sums)
register_pass("free_inputs_early", free_inputs_early)

DEFAULT_PIPELINE: tuple[str, ...] = ("strip_detach", "dce", "early_side_effects", "bucket_allreduces",
                                     "inplace_sums", "free_inputs_early")


def list_passes() -> list[str]:
    """Names of the default pipeline, in order."""
    return list(DEFAULT_PIPELINE)


def resolve(passes) -> list[tuple[str, Pass]]:
    """Turn a ``passes=`` argument into (name, function) pairs.

    ``None`` is the default pipeline; a single name or callable means a pipeline of
    that one pass.  ValueError for an unknown name, TypeError for anything else.
    """
    if passes is None:
        passes = DEFAULT_PIPELINE
    elif isinstance(passes, str) or callable(passes):
        passes = [passes]  # iterating a string would give its letters
    elif isinstance(passes, (bytes, dict)) or not hasattr(passes, "__iter__"):
        raise TypeError(f"passes must be None, a pass name, or a list of pass names and callables "
                        f"fn(graph) -> None, got {type(passes).__name__}")
    out = []
    for p in passes:
        if isinstance(p, str):
            if p not in _registry:
                raise ValueError(f"unknown pass {p!r}; registered passes: {sorted(_registry)}")
            out.append((p, _registry[p]))
        elif callable(p):
            out.append((getattr(p, "__name__", type(p).__name__), p))
        else:
            raise TypeError(f"a pass must be a registered name (str) or a callable fn(graph) -> None, "
                            f"got {type(p).__name__} ({p!r})")
    return out


@dataclass(frozen=True, repr=False)
class PassRecord:
    """What one pass did to a graph; ``code()`` is the graph's code right after it.

    The code is kept compressed (a cached graph keeps its records) and
    decompressed only when asked for.
    """

    name: str
    nodes_before: int
    nodes_after: int
    moved: int
    seconds: float
    packed_code: bytes | None = field(default=None, compare=False)

    @property
    def removed(self) -> int:
        return self.nodes_before - self.nodes_after

    def code(self) -> str:
        """The graph's Python code right after this pass (graphs of ``gradfx.capture``)."""
        if self.packed_code is None:
            raise ValueError(f"the code after pass {self.name!r} was not kept: a block keeps no code per "
                             "pass; gradfx.capture(...) keeps it")
        return zlib.decompress(self.packed_code).decode()

    @property
    def code_after(self) -> str:  # the earlier name of code()
        return self.code()

    def __str__(self) -> str:
        return (f"{self.name}: {self.nodes_before} -> {self.nodes_after} nodes "
                f"({self.removed} removed, {self.moved} moved) in {self.seconds * 1e3:.2f} ms")

    __repr__ = __str__


class PassRecords(list):
    """The records of a pipeline, in order; its repr is one line per pass."""

    def __repr__(self) -> str:
        return "\n".join(str(r) for r in self) if self else "(no passes)"

    def _repr_pretty_(self, printer, cycle) -> None:  # IPython shows the same lines
        printer.text(repr(self))


def run_pipeline(graph: fx.Graph, passes: list[tuple[str, Pass]], keep_code: bool = False) -> PassRecords:
    """Run ``passes`` in order, linting after each; return what each did.

    Blocks keep no code per pass (a long block keeps every graph it captured, and
    a copy of the code after each pass would multiply that memory); ``capture()``,
    made for looking, keeps it compressed (``keep_code``).
    """
    records = PassRecords()
    for name, fn in passes:
        before = list(graph.nodes)
        start = time.perf_counter()
        fn(graph)
        seconds = time.perf_counter() - start
        graph.lint()
        after = list(graph.nodes)
        code = zlib.compress(graph.python_code("self").src.encode(), 1) if keep_code else None
        records.append(PassRecord(name, len(before), len(after), _moved(before, after), seconds, code))
    return records


def _moved(before: list, after: list) -> int:
    """Nodes whose position relative to the other survivors changed."""
    kept = set(after)
    old = [n for n in before if n in kept]
    pos = {n: k for k, n in enumerate(old)}
    return sum(1 for k, n in enumerate(after) if n in pos and pos[n] != k)
