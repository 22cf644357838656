"""Transformer pieces shared by the sequence models: multi-head attention, MLP, a pre-LN layer.

Roles are the vocabulary conventions key on, fixed here for every transformer builder:

============== =====================================================================================
role           tensor
============== =====================================================================================
residual       a residual-stream tensor that feeds a norm (the layer input, and x + attention)
attn_input     the normalized input of the QKV projection
qkv            the QKV projection output (Q, K and V: 3 B S H)
attn_scores    the raw attention scores Q K^T (naive attention)
attn_probs     the softmax output (naive attention)
attn_dropout   the dropout of the attention probabilities (naive attention)
attention      the fused scaled-dot-product attention output
proj_input     the merged heads, input of the output projection
mlp_input      the normalized input of the first MLP linear
mlp_hidden     the first MLP linear's output (input of the activation)
mlp_act        the activation's output (input of the second MLP linear)
patch_embed    the token sequence entering the first layer (ViT)
============== =====================================================================================
"""

from __future__ import annotations

from typing import Any

import sympy

from ..graph import GraphBuilder
from ..symbols import B, F, H, S, h


def attention(g: GraphBuilder, x: str, *, kind: str, attn_drop: float, proj_drop: float,
              causal: bool = False, qkv_bias: bool = True) -> str:
    """timm/HF-style multi-head self-attention on ``x`` (B, S, H); returns the projected output."""
    hd = H / h
    qkv = g.op("linear", x, name="qkv", role="qkv", out_features=3 * H, bias=qkv_bias)
    qkv = g.op("reshape", qkv, name="qkv_heads", shape=(B, S, 3, h, hd))
    g.assume(sympy.Eq(sympy.Mod(H, h), 0))  # the heads divide the hidden size
    qkv = g.op("permute", qkv, name="qkv_perm", dims=(2, 0, 3, 1, 4))
    q = g.op("select", qkv, name="q", dim=0, index=0, split=True)  # qkv.unbind(0)
    k = g.op("select", qkv, name="k", dim=0, index=1, split=True)
    v = g.op("select", qkv, name="v", dim=0, index=2, split=True)
    if kind == "naive":
        q = g.op("scale", q, name="q_scaled", factor=sympy.sqrt(hd) ** -1)
        kt = g.op("transpose", k, name="k_t", dim0=-2, dim1=-1)
        # q (scaled in the QKV output's memory order) and k^T are strided views of it: the batched matmul keeps
        # contiguous copies (the matmul's rule sees it in their strides)
        scores = g.op("matmul", q, kt, name="scores", role="attn_scores")
        probs = g.op("softmax", scores, name="softmax", role="attn_probs", dim=-1)
        probs = g.op("dropout", probs, name="attn_drop", role="attn_dropout", p=attn_drop)
        out = g.op("matmul", probs, v, name="attn_v")
        # the core a checkpoint wraps under --checkpoint selective (q @ k^T ... @ v) and what it is called with
        g.graph.graph.setdefault("recomputed_core", {})[out] = ((q, k, v), (), False)
    else:
        out = g.op("attention", q, k, v, name="sdpa", role="attention", causal=causal, dropout=attn_drop)
    # merging the heads of a transposed tensor copies (its strides say so)
    out = g.op("transpose", out, name="merge_t", dim0=1, dim1=2)
    out = g.op("reshape", out, name="merge", role="proj_input", shape=(B, S, H))
    out = g.op("linear", out, name="proj", out_features=H)
    return g.op("dropout", out, name="proj_drop", p=proj_drop)


def mlp(g: GraphBuilder, x: str, *, act: str = "gelu", drop: float = 0.0) -> str:
    """fc1 -> activation -> dropout -> fc2 -> dropout (timm's Mlp)."""
    y = g.op("linear", x, name="fc1", role="mlp_hidden", out_features=F)
    y = g.op(act, y, name="act", role="mlp_act")
    y = g.op("dropout", y, name="drop1", p=drop)
    y = g.op("linear", y, name="fc2", out_features=H)
    return g.op("dropout", y, name="drop2", p=drop)


def prenorm_layer(g: GraphBuilder, x: str, *, attention_kind: str, dropout: float = 0.0,
                  attn_dropout: float | None = None, eps: float = 1e-6, **kw: Any) -> str:
    """x + attn(norm1(x)); then + mlp(norm2(.)).  ``x`` is the layer input (role ``residual``)."""
    a = g.op("layernorm", x, name="norm1", role="attn_input", eps=eps)
    a = attention(g, a, kind=attention_kind, attn_drop=dropout if attn_dropout is None else attn_dropout,
                  proj_drop=dropout, **kw)
    x = g.op("add", x, a, name="add1", role="residual")
    m = g.op("layernorm", x, name="norm2", role="mlp_input", eps=eps)
    m = mlp(g, m, drop=dropout)
    return g.op("add", x, m, name="add2")
