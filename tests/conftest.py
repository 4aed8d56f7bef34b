import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


def pytest_sessionstart(session):
    """Every test sees gradfx as a user's second process does: its compiled part built and
    loaded (capture/native), not one that appears half-way through the session.  Where it
    cannot be built the tests run with Python serving; GRADFX_REQUIRE_NATIVE=1 (CI) makes
    that an error instead."""
    from gradfx.capture import native
    if native.wait() is None and os.environ.get("GRADFX_REQUIRE_NATIVE") == "1":
        raise RuntimeError(f"gradfx's compiled part is required here but not loaded: {native.reason()}")
