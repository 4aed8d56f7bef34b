"""Where gradfx's warnings point: at the user's code, not at gradfx or torch."""

from __future__ import annotations

import os
import sys

import torch

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_INTERNAL = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep,) + tuple(
    os.path.join(_ROOT, d) + os.sep for d in ("capture", "backends", "reorder"))


def user_stacklevel() -> int:
    """``stacklevel`` for a warning raised by our caller: the first frame outside torch
    and gradfx (the user's backward call), however many wrappers lie between."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
