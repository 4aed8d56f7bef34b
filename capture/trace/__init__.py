"""Recording one backward into a torch.fx graph, on fake tensors."""

from . import rules_builtin  # noqa: F401  (registers the builtin rules)
