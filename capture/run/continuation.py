"""The rest of a backward whose captured graph stopped part-way, run as eager runs it.

A captured graph traces what opaque calls (custom Function backwards, nodes run
for real) return as tensors.  Eager lets such a backward return None for an input
that needs a gradient: the engine then hands the next formulas an undefined
gradient, hooks see None, and a custom Function further on gets zeros.  Where a
traced formula would take such a gradient, the graph passes it through
``runtime_ops.require_gradients``; if it is None there, the graph stops
(``runtime_ops.Diverged``), handing over the engine's state at that point (a
``Frontier``: buffers, dependency counts, ready queue) and the values it refers to.

:func:`finish` runs the remaining nodes through the engine loop the tracer
follows (``trace.engine_loop``), each for real: builtin nodes called with their
gradients (None where undefined), custom backwards through their ctx, hooks and
accumulation through the graph's own runtime functions.  Order, hooks and results
are eager's; only the speed is that of Python, node by node.
"""

from __future__ import annotations

import operator
import weakref

from torch.autograd.function import BackwardCFunction

from .. import native
from ..graph import unpacked
from ..graph.kinds import ACCUMULATE, type_info
from ..graph.saved import ForeignOwned, SavedTensors, left_to_node
from ..trace import engine_loop
from ..runtime import hook_ops, runtime_ops


# A tensor subclass leaf's accumulator, handed the node's input list (the reference count it
# reads is that list's).
_SUBCLASS_ACCUMULATION = runtime_ops.SubclassAccumulation(may_steal=True, listed=True)


def finish(call, frontier: engine_loop.Frontier, stop: runtime_ops.Diverged, keep_graph: bool,
           kept: "Kept", learner=None) -> tuple:
    """Run the rest of ``call`` from where its graph stopped; returns the captured gradients.
    Nodes under the user's saved-tensor hooks run with gradfx unpacking for them, the one
    the graph stopped at on what it unpacked (``stop.values``), telling ``learner``."""
    runner = _Runner(call, kept, keep_graph, learner)
    if isinstance(stop, runtime_ops.UnpackedOtherwise):
        runner.unpacked[frontier.node] = stop.values
    state = engine_loop.EngineState.at_frontier(call, frontier, stop.carry)
    return tuple(engine_loop.drain(runner, state, resume=(frontier.node, list(stop.grads))))


class Positions:
    """Where a graph that may stop finds what a continuation needs, among its call's inputs."""

    __slots__ = ("objects", "saved", "saved_index", "unread", "take_objects", "take_saved")

    def __init__(self, call, graph, n_sizes: int, opaque: frozenset):
        kinds = call.input_kinds
        self.objects = [p for p, kind in enumerate(kinds) if kind not in ("grad", "saved")]
        self.saved = [p for p, kind in enumerate(kinds) if kind == "saved"]
        self.saved_index = {p: k for k, p in enumerate(self.saved)}
        # Saved tensors of a traced node that no op of the graph reads (its formula for an
        # output nobody needs was dropped): freed as the graph starts, yet the real node
        # unpacks them.  (A node run opaquely keeps its own until it ran: ``opaque``.)
        placeholders = [n for n in graph.nodes if n.op == "placeholder"][n_sizes:]
        self.unread = [p for p in self.saved if not placeholders[p].users and call.input_owner[p] not in opaque]
        # Every backward of such a graph keeps these: picked in C, not item by item.
        self.take_objects = _picker(self.objects)
        self.take_saved = _picker(self.saved)


def _picker(positions: list):
    """list -> tuple of its items at ``positions`` (itemgetter, which returns a lone item bare)."""
    if not positions:
        return lambda values: ()
    if len(positions) == 1:
        (p,) = positions
        return lambda values: (values[p],)
    return operator.itemgetter(*positions)


class Kept:
    """What the session keeps of a call's inputs while a graph that may stop runs: the
    hooks, nodes, leaves and retained tensors, and a weak reference to each saved
    tensor.  The graph frees each saved tensor at its last use, so those of the nodes
    still to run are alive when it stops; the unread ones are kept here."""

    __slots__ = ("positions", "objects", "weak", "unread", "released")

    def __init__(self, inputs: list, positions: Positions):
        self.positions = positions
        self.objects = positions.take_objects(inputs)
        self.weak = list(map(weakref.ref, positions.take_saved(inputs)))
        self.unread = [inputs[p] for p in positions.unread]
        # Nodes whose saved variables were released before the graph ran, their tensors
        # left to the graph alone (the session says which): a real run of one of them
        # gets them back for its call (``with_saved``).
        self.released = ()

    def by_position(self) -> dict:
        """Input position -> hook, node, leaf or retained tensor."""
        return dict(zip(self.positions.objects, self.objects))

    def saved_of(self, call, i: int) -> list:
        index = self.positions.saved_index
        tensors = [self.weak[index[p]]() for p in call.records[i].saved]
        if any(t is None for t in tensors):  # only a pass that moved a use before the stop
            raise RuntimeError(f"gradfx: the graph stopped (a gradient turned out None) after freeing a saved "
                               f"tensor {call.node_label(i)} still needs; run this backward without custom passes "
                               "or on the eager engine")
        return tensors


