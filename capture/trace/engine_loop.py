"""The eager engine's order of work for one backward, shared by tracing and running.

:func:`drain` is engine.cpp's ``thread_main`` / ``evaluate_function`` minus the
threads: pop the ready node with the highest sequence number, run its hooks and
its backward, validate the outputs, add them to the input buffers of its next
nodes in order, and push the nodes whose dependencies reach zero.

What "run" means is the runner's (``r``): the tracer records each step into an
fx graph on fake tensors; the continuation (``run.continuation``) runs the steps
for real when a captured graph had to stop part-way.  Both go through this one
loop, so a continuation keeps eager's order exactly where the graph left off.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.autograd.function import BackwardCFunction

from ..graph.kinds import ACCUMULATE, FUNCTION, OPAQUE, TRACED
from .ready_queue import ReadyQueue


@dataclass(frozen=True)
class Frontier:
    """The engine's state at one point of a captured graph where the graph may stop
    (a ``require_gradients`` call), for the continuation to go on from.

    Gradients are named by their index in the values the graph hands over (the
    buffered, then the captured ones).  Node ``node`` is part-way: its pre-hooks
    ran, its gradients come with the call.  Only what the frontier holds is kept,
    so that a graph with many such points stays small.
    """

    node: int
    checked: tuple  # its gradients from opaque calls: those the check looks at
    buffers: tuple  # (node index, per input: value index or None)
    deps: tuple  # (node index, incoming edges not yet delivered) where fewer than at the start
    heap: tuple  # node indices in the ready queue's heap order
    captured: tuple  # autograd.grad: per input, value index or None


class EngineState:
    """Input buffers, dependency counts, ready queue and captured gradients."""

    __slots__ = ("call", "buffers", "deps", "queue", "captured", "ran", "needed", "should_run")

    def __init__(self, call, buffers: dict, deps: list, queue: ReadyQueue, captured: list, ran: set):
        self.call = call
        self.buffers = buffers  # node index -> one gradient (or None) per input
        self.deps = deps  # node index -> incoming edges not yet delivered
        self.queue = queue
        self.captured = captured  # autograd.grad: the gradient per input (None until captured)
        self.ran = ran  # nodes taken from the queue (the tracer's frontiers read it)
        records = call.records
        self.needed = None if call.outputs is None else [r.runs for r in records]
        self.should_run = None
        if self.needed is not None:
            self.should_run = [self.needed[i] or i in call.captures for i in range(len(records))]

    @classmethod
    def at_frontier(cls, call, frontier: Frontier, values) -> "EngineState":
        """The state a graph stopped in, with the values it handed over."""
        def value(k):
            return None if k is None else values[k]
        queue = ReadyQueue()
        # The heap as it was: the walk guarantees the same order of sequence numbers.
        queue._heap = [(call.seq[j], j) for j in frontier.heap]
        deps = [r.deps for r in call.records]  # those of nodes that ran are never read again
        for j, d in frontier.deps:
            deps[j] = d
        return cls(call, {j: [value(k) for k in slots] for j, slots in frontier.buffers}, deps,
                   queue, [value(k) for k in frontier.captured], set())

    @classmethod
    def at_start(cls, r, call, grads) -> "EngineState":
        state = cls(call, {}, [rec.deps for rec in call.records], ReadyQueue(),
                    [None] * (len(call.outputs) if call.outputs is not None else 0), set())
        if len(call.roots) == 1:
            (j, nr), = call.roots
            state.buffers[j] = [None] * len(call.nodes[j]._input_metadata)
            state.buffers[j][nr] = grads[0]
            state.queue.push(call.seq[j], j)
        else:  # GraphRoot: hands each root gradient to its edge, in order
            for (j, nr), g in zip(call.roots, grads):
                state.deliver(r, j, nr, g)
        return state

    def deliver(self, r, child: int, nr: int, grad) -> None:
        """Engine::evaluate_function's loop body for one output edge."""
        self.deps[child] -= 1
        buf = self.buffers.get(child)
        if buf is None:
            if self.should_run is not None and not self.should_run[child]:
                return
            buf = self.buffers[child] = [None] * len(self.call.nodes[child]._input_metadata)
        if grad is not None:
            old = buf[nr]
            buf[nr] = grad if old is None else r.add(old, grad, self.call.node_label(child))
        if self.deps[child] == 0:
            self.queue.push(self.call.seq[child], child)


