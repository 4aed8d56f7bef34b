"""Backward-pass benchmark: gradfx vs eager autograd vs PyTorch's compiled autograd.

For each model it prints, in one run:
- first backward (capture + compile), each engine in a fresh process, and "warm": the
  same in a process where the engine has already run one tiny backward (the one-time
  set-up both pay, about 1 s of importing torch._dynamo and initialising fake
  tensors, is behind it: what every model after the first costs);
- recapture: in a fresh process, the first backward after a size change (e.g. batch
  64 -> 48, or sequence length 32 -> 24) once the first size is cached (gradfx with
  ``dynamic="auto"``: the capture that makes sizes symbolic; PyTorch's compiled
  autograd: its recompile), and gradfx's first backward with ``dynamic=True`` (the
  first capture with every size symbolic);
- steady-state backward time (median, after warm-up), engines alternating in one
  process, as a ratio to eager;
- autograd node count and opaque node count of gradfx's graph;
and at the end one summary line per model.

Models: mlp, transformer, mlp_large, cnn, lstm, transformer_hooked (the transformer with a
full backward hook on each layer), gpt2, llama, bert and t5 (tiny, random weights, built
from transformers' configs: nothing is downloaded; skipped with a message when
transformers is not installed: ``pip install -e ".[models]"``).

Usage: python bench/bench_backward.py [--models mlp transformer] [--backend eager]
       [--skip-torch] [--skip-recapture] [--steady-only] [--steps 50] [--threads 1|2]
       [--no-results]
``--steady-only`` measures the steady state alone (no child processes: the short run).
Each run merges its steady-state ratios (median of the per-round ratios and their
middle half), node counts, date, machine and torch release into ``bench/results.json``
(``bench/results_file.py``) under ``bench_backward --backend B --threads T`` (and
`` GRADFX_NATIVE=0`` where it is set); ``--no-results`` leaves the file alone.
``--backend whole-inductor`` hands gradfx's whole graph to
``torch.compile(gm, backend="inductor", fullgraph=True)`` (``--backend inductor``
is gradfx's built-in split: the pure part compiled, accumulation in Python).
``--threads`` sets ``torch.set_num_threads`` here and in every child process.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only; never reach for a hub
# transformer_hooked: the first layer's input does not require grad (eager warns too)
warnings.filterwarnings("ignore", message="Full backward hook is firing")

import torch
import torch.nn as nn

VOCAB = 128


def _transformer():
    return nn.TransformerEncoder(nn.TransformerEncoderLayer(128, 4, 256, dropout=0.0, batch_first=True), 2,
                                 enable_nested_tensor=False)


def _transformer_hooked():
    model = _transformer()
    for layer in model.layers:  # a module full backward hook on every layer
        layer.register_full_backward_hook(lambda module, grad_input, grad_output: None)
    return model


class _Checkpointed(nn.Module):
    """Each layer of the transformer under a non-reentrant torch.utils.checkpoint (its saved
    tensors under checkpoint's hooks, its forward recomputed in the backward)."""

    def __init__(self):
        super().__init__()
        self.layers = _transformer().layers

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x


def _cnn():
    def block(cin, cout, stride):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())
    return nn.Sequential(block(3, 16, 1), block(16, 32, 2), block(32, 32, 1), block(32, 64, 2),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def _gpt2():
    import transformers
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=128,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager"))


def _llama():
    import transformers
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="sdpa"))


def _bert():
    import transformers
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0, attn_implementation="sdpa"))


def _t5():
    import transformers
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, attn_implementation="eager"))


class _LSTM(nn.Module):
    """A 2-layer LSTM over (batch, length, 32) and a linear head."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(32, 64, 2, batch_first=True)
        self.head = nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def _sum_loss(model, x):
    return model(x).sum()


def _lm_loss(model, ids):
    logits = model(input_ids=ids).logits
    return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _mlm_loss(model, ids):
    # padding at the end of rows 1, 2, 3 of every 4 (a mask that is never all ones)
    pad = (torch.arange(ids.shape[0]) % 4) * 2
    mask = (torch.arange(ids.shape[1]) < ids.shape[1] - pad[:, None]).long()
    logits = model(input_ids=ids * mask, attention_mask=mask).logits
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids.masked_fill(mask == 0, -100).reshape(-1))


def _seq2seq_loss(model, ids):
    target = ids[:, : ids.shape[1] // 2]
    logits = model(input_ids=ids, decoder_input_ids=target).logits
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def _demo_mlp():
    """``python -m gradfx demo``'s model (gradfx/__main__.py)."""
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 10))


def _demo_loss(model, x):
    target = torch.arange(x.shape[0]) % 10
    return nn.functional.cross_entropy(model(x), target)


