"""What a user pays before the compiled backward pays back: the first step of a fresh
process, with inductor's caches empty (cold) and filled by an earlier process (warm), and
the steady backward after it, side by side for

* ``gradfx``: gradfx's built-in inductor backend, eager forward;
* ``gradfx+compiled``: the same with ``torch.compile(model)``'s forward (its regions'
  AOT backwards traced into gradfx's graph);
* ``torch.compile``: ``torch.compile(model)`` alone, its own AOT backward;
* ``pytorch_ca``: PyTorch's compiled autograd (inductor) with ``torch.compile(model)``;
* ``gradfx_whole`` (asked for by name): ``gradfx`` with each region compiled whole, not
  cut into its repeated blocks (``backends/repeated_blocks.py``): what the cut saves in
  compile time and costs in steady speed;
* ``gradfx_lengths`` (asked for by name): ``gradfx`` with ``dynamic="auto"`` over four
  sequence lengths: the first backward of each (the second recaptures with symbolic sizes
  and compiles its regions for all sizes; the third and fourth should compile nothing),
  and the compiles, recaptures and recompiles after each; the steady ratio at the last.

Each (mode, model, cold/warm) runs in a process of its own (``--worker``), which prints
one JSON line: the first step (forward and backward) in seconds, the first backward
alone where the mode compiles there, and the median of per-pair ratios of the mode's
backward to eager's over interleaved pairs after warm-up (1 thread).  Cold runs get an
empty ``TORCHINDUCTOR_CACHE_DIR``; the warm run of the same mode reuses it.  The table
goes to stdout and the figures to ``bench/results.json`` (``bench_compile``).

    python bench/bench_compile.py                      # tiny GPT-2, GPT-2 small
    python bench/bench_compile.py --models gpt2_tiny --modes gradfx torch.compile
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# gradfx_whole: gradfx with each region compiled whole (no repeated blocks), for the
# cost of the cut in steady speed and what it saves in compile time
MODES = ("gradfx", "gradfx+compiled", "torch.compile", "pytorch_ca", "gradfx_whole", "gradfx_lengths")
DEFAULT_MODES = MODES[:4]

# name: (config arguments, batch, sequence length); "_hooks": where AOT cannot go, a
# full backward hook on each block and a post-accumulate-grad hook on each parameter
# (what an optimizer-in-backward registers), torch.compile(model) breaking its graph there
MODELS = {
    "gpt2_tiny": (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64), 8, 32),
    "gpt2_tiny_hooks": (dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64), 8, 32),
    "gpt2_4layer": (dict(n_layer=4, n_embd=256, n_head=4, vocab_size=1024, n_positions=128), 4, 128),
    "gpt2_small": (dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024), 2, 64),
    "gpt2_small_24": (dict(n_layer=24, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024), 2, 64),
    # a Llama: 8 layers, hidden 512, rotary embeddings, sdpa
    "llama_8layer": (dict(num_hidden_layers=8, hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                          intermediate_size=1376, vocab_size=1024, max_position_embeddings=256), 2, 128),
}


# -- one process: one mode, one model ------------------------------------------------

def _model(name: str):
    import torch
    import transformers
    config, batch, length = MODELS[name]
    torch.manual_seed(0)
    if name.startswith("llama"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, bos_token_id=1,
                                                                       eos_token_id=2)).train()
    else:
        cfg = transformers.GPT2Config(**config, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                      bos_token_id=1, eos_token_id=2)
        model = transformers.GPT2LMHeadModel(cfg).train()
    ids = torch.randint(3, config["vocab_size"], (batch, length))
    if name.endswith("_hooks"):
        seen = []
        for block in model.transformer.h:
            block.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(len(grad_out)))
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.shape[0]))
        model.hook_calls = seen
    return model, ids


def worker(mode: str, name: str, pairs: int) -> dict:
    import torch
    torch.set_num_threads(1)
    import gradfx

    if mode == "gradfx_whole":
        from gradfx.backends import repeated_blocks
        repeated_blocks.MIN_NODES = 10 ** 9
    model, ids = _model(name)
    eager_model, _ = _model(name)  # the same weights and hooks
    forward = model if mode in ("gradfx", "gradfx_whole", "gradfx_lengths") else torch.compile(model)
    dynamic = "auto" if mode == "gradfx_lengths" else False

    def backward_of(loss):
        if mode.startswith("gradfx"):
            with gradfx.compiled_autograd(backend="inductor", dynamic=dynamic):
                loss.backward()
        elif mode == "pytorch_ca":
            with torch._dynamo.compiled_autograd._enable(torch.compile(backend="inductor")):
                loss.backward()
        else:
            loss.backward()

    def step(m, backward):
        m.zero_grad(set_to_none=True)
        loss = m(ids, labels=ids).loss
        start = time.perf_counter()
        backward(loss)
        return time.perf_counter() - start

    start = time.perf_counter()
    first_backward = step(forward, backward_of)
    first_step = time.perf_counter() - start
    lengths = []
    if mode == "gradfx_lengths":
        lengths.append({"length": ids.shape[1], "first_backward_s": round(first_backward, 2), **gradfx.stats()})
        vocab = MODELS[name][0]["vocab_size"]
        for change in (-3, 5, -7):
            ids = torch.randint(3, vocab, (ids.shape[0], MODELS[name][2] + change))
            lengths.append({"length": ids.shape[1], "first_backward_s": round(step(forward, backward_of), 2),
                            **gradfx.stats()})
    for _ in range(3):  # warm-up: both sides, any second compile
        step(forward, backward_of)
        step(eager_model, lambda loss: loss.backward())
    ratios, mine, eager = [], [], []
    for k in range(pairs):
        if k % 2:
            e, g = step(eager_model, lambda loss: loss.backward()), step(forward, backward_of)
        else:
            g, e = step(forward, backward_of), step(eager_model, lambda loss: loss.backward())
        ratios.append(g / e)
        mine.append(g)
        eager.append(e)
    low, _, high = statistics.quantiles(ratios, n=4)
    stats = gradfx.stats() if mode.startswith("gradfx") else {}
    return {"first_step_s": round(first_step, 2), "first_backward_s": round(first_backward, 2),
            "ratio_steady": round(statistics.median(ratios), 2),
            "steady_spread": [round(low, 2), round(high, 2)],
            "backward_ms": round(statistics.median(mine) * 1e3, 3),
            "eager_backward_ms": round(statistics.median(eager) * 1e3, 3),
            "compiles": stats.get("compiles"), "uncompiled": stats.get("uncompiled"),
            **({"lengths": lengths} if lengths else {})}


# -- the run ------------------------------------------------------------------------

def _run(mode: str, name: str, cache_dir: str, pairs: int, timeout: float) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir, OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, name, "--pairs", str(pairs)]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        return {"error": tail[0][:200]}
    result = json.loads(lines[-1])
    result["process_s"] = round(time.perf_counter() - start, 1)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2_tiny", "gpt2_small"], choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES), choices=MODES)
    parser.add_argument("--pairs", type=int, default=30, help="interleaved steady pairs (default %(default)s)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    parser.add_argument("--no-results", action="store_true", help="do not write bench/results.json")
    parser.add_argument("--worker", nargs=2, metavar=("MODE", "MODEL"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.pairs)))
        return
    entries = {}
    print(f"{'model':<14} {'mode':<16} {'cold first step':>16} {'warm first step':>16} {'steady bwd/eager':>17}")
    for name in args.models:
        for mode in args.modes:
            cache_dir = tempfile.mkdtemp(prefix="gradfx-bench-inductor-")
            try:
                cold = _run(mode, name, cache_dir, args.pairs, args.timeout)
                warm = _run(mode, name, cache_dir, args.pairs, args.timeout)
            finally:
                shutil.rmtree(cache_dir, ignore_errors=True)
            entry = {"cold": cold, "warm": warm}
            if "ratio_steady" in warm:
                entry["ratio_steady"] = warm["ratio_steady"]
            entries[f"{name} {mode}"] = entry

            def first(r):
                return r.get("error", f"{r['first_step_s']:.1f} s") if "error" in r else f"{r['first_step_s']:.1f} s"
            steady = warm.get("ratio_steady")
            print(f"{name:<14} {mode:<16} {first(cold):>16} {first(warm):>16} "
                  f"{(f'{steady:.2f}x' if steady is not None else '-'):>17}", flush=True)
            for label, r in (("cold", cold), ("warm", warm)):
                if r.get("lengths"):
                    print(f"{'':<14} {label}: " + "; ".join(
                        f"length {x['length']}: {x['first_backward_s']:.2f} s (captures {x['captures']}, "
                        f"recaptures {x['recaptures']}, compiles {x['compiles']}, recompiles {x['recompiles']})"
                        for x in r["lengths"]), flush=True)
    if not args.no_results:
        import results_file
        results_file.record("bench_compile", entries, pairs=args.pairs)


if __name__ == "__main__":
    main()
