"""The ``compiled_autograd`` context manager and the path of one backward call.

While a block is active on a thread, every backward API call made on that thread
reaches :meth:`Session.run_backward` (see ``routing``).  There the call is walked
(``walk``), looked up in the cache, traced and compiled on a miss (``tracer``,
``gradfx.reorder``, ``gradfx.backends``), and run.  Anything that cannot be
captured runs on the eager engine instead, with one warning per block and reason.
"""

from __future__ import annotations

import logging
import sys
import time
import warnings

import torch
import torch.fx as fx
from torch.utils._python_dispatch import _disable_current_modes
from torch._C._functorch import is_functorch_wrapped_tensor as _is_functorch_wrapped
from torch._C._functorch import is_legacy_batchedtensor as _is_legacy_batched

from ... import backends, reorder
from ...backends.identity import Key, callable_key
from .. import logs, native, pipeline, torch_releases
from ..view import annotate
from ..graph import distributed, fast_walk, subclasses
from . import continuation, routing, self_check
from ..runtime import counters, ddp_agreement, ddp_buckets, hook_ops
from .cache import Assumed, cache
from ..view.captured_graph import CapturedGraph
from ..errors import FallbackWarning, Unsupported, _Fallback
from ..runtime.runtime_ops import Diverged, UnpackedOtherwise, WrongGradient
from ..stacklevel import user_stacklevel
from ..graph.saved import ForeignHooks, left_to_node
from ..graph.unpacked import Learner
from ..view import explain
from ..graph.kinds import OPAQUE
from ..graph.walk import BackwardCall, walk_backward

_dispatch_stack_len = torch._C._len_torch_dispatch_stack

_plain_call = None  # the compiled part's plain_call, once it has loaded


def _bind_native(module) -> None:
    global _plain_call
    _plain_call = getattr(module, "plain_call", None)


native.when_loaded(_bind_native)

log = logging.getLogger("gradfx")


def check_dynamic(dynamic) -> None:
    # `in` would take 1 and 0 for True and False (and then treat them as "auto").
    if not (dynamic is True or dynamic is False or (type(dynamic) is str and dynamic == "auto")):
        raise ValueError(f"dynamic must be 'auto', True or False, got {dynamic!r}")


def unused_input_message(index: int) -> str:
    """torch.autograd.grad's error (in this release's words) for an input nothing depends on."""
    which = f"The differentiated Tensor at index {index}" if torch_releases.UNUSED_INPUT_ERROR_NAMES_INDEX \
        else "One of the differentiated Tensors"
    return f"{which} appears to not have been used in the graph. Set allow_unused=True if this is the desired behavior."


# Reasons that hold for the whole process (the self-check's) are warned once in it.
_warned_in_process: set = set()

# A structure's walker goes with its last cached graph.
cache.on_forget.append(fast_walk.walkers.forget)


def reset() -> None:
    """Clear every cache and counter (registered backends stay)."""
    cache.clear()
    fast_walk.walkers.clear()
    counters.clear()


class CompiledBackward:
    """A cache entry: the compiled callable plus what running it needs."""

    __slots__ = ("fn", "boxed", "captured", "release_after", "runs_python", "guard", "size_positions",
                 "verified", "failed", "output_specs", "frontiers", "stopped", "kept", "key", "node_inputs", "release_split",
                 "learner", "in_engine_task", "handshake")

    def __init__(self, fn, captured: CapturedGraph, release_after: frozenset, runs_python: bool,
                 guard, size_positions=(), failed=None, output_specs=None, frontiers=()):
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
        # Where the graph may stop (a traced gradient None at run time) and the rest of the
        # backward runs node by node (run.continuation).
        self.frontiers = frontiers
        self.stopped: set = set()  # frontiers where a backward stopped (logged once each)
        self.kept = None  # where frontiers: continuation.Positions (set by the capture)
        self.key = None  # its cache key (set by the capture)
        # (input position, node index) of the node objects the graph reads: a one-call
        # walk leaves the others None (set by the capture).
        self.node_inputs = ()
        # (owner places, released before the graph, after it) for a walker's calls
        self.release_split = None
        # Where its unpacks of saved tensors under the user's hooks report what they found
        # (graph.unpacked; None: a graph that unpacks none itself).
        self.learner = None
        # What the ranks exchange before a run that calls DDP's Python-reducer hook
        # (runtime.ddp_agreement; None: the graph calls none).
        self.handshake = None
        # It calls C++ post-hooks (DDP's reducer), which queue final callbacks with the
        # engine: it runs inside an engine graph task (routing.in_engine_task).
        self.in_engine_task = False


