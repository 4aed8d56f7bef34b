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
tests/test_hidden_state.py; without that part it runs opaque). A fake-CUDA GPT-2
(``FakeTensorMode``, ``device="cuda"``) cannot be recorded on a CPU-only build: the
first autograd node on a CUDA fake aborts the process (``InputMetadata`` asks for the
device's stream: "PyTorch is not linked with support for cuda devices"). And
``gradfx.capture`` refuses fake tensors whatever their device (a tensor subclass), while
a block hands their backward to the C++ engine as torch's own (``routing.torch_internal``):
``test_fake_tensors``.

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


@pytest.mark.parametrize("name", list(CENSUS))
def test_census(name):
    build, loss_of, expected = CENSUS[name]
    for kind, reason in expected.items():  # an expected kind must be opaque for RUN_REAL's reason
        assert RUN_REAL.get(kind) == reason, (kind, RUN_REAL.get(kind))
    torch.manual_seed(0)
    eager = build().train()
    gfx = copy.deepcopy(eager)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, gfx)]

    with torch.no_grad():  # dropout is on: two seeds, two losses
        torch.manual_seed(1)
        a = loss_of(eager, 0)
        torch.manual_seed(2)
        assert not torch.equal(a, loss_of(eager, 0)), "dropout is off"

    for step in range(2):  # a capture, then a cache hit with new dropout masks
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        torch.manual_seed(10 + step)
        loss_of(eager, step).backward()
        torch.manual_seed(10 + step)
        loss = loss_of(gfx, step)
        if step == 0:
            assert len(autograd_nodes(loss.grad_fn)) > 100
            assert kinds(gradfx.capture(loss).opaque_nodes) == set(expected)
        with gradfx.compiled_autograd(backend="eager", strict=True) as session:
            loss.backward()
        for graph in session.graphs:
            assert kinds(graph.opaque_nodes) == set(expected), graph.opaque_nodes
        assert_same(grads_of(eager.parameters()), grads_of(gfx.parameters()))
        for opt in opts:
            opt.step()
    stats = gradfx.stats()
    assert (stats["captures"], stats["cache_hits"], stats["fallbacks"]) == (1, 1, 0), stats


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
