"""Guard text: what each symbol is, in a compact form when there are many."""

import re

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
