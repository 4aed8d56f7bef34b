"""GPU benchmark: eager autograd vs gradfx vs PyTorch's compiled autograd, on CUDA.

Models: GPT-2 small (transformers' GPT2Config defaults: 12 layers, d768) under bf16
autocast, batch 8 x 512; a Llama-style decoder (LlamaConfig: 8 layers, hidden 1024,
16 heads, 4 key/value heads, SDPA) under bf16 autocast, batch 8 x 512; ResNet-50
(timm's ``resnet50`` if importable, else the one written here), batch 64 x 224 x 224,
channels_last, fp32; and a launch-bound MLP (16 x Linear(256) + GELU + LayerNorm) at
batch 32.  Training mode, AdamW.

Rows per model: eager; gradfx's eager backend; gradfx's inductor backend; gradfx with
``torch.compile(gm, mode="reduce-overhead")`` as its backend (inductor + CUDA graphs);
PyTorch's compiled autograd with inductor (``compiled_autograd._enable``, as
bench_backward.py runs it).  Columns: steady backward median (CUDA events around
``backward()``), train-step throughput (forward + backward + optimizer step), the
first backward (capture + compile), peak memory over the steady steps, the ratios to
eager, and the gradients of the first backward against eager's from the same weights
and seeds (bitwise for the eager backend; eager against itself in the eager row).

gradfx's rows set ``gradfx.capture.graph.kinds.assume_current_stream``: torch 2.11 and
2.13 do not say which stream a node's forward ran on, so gradfx otherwise runs every
CUDA backward on the eager engine.  These forwards do run on the current stream.

Every row runs in a worker process, one after another, each in try/except; a worker
that dies (a CUDA error poisons its process) is replaced for the rows after.  Rows
run cheapest first: eager and the eager backend of every model before any compile,
then each model's compiled rows together, the MLP's first and GPT-2's last.  A global
time budget (``--budget`` seconds) skips what is left, with a note; a row still
running past it is stopped ``--grace`` seconds later.

Writes bench/results/gpu.md (the table) and gpu.json.  ``--dry-run``: the tiniest
version of every model on the CPU, 2 steps (compiled rows for the MLP only unless
``--compiled-models`` says otherwise), to check the script before the GPU time.

Usage: python bench/bench_gpu.py [--budget 420] [--models ...] [--modes ...]
       [--steps 10] [--warmup 3] [--dry-run] [--out bench/results]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only: nothing is downloaded
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", message=".*TF32.*")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

MODEL_ORDER = ["mlp_small", "resnet50", "llama", "gpt2"]  # cheapest compile first
MODES = ["eager", "gradfx_eager", "gradfx_inductor", "torch_ca_inductor", "gradfx_inductor_cudagraphs"]
MODE_LABELS = {
    "eager": "eager",
    "gradfx_eager": "gradfx eager backend",
    "gradfx_inductor": "gradfx inductor",
    "gradfx_inductor_cudagraphs": "gradfx inductor + CUDA graphs (reduce-overhead)",
    "torch_ca_inductor": "PyTorch compiled autograd + inductor",
}
CHEAP = ("eager", "gradfx_eager")


def _import_gradfx():
    """gradfx, importable without pip: the repository root is the package, so a
    temporary folder with a link named gradfx to it goes on the path (and on
    PYTHONPATH, for the workers)."""
    try:
        import gradfx
        return gradfx
    except ImportError:
        pass
    shim = tempfile.mkdtemp(prefix="gradfx_path_")
    os.symlink(ROOT, os.path.join(shim, "gradfx"))
    sys.path.insert(0, shim)
    os.environ["PYTHONPATH"] = shim + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    import gradfx
    return gradfx


# -- models ---------------------------------------------------------------------------

def _mlp(dry):
    import torch.nn as nn
    width, depth = (32, 2) if dry else (256, 16)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 10)), width


def _resnet50(dry):
    """timm's resnet50 where timm is importable (never in the dry run: its tiniest
    version is this file's), else this file's ResNet-50 (torchvision's layout)."""
    if not dry:
        try:
            import timm
            return timm.create_model("resnet50", pretrained=False, num_classes=1000), "timm resnet50"
        except Exception as err:  # not installed, or failed: the hand-written one
            note = f"timm unavailable ({type(err).__name__}): hand-written ResNet-50"
    else:
        note = "hand-written ResNet, 1 block per stage, width 8"
    return _ResNet(blocks=(1, 1, 1, 1) if dry else (3, 4, 6, 3), width=8 if dry else 64), note


def _make_resnet_class():
    import torch.nn as nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
            self.bn3 = nn.BatchNorm2d(cout)
            self.relu = nn.ReLU(inplace=True)
            self.down = None
            if stride != 1 or cin != cout:
                self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            return self.relu(out + (x if self.down is None else self.down(x)))

    class ResNet(nn.Module):
        def __init__(self, blocks=(3, 4, 6, 3), width=64, classes=1000):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                                      nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1))
            layers, cin = [], width
            for stage, n in enumerate(blocks):
                w = width * 2 ** stage
                for b in range(n):
                    layers.append(Bottleneck(cin, w, 2 if (b == 0 and stage > 0) else 1))
                    cin = w * 4
            self.layers = nn.Sequential(*layers)
            self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))

        def forward(self, x):
            return self.head(self.layers(self.stem(x)))
    return ResNet


