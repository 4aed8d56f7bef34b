"""Tracing's one-time set-up, done in the background from import on.

The first fake-tensor trace of a process spends about a second importing and
initialising torch's tracing machinery (dynamo, FakeTensorMode, proxy mode,
sympy).  ``import gradfx`` starts a thread that traces one tiny backward of its
own, so neither the import nor the first backward pays it: the first capture
waits for the thread only if it comes before the thread is done.

The thread touches nothing eager code sees: its tensors are its own and made
without the random generator, grad mode and dispatch modes are per thread, it
never probes for DDP's hooks (the probe switches torch's compiled autograd on for
the process), and its log lines are dropped.  Set ``GRADFX_NO_WARMUP=1`` to do without it.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

NAME = "gradfx-warm-up"
log = logging.getLogger("gradfx")
_thread: threading.Thread | None = None


def start() -> None:
    global _thread
    if os.environ.get("GRADFX_NO_WARMUP") or _thread is not None:
        return
    _thread = threading.Thread(target=_warm_up, name=NAME, daemon=True)
    _thread.start()
    atexit.register(wait)  # an interpreter that exits mid-trace could crash in torch's teardown


def wait() -> None:
    """Block until the warm-up trace is done (at once if it is, or never ran)."""
    thread = _thread
    if thread is not None and thread is not threading.current_thread() and thread.is_alive():
        thread.join()


def _warm_up() -> None:
    try:
        import torch
        import torch._dynamo  # noqa: F401  (routing keeps dynamo out of gradfx's frames)
        import torch.nn.functional as F

        from .api import capture
        from .graph import distributed
        w = torch.linspace(-1.0, 1.0, 16).view(4, 4).requires_grad_(True)
        b = torch.zeros(4, requires_grad=True)
        x = torch.arange(8.0).view(2, 4)
        with distributed.unprobed():
            capture(F.layer_norm(F.gelu(F.linear(x, w, b)), (4,)).relu().mean())
    except Exception:  # an optimization: the first capture does the set-up instead
        log.debug("gradfx: warm-up trace failed", exc_info=True)


class _NotWarmUp(logging.Filter):
    def filter(self, record) -> bool:
        return record.threadName != NAME


log.addFilter(_NotWarmUp())
