"""The self-check: a torch whose internals behave otherwise falls back, never a wrong gradient."""

from __future__ import annotations

import warnings

import pytest
import torch

import gradfx
from gradfx.capture import torch_releases
from gradfx.capture.graph import fast_walk, hooks
from gradfx.capture.run import cache as cache_module
from gradfx.capture.run import self_check, session


@pytest.fixture
def fresh_check(monkeypatch):
    """The self-check runs again (as in a new process); the real verdict comes back after."""
    monkeypatch.setattr(self_check, "verdict", None)
    monkeypatch.setattr(session, "_warned_in_process", set())
    gradfx.reset()
    yield
    gradfx.reset()


def _nonleaf_hook_program():
    x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: g * 10)
    return x, y.sum()


def test_this_release_passes_its_self_check(fresh_check):
    assert torch_releases.TESTED_RELEASE
    assert self_check.refusal() is None


def test_the_probes_leave_no_trace(fresh_check):
    model = torch.nn.Linear(3, 2)
    with gradfx.compiled_autograd() as block:
        model(torch.randn(4, 3)).sum().backward()  # the self-check runs inside this block
    assert block.stats["captures"] == 1 and block.stats["fallbacks"] == 0
    assert gradfx.stats()["captures"] == 1
    assert len(cache_module.cache) == 1 and len(fast_walk.walkers) == 1
    assert [g for g in block.graphs] == block.graphs[:1]


def test_a_broken_internal_falls_back_with_one_warning(fresh_check, monkeypatch):
    # What torch 2.11 did to gradfx before torch_releases knew of it: the hooks of a
    # non-leaf tensor are no longer found by its node, so they would be skipped.
    monkeypatch.setattr(hooks, "node_token", lambda node: id(object()))
    expected_x, expected_loss = _nonleaf_hook_program()
    expected_loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            x, loss = _nonleaf_hook_program()
            with gradfx.compiled_autograd() as block:
                loss.backward()
            assert torch.equal(x.grad, expected_x.grad)  # 20s: the hook ran, on the eager engine
            assert block.stats["fallbacks"] == 1 and block.stats["captures"] == 0
    messages = [str(w.message) for w in caught if issubclass(w.category, gradfx.FallbackWarning)]
    assert len(messages) == 1, messages  # once for the process, not per block
    assert f"torch {torch.__version__}" in messages[0] and "probe 'hooks'" in messages[0]
    assert "hook of y" in messages[0]  # what differed

    x, loss = _nonleaf_hook_program()
    with pytest.raises(gradfx.Unsupported, match="self-check"):
        with gradfx.compiled_autograd(strict=True):
            loss.backward()
    assert x.grad is None  # nothing ran
    with pytest.raises(gradfx.Unsupported, match="self-check"):
        gradfx.capture(loss)


def test_an_untested_release_falls_back(fresh_check, monkeypatch):
    monkeypatch.setattr(torch_releases, "TESTED_RELEASE", False)
    monkeypatch.delenv("GRADFX_ALLOW_UNTESTED_TORCH", raising=False)
    reason = self_check.refusal()
    assert reason is not None and "not a release gradfx was tested on" in reason
    assert "2.11, 2.12, 2.13, 2.14" in reason and torch.__version__ in reason
    x, loss = _nonleaf_hook_program()
    with pytest.warns(gradfx.FallbackWarning, match="not a release gradfx was tested on"):
        with gradfx.compiled_autograd():
            loss.backward()
    assert torch.equal(x.grad, torch.full((3,), 20.0))


def test_an_untested_release_may_be_allowed_where_its_probes_agree(fresh_check, monkeypatch):
    monkeypatch.setattr(torch_releases, "TESTED_RELEASE", False)
    monkeypatch.setenv("GRADFX_ALLOW_UNTESTED_TORCH", "1")
    assert self_check.refusal() is None


def test_node_objects_that_do_not_persist_keep_their_hooks(monkeypatch):
    # torch 2.11 and 2.12 make a new Python object per access of a node once the last
    # is gone: the hooks of a non-leaf whose grad_fn object was dropped must be found.
    monkeypatch.setattr(torch_releases, "NODE_OBJECT_PERSISTS", False)
    grads = []
    for run in (lambda f: f(), _in_block):
        x = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
        y = x * 2
        y.register_hook(lambda g: g * 10)
        junk = [object() for _ in range(100)]  # noqa: F841  (reuses the dropped object's memory)
        run((y * y).sum().backward)
        grads.append(x.grad)
    assert torch.equal(grads[0], grads[1])


def _in_block(fn):
    with gradfx.compiled_autograd() as block:
        fn()
    assert block.stats["captures"] == 1


def test_the_callers_thread_state_does_not_enter_the_probes(fresh_check):
    # The first capture may come under no_grad, inference mode's exit, saved-tensor
    # hooks or autocast of the caller: the probes run on their own thread.
    model = torch.nn.Linear(3, 2)
    loss = model(torch.randn(4, 3)).sum()
    with torch.no_grad(), torch.autograd.graph.save_on_cpu(), torch.autocast("cpu"):
        with gradfx.compiled_autograd() as block:
            loss.backward()
    assert block.stats["captures"] == 1 and self_check.refusal() is None


def test_under_anomaly_mode_the_check_waits_for_a_later_capture(fresh_check):
    loss = torch.nn.Linear(3, 2)(torch.randn(4, 3)).sum()
    with torch.autograd.detect_anomaly(), pytest.warns(gradfx.FallbackWarning, match="anomaly"):
        with gradfx.compiled_autograd():
            loss.backward()
    assert self_check.verdict is None
    assert self_check.refusal() is None and self_check.verdict == ""


def test_the_post_accumulate_probe_walks_in_one_call(fresh_check, monkeypatch):
    """The probe of post-accumulate-grad hooks reaches the one-call walk (program.cpp reads
    the leaves' hook dicts there), and a wrong read of them fails the check."""
    from gradfx.capture import native
    from gradfx.capture.graph import walk_program
    if native.module() is None:
        pytest.skip(f"no compiled part: {native.reason()}")
    for registry in ("_tensor_pre", "_retained", "_node_dicts"):  # other tests' live graphs' hooks
        monkeypatch.setattr(hooks, registry, {})  # would keep every walk on the lines
    answered = []
    real = native.module().program

    def program(*args):
        found = real(*args)
        answered.append(found is not None)
        return found
    monkeypatch.setattr(native.module(), "program", program)
    assert self_check.refusal() is None
    assert sum(answered) >= 2  # the probe's two hits, each walked in one call

    monkeypatch.setattr(self_check, "verdict", None)
    gradfx.reset()
    monkeypatch.setattr(walk_program, "HOOK_INPUT", walk_program.LEAF_INPUT)  # the leaf where its hooks go
    assert "probe 'post-accumulate-grad hooks'" in (self_check.refusal() or "")
