"""Tells DistributedDataParallel's hooks on leaves: its C++ reducer's, its Python reducer's.

DDP registers its gradient all-reduce as C++ post-hooks on the parameters'
AccumulateGrad nodes: Python registered nothing and can read nothing back.  A run
that skipped them would leave every rank with its local gradient, silently.
When torch.distributed is initialized, the walk asks of each accumulator whether
it has C++ post-hooks (:func:`cpp_hooked`).  gradfx's compiled part counts them on
the node and runs them, so the graph calls them where eager does
(``hook_ops.call_node_post_hooks``).  Where the compiled part is not loaded (still
building, ``GRADFX_NATIVE=0``) nothing can call them: the answer comes from torch's
own compiled autograd, asked to collect the node's hooks (it refuses C++ hooks it
cannot compile, such as the reducer's, before anything runs; the compiler function
gradfx passes refuses too, so nothing is ever executed), cached per node, and the
backward falls back (:func:`cpp_hooks_reason`).

With ``optimize_ddp = "python_reducer"`` DDP registers a Python post-accumulate-grad
hook on each parameter instead (:func:`reducer_of` tells it).  Where its DDP has no
comm hook, a call of it runs no user code (:func:`reducer_hook_alone`): the structure
key records that per hook, so a graph may run those calls later than eager does
(``backends.split``) only while it holds.
"""

from __future__ import annotations

import functools

import torch

from .. import native

_HOOK_NAME = "compiled_accum_grad_hook"
_HOOK_MODULE = "torch.nn.parallel.distributed"

_checked: dict[int, tuple] = {}  # id(node) -> (variable id, has C++ hooks)


class _Refused(Exception):
    pass


def _refuse(gm):
    raise _Refused()


def initialized() -> bool:
    """Is torch.distributed's default process group initialized?  Asked on every cached
    backward: torch's ``is_initialized()`` is three Python frames (12 us when the caches
    are cold, as after a graph has run), so this reads what it reads, the registry's
    default group, directly where the registry has it (torch 2.11-2.14)."""
    world = _world[0] if _world else _registry()
    if world is not None:
        return world._default_pg is not None
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _registry():
    """torch's process-group registry (``distributed_c10d._world``) where it keeps the
    default group as ``_default_pg``, else None (then the public API is asked)."""
    if _world:
        return _world[0]
    world = None
    if torch.distributed.is_available():
        world = getattr(torch.distributed.distributed_c10d, "_world", None)
        if world is None or not hasattr(world, "_default_pg"):
            world = None
    _world.append(world)
    return world


_world: list = []  # [the registry or None], once looked up


def cpp_hooked(node) -> bool:
    """Has this AccumulateGrad node C++ post-hooks?"""
    reader = native.module()
    if reader is not None:
        return reader.cpp_post_hooks(node) > 0
    return _probed([node])


def cpp_hooked_mask(accumulators) -> tuple:
    """:func:`cpp_hooked` of each node: what a generated walker checks its structure by."""
    reader = native.module()
    if reader is None:
        return tuple(_probed([n]) for n in accumulators)
    count = reader.cpp_post_hooks
    return tuple([count(n) > 0 for n in accumulators])


def cpp_hooks_reason(accumulators: list) -> str | None:
    """A reason to fall back if any of these AccumulateGrad nodes has C++ hooks that
    gradfx cannot run (its compiled part is not loaded)."""
    if native.module() is not None or not _probed(accumulators):
        return None
    why = native.reason() or "it is still being built (python -m gradfx build builds it ahead of time)"
    return ("C++ hooks on a parameter's gradient accumulator (DistributedDataParallel's reducer), which only "
            f"gradfx's compiled part can run, and it is not loaded: {why}")


def _probed(accumulators: list) -> bool:
    """Has any of these nodes C++ hooks (torch's compiled autograd asked, cached per node)?"""
    unknown = [n for n in accumulators
               if _checked.get(id(n), (None,))[0] != id(n.variable)]
    if unknown:
        found = _probe([n.variable for n in unknown])
        for n in unknown:
            _checked[id(n)] = (id(n.variable), found)
    return any(_checked[id(n)][1] for n in accumulators)


def _probe(variables) -> bool:
    import functools

    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters
    from torch.autograd.variable import Variable

    engine = Variable._execution_engine
    engine = getattr(engine, "engine", engine)  # the C++ engine behind gradfx's routing
    roots = tuple(v.view_as(v) for v in variables)
    grads = tuple(torch.zeros_like(v) for v in variables)
    # torch's compiled autograd installed directly, not through `compiled_autograd._enable`:
    # a test harness may have pointed that at gradfx itself.
    install = torch._C._dynamo.compiled_autograd.set_autograd_compiler
    # torch counts the capture the probe starts: the count the user reads is left as it was
    counted = counters["compiled_autograd"]
    before = dict(counted)
    prior = install(functools.partial(compiled_autograd.AutogradCompilerInstance, _refuse), False)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            engine.run_backward(roots, grads, False, False, (), True, True)
    except _Refused:
        return False
    except RuntimeError:
        return True
    finally:
        install(*prior)
        counted.clear()
        counted.update(before)
    return True


def reducer_of(hook):
    """The DistributedDataParallel whose Python-reducer hook ``hook`` is, else None.

    Asked of every such hook on every cached backward (the structure key, and each bucketed
    call): once one is recognized, its code object (every DDP's hook shares it) and where its
    ``self`` sits answer the next in two identity checks."""
    if type(hook) is not functools.partial:
        return None
    func = hook.func
    code = getattr(func, "__code__", None)
    if code is None:
        return None
    if code is not recognized_hook[0]:
        if code.co_name != _HOOK_NAME or getattr(func, "__module__", None) != _HOOK_MODULE \
                or "self" not in code.co_freevars:
            return None
        recognized_hook[:] = [code, code.co_freevars.index("self")]
    try:
        ddp = func.__closure__[recognized_hook[1]].cell_contents
    except (IndexError, TypeError, ValueError):  # ValueError: an empty cell
        return None
    return ddp if isinstance(ddp, torch.nn.parallel.DistributedDataParallel) else None


# The code object of DDP's hook, once seen, and its ``self``'s cell (native/buckets.cpp reads
# it too).
recognized_hook: list = [None, 0]


def reducer_hook_alone(hook) -> bool:
    """Is ``hook`` DDP's Python-reducer hook on a DDP without comm hooks?  Its call then
    runs DDP's code alone: it reads its parameter's ``.grad`` and all-reduces it."""
    ddp = reducer_of(hook)
    return ddp is not None and not ddp._comm_hooks
