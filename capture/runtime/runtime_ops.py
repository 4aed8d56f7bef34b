"""Python functions that captured graphs call at run time.

They appear in the fx graph as ``call_function`` nodes.  Each one is a side effect
or touches a live Python object, so backends must not trace into them and DCE must
keep them (``capture.trace.fx_kinds`` says which kind each is).
"""

from __future__ import annotations

import sys
import warnings

import torch
from torch.autograd.variable import Variable
from torch._prims_common import is_non_overlapping_and_dense_or_false

from .. import native
from ..graph import hooks, saved, subclasses, unpacked
from ..graph.saved import release_variables
from . import hook_ops


def _dense(t: torch.Tensor) -> bool:
    return t.is_contiguous() or is_non_overlapping_and_dense_or_false(t)


def _obeys_layout_contract(grad: torch.Tensor, variable: torch.Tensor) -> bool:
    # AccumulateGrad's gradient layout contract, as eager checks it: for a dense
    # parameter, the strides of non-size-1 dims match its own and no size-1 dim has
    # stride 0 (an expanded view, e.g. a sum's gradient); otherwise a contiguous grad.
    if variable.is_nested:
        return False
    if _dense(variable):
        for size, stride, vstride in zip(grad.shape, grad.stride(), variable.stride()):
            if (stride != vstride) if size != 1 else (stride == 0):
                return False
        return True
    return grad.is_contiguous()


def _clone_obey_contract(grad: torch.Tensor, variable: torch.Tensor) -> torch.Tensor:
    if _dense(variable):
        out = grad.new_empty_strided(variable.shape, variable.stride(), dtype=grad.dtype)
        return out.copy_(grad)
    return grad.clone(memory_format=torch.contiguous_format)


# References to an otherwise unshared gradient while accumulate_grad_unchecked
# runs: the graph's local variable, this function's argument, getrefcount's own
# argument (one more when accumulate_grad calls it).
_UNSHARED_REFS = 3


class WrongGradient(RuntimeError):
    """A compiled graph handed accumulate_grad a gradient unlike its leaf.

    Raised only for graphs compiled by a backend gradfx does not generate itself;
    the run path re-raises it as a RuntimeError naming the backend.
    """


def _describe(t) -> str:
    return f"{list(t.shape)} ({t.dtype}, {t.device})"


def accumulate_grad(variable: torch.Tensor, grad: torch.Tensor, may_steal: bool) -> None:
    """AccumulateGrad with eager's semantics, for graphs run by any backend.

    The eager engine only ever accumulates a gradient with the leaf's shape, dtype
    and device; a backend's compiled code that produces anything else is refused
    here (``old += grad`` would broadcast or cast it silently).  Graphs of the
    ``eager`` backend, generated from the traced graph, call
    :func:`accumulate_grad_unchecked` instead.
    """
    if grad is None or not variable.requires_grad:
        return
    dtype = variable.grad_dtype
    if grad.shape != variable.shape or (grad.dtype != dtype and dtype is not None) or grad.device != variable.device:
        raise WrongGradient(f"gave a gradient {_describe(grad)} to accumulate into a leaf {_describe(variable)}")
    accumulate_grad_unchecked(variable, grad, may_steal, _UNSHARED_REFS + 1, calls=2)


def accumulate_grad_unchecked(variable: torch.Tensor, grad: torch.Tensor, may_steal: bool,
                              unshared_refs: int = _UNSHARED_REFS, calls: int = 1) -> None:
    """AccumulateGrad with eager's semantics (grad mode is off while graphs run).

    The first gradient is stolen (``.grad`` becomes the gradient itself) when
    nothing else can see it (the graph says no later use, and no hook kept a
    reference) and it obeys the layout contract, as eager does;
    otherwise it is copied into the parameter's layout.  Later gradients are
    added in place, keeping ``.grad``'s identity.
    """
    if grad is None or not variable.requires_grad:
        return
    old = variable.grad
    if old is None:
        refs = sys.getrefcount(grad)  # before a call here holds it
        unshared = may_steal and _unshared(grad, refs, unshared_refs, calls)
        if grad.is_sparse:
            variable.grad = _sparse_first_grad(grad, unshared)
        elif unshared and _obeys_layout_contract(grad, variable):
            variable.grad = grad.detach()
        else:
            variable.grad = _clone_obey_contract(grad, variable)
    elif old.is_sparse and not grad.is_sparse:
        variable.grad = grad + old
    else:
        old += grad
        if old.stride() != variable.stride():
            _check_layout(old, variable)


