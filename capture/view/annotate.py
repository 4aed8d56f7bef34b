"""What the views of a graph need from the live backward, stamped on it at capture.

The graph alone cannot say what its leaves are called, what shape a leaf has
(leaves are objects, not traced tensors) or how its autograd nodes connect
(nodes whose backward is the identity record no fx node).  :func:`apply` writes
those into ``node.meta`` while the live call is at hand; ``display`` reads them.

Names people recognise for leaves come from ``names=``.

``names=`` of :func:`gradfx.capture` and :func:`gradfx.compiled_autograd` is an
``nn.Module`` (its ``named_parameters()`` and ``named_buffers()``), a mapping
tensor -> name, a mapping name -> tensor, or pairs ``(name, tensor)`` such as
``model.named_parameters()``.

At capture time each leaf input of the graph is looked up; a named leaf gets

* ``node.meta["gradfx_name"] = "0.weight"`` on its placeholder and on its
  accumulation (what tables and pictures show), and
* the placeholder's name ``l_0_weight`` (a valid identifier), which is what
  ``.code``, ``print_readable()`` and ``save()`` show.

Names are display only: they never enter a cache key.  A graph shows the names
given to the capture that made it; a cache hit from a block with other names
reuses that graph as it is (and adds no graph to ``session.graphs``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch
import torch.fx as fx

from ..runtime import runtime_ops


class Names:
    """The ``names=`` argument, resolved to names at each capture.

    A module is read when a graph is captured (not when the block starts), so
    parameters replaced in between are still found.
    """

    def __init__(self, names):
        self._module = None
        self._pairs: list[tuple[torch.Tensor, str]] = []
        if isinstance(names, torch.nn.Module):
            self._module = names
        elif isinstance(names, Mapping):
            for key, value in names.items():
                self._pairs.append(_pair(key, value))
        elif isinstance(names, Iterable) and not isinstance(names, (str, bytes, torch.Tensor)):
            for item in names:
                if not (isinstance(item, tuple) and len(item) == 2):
                    raise TypeError(f"names= pairs must be (name, tensor), got {type(item).__name__}")
                self._pairs.append(_pair(*item))
        else:
            raise TypeError("names= must be an nn.Module, a mapping tensor -> name or (name, tensor) "
                            f"pairs, got {type(names).__name__}")

    def lookup(self) -> dict[int, tuple[torch.Tensor, str]]:
        """id(tensor) -> (tensor, name); the tensor is kept to check identity (ids are reused)."""
        pairs = self._pairs
        if self._module is not None:
            pairs = [(t, n) for n, t in self._module.named_parameters()]
            pairs += [(t, n) for n, t in self._module.named_buffers()]
        found: dict[int, tuple[torch.Tensor, str]] = {}
        for t, n in pairs:
            found.setdefault(id(t), (t, n))  # the first name of a shared tensor, as named_parameters
        return found


def _pair(key, value) -> tuple[torch.Tensor, str]:
    if isinstance(key, torch.Tensor) and isinstance(value, str):
        return key, value
    if isinstance(key, str) and isinstance(value, torch.Tensor):
        return value, key
    raise TypeError(f"names= entries map a tensor to a str, got {type(key).__name__} -> {type(value).__name__}")


def identifier(name: str) -> str:
    """A placeholder name for a leaf named ``name``: ``0.weight`` -> ``l_0_weight``."""
    return "l_" + (re.sub(r"\W", "_", name, flags=re.ASCII) or "_")


def tensor_label(name: str | None, shape) -> str:
    """What a leaf is called in tables and pictures: its name, else ``leaf[3, 4]``."""
    return name if name else "leaf[" + ", ".join(str(s) for s in shape) + "]"


def runtime_placeholders(graph: fx.Graph):
    """(placeholder, runtime input position) for every input that is not a size."""
    pos = 0
    for node in graph.find_nodes(op="placeholder"):
        if node.meta.get("gradfx_kind") == "size":
            continue
        yield node, pos
        pos += 1


def apply(graph: fx.Graph, call, names: Names | None, grad_inputs=()) -> None:
    """Stamp what the views show on ``graph``, captured from ``call`` (a BackwardCall).

    Leaves get their shape and dtype always and their name where ``names`` has
    one; hook inputs get the hook's name; each autograd node's own input (its
    node object or leaf) and each root gradient get ``gradfx_next``, the autograd
    nodes they hand gradients to; with ``grad_inputs`` (``autograd.grad``'s
    ``inputs``), the output node gets the name of each returned gradient.
    """
    inputs = call.inputs
    known = names.lookup() if names is not None else {}

    def name_of(t):
        hit = known.get(id(t))
        return hit[1] if hit is not None and hit[0] is t else None

    leaves = {}
    for node, pos in runtime_placeholders(graph):
        kind = node.meta.get("gradfx_kind")
        value = inputs[pos]
        owner = call.input_owner[pos]
        if owner < 0:  # a root gradient
            node.meta["gradfx_next"] = (call.roots[pos][0],)
        elif kind in ("node", "variable") and call.records[owner].node_input == pos:
            node.meta["gradfx_next"] = tuple(e[0] for e in call.records[owner].edges if e is not None)
        if kind == "variable":
            node.meta["gradfx_shape"] = tuple(value.shape)
            node.meta["gradfx_dtype"] = value.dtype
            name = name_of(value)
            node.meta["gradfx_name"] = name
            leaves[node] = name
            if name:
                node._rename(identifier(name))
                node.target = node.name  # a placeholder's target is its argument name in the code
        elif kind == "hook":
            node.meta["gradfx_name"] = getattr(value, "__name__", type(value).__name__)
    for node in graph.find_nodes(op="call_function", target=runtime_ops.accumulate_grad):
        leaf = node.args[0]
        if leaf in leaves:
            node.meta["gradfx_name"] = leaves[leaf]
    if grad_inputs:
        output = next(iter(graph.find_nodes(op="output")))
        output.meta["gradfx_names"] = [name_of(t) or tensor_label(None, t.shape) for t in grad_inputs]
