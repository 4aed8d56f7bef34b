"""What a captured graph's nodes are and what to call them, for every view.

One place classifies fx nodes (:func:`node_kind`) and names them
(:func:`label`, :func:`group_labels`); the table, the HTML view, the readable
code and the picture (``picture``) all read from here.  The tracer stamps
``node.meta["gradfx_kind"]`` on placeholders (``size``, ``grad``, ``saved``,
``variable``, ``node``, ``hook``, ``retained``) and on Python calls (``hook``,
``opaque``, ``check``, ``accumulate``, ``compute``); aten ops carry no stamp.
"""

from __future__ import annotations

import html
import operator
import re
from collections import Counter

import torch
import torch.fx as fx

from ..runtime import hook_ops, runtime_ops
from ..trace.fx_kinds import kind_of
from .annotate import tensor_label

# Input kinds, by what a person reads them as.  "runtime" inputs are live
# objects (autograd nodes, hook callables, retained tensors): the code needs
# them, people don't, so tables and pictures leave them out.
_PLACEHOLDER_KINDS = {"size": "size", "grad": "grad", "saved": "saved", "variable": "leaf",
                      "node": "runtime", "hook": "runtime", "retained": "runtime"}
INPUT_KINDS = frozenset(_PLACEHOLDER_KINDS.values()) | {"input"}
HIDDEN_KINDS = frozenset({"runtime"})

COLOURS = {
    "grad": "#e8e8e8", "saved": "#f2f2f2", "leaf": "#fff3b0", "size": "#e8e8e8", "input": "#e8e8e8",
    "runtime": "#e8e8e8", "compute": "#cfe2ff", "accumulate": "#c7ebc7", "opaque": "#ffd6a5",
    "check": "#ffe0b2",
    "hook": "#f8c8dc", "output": "#e8e8e8",
}

_HOOK_WORDS = {
    hook_ops.call_tensor_hook: "tensor hook", hook_ops.call_pre_hook: "pre-hook",
    hook_ops.call_post_hook: "post-hook", hook_ops.call_post_accumulate_hook: "post-accumulate hook",
    hook_ops.call_node_post_hooks: "post-hooks (C++ too)",
    hook_ops.retain_grad: "retain_grad",
}


def node_kind(node: fx.Node) -> str:
    """``size``, ``grad``, ``saved``, ``leaf``, ``runtime`` (inputs), ``compute``,
    ``opaque``, ``check``, ``hook``, ``accumulate`` or ``output``."""
    kind = kind_of(node)
    if node.op == "placeholder":
        return _PLACEHOLDER_KINDS.get(kind, "input")
    return kind


def shown(node: fx.Node) -> bool:
    """Is the node in tables and pictures (runtime objects are in the code only)?"""
    return node_kind(node) not in HIDDEN_KINDS


def shape_of(node: fx.Node) -> tuple[str, str]:
    """("[2, 3]", "float32") of the node's value; leaves' shapes come from the capture."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _shape_text(val.shape), str(val.dtype).replace("torch.", "")
    if "gradfx_shape" in node.meta:
        return _shape_text(node.meta["gradfx_shape"]), str(node.meta["gradfx_dtype"]).replace("torch.", "")
    if isinstance(val, torch.SymInt):
        return str(val), "int"
    return "", ""


def short_shape(node: fx.Node) -> str:
    """``f32[2, 3]`` as print_readable writes it; "" when the node holds no tensor."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return _abbr(val.dtype) + _shape_text(val.shape)
    if "gradfx_shape" in node.meta:
        return _abbr(node.meta["gradfx_dtype"]) + _shape_text(node.meta["gradfx_shape"])
    return ""


def _abbr(dtype) -> str:
    return _DTYPE_ABBR.get(dtype, str(dtype).replace("torch.", ""))


_DTYPE_ABBR = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
               torch.int64: "i64", torch.int32: "i32", torch.bool: "b8", torch.uint8: "u8", torch.int8: "i8"}


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def leaf_label(node: fx.Node) -> str:
    """A leaf placeholder as people know it: ``0.weight``, or ``leaf[3, 4]``."""
    return tensor_label(node.meta.get("gradfx_name"), node.meta.get("gradfx_shape", ()))


def op_name(node: fx.Node) -> str:
    """The short name of what a call node computes: ``mm``, ``threshold_backward``, ``[1]``."""
    target = node.target
    if target is operator.getitem:
        return f"[{node.args[1]}]"
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    return getattr(target, "__name__", str(target))


def label(node: fx.Node) -> str:
    """What pictures and tables call the node."""
    kind = node_kind(node)
    if kind == "leaf":
        return leaf_label(node)
    if kind == "size":
        return str(node.meta.get("val", node.name))
    if kind in ("grad", "saved"):
        return kind
    if kind == "accumulate":
        leaf = node.args[0] if node.args else None
        return "accumulate → " + (leaf_label(leaf) if isinstance(leaf, fx.Node) else "leaf")
    if kind == "hook":
        words = _HOOK_WORDS.get(node.target, op_name(node))
        hook = node.args[0] if node.args else None
        name = hook.meta.get("gradfx_name") if isinstance(hook, fx.Node) else None
        return f"{words} {name}" if name and node.target is not hook_ops.retain_grad else words
    if kind == "opaque":
        if node.target is runtime_ops.release_saved:
            return "release saved"
        return "opaque " + ("backward" if node.target is runtime_ops.call_backward else "node")
    if kind == "check":
        return "stop if None"
    if kind == "output":
        names = node.meta.get("gradfx_names")
        return "output" + (" (" + ", ".join(names) + ")" if names else "")
    return op_name(node)