def _unshared(grad: torch.Tensor, refs: int, unshared_refs: int, calls: int) -> bool:
    """Does nothing but the graph's one local hold ``grad`` (``refs``: its reference count
    where the caller read it, ``unshared_refs`` if so)?  ``calls``: Python calls between
    the graph's variable and there, each of which may hold one more reference (see
    _call_adds_reference)."""
    return grad._use_count() <= 1 and (
        refs <= unshared_refs or (refs <= unshared_refs + calls and _call_adds_reference()))


def unchecked_accumulator():
    """What the eager backend's graphs accumulate with: the compiled part's AccumulateGrad
    (native/accumulate.cpp: eager's rules in C++, this module's function for every case
    but the common one) where it is loaded, else :func:`accumulate_grad_unchecked`."""
    module = native.module()
    if module is None:
        return accumulate_grad_unchecked
    if not _native:
        # From C, the reference gets the gradient with one reference more than from the
        # graph's code (the graph's stack keeps its argument while C runs), and none for a
        # frame evaluator: C's call copies its arguments into the new frame in any case.
        module.set_accumulate_fallback((accumulate_grad_unchecked, (_UNSHARED_REFS + 1, 0)), _check_layout,
                                       torch.nn.Parameter, _refs_in_local(native.named(module.refcount, "refcount")))
        _native.append(native.named(module.accumulate_grad, "accumulate_grad_native"))
    return _native[0]


_native: list = []


def _refs_in_local(refcount) -> int:
    """The reference count a C function sees of an object the caller holds in one local
    (as the generated graph code holds each gradient)."""
    gradient = object()
    return refcount(gradient)


def _check_layout(result: torch.Tensor, variable: torch.Tensor) -> None:
    """AccumulateGrad's CHECK_RESULT: a warning (once, as TORCH_WARN_ONCE) when ``.grad``
    does not obey the gradient layout contract after an accumulation."""
    global _layout_warned
    if result.is_sparse or variable.is_sparse or result.layout is not torch.strided:
        return
    if _obeys_layout_contract(result, variable) or (_layout_warned and not torch.is_warn_always_enabled()):
        return
    _layout_warned = True
    warnings.warn("grad and param do not obey the gradient layout contract. This is not an error, but may "
                  f"impair performance.\ngrad.sizes() = {list(result.shape)}, strides() = {list(result.stride())}\n"
                  f"param.sizes() = {list(variable.shape)}, strides() = {list(variable.stride())}",
                  UserWarning, stacklevel=2)


_layout_warned = False


def _refs_in_callee(x) -> int:
    return sys.getrefcount(x)


def _call_adds_reference() -> bool:
    """Does a Python call on this thread keep one more reference to its arguments?

    It does while a PEP 523 frame evaluator is installed (dynamo's stays installed
    after a failed compile): the caller's stack keeps them.  Eager decides to steal by
    the gradient's C++ use count; gradfx by its Python reference count, which must not
    count those.  Asked only when a count is just above the usual.
    """
    probe = object()
    return _refs_in_callee(probe) > 3  # the local, the parameter, getrefcount's argument


def accumulate_grad_create_graph(variable: torch.Tensor, grad: torch.Tensor) -> None:
    """AccumulateGrad under grad mode (create_graph): never steals, never in place.

    The first gradient is copied into the parameter's layout (``.grad`` gets the
    copy's history); later ones are added out of place, so ``.grad`` is a new
    tensor each time and the old one is left as it was.
    """
    if grad is None or not variable.requires_grad:
        return
    old = variable.grad
    if old is None:
        variable.grad = grad.clone() if grad.is_sparse else _clone_obey_contract(grad, variable)
    elif old.is_sparse and not grad.is_sparse:
        variable.grad = grad + old
    else:
        variable.grad = old + grad
        _check_layout(variable.grad, variable)


def _sparse_first_grad(grad: torch.Tensor, unshared: bool) -> torch.Tensor:
    # A sparse tensor cannot be detached; eager shares its indices and values in a
    # new sparse tensor when nothing else holds it, else clones it.
    indices, values = grad._indices(), grad._values()
    if unshared and indices.is_contiguous() and values.is_contiguous():
        return torch.sparse_coo_tensor(indices, values, grad.shape, dtype=grad.dtype, device=grad.device,
                                       check_invariants=False)
    return grad.clone()


