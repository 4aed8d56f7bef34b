"""Run PyTorch's own compiled-autograd test file with gradfx in its place.

    python bench/pytorch_suite.py PATH/test/inductor/test_compiled_autograd.py [-k EXPR]
        [--out bench/results_pytorch_suite.json] [--all] [--dynamic auto|true|false]

The file is PyTorch's ``test/inductor/test_compiled_autograd.py`` (it is not in this
repository: get it from a PyTorch checkout of the release you test).  It runs unchanged,
under pytest, in this process, with a shim that maps what it calls onto gradfx:

- ``torch._dynamo.compiled_autograd._enable(compiler_fn, dynamic=...)`` opens a
  ``gradfx.compiled_autograd(backend=compiler_fn)`` block (the test's ``compiler_fn``,
  a one-argument ``fn(gm)``, is the block's backend), with multithreading off as
  PyTorch's does; an inner block must close before its outer one (PyTorch's assertion).
  ``dynamic=True`` (``_enable``'s default: sizes symbolic from the first capture) maps
  to gradfx's ``dynamic=True``; ``False`` (static first, a size symbolic once it
  changes) to ``"auto"``; ``--dynamic`` overrides both.
- ``torch._dynamo.config.compiled_autograd = True`` (or ``config.patch``) works through
  the same ``_enable``: ``torch.compile`` calls it around a function compiled while the
  flag is set, with ``torch.compile`` of the same backend as the compiler.  It builds
  that compiler anew at each call; the shim keeps the first one per ``torch.compile``
  (gradfx keys a backend object by identity; PyTorch's cache keys no compiler).
- ``compiled_autograd._disable()`` suspends the open gradfx blocks of the thread (their
  backwards run on the eager engine) and keeps ``torch.compile`` from opening one.
- ``compiled_autograd.reset()`` (which ``torch._dynamo.reset()`` calls) also calls
  ``gradfx.reset()``.
- Counters: each capture of a block the shim opened adds 1 to
  ``counters["compiled_autograd"]["captures"]`` (not gradfx's once-per-process self-check).
  ``counters["compiled_autograd"]["compiles"]`` is counted by the test's own compiler
  (``make_compiler_fn``): the dynamo graphs compiled from gradfx's graph, so a graph
  break in it counts as in PyTorch's.

The modules the file loads beside it for its wrapped classes (``test_autograd``,
``test_custom_ops``, ``dynamo/test_higher_order_ops``) are replaced by empty stand-ins:
those classes are PyTorch's autograd suite run under compiled autograd, not this
file's tests.  What counts is the class ``TestCompiledAutograd``, less the tests that
do not count (``--all`` runs and counts every collected test): see ``EXCLUDED`` below
and docs/TESTING.md.  The file needs ``pytest`` and ``expecttest``.

It prints one line per test and a summary, and writes the result as JSON (date, torch
version, counts, the failing tests with the first line of their error).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import sys
import tempfile
import threading
import weakref

HERE = os.path.dirname(os.path.abspath(__file__))

# The tests of TestCompiledAutograd that do not count, by reason.  On CPU the class has
# 149 tests: 11 skip for want of a GPU, and these 39 leave the 99 that count.
EXCLUDED = {
    # They build a C++ extension with torch.utils.cpp_extension (a compiler and minutes
    # each); custom C++ autograd Functions are covered by tests/test_custom_functions.py.
    "load_inline": (
        "test_autograd_cpp_node_non_traceable",
        "test_autograd_cpp_node_basic_is_traceable_True", "test_autograd_cpp_node_basic_is_traceable_False",
        "test_autograd_cpp_node_id_is_traceable_True", "test_autograd_cpp_node_id_is_traceable_False",
        "test_autograd_cpp_node_saved_basic_is_traceable_True",
        "test_autograd_cpp_node_saved_basic_is_traceable_False",
        "test_autograd_cpp_node_saved_dynamic_is_traceable_True",
        "test_autograd_cpp_node_saved_dynamic_is_traceable_False",
        "test_autograd_cpp_node_saved_int_is_traceable_True", "test_autograd_cpp_node_saved_int_is_traceable_False",
        "test_autograd_cpp_node_saved_float_is_traceable_True",
        "test_autograd_cpp_node_saved_float_is_traceable_False",
        "test_autograd_cpp_node_data_dependent_is_traceable_True",
        "test_autograd_cpp_node_data_dependent_is_traceable_False",
    ),
    # They run a script in a new Python process, where no shim is: PyTorch's own.
    "subprocess": ("test_hipify_not_loaded_with_import_torch", "test_hipify_not_loaded_with_import_cpp_extension",
                   "test_dynamo_flaky_segfault"),
    # They read the log lines of PyTorch's implementation.
    "logs": ("test_logs", "test_verbose_logs_graph", "test_verbose_logs_aot_id",
             "test_verbose_logs_aot_dispatcher_nodes", "test_verbose_logs_aot_dispatcher_nodes_hop",
             "test_verbose_logs_cpp", "test_verbose_logs_dynamic_shapes", "test_verbose_logs_snapshot"),
    # They expect the errors with which PyTorch's implementation refuses what it does not
    # support (anomaly mode, DDP's C++ reducer, a final callback with a graph break,
    # AOTAutograd's double backward); gradfx runs these on the eager engine or captures
    # them, and eager's own errors apply (docs/SEMANTICS.md).
    "refusals": ("test_anomaly_mode_already_nan", "test_anomaly_mode_backward", "test_anomaly_mode_grad",
                 "test_ddp_cpp_reducer_error", "test_callback_graph_break_throws_error",
                 "test_higher_order_gradients"),
    # They read PyTorch's implementation itself: its C++ cache and compiler instance, or
    # its graph's exact text and helper functions.
    "implementation": ("test_reset", "test_inputs_aliasing_bytecode_attr_mutations",
                       "test_cudagraphs_move_graph_nodes_to_device", "test_tensor_subclass_basic",
                       "test_checkpointing_simple_reentrant_False", "test_disk_offloading",
                       "test_accumulate_grad_capture_lifts_current_grad"),
}


def _stub_modules(test_root: str) -> None:
    """Empty stand-ins for the modules the file loads beside it, where they are missing."""
    stubs = {
        "test_autograd.py": ("TestAutograd", "TestNestedCheckpoint"),
        "test_custom_ops.py": ("TestCustomOp",),
        os.path.join("dynamo", "test_higher_order_ops.py"): (
            "HigherOrderOpTests", "FuncTorchHigherOrderOpTests", "ActivationCheckpointingTests"),
        os.path.join("distributed", "tensor", "test_dtensor_compile.py"): ("TestDTensorCompile",),
    }
    for rel, classes in stubs.items():
        path = os.path.join(test_root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write("import unittest\n\n")
            for name in classes:
                f.write(f"\nclass {name}(unittest.TestCase):\n    pass\n")


class Shim:
    """Maps torch._dynamo.compiled_autograd's entry points and counters onto gradfx."""

    def __init__(self, dynamic: str | None):
        self.dynamic = dynamic  # None: from _enable's argument
        self.local = threading.local()
        self.compilers = weakref.WeakKeyDictionary()  # torch.compile's rebuild_ctx -> its compiler

    def install(self) -> None:
        import torch
        import torch._dynamo.compiled_autograd as ca
        import gradfx
        from gradfx.capture.run import routing
        from gradfx.capture.run.session import Session

        shim = self
        self.ca, self.gradfx, self.routing = ca, gradfx, routing

        def _enable(compiler_fn, dynamic=True, ignore_active_disable_ctx=True):
            if not ignore_active_disable_ctx:
                # torch.compile's hook (config.compiled_autograd) builds its compiler anew
                # for each call of the compiled function: one torch.compile, one compiler,
                # as PyTorch's cache, which no compiler keys, behaves.
                rebuild = sys._getframe(1).f_locals.get("rebuild_ctx")
                if rebuild is not None:
                    compiler_fn = shim.compilers.setdefault(rebuild, compiler_fn)
            return _block(compiler_fn, dynamic, ignore_active_disable_ctx)

        @contextlib.contextmanager
        def _block(compiler_fn, dynamic, ignore_active_disable_ctx):
            if not ignore_active_disable_ctx and shim._disabled():
                yield
                return
            depth = shim._depth()
            shim.local.depth = depth + 1
            try:
                with torch.autograd.set_multithreading_enabled(False), \
                        gradfx.compiled_autograd(backend=compiler_fn, dynamic=shim._gradfx_dynamic(dynamic)) as block:
                    block._pytorch_suite = True  # its captures count (not the self-check's)
                    yield
            finally:
                shim.local.depth -= 1
                if shim.local.depth != depth:
                    raise AssertionError("Nested Compiled Autograd Contexts must return before their parent context")

        @contextlib.contextmanager
        def _disable():
            stack = routing._blocks.stack
            suspended, stack[:] = stack[:], []
            was = shim._disabled()
            shim.local.disabled = True
            try:
                yield
            finally:
                shim.local.disabled = was
                stack[:] = suspended + stack

        original_reset = ca.reset

        def reset():
            original_reset()
            gradfx.reset()

        original_count = Session._count

        def _count(session, name):
            original_count(session, name)
            if name == "captures" and getattr(session, "_pytorch_suite", False):
                torch._dynamo.utils.counters["compiled_autograd"]["captures"] += 1

        ca._enable, ca._disable, ca.reset = _enable, _disable, reset
        Session._count = _count

    def _depth(self) -> int:
        return getattr(self.local, "depth", 0)

    def _disabled(self) -> bool:
        return getattr(self.local, "disabled", False)

    def _gradfx_dynamic(self, dynamic):
        if self.dynamic is not None:
            return {"auto": "auto", "true": True, "false": False}[self.dynamic]
        # PyTorch's dynamic=False starts static and makes a size symbolic once it changes
        # (gradfx's "auto"); dynamic=True makes sizes symbolic from the first capture.
        return True if dynamic else "auto"


