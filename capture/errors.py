"""Exceptions and warnings that are part of gradfx's public API (stable)."""


class Unsupported(Exception):
    """Raised in strict mode for an autograd node or feature gradfx cannot capture.

    The message names the node (type and sequence number) or the feature.
    """


class FallbackWarning(UserWarning):
    """Warned (once per block and reason; once per process where the self-check failed)
    when a backward ran on the eager engine."""


class _Fallback(Exception):
    """Internal: this backward cannot be captured; `reason` says why."""

    def __init__(self, reason: str, process_wide: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.process_wide = process_wide  # true of every backward in the process: warned once
