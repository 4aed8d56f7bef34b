"""Words for why a cached graph was not reused (logged on the ``gradfx`` logger)."""

from __future__ import annotations

import linecache
import logging
import re

from ..graph.walk import BackwardCall, _NodeMark

log = logging.getLogger("gradfx")

_last_key: list = [None]


def describe_position(call: BackwardCall, pos: int) -> str:
    """Which tensor or saved value a position of ``call.sizes`` belongs to."""
    for input_pos, (start, ndim, stride_start) in call.tensor_slots.items():
        if start <= pos < start + ndim:
            return f"{_input_name(call, input_pos)} dim {pos - start}"
        if stride_start >= 0 and stride_start <= pos < stride_start + ndim:
            return f"{_input_name(call, input_pos)} stride {pos - stride_start}"
    for (i, nr), start in call.meta_slots():
        ndim = len(call.nodes[i]._input_metadata[nr].shape)
        if start <= pos < start + ndim:
            return f"gradient {nr} of {call.node_label(i)} dim {pos - start}"
    best = None  # the saved value starting last at or before `pos`
    for (i, attr), (start, _) in call.value_slots():
        if start <= pos and (best is None or start > best[2]):
            best = (i, attr, start)
    if best is not None:
        i, attr, start = best
        return f"{call.node_label(i)} saved {attr[len('_saved_'):]} (item {pos - start})"
    return f"size {pos}"


def _input_name(call, input_pos):
    kind = call.input_kinds[input_pos]
    owner = call.input_owner[input_pos]
    if owner < 0:
        return f"root gradient {input_pos}"
    return f"{kind} tensor of {call.node_label(owner)}"


def size_change(call: BackwardCall, old_sizes, limit: int = 4) -> str:
    changed = [p for p, (a, b) in enumerate(zip(old_sizes, call.sizes)) if a != b]
    parts = [f"{describe_position(call, p)} changed {old_sizes[p]} -> {call.sizes[p]}"
             for p in changed[:limit]]
    more = f" (and {len(changed) - limit} more sizes)" if len(changed) > limit else ""
    return "; ".join(parts) + more if parts else "sizes as before"


def log_structure_miss(call: BackwardCall) -> None:
    """Log how this graph's structure differs from the last one captured, e.g.
    ``new structure: node 1 (PowBackward0 #7): ((<class 'float'>, ...), '2.0') -> '3.0'``."""
    previous, _last_key[0] = _last_key[0], call.key
    if previous is None or not log.isEnabledFor(logging.INFO):
        return
    previous, key = previous.items, call.key.items
    node = None
    for k, (a, b) in enumerate(zip(previous, key)):
        if isinstance(b, _NodeMark):
            node = int(b)
        if a != b:
            where = f"node {node} ({call.node_label(node)})" if node is not None else "the roots"
            log.info("gradfx: new structure: at %s, %r -> %r", where, a, b)
            return
    if len(previous) != len(key):
        log.info("gradfx: new structure: %d -> %d key items", len(previous), len(key))


def annotate_error(err: BaseException, graph_module) -> None:
    """Add the autograd node of the failing graph op to ``err`` (its type is kept)."""
    tb = err.__traceback__
    line = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.startswith("<eval_with_key>"):
            line = linecache.getline(code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    if not line or " = " not in line:
        return
    name = line.strip().split(" = ")[0].split(":")[0].strip()
    for node in graph_module.graph.nodes:
        if node.name == name:
            label = node.meta.get("gradfx_node")
            if label:
                err.add_note(f"gradfx: raised while running the backward of {label} (graph node {name})")
            return


COMPACT_AFTER = 12  # guard lines; more are grouped

_EQUAL = re.compile(r"^sizes\[(\d+)\] == (.+)$")
_WHERE = re.compile(r"^where (s\d+) is sizes\[(\d+)\]: (.*?)(?: (dim|stride) (\d+)| \(item (\d+)\))$")


def compact_guards(lines: list[str], limit: int | None = None) -> list[str]:
    """Guard lines as they are, or grouped when there are more than ``limit``.

    Grouped: positions equal to the same expression share a line
    (``sizes[2..5, 17] == s0``), and symbols read from one tensor or saved value
    share their explanation (``where s3, s4 are sizes[9, 10]: saved tensor of
    AddmmBackward0 #11 dims 0, 1``).  Other lines (each symbol's range first)
    stay as they are, in order.
    """
    if len(lines) <= (COMPACT_AFTER if limit is None else limit):
        return list(lines)
    groups: dict = {}  # group key -> [first line index, members]
    plain = []
    for k, line in enumerate(lines):
        if m := _EQUAL.match(line):
            key, member = ("equal", m.group(2)), int(m.group(1))
        elif m := _WHERE.match(line):
            word = "item" if m.group(6) is not None else m.group(4)
            index = m.group(6) if m.group(6) is not None else m.group(5)
            key, member = ("where", m.group(3), word), (m.group(1), int(m.group(2)), index)
        else:
            plain.append((k, line))
            continue
        groups.setdefault(key, [k, []])[1].append(member)
    out = plain + [(first, _group_line(key, members)) for key, (first, members) in groups.items()]
    return [line for _, line in sorted(out, key=lambda t: t[0])]


def _group_line(key, members) -> str:
    if key[0] == "equal":
        return f"sizes[{_positions(members)}] == {key[1]}"
    _, subject, word = key
    symbols = ", ".join(s for s, _, _ in members)
    where = _positions([p for _, p, _ in members])
    indices = ", ".join(i for _, _, i in members)
    if len(members) == 1:
        tail = f"({word} {indices})" if word == "item" else f"{word} {indices}"
        return f"where {symbols} is sizes[{where}]: {subject} {tail}"
    tail = f"(items {indices})" if word == "item" else f"{word}s {indices}"
    return f"where {symbols} are sizes[{where}]: {subject} {tail}"


def _positions(ps) -> str:
    """``[2, 3, 4, 5, 9]`` -> ``2..5, 9`` (runs of three or more)."""
    ps = sorted(ps)
    parts, k = [], 0
    while k < len(ps):
        j = k
        while j + 1 < len(ps) and ps[j + 1] == ps[j] + 1:
            j += 1
        if j - k >= 2:
            parts.append(f"{ps[k]}..{ps[j]}")
        else:
            parts.extend(str(p) for p in ps[k:j + 1])
        k = j + 1
    return ", ".join(parts)
