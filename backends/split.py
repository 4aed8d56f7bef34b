"""Cut a captured graph into compiled pure regions and the Python run between them.

Compilers such as inductor want pure tensor programs; a captured backward also calls
Python: ``accumulate_grad`` (writes ``.grad``), hooks, autograd nodes run opaquely,
custom Functions' backwards, checks.  Handing the whole graph to ``torch.compile``
makes dynamo break the graph at every one of those calls (measured: 14 graph breaks
on a 4-layer MLP, 1.2-3x slower than eager).  Instead the graph's nodes are cut, in
their order (eager's), into

* regions: maximal runs of pure nodes (aten ops, their getitems, size arithmetic)
  between two Python calls other than accumulations, each compiled on its own by the
  backend's compile function;
* Python: every other node, run as the eager backend's generated code.

Only accumulations move: each runs right after the region it falls in, in its order,
before the next Python call.  Pure ops read no ``.grad``, so only Python could tell
(a post-accumulate-grad hook reads other leaves' ``.grad``).  So do the calls of
DistributedDataParallel's reducer (an accumulator's post-hooks, all C++: the tracer
marks them) that do not complete one of its buckets: the reducer copies the
parameter's ``.grad`` into its bucket and touches no value of the graph; the call
that completes a bucket starts its all-reduce and stays a cut, where eager starts it
(:func:`_reducer_calls_moved`).  The Python reducer's bucketed calls
(``reorder.bucket_allreduces``) move on the same terms, where its hook runs no user
code.  Without this, DDP's hooks cut a backward into a region per parameter.  Pure ops
never move across a Python call: a hook or a custom backward may change a tensor in
place, and what else reads it (through a view too) is not in the graph's edges.  Where the graph
has Python calls, runs of fewer than ``MIN_OPS`` aten ops (views not counted) stay in
Python: compiling them would cost a compile each and gain nothing.  A graph whose only
Python calls are accumulations is one region, compiled whatever its size, with its
accumulations after it.
"""

from __future__ import annotations

import inspect
import logging
import operator
import time
import warnings

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.errors import FallbackWarning
from ..capture.stacklevel import user_stacklevel
from ..capture.runtime import counters, ddp_buckets
from ..capture.trace.fx_kinds import CPP_POST_HOOKS, has_side_effect, kind_of, shares_storage
from ..reorder.memory import free_inputs_early
from . import repeated_blocks

log = logging.getLogger("gradfx")

MIN_OPS = 3

_SIZE_MATH = (operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod)


def _pure(node: fx.Node, pure: set) -> bool:
    if node.op != "call_function" or has_side_effect(node):  # has_side_effect: in-place ops too
        return False
    if node.target is operator.getitem:
        return node.args[0] in pure  # a Python call's tuple is unpacked in Python
    return isinstance(node.target, torch._ops.OpOverload) or node.target in _SIZE_MATH


def aten_work(node: fx.Node) -> bool:
    """Is the node an aten op that computes (not a view)?"""
    return isinstance(node.target, torch._ops.OpOverload) and not node.target.is_view


def partition(graph: fx.Graph) -> list[tuple[bool, list[fx.Node]]]:
    """The graph's calls as ``(compile?, nodes)`` pieces, in the order they run."""
    calls = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    pure: set = set()
    for node in calls:
        if _pure(node, pure):
            pure.add(node)
    moved = _reducer_calls_moved(calls, pure)
    only_accumulations = all(n in pure or kind_of(n) == "accumulate" for n in calls)
    pieces: list = []
    run: list = []  # pure nodes and accumulations since the last other Python call

    def python(nodes):
        if not nodes:
            return
        if pieces and not pieces[-1][0]:
            pieces[-1][1].extend(nodes)
        else:
            pieces.append((False, list(nodes)))

    def end_run():
        region = [n for n in run if n in pure]
        if region and (only_accumulations or sum(map(aten_work, region)) >= MIN_OPS):
            cut = repeated_blocks.blocks(region)
            for block in cut:
                if len(cut) > 1 and sum(map(aten_work, block)) < MIN_OPS:
                    python(block)  # a few ops before or after the repeats: not worth a compile
                else:
                    pieces.append((True, block))
            python([n for n in run if n not in pure])  # the accumulations, right after
        else:
            python(run)
        run.clear()

    for node in calls:
        if node in pure or kind_of(node) == "accumulate" or node in moved:
            run.append(node)
        else:
            end_run()
            python([node])
    end_run()
    return pieces


