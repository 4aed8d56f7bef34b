"""gradfx's compiled part: built in the background per torch release; Python serves until then.

Some builtin autograd nodes keep what their backward reads in C++ members that no
Python binding shows (``hidden.cpp``; ``capture/graph/hidden.py`` says which and why).
A small extension built against the installed torch's own headers reads them; until
it is ready, or where it cannot be built, those nodes run as themselves (opaque), as
they always could.

The first capture of a process starts the build in a process of its own (``build.py``,
about 30-50 s on two idle cores, minutes on a busy machine), so no backward waits for
it; every later capture looks whether it has finished (two ``stat`` calls until it has)
and loads it then.  The start is logged at INFO (pid, log file); a build still running
when the program exits gets one WARNING line at exit, saying where its log is and how
to build ahead of time (``python -m gradfx build``, :func:`build_now`) or turn it off.  The
library is cached per torch release, Python release and source (one directory under
``$GRADFX_CACHE_DIR``, by default ``~/.cache/gradfx``): later processes load it at once.
Where it cannot be had (``GRADFX_NATIVE=0``, a torch release gradfx was not tested
on, no C++ compiler, a failed build or load) one INFO line says why, and Python serves.
A failed build is not retried until its directory is deleted.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time

import torch

from .. import torch_releases
from .build import HEADERS, SOURCES

log = logging.getLogger("gradfx")
_HERE = os.path.dirname(os.path.abspath(__file__))


class _State:
    module = None  # the loaded extension
    reason: str | None = None  # why there is none (decided: not looked for again)
    builder: subprocess.Popen | None = None  # the build this process started
    started: float = 0.0  # when (time.monotonic())


_state = _State()
_lock = threading.Lock()


def _source_hash() -> str:
    digest = hashlib.sha256()
    for name in SOURCES + HEADERS + ("build.py",):
        with open(os.path.join(_HERE, name), "rb") as f:
            digest.update(f.read())
    digest.update(torch.__version__.encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:12]


_HASH = _source_hash()
NAME = f"gradfx_native_{_HASH}"  # the extension's module name, unique per source and release


def directory() -> str:
    """Where this torch release's build lives."""
    root = os.environ.get("GRADFX_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "gradfx")
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{_HASH}"
    return os.path.join(root, "native", tag)


def module():
    """The extension if it is loaded or ready to load; None while it builds or where it cannot
    be had.  Starts the build the first time it is asked for (``start``)."""
    if _state.module is not None or _state.reason is not None:
        return _state.module
    with _lock:
        if _state.module is None and _state.reason is None:
            _look(start=True)
    return _state.module


def when_loaded(fn) -> None:
    """Call ``fn(extension)`` once it has loaded (now, if it has): for code that binds one of
    its functions where asking ``module()`` each time would cost a cached backward."""
    with _lock:
        _on_load.append(fn)
        loaded = _state.module
    if loaded is not None:
        fn(loaded)


_on_load: list = []


def named(fn, name: str):
    """A C function of the extension as fx's code can name it (a global of this name); the
    call passes its arguments on untouched (no reference more)."""
    wrapped = functools.partial(fn)
    wrapped.__name__ = wrapped.__qualname__ = name
    wrapped.__module__ = __name__
    return wrapped


def start() -> None:
    """Start the build where none is cached or running (the first capture calls this)."""
    module()


def wait(timeout: float = 600.0):
    """The extension, built now if need be (waiting up to ``timeout`` seconds); None where it
    cannot be had (``reason()`` says why).  For tests and benchmarks that want it present."""
    deadline = time.monotonic() + timeout
    while module() is None and _state.reason is None:
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)
    return _state.module


def reason() -> str | None:
    """Why the extension is not loaded; None if it is, or while it builds."""
    return _state.reason


def _unavailable(why: str) -> None:
    _state.reason = why
    log.info("gradfx: its compiled part is not used (%s); Python serves", why)


def _look(start: bool) -> None:
    if os.environ.get("GRADFX_NATIVE", "1") == "0":
        return _unavailable("GRADFX_NATIVE=0")
    if not torch_releases.TESTED_RELEASE:
        return _unavailable(f"torch {torch.__version__} is not a release it was tested on")
    where = directory()
    ok, failed = os.path.join(where, "ok.json"), os.path.join(where, "failed.txt")
    if os.path.exists(ok):
        return _load(where, ok)
    if os.path.exists(failed):
        with open(failed) as f:
            first = f.readline().strip()
        return _unavailable(f"its build failed: {first}; see {failed}; `python -m gradfx build` (or deleting "
                            f"{where}) builds it again")
    if start:
        _start_build(where)