class _Runner:
    """engine_loop's steps, run for real on the live nodes."""

    def __init__(self, call, kept: "Kept", keep_graph: bool, learner=None):
        self.call = call
        self.learner = learner
        self.unpacked: dict = {}  # node index -> its saved tensors, unpacked by the graph that stopped
        self.by_pos = kept.by_position()  # input position -> hook, node, leaf or retained tensor
        self.kept = kept
        self.kinds = list(call.kinds)  # every node left runs as the real node
        self.keep_graph = keep_graph

    def step(self, state, i):
        engine_loop.run_one(self, state, i)

    def formula_inputs(self, i, inputs, state):
        return inputs

    def run_traced(self, i, node, grads):
        return None  # the real node runs instead

    def run_function(self, i, ctx, grads):
        return None

    def validate(self, node, outputs, edges):
        raise AssertionError("a continuation runs every node for real")

    def add(self, old, new, label):
        return runtime_ops.add_grads(old, new)

    def meta(self, j, nr):
        node = self.call.nodes[j]
        m = node._input_metadata[nr]
        return m.shape, node.variable.grad_dtype if self.call.records[j].kind is ACCUMULATE else m.dtype

    def run_opaque(self, i, node, grads, node_input):
        metas = tuple(None if e is None else self.meta(*e) for e in self.call.records[i].edges)
        owner = self.call.owned[i]
        if isinstance(owner, SavedTensors) and owner.released:
            # Without retain_graph gradfx released its owner before the graph ran (the graph
            # held the tensors): they are given back for the real node to unpack.
            owner.tensors.extend(self.kept.saved_of(self.call, i))  # in place: the pack hooks hold it
            owner.released = False
        if type(owner) is ForeignOwned:
            plan = unpacked.plan(node, type_info(type(node)))
            if plan is not None:  # as the graph would have: gradfx unpacks, once, in the node's order
                return list(runtime_ops.run_unpacking(node, metas, (False,) * len(metas), plan, self.learner, i,
                                                      grads, self.unpacked.pop(i, None)))
        run = runtime_ops.call_backward if isinstance(node, BackwardCFunction) else runtime_ops.call_node
        if type_info(type(node)).kind is ACCUMULATE:  # a tensor subclass leaf's: it takes the gradient as eager
            run = _SUBCLASS_ACCUMULATION
        if left_to_node(owner) and i in self.kept.released:
            # The node's variables were reset; the graph held its tensors until the stop.
            tensors = iter(self.kept.saved_of(self.call, i))
            raws = tuple(getattr(node, raw) for raw in type_info(type(node)).raw_saved)
            values = tuple(next(tensors) if defined else None for defined in owner.mask)
            return list(native.module().with_saved(raws, values, run, (node, metas, (False,) * len(metas), *grads)))
        return list(run(node, metas, (False,) * len(metas), *grads))

    def release_saved(self, i, node):
        if self.keep_graph:
            return
        owner = self.call.owned[i]
        if isinstance(owner, (SavedTensors, ForeignOwned)) or left_to_node(owner):
            owner.release()
            return
        raw = type_info(type(node)).raw_saved
        if raw and not getattr(getattr(node, "_forward_cls", None), "clear_saved_tensors_on_access", False):
            runtime_ops.release_saved(node, raw)

    # -- hooks and accumulation, with the graph's runtime functions ----------
    def tensor_pre_hooks(self, i, spec, inputs):
        inputs = list(inputs)
        for nr, positions in spec.tensor_pre:
            for pos in positions:
                inputs[nr] = hook_ops.call_tensor_hook(self.by_pos[pos], inputs[nr], self.call.nodes[i])
        for nr, pos in spec.retain:
            hook_ops.retain_grad(self.by_pos[pos], inputs[nr])
        return inputs

    def pre_hooks(self, i, spec, inputs):
        grads = tuple(inputs)
        for pos in spec.pre:
            grads = hook_ops.call_pre_hook(self.by_pos[pos], grads, self.call.nodes[i])
        return list(grads)

    def post_hooks(self, i, spec, outputs, inputs):
        outs = tuple(outputs)
        for pos in spec.post:
            outs = hook_ops.call_post_hook(self.by_pos[pos], outs, tuple(inputs), self.call.nodes[i])
        return list(outs)

    def native_post_hooks(self, i, inputs):
        hook_ops.call_node_post_hooks(self.call.nodes[i], tuple(inputs))

    def post_accumulate_hooks(self, i, spec, var_pos):
        for pos in spec.post_accumulate:
            hook_ops.call_post_accumulate_hook(self.by_pos[pos], self.by_pos[var_pos], self.call.nodes[i])

    def accumulate(self, i, grad, var_input):
        variable = self.by_pos[var_input]
        if self.call.create_graph:
            runtime_ops.accumulate_grad_create_graph(variable, grad)
        else:  # a copy where eager might steal: the same values and layout, unobservable
            runtime_ops.accumulate_grad_unchecked(variable, grad, False)