def _reducer_calls_moved(calls: list, pure: set) -> set:
    """The reducer calls that may run after their region, with its accumulations, in their
    order: those that do not complete a bucket.

    * The C++ reducer's (``CPP_POST_HOOKS``), where nothing up to the next cut reads their
      gradient or a view of it (a C++ hook is passed its gradient).  An idle C++ reducer's
      (DDP in Python-reducer mode: its hooks return at once) complete nothing.
    * The Python reducer's, bucketed (``ddp_buckets.ready``), where the hook runs no user
      code (``Planned.alone``, keyed): such a call reads its parameter's ``.grad``, which
      only it and the accumulation before it touch, and no value of the graph."""
    cpp = [n for n in calls if n.meta.get(CPP_POST_HOOKS)]
    python = {n for n in calls if n.target is ddp_buckets.ready and n.meta["gradfx_allreduce"].alone
              and not _completes_bucket(n)}
    if not cpp:
        return python
    ends = _bucket_ends([n for n in cpp if not n.meta.get("gradfx_idle_reducer")])
    moved = set()
    read: set = set()  # what the nodes after this one read, up to the next cut
    for node in reversed(calls):  # one pass from the end: each call sees what follows it
        if node in python:
            continue
        if node in ends or not (node in pure or kind_of(node) == "accumulate" or node.meta.get(CPP_POST_HOOKS)):
            read = set()
        elif node.meta.get(CPP_POST_HOOKS):
            if read.isdisjoint(_views_of([a for a in node.args[1] if isinstance(a, fx.Node)])):
                moved.add(node)
        else:
            read.update(node.all_input_nodes)
    return moved | python


def _completes_bucket(ready: fx.Node) -> bool:
    """Is this ``ddp_buckets.ready`` call its bucket's last member (it starts the all-reduce)?"""
    state, bucket, member = ready.args[:3]
    _, members, _, _ = state.args[0][bucket]
    trailer = bucket == 0 and state.args[1] is not None  # the ranks' trailer: a member no call makes ready
    return member == len(members) - 1 - trailer


def _bucket_ends(marked: list) -> set:
    """The reducer calls that complete a bucket, as DDP rebuilds its buckets after the first
    step: parameters in the order their gradients became ready (the graph's), a bucket per
    dtype closed once it holds DDP's default bytes (1 MiB for the first, 25 MiB after).
    Where a DDP was given other sizes, only where the all-reduces start differs."""
    caps = ddp_buckets.default_caps()
    filled: dict = {}  # dtype -> (bytes so far, buckets closed)
    last: dict = {}  # dtype -> its last call, which completes its last bucket
    ends = set()
    for hook in marked:
        grads = [a.meta.get("val") for a in hook.args[1] if isinstance(a, fx.Node)]
        grad = grads[0] if len(grads) == 1 else None
        if not isinstance(grad, torch.Tensor) or not isinstance(grad.numel(), int):
            ends.add(hook)  # not one gradient of a known size: a cut
            continue
        so_far, closed = filled.get(grad.dtype, (0, 0))
        so_far += grad.numel() * grad.element_size()
        if so_far >= caps[min(closed, 1)]:
            ends.add(hook)
            so_far, closed = 0, closed + 1
        filled[grad.dtype] = (so_far, closed)
        last[grad.dtype] = hook
    ends.update(last.values())
    return ends


def _views_of(nodes: list) -> set:
    """Every value of the graph sharing memory with one of ``nodes`` through views."""
    roots = []
    for n in nodes:
        while _view_of(n) is not None:
            n = _view_of(n)
        roots.append(n)
    seen, stack = set(), roots
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(u for u in n.users if _view_of(u) is n)
    return seen


def _view_of(node: fx.Node):
    """The value whose memory ``node`` shares (a view op's input; for an output of an op
    returning views, such as split, that op's input), or None."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    if node.target is operator.getitem:
        source = node.args[0]
        return source if source.op == "call_function" and shares_storage(source.target) else None
    return node.args[0] if shares_storage(node.target) else None


def _subgraph(gm: fx.GraphModule, nodes: list, inputs: list, outputs: list) -> fx.GraphModule:
    """``nodes`` as a graph of their own, taking ``inputs`` and returning ``outputs``;
    marked to free each input at its last use (boxed)."""
    graph, env = fx.Graph(), {}
    for a in inputs:
        env[a] = graph.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = graph.node_copy(n, env.__getitem__)
    graph.output(tuple(env[n] for n in outputs))
    free_inputs_early(graph)
    return fx.GraphModule(gm, graph)


def _concrete(x, symbols: dict):
    return int(x.node.expr.xreplace(symbols)) if isinstance(x, torch.SymInt) else x


def _symbolic(val) -> bool:
    """Might a region taking this traced value need other code for other sizes?"""
    if isinstance(val, torch.Tensor):
        return not all(type(s) is int for s in (*val.shape, *val.stride()))
    return not isinstance(val, (int, float))  # a SymInt, or nothing traced


def _example(node: fx.Node, symbols: dict):
    """A stand-in for a value the graph computes, from its traced value: same shape,
    strides, dtype and device, for a compiler to specialize on (not run on)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return torch.empty_strided([_concrete(s, symbols) for s in val.shape],
                                   [_concrete(s, symbols) for s in val.stride()], dtype=val.dtype, device=val.device)
    if isinstance(val, (int, float, torch.SymInt)):
        return _concrete(val, symbols)
    raise TypeError(f"no traced value of {node.name} to compile a region for")


