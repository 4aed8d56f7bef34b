"""Keeping a multi-output op's results together: its getitems right behind it."""

from __future__ import annotations

import operator

import torch.fx as fx


def is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is operator.getitem


def unpack_right_after(node: fx.Node) -> None:
    """Move the getitems of ``node``'s tuple result right behind it, in item order."""
    anchor = node
    for item in sorted((u for u in node.users if is_getitem(u)), key=lambda u: u.args[1]):
        anchor.append(item)
        anchor = item