class _Config:
    """What a block's backend, passes and dynamic mode resolve to, and its cache keys: one
    for its backwards, one for its create_graph backwards (which trace and run otherwise:
    grad mode on)."""

    __slots__ = ("backend_name", "backend_fn", "passes", "key", "key_with_history", "trusted", "plain_graph",
                 "registries")

    def __init__(self, backend, passes, dynamic):
        self.backend_name, self.backend_fn = backends.lookup(backend)
        self.passes = tuple(reorder.resolve(passes))  # shared by the blocks of a _Config
        # Backend and passes by what they are (backends.identity): a lambda written in the
        # training loop is the same backend each step, and a registered name means the
        # function registered now.  `strict` is not in the key: it changes nothing for a
        # graph that compiled, and a graph whose backend failed is marked
        # (CompiledBackward.failed).
        self.key = Key((callable_key(self.backend_fn), tuple(callable_key(fn) for _, fn in self.passes), dynamic))
        self.key_with_history = Key((self.key, "create_graph"))
        # Code generated by gradfx's eager backend needs no checks of its outputs.
        self.trusted = self.backend_fn is backends.builtin.eager
        # gradfx's own backends run the graph as captured: a custom Function's backward
        # runs with its ctx, which keeps its saved tensors (identity, as in eager).
        self.plain_graph = getattr(self.backend_fn, "_gradfx_plain_graph", False)
        self.registries = (backends.changes(), reorder.changes())


def _configure(backend, passes, dynamic) -> _Config:
    """A block's configuration.  Blocks of a registered backend with the default passes,
    opened for every backward of a training loop, reuse theirs while neither registry
    has changed since."""
    if type(backend) is not str or passes is not None:
        return _Config(backend, passes, dynamic)
    config = _named_configs.get((backend, dynamic))
    if config is None or config.registries != (backends.changes(), reorder.changes()):
        config = _named_configs[(backend, dynamic)] = _Config(backend, passes, dynamic)
    return config


# (backend name, dynamic) -> _Config; a handful of entries
_named_configs: dict = {}