class _Graph:
    """What the regions of one graph share: the backend, whether the graph has said that
    part of it runs uncompiled (once: it is one graph), and the code compiled so far by
    what it computes (repeated_blocks.canonical_key): a transformer's layers compile once."""

    def __init__(self, compile_region, python_code, name: str, part: str, dynamic: bool = False):
        self.compile_region, self.python_code, self.name = compile_region, python_code, name
        self.part = part  # what the log calls a region
        # a graph of symbolic sizes: its sized regions compile for all sizes, where the
        # compile function can (it takes ``dynamic``)
        self.dynamic = dynamic and "dynamic" in inspect.signature(compile_region).parameters
        self.warned = False
        self.compiled: dict = {}

    def uncompiled(self, err: Exception) -> None:
        if self.warned:
            log.debug("gradfx: backend %s failed to compile another region", self.name, exc_info=err)
            return
        self.warned = True
        warnings.warn(f"gradfx: backend {self.name!r} failed to compile a region of a backward for new sizes or "
                      f"strides ({type(err).__name__}: {err}); that region runs uncompiled", FallbackWarning,
                      stacklevel=user_stacklevel())
        counters.note("uncompiled")


class _General:
    """Code compiled for every size its guards admit (a region of a symbolic graph)."""

    __slots__ = ("fn", "holds")

    def __init__(self, fn, holds):
        self.fn, self.holds = fn, holds

    def admits(self, inputs: list) -> bool:
        try:
            return bool(self.holds(inputs))
        except Exception:  # noqa: BLE001  (an input the guards cannot read: compile for it)
            log.debug("gradfx: a region's guards could not be evaluated", exc_info=True)
            return False


class _Region:
    """A compiled region: code per key (the graph's sizes where they matter, and the
    strides or values of its inputs the graph computes: a hook may return any layout).
    A key whose compile fails runs the region's Python.  In a graph of symbolic sizes a
    region taking sizes compiles for all sizes at once (``_General``): a new key whose
    inputs its guards admit reuses that code, without a compile."""

    def __init__(self, gm: fx.GraphModule, computed: list[int], sized: bool, graph: _Graph):
        self.gm, self.computed, self.sized, self.graph = gm, computed, sized, graph
        self.python = None
        self.compiled: dict = {}
        self.general: list[_General] = []

    def key(self, sub: list, sizes: tuple) -> tuple:
        computed = tuple(x.stride() if isinstance(x, torch.Tensor) else x for x in map(sub.__getitem__, self.computed))
        return sizes + computed if self.sized else computed

    def compile(self, examples: list, what=None):
        """Code for inputs like ``examples``: a twin's (same ``what``:
        repeated_blocks.canonical_key) where one was compiled, else compiled now."""
        what = repeated_blocks.canonical_key(self.gm, examples) if what is None else what
        fn = self.graph.compiled.get(what)
        if fn is None:
            examples = [a.detach() if isinstance(a, torch.Tensor) else a for a in examples]
            with torch.no_grad():
                fn = self._compile_general(examples) if self.sized and self.graph.dynamic else None
                if fn is None:
                    fn = self.graph.compile_region(self.gm, examples)
            self.graph.compiled[what] = fn
        if isinstance(fn, _General):
            if fn not in self.general:
                self.general.append(fn)
            return fn.fn
        return fn

    def _compile_general(self, examples: list):
        """Code for all sizes, or None where the compiler fails to (then: for these sizes)."""
        try:
            return _General(*self.graph.compile_region(self.gm, examples, dynamic=True))
        except Exception as err:  # noqa: BLE001
            log.info("gradfx: backend %s could not compile a region of %d fx nodes for all sizes (%s: %s); "
                     "compiling it for these sizes", self.graph.name, len(self.gm.graph.nodes), type(err).__name__,
                     err)
            return None

    def compile_on_run(self, sub: list, key: tuple):
        for general in self.general:
            if general.admits(sub):  # compiled for all sizes: these too
                fn = self.compiled[key] = general.fn
                return fn
        what = repeated_blocks.canonical_key(self.gm, sub)
        if what in self.graph.compiled:  # a repeat of a block compiled for these sizes already: no compile
            fn = self.compiled[key] = self.graph.compiled[what]
            return fn
        start = time.perf_counter()
        try:
            fn = self.compile(sub, what)
        except Exception as err:
            self.graph.uncompiled(err)
            fn = False
        self.compiled[key] = fn
        if len(self.compiled) > 1:
            counters.note_recompile(self.graph.name, len(self.gm.graph.nodes), time.perf_counter() - start, key,
                                    next(iter(self.compiled)), len(self.compiled), self.graph.part)
        return fn

    def __call__(self, sub: list, sizes: tuple):
        key = self.key(sub, sizes)
        fn = self.compiled.get(key)
        if fn is None:
            fn = self.compile_on_run(sub, key)
        if fn is False:
            if self.python is None:
                self.python = self.graph.python_code(self.gm, [])._boxed
            return self.python(sub)
        return fn(sub)