AHEAD = ("build it ahead of time with `python -m gradfx build` (CI, clusters; GRADFX_CACHE_DIR=DIR puts it "
         "elsewhere than a read-only home) or turn it off with GRADFX_NATIVE=0")


def _start_build(where: str) -> None:
    if _state.builder is not None:
        if _state.builder.poll() is None:
            return  # still building
        if not os.path.exists(os.path.join(where, "ok.json")):
            return _unavailable(f"its build stopped with code {_state.builder.returncode} and left no result; "
                                f"see {os.path.join(where, 'build.log')}")
        return
    lock = os.path.join(where, "building")
    try:
        os.makedirs(where, exist_ok=True)
        if not _claim(lock):
            return  # another process builds it: this one loads it when it is ready
        out = open(os.path.join(where, "build.log"), "w")
    except OSError as err:
        return _unavailable(f"its cache directory cannot be written ({type(err).__name__}: {err}); set "
                            "GRADFX_CACHE_DIR to a writable directory (`python -m gradfx build` builds it there "
                            "ahead of time), or GRADFX_NATIVE=0 to turn it off")
    with out:
        _state.builder = subprocess.Popen(
            [sys.executable, os.path.join(_HERE, "build.py"), where, NAME],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    with open(lock, "w") as f:
        f.write(str(_state.builder.pid))
    _state.started = time.monotonic()
    atexit.register(_still_building)
    log.info("gradfx: building its compiled part in a process of its own (pid %d, about a minute; log: %s); "
             "Python serves until it is ready. To have it from the first run, %s", _state.builder.pid,
             os.path.join(where, "build.log"), AHEAD)


def _still_building() -> None:
    """At exit: a build this process started and that is still running outlives it; say so."""
    builder = _state.builder
    # Loaded: the build wrote its result last and may only be exiting now.
    if builder is None or builder.poll() is not None or _state.module is not None:
        return
    log.warning("gradfx: its compiled part is still building in a process of its own (pid %d, started %.0f s "
                "ago; log: %s); later processes use it once it is ready. To have it from the first run, %s",
                builder.pid, time.monotonic() - _state.started, os.path.join(directory(), "build.log"), AHEAD)


def building() -> bool:
    """Whether a build of this release's compiled part is running (this process's or another's)."""
    if _state.builder is not None:
        return _state.builder.poll() is None
    try:
        with open(os.path.join(directory(), "building")) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return False
    return not pid or _alive(pid)


def build_now(progress=None, timeout: float = 1800.0):
    """The extension, built now if need be, for ``python -m gradfx build`` and the demo:
    starts the build (a failed one is tried again: its result is deleted first) or joins
    the one running, calling ``progress(seconds waited)`` about once a second until it is
    loaded.  None where it cannot be had: ``reason()`` says why (or the wait timed out)."""
    if _state.module is not None:
        return _state.module
    with _lock:
        if _state.reason is not None and _state.reason.startswith("its build"):
            failed = os.path.join(directory(), "failed.txt")
            try:
                os.unlink(failed)
            except OSError:
                pass
            _state.reason, _state.builder = None, None
    started = time.monotonic()
    while module() is None and _state.reason is None:
        waited = time.monotonic() - started
        if waited > timeout:
            return None
        if progress is not None:
            progress(waited)
        time.sleep(1.0)
    return _state.module


def report() -> dict | None:
    """What the build left (``ok.json``: seconds, bytes, library), where it is loaded."""
    try:
        with open(os.path.join(directory(), "ok.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _claim(lock: str) -> bool:
    """Take the build lock; a lock whose builder is gone is taken over."""
    for _ in range(2):
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            try:
                with open(lock) as f:
                    pid = int(f.read().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and _alive(pid):
                return False
            if not pid and time.time() - os.path.getmtime(lock) < 5.0:
                return False  # just claimed, its pid not yet written
            os.unlink(lock)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _load(where: str, ok: str) -> None:
    try:
        with open(ok) as f:
            report = json.load(f)
        path = os.path.join(where, report["library"])
        spec = importlib.util.spec_from_file_location(NAME, path)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
    except Exception as err:  # an incompatible or damaged library: Python serves
        return _unavailable(f"its library in {where} does not load: {type(err).__name__}: {err}")
    _state.module = loaded
    for fn in _on_load:
        fn(loaded)
    log.info("gradfx: its compiled part is loaded (built in %.1f s, %d KB)", report["seconds"],
             report["bytes"] // 1024)
