"""The eager backend's calls: each aten overload through torch's fastest Python entry to it.

A captured graph calls aten overloads (``torch.ops.aten.mm.default``).  Calling the
overload's own C function costs about 1.4 us an op in Python; torch's public binding of
the same op (``torch.mm``, ``Tensor.t``) parses its arguments faster and costs about
1.0 us (0.8 for a view).  On a backward of a few hundred ops that is a few percent.

The public binding picks an overload from the Python types of its arguments, and it
honours ``__torch_function__``, which the overload's C function and eager's engine
never call.  So a call site takes the binding only when both hold:

* **the same overloads run**: called on meta tensors of the site's shapes, dtypes and
  layouts, under a dispatch mode that records every aten call, the binding and the
  overload's C function make the same calls with the same argument types (checked once
  per overload and argument signature);
* **no ``__torch_function__`` runs**: the whole graph then runs under
  ``torch._C.DisableTorchFunction``.  A graph that calls nothing but aten ops,
  ``getitem`` and gradfx's accumulation runs so as it is.  A graph that calls other code
  (a hook, a custom backward, DDP's reducer), whose user code must see the
  torch-function state eager gives it, runs so where gradfx's compiled part is loaded:
  each such call then goes through :func:`as_user`, which gives it the state the graph
  found (``native/torch_function.cpp``).

Everything else keeps the overload's C function.
"""

from __future__ import annotations

import functools
import operator

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from ..capture import native
from ..capture.runtime.runtime_ops import accumulate_grad, accumulate_grad_unchecked

_PLAIN_CALLS = (operator.getitem, accumulate_grad, accumulate_grad_unchecked)


def plain(graph: fx.Graph) -> bool:
    """Does ``graph`` call only aten overloads, ``getitem`` and accumulations?"""
    return all(n.op != "call_function" or isinstance(n.target, torch._ops.OpOverload) or n.target in _PLAIN_CALLS
               for n in graph.nodes)


def user_calls_apart(graph: fx.Graph) -> bool:
    """Can ``graph`` run without ``__torch_function__``, each call of other code than aten
    ops, ``getitem`` and accumulations through :func:`as_user`?  Where the compiled part
    is loaded, and the graph calls functions alone (no method or module calls)."""
    return native.module() is not None and all(n.op not in ("call_method", "call_module") for n in graph.nodes)


def is_plain_call(target) -> bool:
    return target in _PLAIN_CALLS


def as_user(target):
    """``target`` called with the torch-function state the graph found (the compiled part's
    ``as_user``), named as fx's code can call it as a global."""
    fn = _user_calls.get(target)
    if fn is None:
        fn = _user_calls[target] = _named(functools.partial(native.module().as_user, target),
                                          f"{getattr(target, '__name__', 'call')}_as_user")
    return fn


_user_calls: dict = {}


def without_torch_function(forward):
    """``forward`` run with every torch-function handler off: where the compiled part is
    loaded its ``run_without_torch_function``, which keeps the state it found for the calls
    :func:`as_user` makes; else, for a graph that makes none, ``DisableTorchFunction``."""
    module = native.module()
    if module is not None:
        return functools.partial(module.run_without_torch_function, forward)

    def run(*args):
        with torch._C.DisableTorchFunction():
            return forward(*args)
    return run


def direct(op: torch._ops.OpOverload):
    """``op``'s own C function, named so that fx's code calls it as a global: the same
    overload without ``OpOverload.__call__``'s Python frame (0.4 us an op)."""
    fn = _direct_calls.get(op)
    if fn is None:
        fn = _direct_calls[op] = _named(op._op, str(op).replace(".", "_"))
    return fn


_direct_calls: dict = {}


def _named(fn, name: str):
    """``fn`` as a C-level callable of gradfx's own name: fx's code then calls exactly it
    as a global (by its own name fx would write ``torch.split``, which may be a Python
    wrapper of the binding)."""
    named = functools.partial(fn)
    named.__name__ = named.__qualname__ = name
    named.__module__ = __name__
    return named


def fastest(node: fx.Node):
    """The public binding of ``node``'s overload where it runs the same calls (see the
    module doc), else None.  Only for graphs run without ``__torch_function__``."""
    op = node.target
    signature = _signature(node)
    if signature is None:
        return None
    key = (op, signature)
    if key not in _verified:
        _verified[key] = _verify(op, node)
    return _verified[key]


_verified: dict = {}


def _signature(node: fx.Node):
    """The argument types of a call site (what a binding's argument parser picks its
    overload by; no sizes, so the cache stays small over a run's shapes), or None where a
    binding might read them otherwise: a tensor argument only as a graph value with its
    metadata, a Python value only where the schema takes a Python value."""
    schema = node.target._schema
    args = list(node.args) + [node.kwargs[a.name] for a in schema.arguments[len(node.args):]
                              if a.name in node.kwargs]
    if len(node.args) + len(node.kwargs) != len(args):
        return None  # a kwarg the schema does not name in order (out=, ...)
    parts = []
    for arg, formal in zip(args, schema.arguments):
        tensor_typed = "Tensor" in str(formal.type)
        if isinstance(arg, fx.Node):
            val = arg.meta.get("val")
            if not isinstance(val, torch.Tensor) or not tensor_typed or val.layout != torch.strided:
                return None
            if any(type(s) is not int for s in (*val.shape, *val.stride())):
                return None  # symbolic sizes: no meta twin (the C function serves)
            parts.append((val.dtype, val.dim(), val.device.type))
        elif tensor_typed and arg is not None:
            return None  # a number where the schema takes a tensor: converted otherwise
        elif isinstance(arg, (list, tuple)):
            if any(isinstance(a, fx.Node) for a in arg):
                return None
            parts.append((type(arg), tuple(map(type, arg))))
        else:
            parts.append(type(arg))
    return tuple(parts), tuple(node.kwargs)


def _candidates(op: torch._ops.OpOverload):
    name = op._schema.name.split("::")[-1]
    for where, namespace in (("torch", torch._C._VariableFunctions), ("Tensor", torch.Tensor)):
        fn = getattr(namespace, name, None)
        if fn is not None:
            yield where, fn


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((func, _types(args), _types(tuple(kwargs.items()))))
        return func(*args, **kwargs)


def _types(values):
    return tuple(_types(v) if isinstance(v, (list, tuple)) else
                 ("T", v.dtype, tuple(v.shape), tuple(v.stride())) if isinstance(v, torch.Tensor) else
                 (type(v).__name__, v) for v in values)


def _meta_call(fn, node: fx.Node):
    """``fn`` called on meta twins of the site's tensors, as the recorder sees it."""
    def twin(a):
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return a
    args = [twin(a) for a in node.args]
    # A factory's device too: nothing real runs (a random one would draw from the generator).
    kwargs = {k: "meta" if k == "device" else twin(v) for k, v in node.kwargs.items()}
    recorder = _Recorder()
    with torch._C.DisableTorchFunction(), recorder:
        out = fn(*args, **kwargs)
    return recorder.calls, _types(out if isinstance(out, (tuple, list)) else (out,))


def _verify(op: torch._ops.OpOverload, node: fx.Node):
    try:
        expected = _meta_call(op._op, node)
    except Exception:
        return None
    if not expected[0] or expected[0][0][0] is not op:
        return None
    for where, fn in _candidates(op):
        try:
            if _meta_call(fn, node) == expected:
                return _named(fn, f"{where}_{fn.__name__}")
        except Exception:
            continue
    return None
