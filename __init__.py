"""gradfx: compiled autograd for PyTorch, in Python.

Wrap ``loss.backward()`` (or ``torch.autograd.grad``) in
``with gradfx.compiled_autograd(backend=...)``: gradfx walks the autograd graph,
traces every backward computation into a torch.fx graph on fake tensors, runs
reorder and dead-code passes, hands the graph to a backend compiler and caches the
result for as long as the autograd graph keeps its structure.

The names in ``__all__`` are the stable public API (see the README).
"""

if __name__ != "gradfx":
    # The repository root is this package; pytest imports the root under its folder
    # name.  A second copy would patch torch a second time with separate state, so
    # that name becomes the one real gradfx instead.
    import sys
    import gradfx as _gradfx
    sys.modules[__name__] = _gradfx
else:
    from .backends import list_backends, register_backend
    from .capture import logs
    from .capture.api import capture, compiled_autograd
    from .capture.errors import FallbackWarning, Unsupported
    from .capture.graph import functions, hooks
    from .capture.graph.functions import traceable
    from .capture.run.cache import set_cache_size
    from .capture.run.session import reset
    from .capture.runtime.counters import stats
    from .capture.view.captured_graph import CapturedGraph
    from .reorder import list_passes

    hooks.install()  # notes of hook registrations, before the user's first forward
    functions.install()
    logs.register_with_torch_logs()
    del functions, hooks, logs

    __all__ = [
        "CapturedGraph", "FallbackWarning", "Unsupported", "capture", "compiled_autograd",
        "list_backends", "list_passes", "register_backend", "reset", "set_cache_size", "stats", "traceable",
    ]
    __version__ = "0.1.0"
