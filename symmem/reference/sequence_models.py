"""Faithful PyTorch references of the sequence models: timm ViT, HF GPT-2, HF BERT, HF Llama.

Each class mirrors the original ``forward`` op by op (the ops decide what autograd keeps), not the original's
configuration machinery: timm ``vision_transformer.py`` (``Attention``, ``Block``, ``VisionTransformer`` with
class-token pooling) and, from **transformers 5.23**, ``modeling_gpt2.py`` (``Conv1D``, ``GPT2Attention`` with
``eager_attention_forward`` or ``sdpa_attention_forward``, ``NewGELUActivation``), ``modeling_bert.py``
(``BertEmbeddings`` with its gathered token-type ids, eager and SDPA self-attention, post-LN, pooler) and
``modeling_llama.py`` (``LlamaRMSNorm``, ``LlamaRotaryEmbedding``, ``apply_rotary_pos_emb``, ``repeat_kv`` in
the eager path, SDPA with ``enable_gqa``, SwiGLU MLP, untied head), with the ``DynamicCache`` update that a
training forward with the default ``use_cache=True`` runs (:func:`cache_update`).  Llama's also holds what HF's
forward holds while it runs: its ``LlamaModel`` part (:meth:`LlamaForCausalLM.model`) makes the position ids and
eager attention's whole (B, 1, S, S) mask (:func:`eager_mask`), which go when it returns (before ``lm_head``), and
the :class:`DynamicCache` holds every layer's key and value copies until the forward returns.  Not mirrored,
because autograd keeps none of it: HF's output objects and, for GPT-2, the additive (B, 1, S, S) causal mask made
once per forward (GPT-2 builds a (1, 1, S, S) one per layer here).  :func:`reference` builds one from symbol
values, in training mode, with its inputs.  Needs the ``torch`` extra.

>>> module, inputs = reference("gpt2", {"B": 2, "S": 8, "H": 16, "h": 2, "L": 1, "V": 50})
>>> tuple(module(*inputs).shape)
(2, 8, 50)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import SymmemError
from . import register


def run_layers(layers: Any, x: torch.Tensor, checkpoint: str, *args: Any) -> torch.Tensor:
    """``x`` through ``layers`` in turn; with ``checkpoint`` ``full`` each layer, with ``every-K`` each run of K
    layers, under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (what the training regime's
    activation checkpointing means).  Layers already wrapped by ``checkpoint_wrapper`` (under FSDP2, torchtitan's
    order: :func:`symmem.record.sharded.run_sharded`) checkpoint themselves: with ``full`` they are run as they are."""
    if checkpoint == "none" or (checkpoint == "full" and all(hasattr(m, "_checkpoint_wrapped_module")
                                                             for m in layers)):
        for layer in layers:
            x = layer(x, *args)
        return x
    from torch.utils.checkpoint import checkpoint as ckpt

    if checkpoint != "full" and not checkpoint.startswith("every-"):
        raise SymmemError(f"the references checkpoint 'full' or 'every-K', not {checkpoint!r}")
    k = 1 if checkpoint == "full" else int(checkpoint.removeprefix("every-"))
    layers = list(layers)

    def segment(x: torch.Tensor, *a: Any, part: list[Any]) -> torch.Tensor:
        for layer in part:
            x = layer(x, *a)
        return x

    for i in range(0, len(layers), k):
        x = ckpt(segment, x, *args, part=layers[i:i + k], use_reentrant=False)
    return x


# -- timm VisionTransformer ----------------------------------------------------------------------------
class VitAttention(nn.Module):
    """timm ``Attention`` (qk_norm off): fused SDPA or the explicit softmax path."""

    def __init__(self, dim: int, heads: int, drop: float, fused: bool) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.fused_attn = fused
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.attn_drop = nn.Dropout(drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.transpose(1, 2).reshape(b, n, c)
        return self.proj_drop(self.proj(x))


class VitBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int, drop: float, fused: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = VitAttention(dim, heads, drop, fused)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.fc1, self.act, self.drop1 = nn.Linear(dim, mlp), nn.GELU(), nn.Dropout(drop)
        self.fc2, self.drop2 = nn.Linear(mlp, dim), nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.drop2(self.fc2(self.drop1(self.act(self.fc1(self.norm2(x))))))


class VisionTransformer(nn.Module):
    """timm ``VisionTransformer``: patch conv, class token, position embedding, blocks, norm, token head."""

    #: activation checkpointing of the layers: none, full or every-K (:func:`run_layers`)
    checkpoint = "none"

    def __init__(self, image: tuple[int, int], patch: int, chans: int, dim: int, depth: int, heads: int,
                 mlp: int, classes: int, drop: float, fused: bool) -> None:
        super().__init__()
        tokens = (image[0] // patch) * (image[1] // patch)
        self.proj = nn.Conv2d(chans, dim, patch, patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.pos_drop = nn.Dropout(drop)
        self.blocks = nn.Sequential(*(VitBlock(dim, heads, mlp, drop, fused) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head_drop = nn.Dropout(drop)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed)
        x = self.norm(run_layers(self.blocks, x, self.checkpoint))
        return self.head(self.head_drop(x[:, 0]))


# -- Hugging Face GPT-2 ----------------------------------------------------------------------------------
class Conv1D(nn.Module):
    """transformers ``pytorch_utils.Conv1D``: ``addmm(bias, x.view(-1, nx), weight)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = x.size()[:-1] + (self.nf,)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class NewGELU(nn.Module):
    """transformers ``NewGELUActivation`` (``gelu_new``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return 0.5 * input * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (input + 0.044715 * torch.pow(input, 3.0))))


def cache_update(states: torch.Tensor) -> torch.Tensor:
    """transformers 5.23 ``DynamicLayer.update`` on an empty cache: ``torch.cat([empty, states], dim=-2)``, a
    contiguous copy (``use_cache=True``, the config default, also in a training forward)."""
    return torch.cat([torch.tensor([], dtype=states.dtype, device=states.device), states], dim=-2)


class DynamicCache:
    """transformers 5.23 ``DynamicCache`` as a training forward uses it: each layer's ``update`` makes the key and
    value copies (:func:`cache_update`) and the cache holds them until it is let go (``LlamaForCausalLM.forward``'s
    output holds it).  An object, not a list: engines that rebuild a module's container arguments (FSDP2's
    pre-forward hook) pass it through as they pass HF's."""

    def __init__(self) -> None:
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def update(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.layers.append((cache_update(key), cache_update(value)))
        return self.layers[-1]


class GPT2Attention(nn.Module):
    """transformers 5.23 ``GPT2Attention`` with ``eager_attention_forward`` or ``sdpa_attention_forward``."""

    def __init__(self, dim: int, heads: int, drop: float, sdpa: bool, cache: bool) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = dim, heads, dim // heads
        self.split_size = dim
        self.scaling = self.head_dim ** -0.5
        self.sdpa, self.cache = sdpa, cache
        self.c_attn = Conv1D(3 * dim, dim)
        self.c_proj = Conv1D(dim, dim)
        self.attn_dropout = nn.Dropout(drop)
        self.resid_dropout = nn.Dropout(drop)

    def _attn(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) * self.scaling
        # create_causal_mask's additive mask (HF makes it (B, 1, S, S) once per forward; add keeps nothing)
        s = query.size(-2)
        causal = torch.full((s, s), torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype,
                            device=attn_weights.device).triu(1)  # on the model's device, as HF builds it
        attn_weights = attn_weights + causal
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights.type(value.dtype)
        attn_weights = self.attn_dropout(attn_weights)
        return torch.matmul(attn_weights, value).transpose(1, 2)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output and, under selective recomputation (``mask`` given: the model's (B, 1, S, S) additive mask),
        the weights the checkpointed core returns, which the block holds until it returns (HF's
        ``attn_output, attn_weights = attention_interface(...)``)."""
        query, key, value = self.c_attn(hidden_states).split(self.split_size, dim=2)
        shape = (*query.shape[:-1], -1, self.head_dim)
        query, key, value = (t.view(shape).transpose(1, 2) for t in (query, key, value))
        if self.cache:
            key, value = cache_update(key), cache_update(value)
        weights = None
        if mask is not None:  # --checkpoint selective: eager_attention_forward under a non-reentrant checkpoint
            from torch.utils.checkpoint import checkpoint as ckpt

            out, weights = ckpt(gpt2_eager_attention_forward, self, query, key, value, mask, self.scaling,
                                self.attn_dropout.p, use_reentrant=False)
        elif self.sdpa:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=None,
                                                 dropout_p=self.attn_dropout.p if self.training else 0.0,
                                                 scale=self.scaling, is_causal=query.size(-2) > 1)
            out = out.transpose(1, 2).contiguous()
        else:
            out = self._attn(query, key, value)
        out = out.reshape(*out.shape[:-2], -1).contiguous()
        return self.resid_dropout(self.c_proj(out)), weights


def gpt2_eager_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: torch.Tensor, scaling: float, dropout: float
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 5.23 ``eager_attention_forward`` (GPT-2's), the core selective recomputation checkpoints."""
    attn_weights = torch.matmul(query, key.transpose(-1, -2)) * scaling
    attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = attn_weights.type(value.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2), attn_weights


class GPT2Block(nn.Module):
    def __init__(self, dim: int, heads: int, inner: int, drop: float, sdpa: bool, gelu: str, cache: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim, eps=1e-5)
        self.attn = GPT2Attention(dim, heads, drop, sdpa, cache)
        self.ln_2 = nn.LayerNorm(dim, eps=1e-5)
        self.c_fc, self.c_proj = Conv1D(inner, dim), Conv1D(dim, inner)
        self.act: nn.Module = NewGELU() if gelu == "new" else nn.GELU(approximate="tanh")
        self.dropout = nn.Dropout(drop)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        residual = hidden_states
        hidden_states, _weights = self.attn(self.ln_1(hidden_states), mask)  # held until the block returns
        hidden_states = hidden_states + residual
        residual = hidden_states
        hidden_states = self.dropout(self.c_proj(self.act(self.c_fc(self.ln_2(hidden_states)))))
        return residual + hidden_states


class GPT2LMHeadModel(nn.Module):
    #: activation checkpointing of the layers: none, full or every-K (:func:`run_layers`)
    checkpoint = "none"

    def __init__(self, vocab: int, positions: int, dim: int, depth: int, heads: int, inner: int, drop: float,
                 sdpa: bool, gelu: str, cache: bool = True) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(positions, dim)
        self.drop = nn.Dropout(drop)
        self.h = nn.ModuleList(GPT2Block(dim, heads, inner, drop, sdpa, gelu, cache) for _ in range(depth))
        self.ln_f = nn.LayerNorm(dim, eps=1e-5)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    #: ``forward(input_ids, labels)`` returns the loss, as HF does when given labels (used by ``verify --loss``)
    takes_labels = True

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        position_ids = torch.arange(input_ids.size(-1), device=input_ids.device).unsqueeze(0)
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        if self.checkpoint == "selective":
            # create_causal_mask's (B, 1, S, S) additive mask, made once, passed to every layer's checkpointed
            # core (which keeps it); without selective the per-layer (S, S) one above is the same to autograd
            mask = eager_mask(*input_ids.shape, hidden_states.dtype, hidden_states.device)
            hidden_states = run_layers(self.h, self.drop(hidden_states), "none", mask)
        else:
            hidden_states = run_layers(self.h, self.drop(hidden_states), self.checkpoint)
        lm_logits = self.lm_head(self.ln_f(hidden_states))
        return lm_logits if labels is None else causal_lm_loss(lm_logits, labels)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """HF's loss with labels, transformers 5.23 ``ForCausalLMLoss``: upcast, pad the labels with -100, shift by
    one token, flatten, ``cross_entropy(..., ignore_index=-100)``."""
    logits = logits.float()
    labels = nn.functional.pad(labels, (0, 1), value=-100)
    shift_labels = labels[..., 1:].contiguous()
    logits = logits.view(-1, logits.size(-1))
    return nn.functional.cross_entropy(logits, shift_labels.view(-1), ignore_index=-100)


# -- Hugging Face BERT -----------------------------------------------------------------------------------
class BertEmbeddings(nn.Module):
    def __init__(self, vocab: int, dim: int, positions: int, types: int, drop: float) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, dim, padding_idx=0)
        self.position_embeddings = nn.Embedding(positions, dim)
        self.token_type_embeddings = nn.Embedding(types, dim)
        self.LayerNorm = nn.LayerNorm(dim, eps=1e-12)
        self.dropout = nn.Dropout(drop)
        self.register_buffer("position_ids", torch.arange(positions).expand((1, -1)), persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        batch, seq_length = input_ids.size()
        position_ids = self.position_ids[:, 0: seq_length]
        # transformers 5.23: the zero buffer gathered at the position ids, a new (1, S) tensor, then expanded
        buffered = torch.gather(self.token_type_ids.expand(position_ids.shape[0], -1), dim=1, index=position_ids)
        token_type_ids = buffered.expand(batch, seq_length)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    """transformers 5.23 ``BertSelfAttention`` with ``eager_attention_forward`` or ``sdpa_attention_forward``
    (no attention mask: ``create_bidirectional_mask`` gives none for unpadded input)."""

    def __init__(self, dim: int, heads: int, drop: float, sdpa: bool) -> None:
        super().__init__()
        self.num_attention_heads, self.attention_head_size = heads, dim // heads
        self.all_head_size = dim
        self.scaling = self.attention_head_size ** -0.5
        self.query, self.key, self.value = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.dropout = nn.Dropout(drop)
        self.dropout_prob = drop
        self.sdpa = sdpa

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.attention_head_size)
        query = self.query(hidden_states).view(hidden_shape).transpose(1, 2)
        key = self.key(hidden_states).view(hidden_shape).transpose(1, 2)
        value = self.value(hidden_states).view(hidden_shape).transpose(1, 2)
        if self.sdpa:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=None,
                                                 dropout_p=self.dropout_prob if self.training else 0.0,
                                                 scale=self.scaling, is_causal=False)
            out = out.transpose(1, 2).contiguous()
        else:
            attn_weights = torch.matmul(query, key.transpose(2, 3)) * self.scaling
            attn_weights = nn.functional.softmax(attn_weights, dim=-1)
            attn_weights = self.dropout(attn_weights)
            out = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
        return out.reshape(*input_shape, -1).contiguous()


