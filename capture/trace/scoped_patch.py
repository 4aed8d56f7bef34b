"""A torch function replaced while at least one trace needs the replacement.

Traces on several threads share one replacement: the first trace in installs it, the
last one out puts torch's function back.  (Each trace saving and restoring on its own
would, when two overlap, leave one trace's replacement installed for good.)
"""

from __future__ import annotations

import contextlib
import threading


class ScopedPatch:
    """``owner.name`` replaced by ``make(original)`` inside :meth:`active` blocks."""

    def __init__(self, owner, name: str, make):
        self.owner, self.name, self.make = owner, name, make
        self._lock = threading.Lock()
        self._users = 0
        self._original = None

    @contextlib.contextmanager
    def active(self):
        with self._lock:
            if self._users == 0:
                self._original = getattr(self.owner, self.name)
                setattr(self.owner, self.name, self.make(self._original))
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    setattr(self.owner, self.name, self._original)
                    self._original = None
