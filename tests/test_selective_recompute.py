"""``--checkpoint selective`` in the pytorch convention against a real checkpointed core attention.

Truth: the core attention (``Q K^T``, softmax, dropout, ``@ V``; Korthikanti et al. 2022, section 5) wrapped in
``torch.utils.checkpoint(..., use_reentrant=False)`` the way a user does it -- for transformers 5.23's GPT-2 and
Llama their own ``eager_attention_forward`` registered as an attention function (``AttentionInterface``), for the
project's timm ViT reference the core of its explicit path -- and one training step under the live-bytes tracker.
What is alive when the loss is computed, less the parameters, buffers, the batch and the loss, is what the step
keeps for backward: symmem's kept activations must equal it to the byte.  The checkpoint keeps the core's inputs
(a view its whole base: GPT-2's ``c_attn`` output) and the tensors passed along (the mask, Llama's position ids,
held as keyword arguments), in place of the matmuls' copies, the softmax and the dropout.
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from symmem import derive  # noqa: E402
from symmem.errors import UncountedInput  # noqa: E402
from symmem.record.hf_llama import logits_of  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402

VALUES = {"B": 2, "S": 16, "H": 32, "h": 4, "L": 2, "V": 64, "F": 64}


def measured(module: torch.nn.Module, inputs: torch.Tensor) -> tuple[tuple[int, int, int, int], dict[str, int]]:
    """Two training steps (logits' sum, for-loop AdamW): what the steady step keeps for backward (live bytes when
    the loss is computed, less parameters, buffers, batch, optimizer state and the loss), the first and steady
    peaks, and the steady backward's largest moment; and each phase's largest moment of the steady step."""
    torch.manual_seed(0)
    t = track_step(module, inputs, loss="sum", optimizer="adamw", impl="for-loop")
    b = t.boundary(2, "loss")
    kept = b.live - sum(b.bytes(c) for c in ("parameter", "buffer", "input", "optimizer_state", "gradient", "output"))
    steady: dict[str, int] = {}
    for r in t.records:
        if r.step == 2:
            steady[r.phase] = max(steady.get(r.phase, 0), r.live)
    return (kept, t.first.bytes, t.steady.bytes, steady["backward"]), steady


def symmem(model: str, **options) -> tuple[tuple[int, int, int, int], dict[str, int]]:  # noqa: ANN003
    """The same numbers from symmem's selective recomputation (its simulated step on the CPU)."""
    d = derive(model, convention="pytorch", checkpoint="selective", device="cpu", loss="sum",
               optimizer_impl="for-loop", **options)
    walked: dict[str, int] = {}
    for phase, _, live in d.step.timeline("steady", dict(d.numbers)):
        walked[phase] = max(walked.get(phase, 0), sum(live.values()))
    return (d.value("activations"), d.value("peak_first_step"), d.value("peak"), walked["backward"]), walked