def autograd_label(raw: str, leaf: fx.Node | None = None) -> str:
    """``torch::autograd::AccumulateGrad #leaf`` -> ``AccumulateGrad 0.weight``."""
    raw = raw.replace("torch::autograd::", "")
    if raw.startswith("AccumulateGrad") and leaf is not None:
        return "AccumulateGrad " + leaf_label(leaf)
    return raw


def group_of(node: fx.Node):
    """The autograd node (its index in the backward) that recorded ``node``; None for
    root gradients, sizes and the output."""
    return node.meta.get("gradfx_node_index")


def group_labels(graph: fx.Graph) -> dict:
    """index -> label of every autograd node with a node in ``graph``.

    Every autograd node has an input of its own (its node object or its leaf),
    stamped with its exact label; other nodes of the group may carry the label
    of the node they deliver to (buffer sums), so they only fill gaps.
    """
    exact, votes = {}, {}
    for node in graph.nodes:
        index = group_of(node)
        if index is None or "gradfx_node" not in node.meta:
            continue
        kind = node.meta.get("gradfx_kind")
        if node.op == "placeholder" and kind in ("node", "variable"):
            if kind == "variable" or index not in exact:  # a leaf names its accumulator
                exact[index] = autograd_label(node.meta["gradfx_node"], node if kind == "variable" else None)
        else:
            votes.setdefault(index, Counter())[node.meta["gradfx_node"]] += 1
    for index, counter in votes.items():
        if index not in exact:
            exact[index] = autograd_label(counter.most_common(1)[0][0])
    return exact


def autograd_edges(graph: fx.Graph) -> list[tuple]:
    """The autograd graph's edges among the nodes that ran: (index, index), and
    (root gradient placeholder, index) for the roots."""
    groups = group_labels(graph)
    edges = []
    for node in graph.find_nodes(op="placeholder"):
        for child in node.meta.get("gradfx_next", ()):
            if child in groups:
                edges.append((group_of(node) if group_of(node) is not None else node, child))
    return list(dict.fromkeys(edges))


def after_accumulation(graph: fx.Graph) -> list[tuple[fx.Node, fx.Node]]:
    """(accumulation, post-accumulate hook) pairs.

    The hook runs once the leaf's ``.grad`` is written, but both nodes only read
    the leaf, so no fx edge says that one follows the other; pictures draw it.
    """
    last = {}  # leaf -> its latest accumulation so far
    pairs = []
    for node in graph.nodes:
        kind = node_kind(node)
        if kind == "accumulate" and node.args and isinstance(node.args[0], fx.Node):
            last[node.args[0]] = node
        elif kind == "hook" and node.target is hook_ops.call_post_accumulate_hook:
            leaf = node.args[1] if len(node.args) > 1 else None
            if leaf in last:
                pairs.append((last[leaf], node))
    return pairs


def pass_through(graph: fx.Graph) -> list:
    """Autograd nodes that record no shown fx node: their backward hands the
    gradient on unchanged (``AddBackward0``, ``CloneBackward0``, ...)."""
    seen = {group_of(n) for n in graph.nodes if shown(n)}
    return [i for i in group_labels(graph) if i not in seen]


def table(graph: fx.Graph, include_runtime: bool = False) -> list[dict]:
    """One row per fx node (runtime-object inputs only with ``include_runtime``)."""
    groups = group_labels(graph)
    rows = []
    for node in graph.nodes:
        if not include_runtime and not shown(node):
            continue
        shape, dtype = shape_of(node)
        target = node.target if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))
        index = group_of(node)
        rows.append({"name": node.name, "op": node.op, "target": str(target), "shape": shape,
                     "dtype": dtype, "kind": node_kind(node), "label": label(node),
                     "autograd_node": groups.get(index, autograd_label(node.meta.get("gradfx_node", "")))})
    return rows


_NOISE = "# No stacktrace found for following nodes"
_ASSIGNED = re.compile(r"^\s+([A-Za-z_]\w*)\s*(?::\s*\"[^\"]*\")?\s*=")


def readable(gm: fx.GraphModule) -> str:
    """``print_readable()``'s text, each run of lines headed by its autograd node.

    torch heads runs of nodes with their Python stack trace, or with "No
    stacktrace found" when there is none (always, here); the autograd node is
    the useful heading for a backward graph.
    """
    text = gm.print_readable(print_output=False, include_stride=False)
    by_name = {n.name: n for n in gm.graph.nodes}
    groups = group_labels(gm.graph)
    out, current = [], None
    for line in text.splitlines():
        if line.strip() == _NOISE:
            continue
        match = _ASSIGNED.match(line)
        node = by_name.get(match.group(1)) if match else None
        if node is not None:
            heading = groups.get(group_of(node))
            if heading is not None and heading != current:
                indent = line[: len(line) - len(line.lstrip())]
                out.append(f"{indent}# {heading}")
            current = heading
        out.append(line)
    return "\n".join(out) + "\n"


def html_table(rows: list[dict]) -> str:
    columns = ("name", "label", "op", "target", "shape", "dtype", "kind", "autograd_node")
    head = "".join(f"<th>{c.replace('_', ' ')}</th>" for c in columns)
    body = "".join(
        "<tr style='background:{}'>{}</tr>".format(
            COLOURS.get(r["kind"], "#fff"), "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in columns))
        for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"