def _as_node(node, fn, grads):
    """``fn(*grads)`` run as the engine runs ``node``: it is the current autograd node
    meanwhile, and a post-hook registered on it meanwhile is refused (eager runs such a
    hook right after the node; the graph's post-hook calls are fixed)."""
    previous, watched = hook_ops.running_node(node), hooks.watch_registrations()
    try:
        out = fn(*grads)
    finally:
        hook_ops.done_running(previous)
        added = hooks.post_hook_added(node, watched)
    if added:
        raise RuntimeError(f"gradfx: a post-hook was registered on {node.name()} while it ran; eager runs it "
                           "right after the node, a captured graph cannot. Run this backward on the eager engine.")
    return out


def call_node(node, metas, must_be_defined, *grads):
    """Run a real builtin autograd node (an opaque node); validate as the engine does."""
    out = _as_node(node, node, grads)
    return finish_outputs(node.name(), out if type(out) is tuple else (out,), metas, must_be_defined)


class SubclassAccumulation:
    """AccumulateGrad of a leaf that is a tensor subclass (DTensor, ExpandedWeight), called
    as :func:`call_node` is: the real node, which accumulates with the subclass's own ops
    and calls the leaf's post-accumulate-grad hooks.

    Called from Python, the node never steals the first gradient (the call holds
    references to it) and copies it into the leaf's layout, where eager steals it.  A
    subclass tells the two apart: on torch 2.12 DTensor's copy of a Partial gradient into a
    replicated parameter's layout reduces it, and ``.grad`` is Replicate where eager's is
    Partial.  So where eager would steal (``may_steal``: the graph says nothing else sees
    the gradient, marked as for accumulate_grad, and its reference count agrees) ``.grad``
    becomes the gradient itself, detached, and the hooks are called here, in the node's
    stead.  In code a compiler wrote (``compiled``) the gradient's memory is the
    compiler's to reuse and its reference count says nothing: ``.grad`` is then a clone,
    the subclass's own, which nothing can tell from the gradient (nothing else sees it).
    ``listed``: called as ``fn(node, metas, must_be_defined, *inputs)`` with the node's
    input list (run.continuation, node by node), not from a graph's local.
    One per node of a graph.
    """

    __name__ = "accumulate_subclass"

    def __init__(self, may_steal: bool = False, compiled: bool = False, listed: bool = False):
        self.may_steal, self.compiled, self.listed = may_steal, compiled, listed

    def __call__(self, node, metas, must_be_defined, *grads):
        refs = sys.getrefcount(grads[0])  # before anything here holds it (_refs_in_call)
        if (self.may_steal and grads[0] is not None and (self.compiled or _alone(grads[0], refs, self.listed))
                and _steals(node.variable, grads[0])):
            return _as_node(node, _steal_first_grad, (node.variable, grads[0], self.compiled))
        return call_node(node, metas, must_be_defined, *grads)


class ReadSaved:
    """The saved values of a node traced through a tensor subclass, read from the node as it
    would unpack them (eager's checks: freed, modified in place), as the plain tensors the
    graph computes with: a subclass value as its inner tensors (subclasses.flat_inner).
    The walk's sizes hold the id of their layouts and contexts (kinds.walk_subclass_values)."""

    __name__ = "read_saved"

    def __init__(self, attrs: tuple, expected: tuple):
        """``expected``: per inner tensor, (shape, strides, dtype, device) as traced (the
        form SavedUnpack's takes: a compiler's graph reads both through unpack_saved)."""
        self.attrs, self.expected = attrs, expected

    def __repr__(self):
        return f"read_saved{list(self.attrs)}"

    def unpack(self, node) -> tuple:
        out: list = []
        for attr in self.attrs:
            values = getattr(node, attr)
            for value in (values if type(values) is tuple else (values,)):
                if value is not None:
                    subclasses.flat_inner(value, out)
        return tuple(out)

    __call__ = unpack


def flatten(t) -> tuple:
    """The plain tensors a tensor subclass value (a root gradient) consists of."""
    out: list = []
    subclasses.flat_inner(t, out)
    return tuple(out)