def checkpointed(fn):  # noqa: ANN001, ANN201
    def core(module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN202
        return torch.utils.checkpoint.checkpoint(fn, module, query, key, value, attention_mask,
                                                 use_reentrant=False, **kwargs)
    return core


@pytest.fixture(scope="module")
def hf():
    """transformers' GPT-2 and Llama attention functions, checkpointed, registered under their own names."""
    pytest.importorskip("transformers")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.gpt2 import modeling_gpt2
    from transformers.models.llama import modeling_llama

    for name, module in (("symmem_ckpt_gpt2", modeling_gpt2), ("symmem_ckpt_llama", modeling_llama)):
        AttentionInterface.register(name, checkpointed(module.eager_attention_forward))
        AttentionMaskInterface.register(name, eager_mask)  # the eager path's (B, 1, S, S) additive mask
    return True


@pytest.mark.parametrize("cache, S", [("none", 64)])  # with the cache at S = 16 by hand: 175,488 (+2,048, the mask)
def test_hf_gpt2_eager(hf, cache, S):
    """GPT-2's q, k, v are views of c_attn's output: the checkpoint keeps all of it (3·B·S·H a layer) and the
    mask; it drops the query copy (and without the cache the key and value copies) and the softmax.  The block
    holds the weights the attention returns until it returns.  (HF's GPT2Model also holds its embeddings and the
    mask through the forward, which the zoo's GPT-2 does not count with or without checkpointing: the forward's
    largest moment is not compared; docs/pytorch-sequence.md.)"""
    from transformers import GPT2Config, GPT2LMHeadModel

    v = {**VALUES, "S": S}
    config = GPT2Config(vocab_size=v["V"], n_positions=1024, n_embd=v["H"], n_layer=v["L"], n_head=v["h"],
                        n_inner=v["F"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        use_cache=cache == "dynamic", bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "symmem_ckpt_gpt2"
    torch.manual_seed(0)
    real, _ = measured(logits_of(GPT2LMHeadModel(config)), torch.randint(0, v["V"], (v["B"], v["S"])))
    options = {"attention": "naive", "dropout": 0.0, "cache": cache, "values": v}
    assert symmem("gpt2", **options)[0] == real == (660992, 1110536, 1526392, 1526392)


@pytest.mark.parametrize("G, cache, S", [(1, "dynamic", 16), (2, "none", 64)])
def test_hf_llama_eager(hf, G, cache, S):
    """Llama's checkpoint keeps the rotary query, the key and value it is called with (the cache's copies, or the
    rotary key and v_proj's output), the mask and the position ids; repeat_kv's copies are inside it.  The decoder
    layer holds the weights the attention returns until it returns (the forward's largest moment at S = 64)."""
    from symmem.record.hf_llama import hf_llama

    values = {**VALUES, "G": G, "S": S}
    torch.manual_seed(0)
    module, ids = hf_llama(values, "naive", cache=cache)
    module.config._attn_implementation = "symmem_ckpt_llama"
    real, steady = measured(logits_of(module), ids)
    ours, walked = symmem("llama", attention="naive", cache=cache, values=values)
    assert ours == real
    if S == 16:
        assert real[0] == 151296
    # and the forward's largest moment (with the loss's sum, which derive counts in the forward)
    assert walked["forward"] == max(steady["forward"], steady["loss"])


def test_hf_bert_eager_against_its_own_step_without_checkpointing(hf):
    """BERT's checkpoint keeps the three projections q, k, v view (no mask: HF makes none without padding).  The
    zoo's BERT and this HF BertModel differ by a constant outside the attention with or without checkpointing, so
    the truth is the change selective recomputation makes to HF's own step: kept bytes and both peaks."""
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.models.bert import modeling_bert

    AttentionInterface.register("symmem_ckpt_bert", checkpointed(modeling_bert.eager_attention_forward))
    AttentionMaskInterface.register("symmem_ckpt_bert", eager_mask)
    v = {**VALUES, "S": 64}

    class Hidden(torch.nn.Module):
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.module(ids).last_hidden_state

    def real(implementation: str) -> tuple[int, int, int]:
        config = transformers.BertConfig(hidden_size=v["H"], intermediate_size=v["F"], num_attention_heads=v["h"],
                                         vocab_size=v["V"], num_hidden_layers=v["L"], attention_probs_dropout_prob=0.0,
                                         hidden_dropout_prob=0.0)
        config._attn_implementation = implementation
        torch.manual_seed(0)
        module = transformers.BertModel(config, add_pooling_layer=False)
        return measured(Hidden(module), torch.randint(0, v["V"], (v["B"], v["S"])))[0][:3]

    def ours(checkpoint: str) -> tuple[int, int, int]:
        d = derive("bert-base", convention="pytorch", attention="naive", dropout=0.0, values=v, device="cpu",
                   loss="sum", optimizer_impl="for-loop", checkpoint=checkpoint)
        return d.value("activations"), d.value("peak_first_step"), d.value("peak")

    change = [a - b for a, b in zip(real("symmem_ckpt_bert"), real("eager"), strict=True)]
    assert change == [a - b for a, b in zip(ours("selective"), ours("none"), strict=True)] == [-262144, -81920, -81920]


def test_vit_reference():
    """The project's timm ViT reference with its explicit core (q·scale @ kᵀ, softmax, dropout, @ v) checkpointed:
    the scaled query and the qkv output (k and v view it) are kept."""
    from symmem.reference.sequence_models import VitAttention, reference

    values = {"B": 2, "H": 32, "h": 4, "L": 2, "F": 64, "Hi": 32, "Wi": 32, "C": 3, "K": 10}
    module, (images,) = reference("vit-b16", values, attention="naive")

    def core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, drop: torch.nn.Module) -> torch.Tensor:
        return drop((q @ k.transpose(-2, -1)).softmax(dim=-1)) @ v

    def forward(self: VitAttention, x: torch.Tensor) -> torch.Tensor:  # timm's forward, the core checkpointed
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        x = torch.utils.checkpoint.checkpoint(core, q * self.scale, k, v, self.attn_drop, use_reentrant=False)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(b, n, c)))

    for m in module.modules():
        if isinstance(m, VitAttention):
            m.forward = forward.__get__(m)
    real, _ = measured(module, images)
    assert symmem("vit-b16", attention="naive", values=values)[0] == real
    d = derive("vit-b16", convention="pytorch", attention="naive", checkpoint="selective", values=values)
    assert sorted(t.name for t in d.terms if t.role == "checkpoint") == ["blocks.q_scaled", "blocks.qkv"]


@pytest.mark.parametrize("model, options", [("gpt2", {"attention": "naive"}), ("llama", {"attention": "naive"}),
                                            ("vit-b16", {"attention": "naive"}), ("bert-base", {"attention": "naive"}),
                                            ("llama", {"attention": "sdpa"})])
def test_no_uncounted_warning_once_counted(model, options):
    """What the recompute needs is counted now: no UncountedInput warning (SDPA keeps q, k, v itself)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        derive(model, convention="pytorch", checkpoint="selective", values={"L": 2}, **options).value("activations")
    assert not [w for w in caught if issubclass(w.category, UncountedInput)]