def _ResNet(**kwargs):
    return _make_resnet_class()(**kwargs)


def _gpt2(dry):
    import transformers
    if dry:
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                      attn_implementation="sdpa")
    else:  # GPT-2 small: the defaults (12 layers, d768, 12 heads, vocabulary 50257)
        cfg = transformers.GPT2Config(attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg), cfg.vocab_size


def _llama(dry):
    import transformers
    if dry:
        cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                       attn_implementation="sdpa")
    else:  # GQA: 16 query heads share 4 key/value heads
        cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                                       num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
                                       max_position_embeddings=2048, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg), cfg.vocab_size


class Workload:
    """A model on the device, its batches (by seed), its loss, and what a step is worth."""

    def __init__(self, name, dry, device):
        import torch
        self.name, self.device, self.note = name, device, ""
        self.autocast = None
        self.memory_format = None
        if name == "mlp_small":
            self.model, width = _mlp(dry)
            batch = 4 if dry else 32
            self.shape, self.items, self.unit = (batch, width), batch, "samples"
            self.kind = "dense"
        elif name == "resnet50":
            self.model, self.note = _resnet50(dry)
            batch, side = (2, 32) if dry else (64, 224)
            self.shape, self.items, self.unit = (batch, 3, side, side), batch, "images"
            self.memory_format = torch.channels_last
            self.kind = "image"
        elif name in ("gpt2", "llama"):
            self.model, self.vocab = (_gpt2 if name == "gpt2" else _llama)(dry)
            batch, length = (2, 16) if dry else (8, 512)
            self.shape, self.items, self.unit = (batch, length), batch * length, "tokens"
            self.autocast = torch.bfloat16
            self.kind = "lm"
        else:
            raise ValueError(name)
        self.model = self.model.to(device)
        if self.memory_format is not None:
            self.model = self.model.to(memory_format=self.memory_format)
        self.model.train()

    def batch(self, seed):
        import torch
        g = torch.Generator().manual_seed(seed)
        if self.kind == "lm":
            ids = torch.randint(0, self.vocab, self.shape, generator=g)
            return ids.to(self.device), None
        x = torch.randn(*self.shape, generator=g)
        y = torch.randint(0, 10 if self.kind == "dense" else 1000, (self.shape[0],), generator=g)
        x = x.to(self.device)
        if self.memory_format is not None:
            x = x.contiguous(memory_format=self.memory_format)
        return x, y.to(self.device)

    def loss(self, batch):
        import torch
        import torch.nn.functional as F
        x, y = batch
        with torch.autocast(self.device.type, dtype=self.autocast or torch.bfloat16, enabled=self.autocast is not None):
            if self.kind == "lm":
                return self.model(input_ids=x, labels=x).loss
            return F.cross_entropy(self.model(x).float(), y)


# -- engines --------------------------------------------------------------------------

def _engine(mode):
    """A context-manager factory for the backward of ``mode``."""
    import torch
    if mode == "eager":
        return contextlib.nullcontext
    if mode == "torch_ca_inductor":
        from torch._dynamo import compiled_autograd
        return lambda: compiled_autograd._enable(lambda gm: torch.compile(gm, backend="inductor"))
    import gradfx
    backend = {"gradfx_eager": "eager", "gradfx_inductor": "inductor",
               "gradfx_inductor_cudagraphs": lambda gm, example_inputs: torch.compile(gm, mode="reduce-overhead")}[mode]
    return lambda: gradfx.compiled_autograd(backend)


