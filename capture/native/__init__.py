"""gradfx's compiled part: built in the background per torch release; Python serves until then.

Some builtin autograd nodes keep what their backward reads in C++ members that no
Python binding shows (``hidden.cpp``; ``capture/graph/hidden.py`` says which and why).
A small extension built against the installed torch's own headers reads them; until
it is ready, or where it cannot be built, those nodes run as themselves (opaque), as
they always could.

The first capture of a process starts the build in a process of its own (``build.py``,
about 30-50 s on two cores), so no backward waits for it; every later capture looks
whether it has finished (two ``stat`` calls until it has) and loads it then.  The
library is cached per torch release, Python release and source (one directory under
``$GRADFX_CACHE_DIR``, by default ``~/.cache/gradfx``): later processes load it at once.
Where it cannot be had (``GRADFX_NATIVE=0``, a torch release gradfx was not tested
on, no C++ compiler, a failed build or load) one INFO line says why, and Python serves.
A failed build is not retried until its directory is deleted.
"""

from __future__ import annotations

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
        return _unavailable(f"its build failed: {first}; see {failed}, and delete {where} to build again")
    if start:
        _start_build(where)


def _start_build(where: str) -> None:
    if _state.builder is not None:
        if _state.builder.poll() is None:
            return  # still building
        if not os.path.exists(os.path.join(where, "ok.json")):
            return _unavailable(f"its build stopped with code {_state.builder.returncode} and left no result")
        return
    os.makedirs(where, exist_ok=True)
    lock = os.path.join(where, "building")
    if not _claim(lock):
        return  # another process builds it: this one loads it when it is ready
    with open(os.path.join(where, "build.log"), "w") as out:
        _state.builder = subprocess.Popen(
            [sys.executable, os.path.join(_HERE, "build.py"), where, NAME],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    with open(lock, "w") as f:
        f.write(str(_state.builder.pid))
    log.info("gradfx: building its compiled part in the background in %s; Python serves until it is ready",
             where)


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
