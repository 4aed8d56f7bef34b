"""gradfx on CUDA.

Three parts, by what the machine has:

* streams (every machine, stub metadata): a CUDA node's input metadata records the
  stream its forward ran on, and eager runs the node there; gradfx runs the graph on
  the caller's current stream, so the walk and the generated walker refuse a CUDA
  node whose stream is not that one, or whose stream cannot be read (torch 2.11 and
  2.13 do not expose it) unless ``kinds.assume_current_stream`` is set.  CPU
  metadata is never looked at;
* fake CUDA (a CUDA build of torch, no GPU needed): a graph of FakeTensors made with
  ``device="cuda"`` can be built and its metadata walked; gradfx refuses FakeTensor
  (a tensor subclass) as a live graph.  On a CPU build of torch these skip: making a
  fake CUDA tensor that requires grad aborts the process there (the autograd node
  records the stream of a device the build has no support for);
* real GPU (marked ``cuda``, skipped without one): the eager backend bitwise equal to
  eager (MLP, transformer with dropout, channels_last CNN, autocast with GradScaler,
  mixed devices, non_blocking copies, hooks), peak memory, side streams, inductor.
  These run with ``assume_current_stream`` (their forwards run on the current
  stream), except the ones about refusing.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import gradfx
from gradfx.capture import native
from gradfx.capture.errors import _Fallback
from gradfx.capture.graph import fast_walk, kinds
from gradfx.capture.run import session as session_module
from helpers import assert_same, grads_of, run_both, snap

CUDA = torch.cuda.is_available()
CUDA_BUILD = torch.backends.cuda.is_built()
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
fake_cuda = pytest.mark.skipif(not CUDA_BUILD, reason="a CPU build of torch cannot make a fake CUDA tensor "
                                                      "that requires grad (the process aborts)")


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield
    gradfx.reset()


@pytest.fixture
def assume_streams(monkeypatch):
    """The program's promise: its forwards ran on the stream current at backward()."""
    monkeypatch.setattr(kinds, "assume_current_stream", True)


@pytest.fixture
def warned_afresh(monkeypatch):
    """Fallback warnings that are warned once per process are warned again."""
    monkeypatch.setattr(session_module, "_warned_in_process", set())


# -- streams, on stub metadata -------------------------------------------------------

class _Meta:
    """What the walk reads of an InputMetadata; ``stream`` only where given."""

    def __init__(self, device, shape=(2, 3), dtype=torch.float32, **stream):
        self.device = torch.device(device)
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.__dict__.update(stream)


class _Node:
    def __init__(self, *metas):
        self._input_metadata = list(metas)


class _Stream:
    def __init__(self, stream_id, device_index=0):
        self.stream_id, self.device_index = stream_id, device_index


class _NoStreamRead:
    """A CPU metadata whose stream must never be read."""

    device = torch.device("cpu")
    shape = torch.Size((4,))
    dtype = torch.float32

    @property
    def stream(self):
        raise AssertionError("the stream of CPU metadata was read")


def _backward(loss, engine, *args):
    """``loss.backward(*args)`` on the eager engine (``engine`` None), else in a strict gradfx
    block of that backend that must not fall back."""
    if engine is None:
        loss.backward(*args)
        return
    with gradfx.compiled_autograd(engine, strict=True) as session:
        loss.backward(*args)
    assert session.stats["fallbacks"] == 0


def _walk_metas(node):
    w = kinds.Walk([], {})
    kinds.walk_metas(w, kinds.NodeRecord(kinds.TRACED, (), 0, True), node)
    return w


def _generated_metas(node):
    """The generated walker's metadata checks for ``node``, as a function of a live node:
    Python's lines (a stub node has no C++ metadata for the compiled part to read; the
    compiled part leaves CUDA metadata to those lines too)."""
    src = fast_walk._Source()
    kept = native._state.module, native._state.reason
    native._state.module, native._state.reason = None, "Python's lines, for a stub node"
    try:
        kinds.emit_metas(src, "n0", node)
    finally:
        native._state.module, native._state.reason = kept
    code = "def check(n0):\n    sizes = []\n" + "\n".join(src.lines) + "\n    return sizes\n"
    namespace = dict(src.consts, stream_ok=kinds.stream_ok)
    exec(compile(code, "<test walker>", "exec"), namespace)
    return namespace["check"], code


def test_cpu_metadata_is_never_checked_for_a_stream():
    node = _Node(_NoStreamRead(), _NoStreamRead())
    w = _walk_metas(node)
    assert w.sizes == [4, 4] and w.key == [((1, torch.float32, torch.device("cpu")),) * 2]
    check, code = _generated_metas(node)
    assert "stream" not in code  # the generated code of a CPU graph is what it was
    assert check(node) == [4, 4]


