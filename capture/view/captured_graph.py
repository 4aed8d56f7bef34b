"""CapturedGraph: a captured backward graph, for running, reading and saving.

Stable API (see docs/API.md §4): ``graph_module``, ``code``, ``guards``,
``print_readable()``, ``_repr_html_()``, ``to_svg()``, ``passes``, ``save(path)``.
Experimental: ``table()``, ``opaque_nodes``, ``summary()``, ``capture_seconds``,
``to_svg``'s ``detail`` and ``engine`` arguments.

What each view shows is decided in ``display`` (kinds and names) and drawn by
``picture``; names given with ``names=`` are stamped on the graph at capture
(``naming``), so a graph always shows the names of the capture that made it.
"""

from __future__ import annotations

import html
import logging

import torch
import torch.fx as fx

from . import display
from .display import node_kind  # noqa: F401  (the one classifier; kept importable from here)

log = logging.getLogger("gradfx")


class CapturedGraph:
    """One captured backward graph."""

    def __init__(self, graph_module: fx.GraphModule, *, passes=(), guards=(), opaque_nodes=(),
                 autograd_nodes: int = 0, capture_seconds: float = 0.0, example_inputs=None):
        from ...reorder import PassRecords
        self.graph_module = graph_module
        self.passes = PassRecords(passes)
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

    def table(self, include_runtime: bool = False) -> list[dict]:
        """One row per fx node: name, label, op, target, shape, dtype, kind, autograd node.

        ``kind`` is one of ``size``, ``grad``, ``saved``, ``leaf`` (inputs),
        ``compute``, ``opaque``, ``check``, ``hook``, ``accumulate``, ``output``, and
        ``runtime`` for the live-object inputs (autograd nodes, hook callables,
        retained tensors), which only ``include_runtime=True`` lists.  ``label`` is
        what pictures show: a leaf's name from ``names=`` (else ``leaf[3, 4]``),
        ``accumulate → 0.weight``, a hook's kind and function name, an op's name.
        """
        return display.table(self.graph_module.graph, include_runtime)

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for node in self.graph_module.graph.nodes:
            k = node_kind(node)
            kinds[k] = kinds.get(k, 0) + 1
        parts = ", ".join(f"{v} {k}" for k, v in kinds.items())
        guards = ("; ".join(self.guards) if len(self.guards) <= 2 else f"{len(self.guards)} lines (.guards)") or "none"
        return (f"CapturedGraph: {self.autograd_nodes} autograd nodes -> "
                f"{len(self.graph_module.graph.nodes)} fx nodes ({parts}); "
                f"{len(self.opaque_nodes)} opaque; guards: {guards}")

    def __repr__(self) -> str:
        return self.summary()

    def print_readable(self, print_output: bool = True) -> str:
        """The graph's code with each value's shape and dtype (sizes symbolic where they
        are), each run of lines headed by the autograd node it computes."""
        text = display.readable(self.graph_module)
        if print_output:
            print(text)
        return text

    def to_svg(self, detail: str = "auto", engine: str = "layered") -> str:
        """Draw the graph top-down as SVG: boxes grouped per autograd node, arrows for data flow.

        ``detail``: ``"full"`` (one box per fx node), ``"summary"`` (one box per
        autograd node) or ``"auto"`` (full up to ``picture.FULL_LIMIT`` boxes).
        ``engine``: ``"layered"`` (built in, pure Python on networkx: the same
        picture on every machine), ``"dot"`` (Graphviz's ``dot``, which must be
        installed) or ``"auto"`` (dot when installed, else layered).
        """
        from . import picture  # networkx costs a quarter second to import: only when drawing
        return picture.draw(self.graph_module, detail, engine)

    def _repr_html_(self) -> str:
        rows = self.table()
        try:
            picture = self.to_svg()
        except Exception as err:  # the table and code still show what the graph is
            log.warning("gradfx: could not draw the graph: %s: %s", type(err).__name__, err)
            picture = f"<p>(no picture: {html.escape(type(err).__name__)}: {html.escape(str(err))})</p>"
        passes = "".join(f"<li>{html.escape(str(p))}</li>" for p in self.passes)
        guards = "".join(f"<li><code>{html.escape(g)}</code></li>" for g in self.guards) or "<li>none</li>"
        return (f"<div><p><b>{html.escape(self.summary())}</b></p>"
                f"<div style='overflow:auto; max-height:640px'>{picture}</div>"
                f"<details><summary>table ({len(rows)} rows)</summary>{display.html_table(rows)}</details>"
                f"<p>Guards:</p><ul>{guards}</ul><p>Passes:</p><ol>{passes}</ol>"
                f"<details><summary>code</summary><pre>{html.escape(self.code)}</pre></details></div>")

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
            if not hasattr(obj, "__qualname__"):  # an object of the capture's (a DTensor rebuild, a plan)
                lines += [f"def {name}(*args):",
                          f"    raise RuntimeError({repr(repr(obj))} + ': a runtime object of the capture, not saved; '",
                          "                       'it needs the live autograd objects')"]
                continue
            lines.append(f"from {module} import {obj.__qualname__} as {name}")
        lines += ["", "", "class Backward(torch.nn.Module):"]
        lines += ["    " + l for l in code.src.strip("\n").splitlines()]
        lines += ["", "", "def random_inputs():", "    torch.manual_seed(0)", "    return ["]
        placeholders = self.graph_module.graph.find_nodes(op="placeholder")
        for spec, node in zip(self._input_specs, placeholders):
            what = display.label(node) if display.node_kind(node) == "leaf" else display.node_kind(node)
            if spec[0] == "tensor":
                _, shape, dtype, leaf = spec
                maker = "torch.randn" if dtype.is_floating_point else "torch.zeros"
                extra = ", requires_grad=True" if leaf else ""
                lines.append(f"        {maker}({list(shape)}, dtype={dtype}{extra}),  # {node.name}: {what}")
            elif spec[0] == "int":
                lines.append(f"        {spec[1]},  # {node.name}: a size")
            else:
                lines.append(f"        None,  # {node.name}: {spec[1]} (a live autograd object; not reproducible)")
        lines += ["    ]", "", "", "if __name__ == '__main__':",
                  "    with torch.no_grad():",
                  "        out = Backward()(*random_inputs())",
                  "    print(out)", ""]
        with open(path, "w") as f:
            f.write("\n".join(lines))