def _randn(shape):
    return torch.randn(*shape)


def _ids(shape):
    return torch.randint(3, VOCAB, shape)


# name: (make, input shape, shape after a size change, make an input, loss, needs transformers)
MODELS = {
    # 8 x (Linear(256) + GELU + LayerNorm), batch 64
    "mlp": (lambda: nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256))
                                    for _ in range(8)]), (64, 256), (48, 256), _randn, _sum_loss, False),
    # the demo's MLP: Linear(64, 128), GELU, LayerNorm, Linear(128, 10), batch 32, cross-entropy
    "demo": (_demo_mlp, (32, 64), (24, 64), _randn, _demo_loss, False),
    # 2-layer TransformerEncoder, d=128, 4 heads, ff 256, input 8x32x128
    "transformer": (_transformer, (8, 32, 128), (8, 24, 128), _randn, _sum_loss, False),
    # 4 x (Linear(1024) + GELU + LayerNorm), batch 512 (compute-bound)
    "mlp_large": (lambda: nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.GELU(), nn.LayerNorm(1024))
                                          for _ in range(4)]), (512, 1024), (384, 1024), _randn, _sum_loss, False),
    # 4 x (Conv3x3 + BatchNorm + ReLU), pooling and a Linear head, batch 16 x 3 x 32 x 32
    "cnn": (_cnn, (16, 3, 32, 32), (12, 3, 32, 32), _randn, _sum_loss, False),
    # the transformer with register_full_backward_hook on each of its 2 layers
    "transformer_hooked": (_transformer_hooked, (8, 32, 128), (8, 24, 128), _randn, _sum_loss, False),
    # the transformer with each layer under a non-reentrant checkpoint
    "transformer_checkpointed": (_Checkpointed, (8, 32, 128), (8, 24, 128), _randn, _sum_loss, False),
    # GPT-2 and Llama (rotary, sdpa): 2 layers, hidden 64, vocabulary 128, batch 8 x 32 tokens
    "gpt2": (_gpt2, (8, 32), (8, 24), _ids, _lm_loss, True),
    "llama": (_llama, (8, 32), (8, 24), _ids, _lm_loss, True),
    # 2-layer LSTM, hidden 64, input 8 x 32 steps x 32
    "lstm": (_LSTM, (8, 32, 32), (8, 24, 32), _randn, _sum_loss, False),
    # BERT (padding mask, masked-LM loss) and T5 (encoder-decoder, decoder half as long)
    "bert": (_bert, (8, 32), (8, 24), _ids, _mlm_loss, True),
    "t5": (_t5, (8, 32), (8, 24), _ids, _seq2seq_loss, True),
}


def _available(name):
    if MODELS[name][5] and importlib.util.find_spec("transformers") is None:
        return False
    return True


def _setup(name, resized=False):
    torch.manual_seed(0)
    make, shape, shape2, make_input, loss_fn, _ = MODELS[name]
    model = make()
    x = make_input(shape2 if resized else shape)
    return model, x, loss_fn


def _engine(kind, backend, dynamic="auto"):
    import contextlib
    if kind == "eager":
        return contextlib.nullcontext
    if kind == "gradfx":
        import gradfx
        if backend.startswith("whole-"):  # the whole graph through torch.compile, as users write it
            inner = backend[len("whole-"):]
            return lambda: gradfx.compiled_autograd(
                backend=lambda gm: torch.compile(gm, backend=inner, fullgraph=True), dynamic=dynamic)
        return lambda: gradfx.compiled_autograd(backend=backend, dynamic=dynamic)
    from torch._dynamo import compiled_autograd
    tbackend = backend[len("whole-"):] if backend.startswith("whole-") else backend
    return lambda: compiled_autograd._enable(lambda gm: torch.compile(gm, backend=tbackend))


def _timed_backward(ctx, model, x, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, x)
    start = time.perf_counter()
    with ctx():
        loss.backward()
    return time.perf_counter() - start


def _tiny_backward(ctx):
    layer = nn.Linear(3, 2)
    with ctx():
        layer(torch.randn(4, 3)).tanh().sum().backward()


def first_backward(name, kind, backend, warm=False):
    """Child process: time the first backward of a fresh process (``warm``: after the
    engine's one-time set-up, done by a tiny backward of another model)."""
    ctx = _engine(kind, backend)
    if warm:
        _tiny_backward(ctx)
    model, x, loss_fn = _setup(name)
    out = {"seconds": _timed_backward(ctx, model, x, loss_fn)}
    if kind == "gradfx":
        import gradfx
        g = gradfx.capture(loss_fn(model, x))
        out["autograd_nodes"] = g.autograd_nodes
        out["opaque_nodes"] = len(g.opaque_nodes)
        out["fx_nodes"] = len(g.graph_module.graph.nodes)
    print(json.dumps(out))