def test_unreadable_stream_refuses_cuda_metadata(monkeypatch):
    node = _Node(_Meta("cpu"), _Meta("cuda:0"))
    with pytest.raises(_Fallback, match="does not say which stream") as refused:
        _walk_metas(node)
    assert "assume_current_stream" in refused.value.reason and refused.value.process_wide
    monkeypatch.setattr(kinds, "assume_current_stream", True)
    w = _walk_metas(node)
    assert w.key == [((2, torch.float32, torch.device("cpu")), (2, torch.float32, torch.device("cuda:0")))]


def test_generated_walker_makes_the_same_check(monkeypatch):
    node = _Node(_Meta("cuda:0", shape=(5,)))
    check, code = _generated_metas(node)
    assert "assume_current_stream" in code
    assert check(node) is None  # a miss: the generic walk says why
    monkeypatch.setattr(kinds, "assume_current_stream", True)
    assert check(node) == [5]  # read when it runs, not when it was generated
    monkeypatch.setattr(kinds, "assume_current_stream", False)
    assert check(node) is None


def test_readable_stream_must_be_the_current_one(monkeypatch):
    # A release that exposes InputMetadata.stream: compared with the current stream.
    current = {0: _Stream(3)}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[torch.device(device).index])
    same = _Node(_Meta("cuda:0", stream=_Stream(3)))
    other = _Node(_Meta("cuda:0", stream=_Stream(7)))
    assert _walk_metas(same).sizes == [2, 3]
    with pytest.raises(_Fallback, match="ran on CUDA stream 7, not the caller's current stream 3") as refused:
        _walk_metas(other)
    assert not refused.value.process_wide
    check, code = _generated_metas(same)
    assert "stream_ok(mk)" in code
    assert check(same) == [2, 3] and check(other) is None
    current[0] = _Stream(7)  # the caller moved to the forward's stream
    assert check(other) == [2, 3] and check(same) is None


# -- fake CUDA tensors (a CUDA build, no GPU) ----------------------------------------

def _fake_graph():
    w = torch.randn(4, 3, device="cuda", requires_grad=True)
    x = torch.randn(5, 4, device="cuda")
    return w, (x @ w).relu().sum()


@fake_cuda
def test_fake_cuda_graph_metadata_walks_with_its_device(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=False):
        w, loss = _fake_graph()
        root = loss.grad_fn
        with pytest.raises(_Fallback, match="does not say which stream"):
            _walk_metas(root)
        check, code = _generated_metas(root)
        assert check(root) is None
        monkeypatch.setattr(kinds, "assume_current_stream", True)
        assert _walk_metas(root).key == [((0, torch.float32, torch.device("cuda", 0)),)]
        assert check(root) == []
        mm = root.next_functions[0][0].next_functions[0][0]
        assert [m.device.type for m in mm._input_metadata] == ["cuda"]


@fake_cuda
def test_fake_cuda_graph_is_not_a_live_graph_for_gradfx(assume_streams):
    # capture() refuses a tensor subclass; a backward of fake tensors is torch's own
    # (AOTAutograd traces joint graphs so): a gradfx block passes it to the engine.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from gradfx.capture.run import routing
    with FakeTensorMode(allow_non_fake_inputs=False):
        w, loss = _fake_graph()
        with pytest.raises(gradfx.Unsupported, match="tensor subclass \\(FakeTensor\\)"):
            gradfx.capture(loss)
        assert routing.torch_internal((loss,))
    assert routing.torch_internal((loss,))
    assert w.grad is None


# -- real GPU ------------------------------------------------------------------------

@pytest.fixture
def deterministic():
    """Deterministic kernels (cuDNN's, scatter-like ops'), so bitwise equality means
    the same computation; restored after."""
    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deterministic.*")
        yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


def _train_both(make_model, make_inputs, loss_fn=lambda out: out.float().pow(2).mean(), *, backend="eager",
                steps=3, exact=True, memory_format=None):
    """Eager and gradfx (strict: no fallback) from the same weights, inputs and seeds;
    the gradients after every step compared.  Returns the last session."""
    torch.manual_seed(0)
    eager_model = make_model().cuda()
    if memory_format is not None:
        eager_model = eager_model.to(memory_format=memory_format)
    gfx_model = copy.deepcopy(eager_model)
    session = None
    for step in range(steps):
        torch.manual_seed(100 + step)
        inputs = make_inputs()
        for model, engine in ((eager_model, None), (gfx_model, backend)):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(7 + step)  # dropout's masks: the same in both
            loss = loss_fn(model(*inputs))
            if engine is None:
                loss.backward()
            else:
                with gradfx.compiled_autograd(engine, strict=True) as session:
                    loss.backward()
        torch.cuda.synchronize()
        assert session.stats["fallbacks"] == 0, session.stats
        assert_same(grads_of(eager_model.parameters()), grads_of(gfx_model.parameters()), exact)
    return session


