"""The captured graph in the form compilers trace whole.

The graph gradfx runs itself calls plain Python helpers chosen for eager speed
and exact semantics: ``accumulate_grad`` reads reference counts to decide
whether it may steal a gradient, ``call_backward`` goes through ``ctx.apply``,
``call_node`` takes a live autograd node.  Dynamo cannot trace those.  Before a
graph goes to a compiler (any backend but gradfx's own eager and debug ones) a
copy is rewritten:

* ``accumulate_grad`` -> :func:`accumulate`: tensor code dynamo inlines.  The
  first gradient is stolen where the graph shows that nothing else can see it
  (no later use, never handed to or returned by a hook), else copied into the
  parameter's layout; later ones are added in place, so ``.grad`` keeps its
  identity and layout as in eager;
* ``call_backward`` of a custom Function -> the user's ``backward`` called with a
  context rebuilt from the node's saved-tensor inputs and its attributes (the
  ctx input becomes ``ctx.__dict__``), so dynamo inlines the user's code;
* ``call_node`` (a builtin node that could not be traced), and the backward of
  a Function that cannot be inlined (checkpointing, compiled regions) ->
  ``torch.ops.gradfx.run_node``, a custom op keyed by a slot number: the live
  node is put in a per-thread table for each call, and the op's fake kernel
  gives outputs of the traced shapes.  In a graph with a reentrant checkpoint
  (whose backward runs a backward of its own, accumulating into leaves) the
  accumulations are the ordered custom op ``torch.ops.gradfx.accumulate_grad``
  too;
* hook calls stay as they are, without the node they run for: dynamo inlines them,
  guarding on the hook's code, not on the hook object, so hooks recreated every step
  reuse the compiled code;
* a graph traced through a tensor subclass (DTensor) takes and computes plain tensors
  only: a subclass root gradient becomes its inner tensors (the adapter flattens it), a
  node's saved values are read by the custom op ``torch.ops.gradfx.unpack_saved``, and a
  subclass rebuilt for a live node (a DTensor leaf's accumulator) is rebuilt inside
  ``run_node`` from the inner tensors it is given.  A subclass rebuilt for a hook, or
  handed from one live call to another, has no such form: the backend is not given the
  graph (it runs on the eager backend, with a warning).

:func:`prepare` returns the rewritten graph and an :class:`Adapter` that turns
gradfx's runtime inputs into what that graph takes.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import operator
import threading

import torch
import torch.fx as fx

from ..capture.runtime import hook_ops, runtime_ops
from ..capture.trace.engine_loop import _GROUPED_OUTPUTS
from ..capture.trace.fx_kinds import RUNTIME_SUBCLASS
from ..reorder.bucket_allreduces import unbucket

# Custom Functions whose backward dynamo cannot inline: they run as the custom op.
_OPAQUE_FUNCTIONS = ("CheckpointFunction", "CompiledFunction")
# Of those, the ones whose backward runs a backward of its own (reentrant checkpoint).
_NESTED_BACKWARD = ("CheckpointFunction",)


# -- accumulation ---------------------------------------------------------------

def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: its strides are a permutation of contiguous ones."""
    if t.is_contiguous():
        return True
    expected = 1
    for d in _by_stride(t):
        if t.shape[d] != 1:
            if t.stride(d) != expected:
                return False
            expected *= t.shape[d]
    return True


def _by_stride(t: torch.Tensor) -> list:
    """The dims by increasing stride, ties in dim order (a stable sort), by comparisons
    alone: dynamo cannot sort by symbolic keys (a leaf's strides under dynamic sizes),
    but it guards comparisons."""
    remaining = list(range(t.dim()))
    order = []
    while remaining:
        best = remaining[0]
        for d in remaining[1:]:
            if t.stride(d) < t.stride(best):
                best = d
        remaining.remove(best)
        order.append(best)
    return order


