"""Which sizes of a backward are one size, or a product of others, by construction.

A symbolic trace finds every relation between sizes the formulas rely on by
proving it in sympy (``s7 == s0``, ``s12 == s0*s3``): a guard and a replacement
each, about a millisecond apiece, for hundreds of sizes of a real model.  Most of
those relations are visible before tracing, in what autograd recorded: a saved
activation has its node's metadata shape, an ``mm``'s inner dims agree, a view's
merged dim is the product of the dims it merged, a contiguous tensor's strides are
products of its sizes.  This module reads them off the walk, per node kind, so
that the trace starts with one symbol per size that is really free:

* positions that are one size share a symbol;
* a position tied to a static size (a parameter's) is static;
* a position that is the product of others is that product (no symbol of its own).

Every relation is applied only where the sizes satisfy it now (and, for a
recapture, in the previous backward too), and the guard checks each at run time:
a relation that does not hold for a later backward costs a recapture there, never
a result, and the recapture, seeing both backwards, no longer assumes it.
"""

from __future__ import annotations

import logging
import math

from ..graph.kinds import TRACED
from ..graph.walk import BackwardCall
from .rules import reshape_groups


log = logging.getLogger("gradfx")


class Product(tuple):
    """The key of a derived position: ``const * prod(symbol groups)`` (sorted roots)."""

    @property
    def const(self) -> int:
        return self[0]

    @property
    def factors(self) -> tuple:
        return self[1:]


class Const:
    """A constant factor of a product (the heads in ``B*H``)."""

    __slots__ = ("value",)

    def __init__(self, value: int):
        self.value = value


def _value(sizes, f) -> int:
    return f.value if type(f) is Const else sizes[f]


