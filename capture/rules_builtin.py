"""Backward rules for builtin autograd nodes (see gradfx.capture.rules)."""

from __future__ import annotations

import torch

from .rules import rule


@rule("SumBackward0")
def sum_backward0(saved, grad):
    return (grad.expand(saved.self_sym_sizes),)
