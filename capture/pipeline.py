"""One capture: a walked backward call -> traced graph -> passes -> CapturedGraph.

Both ``gradfx.capture`` and a block's cache miss go through :func:`capture_call`;
the block then compiles the graph with its backend, ``capture`` does not.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from .. import reorder
from .errors import _Fallback
from .graph.walk import BackwardCall
from .trace import torch_caches
from .view import annotate, explain
from .view.captured_graph import CapturedGraph

log = logging.getLogger("gradfx")


@dataclass
class Capture:
    """What a capture made: the graph, its guard, and the sizes it takes as inputs."""

    graph: CapturedGraph
    guard: object  # trace.shapes.Guard
    size_positions: list  # positions of call.sizes passed to the graph, before its inputs
    example_inputs: list
    opaque: list  # labels of the autograd nodes run as the real node
    dynamic_positions: set = frozenset()  # every non-static position: those above and their products
    frontiers: list = ()  # where the graph may stop and hand over to run.continuation
    unpacks: bool = False  # it unpacks saved tensors under the user's hooks itself (graph.unpacked)
    compiled: object = None  # what ``compile`` returned

    @property
    def graph_module(self) -> fx.GraphModule:
        return self.graph.graph_module


def capture_call(call: BackwardCall, dynamic_positions: dict, passes, *, names=None, grad_inputs=(),
                 keep_code: bool = False, compile=None, assumed_none=frozenset(), learner=None) -> Capture:
    """Trace ``call`` (symbolic at ``dynamic_positions``, position -> symbol group;
    static if that trace fails; gradients of opaque calls at ``assumed_none`` as None;
    saved tensors under the user's hooks as ``learner`` knows them: graph.unpacked),
    run ``passes``, wrap the result and ``compile(gm, example_inputs)`` it if given.
    Raises ``_Fallback`` if it cannot be traced."""
    from .trace.shapes import Guard, SymbolicSizes  # sympy and fake tensors: not at import
    from .trace import layouts
    from .trace.tracer import trace_backward
    window = torch_caches.Window()  # what tracing adds to torch's caches goes with the graph
    try:
        with window, _collector_paused():
            start = time.perf_counter()
            trace, symbolic = None, None
            if dynamic_positions:
                symbolic = SymbolicSizes(call.sizes, dynamic_positions, dynamic_positions)
                try:
                    trace = trace_backward(call, symbolic, assumed_none)
                except Exception:
                    log.info("gradfx: tracing with symbolic sizes failed; capturing static sizes",
                             exc_info=log.isEnabledFor(logging.DEBUG))
                    symbolic = None
                    call.kinds = [r.kind for r in call.records]
            if trace is None:
                trace = _trace_static(call, assumed_none, learner)
            describe = lambda p: explain.describe_position(call, p)  # noqa: E731
            guard = symbolic.guard(describe) if symbolic is not None else Guard.static(call.sizes)
            size_positions = symbolic.positions if symbolic is not None else []
            layouts.generalize_views(trace.graph)
            annotate.apply(trace.graph, call, names, grad_inputs)
            records = reorder.run_pipeline(trace.graph, passes, keep_code)
            examples = [call.sizes[p] for p in size_positions] + list(call.inputs)
            # Python code is generated when someone reads or runs it (a backend compiles
            # the graph itself; the eager backend generates its own private copy).
            gm = _LazyGraphModule(torch.nn.Module(), trace.graph)
            graph = CapturedGraph(gm, passes=records, opaque_nodes=trace.opaque,
                                  guards=explain.compact_guards(guard.text), autograd_nodes=len(call.nodes),
                                  capture_seconds=trace.seconds, example_inputs=examples)
            log.info("gradfx: captured %d autograd nodes into %d fx nodes (%d opaque) in %.1f ms",
                     len(call.nodes), len(gm.graph.nodes), len(trace.opaque), (time.perf_counter() - start) * 1e3)
            made = Capture(graph, guard, size_positions, examples, trace.opaque,
                           symbolic.dynamic if symbolic is not None else frozenset(), trace.frontiers,
                           trace.unpacks)
            if compile is not None:
                made.compiled = compile(gm, examples)
    except BaseException:
        window.release_now()
        raise
    window.release_with(gm)
    return made


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off for one capture (unless the user turned it off).

    Tracing allocates and keeps hundreds of thousands of objects (sympy expressions, fake
    tensors, fx nodes); each allocation burst then starts a full collection over the whole
    heap, which made up a quarter of a GPT-2 recapture.  Nothing is collected at the end:
    what the capture left behind goes with the next collection Python starts by itself.
    """
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _trace_static(call: BackwardCall, assumed_none, learner):
    from .trace.tracer import trace_backward
    try:
        return trace_backward(call, None, assumed_none, learner)
    except _Fallback:
        raise
    except Exception as err:
        # Errors eager raises at the same point (a wrong shape, ...) are eager's.
        if isinstance(err, RuntimeError) and "returned an invalid gradient" in str(err):
            raise
        log.debug("gradfx: trace failed", exc_info=True)
        raise _Fallback(f"tracing failed ({type(err).__name__}: {err})") from err
