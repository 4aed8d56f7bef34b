"""Capture: walk the live autograd graph and trace one backward into a torch.fx graph."""

from . import custom_function, hook_registry, logs
from .captured_graph import CapturedGraph
from .errors import FallbackWarning, Unsupported

hook_registry.install()
custom_function.install()
logs.register_with_torch_logs()

__all__ = ["CapturedGraph", "FallbackWarning", "Unsupported"]