class Timer:
    """CUDA events on a GPU, the wall clock (after a sync) elsewhere."""

    def __init__(self, device):
        import torch
        self.cuda = device.type == "cuda"
        self.torch = torch

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def start(self):
        if self.cuda:
            ev = self.torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def seconds(self, start):
        if self.cuda:
            end = self.torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return time.perf_counter() - start


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _compare(ref, got):
    """'bitwise' or the largest difference relative to the gradient's own scale."""
    import torch
    worst, same = 0.0, True
    for a, b in zip(ref, got):
        if a is None or b is None:
            if (a is None) != (b is None):
                return "a gradient is missing", False
            continue
        if torch.equal(a, b):
            continue
        same = False
        scale = a.float().abs().max().item() or 1.0
        worst = max(worst, (a.float() - b.float()).abs().max().item() / scale)
    return ("bitwise" if same else f"differs (max rel {worst:.1e})"), same


def run_row(name, mode, args, device):
    import torch
    import gradfx
    torch._dynamo.reset()
    gradfx.reset()
    timer = Timer(device)
    row = {"model": name, "mode": mode}
    torch.manual_seed(0)
    work = Workload(name, args.dry_run, device)
    model = work.model
    row["note"] = work.note
    row["params"] = sum(p.numel() for p in model.parameters())
    ctx = _engine(mode)
    cudagraph_skips = _cudagraph_skips()
    caught = []

    def backward(loss):
        with warnings.catch_warnings(record=True) as found:
            warnings.simplefilter("always", gradfx.FallbackWarning)
            with ctx():
                loss.backward()
        caught.extend(str(w.message) for w in found if issubclass(w.category, gradfx.FallbackWarning))

    # The first backward from fixed weights and seeds, against eager's.
    first_batch = work.batch(0)
    torch.manual_seed(1)
    work.loss(first_batch).backward()
    reference = _grads(model)
    if mode == "eager":
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        work.loss(first_batch).backward()
        row["grads"] = "eager twice: " + _compare(reference, _grads(model))[0]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = work.loss(first_batch)
    timer.sync()
    start = time.perf_counter()
    backward(loss)
    timer.sync()
    row["first_backward_s"] = time.perf_counter() - start
    if mode != "eager":
        row["grads"], row["bitwise"] = _compare(reference, _grads(model))
    del reference, loss
    model.zero_grad(set_to_none=True)

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    cudagraphs = mode == "gradfx_inductor_cudagraphs" and device.type == "cuda"

    def step(seed, timed):
        if cudagraphs:
            torch.compiler.cudagraph_mark_step_begin()
        opt.zero_grad(set_to_none=True)
        loss = work.loss(work.batch(seed))
        t = timer.start() if timed else None
        backward(loss)
        seconds = timer.seconds(t) if timed else None
        opt.step()
        return seconds

    for k in range(args.warmup):
        step(1 + k, False)
    timer.sync()
    if device.type == "cuda":
        gc.collect()
        torch.cuda.reset_peak_memory_stats()
    times = []
    wall = time.perf_counter()
    for k in range(args.steps):
        times.append(step(100 + k, True))
    timer.sync()
    wall = time.perf_counter() - wall
    row["backward_ms"] = statistics.median(times) * 1e3
    row["step_per_s"] = args.steps / wall
    row["items_per_s"] = args.steps * work.items / wall
    row["unit"] = work.unit
    if device.type == "cuda":
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
    if mode.startswith("gradfx"):
        stats = gradfx.stats()
        row["gradfx_stats"] = stats
        if stats.get("fallbacks"):
            row["note"] = _join(row["note"], f"{stats['fallbacks']} backward(s) fell back to eager"
                                + (f": {caught[0][:160]}" if caught else ""))
    skips = _cudagraph_skips() - cudagraph_skips
    if mode == "gradfx_inductor_cudagraphs" and skips:
        row["note"] = _join(row["note"], f"inductor skipped CUDA graphs {skips} time(s)")
    del opt, work, model
    return row


def _cudagraph_skips():
    try:
        from torch._dynamo.utils import counters
        return counters["inductor"]["cudagraph_skips"]
    except Exception:
        return 0


def _join(a, b):
    return f"{a}; {b}" if a else b


# -- worker and parent ------------------------------------------------------------------