def runner(gm: fx.GraphModule, pieces: list, compile_region, example_inputs: list, python_code, name: str):
    """A boxed callable that runs ``pieces`` (see :func:`partition`) in order.

    ``compile_region(region_gm, example_inputs) -> fn(list) -> outputs`` compiles code
    specialized to its inputs' shapes: each region once now, for the graph's example
    inputs and stand-ins for the values it takes from the graph (:func:`_example`), and
    again on a run that meets other sizes (the graph's size inputs, the leading int
    placeholders; none in a static graph) or other strides of those values.  A compile
    now that fails is the backend's failure (gradfx warns and uses the eager backend, or
    raises ``Unsupported`` in strict mode).  A compile on a run happens after Python of
    the graph has run, so its region then runs uncompiled (``python_code``: the eager
    backend) with a warning, counted as ``uncompiled``.  Compiles on a run count as
    ``recompiles`` and are logged, so that a cache hit that takes seconds says why.

    Values live in a list of slots, each cleared before the piece that uses it last
    runs: that piece is then its only owner and frees it at its last use (saved
    tensors as the eager engine does), and ``accumulate_grad`` may steal it.
    """
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    slot = {n: k for k, n in enumerate(placeholders)}
    flat_out, spec = pytree.tree_flatten(graph.output_node().args[0])
    last = {}  # value -> index of the piece that uses it last (len(pieces): the graph's output)
    for k, (_, nodes) in enumerate(pieces):
        for n in nodes:
            for a in n.all_input_nodes:
                last[a] = k
    for a in flat_out:
        if isinstance(a, fx.Node):
            last[a] = len(pieces)
    n_sizes = 0
    while n_sizes < len(example_inputs) and type(example_inputs[n_sizes]) is int:
        n_sizes += 1
    sizes = tuple(example_inputs[:n_sizes])
    symbols = {}
    for p, value in zip(placeholders[:n_sizes], sizes):
        val = p.meta.get("val")
        if isinstance(val, torch.SymInt):
            symbols[val.node.expr] = value

    part = "a cached backward" if sum(compiled for compiled, _ in pieces) == 1 else "a region of a cached backward"
    shared = _Graph(compile_region, python_code, name, part, dynamic=n_sizes > 0)
    steps = []
    for k, (compiled, nodes) in enumerate(pieces):
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in nodes if last.get(n, k) > k]
        lo = len(slot)
        slot.update((n, lo + j) for j, n in enumerate(outputs))
        piece = _subgraph(gm, nodes, inputs, outputs)
        if compiled:
            computed = [j for j, a in enumerate(inputs) if a.op != "placeholder"]
            sized = n_sizes > 0 and any(_symbolic(a.meta.get("val")) for a in inputs)
            run = _Region(piece, computed, sized, shared)
            examples = [example_inputs[slot[a]] if a.op == "placeholder" else _example(a, symbols) for a in inputs]
            run.compiled[run.key(examples, sizes)] = run.compile(examples)
            del examples
        else:
            run = _python(python_code(piece, [])._boxed)
        frees = [slot[a] for a in inputs if last[a] == k]
        steps.append((run, [slot[a] for a in inputs], frees, lo, lo + len(outputs)))
    unused = [slot[p] for p in placeholders if p not in last]
    blank = [None] * (len(slot) - len(placeholders))
    results = [(slot[a], None) if isinstance(a, fx.Node) else (None, a) for a in flat_out]

    def boxed(args: list):
        sizes = tuple(args[:n_sizes])
        env = args[:]
        args.clear()  # the pieces become the only owners of the saved tensors
        for i in unused:
            env[i] = None
        env += blank
        for run, inputs, frees, lo, hi in steps:
            sub = [env[i] for i in inputs]
            for i in frees:
                env[i] = None
            env[lo:hi] = run(sub, sizes)
        return pytree.tree_unflatten([value if i is None else env[i] for i, value in results], spec)

    def call(*args):
        return boxed(list(args))
    call._boxed = boxed
    return call


def _python(code):
    def run(sub: list, sizes: tuple):
        return code(sub)
    return run