class Rebuild:
    """A tensor subclass value (a DTensor gradient) from the inner tensors the graph computed,
    where a runtime call takes it as eager hands it over: an accumulation, a hook, a node
    run as itself."""

    __name__ = "rebuild_subclass"

    def __init__(self, tp: type, names: tuple, ctx, size: tuple, stride: tuple, constants: dict):
        """``names``: the inner tensors' (the call's arguments, in order); ``constants``:
        the inner values that are no tensors, by name."""
        self.tp, self.names, self.ctx, self.size, self.stride = tp, names, ctx, size, stride
        self.constants = constants

    def __call__(self, *inner):
        parts = dict(self.constants)
        parts.update(zip(self.names, inner))
        return self.tp.__tensor_unflatten__(parts, self.ctx, self.size, self.stride)

    def __repr__(self):
        return f"rebuild_subclass[{self.tp.__name__}]"


class _CallProbe:
    def __call__(self, node, metas, must_be_defined, *grads):
        return sys.getrefcount(grads[0])


def _refs_in_call(listed: bool = False) -> int:
    """The reference count SubclassAccumulation reads of a gradient the caller holds in one
    local (``listed``: in one list, passed as ``*inputs``): an object's call also holds its
    arguments in a tuple, then ``grads``; a frame evaluator (dynamo's, left installed by a
    failed compile) may add to it, so a count just above the usual asks again, on this
    thread, now."""
    gradient = object()
    if listed:
        inputs = [gradient]
        del gradient
        return _CallProbe()(None, (), (), *inputs)
    return _CallProbe()(None, (), (), gradient)


_CALL_REFS = {False: _refs_in_call(False), True: _refs_in_call(True)}


def _alone(grad: torch.Tensor, refs: int, listed: bool) -> bool:
    """Does nothing but the caller's one reference hold ``grad`` (``refs``: its count in the
    call)?"""
    usual = _CALL_REFS[listed]
    return grad._use_count() <= 1 and (refs <= usual or (refs == usual + 1 and refs <= _refs_in_call(listed)))


def _steals(variable: torch.Tensor, grad: torch.Tensor) -> bool:
    """Would AccumulateGrad steal ``grad`` as ``variable``'s first gradient (nothing else
    holding it)?  Read without the subclass's ``__torch_function__``."""
    with torch._C.DisableTorchFunctionSubclass():
        return (not torch.is_grad_enabled() and variable.requires_grad and variable.grad_fn is None
                and variable.grad is None and grad.layout is torch.strided and not grad.is_nested
                and (grad.is_mkldnn or _obeys_layout_contract(grad, variable)))


def _steal_first_grad(variable: torch.Tensor, grad: torch.Tensor, copy: bool) -> tuple:
    """AccumulateGrad's steal, then its post-accumulate-grad hooks, as the node calls them."""
    with torch._C.DisableTorchFunctionSubclass():
        variable.grad = _fresh_copy(grad) if copy else grad.detach()
        post = variable._post_accumulate_grad_hooks
    for hook in tuple(post.values()) if post else ():
        hook_ops.call_post_accumulate_hook(hook, variable)  # the running node is set by _as_node
    return ()


