"""Guard text: what each symbol is, in a compact form when there are many; why a
backward was captured again (a new structure, new sizes), in words."""

import logging
import re

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.capture.view import explain
from gradfx.capture.view.explain import compact_guards


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def _unnumbered(lines):
    return [re.sub(r"#\d+", "#", line) for line in lines]  # a new forward numbers its nodes anew


def test_capture_dynamic_explains_its_symbols_as_a_block_does():
    model = _model()
    x = torch.randn(8, 16)
    captured = gradfx.capture(model(x).square().mean(), dynamic=True)
    gradfx.reset()
    with gradfx.compiled_autograd(dynamic=True) as s:
        model(x).square().mean().backward()
    assert _unnumbered(captured.guards) == _unnumbered(s.graphs[0].guards)
    symbols = set(re.findall(r"\bs\d+\b", " ".join(g for g in captured.guards if not g.startswith("where"))))
    explained = set()
    for line in captured.guards:
        if line.startswith("where "):
            explained |= set(re.findall(r"\bs\d+\b", line.split(":")[0]))
            assert re.search(r"(tensor of|saved|gradient) ", line), line
    assert symbols and symbols == explained


def test_many_guards_are_grouped():
    lines = (["s0 >= 2", "s1 >= 2", "s5 >= 2", "s5 <= 64"]
             + [f"sizes[{p}] == s0" for p in (2, 3, 4, 5, 9)] + ["sizes[7] == s1", "Eq(Mod(s0, 2), 0)",
                                                                  "40 other sizes as captured"]
             + ["where s0 is sizes[0]: saved tensor of AddmmBackward0 #11 dim 0",
                "where s1 is sizes[1]: saved tensor of AddmmBackward0 #11 dim 1",
                "where s5 is sizes[12]: AddmmBackward0 #7 saved mat1_sym_sizes (item 0)"])
    assert compact_guards(lines) == [
        "s0 >= 2",
        "s1 >= 2",
        "s5 >= 2",
        "s5 <= 64",
        "sizes[2..5, 9] == s0",
        "sizes[7] == s1",
        "Eq(Mod(s0, 2), 0)",
        "40 other sizes as captured",
        "where s0, s1 are sizes[0, 1]: saved tensor of AddmmBackward0 #11 dims 0, 1",
        "where s5 is sizes[12]: AddmmBackward0 #7 saved mat1_sym_sizes (item 0)",
    ]
    assert compact_guards(lines[:5]) == lines[:5]  # few: as written


def test_dynamic_capture_guards_are_compact(monkeypatch):
    model = _model()
    x = torch.randn(8, 16)
    compact = gradfx.capture(model(x).square().mean(), dynamic=True).guards
    limit = explain.COMPACT_AFTER
    monkeypatch.setattr(explain, "COMPACT_AFTER", 10 ** 6)
    full = gradfx.capture(model(x).square().mean(), dynamic=True).guards
    assert len(full) > limit and len(compact) < 0.75 * len(full)
    # the same ranges, each symbol explained once, each expression once
    ranges = [line for line in full if not line.startswith(("sizes[", "where "))]
    assert [line for line in compact if not line.startswith(("sizes[", "where "))] == ranges
    explained = [s for line in compact if line.startswith("where ") for s in line.split(":")[0].split()[1:]
                 if re.fullmatch(r"s\d+,?", s)]
    assert sorted(s.rstrip(",") for s in explained) == sorted(
        line.split()[1] for line in full if line.startswith("where "))
    equal = [line.split(" == ")[1] for line in compact if line.startswith("sizes[")]
    assert len(set(equal)) == len(equal)


# -- the new-structure log: what changed, in words ------------------------------------


