"""Pay tracing's one-time costs at import, not in the user's first backward.

The first fake-tensor trace in a process spends ~0.8 s importing and initialising
torch's tracing machinery (FakeTensorMode, proxy mode, sympy).  Tracing one tiny
backward at import moves that cost out of the first ``backward()``.  Set
``GRADFX_NO_WARMUP=1`` to skip it.
"""

from __future__ import annotations

import os


def warm_up() -> None:
    if os.environ.get("GRADFX_NO_WARMUP"):
        return
    import logging

    import torch
    from .api import capture
    logger = logging.getLogger("gradfx")
    disabled, logger.disabled = logger.disabled, True
    try:
        with torch.random.fork_rng():
            lin = torch.nn.Linear(4, 4)
            norm = torch.nn.LayerNorm(4)
            x = torch.randn(2, 4)
            capture(norm(torch.nn.functional.gelu(lin(x))).relu().mean())
    finally:
        logger.disabled = disabled
