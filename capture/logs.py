"""The ``gradfx`` logger, also reachable through ``TORCH_LOGS="+gradfx"``.

gradfx logs with the standard ``logging`` module under the ``gradfx`` logger:
captures and recapture reasons at INFO, backend compiles at INFO when they take
over a second, details at DEBUG.  Registering the name with torch's logging
lets ``TORCH_LOGS="+gradfx"`` (DEBUG) or ``TORCH_LOGS="gradfx"`` (INFO) turn it
on the way it does for torch's own components.
"""

from __future__ import annotations

import os


def register_with_torch_logs() -> None:
    from torch._logging import _internal
    _internal.register_log("gradfx", "gradfx")
    if "gradfx" in os.environ.get("TORCH_LOGS", ""):
        _internal._init_logs()  # torch parsed TORCH_LOGS before "gradfx" existed