def _logged(caplog, steps, word="new structure"):
    """Run each step (a backward and the block arguments it runs under) after
    gradfx.reset(); the log lines of the last step that contain ``word``."""
    gradfx.reset()
    with caplog.at_level(logging.INFO, logger="gradfx"):
        for k, (backward, block) in enumerate(steps):
            if k == len(steps) - 1:
                caplog.clear()
            with gradfx.compiled_autograd(**block):
                backward()
    return [r.getMessage() for r in caplog.records if word in r.getMessage() and r.name == "gradfx"]


def _twice(first, second, **block):
    return [(first, block), (second, block)]


_x = torch.randn(3, requires_grad=True)
_y = torch.randn(3, requires_grad=True)
_column = torch.randn(3, 1, requires_grad=True)


def _hooked():
    a = _x * 2
    a.register_hook(lambda g: g)
    a.sum().backward()


def _saved_under_hooks():
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        loss = (_x * _y).sum()
    loss.backward()


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, s):
        ctx.s = s
        return a * s

    @staticmethod
    def backward(ctx, g):
        return g * ctx.s, None


_TracedScale = gradfx.traceable(_Scale)

_CASES = {
    "roots": (_twice(lambda: torch.autograd.backward([(_x * 2).sum()]),
                     lambda: torch.autograd.backward([(_x * 2).sum(), (_x * 3).sum()])),
              r"the roots changed: the backward started at 1 tensor, now 2"),
    "node type": (_twice(lambda: (_x * 2).sum().backward(), lambda: (_x + 2).sum().backward()),
                  r"node 1 is now AddBackward0 #\d+ instead of MulBackward0"),
    "saved value": (_twice(lambda: _x.pow(2.0).sum().backward(), lambda: _x.pow(3.0).sum().backward()),
                    r"node 1 \(PowBackward0 #\d+\): saved exponent changed from 2\.0 to 3\.0"),
    "saved value type": (_twice(lambda: _x.pow(2).sum().backward(), lambda: _x.pow(2.0).sum().backward()),
                         r"node 1 \(PowBackward0 #\d+\): saved exponent changed from 2 \(an int\) to 2\.0 \(a float\)"),
    "saved sizes": (_twice(lambda: _x.sum().backward(), lambda: _column.sum().backward()),
                    r"node 0 \(SumBackward0 #\d+\): a size changed: saved self_sym_sizes holds 2 sizes now, "
                    r"1 size before"),
    "rank": (_twice(lambda: (_x * 2).sum().backward(), lambda: (_x.view(1, 3) * 2).sum().backward()),
             r"node 2 is now ViewBackward0 #\d+ instead of AccumulateGrad \(4 nodes now, 3 before\)"),
    "edge": (_twice(lambda: (_x * _y.detach()).sum().backward(), lambda: (_x * _y).sum().backward()),
             r"node 1 \(MulBackward0 #\d+\): its gradient for input 1 is needed now \(it goes to node 3 "
             r"\(AccumulateGrad #leaf\)\), before it was not"),
    "root gradient": (_twice(lambda: (_x * 2).sum().backward(), lambda: (_x.double() * 2).sum().backward()),
                      r"the gradient of root 0 is float64 now, float32 before"),
    "hooks": (_twice(lambda: (_x * 2).sum().backward(), _hooked),
              r"node 1 \(MulBackward0 #\d+\): it has hooks now: 1 tensor hook; none before"),
    "inputs": (_twice(lambda: (_x * _y).sum().backward(), lambda: torch.autograd.grad((_x * _y).sum(), [_x])),
               r"the backward now computes the gradients of 1 input \(autograd\.grad or backward\(inputs=\.\.\.\)\); "
               r"before, of every leaf"),
    "create_graph": (_twice(lambda: torch.autograd.grad((_x * _x).sum(), [_x]),
                            lambda: torch.autograd.grad((_x * _x).sum(), [_x], create_graph=True)),
                     r"create_graph=True now, False before"),
    "saved-tensor hooks": (_twice(lambda: (_x * _y).sum().backward(), _saved_under_hooks),
                           r"node 1 \(MulBackward0 #\d+\): its saved tensors are under saved-tensor hooks now"),
    "ctx": (_twice(lambda: _TracedScale.apply(_x, 2.0).sum().backward(),
                   lambda: _TracedScale.apply(_x, 3.0).sum().backward()),
            r"node 1 \(_ScaleBackward #\d+\): ctx\.s changed from 2\.0 to 3\.0"),
    "same graph, another block": ([(lambda: (_x * 2).sum().backward(), {}),
                                   (lambda: (_x * 2).sum().backward(), {"backend": "aot_eager"})],
                                  r"the autograd graph is the one captured last; the block differs"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_new_structure_says_what_changed_in_words(caplog, case):
    steps, expected = _CASES[case]
    logged = _logged(caplog, steps)
    assert len(logged) == 1, logged
    assert re.fullmatch(r"gradfx: new structure \(vs the last capture\): " + expected + r".*", logged[0]), logged[0]
    assert "<class" not in logged[0] and "((" not in logged[0]  # no key items as Python reprs


def test_new_structure_without_words_still_names_the_node(caplog, monkeypatch):
    # A key item this code cannot read: the generic line, still readable.
    monkeypatch.setattr(explain, "structure_change", lambda *a: 1 / 0)
    logged = _logged(caplog, _twice(lambda: _x.pow(2.0).sum().backward(), lambda: _x.pow(3.0).sum().backward()))
    assert len(logged) == 1
    assert re.fullmatch(r"gradfx: new structure \(vs the last capture\): at node 1 \(PowBackward0 #\d+\): "
                        r"'2\.0' -> '3\.0'", logged[0]), logged[0]


def _batches(*batches):
    lin = nn.Linear(16, 4)
    return [(lambda b=b: lin(torch.randn(b, 16)).sum().backward(), {}) for b in batches]


def test_recapture_groups_the_sizes_that_changed(caplog):
    logged = _logged(caplog, _batches(24, 37), word="recapture")
    assert len(logged) == 1, logged
    assert re.search(r"; 4 sizes changed 24 -> 37 \(SumBackward0 #\d+ saved self_sym_sizes\[0\], gradient 0 of "
                     r"AddmmBackward0 #\d+ dim 0, AddmmBackward0 #\d+ saved mat1_sym_sizes\[0\] and 1 more\) "
                     r"\(static so far: dynamic='auto' makes the sizes that changed symbolic",
                     logged[0]), logged[0]


@pytest.mark.parametrize("dynamic, symbolic, note", [
    ("auto", False, "(static so far: dynamic='auto' makes the sizes that changed symbolic from this capture on, "
                    "except sizes of 0 or 1)"),
    ("auto", True, "(symbolic already: the new sizes fail a guard of the graph, such as a size of 0 or 1)"),
    (False, False, "(static: under dynamic=False each new size is a new capture)"),
    (None, False, ""),
])
def test_size_change_says_what_the_capture_does_with_them(caplog, monkeypatch, dynamic, symbolic, note):
    seen = []
    size_change = explain.size_change

    def spy(call, old_sizes, **kw):
        changed = [p for p, (a, b) in enumerate(zip(old_sizes, call.sizes)) if a != b]
        seen.append(size_change(call, old_sizes, dynamic=dynamic, symbolic=changed if symbolic else ()))
        return size_change(call, old_sizes, **kw)
    monkeypatch.setattr(explain, "size_change", spy)
    _logged(caplog, _batches(24, 37), word="recapture")
    assert len(seen) == 1
    assert seen[0].startswith("4 sizes changed 24 -> 37 (") and seen[0].endswith(")" + (" " + note if note else ""))


# -- the note on an error raised while a graph runs -----------------------------------

def _raising_hook(grad):
    raise ValueError("the hook refused")


class _Hooks:
    def pre(self, grads):
        raise ValueError("the pre-hook refused")


def _notes(run, backend="eager", names=None):
    gradfx.reset()
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with pytest.raises(Exception) as raised:
        loss = run(lin, x)
        with gradfx.compiled_autograd(backend=backend, names=lin if names else None):
            loss.backward()
    return getattr(raised.value, "__notes__", [])


def test_a_raising_hook_on_a_named_leaf_names_the_leaf_and_the_hook():
    def run(lin, x):
        lin.weight.register_hook(_raising_hook)
        return lin(x).sum()
    assert _notes(run, names=True) == [
        f"gradfx: raised in the tensor hook {__name__}._raising_hook of leaf 'weight' "
        "(AccumulateGrad #leaf, graph node call_tensor_hook)"]


def test_a_raising_hook_on_an_unnamed_leaf_gives_its_shape():
    def run(lin, x):
        lin.weight.register_hook(_raising_hook)
        return lin(x).sum()
    assert _notes(run) == [
        f"gradfx: raised in the tensor hook {__name__}._raising_hook of a leaf of shape [2, 3] "
        "(AccumulateGrad #leaf, graph node call_tensor_hook)"]


def test_a_raising_hook_on_a_non_leaf_and_a_pre_hook_by_qualified_name():
    def on_output(lin, x):
        h = lin(x)
        h.register_hook(_raising_hook)
        return (h * 2).sum()
    [note] = _unnumbered(_notes(on_output))
    assert note == (f"gradfx: raised in the tensor hook {__name__}._raising_hook of a tensor of shape [4, 2] "
                    "(its gradient goes into AddmmBackward0 #; graph node call_tensor_hook)")

    def pre(lin, x):
        h = lin(x) * 2
        h.grad_fn.register_prehook(_Hooks().pre)
        return h.sum()
    assert _unnumbered(_notes(pre)) == [
        f"gradfx: raised in the pre-hook {__name__}._Hooks.pre of MulBackward0 # (graph node call_pre_hook)"]


def my_backend(gm, example_inputs):
    def compiled(*args):
        raise RuntimeError("compiled code failed")
    return compiled


def returns_the_graph(gm, example_inputs):
    return gm


def test_a_compiled_callable_that_raises_names_its_backend():
    assert _notes(lambda lin, x: lin(x).sum(), backend=my_backend) == [
        "gradfx: raised in the graph compiled by backend 'my_backend'"]

    def run(lin, x):
        lin.weight.register_hook(_raising_hook)
        return lin(x).sum()
    assert _notes(run, backend=returns_the_graph) == [
        f"gradfx: raised in the tensor hook {__name__}._raising_hook of a leaf of shape [2, 3] "
        "(AccumulateGrad #leaf, graph node call_tensor_hook), in the graph compiled by backend 'returns_the_graph'"]


def test_a_builtin_node_that_raises_keeps_its_note():
    """The eager backend: the node's note alone, as before (no backend named)."""
    def run(lin, x):
        h = lin(x)
        h.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0].view(-1, 7),) + grad_inputs[1:])
        return h.sum()
    notes = _notes(run)
    assert len(notes) == 1 and "backend" not in notes[0], notes


def test_hooks_in_words_tell_ddps_python_reducer_hooks():
    """The key records, per post-accumulate-grad hook, whether it is DDP's Python-reducer
    hook on a DDP without comm hooks: a comm hook registered since changes the structure,
    and the words say which hooks were DDP's."""
    from gradfx.capture.graph.kinds import HookSpec
    from gradfx.capture.view import explain
    alone = HookSpec(post_accumulate=[3, 4], post_accumulate_alone=(True, False), native_post=True).key()
    assert explain._hooks(alone) == ("2 post-accumulate-grad hooks, 1 of them DDP's Python-reducer hook (its DDP "
                                     "has no comm hook), C++ post-hooks (DDP's reducer)")
    comm_hooked = HookSpec(post_accumulate=[3, 4], post_accumulate_alone=(False, False), native_post=True).key()
    assert explain._hooks(comm_hooked) == "2 post-accumulate-grad hooks, C++ post-hooks (DDP's reducer)"
