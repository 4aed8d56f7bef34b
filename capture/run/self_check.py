"""The self-check: before the first capture of a process, is this torch safe to capture on?

gradfx reads torch internals: node objects and their hook dicts, saved variables and
their version counters, ``_input_metadata``.  A release that changed one of them would
make gradfx compute wrong gradients without a word (torch 2.11 did, for hooks on
non-leaf tensors, before ``torch_releases`` knew of it).  So before anything is
captured, a few tiny programs run twice, on the eager engine and through gradfx's own
eager backend, and their gradients, hook calls and errors are compared bitwise.  On a
release outside ``torch_releases.TESTED``, or where a probe differs, every backward of
the process runs on the eager engine, with one ``FallbackWarning`` naming the release
and the probe (``Unsupported`` in strict blocks and in ``gradfx.capture``).

``GRADFX_ALLOW_UNTESTED_TORCH=1`` lets an untested release through when its probes
agree (at the user's risk: the probes cover what gradfx reads, not every formula).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch

from .. import native, torch_releases

log = logging.getLogger("gradfx")

verdict: str | None = None  # "" once the probes agreed, else why gradfx must not capture
_lock = threading.RLock()
_checking = threading.local()


def refusal() -> str | None:
    """Why this process must not capture (None: it may).  Runs the check once."""
    found = verdict
    if found is None:
        if getattr(_checking, "active", False):
            return None  # the probes' own backwards
        if torch.is_anomaly_enabled():
            return None  # undecided: blocks fall back under anomaly mode; checked at a later capture
        found = _decide()
    return found or None


def _decide() -> str:
    global verdict
    with _lock:
        if verdict is None:
            start = time.perf_counter()
            verdict = _check()
            seconds = time.perf_counter() - start
            if verdict:
                log.info("gradfx: self-check failed in %.1f ms: %s", seconds * 1e3, verdict)
            else:
                log.debug("gradfx: self-check of torch %s passed in %.1f ms", torch.__version__, seconds * 1e3)
                native.start()  # the process's first capture: the compiled part builds meanwhile
    return verdict


def _check() -> str:
    release = "torch %s" % torch.__version__
    if not torch_releases.TESTED_RELEASE and os.environ.get("GRADFX_ALLOW_UNTESTED_TORCH") != "1":
        tested = ", ".join("%d.%d" % r for r in torch_releases.TESTED)
        return (f"{release} is not a release gradfx was tested on ({tested}); "
                "set GRADFX_ALLOW_UNTESTED_TORCH=1 to capture anyway where its self-check passes")
    # On a thread of their own, the probes see none of the caller's thread state: its
    # gradfx blocks, grad and inference mode, autocast, dispatch modes, saved-tensor hooks.
    torch_releases.before_first_capture()
    found = []
    worker = threading.Thread(target=lambda: found.append(_run_probes()), name="gradfx-self-check")
    with _apart():
        worker.start()
        worker.join()
    return f"{release} failed gradfx's self-check, {found[0]}" if found and found[0] else ""


def _run_probes() -> str:
    """'' if every probe agrees, else which one differs and how."""
    _checking.active = True
    for name, probe in PROBES:
        try:
            differs = _difference(probe(_eager), probe(_gradfx))
        except Exception as err:  # a probe that crashes under gradfx is a probe that fails
            differs = f"{type(err).__name__}: {err}"
        if differs:
            return f"probe '{name}': {differs}"
    return ""


# -- running a probe ------------------------------------------------------------

def _eager(fn):
    """Run ``fn`` (which calls a backward API) on the eager engine."""
    return fn()


# The block the probes run in: session.Session, which sets it when it loads (it asks
# this module for the verdict, so this module does not import it).
block_type = None


def _gradfx(fn):
    """Run ``fn`` through gradfx's eager backend; strict: a fallback is a failure."""
    with block_type("eager", dynamic=False, strict=True, passes=[]):
        return fn()


@contextlib.contextmanager
def _apart():
    """The probes leave nothing behind: the cache, the walkers, the counters and the log
    are the user's as they were.  (Every other thread that would capture waits for the
    verdict meanwhile, so none of them meets the probes' cache.)"""
    from ..graph import fast_walk
    from ..view import explain
    from ..runtime import counters
    from .cache import GraphCache, cache
    kept_cache, kept_walkers = dict(vars(cache)), dict(vars(fast_walk.walkers))
    kept_last = explain._last_key[0]  # the user's last capture: what a new structure is compared with
    kept_totals = dict(counters.totals)
    GraphCache.__init__(cache, cache.max_size)
    cache.on_forget = kept_cache["on_forget"]
    type(fast_walk.walkers).__init__(fast_walk.walkers)
    disabled, log.disabled = log.disabled, True
    try:
        yield
    finally:
        log.disabled = disabled
        vars(cache).clear()
        vars(cache).update(kept_cache)
        vars(fast_walk.walkers).clear()
        vars(fast_walk.walkers).update(kept_walkers)
        counters.totals.update(kept_totals)
        explain._last_key[0] = kept_last


