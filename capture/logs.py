"""The ``gradfx`` logger, also reachable through ``TORCH_LOGS="+gradfx"``.

gradfx logs with the standard ``logging`` module under the ``gradfx`` logger:
captures, recapture reasons and every backend compile (:func:`backend_compiled`)
at INFO, details at DEBUG.  Registering the name with torch's logging
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

log = logging.getLogger("gradfx")


def backend_compiling(backend: str, nodes: int) -> None:
    """Log, at INFO, that a backend other than gradfx's eager one starts compiling a captured
    backward (a compiler may take seconds: the line says what it is busy with)."""
    log.info("gradfx: backend %s compiling a backward of %d fx nodes", backend, nodes)


def backend_compiled(backend: str, nodes: int, seconds: float, failed: str | None = None) -> None:
    """Log one compile of a captured backward by the block's backend, at INFO:
    which backend, how many fx nodes, how long (docs/API.md, Logging).  ``failed``:
    the backend failed and the eager backend stands in (the warning says why)."""
    if failed is None:
        log.info("gradfx: backend %s compiled a backward of %d fx nodes in %.2f s", backend, nodes, seconds)
    else:
        log.info("gradfx: backend %s failed to compile a backward of %d fx nodes (%.2f s); the eager "
                 "backend runs it", backend, nodes, seconds)


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
