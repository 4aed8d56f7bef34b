"""Symbolic sizes and the guards under which a captured graph is reused.

A backward's sizes are gathered by the walk into one flat list (``call.sizes``):
tensor shapes, strides of non-contiguous tensors, input-metadata shapes and saved
size values.  A graph is captured for a set of *dynamic* positions of that list:
each gets a symbol in a ShapeEnv (no duck sizing), shared by the positions that are
one size or given as a product of symbols (``size_relations``), every other position
is static.  Tracing with those symbols records, in the ShapeEnv, every further
relation the backward formulas rely on (``s3 == s0``, ``s0 >= 2``, ...).  The guard
of the graph is then:

* static positions equal their captured values;
* positions sharing a symbol are equal, a product position equals its product;
* each symbol equals its expression after the ShapeEnv's replacements (so
  ``sizes[7] == sizes[0]`` where two dims must agree);
* the free symbols lie in their ranges, and the ShapeEnv's other guards hold.

It is compiled into one Python function of ``sizes``, so checking it costs a few
microseconds.
"""

from __future__ import annotations

import inspect
import operator
import os
from dataclasses import dataclass

import sympy
import torch
from torch._guards import GuardSource, Source
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
from torch.utils._sympy.numbers import int_oo
from torch.utils._sympy.printers import PythonPrinter

from .rules import RULES
from .size_relations import Product
from ..graph import hidden
from ..graph.kinds import ACCUMULATE, TRACED
from ..graph.walk import BackwardCall


@dataclass(frozen=True)
class SizeSource(Source):
    """Where a symbol comes from: a position of the backward's size list."""

    pos: int

    @property
    def name(self) -> str:
        return f"sizes[{self.pos}]"

    @property
    def guard_source(self) -> GuardSource:
        return GuardSource.LOCAL


class _ShapeEnv(ShapeEnv):
    """torch's ShapeEnv, finding the user's frame (where a symbol or guard comes from,
    for messages) by skipping torch's and gradfx's own files.  torch's version first
    builds its list of "uninteresting" files, which imports much of torch._inductor
    and torch._dynamo: 0.2 s on the first symbol of every process."""

    def _get_user_frame(self):
        frame = inspect.currentframe()
        while frame is not None and frame.f_code.co_filename.startswith(_OWN_FILES):
            frame = frame.f_back
        return frame


_OWN_FILES = (os.path.dirname(torch.__file__),
              *(os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), d)
                for d in ("capture", "backends", "reorder")))


def dynamic_candidates(call: BackwardCall) -> set[int]:
    """dynamic=True: every size that is not 0 or 1 (those stay static: broadcasting),
    except the sizes of parameters (``parameter_positions``)."""
    return {p for p, v in enumerate(call.sizes) if v >= 2} - parameter_positions(call)


def _is_parameter(t) -> bool:
    # An nn.Parameter, or a view of one (Linear saves weight.t()); a plain leaf (data
    # that requires grad) stays symbolic.
    if isinstance(t, torch.nn.Parameter):
        return True
    base = t._base
    return base is not None and isinstance(base, torch.nn.Parameter)


def parameter_positions(call: BackwardCall) -> set[int]:
    """Sizes of nn.Parameters (and of their views, and the input metadata of their
    accumulators): static, as torch.compile keeps parameters' shapes.  Weights keep
    their shapes from step to step, and symbols for them would only be unified with
    constants, slowly: they made a first symbolic capture of a 16-layer MLP 1.4x slower.
    A parameter whose size does change is guarded; its next size recaptures."""
    out = set()
    for pos, (start, ndim, stride_start) in call.tensor_slots.items():
        t = call.inputs[pos]
        if isinstance(t, torch.Tensor) and _is_parameter(t):
            out.update(range(start, start + ndim))
            if stride_start >= 0:
                out.update(range(stride_start, stride_start + ndim))
    for (i, nr), start in call.meta_slots():
        if call.kinds[i] is ACCUMULATE and isinstance(call.nodes[i].variable, torch.nn.Parameter):
            out.update(range(start, start + len(call.nodes[i]._input_metadata[nr].shape)))
    return out


def changed_positions(old, new, call: BackwardCall | None = None) -> set[int]:
    """dynamic="auto": sizes that changed (to 2 or more) between two backwards of one structure.

    With ``call``, also every size of the saved tensors of a node that had a
    changed size: such sizes often follow the changed ones with rounding (an RNN
    workspace sized for the batch), so they are made symbolic before they change.
    """
    # A size that was 0 or 1 (broadcasting) and is now 2 or more becomes symbolic as
    # well: the graph captured for 0 or 1 stays for those, the new one takes >= 2.
    changed = {p for p, (a, b) in enumerate(zip(old, new)) if a != b and b >= 2}
    if call is None or not changed:
        return changed
    touched = set()
    for pos, (start, ndim, stride_start) in call.tensor_slots.items():
        if any(p in changed for p in range(start, start + ndim)):
            touched.add(call.input_owner[pos])
    for pos, (start, ndim, stride_start) in call.tensor_slots.items():
        if call.input_owner[pos] in touched and call.input_kinds[pos] == "saved":
            for p in range(start, start + ndim):
                if new[p] >= 2:
                    changed.add(p)
    return changed


