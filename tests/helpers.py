"""Shared test helpers: run the same program under eager autograd and gradfx."""

from __future__ import annotations

import contextlib
import copy
import warnings

import torch

import gradfx


class RetNone(torch.autograd.Function):
    """Returns None for its input: eager passes an undefined gradient on."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return None


class Double(torch.autograd.Function):
    """Doubles its input; an opaque custom Function (its backward is not traced)."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class MaybeNone(torch.autograd.Function):
    """Identity whose backward returns None while ``drop`` is set: a graph traced with a
    gradient there stops at run time and the rest of the backward runs node by node."""
    drop = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None if MaybeNone.drop else grad


class Wide(torch.nn.Module):
    """Two 1 MiB layers: DDP's default buckets (1 MiB first, 25 MiB after) make two of them.
    Matrix products alone: ``aot_eager``'s decompositions compute them as eager does.
    Arguments after ``x`` (another test model's switches) are taken and ignored."""

    def __init__(self, features: int):
        super().__init__()
        self.a = torch.nn.Linear(features, 512)
        self.b = torch.nn.Linear(512, 512)
        self.c = torch.nn.Linear(512, 4)

    def forward(self, x, *ignored):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def autograd_nodes(root) -> set:
    """Every autograd node reachable from ``root`` (a node)."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(f for f, _ in node.next_functions)
    return seen


def grads_of(params):
    return [None if p.grad is None else p.grad.clone() for p in params]


_SAME_WIDTH_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def bitwise_equal(x, y):
    """``torch.equal``, except that NaNs with the same bits are equal."""
    if torch.equal(x, y):
        return True
    if x.shape != y.shape or x.dtype != y.dtype or not x.is_floating_point() or x.layout != torch.strided:
        return False
    as_int = _SAME_WIDTH_INT[x.element_size()]
    return torch.equal(x.contiguous().view(as_int), y.contiguous().view(as_int))


def assert_same(a, b, exact=True):
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        if x is None or y is None:
            assert x is None and y is None, f"gradient {k}: {x is None} vs {y is None}"
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, f"gradient {k}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
        if exact:
            assert bitwise_equal(x, y), f"gradient {k} differs: max abs diff {(x - y).abs().max()}"
        else:
            torch.testing.assert_close(x, y)


def hooked_captures() -> int:
    """Captures of a structure whose saved tensors are under the user's saved_tensors_hooks: one
    that learns how the hooks unpack and one that traces the formulas on that, where gradfx's
    compiled part is loaded (graph.unpacked); without it, one (those nodes run as themselves)."""
    from gradfx.capture import native
    return 2 if native.module() is not None else 1


def compare_training(make_model, make_inputs, loss_fn=None, *, iterations=3, backend="eager",
                     expect_captures=1, zero_grad=True, exact=True, allow_opaque=(), check_opaque=True,
                     **kwargs):
    """Run `iterations` steps in eager and under gradfx; grads must match each step.

    Returns the session of the last gradfx block.
    """
    torch.manual_seed(0)
    eager_model = make_model()
    gfx_model = copy.deepcopy(eager_model)
    loss_fn = loss_fn or (lambda out: out.sum())
    gradfx.reset()
    session = None
    for it in range(iterations):
        torch.manual_seed(100 + it)
        inputs = make_inputs()
        if zero_grad:
            eager_model.zero_grad(set_to_none=True)
            gfx_model.zero_grad(set_to_none=True)
        loss_fn(eager_model(*inputs)).backward()
        with gradfx.compiled_autograd(backend, **kwargs) as session:
            loss_fn(gfx_model(*inputs)).backward()
        assert session.stats["fallbacks"] == 0, session.stats
        if check_opaque:
            for graph in session.graphs:
                # node names without their sequence numbers (those depend on what ran before)
                assert [label.split()[0] for label in graph.opaque_nodes] == list(allow_opaque), graph.opaque_nodes
        assert_same(grads_of(eager_model.parameters()), grads_of(gfx_model.parameters()), exact)
    totals = gradfx.stats()
    assert totals["captures"] == expect_captures, totals
    assert totals["cache_hits"] == iterations - expect_captures, totals
    return session


def snap(x):
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return tuple(snap(v) for v in x)
    return x


def _same_log(a, b):
    assert len(a) == len(b), (len(a), len(b), [e[0] for e in a], [e[0] for e in b])
    for ea, eb in zip(a, b):
        assert ea[0] == eb[0], (ea[0], eb[0])
        _same_value(ea[1:], eb[1:])


def _same_value(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same_value(x, y)
    else:
        assert a == b


def run_both(build, iterations=3, expect_captures=1, **kwargs):
    """build(log) -> (params, step); step() runs one forward+backward.

    Runs `iterations` steps eagerly and under gradfx, each with its own fresh
    model, hooks and log; compares logs and gradients after every step.
    """
    torch.manual_seed(0)
    eager_log, gfx_log = [], []
    state = torch.random.get_rng_state()
    eager_params, eager_step = build(eager_log)
    torch.random.set_rng_state(state)
    gfx_params, gfx_step = build(gfx_log)
    for it in range(iterations):
        torch.manual_seed(it)
        eager_step()
        torch.manual_seed(it)
        with gradfx.compiled_autograd(**kwargs) as session:
            gfx_step()
        assert session.stats["fallbacks"] == 0, session.stats
        _same_log(eager_log, gfx_log)
        assert_same(grads_of(eager_params), grads_of(gfx_params))
    stats = gradfx.stats()
    assert stats["captures"] == expect_captures, stats
    return eager_log




@contextlib.contextmanager
def split_pieces(count):
    """While the block runs: per graph a split backend (inductor, aot_eager) compiles, the
    pieces it is cut into, as ``("region" or "python", count(their nodes))``."""
    from gradfx.backends import builtin
    partition = builtin.partition
    pieces = []

    def recorded(graph):
        found = partition(graph)
        pieces.append([("region" if compiled else "python", count(nodes)) for compiled, nodes in found])
        return found
    builtin.partition = recorded
    try:
        yield pieces
    finally:
        builtin.partition = partition


def record_case(results, key, case) -> None:
    """``results[key] = case()`` on a spawned rank; where it raises, the traceback instead (the
    case's test reports it), and the error goes on (the spawn then stops every rank)."""
    try:
        results[key] = case()
    except Exception:
        import traceback
        results[key] = {"error": traceback.format_exc()}
        raise


@contextlib.contextmanager
def gloo_group(rank: int, world: int, port: int):
    """This spawned rank in a gloo process group on loopback ``port`` (one thread), for the
    block; destroyed after it."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def backward(loss, under_gradfx: bool, backend="eager") -> None:
    """``loss.backward()``: on the eager engine, or under gradfx, where falling back is an error."""
    if not under_gradfx:
        loss.backward()
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", gradfx.FallbackWarning)
        with gradfx.compiled_autograd(backend):
            loss.backward()


def case_backend(case: dict):
    """The backend a distributed test case names: ``"gm"`` is a user's own backend (the
    graph module itself, so the form compilers trace), any other name a built-in one."""
    backend = case.get("backend", "eager")
    return (lambda gm, example_inputs: gm) if backend == "gm" else backend


def record_cases(results, rank: int, cases: dict, run) -> None:
    """``run(rank, case)`` of each case on this rank, gradfx's counters reset before each,
    recorded under ``(name, rank)`` (:func:`record_case`)."""
    for name, case in cases.items():
        gradfx.reset()
        record_case(results, (name, rank), lambda: run(rank, case))


def spawn_ranks(worker, world: int, *args) -> dict:
    """``worker(rank, world, port, *args, results)`` in ``world`` processes on a free loopback
    port (torch.multiprocessing.spawn); what the ranks put in ``results``, as a dict."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(worker, args=(world, port, *args, results), nprocs=world, join=True)
    return dict(results)