def worker(args):
    """Run the rows of ``args.worker`` in order, one JSON line each to ``args.results``."""
    import torch
    _import_gradfx()
    from gradfx.capture.graph import kinds
    kinds.assume_current_stream = True  # see the module's docstring
    device = torch.device("cpu" if args.dry_run else "cuda")
    with open(args.worker) as f:
        rows = json.load(f)
    for name, mode in rows:
        with open(args.results, "a") as out:
            out.write(json.dumps({"model": name, "mode": mode, "started": True}) + "\n")
        left = args.deadline - time.time()
        if left <= 0:
            row = {"model": name, "mode": mode, "note": "skipped: time budget exceeded"}
        elif mode not in CHEAP and left < args.min_compile:
            row = {"model": name, "mode": mode, "note": f"skipped: {left:.0f} s of the time budget left, "
                                                         f"under the {args.min_compile:.0f} s a compiled row needs"}
        else:
            try:
                row = run_row(name, mode, args, device)
            except Exception as err:
                row = {"model": name, "mode": mode, "error": f"{type(err).__name__}: {str(err)[:300]}",
                       "trace": traceback.format_exc()[-2000:]}
        with open(args.results, "a") as out:
            out.write(json.dumps(row) + "\n")
        gc.collect()
        if device.type == "cuda":
            if "error" in row and ("CUDA error" in row["error"] or "illegal" in row["error"]):
                sys.exit(3)  # the process is poisoned: the parent starts another for the rest
            torch.cuda.empty_cache()


def _plan(args):
    models = [m for m in MODEL_ORDER if m in args.models]
    compiled_models = args.compiled_models if args.compiled_models is not None else (
        ["mlp_small"] if args.dry_run else models)
    modes = [m for m in MODES if m in args.modes]
    # Eager and the eager backend of every model first, then each model's compiled rows
    # together (a whole comparison per model), cheapest model first.
    rows = [(name, mode) for mode in modes if mode in CHEAP for name in models]
    rows += [(name, mode) for name in models if name in compiled_models for mode in modes if mode not in CHEAP]
    return rows


def _read(path):
    done, started = {}, []
    if not os.path.exists(path):
        return done, started
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            r = json.loads(line)
            key = (r["model"], r["mode"])
            if r.get("started"):
                started.append(key)
            else:
                done[key] = r
    return done, started