def drain(r, state: EngineState, resume=None) -> list:
    """Run ready nodes until none is left; returns the captured gradients.

    ``resume``: (node index, its gradients after its pre-hooks): a node that was
    part-way when a graph stopped, finished first.  Each task goes through
    ``r.step(state, i)``, which calls :func:`run_one` (the tracer labels what the
    step recorded).
    """
    if resume is not None:
        i, inputs = resume
        _run_body(r, state, i, inputs)
    queue = state.queue
    while len(queue):
        r.step(state, queue.pop())
    return state.captured


def run_one(r, state: EngineState, i: int) -> None:
    """One task of the ready queue: hooks, the node, post-hooks, hand-off of outputs."""
    call = state.call
    state.ran.add(i)
    inputs = state.buffers.pop(i)
    spec = call.records[i].hooks
    if spec is not None:
        inputs = r.tensor_pre_hooks(i, spec, inputs)
    if i in call.captures:
        for nr, pos in call.captures[i]:
            state.captured[pos] = inputs[nr]
    if state.needed is not None and not state.needed[i]:
        return
    if spec is not None and spec.pre:
        inputs = r.pre_hooks(i, spec, inputs)
    _run_body(r, state, i, inputs)


def _run_body(r, state: EngineState, i: int, inputs) -> None:
    """The node itself (after its pre-hooks), its post-hooks, and the hand-off."""
    call = state.call
    kinds = r.kinds
    spec = call.records[i].hooks
    node = call.nodes[i]
    kind = kinds[i]
    if kind is ACCUMULATE:
        if inputs[0] is not None and node.variable.requires_grad:
            r.accumulate(i, inputs[0], call.records[i].node_input)
        # The leaf's post-accumulate-grad hooks run even where nothing was accumulated (an
        # undefined gradient, a leaf that stopped requiring grad): AccumulateGrad calls them
        # after its accumulation step, whatever that did.
        if spec is not None and spec.post_accumulate:
            r.post_accumulate_hooks(i, spec, call.records[i].node_input)
        if spec is not None:
            _post_hooks(r, i, spec, [], inputs)
        return
    edges = call.records[i].edges
    outputs = None
    if kind is TRACED or kind is FUNCTION:
        inputs = r.formula_inputs(i, inputs, state)
        outputs = r.run_traced(i, node, inputs) if kind is TRACED else r.run_function(i, node, inputs)
    if outputs is None and kind is not OPAQUE:
        kinds[i] = OPAQUE
    if outputs is None:
        outputs = r.run_opaque(i, node, inputs, call.records[i].node_input)
    else:
        outputs = r.validate(node, outputs, edges)
    if state.should_run is not None and kinds[i] is not FUNCTION and not isinstance(node, BackwardCFunction):
        outputs = computed(node, outputs, edges, state.should_run)
    if spec is not None:
        outputs = _post_hooks(r, i, spec, outputs, inputs)
    # A node traced through a tensor subclass left its saved values to the node as well.
    if kinds[i] is OPAQUE or call.records[i].subclass is not None:
        r.release_saved(i, node)
    for g, e in zip(outputs, edges):
        if e is not None:
            state.deliver(r, e[0], e[1], g)


def _post_hooks(r, i: int, spec, outputs, inputs):
    """The node's post-hooks; their outputs.  Where C++ hooks are among them (DDP's reducer on
    an accumulator, which has no outputs) the whole list runs natively, in its order."""
    if spec.native_post:
        r.native_post_hooks(i, inputs)
        return outputs
    if spec.post:
        return r.post_hooks(i, spec, outputs, inputs)
    return outputs


# Builtin nodes whose formula computes a list argument's gradients together: one
# output of the list needed computes them all (derivatives.yaml's TensorList inputs).
_GROUPED_OUTPUTS = frozenset({"CatBackward0", "StackBackward0", "BlockDiagBackward0", "ChunkCatBackward0",
                              "CudnnRnnBackward0", "MiopenRnnBackward0", "MkldnnRnnLayerBackward0",
                              "NestedTensorFromTensorListBackward0"})


def computed(node, outputs, edges, should_run):
    """What a builtin formula hands on when only part of the graph runs (autograd.grad,
    ``backward(inputs=)``): eager computes an output only if its next node runs, so the
    node's post-hooks see None for the others.  (A custom Function's backward returns
    what it returns; a list argument's gradients come as one.)"""
    name = type(node).__name__
    if name in _GROUPED_OUTPUTS or name.startswith("Foreach"):
        return outputs
    return [None if e is not None and not should_run[e[0]] else g for g, e in zip(outputs, edges)]