def baked_positions(call: BackwardCall) -> set[int]:
    """Sizes that a traced node's own C++ formula would read as constants (no rule)."""
    out = set()
    for (i, attr), (start, layout) in call.value_slots():
        if attr == hidden.SIZES:  # read by the tracer's own rule (CopySlices), symbolic
            continue
        # (a node a tensor subclass reaches runs as itself in a symbolic trace)
        if call.kinds[i] is TRACED and type(call.nodes[i]).__name__ not in RULES and not call.records[i].subclass:
            out.update(range(start, start + _count(layout)))
    return out


def _count(layout) -> int:
    if layout is None:
        return 1
    if layout == "none":
        return 0
    return sum(_count(x) for x in layout)


class SymbolicSizes:
    """The symbols of one capture: position -> SymInt, in a fresh ShapeEnv.

    ``groups`` (position -> key) makes positions with the same key share a symbol;
    by default each position has its own.  A position whose key is a
    ``size_relations.Product`` is that product of other groups' symbols.
    """

    def __init__(self, sizes: list, dynamic, groups: dict | None = None):
        self.shape_env = _ShapeEnv(duck_shape=False)
        self.sizes = list(sizes)
        groups = groups if groups is not None else {}
        # Derived positions (a Product of other groups' symbols) get no symbol of their
        # own and are no input of the graph: the guard checks them against the product.
        self.derived = {p: groups[p] for p in dynamic if isinstance(groups.get(p), Product)}
        self.positions = sorted(p for p in dynamic if p not in self.derived)
        self.symint = {}
        self.symbol = {}  # position -> its symbol (SymNode.expr shows replacements)
        made: dict = {}
        for p in self.positions:
            group = groups.get(p, p)
            if group in made:
                self.symbol[p], self.symint[p] = made[group]
                continue
            source = SizeSource(p)
            sym = self.shape_env.create_symbol(sizes[p], source, dynamic_dim=DimDynamic.DYNAMIC)
            self.symbol[p] = sym
            self.symint[p] = self.shape_env.create_symintnode(sym, hint=sizes[p], source=source)
            made[group] = (sym, self.symint[p])
        for p, product in self.derived.items():
            value = product.const
            for root in product.factors:
                value = value * made[groups.get(root, root)][1]
            self.symint[p] = value
            self.symbol[p] = value.node.expr

    @property
    def dynamic(self) -> set:
        """Every position that is not static: symbols and products of them."""
        return set(self.positions) | set(self.derived)

    def value(self, p):
        return self.symint.get(p, self.sizes[p])

    def values(self, start, n):
        return [self.value(p) for p in range(start, start + n)]

    def rebuild(self, start, layout):
        """A saved size value (int / tuple / list of tuples) with symbols in place."""
        pos = [start]

        def build(lay):
            if lay is None:
                v = self.value(pos[0])
                pos[0] += 1
                return v
            if lay == "none":
                return None
            return tuple(build(x) for x in lay)
        return build(layout)

    def guard(self, describe=None) -> "Guard":
        """The guard; ``describe(position)`` names where a size comes from."""
        return Guard.build(self, describe)