class BertLayer(nn.Module):
    """``BertAttention`` (self + ``BertSelfOutput``), ``BertIntermediate``, ``BertOutput``: post-LN."""

    def __init__(self, dim: int, heads: int, inner: int, drop: float, sdpa: bool) -> None:
        super().__init__()
        self.self = BertSelfAttention(dim, heads, drop, sdpa)
        self.attn_dense, self.attn_dropout = nn.Linear(dim, dim), nn.Dropout(drop)
        self.attn_LayerNorm = nn.LayerNorm(dim, eps=1e-12)
        self.intermediate = nn.Linear(dim, inner)
        self.out_dense, self.out_dropout = nn.Linear(inner, dim), nn.Dropout(drop)
        self.out_LayerNorm = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        a = self.attn_dropout(self.attn_dense(self.self(hidden_states)))
        a = self.attn_LayerNorm(a + hidden_states)
        m = nn.functional.gelu(self.intermediate(a))
        m = self.out_dropout(self.out_dense(m))
        return self.out_LayerNorm(m + a)


class BertModel(nn.Module):
    #: activation checkpointing of the layers: none, full or every-K (:func:`run_layers`)
    checkpoint = "none"

    def __init__(self, vocab: int, dim: int, depth: int, heads: int, inner: int, drop: float, sdpa: bool,
                 positions: int = 512, types: int = 2) -> None:
        super().__init__()
        self.embeddings = BertEmbeddings(vocab, dim, positions, types, drop)
        self.layer = nn.ModuleList(BertLayer(dim, heads, inner, drop, sdpa) for _ in range(depth))
        self.pooler = nn.Linear(dim, dim)
        self.sdpa = sdpa

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The pooled output (HF also returns the last hidden states, which the pooler already consumed)."""
        hidden_states = self.embeddings(input_ids)
        hidden_states = run_layers(self.layer, hidden_states, self.checkpoint)
        return torch.tanh(self.pooler(hidden_states[:, 0]))


# -- Hugging Face Llama ----------------------------------------------------------------------------------
class LlamaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)  # transformers 5.23
        self.attention_scaling = 1.0

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class LlamaAttention(nn.Module):
    """transformers 5.23 ``LlamaAttention``: the ``DynamicCache`` update, then ``eager_attention_forward``
    (``repeat_kv``) or ``sdpa_attention_forward`` (``enable_gqa`` for G < h, no ``repeat_kv``)."""

    def __init__(self, dim: int, heads: int, kv_heads: int, drop: float, sdpa: bool, cache: bool = True) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_key_value_heads = heads, dim // heads, kv_heads
        self.num_key_value_groups = heads // kv_heads
        self.scaling = self.head_dim ** -0.5
        self.attention_dropout = drop
        self.sdpa, self.cache = sdpa, cache
        self.q_proj = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: DynamicCache | None = None,
                position_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The output and the attention weights (eager), which the decoder layer holds until it returns.
        ``position_ids`` given: selective recomputation, eager attention under a non-reentrant checkpoint, called
        as HF calls it (the position ids a keyword argument the checkpoint holds)."""
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:  # the DynamicCache: held until LlamaForCausalLM.forward returns
            key_states, value_states = cache.update(key_states, value_states)
        elif self.cache:  # checkpointed layers: HF passes no cache there (a copy made, not held)
            key_states, value_states = cache_update(key_states), cache_update(value_states)
        p = self.attention_dropout if self.training else 0.0
        attn_weights = None
        if position_ids is not None:
            from torch.utils.checkpoint import checkpoint as ckpt

            attn_output, attn_weights = ckpt(eager_attention_forward, self, query_states, key_states, value_states,
                                             attention_mask, self.scaling, p, position_ids=position_ids,
                                             use_reentrant=False)
        elif self.sdpa:
            gqa = {"enable_gqa": True} if self.num_key_value_groups > 1 else {}
            attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=None,
                                                         dropout_p=p, scale=self.scaling,
                                                         is_causal=query_states.shape[2] > 1, **gqa)
            attn_output = attn_output.transpose(1, 2).contiguous()
        else:  # a function of its own, as HF's: the caller's key_states and value_states live until it returns
            attn_output, _ = eager_attention_forward(self, query_states, key_states, value_states,
                                                     attention_mask, self.scaling, p)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


