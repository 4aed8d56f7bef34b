"""The opaque-node census: which autograd nodes of real models in training run opaque.

Tiny random-initialised transformers models built from their configs (2 layers, hidden
32, vocabulary 100, nothing downloaded), in training mode with every dropout of the
config at 0.1, one loss from a small random batch. Per model:

* the exact set of node kinds ``gradfx.capture(loss).opaque_nodes`` reports (and the
  block's graph reports), so this test fails when a kind becomes opaque or stops being
  one. A kind expected opaque is named with its reason from ``rules.RUN_REAL``;
* two SGD steps under ``gradfx.compiled_autograd(backend="eager")`` (a capture, then a
  cache hit with new dropout masks) give gradients bitwise equal (``torch.equal``) to
  an eager twin (a deepcopy, reseeded right before each forward so dropout draws the
  same masks).

Measured (torch 2.13.0 CPU, transformers 5.24; batch 2, length 12):

| model (attention) | autograd nodes | opaque kinds |
| --- | --- | --- |
| gpt2 (eager) | 156 | none |
| llama (sdpa, grouped-query) | 232 | none |
| mistral (sdpa, sliding window 8) | 232 | none |
| bert (sdpa, padding mask) | 186 | none |
| t5 (eager, encoder-decoder) | 471 | none |

On CPU, dropout is ``input * bernoulli_mask / (1 - p)`` (MulBackward0), also inside
SDPA's math path; ``NativeDropoutBackward0`` only appears where dropout is fused, on
CUDA (its hidden ``train`` flag is read by gradfx's compiled part and keyed:
tests/test_hidden_state.py; without that part it runs opaque). So GPT-2 also runs here
with ``F.dropout`` as ``at::dropout`` runs it on CUDA (``native_dropout``): 7 dropout
nodes, none opaque, bitwise eager, and compiled whole by inductor. On a CUDA build (CI's
2.11.0 and 2.14.1 jobs; no GPU needed) a fake-CUDA GPT-2 (``FakeTensorMode``,
``device="cuda"``, torch's own dropout) shows that this is the graph CUDA records: the
same node kinds, as many of each. On a CPU-only build no fake-CUDA graph can be
recorded: the first autograd node on a CUDA fake aborts the process (``InputMetadata``
asks for the device's stream). ``gradfx.capture`` refuses fake tensors whatever their
device (a tensor subclass), while a block hands their backward to the C++ engine as
torch's own (``routing.torch_internal``): ``test_fake_tensors``.

Under the built-in ``inductor`` (``test_census_inductor``, slow; GPT-2 in the default
run) every graph of the transformers models compiles: no fallback, nothing left
uncompiled, gradients close to eager's.

timm models (ViT, ResNet, ConvNeXt, EfficientNet) run when timm imports; timm needs
torchvision, whose PyPI wheel for torch 2.13 is a CUDA build that does not load on CPU
torch, so on 2.13 they are skipped. CI runs this file on torch 2.14.1 with torchvision
0.29.1 and timm (`.ci/run`); measured there (timm 1.0.31, 64 x 64 images, batch 2):

| model | autograd nodes | opaque kinds |
| --- | --- | --- |
| vit_tiny_patch16_224 | 489 | none |
| resnet18 | 135 | none |
| convnext_atto | 275 | none |
| efficientnet_b0 | 456 | none |
"""

from __future__ import annotations

import copy
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # configs only; never reach for a hub

import pytest
import torch

import gradfx
from gradfx.capture.trace.rules import RUN_REAL
from helpers import assert_same, autograd_nodes, grads_of

VOCAB = 100
P = 0.1          # every dropout probability of the configs
BATCH, LENGTH = 2, 12


# --- models ---------------------------------------------------------------------------

def _transformers():
    return pytest.importorskip("transformers")


def gpt2():
    t = _transformers()
    return t.GPT2LMHeadModel(t.GPT2Config(
        vocab_size=VOCAB, n_positions=64, n_embd=32, n_layer=2, n_head=4, n_inner=64,
        resid_pdrop=P, embd_pdrop=P, attn_pdrop=P, bos_token_id=1, eos_token_id=2,
        attn_implementation="eager"))


def llama():
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_dropout=P, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="sdpa"))


def mistral():
    t = _transformers()
    return t.MistralForCausalLM(t.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=8, attention_dropout=P, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        attn_implementation="sdpa"))


def bert():
    t = _transformers()
    return t.BertForMaskedLM(t.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=P,
        attention_probs_dropout_prob=P, pad_token_id=0, attn_implementation="sdpa"))


def t5():
    t = _transformers()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, dropout_rate=P, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0, attn_implementation="eager"))