def _layout_ok(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    """AccumulateGrad's layout contract, from sizes and strides only (dynamo folds it):
    a dense parameter's strides where sizes are not 1, else contiguous."""
    if grad.is_contiguous() and variable.is_contiguous():
        return True
    if not _dense(variable):
        return grad.is_contiguous()
    for size, stride, vstride in zip(grad.shape, grad.stride(), variable.stride()):
        if size != 1 and stride != vstride:
            return False
    return True


def accumulate(variable, grad, may_steal: bool, dtype) -> None:
    """AccumulateGrad (grad mode off) in a form dynamo inlines (see the module doc).

    ``dtype``: the leaf's grad_dtype when captured (part of the key; dynamo cannot
    read it), None for any."""
    if grad is None or not variable.requires_grad:
        return
    if grad.shape != variable.shape or (grad.dtype != dtype and dtype is not None) or grad.device != variable.device:
        raise runtime_ops.WrongGradient(f"gave a gradient {list(grad.shape)} ({grad.dtype}, {grad.device}) to "
                                        f"accumulate into a leaf {list(variable.shape)} ({variable.dtype}, "
                                        f"{variable.device})")
    old = variable.grad
    if old is None:
        if may_steal and not grad.is_sparse and _layout_ok(grad, variable):
            variable.grad = grad.detach()
        elif grad.is_sparse:
            variable.grad = grad.clone()
        elif _dense(variable):
            out = torch.empty_strided(variable.shape, variable.stride(), dtype=grad.dtype, device=grad.device)
            out.copy_(grad)
            variable.grad = out
        else:
            variable.grad = grad.clone(memory_format=torch.contiguous_format)
    elif old.is_sparse and not grad.is_sparse:
        variable.grad = grad + old
    else:
        old.add_(grad)


# -- custom Functions -------------------------------------------------------------

class RebuiltContext:
    """What a custom Function's backward reads from ctx, rebuilt inside the graph."""

    def __init__(self, attrs: dict, saved: tuple, needs_input_grad: tuple):
        self.saved_tensors = saved
        self.needs_input_grad = needs_input_grad
        self._attrs = attrs

    def __getattr__(self, name):
        try:
            return self._attrs[name]
        except KeyError:
            raise AttributeError(name) from None


_callers: dict = {}


def backward_caller(function_class):
    """The graph target that calls ``function_class.backward`` with a rebuilt context.

    One per class: the user's function is resolved here, outside any tracing.
    """
    caller = _callers.get(function_class)
    if caller is None:
        backward = inspect.getattr_static(function_class, "backward").__func__
        name = function_class.__name__

        def caller(attrs, saved, needs_input_grad, valid_edges, metas, must_be_defined, *grads):
            result = backward(RebuiltContext(attrs, saved, needs_input_grad), *grads)
            outs = runtime_ops.function_outputs(f"{name}Backward", needs_input_grad, result, valid_edges)
            return runtime_ops.finish_outputs(f"{name}Backward", tuple(outs), metas, must_be_defined)

        caller.__name__ = caller.__qualname__ = f"backward_of_{name}"
        _callers[function_class] = caller
    return caller


# -- opaque nodes as a custom op --------------------------------------------------

class _Live(threading.local):
    nodes: dict = {}
    keys = None  # the dispatcher's thread-local key sets when the graph was called


_live = _Live()
_slots = itertools.count()
_slot_outputs: dict[int, tuple] = {}  # slot -> ((ndim, dtype, device) per defined output)
_slot_seen_none: dict[int, tuple] = {}  # slot -> edges without a next node whose None a post-hook sees
_slot_calls: dict[int, object] = {}  # slot -> how the node runs where not call_node (NodeUnpacking)
# slot -> per gradient, None or (Rebuild, how many inner tensors): rebuilt before the node runs
_slot_rebuilds: dict[int, tuple] = {}
_slot_unpacks: dict[int, object] = {}  # slot -> the SavedUnpack of a traced node under the user's hooks
_ops_defined = False


def _ops():
    """torch.ops.gradfx.run_node and .accumulate_grad, defined on first use (nothing at import)."""
    global _ops_defined
    if _ops_defined:
        return torch.ops.gradfx
    from torch._higher_order_ops.effects import EffectType
    from torch.library import _register_effectful_op, custom_op

    @custom_op("gradfx::run_node", mutates_args=())
    def run_node(slot: int, grads: list[torch.Tensor | None], sizes: list[int]) -> list[torch.Tensor]:
        return _run_node(slot, grads, sizes)

    # The node's own Python (checkpoint's recomputation, a custom backward) runs
    # while compiled code runs: dynamo must not try to compile it.
    @torch._dynamo.disable(recursive=True)
    def _run_node(slot, grads, sizes):
        # A custom op runs below autograd; the node may need autograd (reentrant
        # checkpoint recomputes and differentiates), so it runs with the key sets
        # the graph was called with.
        with torch._C._ForceDispatchKeyGuard(*_live.keys):
            return _run_node_as_called(slot, grads, sizes)

    def _run_node_as_called(slot, grads, sizes):
        node = _live.nodes[slot]
        rebuilds = _slot_rebuilds.get(slot)
        if rebuilds is not None:  # subclass gradients, from the inner tensors the graph computed
            flat, grads = iter(grads), []
            for rebuild in rebuilds:
                grads.append(next(flat) if rebuild is None else rebuild[0](*(next(flat) for _ in range(rebuild[1]))))
        outputs = _slot_outputs[slot]
        metas, at = [], 0
        for ndim, dtype, _ in outputs:
            metas.append((torch.Size(sizes[at:at + ndim]), dtype))
            at += ndim
        edges = _edge_metas(node, metas)
        defined = (True,) * len(edges)  # a custom op cannot return None: say so by name
        call = runtime_ops.call_backward if isinstance(node, torch.autograd.function.BackwardCFunction) \
            else _slot_calls.get(slot, runtime_ops.call_node)
        outs = call(node, edges, defined, *grads)
        result = []
        for k, out in enumerate(outs):
            if edges[k] is None:  # no next node: the graph passes post-hooks None (_as_custom_op)
                if out is not None and k in _slot_seen_none.get(slot, ()):
                    raise RuntimeError(f"gradfx: {node.name()} computed a gradient for an input without a next "
                                       "node, which the compiled graph hands its post-hook as None; run this "
                                       "backward with backend='eager'")
                continue
            if out is None:
                continue
            # The fake kernel promises contiguous outputs (the node's layout is not
            # known before it runs), and a custom op must not return a view of its inputs.
            out = out.contiguous()
            if any(g is not None and out.untyped_storage().data_ptr() == g.untyped_storage().data_ptr()
                   for g in grads):
                out = out.clone()
            result.append(out)
        if len(result) != len(outputs):
            raise RuntimeError("gradfx: an opaque autograd node returned no gradient where the compiled "
                               "graph expects one; run this backward with backend='eager'")
        return result

    @run_node.register_fake
    def _(slot, grads, sizes):
        out, at = [], 0
        for ndim, dtype, device in _slot_outputs[slot]:
            out.append(torch.empty(sizes[at:at + ndim], dtype=dtype, device=device))
            at += ndim
        return out

    @custom_op("gradfx::unpack_saved", mutates_args=())
    def unpack_saved(slot: int) -> list[torch.Tensor]:
        return _unpack_saved(slot)

    @torch._dynamo.disable(recursive=True)  # the user's unpack hooks (a checkpoint's recomputation)
    def _unpack_saved(slot):
        with torch._C._ForceDispatchKeyGuard(*_live.keys):
            unpack = _slot_unpacks[slot]
            node = _live.nodes[slot]
            values = unpack.unpack(node)
        out = []
        for value, want in zip(values, unpack.expected):
            if want is None:
                continue
            if value is None or (tuple(value.shape), value.dtype, value.device) != (want[0], want[2], want[3]):
                got = "None" if value is None else f"{list(value.shape)} ({value.dtype}, {value.device})"
                raise RuntimeError(f"gradfx: the saved_tensors_hooks of {node.name()} unpacked {got} where the "
                                   f"compiled graph was traced for {list(want[0])} ({want[2]}, {want[3]}); run this "
                                   "backward with backend='eager'")
            # A copy in the traced layout: the hook's tensor may share memory with a leaf
            # (a checkpoint's recomputation saves weights detached), and a compiler may
            # reuse an op's output buffer.
            copy = torch.empty_strided(want[0], want[1], dtype=want[2], device=want[3])
            out.append(copy.copy_(value))
        return out

    @unpack_saved.register_fake
    def _(slot):
        return [torch.empty_strided(want[0], want[1], dtype=want[2], device=want[3])
                for want in _slot_unpacks[slot].expected if want is not None]

    @custom_op("gradfx::accumulate_grad", mutates_args=())
    def accumulate_grad(variable: torch.Tensor, grad: torch.Tensor, may_steal: bool) -> None:
        accumulate(variable, grad, may_steal, variable.grad_dtype)  # runs outside dynamo

    @accumulate_grad.register_fake
    def _(variable, grad, may_steal):
        return None

    # Ordered side effects: compilers must neither drop nor reorder the calls.
    _register_effectful_op(torch.ops.gradfx.run_node.default, EffectType.ORDERED)
    _register_effectful_op(torch.ops.gradfx.unpack_saved.default, EffectType.ORDERED)
    _register_effectful_op(torch.ops.gradfx.accumulate_grad.default, EffectType.ORDERED)
    _ops_defined = True
    return torch.ops.gradfx


def _edge_metas(node, defined: list) -> tuple:
    """(shape, dtype) per edge, as call_node/call_backward validate them (None: no edge)."""
    it = iter(defined)
    return tuple(None if child is None else next(it) for child, _ in node.next_functions)


# -- the rewrite --------------------------------------------------------------------

HOOK_CALLS = hook_ops.HOOK_CALLS


def _seen_by_python(grad: fx.Node) -> bool:
    """Could a hook hold this gradient?  It could if a hook call returned it (a hook
    returning None hands back the tensor it saw) or takes it as an argument."""
    source = grad.args[0] if grad.op == "call_function" and grad.target is operator.getitem else grad
    if source.op == "call_function" and source.target in HOOK_CALLS:
        return True
    return any(u.op == "call_function" and u.target in HOOK_CALLS for u in grad.users)


class Adapter:
    """Turns gradfx's runtime inputs into the inputs of the rewritten graph."""

    def __init__(self):
        self.contexts: list[int] = []  # positions whose ctx becomes ctx.__dict__
        self.slots: list[tuple[int, int]] = []  # (position, slot): live node into the table
        self.detach: list[int] = []  # saved tensors and root gradients
        # Accumulations the run makes after the graph (_defer_accumulations), in order:
        # (position of the leaf, may steal, may be None); None: they stay in the graph.
        self.deferred: list[tuple] | None = None
        self.outputs = 0  # how many of the graph's outputs are its own
        self.used: list[int] | None = None  # the positions the graph takes (None: all)
        self.flatten: list[int] = []  # positions of subclass root gradients, taken as their inner tensors

    def expand(self, args) -> list:
        """``args`` with each subclass root gradient replaced by its inner tensors (the
        positions every other entry of the adapter speaks of)."""
        args = list(args)
        for pos in reversed(self.flatten):
            args[pos:pos + 1] = runtime_ops.flatten(args[pos])
        return args

    def __call__(self, args) -> list:
        args = self.expand(args) if self.flatten else list(args)
        for pos in self.contexts:
            args[pos] = args[pos].__dict__
        nodes = _live.nodes
        if self.slots:
            _live.keys = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
        for pos, slot in self.slots:
            nodes[slot] = args[pos]
            args[pos] = None
        for pos in self.detach:
            # Saved tensors read from a node carry autograd metadata on some paths; a
            # compiler guards on it, so every call hands over the same kind of tensor.
            t = args[pos]
            if t is not None and t.requires_grad:
                args[pos] = t.detach()
        if self.used is not None:
            args = [args[pos] for pos in self.used]
        return args

    def leaves(self, args) -> list | None:
        """The leaves of the deferred accumulations, taken before the graph runs (it may
        clear its arguments)."""
        if self.deferred is None:
            return None
        args = self.expand(args) if self.flatten else args
        return [args[d[0]] for d in self.deferred]

    def finish(self, box: list, leaves):
        """Check what the compiled code returned (``box``'s one item), then make the
        deferred accumulations with eager's semantics (runtime_ops.accumulate_grad);
        the graph's own outputs.  Raises WrongGradient, nothing written, unless every
        gradient is as traced."""
        results = box.pop()
        expected = self.outputs + (0 if leaves is None else len(leaves))
        if not isinstance(results, (tuple, list)) or len(results) != expected:
            text = repr(results)
            raise runtime_ops.WrongGradient(f"returned {text if len(text) <= 60 else text[:60] + '...'} instead of "
                                            f"a tuple of {expected} values")
        if leaves is None:
            return results
        results = list(results)
        for (_, _, may_be_none), leaf, k in zip(self.deferred, leaves, range(self.outputs, expected)):
            _check_gradient(results[k], leaf, may_be_none)
        for k, ((_, steal, _), leaf) in enumerate(zip(self.deferred, leaves), self.outputs):
            grad = results[k]
            results[k] = None  # the local is its only reference: a gradient nothing else holds is stolen
            runtime_ops.accumulate_grad(leaf, grad, steal)
        return tuple(results[:self.outputs])


def _check_gradient(grad, leaf, may_be_none: bool) -> None:
    if grad is None and may_be_none:
        return
    dtype = leaf.grad_dtype
    if (not isinstance(grad, torch.Tensor) or grad.shape != leaf.shape or grad.device != leaf.device
            or (dtype is not None and grad.dtype != dtype)):
        what = f"a gradient {list(grad.shape)} ({grad.dtype}, {grad.device})" \
            if isinstance(grad, torch.Tensor) else f"a {type(grad).__name__}"
        raise runtime_ops.WrongGradient(f"gave {what} to accumulate into a leaf {list(leaf.shape)} "
                                        f"({leaf.dtype}, {leaf.device})")


def prepare(gm: fx.GraphModule, example_inputs: list):
    """(the compiler-facing copy of ``gm``, the :class:`Adapter` for its inputs)."""
    graph = copy.deepcopy(gm.graph)
    unbucket(graph)  # DDP's hooks as they are: the compiler traces them (and may bucket their collectives)
    adapter = Adapter()
    _flatten_roots(graph, adapter, example_inputs)  # a subclass root gradient: its inner tensors
    example_inputs = adapter.expand(example_inputs)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    position = {n: k for k, n in enumerate(placeholders)}
    adapter.detach = [position[n] for n in placeholders if n.meta.get("gradfx_kind") in ("saved", "grad")]
    saved_of: dict[int, list] = {}
    for n in placeholders:
        if n.meta.get("gradfx_kind") == "saved":
            saved_of.setdefault(n.meta["gradfx_node_index"], []).append(n)
    _refuse_runtime_subclasses(graph)
    accumulations = []
    nested = False
    python_reads = False  # a hook or a custom backward: Python that could read `.grad`
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is runtime_ops.accumulate_grad:
            leaf, grad, steal = node.args
            steal = bool(steal) and isinstance(grad, fx.Node) and not _seen_by_python(grad)
            node.target = accumulate
            node.args = (leaf, grad, steal, example_inputs[position[leaf]].grad_dtype)
            accumulations.append(node)
        elif node.target is runtime_ops.call_backward:
            python_reads = True
            ctx = example_inputs[position[node.args[0]]]
            cls = type(ctx)._forward_cls
            mask = node.meta.get("gradfx_saved_mask")
            if mask is None or cls.__name__ in _OPAQUE_FUNCTIONS or _engine_materializes(ctx, node.args[3:]):
                nested |= cls.__name__ in _NESTED_BACKWARD
                _as_custom_op(graph, node, adapter, position, ctx)
            else:
                _as_rebuilt_backward(graph, node, cls, ctx, mask, saved_of.get(node.meta["gradfx_node_index"], []))
                adapter.contexts.append(position[node.args[0]])
        elif node.target is runtime_ops.call_node:
            _as_custom_op(graph, node, adapter, position, example_inputs[position[node.args[0]]])
        elif node.target is hook_ops.call_node_post_hooks:  # before the other hook calls: it takes a live node
            python_reads = True  # DDP's reducer reads `.grad`
            _as_post_hooks_op(graph, node, adapter, position)
        elif isinstance(node.target, runtime_ops.SubclassAccumulation):
            python_reads = True  # the leaf's post-accumulate-grad hooks
            grad = node.args[3]
            steal = node.target.may_steal and isinstance(grad, fx.Node) and not _seen_by_python(grad)
            _as_custom_op(graph, node, adapter, position, example_inputs[position[node.args[0]]],
                          runtime_ops.SubclassAccumulation(steal, compiled=True))
        elif isinstance(node.target, runtime_ops.NodeUnpacking):
            python_reads = True  # the user's unpack hooks
            _as_custom_op(graph, node, adapter, position, example_inputs[position[node.args[0]]], node.target)
        elif isinstance(node.target, runtime_ops.SavedUnpack):
            python_reads = True
            _as_unpack_op(graph, node, adapter, position)
        elif isinstance(node.target, runtime_ops.ReadSaved):  # saved values a subclass node reads
            _as_unpack_op(graph, node, adapter, position)
        elif node.target is runtime_ops.release_saved or node.target is runtime_ops.release_hooked:
            graph.erase_node(node)  # compiled code takes no live nodes: released after the run
        elif node.target is runtime_ops.require_gradients:
            _pass_gradients_on(graph, node)
        elif node.target in HOOK_CALLS and node.target is not hook_ops.retain_grad:
            python_reads = True
            # Without the node that runs them (hook_ops._call): compiled code does not answer
            # torch._C._current_autograd_node(), and dynamo would not trace the thread-local.
            node.args = node.args[:-1]
    if not nested and not python_reads:
        _defer_accumulations(graph, accumulations, adapter, position)
    if nested:
        # A reentrant checkpoint runs a backward of its own inside the graph, which may
        # accumulate into the same leaves; dynamo would replay its own `.grad` writes
        # after it, over theirs.  Then every accumulation is an ordered custom op (which
        # never steals: a compiler may reuse the memory of a tensor it passed to an
        # op), and no hook may read `.grad` (dynamo could not see the op's writes).
        if any(n.op == "call_function" and n.target in HOOK_CALLS for n in graph.nodes):
            raise NotImplementedError("a reentrant checkpoint runs a backward of its own inside this graph, "
                                      "which also calls hooks: a compiler cannot order their .grad reads")
        op = _ops().accumulate_grad.default
        for node in accumulations:
            node.target = op
            node.args = (node.args[0], node.args[1], False)
    for node in [n for n in graph.nodes if _is_rebuild(n)]:
        if node.users:  # (run_node takes the inner tensors: _as_custom_op)
            raise NotImplementedError("a tensor subclass rebuilt for a hook or an output (a compiler would "
                                      "trace its construction)")
        graph.erase_node(node)
    adapter.contexts = sorted(set(adapter.contexts))
    adapter.outputs = len(graph.output_node().args[0]) - len(adapter.deferred or ())
    _drop_unused_inputs(graph, adapter, placeholders)
    graph.lint()
    return fx.GraphModule(gm, graph), adapter


def _drop_unused_inputs(graph, adapter, placeholders) -> None:
    """The graph takes what it uses, nothing else: the live nodes its custom ops run go
    through the slot table, deferred accumulations' leaves stay with the run, and what
    the graph reads of no other input (a node a hook no longer takes) is dropped.  So a
    backend's example inputs are tensors and sizes, plus a hook's callable or a custom
    backward's ``ctx.__dict__`` where the graph calls Python that reads them."""
    used = [k for k, n in enumerate(placeholders) if n.users]
    if len(used) == len(placeholders):
        return
    for n in placeholders:
        if not n.users:
            graph.erase_node(n)
    adapter.used = used


def _defer_accumulations(graph, accumulations, adapter, position) -> None:
    """Accumulations leave the graph, which returns their gradients after its own outputs;
    the run accumulates them afterwards (``Adapter.finish``), in their order.

    Only Python can tell when ``.grad`` is written, and this graph runs none that could
    read it.  So a compiler never sees ``leaf.grad``: dynamo would specialise on its being
    None, which gradfx leaves out of its key on purpose, and compile again at the first
    backward that finds a gradient there.  And what a backend's code returns can be
    checked before anything is written: code that computed nothing is caught."""
    out = graph.output_node()
    results = tuple(out.args[0])
    grads = []
    adapter.deferred = []
    for node in accumulations:
        leaf, grad, steal, _ = node.args
        graph.erase_node(node)
        if not isinstance(grad, fx.Node):
            continue  # a None gradient accumulates nothing
        adapter.deferred.append((position[leaf], steal, _may_be_none(grad)))
        grads.append(grad)
    out.args = (results + tuple(grads),)


def _may_be_none(grad: fx.Node) -> bool:
    """Can this gradient be None at run time?  What an opaque node returns can (an
    undefined gradient); an aten op's result or a graph input cannot."""
    source = grad.args[0] if grad.op == "call_function" and grad.target is operator.getitem else grad
    return source.op == "call_function" and source.target is _ops().run_node.default


def _pass_gradients_on(graph, node) -> None:
    """Compiled code runs whole, without the eager graph's stop for a None gradient
    (run.continuation): here an opaque call is a custom op that returns tensors, and a
    custom backward dynamo inlines shows its None to the compiler, which then fails
    and leaves the graph to the eager backend."""
    grads = node.args[0]
    for user in list(node.users):
        user.replace_all_uses_with(grads[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


def _engine_materializes(ctx, grads) -> bool:
    """Does call_backward ask the engine for some of these gradients (see stands_in)?"""
    return ctx.__dict__.get("_gradfx_materialize_grads", True) and any(
        g is None and runtime_ops.stands_in(m) for g, m in zip(grads, ctx._input_metadata))


def _as_rebuilt_backward(graph, node, cls, ctx, mask, saved_nodes):
    it = iter(saved_nodes)
    saved = tuple(next(it) if defined else None for defined in mask)
    valid_edges = tuple(child is not None for child, _ in ctx.next_functions)
    ctx_input, metas, must_be_defined, *grads = node.args
    node.target = backward_caller(cls)
    node.args = (ctx_input, saved, tuple(ctx.needs_input_grad), valid_edges, metas, must_be_defined, *grads)


def _leaves_unneeded_none(autograd_node) -> bool:
    """Does this node compute None for every edge without a next node?  A builtin formula
    computes only the outputs whose edge has one, except a list argument's (computed
    together, as engine_loop.computed says); a custom Function's or C++ Function's
    (CppFunction) backward returns what it returns."""
    name = type(autograd_node).__name__
    if isinstance(autograd_node, torch.autograd.function.BackwardCFunction) or name == "CppFunction":
        return False
    return name not in _GROUPED_OUTPUTS and not name.startswith("Foreach")


def _as_unpack_op(graph, node, adapter, position) -> None:
    """SavedUnpack(node, grads, carry) -> unpack_saved(slot): the tensors the hooks unpacked,
    without the graph's stop (compiled code runs whole), copied into the traced layouts;
    ReadSaved(node) likewise (every value defined)."""
    op = _ops().unpack_saved.default
    slot = next(_slots)
    _slot_unpacks[slot] = node.target
    adapter.slots.append((position[node.args[0]], slot))
    index, k = {}, 0
    for j, want in enumerate(node.target.expected):
        if want is not None:
            index[j], k = k, k + 1
    with graph.inserting_before(node):
        call = graph.call_function(op, (slot,))
    call.meta.update(node.meta)
    for user in list(node.users):  # getitem j -> the j-th defined tensor
        user.args = (call, index[user.args[1]])
    graph.erase_node(node)


def _as_post_hooks_op(graph, node, adapter, position):
    """call_node_post_hooks(node, grads) -> run_node(slot, grads, []): the live node through
    the slot table, as for an opaque node; an effectful op of no outputs."""
    slot = next(_slots)
    _slot_calls[slot] = _run_post_hooks
    _slot_outputs[slot] = ()
    live, grads = node.args
    adapter.slots.append((position[live], slot))
    with graph.inserting_before(node):
        call = graph.call_function(_ops().run_node.default, (slot, list(grads), []))
    call.meta.update(node.meta)
    graph.erase_node(node)


def _run_post_hooks(node, edges, defined, *grads) -> tuple:
    hook_ops.call_node_post_hooks(node, grads)
    return ()


def _as_custom_op(graph, node, adapter, position, autograd_node, call=None):
    """call_node / call_backward(node, metas, must_be_defined, *grads) -> run_node(slot, grads, sizes)
    (``call``: how the node runs, where not call_node)."""
    op = _ops().run_node.default
    slot = next(_slots)
    if call is not None:
        _slot_calls[slot] = call
    live, metas, _, *grads = node.args
    if any(_is_rebuild(g) for g in grads):  # the inner tensors go in; run_node rebuilds
        _slot_rebuilds[slot] = tuple((g.target, len(g.args)) if _is_rebuild(g) else None for g in grads)
        grads = [a for g in grads for a in (g.args if _is_rebuild(g) else (g,))]
    by_edge = {user.args[1]: user for user in node.users}  # getitem of edge k
    # An output for an edge without a next node, which a post-hook sees: its shape is
    # known only once the node ran, so a custom op cannot return it.  Where the node
    # computes None there, the hook is handed None (checked when it runs).
    seen = [k for k in by_edge if metas[k] is None]
    if seen and not _leaves_unneeded_none(autograd_node):
        raise NotImplementedError(f"a post-hook of {autograd_node.name()} sees what it computes for an input "
                                  "without a next node, whose shape is known only when it runs")
    for k in seen:
        user = by_edge.pop(k)
        for use in list(user.users):
            use.args = fx.node.map_arg(use.args, lambda a: None if a is user else a)
        graph.erase_node(user)
    if seen:
        _slot_seen_none[slot] = tuple(seen)
    outputs, sizes, index = [], [], {}
    for k, meta in enumerate(metas):
        if meta is None:
            continue
        shape, dtype = meta
        index[k] = len(outputs)
        outputs.append((len(shape), dtype, _device_of(by_edge.get(k), grads)))
        sizes.extend(shape)
    _slot_outputs[slot] = tuple(outputs)
    adapter.slots.append((position[live], slot))
    with graph.inserting_before(node):
        call = graph.call_function(op, (slot, list(grads), sizes))
    call.meta.update(node.meta)
    for k, user in by_edge.items():  # edge k -> the k-th defined output
        user.args = (call, index[k])
    graph.erase_node(node)


def _is_rebuild(value) -> bool:
    return isinstance(value, fx.Node) and value.op == "call_function" and isinstance(value.target, runtime_ops.Rebuild)


def _refuse_runtime_subclasses(graph) -> None:
    """Raise where a value the run hands from one live call to another may be a tensor
    subclass whose context only the run knows (the capture marked it): a custom op can
    neither take nor return one."""
    for node in graph.nodes:
        if node.meta.get(RUNTIME_SUBCLASS) and any(u.op == "call_function" for u in node.users):
            raise NotImplementedError(f"{node.meta.get('gradfx_node', node.name)} hands on what may be a tensor "
                                      "subclass of a context known only at run time (a hook's result)")


def _flatten_roots(graph, adapter, example_inputs) -> None:
    """flatten(root gradient) -> one placeholder per inner tensor, where the root's was (the
    adapter flattens the root gradient the run hands in: Adapter.expand)."""
    placeholders = list(graph.find_nodes(op="placeholder"))
    for node in list(graph.find_nodes(op="call_function", target=runtime_ops.flatten)):
        root = node.args[0]
        pos = placeholders.index(root)
        count = len(runtime_ops.flatten(example_inputs[pos]))
        with graph.inserting_before(root):
            inner = [graph.placeholder(f"{root.name}_{k}") for k in range(count)]
        for user in list(node.users):  # getitem k -> placeholder k
            inner[user.args[1]].meta.update(user.meta)
            user.replace_all_uses_with(inner[user.args[1]])
            graph.erase_node(user)
        for placeholder in inner:
            placeholder.meta["gradfx_kind"] = "grad"
        graph.erase_node(node)
        if root.users:
            raise NotImplementedError("a subclass root gradient that a live call takes as it is")
        graph.erase_node(root)
        adapter.flatten.append(pos)
    adapter.flatten.sort()


def _device_of(getitem, grads) -> torch.device:
    """The device of an output: as traced, else that of the incoming gradients."""
    for n in ([getitem] if getitem is not None else []) + [g for g in grads if isinstance(g, fx.Node)]:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return torch.device("cpu")