class Session:
    """State of one ``with gradfx.compiled_autograd(...)`` block."""

    def __init__(self, backend="eager", *, dynamic="auto", strict=False, passes=None, names=None):
        self.names = annotate.Names(names) if names is not None else None  # display only: never keyed
        if not (type(dynamic) is str and dynamic == "auto"):
            check_dynamic(dynamic)  # before the lookup: 1 and True are the same dict key
        if type(strict) is not bool:  # strict="no" must not mean True
            raise TypeError(f"strict must be True or False, got {type(strict).__name__} ({strict!r})")
        self._config = _configure(backend, passes, dynamic)
        self.dynamic = dynamic
        self.strict = strict
        self.graphs: list[CapturedGraph] = []
        self.stats = dict.fromkeys(counters.COUNTERS, 0)
        self._warned: set[str] = set()

    backend_name = property(lambda self: self._config.backend_name)
    backend_fn = property(lambda self: self._config.backend_fn)
    passes = property(lambda self: self._config.passes)

    # -- context manager -----------------------------------------------------
    def __enter__(self) -> "Session":
        routing.enter(self)
        return self

    def __exit__(self, *exc) -> None:
        routing.leave(self)

    def _count(self, name: str) -> None:
        self.stats[name] += 1
        counters.totals[name] += 1

    # -- one backward call ---------------------------------------------------
    def run_backward(self, engine, tensors, grad_tensors, keep_graph, create_graph,
                     inputs=(), allow_unreachable=True, accumulate_grad=True):
        args = (tensors, grad_tensors, keep_graph, create_graph, inputs, allow_unreachable, accumulate_grad)
        # The compiled part's one check passes what every check below would (a user's call
        # of plain tensors, the common case); the Python checks decide the rest.
        plain = _plain_call is not None and _plain_call(tensors, grad_tensors, inputs)
        if not plain:
            if routing.torch_internal(tensors):
                return engine.run_backward(*args)  # torch's own: straight to the engine, uncounted
            if _eager_refuses(tensors, inputs):
                # Eager raises for this call before computing anything: let it, in its own
                # words.  Nothing ran, so nothing is counted and nothing is warned.
                return engine.run_backward(*args)
        try:
            if not plain and _dispatch_stack_len():
                # The user's dispatch modes (FlopCounterMode, ...) see the backward's
                # compute, as in eager; not gradfx's walk, tracing and compiling.
                with _disable_current_modes():
                    entry, call = self._prepare(tensors, grad_tensors, inputs, accumulate_grad, create_graph,
                                                engine, False)
            else:
                entry, call = self._prepare(tensors, grad_tensors, inputs, accumulate_grad, create_graph, engine,
                                            plain)
        except _Fallback as fb:
            return self._fallback(engine, args, fb.reason, fb.process_wide)
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

    def _prepare(self, tensors, grad_tensors, inputs, accumulate_grad, create_graph, engine, plain):
        """Walk the graph and find (or capture) its compiled backward: (entry, call).
        Raises _Fallback for what gradfx does not capture.  ``plain``: the roots, inputs and
        gradients are known to pass the type and batching checks."""
        if self_check.verdict != "":  # "": the self-check passed (read here, the common case)
            refused = self_check.refusal()
            if refused is not None:
                raise _Fallback(refused, process_wide=True)
        if torch.is_anomaly_enabled():
            raise _Fallback("anomaly detection is enabled")
        if not plain:
            _check_call(tensors, grad_tensors, inputs)
        if create_graph and accumulate_grad:
            _warn_like_eager_once(engine)
        config = self._config.key if not create_graph else self._config.key_with_history
        call = None
        # The generated walker of a known structure, if one accepts this graph.
        for walker in fast_walk.walkers.find((type(tensors[0].grad_fn), config)) or ():
            try:
                found = walker(tensors, grad_tensors, inputs or (), accumulate_grad)
            except ForeignHooks:  # saved tensors now under the user's hooks
                break
            if found is not None:
                call, structure = fast_walk.instantiate(walker.template, *found), walker.structure
                break
        if call is None:
            call = walk_backward(tensors, grad_tensors, inputs, accumulate_grad, create_graph,
                                 take_functions=not self._config.plain_graph)
            structure = (call.key, config)
        key = cache.key(structure) if cache.assumes else structure  # cache.key, its common case inline
        entry = cache.lookup(key, call.sizes)
        if entry is None:
            if type(call.nodes) is not list or any(left_to_node(o) for o in call.owned):
                # The walker left the saved tensors to their nodes, or made the nodes' objects
                # only for what asks (a one-call walk); tracing needs gradfx's own owners
                # (fakes are substituted through them) and every node: the generic walk.
                call = walk_backward(tensors, grad_tensors, inputs, accumulate_grad, create_graph,
                                     take_functions=not self._config.plain_graph)
            entry = self._capture(call, key, tensors, () if accumulate_grad else inputs)
            self._count("captures")
        else:
            if entry.failed is not None:  # before anything is released
                self._backend_failed(entry.failed, None)
            self.stats["cache_hits"] += 1  # _count, inline
            counters.totals["cache_hits"] += 1
        return entry, call

    def _fallback(self, engine, args, reason: str, process_wide: bool = False):
        if self.strict:
            raise Unsupported(reason)
        warned = _warned_in_process if process_wide else self._warned
        if reason not in warned:
            warned.add(reason)
            warnings.warn(f"gradfx: running this backward on the eager engine: {reason}",
                          FallbackWarning, stacklevel=user_stacklevel())
        self._count("fallbacks")
        tensors, _, _, _, inputs, _, accumulate_grad = args
        said = ddp_agreement.before_eager_engine(tensors, inputs, accumulate_grad)  # what the other ranks wait for
        try:
            return routing.run_on_engine(engine, *args)  # a backward inside it runs on the engine too
        finally:
            if said is not None:
                said.settle()

    def _capture(self, call: BackwardCall, structure, tensors, grad_inputs=()) -> CompiledBackward:
        """Capture and compile ``call``; ``structure`` is its cache key (an Assumed key for
        a graph traced with the gradients its last stop found None as None)."""
        recapture = cache.known(structure)
        base = structure.base if isinstance(structure, Assumed) else structure
        assumed = structure.none if isinstance(structure, Assumed) else frozenset()
        unpacked = dict(structure.unpacked) if isinstance(structure, Assumed) else {}
        if assumed and not recapture:
            log.info("gradfx: capturing again with %d gradients from opaque calls as None, as the last "
                     "backward found them", len(assumed))
        elif unpacked and not recapture:
            log.info("gradfx: capturing again with the saved tensors of %d nodes laid out as their "
                     "saved_tensors_hooks unpacked them", len(unpacked))
        elif recapture:
            self._count("recaptures")
            if log.isEnabledFor(logging.INFO):
                failed = "; ".join(f"guard {e.guard.failing(call.sizes)}" for e in cache.entries(structure)[:2])
                log.info("gradfx: recapture: %s; %s", failed or "no graph",
                         explain.size_change(call, cache.last_sizes[structure], dynamic=self.dynamic,
                                             symbolic=cache.dynamic_positions.get(structure, ())))
        else:
            explain.log_structure_miss(call)
        warm_up = getattr(self._config.backend_fn, "_gradfx_warm_up", None)
        if warm_up is not None:  # the backend's process set-up, on a thread, while the capture runs
            warm_up()
        learner = Learner(base, unpacked, cache.learn)
        made = pipeline.capture_call(call, self._dynamic_positions(call, structure), self.passes,
                                     names=self.names, grad_inputs=grad_inputs, assumed_none=assumed,
                                     learner=learner,
                                     compile=self._compile_with_history if call.create_graph else self._compile)
        captured, guard = made.graph, made.guard
        compiled, failed = made.compiled
        _say_subclassed(call)
        # Nodes run as themselves, and those traced through a tensor subclass (the graph
        # reads their saved values from them), keep their saved tensors until they run.
        release_after = frozenset(i for i, k in enumerate(call.kinds) if k is OPAQUE or call.records[i].subclass)
        self.graphs.append(captured)
        specs = None
        if call.outputs is not None and (failed is None and not self._config.trusted):
            specs = _output_specs(captured.graph_module.graph)
        entry = CompiledBackward(compiled, captured, release_after, bool(call.hooks or release_after),
                                 guard, made.size_positions, failed, specs, made.frontiers)
        if made.frontiers:
            entry.kept = continuation.Positions(call, captured.graph_module.graph, len(made.size_positions),
                                                release_after)
        entry.node_inputs = _node_inputs(call, captured.graph_module.graph, len(made.size_positions),
                                         everyone=bool(made.frontiers))
        if made.dynamic_positions:
            cache.dynamic_positions[structure] = made.dynamic_positions
        entry.key = structure
        entry.learner = learner if made.unpacks else None
        entry.in_engine_task = any(spec.native_post for spec in call.hooks.values())
        if call.hooks and distributed.initialized():
            # A compiler given the traced form gets DDP's hooks as they are, not the buckets.
            bucketed = backends.gets_captured_graph(self._config.backend_fn, call.create_graph)
            entry.handshake = ddp_agreement.handshake_of(captured.graph_module.graph, len(made.size_positions),
                                                         call.inputs, ddp_buckets.open_buckets if bucketed else None)
        cache.put(structure, call.sizes, entry, dynamic=bool(made.size_positions))
        self._add_fast_walker(call, base, tensors)
        return entry

    def _add_fast_walker(self, call, structure, tensors) -> None:
        root_type = type(call.nodes[0])
        config = structure[1]
        if any(w.structure == structure for w in fast_walk.walkers.candidates(root_type, config)):
            return  # a recapture of a known structure (new sizes): its walker still fits
        try:
            walker = fast_walk.generate(call, tensors, structure)
        except Exception:  # a walker is an optimization; the generic walk always works
            log.debug("gradfx: no fast walker", exc_info=True)
            return
        if walker is not None:
            fast_walk.walkers.add(root_type, config, walker)

    def _dynamic_positions(self, call: BackwardCall, structure) -> dict:
        """position -> symbol group, for the sizes this capture makes symbolic."""
        if self.dynamic is False:
            return {}
        from ..trace.shapes import baked_positions, changed_positions, dynamic_candidates
        from ..trace.size_relations import relate
        previous = cache.last_sizes.get(structure)
        if self.dynamic is not True and previous is None:
            return {}
        wanted = cache.dynamic_positions.get(structure, set())
        if previous is not None:  # sizes that changed, a parameter's under dynamic=True as well
            wanted = wanted | changed_positions(previous, call.sizes, call)
        # Under "auto", the first size change makes symbolic what dynamic=True would as
        # well: a batch change then also covers the next sequence length.  What stays
        # free after size_relations is the data's sizes (widths are a parameter's), and
        # the trace costs about what a recapture of the changed sizes alone did.
        wanted = wanted | dynamic_candidates(call)
        # A size of 0 or 1 stays static (broadcasting), even where an earlier graph had a symbol.
        wanted = {p for p in wanted if call.sizes[p] >= 2}
        positions = wanted - baked_positions(call)
        try:
            return relate(call, positions, previous)
        except Exception:  # relations only spare the trace work: without them, a symbol each
            log.debug("gradfx: size relations failed", exc_info=True)
            return {p: p for p in positions}

    def _compile(self, gm: fx.GraphModule, example_inputs: list, plain: bool = False):
        """(compiled callable, None), or (eager stand-in, reason) if the backend failed.

        A compile function that raises or returns something not callable fails here,
        before the backward runs and releases anything: in strict mode the autograd
        graph is left as it was, so an eager backward of it still works.
        """
        start = time.perf_counter()
        self._count("compiles")
        failed = None
        if self.backend_fn is not backends.builtin.eager:
            logs.backend_compiling(self.backend_name, len(gm.graph.nodes))
        try:
            compiled = backends.compile_with(self.backend_fn, gm, example_inputs, plain)
            if not callable(compiled):
                raise TypeError(f"it returned {type(compiled).__name__} ({_short(compiled)}), not a callable")
        except Exception as err:
            failed = self._failure(err)
            self._backend_failed(failed, err)
            self._count("uncompiled")
            compiled = backends.compile_with(backends.builtin.eager, gm, example_inputs)
        logs.backend_compiled(self.backend_name, len(gm.graph.nodes), time.perf_counter() - start, failed)
        return compiled, failed

    def _compile_with_history(self, gm: fx.GraphModule, example_inputs: list):
        """A create_graph graph goes to the block's backend as captured (the form the eager
        backend runs: gradfx's runtime calls accumulate and call custom backwards with grad
        mode on); the backend's code must record autograd history, for the backward
        through the gradients it returns.

        gradfx's own inductor and aot_eager build inference code (and AOTAutograd's
        training path would hide the history behind one node that has no backward of its
        own: a third order fails), so their create_graph graphs run on the eager backend,
        said once per block.
        """
        if not _builds_inference_code(self.backend_fn):
            return self._compile(gm, example_inputs, plain=True)
        self._count("compiles")
        if "create_graph" not in self._warned:
            self._warned.add("create_graph")
            log.info("gradfx: create_graph backwards run on the eager backend (backend %s builds code "
                     "without autograd history)", self.backend_name)
        return backends.compile_with(backends.builtin.eager, gm, example_inputs), None

    def _backend_failed(self, reason: str, err) -> None:
        """Strict: raise Unsupported.  Otherwise warn (once per block) that the eager
        backend stands in.  The whole error goes to the log at DEBUG."""
        if err is not None:
            log.debug("gradfx: %s", reason, exc_info=err)
        if self.strict:
            raise Unsupported(reason) from err
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"gradfx: {reason}; running the graph on the eager backend", FallbackWarning,
                          stacklevel=user_stacklevel())

    def _call_graph(self, entry: CompiledBackward, call: BackwardCall, inputs: list, keep_graph: bool, kept):
        # One frame on the way to the graph, for a cached backward's sake: what the two
        # exceptions need is in the methods below.
        try:
            try:
                if entry.boxed is not None:
                    return entry.boxed(inputs)
                return _call_entry(entry, inputs)
            except backends.CompileFailedAtRun as failed:  # nothing ran: the eager backend runs it
                return self._run_uncompiled(entry, inputs, failed.error)
        except Diverged as stop:
            return self._finish_stopped(entry, call, stop, keep_graph, kept)

    def _run_uncompiled(self, entry: CompiledBackward, inputs: list, err: BaseException):
        entry.failed = self._failure(err)
        self._backend_failed(entry.failed, err)
        self._count("uncompiled")
        entry.fn = backends.compile_with(backends.builtin.eager, entry.captured.graph_module, [])
        entry.boxed = getattr(entry.fn, "_boxed", None)
        return _call_entry(entry, inputs)

    def _finish_stopped(self, entry: CompiledBackward, call: BackwardCall, stop: Diverged, keep_graph: bool, kept):
        """The graph stopped (a traced gradient None at run time): the rest runs node by node."""
        frontier = entry.frontiers[stop.frontier]
        if entry.handshake is not None:
            agreement = ddp_buckets.starting.agreement
            if agreement is not None:  # the rest calls DDP's hook itself: the other ranks are told
                agreement.turn_away()
        # Once per graph and place at INFO: a backward that stops each time runs
        # its rest at Python speed.
        level = logging.DEBUG if stop.frontier in entry.stopped else logging.INFO
        entry.stopped.add(stop.frontier)
        if isinstance(stop, UnpackedOtherwise):
            log.log(level, "gradfx: the saved_tensors_hooks of %s unpacked tensors laid out otherwise than the "
                    "graph was traced for; the rest of this backward runs node by node",
                    call.node_label(frontier.node))
        else:
            log.log(level, "gradfx: %s gets None or a tensor subclass where the graph traced a plain "
                    "gradient, or a gradient where it traced None; the rest of this backward runs node by node",
                    call.node_label(frontier.node))
        out = continuation.finish(call, frontier, stop, keep_graph, kept, entry.learner)
        # The next backward of this structure takes (or captures) the graph traced
        # with what this one found.
        cache.stopped(entry.key, frontier.node, frontier.checked,
                      frozenset(k for k in frontier.checked if stop.grads[k] is None))
        return out

    def _failure(self, err: BaseException) -> str:
        """What a warning says of a backend that failed: the error's first line (dynamo's
        go on with links and advice that belong in the log)."""
        def first_line(e):
            lines = [line for line in str(e).splitlines() if line.strip()]
            return f"{type(e).__name__}: {lines[0] if lines else ''}"
        root, seen = err, {id(err)}
        while root.__context__ is not None and id(root.__context__) not in seen:  # what dynamo wraps
            root = root.__context__
            seen.add(id(root))
        why = first_line(err) + ("" if root is err else f", from {first_line(root)}")
        return f"backend {self.backend_name!r} failed to compile ({why})"

    def _run(self, entry: CompiledBackward, call: BackwardCall, keep_graph: bool):
        inputs = call.inputs
        if entry.node_inputs and type(call.nodes) is not list:  # a one-call walk's: made when asked for
            nodes = call.nodes
            for pos, i in entry.node_inputs:
                inputs[pos] = nodes[i]
        # Where the graph may stop, the rest of the backward needs what the graph held.
        kept = continuation.Kept(inputs, entry.kept) if entry.frontiers else None
        if entry.handshake is not None:  # sent before the graph runs, answered by its first all-reduce
            outer = getattr(ddp_buckets.starting, "agreement", None)  # a backward's, this one inside it
            ddp_buckets.starting.agreement = entry.handshake.start(inputs)
        if entry.size_positions:
            sizes = call.sizes
            inputs = [sizes[p] for p in entry.size_positions] + inputs
        call.inputs = None  # the compiled graph becomes the only owner of its inputs
        owned = call.owned
        release_now = not keep_graph and entry.verified
        held = call.owner_indices
        if held is None:
            held = [i for i, saved in enumerate(owned) if saved is not None]
        early, late = (), held
        if release_now:
            # Traced nodes' saved tensors now live only in `inputs`, so the graph frees
            # each at its last use; opaque nodes still read theirs and are released after.
            # Where the graph may stop, the nodes run after it get theirs back from what
            # the graph still holds (run.continuation: a released owner refilled, a node
            # left its tensors (HeldByNode) run with them); a graph that records history
            # leaves those to their nodes.
            split = entry.release_split
            if split is not None and split[0] is held:  # a walker's calls share their owners' places
                early, late = split[1], split[2]
            else:
                after = entry.release_after
                keep = entry.frontiers and call.create_graph
                early = [i for i in held if i not in after and not (keep and left_to_node(owned[i]))]
                now = set(early)
                late = [i for i in held if i not in now]
                if not keep and type(held) is tuple:
                    entry.release_split = (held, early, late)
            for i in early:
                owned[i].release()
            if kept is not None:
                kept.released = early
        task = hook_ops.graph_task(call.executed_ids, keep_graph, call.outputs is None, _grad_inputs(call)) \
            if entry.runs_python else None
        # The engine's grad mode for a backward: on only when it records history.  Set and
        # restored by hand, as the context managers around it are: a cached backward's
        # Python is cold, and each frame of it costs.
        grad_mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(call.create_graph)
        callbacks = routing.begin_backward()
        try:
            if task is None:
                out = self._call_graph(entry, call, inputs, keep_graph, kept)
                if callbacks:
                    routing.run_callbacks(callbacks)
            else:
                with task:
                    if entry.in_engine_task:
                        out = routing.in_engine_task(self._call_graph, (entry, call, inputs, keep_graph, kept),
                                                     call.create_graph)
                    else:
                        out = self._call_graph(entry, call, inputs, keep_graph, kept)
                    if callbacks:
                        routing.run_callbacks(callbacks)
        except WrongGradient as err:
            raise RuntimeError(f"gradfx: the graph compiled by backend {self.backend_name!r} {err}; the backend "
                               "must return what the graph it was given computes") from err
        except Exception as err:
            explain.annotate_error(err, entry.captured.graph_module, self.backend_name)
            raise
        finally:
            routing.end_backward()
            torch._C._set_grad_enabled(grad_mode)
            if entry.handshake is not None:
                agreement, ddp_buckets.starting.agreement = ddp_buckets.starting.agreement, outer
                if agreement is not None:
                    agreement.settle()  # what this rank sent, where no all-reduce waited for it
        entry.verified = True
        del inputs
        if not keep_graph:
            for i in late:
                owned[i].release()
        return out