def _timm(name, **kwargs):
    def make():
        timm = pytest.importorskip("timm")
        return timm.create_model(name, pretrained=False, **kwargs)
    return make


def lm_loss(kind):
    def loss(model, seed, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=g).to(device)
        if kind == "mlm":  # padding: row i ends in 2 * (i % 4) + 1 pad tokens
            pad = (torch.arange(BATCH) % 4) * 2 + 1
            mask = (torch.arange(LENGTH) < LENGTH - pad[:, None]).long().to(device)
            logits = model(input_ids=ids * mask, attention_mask=mask).logits
            target = ids.masked_fill(mask == 0, -100)
        elif kind == "seq2seq":
            target = torch.randint(3, VOCAB, (BATCH, LENGTH // 2), generator=g).to(device)
            logits = model(input_ids=ids, decoder_input_ids=target).logits
        else:
            logits = model(input_ids=ids).logits
            logits, target = logits[:, :-1], ids[:, 1:]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
    return loss


def image_loss(size):
    def loss(model, seed, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(2, 3, size, size, generator=g).to(device)
        logits = model(x)
        target = torch.randint(0, logits.shape[-1], (2,), generator=g).to(device)
        return torch.nn.functional.cross_entropy(logits, target)
    return loss


# name -> (build, loss, the opaque node kinds expected today, each with RUN_REAL's reason)
CENSUS = {
    "gpt2": (gpt2, lm_loss("causal"), {}),
    "llama": (llama, lm_loss("causal"), {}),
    "mistral": (mistral, lm_loss("causal"), {}),
    "bert": (bert, lm_loss("mlm"), {}),
    "t5": (t5, lm_loss("seq2seq"), {}),
    # timm: where it imports (CI's torch 2.14.1 job)
    "vit_tiny": (_timm("vit_tiny_patch16_224", img_size=64, drop_rate=P), image_loss(64), {}),
    "resnet18": (_timm("resnet18", drop_rate=P), image_loss(64), {}),
    "convnext_atto": (_timm("convnext_atto", drop_rate=P), image_loss(64), {}),
    "efficientnet_b0": (_timm("efficientnet_b0", drop_rate=P), image_loss(64), {}),
}


def kinds(labels):
    """Node kinds of ``opaque_nodes`` labels (without their sequence numbers)."""
    return {label.split()[0] for label in labels}


@pytest.fixture(autouse=True)
def fresh():
    gradfx.reset()
    yield
    gradfx.reset()


def _train_twins(build, loss_of, backend, expected=frozenset(), check_first=None):
    """Two SGD steps of a model and its eager twin (a capture, then a cache hit with new
    dropout masks) under ``backend`` (strict: no fallback, no backend failure): the opaque
    kinds of the capture and of the block's graphs are ``expected``, the gradients those of
    eager (bitwise for the eager backend, ``assert_close`` for a compiler)."""
    torch.manual_seed(0)
    eager = build().train()
    gfx = copy.deepcopy(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, gfx)]
    for step in range(2):
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        torch.manual_seed(10 + step)
        loss_of(eager, step).backward()
        torch.manual_seed(10 + step)
        loss = loss_of(gfx, step)
        if step == 0:
            assert len(autograd_nodes(loss.grad_fn)) > 100
            if check_first is not None:
                check_first(loss)
            assert kinds(gradfx.capture(loss).opaque_nodes) == set(expected)
        with gradfx.compiled_autograd(backend=backend, strict=True) as session:
            loss.backward()
        for graph in session.graphs:
            assert kinds(graph.opaque_nodes) == set(expected), graph.opaque_nodes
        assert_same(grads_of(eager.parameters()), grads_of(gfx.parameters()), exact=backend == "eager")
        for opt in opts:
            opt.step()
    stats = gradfx.stats()
    assert (stats["captures"], stats["cache_hits"], stats["fallbacks"], stats["uncompiled"]) == (1, 1, 0, 0), stats


@pytest.mark.parametrize("name", list(CENSUS))
def test_census(name):
    build, loss_of, expected = CENSUS[name]
    for kind, reason in expected.items():  # an expected kind must be opaque for RUN_REAL's reason
        assert RUN_REAL.get(kind) == reason, (kind, RUN_REAL.get(kind))
    with torch.no_grad():  # dropout is on: two seeds, two losses
        torch.manual_seed(0)
        model = build().train()
        torch.manual_seed(1)
        a = loss_of(model, 0)
        torch.manual_seed(2)
        assert not torch.equal(a, loss_of(model, 0)), "dropout is off"
    _train_twins(build, loss_of, "eager", expected)


# The transformers models under the built-in inductor: every graph compiled (no graph
# or region left uncompiled, no fallback), the gradients close to eager's.
@pytest.mark.parametrize("name", [
    pytest.param("gpt2", marks=[pytest.mark.slow, pytest.mark.sample]),
    *(pytest.param(name, marks=pytest.mark.slow) for name in ("llama", "mistral", "bert", "t5")),
])
def test_census_inductor(name):
    build, loss_of, expected = CENSUS[name]
    _train_twins(build, loss_of, "inductor", expected)


# --- dropout as CUDA runs it -------------------------------------------------------------

def _fused_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as ``at::dropout`` runs it on CUDA: the fused kernel, ``native_dropout``,
    wherever it is acceptable there (training, 0 < p < 1, a non-empty input); elsewhere
    (and in place) the CPU path."""
    if training and not inplace and 0 < p < 1 and input.numel() > 0:
        return torch.native_dropout(input, p, True)[0]
    return _cpu_dropout(input, p, training, inplace)


_cpu_dropout = torch.nn.functional.dropout


@pytest.fixture
def cuda_dropout(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "dropout", _fused_dropout)


def _kind_counts(root) -> dict:
    """How many nodes of each kind; ``reshape``'s view counted as one kind, whichever node it
    records (``ReshapeAliasBackward0`` on the fake-CUDA model, ``ViewBackward0`` on CPU)."""
    counts: dict = {}
    for node in autograd_nodes(root):
        name = type(node).__name__
        name = "ViewBackward0" if name == "ReshapeAliasBackward0" else name
        counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.mark.parametrize("backend", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_gpt2_with_cudas_dropout(cuda_dropout, backend):
    """GPT-2 in training with dropout as on CUDA (``NativeDropoutBackward0``, whose ``train``
    flag is hidden in C++ and read by gradfx's compiled part): no node opaque; with the
    eager backend bitwise eager, with inductor every graph compiled."""
    def seven_dropouts(loss):  # the embeddings' and 3 per layer
        assert _kind_counts(loss.grad_fn)["NativeDropoutBackward0"] == 7
    _train_twins(gpt2, lm_loss("causal"), backend, check_first=seven_dropouts)


@pytest.mark.skipif(not torch.backends.cuda.is_built(),
                    reason="a CPU build of torch cannot make a fake CUDA tensor that requires grad")
def test_fake_cuda_gpt2_has_the_graph_of_cudas_dropout(monkeypatch):
    """What ``test_gpt2_with_cudas_dropout`` captures is the graph GPT-2 records on CUDA: a
    fake-CUDA GPT-2 (a CUDA build, no GPU needed) running torch's own dropout has the same
    node kinds, as many of each, and gradfx's compiled part reads the ``train`` flag of
    each of its dropout nodes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from gradfx.capture import native
    from gradfx.capture.graph.kinds import hidden_state

    loss_of = lm_loss("causal")
    monkeypatch.setattr(torch.nn.functional, "dropout", _fused_dropout)
    torch.manual_seed(0)
    imitated = _kind_counts(loss_of(gpt2().train(), 0).grad_fn)
    monkeypatch.undo()
    with FakeTensorMode():
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = gpt2().train()
        loss = loss_of(model, 0, "cuda")
    assert loss.device.type == "cuda"
    assert _kind_counts(loss.grad_fn) == imitated
    assert native.wait() is not None, native.reason()
    dropouts = [n for n in autograd_nodes(loss.grad_fn) if type(n).__name__ == "NativeDropoutBackward0"]
    assert len(dropouts) == 7 and all(hidden_state(n) == ((), (True,)) for n in dropouts)


# --- fake tensors -----------------------------------------------------------------------

@pytest.mark.parametrize("device", [
    "cpu",
    # On a CPU-only build the first autograd node on a fake CUDA tensor aborts the whole
    # process (InputMetadata asks for the CUDA stream), so only where CUDA is there.
    pytest.param("cuda", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="fake CUDA autograd needs a CUDA build with a device")),
])
def test_fake_tensors(device):
    """A GPT-2 built and run under FakeTensorMode: gradfx.capture refuses it (a tensor
    subclass), and a block hands its backward to the C++ engine as torch's own."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        torch.manual_seed(0)
        with torch.device(device):  # a fake .to("cuda") of a CPU fake needs CUDA linked in
            model = gpt2().train()
        loss = lm_loss("causal")(model, 0, device)
    assert loss.device.type == device and loss.grad_fn is not None
    with pytest.raises(gradfx.Unsupported, match=r"tensor subclass \(FakeTensor\)"):
        gradfx.capture(loss)
    with mode:
        with gradfx.compiled_autograd(backend="eager", strict=True) as session:
            loss.backward()
    assert session.stats["captures"] == session.stats["fallbacks"] == 0, session.stats
    assert all(p.grad is not None for p in model.parameters())