class _Relations:
    """A union-find over the positions of ``sizes``, with products."""

    def __init__(self, sizes, dynamic, previous=None):
        self.sizes = sizes
        self.previous = previous
        self.dynamic = dynamic
        self.parent: dict = {}
        self.products: list = []  # (position, factor positions) for dynamic positions
        self.pieces: list = []  # (whole, parts): a static whole has static parts
        self.pinned: set = set()  # positions found static
        self.moved: list = []  # (p, u, Const h, v, q): p == u*h and v == h*q where v is static

    def _holds(self, x, y) -> bool:
        s, p = self.sizes, self.previous
        return s[x] == s[y] and s[x] >= 2 and (p is None or p[x] == p[y])

    def find(self, p):
        parent = self.parent
        while parent.get(p, p) != p:
            parent[p] = parent.get(parent[p], parent[p])
            p = parent[p]
        return p

    def tie(self, a, b) -> None:
        """Tie positions ``a[k]`` and ``b[k]`` (None entries are skipped)."""
        for x, y in zip(a, b):
            if x is None or y is None or x == y or not self._holds(x, y):
                continue
            rx, ry = self.find(x), self.find(y)
            if rx != ry:
                self.parent[max(rx, ry)] = min(rx, ry)

    def derive(self, p, factors) -> None:
        """``p`` is the product of ``factors`` (positions), where the sizes agree."""
        if p is None or not factors or None in factors or p in factors:
            return
        for sizes in (self.sizes, self.previous):
            if sizes is not None and sizes[p] != math.prod(_value(sizes, f) for f in factors):
                return
        self.pieces.append((p, tuple(factors)))
        if p in self.dynamic:
            self.products.append((p, tuple(factors)))

    def piece_of(self, whole, parts) -> None:
        """``parts`` are pieces of ``whole`` (a split, a cat): static where it is."""
        if whole is not None and None not in parts:
            self.pieces.append((whole, tuple(parts)))

    def pin(self, p) -> None:
        """``p`` is static (it did not change since the previous backward)."""
        if p in self.dynamic and (self.previous is None or self.previous[p] == self.sizes[p]):
            self.pinned.add(p)

    def _merge_products(self) -> None:
        """One size that is two products (B*T viewed from two sides): after cancelling the
        factors both share, the rest are one size each where they match unambiguously
        (one factor left on each side, or factors of distinct sizes matched by size: a
        batch of 4 beside 4 heads is left alone)."""
        changed = True
        while changed:
            changed = False
            first: dict = {}
            for p, factors in self.products:
                other = first.setdefault(self.find(p), factors)
                if other is not factors:
                    changed |= self._match(other, factors)

    def _same(self, x, y) -> bool:
        if type(x) is Const or type(y) is Const:
            return type(x) is type(y) and x.value == y.value
        return self.find(x) == self.find(y)

    def _match(self, a, b) -> bool:
        """Tie (or pin, against a constant) the factors of two equal products; True if
        that changed anything."""
        a, b = list(a), list(b)
        for x in list(a):
            y = next((y for y in b if self._same(x, y)), None)
            if y is not None:
                a.remove(x)
                b.remove(y)
        if len(a) != len(b) or not a:
            return False
        s = self.sizes
        values = [_value(s, x) for x in a]
        if len(a) > 1:
            if len(set(values)) != len(a) or sorted(values) != sorted(_value(s, y) for y in b):
                return False
            b = [next(y for y in b if _value(s, y) == v) for v in values]
        changed = False
        for x, y in zip(a, b):
            if type(x) is Const and type(y) is Const:
                continue
            if type(x) is Const or type(y) is Const:
                if _value(s, x) == _value(s, y):
                    before = len(self.pinned)
                    self.pin(y if type(x) is Const else x)
                    changed |= len(self.pinned) != before
                continue
            if self.find(x) != self.find(y):
                self.tie([x], [y])
                changed |= self.find(x) == self.find(y)
        return changed

    def _static_pieces(self) -> set:
        """The static roots, once the parts of static wholes are static too (a model's
        width split into heads and head size, a fused projection split in three),
        found until nothing changes."""
        dynamic = self.dynamic
        static_roots = self._static_roots()
        while True:
            before = len(self.pinned)
            for whole, parts in self.pieces:
                if whole not in dynamic or self.find(whole) in static_roots:
                    for p in parts:
                        if type(p) is not Const and self.find(p) not in static_roots:
                            self.pin(p)
            if len(self.pinned) == before:
                return static_roots
            static_roots = self._static_roots()

    def _static_roots(self) -> set:
        dynamic = self.dynamic
        roots = {self.find(p) for p in self.parent if p not in dynamic}
        roots |= {self.find(p) for p in self.parent.values() if p not in dynamic}
        return roots | {self.find(p) for p in self.pinned}

    def groups(self, positions) -> dict:
        """position -> int (symbol group) or Product; static positions are left out."""
        dynamic = self.dynamic
        while True:
            self._merge_products()
            static_roots = self._static_pieces()
            # A factor moved between two dims is a constant where the dim it moved into
            # is static; that makes more products, so more may follow.
            ready = [m for m in self.moved if self.find(m[3]) in static_roots or m[3] not in dynamic]
            if not ready:
                break
            for m in ready:
                self.moved.remove(m)
                p, u, h, v, q = m
                self.derive(p, [u, h])
                self.derive(v, [h, q])
        derived = {}
        for p, factors in self.products:
            derived.setdefault(self.find(p), factors)
        memo: dict = {}

        def expr(root, visiting):
            """(const, symbol roots) for a group, or None for a symbol of its own."""
            if root in memo:
                return memo[root]
            if root in static_roots or root not in dynamic:
                return (self.sizes[root], ())
            factors = derived.get(root)
            if factors is None or root in visiting:
                return None
            visiting = visiting | {root}
            if any(type(f) is not Const and self.find(f) in visiting for f in factors):
                return None  # circular (positions tied since the product was seen): a symbol
            const, roots = 1, []
            for f in factors:
                if type(f) is Const:
                    const *= f.value
                    continue
                fr = self.find(f)
                sub = expr(fr, visiting)
                if sub is None:
                    roots.append(fr)
                else:
                    const *= sub[0]
                    roots.extend(sub[1])
            memo[root] = (const, tuple(sorted(roots)))
            return memo[root]

        out = {}
        for p in positions:
            root = self.find(p)
            e = expr(root, frozenset())
            if e is None:
                out[p] = root
            elif e[1]:
                out[p] = Product((e[0],) + e[1])
            # else: static (tied to a static size, or a product of static sizes)
        # A product's factors must be symbols; where a cycle left one derived, the
        # product's position gets a symbol instead.
        changed = True
        while changed:
            changed = False
            for p, key in out.items():
                if isinstance(key, Product) and any(out.get(f) != f for f in key.factors):
                    out[p] = self.find(p)
                    changed = True
        return out


