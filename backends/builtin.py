"""The built-in backends: eager, aot_eager, inductor, debug."""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import os
import platform
import sys
import threading
import time
import warnings

import torch
import torch.fx as fx
from torch.fx.graph import _BoxedCodeGen

from ..capture.errors import FallbackWarning
from ..capture.stacklevel import user_stacklevel
from ..capture.runtime import counters, ddp_buckets, hook_ops
from ..capture.runtime.runtime_ops import accumulate_grad, unchecked_accumulator
from ..reorder.memory import frees_inputs_early
from . import bindings
from .registry import register_backend, takes_plain_graph
from .split import MIN_OPS, aten_work, partition, runner

log = logging.getLogger("gradfx")


@register_backend("eager")
@takes_plain_graph
def eager(gm: fx.GraphModule, example_inputs: list):
    """Run the graph as generated Python.

    After the ``free_inputs_early`` pass the graph takes one list and frees each
    input at its last use, as the eager engine frees saved tensors node by node;
    without it, the inputs live until the graph returns.

    The code runs on a private copy of the graph that accumulates with
    ``accumulate_grad_unchecked`` (in C++ where gradfx's compiled part is loaded): this
    code is generated from the traced graph,
    so its gradients have their leaves' metadata by construction, and the check
    that other backends' code gets would only cost time on every backward.  It runs
    a node's C++ post-hooks (DDP's reducer) through the compiled part's C function
    directly, without the Python one around it, and so the Python reducer's bucketed hook
    calls (``ddp_buckets.ready``).  The
    copy calls each aten overload's own C function rather than its Python
    ``OpOverload`` wrapper (the same kernel, one Python frame less per op), or torch's
    public binding where that runs the same overload, with ``__torch_function__`` off:
    where the graph calls other code, that code gets the thread's own torch-function
    state back for each call (``bindings``).
    """
    graph = copy.deepcopy(gm.graph)
    # A graph of aten ops and accumulations alone runs without __torch_function__ (as
    # eager's engine computes), so its ops may take torch's public bindings (bindings).
    # So does a graph that calls other code, where each such call gets the user's
    # torch-function state back (bindings.as_user).
    plain = bindings.plain(graph)
    apart = not plain and bindings.user_calls_apart(graph)
    accumulate = unchecked_accumulator()
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        target = node.target
        if target is accumulate_grad:
            node.target = accumulate
            continue
        if target is hook_ops.call_node_post_hooks:
            target = hook_ops.node_post_hooks_native()
        elif target is ddp_buckets.ready:
            target = ddp_buckets.ready_native()
        if isinstance(target, torch._ops.OpOverload):
            fast = bindings.fastest(node) if plain or apart else None
            target = fast if fast is not None else bindings.direct(target)
        elif apart and not bindings.is_plain_call(target):
            target = bindings.as_user(target)
        node.target = target
    boxed = frees_inputs_early(gm.graph)
    if boxed:
        graph.set_codegen(_DropsUnusedInputs(
            {n.name for n in graph.find_nodes(op="placeholder") if not n.users}))
    private = fx.GraphModule(gm, graph)
    forward = private.forward
    if plain or apart:
        forward = bindings.without_torch_function(forward)
    if not boxed:
        return forward

    def run(*args):
        return forward(list(args))
    run._boxed = forward
    return run


class _DropsUnusedInputs(_BoxedCodeGen):
    """Boxed code that does not bind the inputs nobody uses (the saved tensors of a node
    run opaquely), so they are freed with the list, not when the graph returns."""

    def __init__(self, unused: set):
        super().__init__()
        self.unused = unused

    def gen_fn_def(self, free_vars, maybe_return_annotation, **kwargs):
        lines = super().gen_fn_def(free_vars, maybe_return_annotation, **kwargs).split("\n")
        for k, line in enumerate(lines):
            name, bound, _ = line.strip().partition(" = next(args_iter)")
            if bound and name in self.unused:
                lines[k] = "    next(args_iter)"
        return "\n".join(lines)


