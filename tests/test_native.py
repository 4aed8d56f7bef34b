"""gradfx's compiled part (capture/native): found, built in the background, or said why not.

Each test gives the loader a fresh state and cache directory of its own, so the
session's loaded extension is left alone.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from gradfx.capture import native


@pytest.fixture
def fresh(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("GRADFX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_state", native._State())
    caplog.set_level(logging.INFO, logger="gradfx")
    return tmp_path


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if "compiled part" in r.getMessage()]


def test_the_directory_names_the_torch_and_python_releases(fresh):
    where = native.directory()
    assert where.startswith(str(fresh))
    assert f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-" in os.path.basename(where)


def test_switched_off(fresh, monkeypatch, caplog):
    monkeypatch.setenv("GRADFX_NATIVE", "0")
    assert native.module() is None and native.module() is None
    assert native.reason() == "GRADFX_NATIVE=0"
    assert _lines(caplog) == ["gradfx: its compiled part is not used (GRADFX_NATIVE=0); Python serves"]
    assert not os.path.exists(native.directory())  # nothing built


def test_an_untested_torch_release_is_not_built_for(fresh, monkeypatch):
    monkeypatch.setattr(native.torch_releases, "TESTED_RELEASE", False)
    assert native.module() is None
    assert "is not a release it was tested on" in native.reason()


def test_a_failed_build_says_why_once_and_is_not_retried(fresh, monkeypatch, caplog):
    """No C++ compiler (CXX names a program that fails): the build leaves failed.txt."""
    monkeypatch.setenv("CXX", "/bin/false")
    assert native.wait(timeout=120) is None
    reason = native.reason()
    assert reason.startswith("its build failed: ") and "`python -m gradfx build` (or deleting" in reason, reason
    assert os.path.exists(os.path.join(native.directory(), "failed.txt"))
    later = native._State()
    monkeypatch.setattr(native, "_state", later)
    assert native.module() is None and later.builder is None  # read, not built again
    assert len([line for line in _lines(caplog) if "build failed" in line]) == 2  # once per process


def test_a_library_that_does_not_load_leaves_python_serving(fresh):
    where = native.directory()
    os.makedirs(where)
    with open(os.path.join(where, "broken.so"), "w") as f:
        f.write("not a library")
    with open(os.path.join(where, "ok.json"), "w") as f:
        f.write('{"seconds": 1.0, "bytes": 13, "library": "broken.so"}')
    assert native.module() is None
    assert "does not load" in native.reason()


def test_a_build_under_way_elsewhere_is_waited_for_not_repeated(fresh):
    """A live process holds the lock: this one starts no build of its own."""
    where = native.directory()
    os.makedirs(where)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with open(os.path.join(where, "building"), "w") as f:
            f.write(str(holder.pid))
        assert native.module() is None and native.reason() is None
        assert native._state.builder is None
    finally:
        holder.kill()
        holder.wait()
    # Its holder gone (killed mid-build), the lock is taken over and a build starts.
    native.module()
    assert native._state.builder is not None
    native._state.builder.kill()
    native._state.builder.wait()


def test_the_session_loaded_the_cached_build():
    """The test session waited for the build (conftest): the extension answers."""
    module = native.module()
    if module is None:
        pytest.skip(f"no compiled part here: {native.reason()}")
    x = torch.randn(3, requires_grad=True)
    assert module.hidden(x.exp().grad_fn) is None
    assert module.hidden(torch.native_dropout(x, 0.5, True)[0].grad_fn) == (True,)


def test_a_build_it_starts_says_where_its_log_is_and_outliving_the_program_is_said(fresh, caplog):
    """The start: pid, log, how to build ahead of time or turn it off (INFO); at exit, a build
    still running gets one WARNING line (visible without any logging set up)."""
    native.module()
    builder = native._state.builder
    assert builder is not None
    try:
        log_file = os.path.join(native.directory(), "build.log")
        [start] = [line for line in _lines(caplog) if "building" in line]
        assert start.startswith(f"gradfx: building its compiled part in a process of its own (pid {builder.pid}, ")
        assert f"log: {log_file}" in start and "`python -m gradfx build`" in start and "GRADFX_NATIVE=0" in start
        assert native.building()
        caplog.clear()
        native._still_building()  # what atexit runs
        [record] = [r for r in caplog.records if r.name == "gradfx"]
        assert record.levelno == logging.WARNING
        message = record.getMessage()
        assert message.startswith(f"gradfx: its compiled part is still building in a process of its own "
                                  f"(pid {builder.pid}, started ")
        assert f"log: {log_file}" in message and "`python -m gradfx build`" in message
        assert "GRADFX_CACHE_DIR" in message and "GRADFX_NATIVE=0" in message
    finally:
        builder.kill()
        builder.wait()
    caplog.clear()
    native._still_building()  # finished (here: killed): nothing to say
    assert not caplog.records


def test_an_unwritable_cache_directory_leaves_python_serving(fresh, monkeypatch):
    blocker = fresh / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("GRADFX_CACHE_DIR", str(blocker))  # a directory under a file cannot be made
    assert native.module() is None
    reason = native.reason()
    assert reason.startswith("its cache directory cannot be written (") and "GRADFX_CACHE_DIR" in reason, reason


def test_build_now_tries_a_failed_build_again(fresh, monkeypatch):
    where = native.directory()
    os.makedirs(where)
    with open(os.path.join(where, "failed.txt"), "w") as f:
        f.write("no compiler\n")
    assert native.module() is None and native.reason().startswith("its build failed: no compiler")
    monkeypatch.setenv("CXX", "/bin/false")
    seen = []
    assert native.build_now(seen.append, timeout=120) is None
    assert native._state.builder is not None and seen  # built again (and failed again), with progress
    assert native.reason().startswith("its build failed: ")