class _Node:
    """The positions of one node's sizes, by what they are."""

    def __init__(self, call: BackwardCall, i: int, metas: dict):
        self.call, self.i, self.metas = call, i, metas
        self.record = call.records[i]
        self.node = call.nodes[i]
        self.saved_inputs = _saved_positions(call, i)  # saved tensor attribute -> input position

    def meta(self, nr=0):
        return self.metas.get((self.i, nr))

    def edge(self, k):
        edges = self.record.edges
        if k >= len(edges) or edges[k] is None:
            return None
        return self.metas.get(edges[k])

    def edges(self):
        return [self.metas.get(e) for e in self.record.edges if e is not None]

    def value(self, attr):
        """Positions of a saved flat size value (``_saved_self_sym_sizes``), or None."""
        slot = self.record.values.get(attr)
        if slot is None:
            return None
        start, layout = slot
        if layout is None:
            return [start]
        if not isinstance(layout, tuple) or any(e is not None for e in layout):
            return None
        return list(range(start, start + len(layout)))

    def saved(self, name):
        """(size positions, stride positions or None if contiguous) of a saved tensor."""
        pos = self.saved_inputs.get(name)
        if pos is None:
            return None
        start, ndim, stride_start = self.call.tensor_slots[pos]
        strides = list(range(stride_start, stride_start + ndim)) if stride_start >= 0 else None
        return list(range(start, start + ndim)), strides

    def saved_sizes(self, name):
        s = self.saved(name)
        return s[0] if s is not None else None

    def attr(self, name):
        """A saved non-size value (a dim), read from the live node."""
        try:
            return getattr(self.node, name)
        except Exception:
            return None

    def arg(self, rel: "_Relations", name, edge=None):
        """The sizes of argument ``name`` wherever recorded (saved tensor, ``*_sym_sizes``,
        the metadata of its edge), tied together; the first found."""
        found = [self.saved_sizes(f"_saved_{name}"), self.value(f"_saved_{name}_sym_sizes")]
        if edge is not None:
            found.append(self.edge(edge))
        found = [f for f in found if f is not None]
        for other in found[1:]:
            if len(other) == len(found[0]):
                rel.tie(found[0], other)
        return found[0] if found else None


def _saved_positions(call: BackwardCall, i: int) -> dict:
    """Saved tensor attribute -> input position, for a node that saved no tensor lists."""
    owned = call.owned[i] if call.owned is not None else None
    mask = getattr(owned, "mask", None)
    if mask is None:
        return {}
    from ..graph.kinds import type_info
    names = type_info(type(call.nodes[i])).saved_tensors
    if len(names) != len(mask):
        return {}
    out, k = {}, 0
    saved = call.records[i].saved
    for name, defined in zip(names, mask):
        if defined:
            if k >= len(saved):
                return {}
            out[name] = saved[k]
            k += 1
    return out


def _wrap(d: int, ndim: int) -> int:
    """A saved dim as an index: nodes hand negative dims back as unsigned 64-bit ints."""
    if d >= 2 ** 63:
        d -= 2 ** 64
    return d % ndim


def _right(out, inp):
    """Align ``inp`` to the right of ``out`` (broadcasting): pairs of lists."""
    n = min(len(out), len(inp))
    return out[len(out) - n:], inp[len(inp) - n:]


def _dense_strides(rel: _Relations, sizes, strides) -> None:
    """A dense tensor's strides are products of its sizes (inner dims first)."""
    if sizes is None or strides is None or len(sizes) != len(strides):
        return
    s = rel.sizes
    dims = [d for d in range(len(sizes)) if s[sizes[d]] != 1 and s[strides[d]] != 0]
    dims.sort(key=lambda d: s[strides[d]])
    for inner, outer in zip(dims, dims[1:]):
        rel.derive(strides[outer], [strides[inner], sizes[inner]])


# -- per node kind ----------------------------------------------------------------

def _shape_keeping(rel, n):
    own, src = n.meta(), n.edge(0)
    if own is not None and src is not None and len(own) == len(src):
        rel.tie(own, src)


def _broadcasting(rel, n):
    """Ops whose output is the broadcast of their tensor inputs (edges and saved)."""
    own = n.meta()
    if own is None:
        return
    inputs = n.edges() + [n.saved_sizes(a) for a in n.saved_inputs]
    for inp in inputs:
        if inp is not None:
            rel.tie(*_right(own, inp))


def _expand(rel, n):
    own, src = n.meta(), n.value("_saved_self_sym_sizes")
    if own is not None and src is not None:
        rel.tie(*_right(own, src))


def _view(rel, n):
    own, src = n.meta(), n.value("_saved_self_sym_sizes")
    if own is None or src is None:
        return
    s = rel.sizes
    for a, b in reshape_groups([s[p] for p in own], [s[p] for p in src]):
        if len(a) == 1 and len(b) == 1:
            rel.tie([own[a[0]]], [src[b[0]]])
        elif len(a) == 1:
            rel.derive(own[a[0]], [src[d] for d in b])
        elif len(b) == 1:
            rel.derive(src[b[0]], [own[d] for d in a])
        elif len(a) == 2 and len(b) == 2:
            _moved_factor(rel, [own[d] for d in a], [src[d] for d in b])



