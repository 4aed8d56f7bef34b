"""CapturedGraph: a captured backward graph, for running, reading and saving.

Stable API (see API.md §4): ``graph_module``, ``code``, ``guards``,
``print_readable()``, ``_repr_html_()``, ``to_svg()``, ``passes``, ``save(path)``.
Experimental: ``table()``, ``opaque_nodes``, ``capture_seconds``.
"""

from __future__ import annotations

import html

import torch
import torch.fx as fx

from . import runtime_ops

_KIND_COLOURS = {
    "input": "#e8e8e8", "compute": "#cfe2ff", "accumulate": "#d1f0d1",
    "opaque": "#ffd6a5", "hook": "#f8c8dc", "output": "#e8e8e8",
}


def node_kind(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    if node.op == "output":
        return "output"
    if node.target is runtime_ops.accumulate_grad:
        return "accumulate"
    if node.target is runtime_ops.call_node:
        return "opaque"
    if node.meta.get("gradfx_kind") == "hook":
        return "hook"
    return "compute"


def _describe(val) -> tuple[str, str]:
    if isinstance(val, torch.Tensor):
        return "[" + ", ".join(str(s) for s in val.shape) + "]", str(val.dtype).replace("torch.", "")
    return "", ""


class CapturedGraph:
    """One captured backward graph."""

    def __init__(self, graph_module: fx.GraphModule, *, passes=(), guards=(), opaque_nodes=(),
                 autograd_nodes: int = 0, capture_seconds: float = 0.0, example_inputs=None):
        self.graph_module = graph_module
        self.passes = list(passes)
        self.guards = list(guards)
        self.opaque_nodes = list(opaque_nodes)
        self.autograd_nodes = autograd_nodes
        self.capture_seconds = capture_seconds
        self._input_specs = [self._spec(x) for x in (example_inputs or [])]

    @staticmethod
    def _spec(x):
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), x.dtype, x.requires_grad and x.is_leaf)
        if isinstance(x, int):
            return ("int", x)
        return ("object", type(x).__name__)

    @property
    def code(self) -> str:
        return self.graph_module.code

    def table(self) -> list[dict]:
        """One row per fx node: name, op, target, shape, dtype, kind, autograd node."""
        rows = []
        for node in self.graph_module.graph.nodes:
            shape, dtype = _describe(node.meta.get("val"))
            target = node.target if node.op != "call_function" else getattr(node.target, "__name__", str(node.target))
            rows.append({"name": node.name, "op": node.op, "target": str(target), "shape": shape,
                         "dtype": dtype, "kind": node_kind(node),
                         "autograd_node": node.meta.get("gradfx_node", "")})
        return rows

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for node in self.graph_module.graph.nodes:
            k = node_kind(node)
            kinds[k] = kinds.get(k, 0) + 1
        parts = ", ".join(f"{v} {k}" for k, v in kinds.items())
        return (f"CapturedGraph: {self.autograd_nodes} autograd nodes -> "
                f"{len(self.graph_module.graph.nodes)} fx nodes ({parts}); "
                f"{len(self.opaque_nodes)} opaque; guards: {self.guards or 'none'}")

    def __repr__(self) -> str:
        return self.summary()

    def print_readable(self, print_output: bool = True) -> str:
        """The graph's code with each value's shape and dtype (sizes symbolic where they are)."""
        text = self.graph_module.print_readable(print_output=False, include_stride=False)
        if print_output:
            print(text)
        return text

    def _repr_html_(self) -> str:
        rows = "".join(
            "<tr style='background:{}'>{}</tr>".format(
                _KIND_COLOURS.get(r["kind"], "#fff"),
                "".join(f"<td>{html.escape(str(r[c]))}</td>" for c in
                        ("name", "op", "target", "shape", "dtype", "kind", "autograd_node")))
            for r in self.table())
        passes = "".join(f"<li>{html.escape(str(p))}</li>" for p in self.passes)
        guards = "".join(f"<li><code>{html.escape(g)}</code></li>" for g in self.guards) or "<li>none</li>"
        return (f"<div><p><b>{html.escape(self.summary())}</b></p>"
                "<table><tr><th>name</th><th>op</th><th>target</th><th>shape</th><th>dtype</th>"
                f"<th>kind</th><th>autograd node</th></tr>{rows}</table>"
                f"<p>Guards:</p><ul>{guards}</ul><p>Passes:</p><ol>{passes}</ol>"
                f"<details><summary>code</summary><pre>{html.escape(self.code)}</pre></details></div>")

    def to_svg(self) -> str:
        """Draw the graph: one box per fx node, coloured by kind, edges for data flow.

        A simple built-in layered layout, so no system package is needed.
        """
        nodes = list(self.graph_module.graph.nodes)
        pos = {n: k for k, n in enumerate(nodes)}
        row_h, box_w, box_h = 34, 300, 24
        height = row_h * len(nodes) + 20
        parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{box_w + 140}" height="{height}" '
                 'font-family="monospace" font-size="11">']
        for n in nodes:
            y = 10 + row_h * pos[n]
            for user in n.users:
                y2 = 10 + row_h * pos[user]
                bend = 20 + 8 * (pos[user] - pos[n]) % 100
                parts.append(f'<path d="M{box_w + 10},{y + box_h / 2} C{box_w + 10 + bend},{y + box_h / 2} '
                             f'{box_w + 10 + bend},{y2 + box_h / 2} {box_w + 10},{y2 + box_h / 2}" '
                             'fill="none" stroke="#888"/>')
        for n in nodes:
            y = 10 + row_h * pos[n]
            kind = node_kind(n)
            shape, dtype = _describe(n.meta.get("val"))
            label = f"{n.name} {shape}"
            mark = {"accumulate": " [acc]", "hook": " [hook]", "opaque": " [opaque]"}.get(kind, "")
            parts.append(f'<rect x="10" y="{y}" width="{box_w}" height="{box_h}" rx="4" '
                         f'fill="{_KIND_COLOURS.get(kind, "#fff")}" stroke="#444"><title>'
                         f'{html.escape(n.meta.get("gradfx_node", ""))}</title></rect>')
            parts.append(f'<text x="16" y="{y + 16}">{html.escape(label + mark)}</text>')
        parts.append("</svg>")
        return "".join(parts)

    def save(self, path) -> None:
        """Write a standalone script that rebuilds this graph and runs it on random inputs."""
        code = self.graph_module.graph.python_code(root_module="self")
        lines = [
            "# Saved by gradfx: a captured backward graph, runnable on its own.",
            "import torch",
            "from torch import device",
        ]
        for name, obj in code.globals.items():
            module = getattr(obj, "__module__", None)
            if name in ("torch", "device") or module is None or not callable(obj):
                continue
            if obj is type(None):
                lines.append(f"{name} = type(None)")
                continue
            if module == "builtins":
                continue
            lines.append(f"from {module} import {obj.__qualname__} as {name}")
        lines += ["", "", "class Backward(torch.nn.Module):"]
        lines += ["    " + l for l in code.src.strip("\n").splitlines()]
        lines += ["", "", "def random_inputs():", "    torch.manual_seed(0)", "    return ["]
        for spec in self._input_specs:
            if spec[0] == "tensor":
                _, shape, dtype, leaf = spec
                maker = "torch.randn" if dtype.is_floating_point else "torch.zeros"
                extra = ", requires_grad=True" if leaf else ""
                lines.append(f"        {maker}({list(shape)}, dtype={dtype}{extra}),")
            elif spec[0] == "int":
                lines.append(f"        {spec[1]},  # a size")
            else:
                lines.append(f"        None,  # {spec[1]} (a live autograd object; not reproducible)")
        lines += ["    ]", "", "", "if __name__ == '__main__':",
                  "    with torch.no_grad():",
                  "        out = Backward()(*random_inputs())",
                  "    print(out)", ""]
        with open(path, "w") as f:
            f.write("\n".join(lines))
