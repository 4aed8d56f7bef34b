"""Recording one backward into a torch.fx graph, on fake tensors.  Imported by the
pipeline, the passes, the backends and the view; it imports the runtime functions it
records calls to and the readers of the live graph."""

from . import rules_builtin  # noqa: F401  (registers the builtin rules)