def _fresh_copy(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` in memory of its own: for a subclass with the flatten protocol, rebuilt
    around copies of its inner tensors (a DTensor's ``clone`` would reduce a Partial one:
    another placement, other values)."""
    return subclasses.map_inner(grad, torch.Tensor.clone)


class NodeUnpacking:
    """``call_node`` for a builtin node whose saved tensors are under the user's
    saved_tensors_hooks, gradfx doing its unpacks (graph.unpacked): the hooks run once each,
    in the node's order, inside the node, and ``learner`` hears the layouts they gave.  One
    per node of a graph (what it knows of the node is no argument a graph could print)."""

    __name__ = "call_node_unpacking"

    def __init__(self, plan, learner, i: int):
        self.plan, self.learner, self.i = plan, learner, i

    def __call__(self, node, metas, must_be_defined, *grads):
        return run_unpacking(node, metas, must_be_defined, self.plan, self.learner, self.i, grads, None)


def run_unpacking(node, metas, must_be_defined, plan, learner, i, grads, values):
    """Run node ``i`` as the engine would, gradfx unpacking its saved tensors for it (``values``:
    unpacked already, where a graph stopped right after unpacking them: SavedUnpack)."""
    if values is None and native.module() is None:  # turned off since the capture: the node unpacks
        return call_node(node, metas, must_be_defined, *grads)

    def run(*grads):
        found = unpacked.unpack(node, plan) if values is None else values
        if learner is not None:
            learner.learned(i, found)
        return unpacked.with_saved(node, plan, found, node, grads)
    out = _as_node(node, run, grads)
    return finish_outputs(node.name(), out if type(out) is tuple else (out,), metas, must_be_defined)


class SavedUnpack:
    """The saved tensors of a traced node under the user's hooks, unpacked where the node runs
    (the hooks run here, in the node's order): passed on if laid out as ``expected`` (the
    trace's), else the graph stops here (UnpackedOtherwise), handing them over with what the
    rest of the backward needs."""

    __name__ = "unpack_saved"

    def __init__(self, plan, expected: tuple, frontier: int):
        self.plan, self.expected, self.frontier = plan, expected, frontier

    def unpack(self, node) -> tuple:
        previous = hook_ops.running_node(node)
        try:
            return unpacked.unpack(node, self.plan)
        finally:
            hook_ops.done_running(previous)

    def __call__(self, node, grads: tuple, carry: tuple) -> tuple:
        values = self.unpack(node)
        meta = unpacked.meta
        for value, want in zip(values, self.expected):
            if meta(value) != want:
                raise UnpackedOtherwise(self.frontier, grads, carry, values)
        return values


def call_backward(ctx, metas, must_be_defined, *grads):
    """Run a custom Function's backward with its real ctx, as the engine's PyNode does.

    Undefined incoming gradients are materialized as zeros unless the Function
    called ``ctx.set_materialize_grads(False)``; the result is checked and mapped
    onto the node's edges (one per tensor input of the forward).
    """
    if ctx.__dict__.get("_gradfx_materialize_grads", True) and any(g is None for g in grads):
        metadata = ctx._input_metadata
        if any(g is None and stands_in(m) for g, m in zip(grads, metadata)):
            grads = materialized_by_engine(ctx, grads)
        else:
            grads = tuple(torch.zeros(m.shape, dtype=m.dtype, device=m.device) if g is None else g
                          for g, m in zip(grads, metadata))
    outs = function_outputs(ctx.name(), ctx.needs_input_grad, _as_node(ctx, ctx.apply, grads),
                            [m is not None for m in metas])
    return finish_outputs(ctx.name(), outs, metas, must_be_defined)


def release_saved(node, raw_attrs: tuple) -> None:
    """Release the saved tensors of a node run opaquely, after its post-hooks, as the
    engine does after each node of a backward that does not keep its graph (they
    were kept to the end of the backward, holding every such node's memory)."""
    if hook_ops.keeps_graph() is not False:
        return
    for attr in raw_attrs:
        raw = getattr(node, attr)
        release_variables(raw if type(raw) is tuple else (raw,))


def release_hooked(node) -> None:
    """Release the saved variables of a node under the user's saved_tensors_hooks right after
    it ran (its post-hooks), as the engine does in a backward that does not keep its graph:
    what the hooks packed goes then (a checkpoint's frame, its block's saved inputs)."""
    if hook_ops.keeps_graph() is False:
        saved.release_hooked(node)


def stands_in(meta) -> bool:
    """Might this input metadata of a custom Function's node be a stand-in?

    An output marked non-differentiable, or one that is not a tensor, gets a
    default-constructed metadata entry (a CPU scalar of the default dtype at the
    time); PyNode materializes its missing gradient from the forward output's own
    shape and dtype (or passes None), which Python cannot read.  A real CPU scalar
    output looks the same.
    """
    return len(meta.shape) == 0 and meta.device.type == "cpu" and not meta.is_nested_tensor


class _Materialized(Exception):
    def __init__(self, grads):
        super().__init__("gradfx: materialized gradients (never seen by users)")
        self.grads = grads


def materialized_by_engine(ctx, grads) -> tuple:
    """The gradients PyNode::apply would pass to ``ctx``'s backward, from the engine.

    Where a missing gradient's slot has a stand-in metadata entry, only the engine
    knows what to pass: it is asked to run the node with the defined gradients as
    roots, and the node's ``apply`` is replaced for that call by one that records
    its arguments and stops the engine before the user's backward runs.  Nothing
    else runs: the node has no hooks (the capture checks), and the engine stops
    inside the node.
    """
    metadata = ctx._input_metadata
    roots = [k for k, g in enumerate(grads) if g is not None]
    given = list(grads)
    if not roots:
        # Eager materializes every slot; a slot with real metadata can be the root.
        real = [k for k, m in enumerate(metadata) if not stands_in(m)]
        if not real:
            raise RuntimeError(f"gradfx: {ctx.name()} received no gradient at all and its outputs' shapes "
                               "cannot be read; run this backward on the eager engine")
        m = metadata[real[0]]
        given[real[0]] = torch.zeros(m.shape, dtype=m.dtype, device=m.device)
        roots = real[:1]
    edges = [torch.autograd.graph.GradientEdge(n, nr) for n, nr in ctx.next_functions if n is not None]
    if not edges:
        return tuple(given)

    def record(*args):
        raise _Materialized(args[0] if len(args) == 1 and type(args[0]) is list else args)

    attrs = ctx.__dict__
    attrs["apply"] = attrs["apply_boxed"] = record
    try:
        # The C++ engine itself, not gradfx's routing in front of it (see run.routing).
        engine = Variable._execution_engine
        engine = getattr(engine, "engine", engine)
        engine.run_backward(tuple(torch.autograd.graph.GradientEdge(ctx, k) for k in roots),
                            tuple(given[k] for k in roots), True, False, tuple(edges[:1]), True, False)
    except _Materialized as done:
        return tuple(g if g is not None else m for g, m in zip(grads, done.grads))
    finally:
        del attrs["apply"], attrs["apply_boxed"]
    raise RuntimeError(f"gradfx: the engine did not run {ctx.name()} to materialize its gradients")


def function_outputs(name: str, needs_input_grad, result, valid_edges) -> list:
    """A custom Function's backward result as one gradient per edge (PyNode::apply's rules).

    Extra trailing Nones are dropped and the count must equal the forward's inputs.
    Edges exist for tensor inputs only; the valid ones (inputs that require grad)
    appear in the same order as the True entries of ``needs_input_grad``, the others
    (no next node) get what the backward returned for them, for the post-hooks.  Written
    for dynamo as well: the traceable form of a custom Function calls it too.
    """
    if type(result) is not tuple:
        result = (result,)
    n = len(needs_input_grad)
    if len(result) > n and all(r is None for r in result[n:]):
        result = result[:n]
    if len(result) != n:
        raise RuntimeError(f"function {name} returned an incorrect number of gradients "
                           f"(expected {n}, got {len(result)})")
    _check_function_result(name, needs_input_grad, result, len(valid_edges))
    wanted = [r for r, need in zip(result, needs_input_grad) if need]
    n_unneeded = len(valid_edges) - sum(valid_edges)
    if not n_unneeded:  # every edge has a next node (the common case): nothing else to place
        return wanted
    wanted, unneeded = iter(wanted), iter(_unneeded_gradients(needs_input_grad, result, n_unneeded))
    return [next(wanted) if valid else next(unneeded) for valid in valid_edges]


def _unneeded_gradients(needs_input_grad, result, n_edges: int) -> list:
    """What the backward returned for each edge without a next node (a tensor input that
    needs no gradient), in order: eager hands it to the node's post-hooks.

    Those are among the inputs that need no gradient, where Python cannot tell tensors
    from other values: one given a gradient is a tensor (PyNode refuses one for anything
    else), and ``n_edges`` says how many of those given None are tensors too.  A gradient
    whose edge that leaves open (such Nones both before and after it) stays None.
    """
    given = [r for r, need in zip(result, needs_input_grad) if not need]
    hidden = n_edges - sum(r is not None for r in given)  # tensors among the Nones
    out = [None] * n_edges
    nones_before, nones_after, placed = 0, sum(r is None for r in given), 0
    for r in given:
        if r is None:
            nones_before, nones_after = nones_before + 1, nones_after - 1
            continue
        low, high = max(0, hidden - nones_after), min(hidden, nones_before)  # tensors before it
        if low == high:
            out[placed + low] = r
        placed += 1
    return out


def _check_function_result(name: str, needs_input_grad, result, n_tensor_inputs: int) -> None:
    """PyNode::apply's checks of each gradient: None for an input that was not a tensor,
    else a tensor or None.  Python sees which inputs were tensors only through their
    count (one edge each): an input that needs no gradient is known not to be a tensor
    when every tensor input needs one, or when more such inputs got a gradient than
    there are tensors among them."""
    untracked = n_tensor_inputs - sum(map(bool, needs_input_grad))  # tensors needing no gradient
    extra = sum(1 for r, need in zip(result, needs_input_grad) if not need and r is not None)
    for i, (r, need) in enumerate(zip(result, needs_input_grad)):
        if r is None:
            continue
        if not need and (untracked == 0 or extra > untracked):
            raise RuntimeError(f"function {name} returned a gradient different than None at position {i + 1}, "
                               "but the corresponding forward input was not a Variable")
        if not isinstance(r, torch.Tensor):
            raise RuntimeError(f"expected Variable or None (got {type(r).__name__})")


def check_gradient_count(name: str, got: int, expected: int) -> None:
    """engine.cpp validate_outputs' first check, with its message."""
    if got != expected:
        raise RuntimeError(f"Function {name} returned an invalid number of gradients - "
                           f"expected {expected}, but got {got}")


def finish_outputs(name, outs, metas, must_be_defined):
    """validate_outputs at run time for an opaque call, whose outputs may be None."""
    check_gradient_count(name, len(outs), len(metas))
    result = []
    for k, (g, meta) in enumerate(zip(outs, metas)):
        if meta is None:
            # No next node: eager leaves it unchecked for the node's post-hooks (which see
            # it), then drops it.
            result.append(g)
        elif g is None:
            if must_be_defined[k]:
                raise RuntimeError(
                    f"gradfx: {name} returned None for gradient {k}, which the captured graph "
                    "feeds to a traced formula; this backward cannot run under gradfx (it ran "
                    "as far as this node). Run it on the eager engine.")
            result.append(None)
        else:
            result.append(validate_output(g, meta[0], meta[1], name, k))
    return tuple(result)


class Diverged(Exception):
    """A gradient the captured graph traced as a tensor is None at run time: the graph
    stops, and the backward goes on as eager runs it (see run.continuation)."""

    def __init__(self, frontier: int, grads: tuple, carry: tuple):
        super().__init__("gradfx: a gradient turned out None where the captured graph traced a tensor")
        self.frontier, self.grads, self.carry = frontier, grads, carry


class UnpackedOtherwise(Diverged):
    """Saved tensors the user's hooks unpacked are laid out otherwise than the graph was
    traced for: the graph stops, and the node runs on them (see run.continuation)."""

    def __init__(self, frontier: int, grads: tuple, carry: tuple, values: tuple):
        super().__init__(frontier, grads, carry)
        self.values = values


def require_gradients(grads: tuple, defined: tuple, none: tuple, frontier: int, carry: tuple) -> tuple:
    """The gradients of a traced formula, some from opaque calls: passed through if those
    at ``defined`` are plain tensors and those at ``none`` are None, as the graph was
    traced; else (None, or a tensor subclass, which the formula was not traced for) the
    graph stops here (Diverged), handing over ``carry``, what the rest of the backward
    needs."""
    for k in defined:
        if type(grads[k]) is not torch.Tensor:
            raise Diverged(frontier, grads, carry)
    for k in none:
        if grads[k] is not None:
            raise Diverged(frontier, grads, carry)
    return grads


def add_grads(old, new):
    """InputBuffer::add for gradients that may be None at run time."""
    if old is None:
        return new
    if new is None:
        return old
    return old + new


def validate_output(grad, shape, dtype, node_name: str, index: int):
    """engine.cpp's validate_outputs for one gradient: reduce broadcast, cast dtype."""
    if grad is None:
        return None
    grad = hook_ops.plain_tensor(grad)
    # Lengths first: comparing a symbolic size with an unrelated static one that
    # happens to be equal would specialize the symbol.
    if len(grad.shape) != len(shape) or grad.shape != shape:
        if not _expandable(shape, grad.shape):
            raise RuntimeError(
                f"Function {node_name} returned an invalid gradient at index {index} - got "
                f"{list(grad.shape)} but expected shape compatible with {list(shape)}")
        grad = grad.sum_to_size(shape)
    if grad.dtype != dtype and dtype is not None:  # None: a leaf whose grad_dtype is None
        grad = grad.to(dtype)
    return grad


def _expandable(shape, desired) -> bool:
    # Can a tensor of `shape` be expanded to `desired`?  (at::is_expandable_to)
    if len(shape) > len(desired):
        return False
    for s, d in zip(reversed(shape), reversed(desired)):
        if s != d and s != 1:
            return False
    return True