class Collector:
    """pytest plugin: each test's outcome, and the first line of each failure."""

    def __init__(self, shim: Shim):
        self.shim = shim
        self.results: dict[str, dict] = {}

    only_counted = False

    def pytest_configure(self, config):
        self.shim.install()

    def pytest_collection_modifyitems(self, session, config, items):
        if self.only_counted:  # by exact name (--deselect would take test_logs for a prefix)
            kept = [item for item in items if counted(item.nodeid.split("::", 1)[1], False)]
            config.hook.pytest_deselected(items=[item for item in items if item not in kept])
            items[:] = kept

    def pytest_runtest_logreport(self, report):
        name = report.nodeid.split("::", 1)[1]
        entry = self.results.setdefault(name, {"outcome": "passed"})
        if report.when == "call" and hasattr(report, "wasxfail"):
            entry["outcome"] = "xfailed" if report.skipped else "xpassed"
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["reason"] = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else ""
        elif report.failed:
            entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["error"] = _first_line(report)
        if report.when == "teardown":
            print(f"{entry['outcome'].upper():8} {name}" + (f"  ({entry['error']})" if "error" in entry else ""),
                  flush=True)


def _first_line(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else ""


def counted(name: str, everything: bool) -> bool:
    if everything:
        return True
    cls, _, test = name.partition("::")
    return cls == "TestCompiledAutograd" and not any(test in names for names in EXCLUDED.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="PyTorch's test/inductor/test_compiled_autograd.py")
    parser.add_argument("-k", dest="expr", default=None, help="pytest -k expression")
    parser.add_argument("--out", default=os.path.join(HERE, "results_pytorch_suite.json"),
                        help="where to write the JSON result (default: %(default)s)")
    parser.add_argument("--all", action="store_true", help="run and count every collected test, not the selection")
    parser.add_argument("--dynamic", choices=("auto", "true", "false"), default=None,
                        help="gradfx's dynamic for every block (default: from _enable's argument)")
    args = parser.parse_args(argv)

    import pytest
    import torch

    source = os.path.abspath(args.path)
    work = tempfile.mkdtemp(prefix="gradfx_pytorch_suite_")
    try:
        test_root = os.path.join(work, "test")
        os.makedirs(os.path.join(test_root, "inductor"))
        target = os.path.join(test_root, "inductor", "test_compiled_autograd.py")
        shutil.copyfile(source, target)
        _stub_modules(test_root)
        collector = Collector(Shim(args.dynamic))
        pytest_args = [target, "-q", "-p", "no:cacheprovider", "--rootdir", work, "-o", "addopts=",
                       "-W", "ignore::DeprecationWarning", "--no-header", "-rN"]
        if args.expr:
            pytest_args += ["-k", args.expr]
        collector.only_counted = not args.all  # what does not count does not run
        pytest.main(pytest_args, plugins=[collector])
    finally:
        shutil.rmtree(work, ignore_errors=True)

    results = {name: r for name, r in collector.results.items() if counted(name, args.all)}
    ran = {n: r for n, r in results.items() if r["outcome"] != "skipped"}
    passed = sorted(n for n, r in ran.items() if r["outcome"] in ("passed", "xfailed"))
    failed = {n: r.get("error", r["outcome"]) for n, r in sorted(ran.items()) if n not in passed}
    skipped = sorted(n for n, r in results.items() if r["outcome"] == "skipped")
    print(f"\ngradfx on {os.path.basename(source)}: {len(passed)} of {len(ran)} pass"
          f" ({len(failed)} fail, {len(skipped)} skipped here)")
    for name, error in failed.items():
        print(f"  FAILED {name}: {error}")
    summary = {
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "file": os.path.basename(source),
        "selection": "every collected test" if args.all else
                     "TestCompiledAutograd less bench/pytorch_suite.py's EXCLUDED",
        "k": args.expr,
        "dynamic": args.dynamic or "from _enable",
        "passed": len(passed),
        "ran": len(ran),
        "skipped": skipped,
        "failed": failed,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)
            f.write("\n")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