def _difference(expected: list, got: list) -> str:
    """'' if the two logs agree bitwise, else the first difference in words."""
    if len(expected) != len(got):
        labels = [e[0] for e in expected], [g[0] for g in got]
        return f"eager logged {labels[0]}, gradfx {labels[1]}"
    for (label, want), (label_got, have) in zip(expected, got):
        if label != label_got:
            return f"eager logged {label!r} where gradfx logged {label_got!r}"
        if isinstance(want, torch.Tensor) or isinstance(have, torch.Tensor):
            same = (isinstance(want, torch.Tensor) and isinstance(have, torch.Tensor) and want.dtype == have.dtype
                    and want.shape == have.shape and torch.equal(want, have))
        else:
            same = want == have
        if not same:
            return f"{label}: eager {_show(want)}, gradfx {_show(have)}"
    return ""


def _show(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.detach().flatten()[:4].tolist()} ({value.dtype})"
    return repr(value)


def _raises(fn) -> str:
    """What calling ``fn`` raised (the type), or 'no error'."""
    try:
        fn()
    except Exception as err:
        return type(err).__name__
    return "no error"


# -- the probes -------------------------------------------------------------------
# Each takes `run` (_eager or _gradfx) and returns a log of (label, value): gradients,
# hook calls in the order they happened, errors.  Values are fixed, not random.

class _Scaled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k):
        ctx.save_for_backward(x)
        ctx.k = k
        return x * k

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k + x, None


def _probe_hooks(run) -> list:
    """Tensor hooks on a leaf and a non-leaf, retain_grad, a post-accumulate hook, node
    pre- and post-hooks, a custom Function, saved tensors taken over (validate_outputs
    reads _input_metadata throughout): run twice keeping the graph (the second time by
    the cached walker), a third time freeing it, and a fourth, which raises."""
    events = []
    note = lambda label, value: events.append((label, value.detach().clone()))  # noqa: E731
    x = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
    w = torch.tensor([0.25, -1.0, 2.0], requires_grad=True)
    x.register_hook(lambda g: note("leaf hook of x", g))
    x.register_post_accumulate_grad_hook(lambda t: note("post-accumulate hook of x", t.grad))
    y = x * w
    y.register_hook(lambda g: (note("hook of y", g), g * 3)[1])
    y.retain_grad()
    z = _Scaled.apply(y, 1.5).tanh()
    z.grad_fn.register_prehook(lambda go: note("pre-hook of tanh", go[0]))
    z.grad_fn.register_hook(lambda gi, go: note("post-hook of tanh", gi[0]))
    loss = z.sum()
    for keep in (True, True, False):
        run(lambda: loss.backward(retain_graph=keep))
    logged = list(events)  # eager runs the pre-hook of tanh before its error, gradfx raises first
    again = _raises(lambda: run(loss.backward))
    return logged + [("x.grad", x.grad), ("w.grad", w.grad), ("y.grad", y.grad), ("fourth backward", again)]


def _probe_post_accumulate_hooks(run) -> list:
    """Leaves whose only hooks are post-accumulate-grad hooks, two on one of them: after
    the capture, hits walk them in one C++ call (walk_program), which reads their dicts."""
    events = []
    a = torch.tensor([0.5, -1.5], requires_grad=True)
    b = torch.tensor([2.0, 0.25], requires_grad=True)
    a.register_post_accumulate_grad_hook(lambda t: events.append(("first hook of a", t.grad.clone())))
    a.register_post_accumulate_grad_hook(lambda t: events.append(("second hook of a", t.grad.clone())))
    b.register_post_accumulate_grad_hook(lambda t: events.append(("hook of b", t.grad.clone())))
    for _ in range(3):
        run(lambda: (a * b).exp().sum().backward())
    return events + [("a.grad", a.grad), ("b.grad", b.grad)]


def _probe_version_check(run) -> list:
    """A backward through a saved tensor modified in place raises, nothing accumulated."""
    c = torch.tensor([1.0, 2.0], requires_grad=True)
    d = c.exp()
    loss = d.sum()
    d.mul_(3)
    return [("in-place modified", _raises(lambda: run(loss.backward))), ("c.grad", c.grad)]


PROBES = (("hooks", _probe_hooks), ("post-accumulate-grad hooks", _probe_post_accumulate_hooks),
          ("in-place version check", _probe_version_check))
