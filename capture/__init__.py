"""Capture: one backward call, from the live autograd graph to a compiled torch.fx graph.

Its packages, top to bottom (a package imports only those below it; docs/ARCHITECTURE.md
draws them and tests/test_layout.py keeps them so): ``api`` (the public entry points),
``run`` (the driver of a backward), ``pipeline`` (one capture), ``view`` (what a
captured graph shows), then, below the top-level ``backends`` and ``reorder``,
``trace`` (the tracer), ``runtime`` (what graphs call), ``graph`` (the readers of the
live autograd graph), ``native`` (the compiled part) and the shared modules here
(``errors``, ``logs``, ``torch_releases``, ``stacklevel``).  This module imports nothing:
importing any part of capture loads only what that part needs.
"""
