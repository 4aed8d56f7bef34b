"""Built-in and user backends: correct results, one compile per structure, failures handled."""

import math
import warnings

import pytest
import torch
import torch.nn as nn

import gradfx
from helpers import compare_training


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4))


def test_aot_eager_backend():
    compare_training(mlp, lambda: (torch.randn(8, 16),), backend="aot_eager", exact=False)


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        h = self.net[0](x)
        h.register_hook(lambda g: g * 2)
        return self.net[3](self.net[2](self.net[1](h)))


def test_aot_eager_with_hooks():
    compare_training(Hooked, lambda: (torch.randn(8, 16),), backend="aot_eager", exact=False)


@pytest.mark.slow
@pytest.mark.parametrize("make, shape", [
    pytest.param(mlp, (8, 16), marks=pytest.mark.sample),
    (lambda: nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 1,
                                   enable_nested_tensor=False), (2, 5, 16)),
])
def test_inductor_backend(make, shape):
    compare_training(make, lambda: (torch.randn(*shape),), backend="inductor", exact=False)


@pytest.mark.slow
def test_inductor_dynamic_shapes():
    torch.manual_seed(0)
    model = mlp()
    for b in (4, 6, 7):
        x = torch.randn(b, 16)
        model.zero_grad()
        model(x).sum().backward()
        expected = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        with gradfx.compiled_autograd(backend="inductor"):
            model(x).sum().backward()
        for p, e in zip(model.parameters(), expected):
            torch.testing.assert_close(p.grad, e)
    assert gradfx.stats()["captures"] == 2
    # batch 7 hits the dynamic graph of batch 6, whose regions inductor compiled for all sizes
    assert gradfx.stats()["cache_hits"] == 1 and gradfx.stats()["recompiles"] == 0


def test_backend_recompiles_on_a_cache_hit_are_counted_and_logged(caplog):
    """A backend that compiles code per shape (its compile function takes no ``dynamic``):
    a dynamic graph met with new sizes is a cache hit for gradfx and a recompile for the
    backend."""
    from gradfx.backends import builtin
    per_shape = builtin._split_backend("per_shape", lambda gm, examples: builtin._aot_eager_compile(gm, examples))
    torch.manual_seed(0)
    model = mlp()
    with caplog.at_level("INFO", logger="gradfx"):
        with gradfx.compiled_autograd(backend=per_shape, dynamic=True) as outer:
            model(torch.randn(4, 16)).sum().backward()
            model(torch.randn(4, 16)).sum().backward()
            with gradfx.compiled_autograd(backend=per_shape, dynamic=True) as inner:
                model(torch.randn(6, 16)).sum().backward()
            model(torch.randn(6, 16)).sum().backward()
    assert outer.stats["captures"] == 1 and outer.stats["cache_hits"] == 2 and outer.stats["recompiles"] == 0
    assert inner.stats["cache_hits"] == 1 and inner.stats["recompiles"] == 1  # counted where it ran
    assert gradfx.stats()["recompiles"] == 1 and gradfx.stats()["compiles"] == 1
    logged = [r.getMessage() for r in caplog.records if "recompiled" in r.getMessage()]
    assert len(logged) == 1 and "per_shape" in logged[0] and "fx nodes" in logged[0] and " s " in logged[0]


def test_debug_backend_matches_and_names_bad_values():
    compare_training(mlp, lambda: (torch.randn(8, 16),), backend="debug")
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    x[0, 0] = math.inf
    with gradfx.compiled_autograd(backend="debug"):
        with pytest.raises(RuntimeError, match=r"debug backend: Function '.*Backward0 #\d+' returned (nan|inf)"):
            lin(x).sum().backward()


def test_user_backend_counts_one_compile_for_three_iterations():
    calls = []

    def counting(gm, example_inputs):
        calls.append(len(gm.graph.nodes))
        return gm
    compare_training(mlp, lambda: (torch.randn(8, 16),), backend=counting)
    assert len(calls) == 1


def test_runtime_error_names_the_autograd_node_and_keeps_its_type():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            raise ValueError("backward failed")

    lin = nn.Linear(3, 3)
    with gradfx.compiled_autograd():
        with pytest.raises(ValueError) as err:
            Boom.apply(lin(torch.randn(2, 3))).sum().backward()
    assert any("BoomBackward" in note for note in getattr(err.value, "__notes__", []))
    # Nothing was accumulated before the failing node: no .grad half-written.
    assert lin.weight.grad is None and lin.bias.grad is None


def test_entry_point_backends_are_listed(monkeypatch):
    import importlib.metadata as md
    from gradfx.backends import registry

    class EP:
        name = "from_plugin"

        def load(self):
            return lambda gm, ex: gm
    monkeypatch.setattr(md, "entry_points", lambda group=None: [EP()] if group == "gradfx.backends" else [])
    monkeypatch.setattr(registry, "_entry_points_loaded", False)
    assert "from_plugin" in gradfx.list_backends()
    lin = nn.Linear(2, 2)
    with gradfx.compiled_autograd(backend="from_plugin"):
        lin(torch.randn(1, 2)).sum().backward()
    assert lin.weight.grad is not None