def _say_subclassed(call: BackwardCall) -> None:
    """One INFO line per capture: the nodes a tensor subclass reached that run as themselves
    (the rest were traced through it)."""
    reached = [i for i, rec in enumerate(call.records) if rec.subclass]
    opaque = [i for i in reached if call.kinds[i] is OPAQUE]
    if opaque:
        log.info("gradfx: %d of the %d nodes a tensor subclass reaches run as themselves (%s): %s", len(opaque),
                 len(reached), "; ".join(sorted({call.records[i].subclass for i in opaque})),
                 ", ".join(call.node_label(i) for i in opaque[:8]) + (", ..." if len(opaque) > 8 else ""))
    elif reached:
        log.info("gradfx: the %d nodes a tensor subclass reaches are traced through it", len(reached))


def _node_inputs(call: BackwardCall, graph: fx.Graph, sizes: int, everyone: bool) -> tuple:
    """(input position, node index) per node object among the graph's inputs that the graph
    reads (``everyone``: all of them, for a continuation that may run any node)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"][sizes:]
    return tuple((pos, call.input_owner[pos]) for pos, (ph, kind) in enumerate(zip(placeholders, call.input_kinds))
                 if kind == "node" and (everyone or ph.users))


def _builds_inference_code(backend_fn) -> bool:
    """Is this one of gradfx's built-in compiling backends (code without autograd history)?"""
    return any(backend_fn is backends.lookup(name)[1] for name in ("inductor", "aot_eager"))


