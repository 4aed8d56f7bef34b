"""Eager programs for tests/test_import_isolation.py, run in a fresh process per mode.

``python eager_programs.py MODE`` prints one JSON list: per program, what it
observed (values, hook calls, handle ids, exception types and texts).  MODE:

* ``plain``: gradfx is never imported;
* ``import``: ``import gradfx`` first, nothing else;
* ``used``: gradfx imported, and each graph first goes through a gradfx block
  (``backward(retain_graph=True)``) and ``gradfx.capture``.

In the other modes that first backward runs on the eager engine, so the three
runs must print the same thing.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn

MODE = sys.argv[1] if __name__ == "__main__" else "plain"
if MODE != "plain":
    import gradfx


def first_backward(loss):
    """The first backward of a program's graph: through gradfx in mode ``used``."""
    if MODE == "used":
        with gradfx.compiled_autograd():
            loss.backward(retain_graph=True)
        try:
            gradfx.capture(loss)
        except gradfx.Unsupported:  # tensor subclasses
            pass
    else:
        loss.backward(retain_graph=True)


def value(x):
    if isinstance(x, torch.Tensor):
        return ["tensor", type(x).__name__, str(x.dtype), list(x.shape), x.detach().tolist()]
    if isinstance(x, (tuple, list)):
        return [value(v) for v in x]
    if x is None or isinstance(x, (int, float, str, bool)):
        return x
    return type(x).__name__


def attempt(log, what, fn):
    try:
        log.append([what, "ok", value(fn())])
    except Exception as err:
        log.append([what, "raised", type(err).__name__, str(err)])


def retain_grad_twice(log):
    x = torch.randn(3, 4, requires_grad=True)
    y = x * 2
    y.retain_grad()
    y.retain_grad()
    z = (y * y).sum()
    first_backward(z)
    attempt(log, "backward", lambda: z.backward())
    log.append(["grads", value(y.grad), value(x.grad), y.retains_grad])


def register_hook_twice(log):
    x = torch.randn(3, requires_grad=True)
    y = x.sin()
    h1 = y.register_hook(lambda g: log.append(["h1", value(g)]))
    h2 = y.register_hook(lambda g: (log.append(["h2", value(g)]), g * 2)[1])
    log.append(["handles", h1.id - h2.id, type(h1).__name__, len(y._backward_hooks),
                type(y._backward_hooks).__name__])
    loss = y.exp().sum()
    first_backward(loss)
    attempt(log, "backward", lambda: loss.backward())
    log.append(["grad", value(x.grad)])


def hooks_removed_through_handles(log):
    x = torch.randn(4, requires_grad=True)
    y = x * 3
    keep = y.register_hook(lambda g: log.append(["kept", value(g)]))
    gone = y.register_hook(lambda g: log.append(["removed", value(g)]))
    gone.remove()
    node = y.grad_fn
    pre = node.register_prehook(lambda go: log.append(["node pre", value(go)]))
    post = y.grad_fn.register_hook(lambda gi, go: log.append(["node post", value(gi)]))
    post.remove()
    loss = y.pow(2).sum()
    first_backward(loss)
    attempt(log, "backward", lambda: loss.backward())
    keep.remove()
    pre.remove()
    attempt(log, "again", lambda: loss.backward())
    log.append(["grad", value(x.grad), len(y._backward_hooks)])


def hooks_on_views_and_inplace(log):
    x = torch.randn(4, 3, requires_grad=True)
    a = x * 1.5
    v = a[1:]
    v.register_hook(lambda g: log.append(["view", value(g)]))
    a.register_hook(lambda g: log.append(["before inplace", value(g)]))
    a.mul_(2)
    a.register_hook(lambda g: log.append(["after inplace", value(g)]))
    a.retain_grad()
    w = a.view(12)
    w.retain_grad()
    w.register_hook(lambda g: log.append(["view of modified", value(g)]))
    loss = (w * torch.arange(12.0)).sum() + v.sum()
    first_backward(loss)
    attempt(log, "backward", lambda: loss.backward())
    log.append(["grads", value(x.grad), value(a.grad), value(w.grad)])


class LoggingTensor(torch.Tensor):
    calls: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.calls.append(getattr(func, "__name__", str(func)))
        return super().__torch_function__(func, types, args, kwargs or {})


def tensor_subclass(log):
    LoggingTensor.calls = []
    x = torch.randn(3, requires_grad=True).as_subclass(LoggingTensor)
    y = x * 2
    h = y.register_hook(lambda g: log.append(["hook", value(g)]))
    y.retain_grad()
    loss = (y * y).sum()
    first_backward(loss)
    attempt(log, "backward", lambda: loss.backward())
    log.append(["calls", list(LoggingTensor.calls), type(h).__name__, value(y.grad), value(x.grad)])


def hook_without_grad_fn(log):
    plain = torch.randn(3)
    attempt(log, "no grad", lambda: plain.register_hook(lambda g: g))
    leaf = torch.randn(3, requires_grad=True)
    h = leaf.register_hook(lambda g: log.append(["leaf hook", value(g)]))
    attempt(log, "retain on leaf", lambda: leaf.retain_grad())
    attempt(log, "retain no grad", lambda: plain.retain_grad())
    loss = (leaf * leaf).sum()
    first_backward(loss)
    attempt(log, "backward", lambda: loss.backward())
    log.append(["leaf", value(leaf.grad), type(h).__name__])


def module_backward_hooks(log):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    handles = [
        model[0].register_full_backward_hook(lambda m, gi, go: log.append(["full0", value(gi), value(go)])),
        model[2].register_full_backward_pre_hook(lambda m, go: log.append(["pre2", value(go)])),
        model.register_full_backward_hook(lambda m, gi, go: log.append(["model", value(go)])),
    ]
    out = model(torch.randn(3, 4)).sum()
    first_backward(out)
    attempt(log, "backward", lambda: out.backward())
    log.append(["grads", [value(p.grad) for p in model.parameters()], [h.id - handles[0].id for h in handles]])


def errors(log):
    x = torch.randn(3, requires_grad=True)
    y = (x * x).sum()
    first_backward(y)
    attempt(log, "retained", lambda: y.backward())
    attempt(log, "freed", lambda: y.backward())
    z = x.exp()
    z.register_hook(lambda g: g[:2])
    attempt(log, "bad hook", lambda: z.sum().backward())
    attempt(log, "no grad", lambda: torch.randn(2).sum().backward())
    attempt(log, "grad", lambda: torch.autograd.grad((x * 2).sum(), [x, torch.randn(1, requires_grad=True)]))


PROGRAMS = [retain_grad_twice, register_hook_twice, hooks_removed_through_handles,
            hooks_on_views_and_inplace, tensor_subclass, hook_without_grad_fn,
            module_backward_hooks, errors]


def main():
    torch.manual_seed(0)
    out = []
    for program in PROGRAMS:
        log: list = []
        try:
            program(log)
        except Exception as err:
            log.append(["program raised", type(err).__name__, str(err)])
        out.append([program.__name__, log])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