class Guard:
    """The compiled condition on ``sizes`` under which a graph is reused.

    ``conditions`` are sympy booleans over one symbol per dynamic position (its
    own ShapeEnv symbol); the check binds each symbol to its size and evaluates
    their conjunction, printed as one expression so that an ``or`` inside a
    condition can never leak out of it.
    """

    def __init__(self, check, text: list[str], positions: list[int], explain=None):
        self.check = check
        self.text = text
        self.positions = positions  # the free symbols' positions
        self._explain = explain

    def failing(self, sizes) -> str:
        """The first condition that ``sizes`` break, with the values (for logs)."""
        return self._explain(sizes) if self._explain is not None else "sizes differ"

    def __call__(self, sizes) -> bool:
        return self.check(sizes)

    @staticmethod
    def static(sizes) -> "Guard":
        expected = tuple(sizes)
        return Guard(lambda s: tuple(s) == expected, [f"all {len(expected)} sizes as captured"], [])

    @staticmethod
    def build(symbolic: SymbolicSizes, describe=None) -> "Guard":
        # Each symbol is read from the first position that has it; the other positions
        # of a shared symbol must equal it.
        bound, others = {}, {}
        for p in symbolic.positions:
            sym = symbolic.symbol[p]
            if sym in bound.values():
                others[p] = sym
            else:
                bound[p] = sym
        shown_conditions, implied = guard_conditions(symbolic)
        # Positions sharing a symbol or holding a product of symbols are compared as
        # plain Python (a tuple per expression): as sympy equations, printing and joining
        # them cost more than the rest of the guard (T5: 1,700 of them, 0.9 s).
        others.update((p, symbolic.symbol[p]) for p in symbolic.derived)
        others = dict(sorted(others.items()))
        conditions = shown_conditions + implied
        unbound = set().union(*(c.free_symbols for c in conditions), *(e.free_symbols for e in others.values()))
        unbound -= set(bound.values())
        if unbound:  # a symbol no size stands for (data-dependent): no guard can check it
            raise ValueError(f"guard uses symbols without a size: {sorted(map(str, unbound))}")
        dynamic = symbolic.dynamic
        static = [p for p in range(len(symbolic.sizes)) if p not in dynamic]
        printer = PythonPrinter()
        bindings = [f"{bound[p]} = sizes[{p}]" for p in sorted(bound)]
        body = printer.doprint(sympy.And(*conditions)) if conditions else "True"
        getter = operator.itemgetter(*static) if static else (lambda s: ())
        expected = tuple(symbolic.sizes[p] for p in static)
        if len(static) == 1:
            expected = expected[0]
        src = "def check(sizes):\n    if getter(sizes) != expected:\n        return False\n    "
        src += "\n    ".join(bindings) + "\n"
        namespace = {"getter": getter, "expected": expected}
        by_expr: dict = {}  # the positions of each expression: one C-level read per expression
        for p, e in others.items():
            by_expr.setdefault(printer.doprint(e), []).append(p)
        for k, (e, ps) in enumerate(by_expr.items()):
            if len(ps) == 1:
                src += f"    if sizes[{ps[0]}] != ({e}):\n        return False\n"
            else:
                namespace[f"same{k}"] = operator.itemgetter(*ps)
                src += f"    if same{k}(sizes) != ({e},) * {len(ps)}:\n        return False\n"
        src += f"    return bool({body})\n"
        exec(compile(src, "<gradfx guard>", "exec"), namespace)

        # What users read: free symbols by name, every other position as sizes[p].
        env = symbolic.shape_env
        home = {sym: p for p, sym in bound.items()}
        free = [sym for sym in bound.values() if env.replace(sym) == sym]
        shown = {sym: sympy.Symbol(f"sizes[{p}]") for p, sym in bound.items()
                 if sym not in free}
        lines = [printer.doprint(c.xreplace(shown)) for c in conditions]
        alias_lines = [f"sizes[{p}] == {printer.doprint(e.xreplace(shown))}" for p, e in others.items()]
        text = list(dict.fromkeys(lines[:len(shown_conditions)] + alias_lines))
        text.append(f"{len(static)} other sizes as captured")
        if describe is not None:
            for sym in sorted(free, key=home.__getitem__):
                text.append(f"where {sym} is sizes[{home[sym]}]: {describe(home[sym])}")

        def explain(sizes):
            for p in static:
                if sizes[p] != symbolic.sizes[p]:
                    return f"static sizes[{p}] == {symbolic.sizes[p]} (got {sizes[p]})"
            values = {sym: sympy.Integer(sizes[p]) for p, sym in bound.items()}
            for (p, e), line in zip(others.items(), alias_lines):
                want = e.xreplace(values)
                if want != sizes[p]:
                    return f"{line} (got {sizes[p]}, expected {want})"
            for cond, line in zip(conditions, lines):
                if cond.xreplace(values) is not sympy.true:
                    return f"{line} with {dict((str(s), int(values[s])) for s in cond.free_symbols)}"
            return "none"
        return Guard(namespace["check"], text, sorted(home[s] for s in free), explain)


def guard_conditions(symbolic: SymbolicSizes) -> tuple[list, list]:
    """Every condition the trace relied on, as sympy booleans over the positions' symbols:
    (the conditions to show, those implied by them, checked all the same).

    * each symbol within its range (the ShapeEnv's lower bound, 2 by default);
    * each position whose symbol the ShapeEnv replaced equals its replacement
      (``s7 == s0`` where two dims must agree);
    * the ShapeEnv's guards (after replacements), minus those that hold trivially.
    """
    env = symbolic.shape_env
    conditions = []
    replaced = {}
    implied = []  # ranges of replaced symbols: implied by their replacement, still checked
    for sym in dict.fromkeys(symbolic.symbol[p] for p in symbolic.positions):  # each symbol once
        e = env.replace(sym)
        if e != sym:
            replaced[sym] = e
        vr = env.var_to_range.get(sym)
        lower = int(vr.lower) if vr is not None and _finite(vr.lower) else 2
        ranges = [sympy.Ge(sym, lower, evaluate=False)]
        if vr is not None and _finite(vr.upper):
            ranges.append(sympy.Le(sym, int(vr.upper), evaluate=False))
        (implied if e != sym else conditions).extend(ranges)
    conditions += [sympy.Eq(sym, e, evaluate=False) for sym, e in replaced.items()]
    seen = set(conditions)
    for g in env.guards:
        e = env.simplify(g.expr)
        if e == sympy.true or e in seen:
            continue
        seen.add(e)
        conditions.append(e)
    return conditions, implied


def _finite(bound) -> bool:
    return bound not in (sympy.oo, -sympy.oo, int_oo, -int_oo)
