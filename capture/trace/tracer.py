"""Trace one backward call into a torch.fx graph, on fake tensors.

The tracer is one runner of :mod:`engine_loop` (the eager engine's order of
work): running a builtin node on fake tensors records the aten ops of its own
backward formula (torch's proxy mode does the recording); a node that cannot run
on fake tensors becomes an opaque ``call_node`` of the real node; hooks, custom
backwards and accumulation become calls of gradfx's runtime functions.  Because
the order is the engine's, buffers are summed and leaves accumulated in eager's
order, so replaying the graph is bitwise eager.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._subclasses.fake_impls import fast_detach
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.function import BackwardCFunction
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import (
    PythonKeyTracer,
    ProxyTorchDispatchMode,
    disable_proxy_modes_tracing,
    fetch_sym_proxy,
    get_proxy_slot,
    track_tensor_tree,
)
from torch._prims_common import is_contiguous_or_false, make_contiguous_strides_for
from torch.utils._python_dispatch import _disable_current_modes
from torch.fx.experimental.symbolic_shapes import ShapeEnv, _suppress_guards

from .. import native
from ..runtime import ddp_buckets, gloo_ring, hook_ops, runtime_ops
from . import aot_regions, engine_loop, fast_ops, plain_layout, sym_memo
from .fx_kinds import BUFFER_SUM, CPP_POST_HOOKS, RUNTIME_SUBCLASS
from .scoped_patch import ScopedPatch
from .getitems import unpack_right_after
from .rules import HIDDEN_RULES, RUN_REAL, RUN_REAL_WITH_HISTORY, TAKES_NONE, apply_rule
from .rules_builtin import copy_slices
from .shapes import SymbolicSizes
from ..graph import hidden as graph_hidden, subclasses, unpacked
from ..graph.distributed import reducer_of
from ..graph.saved import ForeignOwned, foreign_hooks, saved_layouts, substitute, substituted, take_saved
from ..graph.kinds import ACCUMULATE, FUNCTION, REGION_INTS, SUBCLASS_GRADS, subclass_grads, type_info
from ..graph.walk import BackwardCall
from ..errors import _Fallback

log = logging.getLogger("gradfx")


@dataclass
class Trace:
    graph: fx.Graph
    opaque: list  # labels of nodes that run opaquely
    seconds: float
    frontiers: list  # per continuation point of the graph (require_gradients): its Frontier
    unpacks: bool = False  # it unpacks saved tensors under the user's hooks itself (graph.unpacked)


# Nodes whose fake-tensor kernels guard on sizes only to pick an output memory
# format heuristically (convolution picks a backend by batch size).  The graph
# replays the real op, which picks its own layout, so those guards are not
# recorded: they would only cause recaptures.
LAYOUT_ONLY_GUARDS = frozenset({"ConvolutionBackward0"})


class _SymbolicSaved:
    """``saved`` for a rule while tracing: size values symbolic, the rest as saved."""

    def __init__(self, node, i, tracer):
        self._node, self._i, self._tracer = node, i, tracer

    def __getattr__(self, name):
        attr = "_saved_" + name
        slot = self._tracer.call.records[self._i].values.get(attr)
        if slot is not None:
            value = self._tracer.symbolic.rebuild(*slot)
        else:
            value = substituted(self._node, name)
            if value is None:
                value = getattr(self._node, attr)  # tensors come back as fakes (substituted)
        self.__dict__[name] = value  # a rule reading it again gets the same object
        return value

    def reshape(self, grad, shape):
        return self._tracer.reshape(grad, shape)


class _Input:
    """Stands for a non-tensor runtime input (hook, leaf, node) while tracing."""

    __slots__ = ("pos",)

    def __init__(self, pos: int):
        self.pos = pos


class _Unshaped:
    """What an opaque call returned for an edge without a next node, which only the
    node's post-hooks see: a tensor, or None, whose shape and dtype nothing says before
    the node runs (no next node holds its metadata).  The graph hands the call's output
    on as it is; it gets no fake."""

    __slots__ = ("proxy",)

    def __init__(self, proxy):
        self.proxy = proxy


_UNSHAPED = _Unshaped(None)  # ``like`` of such an output (python_call binds a new one)


class _Tracer:
    def __init__(self, call: BackwardCall, symbolic: SymbolicSizes | None, assumed_none=frozenset(), learner=None):
        self.call = call
        self.symbolic = symbolic
        # Saved tensors under the user's hooks are unpacked by the graph itself in static
        # traces (graph.unpacked): their layouts are known only as a static backward found
        # them, and a symbolic graph would learn one layout per size.
        self.learner = learner if symbolic is None and not call.create_graph else None
        self.unpacks = False
        self.state = None  # the engine state of the step being traced (for frontiers)
        # (node index, input): gradients from opaque calls that were None when an earlier
        # graph of this structure stopped; traced as None this time (checked at run time).
        self.assumed_none = assumed_none
        dynamic = symbolic is not None
        self.shape_env = symbolic.shape_env if dynamic else ShapeEnv()
        self.fake_mode = FakeTensorMode(shape_env=self.shape_env, static_shapes=not dynamic)
        # Fake tensors cache each op's output metadata by its arguments.  With symbolic sizes
        # a backward's ops almost never repeat a key (every size is its own expression), and
        # building the entries cost a quarter of a symbolic trace of GPT-2: off for those.
        self.fake_mode.cache_enabled = not dynamic
        self.tracer = PythonKeyTracer()
        self.tracer.root = torch.nn.Module()
        self.tracer.graph = fx.Graph(tracer_cls=PythonKeyTracer)
        self.tracer.tensor_attrs = {}
        self.proxy_mode = ProxyTorchDispatchMode(self.tracer, tracing_mode="symbolic" if dynamic else "fake")
        self.opaque: list = []
        self.object_proxies: dict = {}
        self.maybe_none: set[int] = set()  # ids of fakes that may be None at run time
        self.keep: list = []  # keeps those fakes alive so their ids stay unique
        self.layouts: dict = {}  # layout -> the fake that fakes of that layout are detached from
        self.kinds = call.kinds  # the loop turns a node opaque here when it cannot be traced
        self.frontiers: list = []  # per require_gradients call: where the graph may stop
        self.placeholder_values: list = []  # per runtime input: its fake, or the value itself
        self.recovered: dict = {}  # node index -> what its hidden rule recovered (None: runs real)
        # Tensor subclasses traced through (graph.subclasses): the fake subclass values
        # rebuilt for runtime calls (id -> proxy), and the ids of fakes standing for what a
        # runtime call returned where a subclass went in (a hook's result: of a context
        # only the run knows; a traced formula never takes those).
        self.rebuilt: dict = {}
        self.unknown: set[int] = set()
        self.saved_table: dict | None = None  # the substitution table (saved.substitute)

    # -- inputs --------------------------------------------------------------
    def placeholders(self):
        """One placeholder per runtime input; tensors get fakes bound to them."""
        call = self.call
        names = {"grad": "grad", "saved": "saved", "variable": "leaf", "node": "node",
                 "hook": "hook", "retained": "retained"}
        fakes = []
        symbolic = self.symbolic
        if symbolic is not None:  # one size input per dynamic position, first
            for p in symbolic.positions:
                proxy = self.tracer.create_proxy("placeholder", f"size_{p}", (), {})
                proxy.node.meta["gradfx_kind"] = "size"
                proxy.node.meta["val"] = symbolic.symint[p]
                track_tensor_tree(symbolic.symint[p], proxy, constant=None, tracer=self.tracer)
            if symbolic.derived:  # products of the size inputs, computed in the graph
                with self.fake_mode, self.proxy_mode:
                    for p, product in symbolic.derived.items():
                        value = product.const
                        for root in product.factors:
                            value = symbolic.symint[root] * value
                        symbolic.symint[p] = value
        for i, (value, kind) in enumerate(zip(call.inputs, call.input_kinds)):
            proxy = self.tracer.create_proxy("placeholder", f"{names[kind]}_{i}", (), {})
            proxy.node.meta["gradfx_kind"] = kind
            owner = call.input_owner[i]
            if owner >= 0:
                proxy.node.meta["gradfx_node"] = call.node_label(owner)
                proxy.node.meta["gradfx_node_index"] = owner  # labels repeat (leaves): groups need the index
            if kind == "grad" and i not in call.tensor_slots:  # a subclass root gradient (walk.root_layout_id)
                fakes.append(self.subclass_root(i, value, proxy))
            elif kind in ("grad", "saved"):
                fake = self.fake_tensor(i, value)
                track_tensor_tree(fake, proxy, constant=None, tracer=self.tracer)
                proxy.node.meta["val"] = fake
                fakes.append(fake)
            else:
                self.object_proxies[i] = proxy
                fakes.append(value)
        self.placeholder_values = fakes
        return fakes

    def subclass_root(self, pos, value, proxy):
        """The fake for a root gradient that is a tensor subclass (a DTensor loss's): in a
        static trace, the subclass around fakes of its inner tensors, which the graph reads
        off the gradient (runtime_ops.flatten); in a symbolic one, a plain fake standing for
        what the run hands in (the nodes it reaches run as themselves)."""
        if self.symbolic is not None or self.call.create_graph:
            fake = self.new_fake(tuple(value.shape), tuple(value.stride()), value.dtype, value.device)
            track_tensor_tree(fake, proxy, constant=None, tracer=self.tracer)
            self.mark_unknown(fake)
            return fake
        flat: list = []
        subclasses.flat_inner(value, flat)
        node = self.tracer.create_node("call_function", runtime_ops.flatten, (proxy.node,), {})
        node.meta["gradfx_kind"] = "compute"
        inner = []
        for k, t in enumerate(flat):
            fake = self.new_fake(tuple(t.shape), "contiguous" if t.is_contiguous() else tuple(t.stride()), t.dtype,
                                 t.device)
            track_tensor_tree(fake, self.tracer.proxy(node)[k], constant=None, tracer=self.tracer)
            inner.append(fake)
        fake = _fake_like(value, iter(inner))
        self.rebuilt[id(fake)] = proxy  # a runtime call given it gets the root gradient itself
        self.keep.append(fake)
        return fake

    def fake_tensor(self, pos, value):
        if self.symbolic is None:
            # its layout is all a trace reads of it; a create_graph trace records history and
            # formulas may look at requires_grad: there the real tensor's own fake
            if _plain(value) and not self.call.create_graph:
                strides = "contiguous" if value.is_contiguous() else tuple(value.stride())
                return self.new_fake(tuple(value.shape), strides, value.dtype, value.device)
            return self.fake_mode.from_tensor(value)  # 0.4-0.8 ms each: views, autograd, bits
        start, ndim, stride_start = self.call.tensor_slots[pos]
        shape = self.symbolic.values(start, ndim)
        strides = "contiguous" if stride_start < 0 else self.symbolic.values(stride_start, ndim)
        return self.new_fake(shape, strides, value.dtype, value.device)

    def new_fake(self, shape, strides, dtype, device):
        """A fake tensor of this layout (``strides`` may be ``"contiguous"``), detached from
        one made once per layout and trace: making a fake with symbolic sizes costs about
        0.5 ms of SymInt arithmetic (numel, storage size, contiguity), detaching one 20 us.
        Fakes of one layout share their meta storage, which no traced op reads."""
        key = (tuple(map(plain_layout.expr, shape)),
               strides if strides == "contiguous" else tuple(map(plain_layout.expr, strides)), dtype, device)
        with disable_proxy_modes_tracing(), self.fake_mode:
            template = self.layouts.get(key)
            if template is None:
                if strides == "contiguous":
                    strides = make_contiguous_strides_for(shape)
                template = self.layouts[key] = torch.empty_strided(shape, strides, dtype=dtype, device=device)
            return fast_detach(self.fake_mode, template)

    def reshape(self, grad, shape):
        """``grad.reshape(shape)`` recorded directly where the sizes' expressions decide
        it (:mod:`plain_layout`): a view, or a contiguous copy viewed (what ATen's
        reshape does where no view exists).  Fake reshape would reach the same by
        proving stride equalities in sympy, a guard each (on GPT-2's first symbolic
        capture its view backwards took 1.35 s that way, 0.8 s this way).  None where
        the expressions do not decide it (then: reshape on the fakes)."""
        with disable_proxy_modes_tracing():  # size arithmetic for the guards, not the graph
            numel = 1
            for d in shape:
                numel = numel * d
            # a guard where sizes are symbolic, as reshape records; none where the two
            # are one expression (the sizes related before tracing: size_relations)
            if not plain_layout.plainly_equal(grad.numel(), numel) and grad.numel() != numel:
                return None
            if plain_layout.plainly_contiguous(grad):
                strides = "contiguous"
            else:
                strides = plain_layout.view_strides(grad.shape, grad.stride(), shape, self.shape_env)
                if strides is plain_layout.UNDECIDED:
                    if not is_contiguous_or_false(grad):
                        return None
                    strides = "contiguous"
        if strides is None:  # no view: ATen's _unsafe_view(self.clone(contiguous_format), shape)
            copy = self.record_op(torch.ops.aten.clone.default, (grad,), grad.shape, "contiguous",
                                  {"memory_format": torch.contiguous_format})
            return self.record_op(torch.ops.aten._unsafe_view.default, (copy, list(shape)), shape, "contiguous")
        return self.record_op(torch.ops.aten.view.default, (grad, list(shape)), shape, strides)

    def record_op(self, func, args, shape, strides, kwargs=None):
        """Record ``func(*args, **kwargs)`` whose output the caller has laid out (``shape``,
        ``strides``; dtype and device of ``args[0]``): no fake-tensor dispatch."""
        like = args[0]
        return self._record(func, args, kwargs, self.new_fake(shape, strides, like.dtype, like.device))

    def record_several(self, func, args, layouts, kwargs=None):
        """Record ``func(*args, **kwargs)`` with several outputs the caller has laid out
        (per output ``(shape, strides, like)``, or None for an undefined one)."""
        outs = tuple(None if spec is None else self.new_fake(spec[0], spec[1], spec[2].dtype, spec[2].device)
                     for spec in layouts)
        return self._record(func, args, kwargs, outs)

    def _record(self, func, args, kwargs, out):
        args = tuple([self.arg(x) for x in a] if type(a) is list else self.arg(a) for a in args)  # lists stay lists
        proxy = self.tracer.create_proxy("call_function", func, args, kwargs or {})
        proxy.node.meta["original_aten"] = func
        track_tensor_tree(out, proxy, constant=None, tracer=self.tracer)
        return out

    def sum_to(self, grad, shape):
        """The engine's reduction of a broadcast gradient to its input's shape (at::sum_to)
        where the sizes' expressions decide which dims it sums; None where they do not
        (then: validate_output on the fakes, which also raises eager's error for a shape
        that is not a broadcast of the input's)."""
        sizes = grad.shape
        lead = len(sizes) - len(shape)
        if lead < 0:
            return None
        dims = list(range(lead))
        for d in range(lead, len(sizes)):
            want = shape[d - lead]
            if plain_layout.plainly_equal(want, sizes[d]):
                continue
            if plain_layout.expr(want) != 1:
                return None  # two different sizes: a wrong gradient, or equal only for some sizes
            dims.append(d)  # 1 against a size that is not 1 as written: a symbol (>= 2) or an int
        if dims:
            grad = grad.sum(dims, keepdim=True)
        return self.reshape(grad, shape) if lead > 0 else grad

    def meta(self, i, nr):
        """(shape, dtype, device) of input ``nr`` of node ``i``, sizes symbolic where they are."""
        node = self.call.nodes[i]
        m = node._input_metadata[nr]
        # A leaf's gradient is cast to its grad_dtype (None: kept as it comes).
        dtype = node.variable.grad_dtype if self.call.records[i].kind is ACCUMULATE else m.dtype
        if self.symbolic is None:
            return tuple(m.shape), dtype, m.device
        return tuple(self.symbolic.values(self.meta_start(i, nr), len(m.shape))), dtype, m.device

    def meta_start(self, i, nr):
        """Where input ``nr`` of node ``i``'s metadata shape starts in the sizes (None if
        the walk read none of that node's: a node autograd.grad does not run)."""
        start = self.call.records[i].meta_start
        if start is None:
            return None
        return start + sum(len(m.shape) for m in self.call.nodes[i]._input_metadata[:nr])

    def walked_meta(self, i, nr):
        """(shape, dtype) of input ``nr`` of node ``i`` with the shape as the size list
        holds it (symbolic where it is: what the guard checks), or None where the walk
        read none."""
        start = self.meta_start(i, nr)
        if start is None:
            return None
        m = self.call.nodes[i]._input_metadata[nr]
        n = len(m.shape)
        shape = self.symbolic.values(start, n) if self.symbolic is not None else self.call.sizes[start:start + n]
        return tuple(shape), m.dtype

    def recover(self, i):
        """What node ``i``'s hidden rule reads, rebuilt from metadata (rules.HIDDEN_RULES),
        once per trace; None where the metadata does not determine it."""
        if i not in self.recovered:
            node, rec = self.call.nodes[i], self.call.records[i]
            inputs = [None if e is None else self.walked_meta(*e) for e in rec.edges]
            observed = rec.hooks is not None and bool(rec.hooks.post)
            recover = HIDDEN_RULES[type(node).__name__][0]
            self.recovered[i] = recover(node, self.walked_meta(i, 0), inputs, observed)
        return self.recovered[i]

    def proxy(self, x):
        return get_proxy_slot(x, self.tracer).proxy

    # -- recording side-effecting calls -------------------------------------
    def record(self, fn, args, label):
        # The arguments are proxies, tuples and constants (see ``arg``): their fx nodes
        # directly, without the tracer's generic conversion (which costs microseconds per
        # element, and a stop hands over hundreds).
        node = self.tracer.create_node("call_function", fn, _fx_args(args), {})
        node.meta["gradfx_node"] = label
        return self.tracer.proxy(node)

    def python_call(self, fn, args, like, label, kind):
        """Record ``fn(*args)`` with Python semantics; its result looks like ``like``.

        ``like`` is None (no result), a fake tensor or None (one result), or a tuple
        of those (a tuple result).  Returns fakes bound to the call's proxy.
        """
        proxy = self.record(fn, tuple(self.arg(a) for a in args), label)
        proxy.node.meta["gradfx_kind"] = kind
        self.last_call = proxy.node
        if like is None and not isinstance(like, tuple):
            return None
        single = not isinstance(like, tuple)
        items = (like,) if single else like
        outs = []
        for k, x in enumerate(items):
            if x is None:
                outs.append(None)
            elif isinstance(x, _Unshaped):
                outs.append(_Unshaped(proxy if single else proxy[k]))
            else:
                fake = self.new_fake(x.shape, x.stride(), x.dtype, x.device)
                track_tensor_tree(fake, proxy if single else proxy[k], constant=None, tracer=self.tracer)
                if type(x) is not FakeTensor or id(x) in self.unknown:  # a subclass went in
                    self.mark_unknown(fake)
                outs.append(fake)
        return outs[0] if single else tuple(outs)

    def arg(self, x):
        if isinstance(x, _Input):
            return self.object_proxies[x.pos]
        if isinstance(x, _Unshaped):
            return x.proxy
        if isinstance(x, torch.Tensor):
            return self.proxy(x) if type(x) is FakeTensor else self.rebuilt_proxy(x)
        if isinstance(x, (tuple, list, torch.Size)):
            return tuple(self.arg(a) for a in x)
        if isinstance(x, torch.SymInt):  # a symbolic size: the graph value that computes it
            return fetch_sym_proxy(self.tracer)(x)
        return x

    def mark_unknown(self, fake) -> None:
        """``fake`` stands for a runtime value that may be a tensor subclass whose context only
        the run knows; its fx node says so too (a compiler's form of the graph refuses it:
        backends.traceable)."""
        self.unknown.add(id(fake))
        self.keep.append(fake)
        self.proxy(fake).node.meta[RUNTIME_SUBCLASS] = True

    def rebuilt_proxy(self, x):
        """The graph value of fake subclass ``x`` (traced through) as a runtime call takes it:
        the subclass rebuilt from its inner tensors (runtime_ops.Rebuild), once per value, so
        that every call sees one object, as in eager."""
        proxy = self.rebuilt.get(id(x))
        if proxy is None:
            names, ctx = subclasses.flatten(x)
            parts = {n: getattr(x, n) for n in names}
            tensors = tuple(n for n in names if isinstance(parts[n], torch.Tensor))
            inner = tuple(self.arg(parts[n]) for n in tensors)
            fn = runtime_ops.Rebuild(type(x), tensors, ctx, tuple(x.shape), tuple(x.stride()),
                                     {n: v for n, v in parts.items() if n not in tensors})
            node = self.tracer.create_node("call_function", fn, _fx_args(inner), {})  # labelled by step
            proxy = self.rebuilt[id(x)] = self.tracer.proxy(node)
            self.keep.append(x)
        return proxy

    # -- hooks, in eager's order ---------------------------------------------
    def tensor_pre_hooks(self, i, spec, inputs):
        label = self.call_label(i)
        inputs = list(inputs)
        for nr, positions in spec.tensor_pre:
            for pos in positions:
                grad = inputs[nr]
                inputs[nr] = self.python_call(hook_ops.call_tensor_hook, (_Input(pos), grad, self.running(i)), grad,
                                              label, "hook")
                if grad is not None and id(grad) in self.maybe_none:  # None stays None
                    self.may_be_none((inputs[nr],))
        for nr, pos in spec.retain:
            self.python_call(hook_ops.retain_grad, (_Input(pos), inputs[nr]), None, label, "hook")
        return inputs

    def pre_hooks(self, i, spec, inputs):
        label = self.call_label(i)
        grads = tuple(inputs)
        for pos in spec.pre:
            grads = self.python_call(hook_ops.call_pre_hook, (_Input(pos), grads, self.running(i)), grads, label,
                                     "hook")
            self.may_be_none(grads)
        return list(grads)

    def post_hooks(self, i, spec, outputs, inputs):
        label = self.call_label(i)
        outs = tuple(outputs)
        for pos, incoming in zip(spec.post, spec.post_incoming):
            # A module's output hook hands on the node's incoming gradients: None where none came.
            like = tuple(o if g is not None else None for o, g in zip(outs, inputs)) if incoming else outs
            outs = self.python_call(hook_ops.call_post_hook, (_Input(pos), outs, tuple(inputs), self.running(i)), like,
                                    label, "hook")
            self.may_be_none(outs)
        return list(outs)

    def may_be_none(self, grads) -> None:
        """Gradients a node hook returned: it may put None in place of any of them."""
        for g in grads:
            if g is not None:
                self.maybe_none.add(id(g))
                self.keep.append(g)

    def native_post_hooks(self, i, inputs):
        self.python_call(hook_ops.call_node_post_hooks, (self.running(i), tuple(inputs)), None, self.call_label(i),
                         "hook")
        spec = self.call.records[i].hooks
        if not spec.post and native.module().post_hooks_all_cpp(self.call.nodes[i]):
            self.last_call.meta[CPP_POST_HOOKS] = True
        if not spec.post and any(reducer_of(self.call.inputs[pos]) is not None
                                 for pos in spec.post_accumulate):
            # C++ hooks alone, on a parameter of a DDP in Python-reducer mode: its C++ reducer
            # never expects them (DDP skips the reducer's forward and backward set-up), so
            # they read no .grad (reorder.bucket_allreduces)
            self.last_call.meta["gradfx_idle_reducer"] = True

    def post_accumulate_hooks(self, i, spec, var_pos):
        label = self.call_label(i)
        for pos, alone in zip(spec.post_accumulate, spec.post_accumulate_alone):
            self.python_call(hook_ops.call_post_accumulate_hook, (_Input(pos), _Input(var_pos), self.running(i)), None,
                             label, "hook")
            ddp = reducer_of(self.call.inputs[pos])
            if ddp is not None:  # DDP's Python reducer: reorder.bucket_allreduces plans it into a bucket
                variable = self.call.inputs[var_pos]
                self.last_call.meta["gradfx_allreduce"] = ddp_buckets.Planned(
                    variable.numel(), variable.dtype, id(ddp.process_group), *ddp_buckets.bucket_caps(ddp),
                    gloo_ring.ranks_of(ddp.process_group, variable.device), alone)

    def running(self, i):
        """The input holding node ``i`` itself, which its hooks see running (hook_ops._call);
        None for a node the graph takes no object of (one whose gradient autograd.grad
        only captures)."""
        rec = self.call.records[i]
        if rec.kind is ACCUMULATE:
            pos = rec.hooks.node if rec.hooks is not None else None
        else:
            pos = rec.node_input
        return None if pos is None else _Input(pos)

    def call_label(self, i):
        return self.call.node_label(i)

    # -- the engine loop's steps (engine_loop) -----------------------------
    def step(self, state, i):
        """One task of the ready queue; every fx node it records is labelled with the node."""
        graph = self.tracer.graph
        marker = graph._root.prev
        self.state = state
        engine_loop.run_one(self, state, i)
        label = self.call.node_label(i)
        node = marker.next
        while node is not graph._root:
            node.meta.setdefault("gradfx_node", label)
            node.meta.setdefault("gradfx_node_index", i)
            node.meta.setdefault("gradfx_kind", "compute")  # what proxy mode recorded: aten ops
            node = node.next

    def validate(self, node, outputs, edges):
        return _validate(self, node, outputs, edges)

    def formula_inputs(self, i, inputs, state):
        """The gradients a traced formula of node ``i`` gets.

        A gradient from an opaque call (a custom Function's backward, a node run for
        real) may turn out None at run time, where eager hands the formula an
        undefined gradient; the traced formula needs a tensor.  Such gradients pass
        through ``require_gradients`` first: if one is None at run time, the graph
        stops there and the rest of the backward runs as eager runs it, from the
        engine's state at this point (a :class:`Frontier`: run.continuation).
        """
        checked = tuple(k for k, g in enumerate(inputs) if g is not None and id(g) in self.maybe_none)
        if not checked or self.subclass_grads(i):  # (that node runs as itself: run_subclass)
            return inputs
        if self.runs_real(i):
            return inputs  # the real node takes None
        none = tuple(k for k in checked if (i, k) in self.assumed_none)
        defined = tuple(k for k in checked if k not in none)
        frontier, carry = self.frontier(i, state, checked)
        self.frontiers.append(frontier)
        like = tuple(None if k in none else g for k, g in enumerate(inputs))
        outs = self.python_call(runtime_ops.require_gradients,
                                (tuple(inputs), defined, none, len(self.frontiers) - 1, tuple(carry)),
                                like, self.call.node_label(i), "check")
        return list(outs)

    def frontier(self, i, state, checked):
        """The engine's state with node ``i`` part-way (its pre-hooks ran), and the
        gradients the graph holds then: (Frontier, those gradients as traced).  The
        runtime inputs a continuation needs the session keeps (run.continuation), so
        what a stop hands over grows with the frontier, not with the graph."""
        call = self.call
        carry = []

        def slot(g):
            if g is None:
                return None
            carry.append(g)
            return len(carry) - 1

        buffers = tuple((j, tuple(slot(g) for g in buf)) for j, buf in state.buffers.items())
        captured = tuple(slot(g) for g in state.captured)
        deps = tuple((j, d) for j, d in enumerate(state.deps) if d != call.records[j].deps and j not in state.ran)
        frontier = engine_loop.Frontier(i, checked, buffers, deps, tuple(j for _, j in state.queue._heap), captured)
        return frontier, carry

    # -- running one node ----------------------------------------------------
    def runs_real(self, i) -> bool:
        """Does node ``i`` run as itself, never traced?  Builtin nodes ``rules`` lists, those
        whose hidden state it cannot recover, and with create_graph a custom Function's
        backward (tracing would lose what it builds for a further backward: Functions it
        applies, once_differentiable)."""
        node = self.call.nodes[i]
        if isinstance(node, BackwardCFunction):
            return self.call.create_graph
        name = type(node).__name__
        if name in HIDDEN_RULES:
            return self.recover(i) is None
        if name in RUN_REAL and self.call.records[i].hidden is not None:
            return False  # its hidden state is keyed (graph.hidden): the node runs on fakes
        return name in RUN_REAL or (self.call.create_graph and name in RUN_REAL_WITH_HISTORY)

    def run_traced(self, i, node, grads):
        if self.runs_real(i) or self.takes_unknown(grads):
            log.debug("gradfx: %s runs opaque", self.call.node_label(i))
            return None
        if self.call.records[i].subclass is not None:
            return self.run_subclass(i, node, grads)
        graph = self.tracer.graph
        before = (graph._root.prev, len(self.shape_env.guards))
        try:
            out = None
            hidden = HIDDEN_RULES.get(type(node).__name__)
            if hidden is not None:  # the node's own formula would bake in what no guard checks
                out = hidden[1](self.recover(i), *grads)
            elif self.symbolic is not None and type(node).__name__ == "CopySlices":  # its geometry symbolic
                geometry = graph_hidden.copy_slices_geometry(
                    self.symbolic.rebuild(*self.call.records[i].values[graph_hidden.SIZES]))
                out = copy_slices(geometry, graph_hidden.wrapped(node), node, *grads)
            # Rules are written for tensors; with a None gradient the node itself runs (as eager).
            elif self.symbolic is not None and (all(g is not None for g in grads)
                                                or type(node).__name__ in TAKES_NONE):
                out = apply_rule(node, grads, _SymbolicSaved(node, i, self))
                out = self.formula_computes(node, i, out)
            if out is None:
                if self.symbolic is not None and type(node).__name__ in LAYOUT_ONLY_GUARDS:
                    with _suppress_guards(self.shape_env):
                        out = node(*grads)
                else:
                    out = node(*grads)
        except Exception as err:  # cannot run on fakes: undo and go opaque
            self.undo(before, i, err)
            return None
        return out if type(out) is tuple else (out,)

    def takes_unknown(self, grads) -> bool:
        """Is one of ``grads`` what a runtime call returned where a subclass went in?"""
        return any(g is not None and id(g) in self.unknown for g in grads)

    def subclass_grads(self, i) -> bool:
        """Does node ``i`` take a tensor subclass's gradient, or is it reached by a subclass
        otherwise (its saved values)?  Then a gradient from an opaque call, whose context
        only the run knows, makes it run as itself."""
        rec = self.call.records[i]
        return rec.subclass is not None or (rec.kind is FUNCTION and subclass_grads(self.call.nodes[i]))

    def run_subclass(self, i, node, grads):
        """Node ``i``, which a tensor subclass reaches (its saved values, or its gradients),
        traced through the subclass: its saved values become fakes of the same subclass
        around fake inner tensors, which the graph reads from the node when it runs
        (substitute_saved), and the node's formula runs on them, the subclass's
        ``__torch_dispatch__`` recording its ops on the inner tensors (a DTensor's
        redistributions as functional collectives).  None where it cannot (the node then
        runs as itself): sizes symbolic, a backward recording history, a gradient from a
        runtime call (whose subclass context only the run knows), a subclass without the
        flatten protocol."""
        if (self.symbolic is not None or self.call.create_graph or type(node).__name__ in HIDDEN_RULES
                or any(g is not None and id(g) in self.maybe_none for g in grads)):
            return None
        graph = self.tracer.graph
        before = (graph._root.prev, len(self.shape_env.guards))
        try:
            info = type_info(type(node))
            if info.raw_saved:
                self.substitute_saved(i, node, info)
            out = node(*grads)
            if any(isinstance(g, torch.Tensor) and type(g) is not FakeTensor and not subclasses.traceable(type(g))
                   for g in (out if type(out) is tuple else (out,))):
                raise TypeError("its formula returned a tensor subclass gradfx does not trace through")
            self.constants_made(before[0])
        except Exception as err:
            self.undo(before, i, err)
            return None
        return out if type(out) is tuple else (out,)

    def constants_made(self, last) -> None:
        """The tensor constants a subclass's Python recorded after ``last`` (DTensor's loss
        handlers: ``torch.where(mask, target, 0)``), made by an op of the graph where they
        hold one value (``aten.full``, their dtype and device), as the graph holds no
        tensor; raise for any other (the node runs as itself)."""
        node = last.next
        while node.op != "root":
            following = node.next
            if node.op == "get_attr":
                value = getattr(self.tracer.root, node.target)
                with _disable_current_modes():  # a real tensor
                    one = (isinstance(value, torch.Tensor) and value.numel() > 0
                           and bool((value == value.reshape(-1)[0]).all()))
                    if not one:
                        raise TypeError(f"its backward records a tensor constant ({node.target})")
                    fill = value.reshape(-1)[0].item()
                with self.tracer.graph.inserting_before(node):
                    made = self.tracer.graph.call_function(torch.ops.aten.full.default, (list(value.shape), fill),
                                                           {"dtype": value.dtype, "device": value.device})
                made.meta.update(node.meta)
                node.replace_all_uses_with(made)
                self.tracer.graph.erase_node(node)
            node = following

    def substitute_saved(self, i, node, info) -> None:
        """Fakes for node ``i``'s saved values while its formula is traced: the graph reads the
        values from the node (runtime_ops.ReadSaved, eager's unpack and checks) as plain
        inner tensors; a subclass value's fake is the subclass around fakes of those.  The
        walk's sizes hold the id of their layouts and contexts (kinds.walk_subclass_values)."""
        if foreign_hooks(node, info.raw_saved):
            raise TypeError("its saved tensors are under saved_tensors_hooks")
        with _disable_current_modes():  # the real values, unpacked as the node would
            layouts = saved_layouts(node, info.saved_tensors)
            if any(layout is not None and len(layout) == 1 for layout in layouts):
                raise TypeError("a tensor subclass without the flatten protocol among its saved tensors")
            owned, _, values = take_saved(node, info.raw_saved, info.saved_tensors, subclasses_too=True)
            flat: list = []
            for value in values:
                subclasses.flat_inner(value, flat)
        like = tuple(self.new_fake(tuple(t.shape), "contiguous" if t.is_contiguous() else tuple(t.stride()),
                                   t.dtype, t.device) for t in flat)
        read = tuple((tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in flat)
        inner = iter(self.python_call(runtime_ops.ReadSaved(info.saved_tensors, read),
                                      (_Input(self.call.records[i].node_input),), like, self.call_label(i),
                                      "compute"))
        for k, value in enumerate(values):
            self.saved_table[(id(owned), k)] = _fake_like(value, inner)

    def formula_computes(self, node, i, out):
        """A rule's outputs as the node's formula gives them: a rule computes every output,
        the formula none for an edge without a next node (post-hooks see None there),
        except a list argument's, which it computes together."""
        edges = self.call.records[i].edges
        if type(out) is not tuple or len(out) != len(edges) or type(node).__name__ in engine_loop._GROUPED_OUTPUTS:
            return out
        return tuple(None if e is None else g for g, e in zip(out, edges))

    def run_function(self, i, ctx, grads):
        """Trace a traceable custom Function's backward; None if it cannot run on fakes
        (or runs as itself: runs_real)."""
        if self.runs_real(i) or self.takes_unknown(grads) or (
                self.subclass_grads(i) and any(g is not None and id(g) in self.maybe_none for g in grads)):
            return None
        graph = self.tracer.graph
        before = (graph._root.prev, len(self.shape_env.guards))
        try:
            if ctx.__dict__.get("_gradfx_materialize_grads", True):
                if self.stand_ins(i, grads):
                    return None  # only the engine knows those gradients' shapes: runs opaque
                grads = [torch.zeros(self.meta(i, k)[0], dtype=self.meta(i, k)[1]) if g is None else g
                         for k, g in enumerate(grads)]
            with _generators_untouched():
                out = self._apply_function(i, ctx, grads)
            self.no_held_objects(before[0])
            if self.symbolic is not None and any(isinstance(g, torch.Tensor) and type(g) is not FakeTensor
                                                 for g in (out if type(out) is tuple else (out,))):
                raise TypeError("a tensor subclass gradient under symbolic sizes")  # DTensor's Functions
            return runtime_ops.function_outputs(ctx.name(), ctx.needs_input_grad, out,
                                                [e is not None for e in self.call.records[i].edges])
        except Exception as err:
            self.undo(before, i, err)
            aot_regions.say_why_opaque(ctx._forward_cls, err)
            return None

    def _apply_function(self, i, ctx, grads):
        """The Function's backward on fakes; a compiled region's replays its backward graph,
        reading its saved ints as the walk's sizes (symbolic where they are)."""
        if not aot_regions.is_region(ctx._forward_cls):
            return ctx.apply(*grads)
        slot = self.call.records[i].values.get(REGION_INTS)
        ints = contextlib.nullcontext()
        if slot is not None and self.symbolic is not None:
            ints = aot_regions.with_saved_ints(ctx, self.symbolic.rebuild(*slot))
        with aot_regions.replayed(ctx._forward_cls), ints:
            return ctx.apply(*grads)

    def no_held_objects(self, last) -> None:
        """Raise where the nodes recorded after ``last`` read an object the trace would
        hold (a ``torch.Generator`` passed to a draw): the backward then runs as itself,
        drawing from the user's generator at run time as eager does."""
        node = last.next
        while node.op != "root":
            if node.op == "get_attr":
                raise TypeError(f"its backward passes an object to an op ({node.target})")
            node = node.next

    def stand_ins(self, i, grads) -> list:
        """Slots of custom Function node ``i`` without a gradient whose metadata may be a
        stand-in (a non-differentiable or non-tensor output: see runtime_ops.stands_in)."""
        metadata = self.call.nodes[i]._input_metadata
        return [k for k, g in enumerate(grads) if g is None and runtime_ops.stands_in(metadata[k])]

    def undo(self, before: tuple, i: int, err: Exception) -> None:
        """Erase what a failed attempt to trace node ``i`` recorded after ``before``:
        its graph nodes and the guards it added (the real node runs instead)."""
        last, n_guards = before
        graph = self.tracer.graph
        for n in reversed(list(graph.nodes)):
            if n is last:
                break
            graph.erase_node(n)
        del self.shape_env.guards[n_guards:]
        log.debug("gradfx: %s runs opaque (%s: %s)", self.call.node_label(i), type(err).__name__, err)

    def run_opaque(self, i, node, grads, node_input):
        """Record a call of the real node (builtin) or of the user's backward (Function)."""
        plan = self.unpack_plan(i, node)
        if plan is not None:
            out = self.run_unpacked(i, node, grads, plan)
            if out is not None:
                return out
        label = self.call.node_label(i)
        self.opaque.append(label)
        metas, like = [], []
        hooks = self.call.records[i].hooks
        observed = hooks is not None and bool(hooks.post)
        for e in self.call.records[i].edges:
            if e is None:
                # No next node: only post-hooks see the output, as the node computed it.
                metas.append(None)
                like.append(_UNSHAPED if observed else None)
            else:
                shape, dtype, device = self.meta(e[0], e[1])
                metas.append((shape, dtype))
                like.append(self.new_fake(shape, "contiguous", dtype, device))
        function = isinstance(node, BackwardCFunction)
        if function and node.__dict__.get("_gradfx_materialize_grads", True):
            # PyNode's zeros for gradients known to be None here (the graph shows them);
            # call_backward materializes those that turn out None at run time, and those
            # whose metadata is a stand-in (it asks the engine, which runs the node's hooks).
            stand_ins = self.stand_ins(i, grads)
            if stand_ins and self.call.records[i].hooks is not None:
                raise _Fallback(f"{label} has hooks and an output without a gradient that is not a "
                                "differentiable tensor (its gradient's shape is known only to the engine)")
            grads = [torch.zeros(self.meta(i, k)[0], dtype=self.meta(i, k)[1], device=self.meta(i, k)[2])
                     if g is None and k not in stand_ins else g for k, g in enumerate(grads)]
        fn = runtime_ops.call_backward if function else runtime_ops.call_node
        if type_info(type(node)).kind is ACCUMULATE:  # a tensor subclass leaf's (kinds.AccumulateKind)
            fn = runtime_ops.SubclassAccumulation()
        head = (_Input(node_input), tuple(metas), (False,) * len(metas))
        if plan is not None:  # gradfx unpacks for it, and learns what the hooks gave
            fn = runtime_ops.NodeUnpacking(plan, self.learner, i)
            self.unpacks = True
        outs = self.python_call(fn, head + tuple(grads), tuple(like), label, "opaque")
        call = self.last_call
        call.meta["gradfx_node_index"] = i
        if function and self.call.owned[i] is not None:
            call.meta["gradfx_saved_mask"] = self.call.owned[i].mask
        for o, e in zip(outs, self.call.records[i].edges):
            if o is not None and not isinstance(o, _Unshaped):
                self.maybe_none.add(id(o))
                self.keep.append(o)
                if e is not None and self.call.records[e[0]].subclass == SUBCLASS_GRADS:
                    self.mark_unknown(o)  # what it hands a node taking a subclass's gradient
        return outs

    # -- saved tensors under the user's hooks (graph.unpacked) -------------------
    def unpack_plan(self, i, node):
        """The unpack plan of node ``i`` if the graph unpacks its saved tensors itself: a
        builtin node under the user's saved_tensors_hooks, in a static trace."""
        if self.learner is None or type(self.call.owned[i]) is not ForeignOwned:
            return None
        return unpacked.plan(node, type_info(type(node)))

    def run_unpacked(self, i, node, grads, plan):
        """Node ``i``'s formula traced on fakes of the saved tensors as the last backward
        unpacked them; the graph unpacks them at this point and checks their layouts (a
        stop where one differs).  None where it cannot be traced so: the node then runs
        for real, gradfx unpacking for it (runtime_ops.NodeUnpacking)."""
        metas = self.learner.known.get(i)
        if (not unpacked.fits(metas) or type(node).__name__ in HIDDEN_RULES or self.runs_real(i)
                or any(g is not None and id(g) in self.maybe_none for g in grads)):
            log.debug("gradfx: %s runs for real, gradfx unpacking for it (%s)", self.call.node_label(i),
                      "layouts unknown" if not unpacked.fits(metas) else "gradients from opaque calls")
            return None
        graph = self.tracer.graph
        before = (graph._root.prev, len(self.shape_env.guards))
        frontier, carry = self.frontier(i, self.state, ())
        self.frontiers.append(frontier)
        try:
            like = tuple(None if m is None else self.new_fake(m[0], m[1], m[2], m[3]) for m in metas)
            values = self.python_call(runtime_ops.SavedUnpack(plan, metas, len(self.frontiers) - 1),
                                      (_Input(self.call.records[i].node_input), tuple(grads), tuple(carry)),
                                      like, self.call.node_label(i), "hook")
            out = unpacked.with_saved(node, plan, values, node, tuple(grads))
            out = out if type(out) is tuple else (out,)
            out = self.validate(node, out, self.call.records[i].edges)
        except Exception as err:
            self.frontiers.pop()
            self.undo(before, i, err)
            return None
        self.unpacks = True
        return out

    def release_saved(self, i, node):
        """After a node run opaquely (and its post-hooks): free its saved tensors now,
        as the engine does, unless the backward keeps its graph (decided at run time).
        Not for saved tensors freed on access: their handles are gone by then."""
        if type(self.call.owned[i]) is ForeignOwned:  # what the user's hooks packed goes now, as in eager
            self.python_call(runtime_ops.release_hooked, (_Input(self.call.records[i].node_input),), None,
                             self.call.node_label(i), "opaque")
            return
        raw = type_info(type(node)).raw_saved
        if raw and not getattr(getattr(node, "_forward_cls", None), "clear_saved_tensors_on_access", False):
            self.python_call(runtime_ops.release_saved, (_Input(self.call.records[i].node_input), raw), None,
                             self.call.node_label(i), "opaque")

    def add(self, old, new, label):
        """InputBuffer::add; gradients from opaque calls may turn out None at run time, and
        one a runtime call returned for a subclass is added as the run finds it."""
        unknown = id(old) in self.unknown or id(new) in self.unknown
        if id(old) in self.maybe_none or id(new) in self.maybe_none or unknown:
            out = self.python_call(runtime_ops.add_grads, (old, new), old, label, "compute")
            self.maybe_none.add(id(out))
            self.keep.append(out)
            if unknown:
                self.mark_unknown(out)
            return out
        out = old + new
        if type(out) is FakeTensor:  # (reorder.inplace_sums makes it in place where eager does)
            self.proxy(out).node.meta[BUFFER_SUM] = True
        return out

    def accumulate(self, i, grad, var_input):
        label = self.call.node_label(i)
        if self.call.create_graph:
            proxy = self.record(runtime_ops.accumulate_grad_create_graph,
                                (self.object_proxies[var_input], self.proxy(grad)), label)
            proxy.node.meta["gradfx_kind"] = "accumulate"
            return
        proxy = self.record(runtime_ops.accumulate_grad,
                            (self.object_proxies[var_input], self.arg(grad), False), label)
        proxy.node.meta["gradfx_kind"] = "accumulate"


def _fake_like(value, inner):
    """A fake standing for saved ``value``: the next of the ``inner`` fakes for a plain
    tensor, a traceable subclass's own ``__tensor_unflatten__`` around its inner ones."""
    return subclasses.map_inner(value, lambda plain: next(inner))


def _fx_args(x):
    if isinstance(x, fx.Proxy):
        return x.node
    if type(x) is tuple:
        return tuple([_fx_args(a) for a in x])
    return x


def _validate(t, node, outputs, edges):
    """engine.cpp validate_outputs on traced (fake) outputs."""
    runtime_ops.check_gradient_count(node.name(), len(outputs), len(edges))
    result = []
    for k, (g, e) in enumerate(zip(outputs, edges)):
        if e is None or g is None:
            result.append(g)
            continue
        shape, dtype, _ = t.meta(e[0], e[1])
        same = _same_sizes(g.shape, shape)
        if same and g.dtype == dtype:
            result.append(g)  # what validate_output returns, without asking sympy
            continue
        reduced = t.sum_to(g, shape) if t.symbolic is not None and not same else None
        if reduced is not None:
            g = reduced if reduced.dtype == dtype or dtype is None else reduced.to(dtype)
        else:
            g = runtime_ops.validate_output(g, shape, dtype, node.name(), k)
        result.append(g)
    return result


def _same_sizes(got, expected) -> bool:
    """Sizes equal by what they are (equal ints, or the same symbolic expression): a
    comparison that needs no reasoning and records no guard."""
    if len(got) != len(expected):
        return False
    for a, b in zip(got, expected):
        if a is b:
            continue
        if type(a) is int and type(b) is int:
            if a != b:
                return False
        elif isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
            if a.node.expr != b.node.expr:  # structural: equal expressions, or ask sympy
                return False
        else:
            return False
    return True


def trace_backward(call: BackwardCall, symbolic: SymbolicSizes | None = None, assumed_none=frozenset(),
                   learner=None) -> Trace:
    """Record ``call`` into an fx graph (sizes symbolic where ``symbolic`` says; the
    formula inputs ``assumed_none`` names as None: see _Tracer.formula_inputs; saved
    tensors under the user's hooks as ``learner`` knows them: _Tracer.run_unpacking)."""
    start = time.perf_counter()
    if symbolic is None:
        return _trace(call, symbolic, start, assumed_none, learner)
    with _plain_tensor_meta.active(), sym_memo.memoized(symbolic.shape_env):
        return _trace(call, symbolic, start, assumed_none, learner)


def _trace(call: BackwardCall, symbolic: SymbolicSizes | None, start: float, assumed_none, learner) -> Trace:
    t = _Tracer(call, symbolic, assumed_none, learner)
    t.saved_table = table = {}
    fakes = t.placeholders()
    grads = fakes[: len(call.roots)]
    for i, owned in enumerate(call.owned):
        if owned is not None:
            for k, _ in enumerate(owned.tensors):
                table[(id(owned), k)] = None
    # map each owned saved tensor to its fake (placeholders are in owner order)
    pos_by_owner: dict[int, int] = {}
    for pos, (kind, owner) in enumerate(zip(call.input_kinds, call.input_owner)):
        if kind == "saved":
            owned = call.owned[owner]
            k = pos_by_owner.get(owner, 0)
            table[(id(owned), k)] = fakes[pos]
            pos_by_owner[owner] = k + 1
    # The engine runs a backward with grad mode = create_graph: formulas branch on it
    # (silu, group_norm, det, solve record other ops when they must be differentiable).
    with substitute(table), t.fake_mode, t.proxy_mode, torch.set_grad_enabled(call.create_graph), \
            fast_ops.recorded_directly(t):
        captured = engine_loop.drain(t, engine_loop.EngineState.at_start(t, call, grads))
    out = []
    for g in captured:
        out.append(None if g is None else t.arg(g).node)
    t.tracer.graph.output(tuple(out))
    _group_getitems(t.tracer.graph)
    if not call.create_graph:  # under grad mode AccumulateGrad never steals
        _mark_steals(t.tracer.graph)
    t.tracer.graph._gradfx_create_graph = call.create_graph
    return Trace(t.tracer.graph, t.opaque, time.perf_counter() - start, t.frontiers, t.unpacks)


def _extract_plainly(original):
    """Every traced tensor's ``tensor_meta`` (fx metadata) without sympy where its
    contiguity is plain.

    Recording a tensor, the proxy tracer asks whether it is contiguous in each memory
    format; with symbolic sizes each question is a sympy proof, a sixth of a symbolic
    trace.  A tensor contiguous as written (:func:`plain_layout.plainly_contiguous`)
    gets the answer the first question would give; any other asks as before.  The
    function is replaced while symbolic traces run; another thread's tracing meanwhile
    gets the same answers.
    """
    def extract(result, include_contiguity=True):
        if include_contiguity and result.layout is torch.strided and plain_layout.plainly_contiguous(result):
            return original(result, include_contiguity=False)._replace(memory_format=torch.contiguous_format)
        return original(result, include_contiguity)
    return extract


_plain_tensor_meta = ScopedPatch(proxy_tensor, "_extract_tensor_metadata", _extract_plainly)


def _group_getitems(graph: fx.Graph) -> None:
    """Unpack every multi-output op right after it runs.

    Proxies unpack a tuple result lazily, where each item is first used; then the
    tuple stays alive across other work and holds an extra reference to its
    items, which would keep a gradient from being stolen by its accumulation (the
    eager engine moves outputs out of the node's result at once).
    """
    for node in list(graph.nodes):
        unpack_right_after(node)


_OWN_POST_HOOKS = (hook_ops.call_post_hook, hook_ops.call_node_post_hooks)


def _mark_steals(graph: fx.Graph) -> None:
    """Let accumulate_grad steal a gradient nothing else can see, as eager does.

    Eager steals when the gradient's refcount says the input buffer is its only
    owner: not a tensor the caller passed in, and not used by anything still to
    run.  Here: not a placeholder, and no user after this accumulation but the
    accumulator's own post-hooks (eager expects the reference it keeps for them).
    """
    order = {n: k for k, n in enumerate(graph.nodes)}
    subclass = [n for n in graph.nodes if isinstance(n.target, runtime_ops.SubclassAccumulation)]
    for node in graph.find_nodes(op="call_function", target=runtime_ops.accumulate_grad) + subclass:
        grad = node.args[1] if node.target is runtime_ops.accumulate_grad else node.args[3]
        if not isinstance(grad, fx.Node) or grad.op == "placeholder":
            continue
        label = node.meta.get("gradfx_node")
        if all(order[u] <= order[node] or (u.target in _OWN_POST_HOOKS and u.meta.get("gradfx_node") == label)
               for u in grad.users):
            if node.target is runtime_ops.accumulate_grad:
                node.update_arg(2, True)
            else:
                node.target = runtime_ops.SubclassAccumulation(may_steal=True)


def _plain(t: torch.Tensor) -> bool:
    """A dense tensor without conjugate or negative bits, of a dtype fakes make alike: a
    fake of its sizes and strides alone stands for it in a static trace."""
    return (t.layout is torch.strided and not t.is_conj() and not t.is_neg() and not t.is_quantized
            and not t.is_nested and type(t) in (torch.Tensor, torch.nn.Parameter))


class GeneratorTouched(RuntimeError):
    """A traced backward moved a real random generator's state."""


@contextlib.contextmanager
def _generators_untouched():
    """Around a custom backward traced on fakes: its random draws on fakes record ops and
    leave the generators alone.  Python that reads or sets a generator's state
    (``torch.manual_seed``, a draw on a real tensor) would do it now,
    at trace time, and never in the graph: the state is put back and the backward runs
    as itself (GeneratorTouched), so every draw happens when eager's would."""
    before = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:  # put back also where the trace failed otherwise (the backward then runs as itself)
        touched = not torch.equal(before, torch.random.get_rng_state())
        if touched:
            torch.random.set_rng_state(before)
        if cuda is not None and any(not torch.equal(a, b) for a, b in zip(cuda, torch.cuda.get_rng_state_all())):
            torch.cuda.set_rng_state_all(cuda)
            touched = True
    if touched:
        raise GeneratorTouched("its backward changed a random generator's state while traced")