def resize_backward(name, kind, backend):
    """Child process: the first backward after a size change, the first size cached."""
    ctx = _engine(kind, backend, dynamic="auto")
    model, x, loss_fn = _setup(name)
    _, x2, _ = _setup(name, resized=True)
    for _ in range(2):  # capture, then a cache hit
        _timed_backward(ctx, model, x, loss_fn)
    out = {"seconds": _timed_backward(ctx, model, x2, loss_fn)}
    out["again"] = _timed_backward(ctx, model, x2, loss_fn)  # the new size once more
    if kind == "gradfx":
        import gradfx
        out["stats"] = gradfx.stats()
    print(json.dumps(out))


def symbolic_backward(name, kind, backend):
    """Child process: gradfx's first backward with dynamic=True (every size symbolic)."""
    ctx = _engine(kind, backend, dynamic=True)
    model, x, loss_fn = _setup(name)
    out = {"seconds": _timed_backward(ctx, model, x, loss_fn)}
    _, x2, _ = _setup(name, resized=True)
    out["resized"] = _timed_backward(ctx, model, x2, loss_fn)  # the other size: a cache hit
    import gradfx
    out["stats"] = gradfx.stats()
    print(json.dumps(out))


CHILD_MODES = {"first": first_backward, "first_warm": lambda *a: first_backward(*a, warm=True),
               "resize": resize_backward, "symbolic": symbolic_backward}


