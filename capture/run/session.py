"""The ``compiled_autograd`` context manager and the path of one backward call.

While a block is active on a thread, every backward API call made on that thread
reaches :meth:`Session.run_backward` (see ``routing``).  There the call is walked
(``walk``), looked up in the cache, traced and compiled on a miss (``tracer``,
``gradfx.reorder``, ``gradfx.backends``), and run.  Anything that cannot be
captured runs on the eager engine instead, with one warning per block and reason.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections import Counter

import torch
import torch.fx as fx

from ... import backends, reorder
from ...backends.identity import Key, callable_key
from ..view import annotate
from ..graph import distributed, fast_walk
from . import hook_ops, routing
from .cache import cache
from ..view.captured_graph import CapturedGraph
from ..errors import FallbackWarning, Unsupported, _Fallback
from .runtime_ops import WrongGradient
from ..graph.saved import ForeignHooks
from ..view import explain
from ..trace.shapes import Guard, SymbolicSizes, baked_positions, changed_positions, dynamic_candidates
from ..trace.tracer import trace_backward
from . import torch_caches
from ..graph.walk import OPAQUE, BackwardCall, walk_backward

log = logging.getLogger("gradfx")

# recompiles: a backend compiling a cached graph again for new sizes (inductor does, per shape)
COUNTERS = ("captures", "cache_hits", "fallbacks", "compiles", "recaptures", "recompiles")
_global_stats = dict.fromkeys(COUNTERS, 0)
_local = threading.local()


def unused_input_message(index: int) -> str:
    """torch.autograd.grad's error (torch 2.13's words) for an input nothing depends on."""
    return (f"The differentiated Tensor at index {index} appears to not have been used in the graph. "
            "Set allow_unused=True if this is the desired behavior.")


def stats() -> dict:
    """Counters since the last reset(), for all blocks."""
    return dict(_global_stats)


# A structure's walker goes with its last cached graph.
cache.on_forget.append(fast_walk.walkers.forget)


def reset() -> None:
    """Clear every cache and counter (registered backends stay)."""
    cache.clear()
    fast_walk.walkers.clear()
    for k in _global_stats:
        _global_stats[k] = 0


def note_recompile(backend: str, nodes: int, seconds: float, sizes: tuple, first: tuple, count: int) -> None:
    """A backend compiled a cached graph again, for new sizes (on a cache hit).

    Counted as ``recompiles`` in the innermost block on this thread (the one
    whose backward is running) and logged with how the sizes differ from the
    graph's first compile, so that a slow cache hit says why.
    """
    session = current()
    if session is not None:
        session._count("recompiles")
    else:
        _global_stats["recompiles"] += 1
    if log.isEnabledFor(logging.INFO):
        changes = Counter((a, b) for a, b in zip(first, sizes) if a != b)
        what = ", ".join(f"{a} -> {b}" + (f" ({n} sizes)" if n > 1 else "") for (a, b), n in changes.most_common(4))
        log.info("gradfx: backend %s recompiled a cached backward of %d fx nodes in %.2f s for new sizes "
                 "(%s); %d compiled versions of this graph", backend, nodes, seconds, what or "none", count)


def current() -> "Session | None":
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


class CompiledBackward:
    """A cache entry: the compiled callable plus what running it needs."""

    __slots__ = ("fn", "boxed", "captured", "release_after", "runs_python", "guard", "size_positions",
                 "verified", "failed", "output_specs")

    def __init__(self, fn, captured: CapturedGraph, release_after: frozenset, runs_python: bool,
                 guard, size_positions=(), failed=None, output_specs=None):
        self.fn = fn
        self.boxed = getattr(fn, "_boxed", None)
        self.captured = captured
        self.release_after = release_after  # nodes run opaquely keep their tensors until the end
        # Hooks and opaque calls run user code that may ask torch about the
        # running graph task (multi-grad hooks, checkpoint's recomputation cache).
        self.runs_python = runs_python
        self.guard = guard
        self.size_positions = size_positions  # sizes passed to the graph, before its inputs
        # A compiler's code may compile lazily, on its first call: until that call has
        # succeeded, nothing is released before the run (a failure falls back intact).
        self.verified = getattr(fn, "_gradfx_compiled", None) is None
        # Why the backend failed, when `fn` is the eager backend standing in for it:
        # a strict block must not run the stand-in.
        self.failed = failed
        # autograd.grad graphs of backends gradfx does not generate itself: what each
        # returned gradient must look like (None: not checked).
        self.output_specs = output_specs


class Session:
    """State of one ``with gradfx.compiled_autograd(...)`` block."""

    def __init__(self, backend="eager", *, dynamic="auto", strict=False, passes=None, names=None):
        self.names = annotate.Names(names) if names is not None else None  # display only: never keyed
        self.backend_name, self.backend_fn = backends.lookup(backend)
        # `in` would take 1 and 0 for True and False (and then treat them as "auto").
        if not (dynamic is True or dynamic is False or (type(dynamic) is str and dynamic == "auto")):
            raise ValueError(f"dynamic must be 'auto', True or False, got {dynamic!r}")
        if type(strict) is not bool:  # strict="no" must not mean True
            raise TypeError(f"strict must be True or False, got {type(strict).__name__} ({strict!r})")
        self.passes = reorder.resolve(passes)
        self.dynamic = dynamic
        self.strict = strict
        self.graphs: list[CapturedGraph] = []
        self.stats = dict.fromkeys(COUNTERS, 0)
        self._warned: set[str] = set()
        # Code generated by gradfx's eager backend needs no checks of its outputs.
        self._trusted = self.backend_fn is backends.builtin.eager
        # Backend and passes by what they are (backends.identity), computed once per
        # block: a lambda written in the training loop is the same backend each step,
        # and a registered name means the function registered now.  `strict` is not
        # in the key: it changes nothing for a graph that compiled, and a graph whose
        # backend failed is marked (CompiledBackward.failed).
        self._config_key = Key((callable_key(self.backend_fn),
                                tuple(callable_key(fn) for _, fn in self.passes), dynamic))

    # -- context manager -----------------------------------------------------
    def __enter__(self) -> "Session":
        routing.install()
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _local.stack.remove(self)

    def _count(self, name: str) -> None:
        self.stats[name] += 1
        _global_stats[name] += 1

    # -- one backward call ---------------------------------------------------
    def run_backward(self, engine, tensors, grad_tensors, keep_graph, create_graph,
                     inputs=(), allow_unreachable=True, accumulate_grad=True):
        args = (tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad)
        if _eager_refuses(tensors, inputs):
            # Eager raises for this call before computing anything: let it, in its own
            # words.  Nothing ran, so nothing is counted and nothing is warned.
            return engine.run_backward(*args)
        try:
            if create_graph:
                raise _Fallback("create_graph=True (double backward)")
            if torch.is_anomaly_enabled():
                raise _Fallback("anomaly detection is enabled")
            for t in tuple(tensors) + tuple(inputs or ()):
                if not isinstance(t, torch.Tensor):
                    raise _Fallback(f"a GradientEdge ({type(t).__name__}) as root or input")
                if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
                    raise _Fallback(f"a tensor subclass ({type(t).__name__})")
            if any(g is None for g in grad_tensors):
                raise _Fallback("a root without a gradient")  # eager raises the error
            call, structure = self._fast_walk(tensors, grad_tensors, inputs)
            if call is None:
                call = walk_backward(tensors, grad_tensors, inputs, accumulate_grad)
                structure = (call.key, self._config_key)
            entry = cache.lookup(structure, call.sizes)
            if entry is None:
                entry = self._capture(call, structure, tensors, () if accumulate_grad else inputs)
                self._count("captures")
            else:
                if entry.failed is not None:  # before anything is released
                    self._backend_failed(entry.failed, None)
                self._count("cache_hits")
        except _Fallback as fb:
            return self._fallback(engine, args, fb.reason)
        results = self._run(entry, call, keep_graph)
        if not accumulate_grad:
            if entry.output_specs is not None:
                _check_outputs(results, entry.output_specs, inputs, self.backend_name)
            if not allow_unreachable:
                for k, r in enumerate(results):
                    if r is None:
                        raise RuntimeError(unused_input_message(k))
            return results
        return ()

    def _fast_walk(self, tensors, grads, inputs):
        """The generated walker of a known structure, if one accepts this graph."""
        if inputs or len(tensors) != 1 or distributed.initialized():
            return None, None
        fn = tensors[0].grad_fn
        for walker in fast_walk.walkers.candidates(type(fn), self._config_key):
            try:
                found = walker(tensors, grads)
            except ForeignHooks:  # saved tensors now under the user's hooks
                return None, None
            if found is not None:
                return fast_walk.instantiate(walker.template, *found), walker.structure
        return None, None

    def _fallback(self, engine, args, reason: str):
        if self.strict:
            raise Unsupported(reason)
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"gradfx: running this backward on the eager engine: {reason}",
                          FallbackWarning, stacklevel=4)
        self._count("fallbacks")
        return engine.run_backward(*args)

    def _capture(self, call: BackwardCall, structure, tensors, grad_inputs=()) -> CompiledBackward:
        recapture = cache.known(structure)
        if recapture:
            self._count("recaptures")
            if log.isEnabledFor(logging.INFO):
                failed = "; ".join(f"guard {e.guard.failing(call.sizes)}" for e in cache.entries(structure)[:2])
                log.info("gradfx: recapture: %s; %s", failed or "no graph",
                         explain.size_change(call, cache.last_sizes[structure]))
        else:
            explain.log_structure_miss(call)
        # What tracing and compiling add to torch's process-wide caches goes with
        # this graph (torch_caches).
        window = torch_caches.Window()
        try:
            with window:
                dynamic = self._dynamic_positions(call, structure)
                trace, symbolic = None, None
                if dynamic:
                    symbolic = SymbolicSizes(call.sizes, dynamic)
                    try:
                        trace = trace_backward(call, symbolic)
                    except Exception:
                        log.info("gradfx: tracing with symbolic sizes failed; capturing static sizes",
                                 exc_info=log.isEnabledFor(logging.DEBUG))
                        symbolic = None
                        call.kinds = list(call.walk_kinds)
                if trace is None:
                    trace = self._trace(call, None)
                describe = lambda p: explain.describe_position(call, p)  # noqa: E731
                guard = symbolic.guard(describe) if symbolic is not None else Guard.static(call.sizes)
                captured, compiled, failed = self.compile_graph(
                    trace, call, guards=explain.compact_guards(guard.text), grad_inputs=grad_inputs,
                    size_positions=symbolic.positions if symbolic is not None else ())
        except BaseException:
            window.release_now()
            raise
        window.release_with(captured.graph_module)
        release_after = frozenset(i for i, k in enumerate(call.kinds) if k is OPAQUE)
        self.graphs.append(captured)
        specs = None
        if call.outputs is not None and (failed is None and not self._trusted):
            specs = _output_specs(captured.graph_module.graph)
        entry = CompiledBackward(compiled, captured, release_after, bool(call.hooks or release_after),
                                 guard, symbolic.positions if symbolic is not None else (), failed, specs)
        if symbolic is not None:
            cache.dynamic_positions[structure] = set(symbolic.positions)
        cache.put(structure, call.sizes, entry, dynamic=symbolic is not None)
        self._add_fast_walker(call, structure, tensors)
        return entry

    def _add_fast_walker(self, call, structure, tensors) -> None:
        root_type = type(call.nodes[0])
        if any(w.structure == structure for w in fast_walk.walkers.candidates(root_type, self._config_key)):
            return  # a recapture of a known structure (new sizes): its walker still fits
        try:
            walker = fast_walk.generate(call, tensors, structure)
        except Exception:  # a walker is an optimization; the generic walk always works
            log.debug("gradfx: no fast walker", exc_info=True)
            return
        if walker is not None:
            fast_walk.walkers.add(root_type, self._config_key, walker)

    def _dynamic_positions(self, call: BackwardCall, structure) -> set:
        if self.dynamic is False:
            return set()
        if self.dynamic is True:
            wanted = dynamic_candidates(call.sizes)
        else:
            previous = cache.last_sizes.get(structure)
            if previous is None:
                return set()
            wanted = changed_positions(previous, call.sizes, call) | cache.dynamic_positions.get(structure, set())
        return wanted - baked_positions(call)

    def _trace(self, call, symbolic):
        try:
            return trace_backward(call, symbolic)
        except _Fallback:
            raise
        except Exception as err:
            # Errors eager raises at the same point (a wrong shape, ...) are eager's.
            if isinstance(err, RuntimeError) and "returned an invalid gradient" in str(err):
                raise
            log.debug("gradfx: trace failed", exc_info=True)
            raise _Fallback(f"tracing failed ({type(err).__name__}: {err})") from err

    def compile_graph(self, trace, call: BackwardCall, compile: bool = True, guards=(), size_positions=(),
                      grad_inputs=(), keep_code: bool = False):
        """(CapturedGraph, compiled callable or None, why the backend failed or None)."""
        start = time.perf_counter()
        annotate.apply(trace.graph, call, self.names, grad_inputs)
        records = reorder.run_pipeline(trace.graph, self.passes, keep_code)
        examples = [call.sizes[p] for p in size_positions] + list(call.inputs)
        gm = fx.GraphModule(torch.nn.Module(), trace.graph)
        captured = CapturedGraph(gm, passes=records, opaque_nodes=trace.opaque, guards=guards,
                                 autograd_nodes=len(call.nodes),
                                 capture_seconds=trace.seconds, example_inputs=examples)
        compiled, failed = self._compile(gm, examples) if compile else (None, None)
        log.info("gradfx: captured %d autograd nodes into %d fx nodes (%d opaque); trace %.1f ms, "
                 "passes+compile %.1f ms with backend %s", len(call.nodes), len(gm.graph.nodes),
                 len(trace.opaque), trace.seconds * 1e3, (time.perf_counter() - start) * 1e3,
                 self.backend_name)
        return captured, compiled, failed

    def _compile(self, gm: fx.GraphModule, example_inputs: list):
        """(compiled callable, None), or (eager stand-in, reason) if the backend failed.

        A compile function that raises or returns something not callable fails here,
        before the backward runs and releases anything: in strict mode the autograd
        graph is left as it was, so an eager backward of it still works.
        """
        start = time.perf_counter()
        self._count("compiles")
        failed = None
        try:
            compiled = backends.compile_with(self.backend_fn, gm, example_inputs)
            if not callable(compiled):
                raise TypeError(f"it returned {type(compiled).__name__} ({_short(compiled)}), not a callable")
        except Exception as err:
            failed = f"backend {self.backend_name!r} failed to compile ({type(err).__name__}: {err})"
            self._backend_failed(failed, err)
            compiled = backends.compile_with(backends.builtin.eager, gm, example_inputs)
        seconds = time.perf_counter() - start
        level = logging.INFO if seconds > 1.0 else logging.DEBUG
        log.log(level, "gradfx: backend %s compiled %d fx nodes in %.2f s", self.backend_name,
                len(gm.graph.nodes), seconds)
        return compiled, failed

    def _backend_failed(self, reason: str, err) -> None:
        """Strict: raise Unsupported.  Otherwise warn (once per block) that the eager
        backend stands in."""
        if self.strict:
            raise Unsupported(reason) from err
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"gradfx: {reason}; running the graph on the eager backend", FallbackWarning,
                          stacklevel=6)

    def _run(self, entry: CompiledBackward, call: BackwardCall, keep_graph: bool):
        inputs = call.inputs
        if entry.size_positions:
            sizes = call.sizes
            inputs = [sizes[p] for p in entry.size_positions] + inputs
        call.inputs = None  # the compiled graph becomes the only owner of its inputs
        owned = call.owned
        release_now = not keep_graph and entry.verified
        if release_now:
            # Traced nodes' saved tensors now live only in `inputs`, so the graph frees
            # each at its last use; opaque nodes still read theirs and are released after.
            late = entry.release_after
            for i, saved in enumerate(owned):
                if saved is not None and i not in late:
                    saved.release()
        task = hook_ops.graph_task(call.executed_ids, keep_graph) if entry.runs_python else contextlib.nullcontext()
        try:
            with torch.no_grad(), task, routing.running_backward():
                try:
                    out = _call_entry(entry, inputs)
                except backends.CompileFailedAtRun as failed:  # nothing ran: use the eager backend
                    err = failed.error
                    entry.failed = f"backend {self.backend_name!r} failed to compile ({type(err).__name__}: {err})"
                    self._backend_failed(entry.failed, err)
                    entry.fn = backends.compile_with(backends.builtin.eager, entry.captured.graph_module, [])
                    entry.boxed = getattr(entry.fn, "_boxed", None)
                    out = _call_entry(entry, inputs)
        except WrongGradient as err:
            raise RuntimeError(f"gradfx: the graph compiled by backend {self.backend_name!r} {err}; the backend "
                               "must return what the graph it was given computes") from err
        except Exception as err:
            explain.annotate_error(err, entry.captured.graph_module)
            raise
        entry.verified = True
        del inputs
        if not keep_graph:
            for i in (entry.release_after if release_now else range(len(owned))):
                if owned[i] is not None:
                    owned[i].release()
        return out


def _eager_refuses(tensors, inputs) -> bool:
    """Does the eager engine reject this call before computing anything?

    A root that neither requires grad nor has a grad_fn ("element 0 of tensors does
    not require grad and does not have a grad_fn"), or an input that does not
    require grad ("One of the differentiated Tensors does not require grad").
    """
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.grad_fn is None and not t.requires_grad:
            return True
    for t in inputs or ():
        if isinstance(t, torch.Tensor) and not t.requires_grad:
            return True
    return False


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _output_specs(graph: fx.Graph) -> list:
    """What each gradient an autograd.grad graph returns must look like.

    Per output: None (the traced graph returns None), or (shape with None for
    symbolic sizes, dtype, device, may be None at run time); shapes, dtypes and
    devices come from the traced metadata.  An opaque node or a hook may return
    None where tracing saw a tensor; an aten op or a graph input cannot.
    """
    specs = []
    for arg in graph.output_node().args[0]:
        if not isinstance(arg, fx.Node):
            specs.append(None)
            continue
        val = arg.meta.get("val")
        may_be_none = not (arg.op == "placeholder" or isinstance(arg.target, torch._ops.OpOverload))
        if isinstance(val, torch.Tensor):
            shape = tuple(s if type(s) is int else None for s in val.shape)
            specs.append((shape, val.dtype, val.device, may_be_none))
        else:
            specs.append((None, None, None, may_be_none))  # compared with the input itself
    return specs


def _check_outputs(results, specs: list, inputs, backend: str) -> None:
    """Refuse gradients a backend's compiled graph returned unlike the traced ones.

    Never repaired: a wrong shape or dtype means the backend computed something
    else than the graph it was given.
    """
    def fail(what):
        raise RuntimeError(f"gradfx: the graph compiled by backend {backend!r} {what}; "
                           "the backend must return what the graph it was given returns")
    if not isinstance(results, (tuple, list)) or len(results) != len(specs):
        fail(f"returned {_short(results)} instead of a tuple of {len(specs)} gradients")
    for k, (got, spec, inp) in enumerate(zip(results, specs, inputs)):
        if spec is None:
            if got is not None:
                fail(f"returned a {type(got).__name__} for input {k} of torch.autograd.grad, where the "
                     "traced graph returns None")
            continue
        shape, dtype, device, may_be_none = spec
        if got is None:
            if may_be_none:
                continue
            fail(f"returned None for input {k} of torch.autograd.grad, where the traced graph returns a tensor")
        if not isinstance(got, torch.Tensor):
            fail(f"returned a {type(got).__name__} for input {k} of torch.autograd.grad, not a tensor")
        if shape is None:  # no traced metadata: a gradient has its input's
            shape, dtype, device = tuple(inp.shape), inp.dtype, inp.device
        elif None in shape:  # symbolic sizes: the gradient's sizes are its input's
            shape = tuple(inp.shape) if inp.dim() == len(shape) else shape
        if (got.dim() != len(shape) or any(s is not None and s != g for s, g in zip(shape, got.shape))
                or got.dtype != dtype or got.device != device):
            expected = [("?" if s is None else s) for s in shape]
            fail(f"returned a gradient {list(got.shape)} ({got.dtype}, {got.device}) for input {k} of "
                 f"torch.autograd.grad; the traced graph returns {expected} ({dtype}, {device})")


def _call_entry(entry: CompiledBackward, inputs: list):
    if entry.boxed is not None:
        return entry.boxed(inputs)
    out = entry.fn(*inputs)
    inputs.clear()
    return out
