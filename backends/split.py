"""Split a captured graph into a pure aten part and its leaf accumulations.

Compilers such as inductor want pure tensor programs; a captured backward also
writes ``.grad`` through ``accumulate_grad`` calls.  Handing the whole graph to
``torch.compile`` makes dynamo break the graph at every one of those calls
(measured: 14 graph breaks on a 4-layer MLP, 1.2-3x slower than eager).  Instead:

1. the pure part (every op except the accumulations) becomes its own graph that
   returns the gradients to accumulate and the graph's outputs; a backend
   compiles that;
2. a small Python epilogue accumulates the gradients in the original order, with
   ``accumulate_grad``'s own semantics (steal, copy into the layout, add in place).

Moving the accumulations after the pure part cannot be observed: nothing in the
graph reads ``.grad`` (graphs with hooks or opaque calls, which could, are not
split and run on the eager backend).
"""

from __future__ import annotations

import logging
import operator
import time
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..capture.errors import FallbackWarning
from ..capture.run import counters
from ..capture.run.runtime_ops import accumulate_grad_unchecked
from ..capture.trace.kinds import SIDE_EFFECTS, kind_of

log = logging.getLogger("gradfx")


@dataclass
class Split:
    pure: fx.GraphModule  # inputs (a subset of the graph's) -> (*grads, *outputs)
    used_inputs: list[int]  # positions of the pure graph's inputs among the graph's
    accumulations: list[tuple[int, int, bool]]  # (leaf input position, grad index, may steal)
    n_grads: int
    out_spec: object
    n_outputs: int


def _pure(node: fx.Node) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) or node.target in (
        operator.getitem, operator.mul, operator.add, operator.sub, operator.floordiv, operator.mod)


def split(gm: fx.GraphModule) -> Split | None:
    """The split of ``gm``, or None if it has side effects other than accumulations."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    position = {n: k for k, n in enumerate(placeholders)}
    accumulations, grads, acc_nodes = [], [], set()
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            return None
        kind = kind_of(node)
        if kind == "accumulate":
            leaf, grad, steal = node.args
            if node.users or leaf.op != "placeholder":
                return None
            accumulations.append((position[leaf], len(grads), bool(steal)))
            grads.append(grad)
            acc_nodes.add(node)
        elif kind in SIDE_EFFECTS or not _pure(node):
            return None
    output = next(n for n in graph.nodes if n.op == "output")
    outputs, spec = pytree.tree_flatten(output.args[0])

    body = [n for n in graph.nodes if n.op not in ("placeholder", "output") and n not in acc_nodes]
    needed = {a for n in body for a in n.all_input_nodes if a.op == "placeholder"}
    needed |= {a for a in grads + outputs if isinstance(a, fx.Node) and a.op == "placeholder"}
    pure, env, used = fx.Graph(), {}, []
    for node in placeholders:
        if node in needed:
            env[node] = pure.placeholder(node.name)
            env[node].meta = dict(node.meta)
            used.append(position[node])
    for node in body:
        env[node] = pure.node_copy(node, lambda a: env[a])
    value = lambda a: env[a] if isinstance(a, fx.Node) else a  # noqa: E731
    pure.output(tuple(value(a) for a in grads + outputs))
    # A gradient used by two accumulations cannot be stolen by the first.
    uses = [k for _, k, _ in accumulations]
    accumulations = [(leaf, k, steal and uses.count(k) == 1) for leaf, k, steal in accumulations]
    return Split(fx.GraphModule(gm, pure), used, accumulations, len(grads), spec, len(outputs))


def runner(s: Split, compile_pure, example_inputs: list, fallback, name: str = "backend"):
    """A boxed callable: run the compiled pure part, then accumulate.

    ``compile_pure(pure_gm, example_inputs) -> fn(list) -> outputs`` compiles code
    specialized to input shapes: once now for the example inputs, and again for
    each new shape a dynamic graph meets (gradfx's guards pick the graph, this
    picks the compiled code).  Every shape of a graph's tensors is determined by
    its size inputs (the leading int placeholders; none in a static graph), so
    those ints are the key.  The first compile fails like any backend compile
    (gradfx warns and uses the eager backend, or raises ``Unsupported`` in strict
    mode); a later one happens while the graph runs, its inputs already taken
    over, so the graph then runs on ``fallback`` (the eager backend) with a
    warning.  Compiles after the first happen on cache hits: they count as
    ``recompiles`` and are logged, so that a cache hit that takes seconds says why.
    """
    compiled: dict = {}
    leaf_positions = [leaf for leaf, _, _ in s.accumulations]
    n_sizes = 0
    while n_sizes < len(example_inputs) and type(example_inputs[n_sizes]) is int:
        n_sizes += 1

    def compile_now(sub):
        with torch.no_grad():
            return compile_pure(s.pure, [a.detach() if isinstance(a, torch.Tensor) else a for a in sub])

    def compile_for(sub, key):
        fn = compiled.get(key)
        if fn is None:
            start = time.perf_counter()
            try:
                fn = compile_now(sub)
            except Exception as err:
                warnings.warn(f"gradfx: compiling a backward failed ({type(err).__name__}: {err}); "
                              "running it on the eager backend", FallbackWarning)
                fn = False
            compiled[key] = fn
            if len(compiled) > 1:
                counters.note_recompile(name, len(s.pure.graph.nodes), time.perf_counter() - start, key, next(iter(compiled)),
                               len(compiled))
        return fn

    compiled[tuple(example_inputs[:n_sizes])] = compile_now([example_inputs[i] for i in s.used_inputs])

    def boxed(args: list):
        sub = [args[i] for i in s.used_inputs]
        fn = compile_for(sub, tuple(args[:n_sizes]))
        if fn is False:
            del sub
            return fallback(args)
        leaves = [args[i] for i in leaf_positions]
        args.clear()  # the compiled code becomes the only owner of the saved tensors
        outs = list(fn(sub))
        for leaf, (_, k, steal) in zip(leaves, s.accumulations):
            grad = outs[k]
            if steal:
                outs[k] = None  # so that accumulate_grad sees no other reference
            # Unchecked: the pure part was compiled from the traced graph by gradfx's
            # own pipeline, so its gradients have their leaves' metadata.
            accumulate_grad_unchecked(leaf, grad, steal)
            del grad
        return pytree.tree_unflatten(outs[s.n_grads:s.n_grads + s.n_outputs], s.out_spec)

    def run(*args):
        return boxed(list(args))
    run._boxed = boxed
    return run
