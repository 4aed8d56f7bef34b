"""The committed results file, ``bench/results.json``, that the benchmark scripts write.

Every figure the README and ``docs/*.md`` quote comes from this file
(``tests/test_doc_figures.py`` checks it).  It is keyed by benchmark (the script and the
flags that change what it measures, e.g. ``bench_backward --backend eager --threads 1``),
then by model; each entry says when, on what machine (CPU model, cores, load average
when the run started) and with which torch and Python it was measured, and holds its
ratios to eager under keys that start with ``ratio``.  A run replaces the entries of
the models it measured and leaves the others as they were (``record``).

Standard library only: ``bench_gpu.py``'s workers and a machine without gradfx import it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PATH = os.path.join(HERE, "results.json")


def machine() -> dict:
    """The CPU model, its cores and the load average (a busy machine measures noisily)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"cpu": cpu, "cores": os.cpu_count(), "load": load, "system": platform.system()}


def stamp() -> dict:
    """When, where and with what: date, machine, torch and Python releases."""
    import torch
    return {"date": datetime.date.today().isoformat(), "machine": machine(), "torch": torch.__version__,
            "python": platform.python_version()}


def record(benchmark: str, entries: dict, path: str = PATH, **common) -> None:
    """Merge ``{model: entry}`` under ``benchmark`` into the results file; each entry gets
    :func:`stamp`, ``common`` and the command line that ran."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    when = stamp()
    command = " ".join(["python", os.path.relpath(sys.argv[0], os.path.dirname(HERE))] + sys.argv[1:])
    env = {k: os.environ[k] for k in ("GRADFX_NATIVE",) if k in os.environ}
    section = data.setdefault(benchmark, {})
    for model, entry in entries.items():
        section[model] = {**when, **common, "command": command, **({"env": env} if env else {}), **entry}
    data = {k: dict(sorted(v.items())) for k, v in sorted(data.items())}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)
    print(f"[results] {len(entries)} entr{'y' if len(entries) == 1 else 'ies'} of {benchmark!r} written to "
          f"{os.path.relpath(path)}")


def load(path: str = PATH) -> dict:
    with open(path) as f:
        return json.load(f)


def ratios(data):
    """Every ratio ``data`` (the file, :func:`load`) holds: values under keys that start
    with ``ratio``."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key.startswith("ratio") and isinstance(value, (int, float)):
                yield float(value)
            elif key.startswith("ratio") and isinstance(value, list):
                yield from (float(v) for v in value if isinstance(v, (int, float)))
            else:
                yield from ratios(value)
    elif isinstance(data, list):
        for item in data:
            yield from ratios(item)