@pytest.mark.parametrize("user_turned_it_off", [False, True])
def test_garbage_collector_pauses_during_a_capture_only(user_turned_it_off):
    """A capture runs with Python's cyclic collector off (its full passes over a heap of
    sympy and fake-tensor objects cost a quarter of a recapture); it is back on afterwards,
    also when the capture fails, and stays off if the user had turned it off."""
    import gc
    seen = []

    def backend(gm, example_inputs):
        seen.append(gc.isenabled())
        if len(seen) == 2:
            raise RuntimeError("this backend fails its second compile")
        return gm

    model = mlp()
    was = gc.isenabled()
    try:
        if user_turned_it_off:
            gc.disable()
        with gradfx.compiled_autograd(backend=backend):
            model(torch.randn(8, 16)).sum().backward()
        assert gc.isenabled() is not user_turned_it_off
        with pytest.raises(gradfx.Unsupported):
            with gradfx.compiled_autograd(backend=backend, dynamic=False, strict=True):
                model(torch.randn(5, 16)).sum().backward()
        assert gc.isenabled() is not user_turned_it_off
    finally:
        gc.enable() if was else gc.disable()
    assert seen == [False, False]


# -- the contract a torch.compile user's first custom backend relies on ---------------

def _transformer():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def test_first_custom_backend_of_a_torch_compile_user(capsys):
    """The backend torch.compile's docs start with: shapes of the example inputs, the
    graph's table, the graph back.  Every example input is a tensor or a size (the graph
    calls no Python object here: no autograd node, no leaf it does not read)."""
    seen = []

    def my_backend(gm, example_inputs):
        seen.append([type(e) for e in example_inputs])
        print([e.shape for e in example_inputs])
        gm.graph.print_tabular()
        return gm

    with warnings.catch_warnings():
        warnings.simplefilter("error", gradfx.FallbackWarning)
        compare_training(_transformer, lambda: (torch.randn(5, 3, 32),), lambda out: out.mean(),
                         backend=my_backend)
    assert len(seen) == 1 and all(t in (torch.Tensor, torch.nn.Parameter) for t in seen[0]), seen
    assert "opcode" in capsys.readouterr().out  # print_tabular's header


def test_graph_inputs_are_what_it_uses():
    """Placeholders a backend gets all have users; hooks reach the graph as their callables."""
    inputs = []

    def backend(gm, example_inputs):
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        assert len(placeholders) == len(example_inputs)
        assert all(n.users for n in placeholders), [n.name for n in placeholders if not n.users]
        inputs.append(example_inputs)
        return gm

    compare_training(Hooked, lambda: (torch.randn(8, 16),), backend=backend)
    kinds = {type(e) for e in inputs[0]}
    assert callable([e for e in inputs[0] if not isinstance(e, torch.Tensor)][0])
    assert kinds - {torch.Tensor, torch.nn.Parameter} and all(
        isinstance(e, (torch.Tensor, int)) or callable(e) for e in inputs[0])


def test_torch_compile_of_the_graph_with_opaque_nodes():
    """A graph that runs a node as itself: it reaches the graph through a custom op, not
    as an input; torch.compile(gm) compiles it."""
    from helpers import Double

    class WithDouble(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            return self.net(Double.apply(self.net[0](x)).relu().matmul(torch.ones(32, 16)))

    types = []

    def backend(gm, example_inputs):
        types.extend(type(e) for e in example_inputs)
        return torch.compile(gm, backend="aot_eager")

    compare_training(WithDouble, lambda: (torch.randn(8, 16),), backend=backend, exact=False,
                     allow_opaque=("DoubleBackward",))
    assert set(types) <= {torch.Tensor, torch.nn.Parameter, dict}, types


# -- inductor's caches: a later process loads what an earlier one compiled -------------

_WARM_PROGRAM = """
import logging, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(message)s")
logging.getLogger("gradfx").setLevel(logging.INFO)
import threading
import torch, gradfx
import torch._inductor.cpu_vec_isa as isa
probes = isa.valid_vec_isa_list
isa.valid_vec_isa_list = lambda: print("vector probes on", threading.current_thread().name) or probes()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
loss = model(torch.randn(8, 16)).sum()
with gradfx.compiled_autograd(backend="inductor"):
    loss.backward()
print("grad", model[0].weight.grad.sum().item())
from gradfx.backends import builtin
print("sets probed side by side and valid:", sorted(str(i) for i in builtin._probed_sets(isa) if i))
print("sets inductor finds valid:", sorted(str(i) for i in probes()))
"""


@pytest.mark.slow
@pytest.mark.sample
def test_inductor_regions_hit_the_fx_graph_cache_in_a_later_process(tmp_path):
    """The built-in inductor compiles with a shape environment, so inductor's FX graph cache
    keys its regions: a second process loads them (the log says hit) instead of compiling.
    Inductor's vector-ISA probes (child processes, every process) start on a thread of
    their own when the capture begins, and so run while the graph is captured; the sets
    it probes side by side are those inductor would probe one by one."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    runs = [subprocess.run([sys.executable, "-c", _WARM_PROGRAM], env=env, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    first, second = (run.stdout for run in runs)
    assert "(FX graph cache miss)" in first and "bypass" not in first, first
    assert "(FX graph cache hit)" in second and "miss" not in second, second
    for run in (first, second):
        if torch.cuda.is_available():
            break  # with CUDA the probes are inductor's own, where it needs them
        probed = [line for line in run.splitlines() if line.startswith("vector probes on")]
        assert probed and probed[0] == "vector probes on gradfx-inductor-probes", run
        # the sets probed side by side are those inductor asks about (on x86 Linux; else none)
        ours = next(line for line in run.splitlines() if line.startswith("sets probed side by side"))
        theirs = next(line for line in run.splitlines() if line.startswith("sets inductor finds valid"))
        assert ours.endswith("[]") or ours.split(":")[1] == theirs.split(":")[1], run
    grads = [line for run in (first, second) for line in run.splitlines() if line.startswith("grad ")]
    assert grads[0] == grads[1]
