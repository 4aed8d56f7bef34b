"""Build gradfx's compiled part into one directory: ``python build.py DIR``.

Run by ``capture.native`` in a process of its own (a build takes about 30-50 s on two
cores and must not hold up a backward), with nothing of gradfx imported: only torch,
whose ``cpp_extension`` compiles against the installed release's own headers.  It
leaves in DIR either ``ok.json`` (build seconds, the library's size) or
``failed.txt`` (why), written last, so a reader sees a finished build or none.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

SOURCES = ("module.cpp", "hidden.cpp", "walk.cpp", "structure.cpp", "saved.cpp", "program.cpp", "accumulate.cpp",
           "post_hooks.cpp", "fields.cpp", "buckets.cpp", "ring_copy.cpp",
           "torch_function.cpp")
HEADERS = ("checks.h", "methods.h")


def build(directory: str, name: str) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    # The environment's own bin (pip's ninja, a compiler wrapper) even where it is not on PATH.
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    started = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load
        module = load(name, [os.path.join(here, s) for s in SOURCES], build_directory=directory,
                      extra_cflags=["-O2"], verbose=False)
        library = module.__file__
        report = {"seconds": round(time.perf_counter() - started, 1), "bytes": os.path.getsize(library),
                  "library": os.path.basename(library)}
        _write(directory, "ok.json", json.dumps(report))
    except BaseException as err:  # the reason goes to the log line of every process that looks
        detail = traceback.format_exc(limit=2)
        first = str(err).strip().splitlines()
        _write(directory, "failed.txt", (first[0] if first else type(err).__name__) + "\n\n" + detail)


def _write(directory: str, name: str, text: str) -> None:
    tmp = os.path.join(directory, name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(directory, name))


if __name__ == "__main__":
    build(sys.argv[1], sys.argv[2])