def _grad_inputs(call: BackwardCall) -> frozenset | None:
    """For autograd.grad(): ids of the nodes of its inputs (see hook_ops.graph_task)."""
    if call.accumulate:
        return None
    return frozenset(id(call.nodes[out[0]]) for out in call.outputs if out is not None)


def _check_call(tensors, grad_tensors, inputs) -> None:
    """Raises _Fallback for roots, inputs or gradients gradfx does not capture."""
    # A root or input may be a subclass traced through (a DTensor loss or parameter): only
    # its edge is read.
    for t in (*tensors, *(inputs or ())):
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and not (
                isinstance(t, torch.Tensor) and subclasses.traceable(type(t))):
            _refuse_type(t)
    if any(g is None for g in grad_tensors):
        raise _Fallback("a root without a gradient")  # eager raises the error
    if any(_is_functorch_wrapped(g) or _is_legacy_batched(g) for g in grad_tensors):
        raise _Fallback("batched gradients (autograd.grad with is_grads_batched=True, or vmap)")


def _refuse_type(t) -> None:
    """A root or input that is neither a plain tensor nor a parameter: why it falls back."""
    if not isinstance(t, torch.Tensor):
        raise _Fallback(f"a GradientEdge ({type(t).__name__}) as root or input")
    raise _Fallback(f"a tensor subclass ({type(t).__name__})")


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