def eager_attention_forward(module: LlamaAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor, scaling: float, dropout: float, **kwargs: Any
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers 5.23 ``eager_attention_forward`` (Llama's): ``repeat_kv``, the scores, the float32 softmax,
    dropout, ``@ V``."""
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights + attention_mask[:, :, :, : key_states.shape[-2]]
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class LlamaDecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, inner: int, drop: float, sdpa: bool,
                 cache: bool = True) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(dim, heads, kv_heads, drop, sdpa, cache)
        self.gate_proj = nn.Linear(dim, inner, bias=False)
        self.up_proj = nn.Linear(dim, inner, bias=False)
        self.down_proj = nn.Linear(inner, dim, bias=False)
        self.act_fn = nn.SiLU()
        self.input_layernorm = LlamaRMSNorm(dim)
        self.post_attention_layernorm = LlamaRMSNorm(dim)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None, cache: DynamicCache | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        # the weights: held until the layer returns; the position ids only under selective (a tensor-parallel
        # plan's PrepareModuleInput names the four positional inputs)
        more = {} if position_ids is None else {"position_ids": position_ids}
        hidden_states, _weights = self.self_attn(hidden_states, position_embeddings, attention_mask, cache, **more)
        hidden_states = residual + hidden_states
        residual = hidden_states
        x = self.post_attention_layernorm(hidden_states)
        hidden_states = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return residual + hidden_states


class LlamaForCausalLM(nn.Module):
    #: activation checkpointing of the layers: none, full or every-K (:func:`run_layers`)
    checkpoint = "none"

    def __init__(self, vocab: int, dim: int, depth: int, heads: int, kv_heads: int, inner: int, drop: float,
                 sdpa: bool, cache: bool = True) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaDecoderLayer(dim, heads, kv_heads, inner, drop, sdpa, cache)
                                    for _ in range(depth))
        self.norm = LlamaRMSNorm(dim)
        self.rotary_emb = LlamaRotaryEmbedding(dim // heads)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.sdpa, self.cache = sdpa, cache

    takes_labels = True

    def model(self, input_ids: torch.Tensor, cache: DynamicCache | None) -> torch.Tensor:
        """``LlamaModel.forward``: its locals (the position ids, eager attention's mask, the rotary tables) go when
        it returns, after the final norm -- before ``lm_head``.  The sequence is the ids' (HF counts the
        embedding's: the same on one device; under sequence parallelism the ids are whole, the embedding's output
        split)."""
        inputs_embeds = self.embed_tokens(input_ids)
        batch, seq = input_ids.shape
        position_ids = (torch.arange(seq, device=inputs_embeds.device) + 0).unsqueeze(0)  # + past_seen_tokens
        causal_mask = None
        if not self.sdpa:
            causal_mask = eager_mask(batch, seq, inputs_embeds.dtype, inputs_embeds.device)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        if self.checkpoint == "selective":  # each layer's core checkpointed: HF passes the position ids along
            hidden_states = run_layers(self.layers, hidden_states, "none", position_embeddings, causal_mask, cache,
                                       position_ids)
        else:
            hidden_states = run_layers(self.layers, hidden_states, self.checkpoint, position_embeddings,
                                       causal_mask, cache)
        return self.norm(hidden_states)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        # the DynamicCache (use_cache=True, the config's default, also in training) holds every layer's key and
        # value copies until this forward returns; HF turns it off in checkpointed layers
        cache = DynamicCache() if self.cache and self.checkpoint in ("none", "selective") else None
        logits = self.lm_head(self.model(input_ids, cache))
        return logits if labels is None else causal_lm_loss(logits, labels)


def eager_mask(batch: int, seq: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """transformers 5.23 ``create_causal_mask`` for eager attention (``sdpa_mask`` then ``eager_mask``): the
    boolean ``kv_idx <= q_idx`` over broadcast index ranges, expanded to (B, 1, S, S), then ``torch.where`` into a
    whole (B, 1, S, S) additive float mask (0 where attended, the dtype's minimum elsewhere).

    >>> eager_mask(2, 3, torch.float32, torch.device("cpu")).shape
    torch.Size([2, 1, 3, 3])
    """
    q_arange = torch.arange(seq, device=device) + 0  # + q_offset
    kv_arange = torch.arange(seq, device=device) + 0  # + kv_offset
    allowed = kv_arange[None, None, None, :] <= q_arange[None, None, :, None]
    allowed = allowed.expand(batch, -1, seq, seq)
    return torch.where(allowed, torch.zeros((), device=device, dtype=dtype), torch.finfo(dtype).min)


# -- construction from symbol values ---------------------------------------------------------------------
def _need(values: Mapping[str, int], *names: str) -> list[int]:
    missing = [n for n in names if n not in values]
    if missing:
        raise SymmemError(f"the reference needs values for {', '.join(missing)}")
    return [int(values[n]) for n in names]


def reference(model: str, values: Mapping[str, int], **options: Any) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A reference module for ``model`` (``vit-*``, ``gpt2``, ``bert-*``, ``llama``) in training mode, and inputs.

    ``values`` are symbol values (``B``, ``S``, ``H``, ``h``, ``L``, ``F``, ``V``, ``G``; ViT: ``Hi``, ``Wi``,
    ``C``, ``K``); missing ``F`` is 4H, missing ``G`` is h.  ``options`` are the builder's options.
    """
    attention = options.get("attention")
    sdpa = attention == "sdpa"
    dropout = float(options.get("dropout", 0.0))
    b = _need(values, "B")[0]
    hidden, heads, layers = _need(values, "H", "h", "L")
    inner = int(values.get("F", 4 * hidden))
    if model.startswith("vit-"):
        chans, hi, wi = int(values.get("C", 3)), *_need(values, "Hi", "Wi")
        patch = int(options.get("patch", 16))
        m: nn.Module = VisionTransformer((hi, wi), patch, chans, hidden, layers, heads, inner,
                                         int(values.get("K", 10)), dropout, sdpa)
        inputs: tuple[torch.Tensor, ...] = (torch.randn(b, chans, hi, wi),)
    else:
        seq, vocab = _need(values, "S", "V")
        ids = torch.randint(0, vocab, (b, seq))
        inputs = (ids,)
        if model == "gpt2":
            m = GPT2LMHeadModel(vocab, 1024, hidden, layers, heads, inner, dropout, sdpa,
                                options.get("gelu", "new"), options.get("cache", "dynamic") == "dynamic")
        elif model.startswith("bert"):
            m = BertModel(vocab, hidden, layers, heads, inner, dropout, sdpa)
        elif model == "llama":
            kv = int(values.get("G", heads))
            if heads % kv:
                raise SymmemError(f"llama: h={heads} query heads are not a multiple of G={kv} key/value heads")
            m = LlamaForCausalLM(vocab, hidden, layers, heads, kv, inner, dropout, sdpa,
                                 options.get("cache", "dynamic") == "dynamic")
        else:
            raise SymmemError(f"no sequence reference for model {model!r}")
    m.checkpoint = str(options.get("checkpoint", "none"))  # activation checkpointing of the layers
    m.train()
    return m, inputs


def _factory(model: str) -> Any:
    def factory(numbers: Mapping[str, int], options: Mapping[str, Any]) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        return reference(model, numbers, **options)

    return factory


for _name in ("vit-ti16", "vit-s16", "vit-b16", "vit-l16", "gpt2", "bert-base", "bert-large", "llama"):
    register(_name, _factory(_name))