def _devices(graph) -> set:
    """The device types of the tensors a captured graph computes with."""
    return {n.meta["val"].device.type for n in graph.graph_module.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)}


def _mlp(width=64, depth=4):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def _cnn():
    def block(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
    return nn.Sequential(block(3, 16, 1), block(16, 32, 2), block(32, 32, 1), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(32, 10))


@pytest.mark.cuda
@needs_gpu
def test_cuda_graphs_are_refused_where_streams_cannot_be_read(warned_afresh):
    if hasattr(torch.randn(1, device="cuda", requires_grad=True).mul(2).grad_fn._input_metadata[0], "stream"):
        pytest.skip("this release exposes the stream: test_side_stream_forward_falls_back covers it")
    model = _mlp().cuda()
    x = torch.randn(16, 64, device="cuda")
    with pytest.raises(gradfx.Unsupported, match="does not say which stream"):
        with gradfx.compiled_autograd(strict=True):
            model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    expected = grads_of(model.parameters())
    model.zero_grad(set_to_none=True)
    with pytest.warns(gradfx.FallbackWarning, match="does not say which stream"):
        with gradfx.compiled_autograd() as session:
            model(x).sum().backward()
    assert session.stats["fallbacks"] == 1
    assert_same(expected, grads_of(model.parameters()))


@pytest.mark.cuda
@needs_gpu
def test_mlp_bitwise(assume_streams, deterministic):
    _train_both(_mlp, lambda: (torch.randn(32, 64, device="cuda"),))


@pytest.mark.cuda
@needs_gpu
def test_capture_places_the_graph_on_cuda(assume_streams):
    model = _mlp().cuda()
    loss = model(torch.randn(8, 64, device="cuda")).sum()
    assert _devices(gradfx.capture(loss)) == {"cuda"}
    loss.backward()  # capture left the graph as it was
    assert all(p.grad.device.type == "cuda" for p in model.parameters())


@pytest.mark.cuda
@needs_gpu
def test_transformer_with_dropout_bitwise(assume_streams, deterministic):
    _train_both(lambda: nn.TransformerEncoderLayer(64, 4, 128, dropout=0.1, batch_first=True),
                lambda: (torch.randn(4, 12, 64, device="cuda"),))


@pytest.mark.cuda
@needs_gpu
def test_channels_last_cnn_bitwise(assume_streams, deterministic):
    _train_both(_cnn, lambda: (torch.randn(4, 3, 16, 16, device="cuda").to(memory_format=torch.channels_last),),
                memory_format=torch.channels_last)


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("init_scale", [2.0 ** 16, 2.0 ** 60], ids=["finite", "overflow"])
def test_autocast_with_grad_scaler_bitwise(dtype, init_scale, assume_streams, deterministic):
    torch.manual_seed(0)
    eager_model = _mlp().cuda()
    gfx_model = copy.deepcopy(eager_model)

    def train(model, engine):
        """Per step: (unscaled grads, inf found, scale after update, parameters after the step)."""
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cuda", init_scale=init_scale)
        steps = []
        for step in range(2):
            torch.manual_seed(step)
            x = torch.randn(16, 64, device="cuda")
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=dtype):
                loss = model(x).float().pow(2).mean()
            _backward(scaler.scale(loss), engine)
            scaler.unscale_(opt)
            found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
            grads = grads_of(model.parameters())
            scaler.step(opt)  # skipped where an inf was found
            scaler.update()
            steps.append((grads, found, scaler.get_scale(), [snap(p) for p in model.parameters()]))
        return steps
    eager, gfx = train(eager_model, None), train(gfx_model, "eager")
    if dtype is torch.float16 and init_scale > 2.0 ** 40:
        assert eager[0][1] == 1.0  # the overflow was found, the step skipped
    for (eg, ef, es, ep), (gg, gf, gs, gp) in zip(eager, gfx):
        assert (ef, es) == (gf, gs)
        assert_same(eg, gg)
        assert_same(ep, gp)


@pytest.mark.cuda
@needs_gpu
def test_mixed_devices_bitwise(assume_streams, deterministic):
    def loss_fn(out):
        on_cpu = out.to("cpu")
        return (on_cpu * torch.tensor(0.5)).pow(2).sum() + (out * torch.tensor(2.0)).mean().cpu()
    _train_both(_mlp, lambda: (torch.randn(16, 64, device="cuda"),), loss_fn)
    model = _mlp().cuda()
    assert _devices(gradfx.capture(loss_fn(model(torch.randn(4, 64, device="cuda"))))) == {"cpu", "cuda"}