_CREATE_GRAPH_WARNED = [False]


def _warn_like_eager_once(engine) -> None:
    """Eager's one-time warning for ``backward(create_graph=True)``, given as eager gives it.

    It is a C++ once-per-process warning: a tiny real backward uses up torch's own
    flag (so the eager engine stays silent later) and its text is warned once here,
    from the frame eager's warning names (torch.autograd.graph._engine_run_backward);
    every time with ``torch.set_warn_always(True)``, as torch's.
    """
    if _CREATE_GRAPH_WARNED[0] and not torch.is_warn_always_enabled():
        return
    _CREATE_GRAPH_WARNED[0] = True
    leaf = torch.zeros((), requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.run_backward((leaf * 1.0,), (torch.ones(()),), False, True, (), True, True)
    for w in caught:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != "_engine_run_backward":
            frame = frame.f_back
        if frame is None:
            warnings.warn(w.message, w.category, stacklevel=3)
        else:
            warnings.warn_explicit(w.message, w.category, frame.f_code.co_filename, frame.f_lineno,
                                   module=frame.f_globals.get("__name__"),
                                   registry=frame.f_globals.setdefault("__warningregistry__", {}))


def _call_entry(entry: CompiledBackward, inputs: list):
    if entry.boxed is not None:
        return entry.boxed(inputs)
    out = entry.fn(*inputs)
    inputs.clear()
    return out


self_check.block_type = Session  # the block its probes run in