def _child(mode, name, kind, backend, threads):
    env = dict(os.environ)
    cmd = [sys.executable, __file__, "--child", mode, name, kind, backend]
    if threads:
        cmd += ["--threads", str(threads)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 1800 s"}
    if res.returncode != 0:
        return {"error": res.stderr.strip().splitlines()[-1] if res.stderr.strip() else "failed"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def _quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def steady_state(name, kinds, backend, steps, warmup=5):
    """Each engine's median time, and per engine the median and middle half (25th-75th
    percentile) of its time over eager's in the same round: engines alternate, one
    backward each per round, after ``warmup`` rounds."""
    model, x, loss_fn = _setup(name)
    ctxs = {k: _engine(k, backend) for k in kinds}
    times = {k: [] for k in kinds}
    for step in range(steps + warmup):
        for k in kinds:
            t = _timed_backward(ctxs[k], model, x, loss_fn)
            if step >= warmup:
                times[k].append(t)
    out = {k: _quantile(v, 0.5) for k, v in times.items()}
    for k in kinds:
        if k != "eager":
            pairs = [t / e for t, e in zip(times[k], times["eager"])]
            out[k + "/eager"] = (_quantile(pairs, 0.5), _quantile(pairs, 0.25), _quantile(pairs, 0.75))
    return out


def _s(result, key="seconds"):
    v = result.get(key) if result else None
    return f"{v:.3f} s" if isinstance(v, (int, float)) else (result or {}).get("error", "n/a")


def _num(result, key="seconds"):
    v = (result or {}).get(key)
    return v if isinstance(v, (int, float)) else float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child", nargs=4, metavar=("MODE", "MODEL", "ENGINE", "BACKEND"))
    p.add_argument("--models", nargs="+", default=["mlp", "transformer"], choices=sorted(MODELS))
    p.add_argument("--backend", default="eager")
    p.add_argument("--skip-torch", action="store_true", help="skip PyTorch's compiled autograd")
    p.add_argument("--skip-recapture", action="store_true", help="skip the size-change and dynamic=True runs")
    p.add_argument("--steady-only", action="store_true",
                   help="measure the steady state alone (no first-backward or recapture child processes)")
    p.add_argument("--no-results", action="store_true", help="do not write bench/results.json")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--threads", type=int, choices=[1, 2], help="torch.set_num_threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.child:
        mode, name, kind, backend = args.child
        CHILD_MODES[mode](name, kind, backend)
        return
    kinds = ["eager", "gradfx"] + ([] if args.skip_torch else ["torch_ca"])
    from gradfx.capture import native
    if native.wait() is None:  # measure with gradfx's compiled part, built now if need be
        print(f"gradfx's compiled part is not used: {native.reason()}")
    print(f"backend={args.backend} torch={torch.__version__} threads={torch.get_num_threads()}")
    summary = []
    recorded = {}
    for name in args.models:
        if not _available(name):
            print(f"\n[{name}] skipped: transformers is not installed (pip install -e \".[models]\")")
            continue
        if args.steady_only:
            first = {k: {} for k in kinds if k != "eager"}
            warm = {k: {} for k in kinds if k != "eager"}
        else:
            first = {k: _child("first", name, k, args.backend, args.threads) for k in kinds if k != "eager"}
            warm = {k: _child("first_warm", name, k, args.backend, args.threads) for k in kinds if k != "eager"}
        resize, symbolic = {}, {}
        if not args.skip_recapture and not args.steady_only:
            resize = {k: _child("resize", name, k, args.backend, args.threads) for k in kinds if k != "eager"}
            symbolic = _child("symbolic", name, "gradfx", args.backend, args.threads)
        steady = steady_state(name, kinds, args.backend, args.steps)
        g = first["gradfx"] or _child("first_warm", name, "gradfx", args.backend, args.threads)
        print(f"\n[{name}] autograd nodes {g.get('autograd_nodes')}, opaque {g.get('opaque_nodes')}, "
              f"fx nodes {g.get('fx_nodes')}")
        line = f"  first backward: gradfx {_s(g)}"
        if "torch_ca" in first:
            t = _num(first["torch_ca"])
            line += f", torch compiled autograd {_s(first['torch_ca'])} (gradfx = 1/{t / _num(g):.1f} of it)"
        if not args.steady_only:
            print(line)
        gw = warm["gradfx"]
        line = f"  first backward, warm process: gradfx {_s(gw)}"
        if "torch_ca" in warm:
            t = _num(warm["torch_ca"])
            line += f", torch compiled autograd {_s(warm['torch_ca'])} (gradfx = 1/{t / _num(gw):.1f} of it)"
        if not args.steady_only:
            print(line)
        if resize:
            shape, shape2 = MODELS[name][1], MODELS[name][2]
            r = resize["gradfx"]
            line = (f"  recapture {'x'.join(map(str, shape))} -> {'x'.join(map(str, shape2))}: "
                    f"gradfx auto {_s(r)} (captures {r.get('stats', {}).get('captures', '?')}, then {_s(r, 'again')})")
            if "torch_ca" in resize:
                line += f", torch compiled autograd {_s(resize['torch_ca'])} (then {_s(resize['torch_ca'], 'again')})"
            print(line)
            print(f"  first symbolic capture (dynamic=True): gradfx {_s(symbolic)} "
                  f"(other size: {_s(symbolic, 'resized')}, captures {symbolic.get('stats', {}).get('captures', '?')})")
        e = steady["eager"]
        ratio, low, high = steady["gradfx/eager"]
        line = (f"  steady backward: eager {e * 1e3:.3f} ms, gradfx {steady['gradfx'] * 1e3:.3f} ms "
                f"({ratio:.2f}x, middle half {low:.2f}-{high:.2f}x)")
        entry = {"steps": args.steps, "eager_ms": round(e * 1e3, 4), "gradfx_ms": round(steady["gradfx"] * 1e3, 4),
                 "ratio": round(ratio, 3), "spread": [round(low, 3), round(high, 3)],
                 "autograd_nodes": g.get("autograd_nodes"), "opaque_nodes": g.get("opaque_nodes")}
        if "torch_ca" in steady:
            tratio, tlow, thigh = steady["torch_ca/eager"]
            line += (f", torch compiled autograd {steady['torch_ca'] * 1e3:.3f} ms ({tratio:.2f}x, middle half "
                     f"{tlow:.2f}-{thigh:.2f}x)")
            entry.update(torch_ca_ms=round(steady["torch_ca"] * 1e3, 4), ratio_torch_ca=round(tratio, 3),
                         spread_torch_ca=[round(tlow, 3), round(thigh, 3)])
        print(line, flush=True)
        recorded[name] = entry
        summary.append((name, _num(first["gradfx"]), _num(gw), _num(resize.get("gradfx")), _num(symbolic),
                        ratio, steady["torch_ca/eager"][0] if "torch_ca" in steady else float("nan")))
    if recorded and not args.no_results:
        import results_file
        key = f"bench_backward --backend {args.backend} --threads {torch.get_num_threads()}"
        if os.environ.get("GRADFX_NATIVE") == "0":
            key += " GRADFX_NATIVE=0"
        results_file.record(key, recorded, threads=torch.get_num_threads(),
                            compiled_part=native.module() is not None)
    if summary:
        print(f"\nsummary (threads={torch.get_num_threads()}, backend={args.backend}): "
              "first (fresh, warm process), recapture (auto), first symbolic (True) in s; steady ratios vs eager")
        print(f"  {'model':20s} {'first':>8s} {'warm':>8s} {'recapture':>10s} {'symbolic':>9s} {'gradfx/eager':>13s} "
              f"{'torch_ca/eager':>15s}")
        for name, f, w, r, s, ratio, tratio in summary:
            print(f"  {name:20s} {f:8.3f} {w:8.3f} {r:10.3f} {s:9.3f} {ratio:13.2f} {tratio:15.2f}")


if __name__ == "__main__":
    main()
