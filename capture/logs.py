"""The ``gradfx`` logger, also reachable through ``TORCH_LOGS="+gradfx"``.

gradfx logs with the standard ``logging`` module under the ``gradfx`` logger:
captures and recapture reasons at INFO, backend compiles at INFO when they take
over a second, details at DEBUG.  Registering the name with torch's logging
lets ``TORCH_LOGS="+gradfx"`` (DEBUG) or ``TORCH_LOGS="gradfx"`` (INFO) turn it
on the way it does for torch's own components.

When ``TORCH_LOGS`` names gradfx, torch itself imports gradfx while it parses the
variable (any importable module name is accepted there), in the middle of its
own set-up, and then gives every registered logger its handler.  Setting up
again from inside that import gave every torch and gradfx logger a second
handler, so every line printed twice; gradfx sets up only when torch did not
(``TORCH_LOGS`` changed after torch was imported).
"""

from __future__ import annotations

import logging
import os
import sys


def register_with_torch_logs() -> None:
    from torch._logging import _internal
    _internal.register_log("gradfx", "gradfx")
    if "gradfx" not in os.environ.get("TORCH_LOGS", ""):
        return
    if _inside(_internal._init_logs) or _has_torch_handler(_internal):
        return  # torch is setting up (it imported us) or has set up the gradfx logger
    _internal._init_logs()


def _inside(fn) -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is fn.__code__:
            return True
        frame = frame.f_back
    return False


def _has_torch_handler(internal) -> bool:
    return any(internal._is_torch_handler(h) for h in logging.getLogger("gradfx").handlers)