def _functionalized(pure: fx.GraphModule, example_inputs: list) -> fx.GraphModule:
    """The region without mutations, in inductor's decompositions, traced on
    ``example_inputs`` (real tensors, or :func:`_symbolic_fakes` for code of all sizes)."""
    # Views stay views: a region's outputs keep eager's layouts, which the regions after
    # it were compiled for and which accumulate_grad's steal needs.
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx
    functional = make_fx(torch.func.functionalize(pure, remove="mutations"), decomposition_table=select_decomp_table(),
                         tracing_mode="fake")(*example_inputs)
    # make_fx keeps a shape environment on the module, which inductor's FX graph cache
    # cannot pickle into a key (it bypasses the cache).  Inductor finds it where this says
    # None: on the inputs' fakes.
    functional.shape_env = None
    return functional


def _symbolic_fakes(pure: fx.GraphModule, example_inputs: list) -> tuple:
    """(fakes of the region's inputs, their fake mode), in a shape environment of their own: a size is a symbol
    where the captured graph's is one (its placeholders' values say), an int input too;
    every other size stays the int it is (a model's widths: static code, fewer guards).
    Each symbol is fresh: two sizes equal here only by chance (a sequence length and a
    head dimension, both 32) do not become one, which the next length would break."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext
    shape_env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=shape_env)
    fakes = []
    for k, (node, x) in enumerate(zip(pure.graph.find_nodes(op="placeholder"), example_inputs)):
        val = node.meta.get("val")
        source = ConstantSource(f"gradfx_input_{k}")
        if isinstance(x, torch.Tensor):
            symbolic = [isinstance(v, torch.SymInt) for v in val.shape] if isinstance(val, torch.Tensor) \
                else [False] * x.dim()
            context = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if s else DimDynamic.STATIC for s in symbolic])
            fakes.append(mode.from_tensor(x, source=source, symbolic_context=context))
        elif isinstance(x, int) and isinstance(val, torch.SymInt):
            fakes.append(shape_env.create_symintnode(
                shape_env.create_symbol(x, source, dynamic_dim=DimDynamic.DYNAMIC), hint=x, source=source))
        else:
            fakes.append(x)
    return fakes, mode


def _guard(fakes: list, mode):
    """``holds(inputs) -> bool``: do the guards of the shape environment of these
    :func:`_symbolic_fakes`, which the region was traced and compiled in, hold for these
    inputs (sizes, strides, ints; the static sizes too: the code assumed them)?"""
    shape_env = mode.shape_env
    code = shape_env.produce_guards_expression(fakes, ignore_static=False)
    if not code:
        return lambda inputs: True
    return lambda inputs: shape_env.evaluate_guards_expression(code, inputs)


def _split_backend(name: str, compile_region):
    """A backend that compiles each pure region of a graph with
    ``compile_region(region_gm, example_inputs)`` and runs the rest as Python
    (:mod:`.split`)."""
    def backend(gm: fx.GraphModule, example_inputs: list):
        pieces = partition(gm.graph)
        if any(compiled for compiled, _ in pieces):
            return runner(gm, pieces, compile_region, example_inputs, eager, name)
        if any(map(aten_work, gm.graph.nodes)):  # else there is nothing to compile
            warnings.warn(f"gradfx: backend {name!r} runs a backward graph uncompiled (on the eager backend): its "
                          f"hooks, opaque calls or checks leave no run of {MIN_OPS} or more aten ops to compile",
                          FallbackWarning, stacklevel=user_stacklevel())
            counters.note("uncompiled")
        return eager(gm, example_inputs)
    backend.__name__ = name
    return takes_plain_graph(backend)


def _inductor_compile(pure: fx.GraphModule, example_inputs: list, dynamic: bool = False):
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    start = time.perf_counter()
    if dynamic:  # fakes of symbolic sizes, in their own shape environment: code for every size
        fakes, fake_mode = _symbolic_fakes(pure, example_inputs)
        functional = _functionalized(pure, fakes)
    else:
        functional = _functionalized(pure, example_inputs)
        # Inductor's FX graph cache keys a graph with the guards of its shape environment and
        # bypasses a compile that has none: a tracing context with one (static: every size
        # is an int here) lets a later process load the compiled region instead of compiling it.
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        fakes = [fake_mode.from_tensor(x, static_shapes=True) if isinstance(x, torch.Tensor) else x
                 for x in example_inputs]
    _probing.join()
    what = "a region" + (" for all sizes" if dynamic else "")
    log.info("gradfx: inductor compiling %s of %d fx nodes", what, len(functional.graph.nodes))
    with tracing(TracingContext(fake_mode)), _FxCacheOutcome() as cache:
        compiled = compile_fx_inner(functional, fakes)
    log.info("gradfx: inductor compiled %s of %d fx nodes in %.2f s (FX graph cache %s)",
             what, len(functional.graph.nodes), time.perf_counter() - start, cache.outcome)
    return (compiled, _guard(fakes, fake_mode)) if dynamic else compiled


class _FxCacheOutcome(logging.Filter):
    """What inductor's FX graph cache did for one compile: ``hit``, ``miss``, or
    ``bypass: <inductor's reason>``, from its counters and its log record of the reason
    (read by this filter on inductor's cache logger; a record the logger's own level
    would not have let through goes no further)."""

    _COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")

    def __init__(self):
        super().__init__()
        self.reason = None
        self.outcome = "not consulted"

    def filter(self, record) -> bool:
        message = record.getMessage()
        if message.startswith("Bypassing FX Graph Cache because"):
            self.reason = message.split("because", 1)[1].strip(" '")
        return record.levelno >= self._shown

    def __enter__(self):
        from torch._dynamo.utils import counters as torch_counters
        self._counts = torch_counters["inductor"]
        self._before = [self._counts[c] for c in self._COUNTERS]
        self._logger = logging.getLogger("torch._inductor.codecache")
        self._level = self._logger.level
        self._shown = self._logger.getEffectiveLevel()
        self._logger.setLevel(min(self._shown, logging.INFO))
        self._logger.addFilter(self)
        return self

    def __exit__(self, *exc):
        self._logger.removeFilter(self)
        self._logger.setLevel(self._level)
        hit, miss, bypass = (self._counts[c] - b for c, b in zip(self._COUNTERS, self._before))
        if bypass:
            self.outcome = f"bypass: {self.reason or 'no reason given'}"
        elif hit:
            self.outcome = "hit"
        elif miss:
            self.outcome = "miss"
        return False


def _aot_eager_compile(pure: fx.GraphModule, example_inputs: list, dynamic: bool = False):
    inputs, mode = _symbolic_fakes(pure, example_inputs) if dynamic else (example_inputs, None)
    functional = _functionalized(pure, inputs)
    holds = _guard(inputs, mode) if dynamic else None
    functional.graph.set_codegen(_BoxedCodeGen())
    functional.recompile()
    return (functional.forward, holds) if dynamic else functional.forward


class _VectorProbes:
    """Inductor's per-process set-up that even a cache hit waits for: before it loads a
    compiled CPU kernel it asks which vector instruction sets the CPU takes, loading a
    probe library in a child Python for each, in every process, and building the libraries
    first where its cache is empty (gcc).  One by one, as inductor asks, that took 1.1 s
    here, 7.9 s with an empty cache; side by side 0.6 s and 4.1 s.  Started on a thread
    when a capture for the inductor backend begins, the probes run while the graph is
    captured and the first region made functional (they wait on child processes, not on
    the GIL); its compile then waits for them.  Their answers are inductor's own cache."""

    def __init__(self):
        self.thread = None

    def start(self) -> None:
        # With a GPU the regions are most likely CUDA code, which needs no probes: then
        # inductor asks, where it does.
        if self.thread is not None or torch.cuda.is_available():
            return
        # Imported here, not on the thread: two threads importing at once may deadlock.
        from torch._inductor import codecache, cpp_builder, cpu_vec_isa  # noqa: F401
        self.thread = threading.Thread(target=self._probe, args=(cpu_vec_isa,), name="gradfx-inductor-probes",
                                       daemon=True)
        self.thread.start()

    @staticmethod
    def _probe(cpu_vec_isa) -> None:
        try:
            candidates = _probed_sets(cpu_vec_isa)
            if len(candidates) > 1:
                # Each set builds (in a cold cache: gcc, seconds) and loads a library of its
                # own, and inductor asks them one by one: here they go side by side, and
                # each answer is the set's own cached one.
                with concurrent.futures.ThreadPoolExecutor(min(len(candidates), os.cpu_count() or 1)) as pool:
                    list(pool.map(bool, candidates))
            cpu_vec_isa.valid_vec_isa_list()
        except Exception:  # noqa: BLE001  (the compile asks again, and reports what fails)
            log.debug("gradfx: inductor's vector probes failed on their thread", exc_info=True)

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()


