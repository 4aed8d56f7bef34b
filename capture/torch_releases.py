"""The torch releases gradfx supports, and every internal that differs between them.

gradfx reads torch internals (node objects, hook dicts, saved variables).  Where
those differ between supported releases, the difference is named here, once, with
the release it belongs to; the rest of gradfx asks this module instead of comparing
version numbers.  ``run/self_check.py`` probes the internals at the first capture of a
process and falls back to the eager engine where one of them behaves otherwise.
"""

from __future__ import annotations

import torch

# Releases the test suite runs on (major, minor); others fall back to the eager engine.
TESTED = ((2, 11), (2, 12), (2, 13), (2, 14))


def _parse(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


RELEASE = _parse(torch.__version__)
TESTED_RELEASE = RELEASE in TESTED

# 2.13: a C++ node keeps its Python object for as long as the node lives, so the
# object's id names the node.  2.11 and 2.12: the object is dropped with its last
# Python reference and every later access (``grad_fn``, ``next_functions``) makes a
# new one, so ids of node objects do not outlive a walk that holds them.  The node's
# ``metadata`` dict, by contrast, is owned by the C++ node on every release.
NODE_OBJECT_PERSISTS = RELEASE >= (2, 13)


def node_token(node) -> int:
    """A number that names ``node`` for as long as it lives (ids may be reused after).

    Callers check a witness (type, sequence number) beside it, as for any id.
    """
    if NODE_OBJECT_PERSISTS:
        return id(node)
    return id(node.metadata)  # created on first read; lives with the C++ node


# Eager's error words that gradfx repeats where it raises eager's errors itself.
# 2.13: "The differentiated Tensor at index 1 appears to not have been used ...";
# 2.11 and 2.12: "One of the differentiated Tensors appears to not have been used ...".
UNUSED_INPUT_ERROR_NAMES_INDEX = RELEASE >= (2, 13)
# 2.13: a saved output modified in place is "output 0 of Exp" (the forward op);
# 2.11 and 2.12: "output 0 of ExpBackward0" (the node).
MODIFIED_OUTPUT_NAMES_FORWARD_OP = RELEASE >= (2, 13)

# Where gloo's ring all-reduce starts each chunk's sum (``runtime/gloo_ring.py``) is
# gloo's, bundled with torch: checked against gloo on every tested release.  On
# another, the Python reducer keeps one all-reduce per parameter over more than two
# ranks rather than trust a layout that would not be bitwise.
GLOO_RING_ORDER_KNOWN = TESTED_RELEASE

# 2.11's CUDA build on a machine without a GPU: the first FakeTensorMode entered inside
# a capture, once another thread has started (the self-check's does), crashes the
# process (SIGSEGV in c10::impl::ensureCUDADeviceGuardSet, which that entry calls);
# one entered before, outside any capture, does not.  2.12 and later: no crash.
FAKE_MODE_ENTERED_BEFORE_THREADS = RELEASE < (2, 12)


def before_first_capture() -> None:
    """What a release needs done once per process before its first capture (on the
    thread of that capture, before the self-check starts its thread)."""
    if FAKE_MODE_ENTERED_BEFORE_THREADS:
        from torch._subclasses.fake_tensor import FakeTensorMode
        with FakeTensorMode():
            pass
