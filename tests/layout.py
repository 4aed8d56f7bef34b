"""The package's layers, read from its imports: what test_layout checks and
docs/ARCHITECTURE.md draws.  ``python tests/layout.py`` prints the picture, the
import counts and the lines per layer.

A module's imports of other gradfx modules are read from its source (the module
level and inside functions alike).  Each module belongs to one layer; a layer may
import the layers below it.  An import of a layer above is an upward import.
"""

from __future__ import annotations

import ast
import collections
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
_OUTSIDE = {"tests", "bench", "notebooks", "docs", "build"}

# Top to bottom: (layer, what it holds, the module prefixes it owns).  A module belongs to
# the layer of its longest matching prefix.
LAYERS = [
    ("gradfx", "the public names, the command line", ("", "__main__")),
    ("capture.api", "compiled_autograd and capture", ("capture.api",)),
    ("capture.run", "the driver of a backward: session, routing, cache, self-check",
     ("capture.run",)),
    ("capture.pipeline", "one capture: walk, trace, passes, backend", ("capture.pipeline",)),
    ("capture.view", "what a captured graph shows: display, picture, explanations", ("capture.view",)),
    ("backends", "the compilers", ("backends",)),
    ("reorder", "the passes", ("reorder",)),
    ("capture.trace", "the tracer on fake tensors", ("capture.trace",)),
    ("capture.runtime", "what graphs call when they run", ("capture.runtime",)),
    ("capture.graph", "the readers of the live autograd graph", ("capture.graph",)),
    ("capture.native", "the compiled part", ("capture.native",)),
    ("capture (shared)", "errors, logs, torch releases", ("capture", "capture.errors", "capture.logs",
                                                             "capture.torch_releases", "capture.stacklevel")),
]


def modules() -> dict[str, pathlib.Path]:
    """Dotted name (relative to the package; "" is the package itself) -> file."""
    found = {}
    for directory, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(d for d in dirs if d not in _OUTSIDE and not d.startswith((".", "_")) and
                         not d.endswith(".egg-info"))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = (pathlib.Path(directory) / f).relative_to(ROOT).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = pathlib.Path(directory) / f
    return found


def _target(names: dict, base: str, alias: str) -> str | None:
    candidate = f"{base}.{alias}" if base else alias
    if candidate in names:
        return candidate
    return base if base in names else None


def imports(names: dict) -> dict[str, set]:
    """Module -> the gradfx modules it imports."""
    edges = collections.defaultdict(set)
    for name, path in names.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        if name == "":
            package = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)]
                    base = ".".join(base + ([node.module] if node.module else []))
                elif node.module and (node.module == "gradfx" or node.module.startswith("gradfx.")):
                    base = node.module[len("gradfx") + 1:]
                else:
                    continue
                for alias in node.names:
                    target = _target(names, base, alias.name)
                    if target is not None and target != name:
                        edges[name].add(target)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("gradfx."):
                        target = _target(names, alias.name[len("gradfx."):], "")
                        if target is not None and target != name:
                            edges[name].add(target)
    return edges


def layer_of(name: str) -> int:
    best, depth = None, -1
    for k, (_, _, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or (p and name.startswith(p + "."))) and len(p) > depth:
                best, depth = k, len(p)
            elif p == "" and name == "" and depth < 0:
                best, depth = k, 0
    if best is None:
        raise LookupError(f"module {name!r} belongs to no layer of tests/layout.py")
    return best


def upward(names: dict, edges: dict) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in edges.items() for b in targets if layer_of(b) < layer_of(a))


def circles(edges: dict) -> list[list[str]]:
    """The import circles: strongly connected sets of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))
    sys.setrecursionlimit(10000)
    for v in sorted(set(edges) | {w for ws in edges.values() for w in ws}):
        if v not in index:
            visit(v)
    return out


def lines_per_layer(names: dict) -> list[tuple[str, int, int]]:
    """(layer, modules, lines) per layer."""
    counts = collections.Counter()
    sizes = collections.Counter()
    for name, path in names.items():
        k = layer_of(name)
        counts[k] += 1
        sizes[k] += len(path.read_text().splitlines())
    return [(LAYERS[k][0], counts[k], sizes[k]) for k in range(len(LAYERS))]


def picture(names: dict, edges: dict) -> str:
    """The layers top to bottom, each with the layers it imports directly."""
    below = collections.defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if layer_of(a) != layer_of(b):
                below[layer_of(a)].add(layer_of(b))
    width = max(len(layer) for layer, _, _ in LAYERS)
    rows = []
    for k, (layer, what, _) in enumerate(LAYERS):
        uses = ", ".join(LAYERS[j][0] for j in sorted(below[k]))
        rows.append(f"{layer:<{width}}  {what}" + (f"\n{'':<{width}}    imports: {uses}" if uses else ""))
    return "\n".join(rows)


def main() -> None:
    names = modules()
    edges = imports(names)
    print(picture(names, edges))
    print()
    total = sum(len(v) for v in edges.values())
    print(f"{len(names)} modules, {total} import edges, {len(upward(names, edges))} upward, "
          f"{len(circles(edges))} circles")
    for a, b in upward(names, edges):
        print(f"  upward: {a} -> {b}")
    for group in circles(edges):
        print("  circle: " + " <-> ".join(group))
    for layer, n, lines in lines_per_layer(names):
        print(f"  {layer:<18} {n:>3} modules {lines:>6} lines")


if __name__ == "__main__":
    main()