def _probed_sets(cpu_vec_isa) -> list:
    """The vector instruction sets inductor's valid_vec_isa_list probes on this machine:
    those of its list whose CPU flags the CPU has, on x86 Linux (elsewhere it probes at
    most one: nothing to run side by side)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    flags = cpu_vec_isa.x86_isa_checker()
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]


_probing = _VectorProbes()

inductor = _split_backend("inductor", _inductor_compile)
inductor._gradfx_warm_up = _probing.start
register_backend("inductor", inductor)
register_backend("aot_eager", _split_backend("aot_eager", _aot_eager_compile))


@register_backend("debug")
@takes_plain_graph
def debug(gm: fx.GraphModule, example_inputs: list):
    """Run node by node, checking every tensor against the traced metadata.

    Raises naming the autograd node (``MmBackward0 #12``) that produced a tensor
    whose shape, dtype or device differs from what tracing recorded, or that
    holds NaN or infinity.  A stride different from the recorded one is logged
    (kernels may choose another memory format at run time).
    """
    interpreter = _CheckingInterpreter(gm)

    def run(*args):
        return interpreter.run(*args)
    return run


class _CheckingInterpreter(fx.Interpreter):
    def run_node(self, node: fx.Node):
        result = super().run_node(node)
        expected = node.meta.get("val")
        if isinstance(result, torch.Tensor) and isinstance(expected, torch.Tensor) and node.op != "placeholder":
            _check_tensor(node, result, expected)
        return result


def _check_tensor(node: fx.Node, got: torch.Tensor, expected: torch.Tensor) -> None:
    where = node.meta.get("gradfx_node", "the graph")
    static_shape = all(isinstance(s, int) for s in expected.shape)
    if (static_shape and tuple(got.shape) != tuple(expected.shape)) or got.dim() != expected.dim():
        raise RuntimeError(f"gradfx debug backend: {node.name} (from {where}) has shape {tuple(got.shape)}, "
                           f"traced as {tuple(expected.shape)}")
    if got.dtype != expected.dtype or got.device.type != expected.device.type:
        raise RuntimeError(f"gradfx debug backend: {node.name} (from {where}) is {got.dtype} on {got.device}, "
                           f"traced as {expected.dtype} on {expected.device}")
    if static_shape and all(isinstance(s, int) for s in expected.stride()) and got.stride() != expected.stride():
        log.info("gradfx debug backend: %s (from %s) has strides %s, traced as %s", node.name, where,
                 got.stride(), expected.stride())
    if (got.is_floating_point() or got.is_complex()) and not torch.isfinite(got).all():
        kind = "nan" if torch.isnan(got).any() else "inf"
        raise RuntimeError(f"gradfx debug backend: Function '{where}' returned {kind} values in {node.name}")