def _moved_factor(rel, a, b):
    """(x*h, y) <-> (x, h*y): a factor moved between two dims (attention's
    (B, E) <-> (B*H, E/H)).  Where h*y is static (a model's width), so is h; where it
    is not, h may be a size that changes ((n*m, 6) <-> (n, m*6)): nothing is assumed."""
    s = rel.sizes
    for (p, q), (u, v) in ((a, b), (b, a)):
        if s[u] and s[q] and s[p] % s[u] == 0 and s[v] % s[q] == 0 and s[p] // s[u] == s[v] // s[q] > 1:
            rel.moved.append((p, u, Const(s[p] // s[u]), v, q))
            return


def _mm(rel, n, first="self"):
    a, b, out = n.arg(rel, first, 1 if first == "mat1" else 0), n.arg(rel, "mat2", 2 if first == "mat1" else 1), n.meta()
    if a is None or b is None or len(a) != 2 or len(b) != 2:
        return
    rel.tie([a[1]], [b[0]])
    if out is not None and len(out) == 2:
        rel.tie(out, [a[0], b[1]])
    if first == "mat1":
        bias = n.edge(0)
        if bias is not None and out is not None:
            rel.tie(*_right(out, bias))


def _bmm(rel, n):
    a, b, out = n.arg(rel, "self", 0), n.arg(rel, "mat2", 1), n.meta()
    if a is None or b is None or len(a) != 3 or len(b) != 3:
        return
    rel.tie([a[0], a[2]], [b[0], b[1]])
    if out is not None and len(out) == 3:
        rel.tie(out, [a[0], a[1], b[2]])


def _transpose(rel, n):
    own, src = n.meta(), n.edge(0)
    if own is None or src is None or len(own) != len(src):
        return
    order = list(range(len(src)))
    kind = type(n.node).__name__
    if kind == "TBackward0":
        order.reverse()
    elif kind == "TransposeBackward0":
        d0, d1 = n.attr("_saved_dim0"), n.attr("_saved_dim1")
        if not isinstance(d0, int) or not isinstance(d1, int) or not src:
            return
        d0, d1 = _wrap(d0, len(src)), _wrap(d1, len(src))
        order[d0], order[d1] = order[d1], order[d0]
    else:  # PermuteBackward0
        dims = n.attr("_saved_dims")
        if not isinstance(dims, tuple) or sorted(_wrap(d, len(src)) for d in dims) != order:
            return
        order = [_wrap(d, len(src)) for d in dims]
    rel.tie(own, [src[d] for d in order])


def _all_but_dim(rel, n, own, src):
    dim = n.attr("_saved_dim")
    if own is None or src is None or len(own) != len(src) or not isinstance(dim, int) or not src:
        return
    dim = _wrap(dim, len(src))
    rel.tie([p for d, p in enumerate(own) if d != dim], [p for d, p in enumerate(src) if d != dim])
    return dim


def _slice(rel, n):
    _all_but_dim(rel, n, n.meta(), n.value("_saved_self_sym_sizes"))


def _split(rel, n):
    """Pieces of ``split_size`` (or ``split_sizes``) along ``dim``; the pieces of a static
    size (a fused projection split in three) are static."""
    src = n.value("_saved_self_sym_sizes")
    size = n.value("_saved_split_size") or n.value("_saved_split_sizes")
    metas = [n.meta(nr) for nr in range(len(n.node._input_metadata))]
    for nr, own in enumerate(metas):
        dim = _all_but_dim(rel, n, own, src)
        if dim is None:
            continue
        rel.piece_of(src[dim], [own[dim]] + (size or []))
        if size is not None:
            k = 0 if len(size) == 1 else nr
            if k < len(size) and (len(size) > 1 or nr < len(metas) - 1):
                rel.tie([own[dim]], [size[k]])


def _cat(rel, n):
    """Equal sizes off ``dim``; along it, the pieces of a static size are static, and
    pieces of size 0 beside one other (an empty cache) leave that one's size."""
    own = n.meta()
    dims = [_all_but_dim(rel, n, own, src) for src in n.edges()]
    if own is None or not dims or None in dims:
        return
    dim, pieces = dims[0], [src[dims[0]] for src in n.edges()]
    rel.piece_of(own[dim], pieces)
    sized = [p for p in pieces if rel.sizes[p] != 0]
    if len(sized) == 1 and all(p not in rel.dynamic for p in pieces if p != sized[0]):
        rel.tie([own[dim]], sized)


def _select(rel, n):
    own, src, dim = n.meta(), n.value("_saved_self_sym_sizes"), n.attr("_saved_dim")
    if own is None or src is None or not isinstance(dim, int) or len(src) != len(own) + 1:
        return
    dim = _wrap(dim, len(src))
    rel.tie(own, src[:dim] + src[dim + 1:])


def _unsqueeze(rel, n):
    own, src, dim = n.meta(), n.edge(0), n.attr("_saved_dim")
    if own is None or src is None or not isinstance(dim, int) or len(own) != len(src) + 1:
        return
    dim = _wrap(dim, len(own))
    rel.tie(own[:dim] + own[dim + 1:], src)


def _squeeze(rel, n):
    own, src = n.meta(), n.value("_saved_self_sym_sizes")
    if own is None or src is None:
        return
    dims = n.attr("_saved_dim") if type(n.node).__name__ != "SqueezeBackward0" else tuple(range(len(src)))
    dims = (dims,) if isinstance(dims, int) else dims
    if not isinstance(dims, tuple) or not src:
        return
    removed = {d for d in (_wrap(d, len(src)) for d in dims) if rel.sizes[src[d]] == 1}
    kept = [p for d, p in enumerate(src) if d not in removed]
    if len(kept) == len(own):
        rel.tie(own, kept)


def _attention(rel, n):
    """Fused attention: query (B, H, L, E), key (B, H, S, E), value (B, H, S, Ev),
    output (B, H, L, Ev), logsumexp (B, H, L), a mask broadcast to (B, H, L, S)."""
    q, k, v = n.arg(rel, "query", 0), n.arg(rel, "key", 1), n.arg(rel, "value", 2)
    out = n.saved_sizes("_saved_output")
    own = n.meta()
    if out is not None and own is not None and len(own) == len(out):
        rel.tie(own, out)
    out = out or own
    if any(x is None or len(x) != 4 for x in (q, k, v, out)):
        return
    rel.tie([k[0], v[0], out[0], out[1], v[1], v[2], k[3], out[2], out[3]],
            [q[0], q[0], q[0], q[1], k[1], k[2], q[3], q[2], v[3]])
    lse = n.saved_sizes("_saved_logsumexp")
    if lse is not None and len(lse) == 3:
        rel.tie(lse, out[:3])
    mask = n.saved_sizes("_saved_attn_mask")
    if mask is not None:
        rel.tie(*_right([q[0], q[1], q[2], k[2]], mask))


def _reduce(rel, n):
    own, src = n.meta(), n.value("_saved_self_sym_sizes")
    numel = n.value("_saved_self_sym_numel")
    if src is not None and numel is not None:
        rel.derive(numel[0], src)
    dims, keep = n.attr("_saved_dim"), n.attr("_saved_keepdim")
    if own is None or src is None or not isinstance(dims, tuple) or not src:
        return
    reduced = {_wrap(d, len(src)) for d in dims}
    kept = [p for d, p in enumerate(src) if d not in reduced]
    if keep:
        if len(own) == len(src):
            rel.tie([p for d, p in enumerate(own) if d not in reduced], kept)
    elif len(own) == len(kept):
        rel.tie(own, kept)


def _layer_norm(rel, n):
    _shape_keeping(rel, n)
    x = n.saved_sizes("_saved_input")
    shape = n.attr("_saved_normalized_shape")
    if x is None or not isinstance(shape, tuple):
        return
    axis = len(x) - len(shape)
    for stat in ("_saved_result1", "_saved_result2"):
        s = n.saved_sizes(stat)
        if s is not None and len(s) == len(x):
            rel.tie(s[:axis], x[:axis])


def _embedding(rel, n):
    own, idx = n.meta(), n.saved_sizes("_saved_indices")
    if own is not None and idx is not None and len(own) == len(idx) + 1:
        rel.tie(own[:-1], idx)
    rows, weight = n.value("_saved_weight_sym_argsize_0"), n.edge(0)
    if rows is not None and weight:
        rel.tie(rows, weight[:1])


def _nll_loss(rel, n):
    x, target = n.saved_sizes("_saved_self"), n.saved_sizes("_saved_target")
    if x is not None and target is not None and len(x) >= 1 and len(target) >= 1:
        rel.tie(x[:1], target[:1])
        if len(x) == len(target) + 1:  # (N, C, d1, ...) and (N, d1, ...)
            rel.tie(x[2:], target[1:])


def _group_norm(rel, n):
    """group_norm: the saved N and C are the input's dims 0 and 1, HxW the product of the
    rest; mean and rstd are (N, group)."""
    _shape_keeping(rel, n)
    x = n.saved_sizes("_saved_input")
    if x is None or len(x) < 2:
        return
    rel.tie(n.value("_saved_N") or [None], x[:1])
    rel.tie(n.value("_saved_C") or [None], x[1:2])
    hxw = n.value("_saved_HxW")
    if hxw is not None:
        if len(x) == 3:
            rel.tie(hxw, x[2:])
        else:
            rel.derive(hxw[0], x[2:])
    for stat in ("_saved_result1", "_saved_result2"):
        s = n.saved_sizes(stat)
        if s is not None and len(s) == 2:
            rel.tie(s[:1], x[:1])


def _index_select(rel, n):
    """index_select: the output is self's sizes but along dim, where it has the index's."""
    _all_but_dim(rel, n, n.meta(), n.value("_saved_self_sym_sizes"))


def _value_selecting(rel, n):
    """max / min / kthvalue / mode / median along dim, topk, sort: the values and their
    indices share a shape, self's sizes but along dim (gone without keepdim)."""
    own, src, dim = n.meta(), n.value("_saved_self_sym_sizes"), n.attr("_saved_dim")
    idx = n.saved_sizes("_saved_indices")
    if own is not None and idx is not None and len(own) == len(idx):
        rel.tie(own, idx)
    if own is None or src is None or not isinstance(dim, int) or not src:
        return
    if len(own) == len(src):
        _all_but_dim(rel, n, own, src)
    elif len(own) + 1 == len(src):
        dim = _wrap(dim, len(src))
        rel.tie(own, src[:dim] + src[dim + 1:])


def _repeat(rel, n):
    """repeat: each output dim is its repeat times self's dim (the leading new dims are repeats)."""
    own, src, repeats = n.meta(), n.value("_saved_self_sym_sizes"), n.attr("_saved_repeats")
    if own is None or src is None or not isinstance(repeats, tuple) or len(own) != len(repeats):
        return
    lead = len(own) - len(src)
    for d, p in enumerate(src):
        r = repeats[d + lead]
        if r == 1:
            rel.tie([own[d + lead]], [p])
        elif r > 1:
            rel.derive(own[d + lead], [Const(r), p])


def _upsample(rel, n):
    """upsample_*: batch and channels pass through; the spatial sizes are output_size."""
    own, src = n.meta(), n.value("_saved_self_sym_sizes")
    if own is not None and src is not None and len(own) == len(src) >= 2:
        rel.tie(own[:2], src[:2])


def _upsample_output(rel, n):
    """upsample_*: and the output's spatial sizes are the saved output_size."""
    _upsample(rel, n)
    own, out = n.meta(), n.value("_saved_output_size")
    if own is not None and out is not None and len(own) == len(out) + 2:
        rel.tie(own[2:], out)


def _kernel_volume(n):
    ks = n.attr("_saved_kernel_size")
    return math.prod(ks) if isinstance(ks, tuple) and ks else None


def _im2col(rel, n):
    """unfold (im2col): input (N, C, H, W), output (N, C * kh * kw, L); the saved H and W are
    the input's."""
    own, src = n.meta(), n.edge(0)
    if src is None or len(src) < 2:
        return
    rel.tie(n.value("_saved_self_sym_argsize_minus_2") or [None], src[-2:-1])
    rel.tie(n.value("_saved_self_sym_argsize_minus_1") or [None], src[-1:])
    k = _kernel_volume(n)
    if own is not None and len(own) == len(src) - 1 and k is not None:
        if len(src) == 4:
            rel.tie(own[:1], src[:1])
        rel.derive(own[-2], [Const(k), src[-3]])


def _col2im(rel, n):
    """fold (col2im): input (N, C * kh * kw, L), output (N, C, H, W)."""
    own, src = n.meta(), n.edge(0)
    k = _kernel_volume(n)
    if own is None or src is None or len(own) != len(src) + 1 or len(own) < 3 or k is None:
        return
    if len(own) == 4:
        rel.tie(own[:1], src[:1])
    rel.derive(src[-2], [Const(k), own[-3]])


def _constant_pad(rel, n):
    """constant_pad_nd: the dims without padding keep their sizes (pads pair up from the last dim)."""
    own, src, pad = n.meta(), n.edge(0), n.attr("_saved_pad")
    if own is None or src is None or len(own) != len(src) or not isinstance(pad, tuple) or len(pad) % 2:
        return
    padded = {len(own) - 1 - k // 2 for k, p in enumerate(pad) if p != 0}
    keep = [d for d in range(len(own)) if d not in padded]
    rel.tie([own[d] for d in keep], [src[d] for d in keep])


def _masked_scatter(rel, n):
    """masked_scatter: the output has self's shape; the saved source sizes are the source's."""
    _shape_keeping(rel, n)
    n.arg(rel, "source", 1)


def _diagonal(rel, n):
    """diagonal: self's sizes but dim1 and dim2, then the diagonal's length."""
    own, src = n.meta(), n.value("_saved_self_sym_sizes")
    d1, d2 = n.attr("_saved_dim1"), n.attr("_saved_dim2")
    if own is None or src is None or not isinstance(d1, int) or not isinstance(d2, int) or len(src) < 2:
        return
    gone = {_wrap(d1, len(src)), _wrap(d2, len(src))}
    kept = [p for d, p in enumerate(src) if d not in gone]
    if len(own) == len(kept) + 1:
        rel.tie(own[:-1], kept)


def _fft_last(rel, n):
    """The r2c / c2r transforms: every dim but the last transformed one keeps its size."""
    own, src, dims = n.meta(), n.edge(0), n.attr("_saved_dim")
    if own is None or src is None or len(own) != len(src) or not isinstance(dims, tuple) or not dims:
        return
    last = _wrap(dims[-1], len(own))
    rel.tie([p for d, p in enumerate(own) if d != last], [p for d, p in enumerate(src) if d != last])


SHAPE_KEEPING = frozenset({
    "AbsBackward0", "AliasBackward0", "AddBackward1", "CloneBackward0", "CosBackward0", "DivBackward1", "EluBackward0",
    "ExpBackward0", "GeluBackward0", "HardswishBackward0", "LeakyReluBackward0", "LogBackward0",
    "LogSigmoidBackward0", "LogSoftmaxBackward0", "MulBackward1", "NativeDropoutBackward0",
    "NegBackward0", "PowBackward0", "ReluBackward0", "RsqrtBackward0",
    "SigmoidBackward0", "SiluBackward0", "SinBackward0", "SoftmaxBackward0", "SqrtBackward0",
    "SubBackward1", "TanhBackward0", "ThresholdBackward0", "ToCopyBackward0",
    "FftC2CBackward0", "SelectScatterBackward0", "SliceScatterBackward0", "DiagonalScatterBackward0",
    "PutBackward0",
})
BROADCASTING = frozenset({
    "AddBackward0", "SubBackward0", "MulBackward0", "DivBackward0", "MaximumBackward0", "MinimumBackward0",
    "PowBackward1", "Atan2Backward0", "WhereBackward0", "MaskedFillBackward0", "AddcmulBackward0",
    "AddcdivBackward0", "LerpBackward0", "LerpBackward1",
})

# node kind -> its relations (kinds not listed have only the generic ones)
RELATIONS = {
    **{k: _shape_keeping for k in SHAPE_KEEPING},
    **{k: _broadcasting for k in BROADCASTING},
    "NativeLayerNormBackward0": _layer_norm, "NativeGroupNormBackward0": _group_norm,
    "IndexSelectBackward0": _index_select, "RepeatBackward0": _repeat,
    **{k: _upsample_output for k in ("UpsampleNearest1DBackward0", "UpsampleNearestExact1DBackward0",
                                     "UpsampleNearest2DBackward0", "UpsampleNearestExact2DBackward0",
                                     "UpsampleNearest3DBackward0", "UpsampleNearestExact3DBackward0",
                                     "UpsampleLinear1DBackward0", "UpsampleBilinear2DBackward0",
                                     "UpsampleBicubic2DBackward0", "UpsampleTrilinear3DBackward0",
                                     "UpsampleBilinear2DAaBackward0", "UpsampleBicubic2DAaBackward0")},
    "Im2ColBackward0": _im2col, "Col2ImBackward0": _col2im, "ConstantPadNdBackward0": _constant_pad,
    "MaskedScatterBackward0": _masked_scatter, "DiagonalBackward0": _diagonal,
    "FftR2CBackward0": _fft_last, "FftC2RBackward0": _fft_last,
    **{k: _value_selecting for k in ("MaxBackward0", "MinBackward0", "KthvalueBackward0", "ModeBackward0",
                                     "MedianBackward1", "NanmedianBackward1", "TopkBackward0", "SortBackward0",
                                     "SortBackward1")},
    "ExpandBackward0": _expand,
    "ViewBackward0": _view, "UnsafeViewBackward0": _view, "ReshapeAliasBackward0": _view,
    "MmBackward0": _mm, "AddmmBackward0": lambda rel, n: _mm(rel, n, "mat1"), "BmmBackward0": _bmm,
    "TBackward0": _transpose, "TransposeBackward0": _transpose, "PermuteBackward0": _transpose,
    "SliceBackward0": _slice, "SplitBackward0": _split, "SplitWithSizesBackward0": _split,
    "CatBackward0": _cat, "SelectBackward0": _select, "UnsqueezeBackward0": _unsqueeze,
    "SumBackward1": _reduce, "MeanBackward1": _reduce,
    "EmbeddingBackward0": _embedding, "NllLossBackward0": _nll_loss,
    "SqueezeBackward0": _squeeze, "SqueezeBackward1": _squeeze, "SqueezeBackward2": _squeeze,
    **{k: _attention for k in ("ScaledDotProductFlashAttentionForCpuBackward0",
                               "ScaledDotProductEfficientAttentionBackward0",
                               "ScaledDotProductFlashAttentionBackward0",
                               "ScaledDotProductCudnnAttentionBackward0")},
}


def relate(call: BackwardCall, positions, previous=None) -> dict:
    """position -> symbol group (an int) or :class:`Product`, for the dynamic
    ``positions`` that stay dynamic (those tied to a static size are left out).

    The generic relations, for every node: one tensor met twice; a tensor and the
    metadata its autograd node keeps for it (a saved activation is output
    ``t.output_nr`` of ``t.grad_fn``; a root gradient has its root's shape); a saved
    tensor and the ``*_sym_sizes`` / ``*_sym_strides`` saved beside it; strides of a
    dense tensor as products of its sizes; ``self_sym_sizes`` of a one-input node and
    the metadata of that input.  Then each kind's own (``RELATIONS``).  With
    ``previous`` (the sizes of an earlier backward of the structure), sizes that
    changed alike share a symbol as well.
    """
    sizes = call.sizes
    dynamic = set(positions)
    rel = _Relations(sizes, dynamic, previous)
    metas = {}  # (node index, input_nr) -> positions
    for (i, nr), start in call.meta_slots():
        metas[(i, nr)] = list(range(start, start + len(call.nodes[i]._input_metadata[nr].shape)))
    index = {id(node): i for i, node in enumerate(call.nodes)}
    first = {}  # id(tensor) -> sizes where first met
    for pos, (start, ndim, stride_start) in call.tensor_slots.items():
        t = call.inputs[pos]
        own = list(range(start, start + ndim))
        if stride_start >= 0:
            strides = list(range(stride_start, stride_start + ndim))
            _dense_strides(rel, own, strides)
        else:
            strides = None
        seen = first.setdefault(id(t), (own, strides))
        rel.tie(seen[0], own)
        if seen[1] is not None and strides is not None:
            rel.tie(seen[1], strides)
        if pos < len(call.roots):
            meta = metas.get(call.roots[pos])
        else:
            fn = t.grad_fn
            i = index.get(id(fn)) if fn is not None else None
            meta = metas.get((i, t.output_nr)) if i is not None else None
        if meta is not None and len(meta) == ndim:
            rel.tie(meta, own)
    for i, rec in enumerate(call.records):
        if call.kinds[i] is not TRACED or not rec.runs:
            continue
        n = _Node(call, i, metas)
        for attr in rec.values:  # X_sym_sizes beside a saved X; X_sym_strides of X_sym_sizes
            if attr.endswith("_sym_sizes"):
                name = attr[:-len("_sym_sizes")]
                values, strides, tensor = n.value(attr), n.value(name + "_sym_strides"), n.saved(name)
                _dense_strides(rel, values, strides)
                if values is not None and tensor is not None and len(values) == len(tensor[0]):
                    rel.tie(values, tensor[0])
                    if strides is not None and tensor[1] is not None:
                        rel.tie(strides, tensor[1])
        self_sizes = n.value("_saved_self_sym_sizes")
        if self_sizes is not None and len(rec.edges) == 1:
            src = n.edge(0)
            if src is not None and len(src) == len(self_sizes):
                rel.tie(src, self_sizes)
        relation = RELATIONS.get(type(n.node).__name__)
        if relation is not None:
            try:
                relation(rel, n)
            except Exception:  # an optimization: a node it cannot read keeps its own symbols
                log.debug("gradfx: no size relations for %s", type(n.node).__name__, exc_info=True)
    if previous is not None:
        # Sizes that changed alike between the two backwards share a symbol (until a
        # third tells them apart); unchanged sizes that are equal are a coincidence, and
        # so may be products (a stride H*L beside B*L where B == H): they follow their factors.
        derived = {rel.find(p) for p, _ in rel.products}
        by_pair: dict = {}
        for p in dynamic:
            if sizes[p] != previous[p] and rel.find(p) not in derived:
                q = by_pair.setdefault((sizes[p], previous[p]), p)
                rel.tie([q], [p])
    return rel.groups(positions)
