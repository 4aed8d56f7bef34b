"""Capture: walk the live autograd graph and trace one backward into a torch.fx graph."""

from . import logs
from .graph import hooks
from .trace import functions
from .view.captured_graph import CapturedGraph
from .errors import FallbackWarning, Unsupported

hooks.install()
functions.install()
logs.register_with_torch_logs()

__all__ = ["CapturedGraph", "FallbackWarning", "Unsupported"]