def parent(args):
    begin = time.time()
    deadline = begin + args.budget
    plan = _plan(args)
    tmp = tempfile.mkdtemp(prefix="bench_gpu_")
    results = os.path.join(tmp, "rows.jsonl")
    log = []
    while True:
        done, started = _read(results)
        todo = [r for r in plan if r not in done]
        if not todo:
            break
        if log and len(todo) == log[-1]["todo"]:  # the last worker finished nothing: give up
            _write_rows(results, [{"model": r[0], "mode": r[1], "error": "no worker could run it"} for r in todo])
            break
        if time.time() > deadline:
            for r in todo:
                done[r] = {"model": r[0], "mode": r[1], "note": f"skipped: time budget ({args.budget:.0f} s) exceeded"}
            _write_rows(results, [done[r] for r in todo])
            break
        rows_file = os.path.join(tmp, f"todo{len(log)}.json")
        with open(rows_file, "w") as f:
            json.dump(todo, f)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", rows_file, "--results", results,
               "--deadline", str(deadline), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--min-compile", str(args.min_compile)]
        if args.dry_run:
            cmd.append("--dry-run")
        print(f"[bench_gpu] worker for {len(todo)} row(s), {deadline - time.time():.0f} s left", flush=True)
        try:
            proc = subprocess.run(cmd, timeout=max(5.0, deadline - time.time() + args.grace), capture_output=True,
                                  text=True)
            rc, tail = proc.returncode, (proc.stderr or "").strip().splitlines()[-3:]
        except subprocess.TimeoutExpired as err:
            rc, tail = "timeout", ((err.stderr or b"").decode(errors="replace") if isinstance(err.stderr, bytes)
                                   else (err.stderr or "")).strip().splitlines()[-3:]
        log.append({"rc": rc, "stderr_tail": tail, "todo": len(todo)})
        done, started = _read(results)
        hung = [r for r in started if r not in done]
        for r in hung:  # the row the worker was in when it died or was stopped
            why = (f"killed at the time budget ({args.budget:.0f} s)" if rc == "timeout"
                   else f"worker died (exit {rc}): {' | '.join(tail)[-300:]}")
            _write_rows(results, [{"model": r[0], "mode": r[1], "error": why}])
        if rc == 0:
            break
    done, _ = _read(results)
    rows = [done.get(r, {"model": r[0], "mode": r[1], "error": "no result"}) for r in plan]
    _ratios(rows)
    meta = _meta(args, time.time() - begin, log)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gpu.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
    table = _markdown(meta, rows)
    with open(os.path.join(args.out, "gpu.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"[bench_gpu] {time.time() - begin:.0f} s; wrote {args.out}/gpu.md and gpu.json", flush=True)


def _write_rows(path, rows):
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def _ratios(rows):
    eager = {r["model"]: r for r in rows if r["mode"] == "eager" and "backward_ms" in r}
    for r in rows:
        e = eager.get(r["model"])
        if e is not None and "backward_ms" in r:
            r["backward_vs_eager"] = r["backward_ms"] / e["backward_ms"]
            r["throughput_vs_eager"] = r["items_per_s"] / e["items_per_s"]


def _meta(args, seconds, log):
    import torch
    meta = {"torch": torch.__version__, "cuda": torch.version.cuda, "dry_run": args.dry_run, "steps": args.steps,
            "warmup": args.warmup, "budget_s": args.budget, "seconds": round(seconds, 1), "workers": log,
            "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if torch.cuda.is_available() and not args.dry_run:
        meta["gpu"] = torch.cuda.get_device_name(0)
    try:
        import transformers
        meta["transformers"] = transformers.__version__
    except Exception:
        pass
    try:
        import timm
        meta["timm"] = timm.__version__
    except Exception:
        pass
    return meta


def _fmt(v, spec, suffix=""):
    return f"{v:{spec}}{suffix}" if isinstance(v, (int, float)) else "—"


def _markdown(meta, rows):
    where = meta.get("gpu", "CPU (dry run)" if meta["dry_run"] else "?")
    lines = [f"# gradfx GPU benchmark{' (dry run: tiniest models on the CPU)' if meta['dry_run'] else ''}", "",
             f"{where}; torch {meta['torch']} (CUDA {meta['cuda']}); transformers {meta.get('transformers', '—')}; "
             f"timm {meta.get('timm', '—')}; {meta['steps']} timed steps after {meta['warmup']} warm-up; "
             f"{meta['seconds']} s of a {meta['budget_s']:.0f} s budget; {meta['date']}.", "",
             "Backward: median of CUDA events around `backward()` (the wall clock in a dry run). Step: forward + "
             "backward + AdamW. First backward: capture and compile included. Peak: `max_memory_allocated` over the "
             "timed steps. Grads: the first backward's against eager's from the same weights and seeds. gradfx rows "
             "run with `kinds.assume_current_stream = True` (torch cannot say which stream a node's forward used).", "",
             "| model | mode | backward ms | vs eager | steps/s | items/s | vs eager | first backward s | peak GiB "
             "| grads | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        note = r.get("error") and f"**error**: {r['error']}" or r.get("note", "")
        if r.get("error") and r.get("note"):
            note = f"{r['note']}; {note}"
        lines.append("| " + " | ".join([
            r["model"], MODE_LABELS.get(r["mode"], r["mode"]), _fmt(r.get("backward_ms"), ".2f"),
            _fmt(r.get("backward_vs_eager"), ".2f", "x"), _fmt(r.get("step_per_s"), ".2f"),
            _fmt(r.get("items_per_s"), ".0f", f" {r.get('unit', '')}".rstrip()),
            _fmt(r.get("throughput_vs_eager"), ".2f", "x"), _fmt(r.get("first_backward_s"), ".2f"),
            _fmt(r.get("peak_gb"), ".2f"), r.get("grads", "—"), note.replace("|", "/").replace("\n", " ")]) + " |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=MODEL_ORDER, choices=MODEL_ORDER)
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--compiled-models", nargs="*", choices=MODEL_ORDER,
                   help="models that get the compiled rows (default: all; the MLP alone in a dry run)")
    p.add_argument("--budget", type=float, default=420.0, help="seconds for every row together")
    p.add_argument("--grace", type=float, default=20.0, help="seconds past the budget before a worker is killed")
    p.add_argument("--min-compile", type=float, help="seconds a compiled row needs to start "
                   "(default 40; 0 in a dry run)")
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--dry-run", action="store_true", help="the tiniest models on the CPU, 2 steps")
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps is None:
        args.steps = 2 if args.dry_run else 10
    if args.warmup is None:
        args.warmup = 0 if args.dry_run else 3
    if args.min_compile is None:
        args.min_compile = 0.0 if args.dry_run else 40.0
    if args.worker:
        worker(args)
        return
    import torch
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("bench_gpu: no CUDA GPU here (--dry-run runs the tiniest models on the CPU)")
    _import_gradfx()  # here too: PYTHONPATH for the workers
    parent(args)


if __name__ == "__main__":
    main()