@pytest.mark.cuda
@needs_gpu
def test_non_blocking_copies_bitwise(assume_streams, deterministic):
    torch.manual_seed(0)
    results = []
    for engine in (None, "eager"):
        torch.manual_seed(0)
        model = _mlp(32, 2).cuda()
        w = torch.randn(32, 32).pin_memory().requires_grad_()  # a pinned CPU leaf
        for step in range(2):
            torch.manual_seed(10 + step)
            x = torch.randn(8, 32).pin_memory()
            out = model(x.to("cuda", non_blocking=True) @ w.to("cuda", non_blocking=True))
            host = out.to("cpu", non_blocking=True)
            torch.cuda.synchronize()
            loss = host.pow(2).sum()
            _backward(loss, engine)
            torch.cuda.synchronize()
        results.append(grads_of([w, *model.parameters()]))
    assert results[0][0].device.type == "cpu"
    assert_same(results[0], results[1])


@pytest.mark.cuda
@needs_gpu
def test_hooks_count_and_order(assume_streams, deterministic):
    def build(log):
        model = _mlp(32, 2).cuda()
        params = list(model.parameters())
        model[0].register_full_backward_hook(lambda m, gi, go: log.append(("module0", snap(go))))
        for k, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda p, k=k: log.append((f"acc{k}", snap(p.grad))))

        def step():
            h = model[0](torch.randn(8, 32, device="cuda"))
            h.register_hook(lambda g: log.append(("h", snap(g))))
            h.retain_grad()
            out = model[1:](h)
            out.register_hook(lambda g: g * 3)
            out.pow(2).sum().backward()
            log.append(("h.grad", snap(h.grad)))
        return params, step
    log = run_both(build)
    names = [entry[0] for entry in log]
    assert names.count("h") == 3 and names.count("module0") == 3 and names.count("acc0") == 3


@pytest.mark.cuda
@needs_gpu
def test_peak_memory_within_two_percent_of_eager(assume_streams):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(2048, 2048), nn.GELU()) for _ in range(6)]).cuda()
    x = torch.randn(2048, 2048, device="cuda")

    def peak(engine):
        model.zero_grad(set_to_none=True)
        loss = model(x).pow(2).mean()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        if engine is None:
            loss.backward()
        else:
            with gradfx.compiled_autograd(engine, strict=True):
                loss.backward()
        torch.cuda.synchronize()
        del loss
        return torch.cuda.max_memory_allocated()
    peak("eager")  # the capture
    eager, gfx = peak(None), peak("eager")
    assert gfx <= 1.02 * eager, (gfx / 2**20, eager / 2**20)


def _on_a_side_stream():
    """An MLP, its input and a side stream: (model, x, side)."""
    torch.manual_seed(0)
    return _mlp().cuda(), torch.randn(16, 64, device="cuda"), torch.cuda.Stream()


@pytest.mark.cuda
@needs_gpu
def test_side_stream_forward_falls_back(warned_afresh, deterministic):
    model, x, side = _on_a_side_stream()

    def forward():
        model.zero_grad(set_to_none=True)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            loss = model(x).pow(2).mean()
        torch.cuda.current_stream().wait_stream(side)
        return loss
    forward().backward()
    torch.cuda.synchronize()
    expected = grads_of(model.parameters())
    loss = forward()
    with pytest.warns(gradfx.FallbackWarning, match="stream"):
        with gradfx.compiled_autograd() as session:
            loss.backward()
    torch.cuda.synchronize()
    assert session.stats["fallbacks"] == 1
    assert_same(expected, grads_of(model.parameters()))


@pytest.mark.cuda
@needs_gpu
def test_forward_and_backward_on_one_side_stream_are_exact(assume_streams, deterministic):
    # The promise holds: the forward ran on the stream current at backward(), a side one.
    model, x, side = _on_a_side_stream()
    side.wait_stream(torch.cuda.current_stream())
    grads = []
    for engine in (None, "eager", "eager"):
        model.zero_grad(set_to_none=True)
        with torch.cuda.stream(side):
            loss = model(x).pow(2).mean()
            _backward(loss, engine)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        grads.append(grads_of(model.parameters()))
    assert_same(grads[0], grads[1])
    assert_same(grads[0], grads[2])


@pytest.mark.cuda
@needs_gpu
def test_inductor_allclose(assume_streams):
    session = _train_both(_mlp, lambda: (torch.randn(32, 64, device="cuda"),), backend="inductor", exact=False)
    assert session.stats["fallbacks"] == 0
