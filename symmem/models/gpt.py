"""GPT-2 as Hugging Face builds it: ``GPT2LMHeadModel`` of **transformers 5.23** (``modeling_gpt2.py``).

Token and position embeddings (``wte`` + ``wpe`` of 1024 positions), embedding dropout, ``L`` pre-LN blocks
[``ln_1``, ``c_attn`` (a ``Conv1D``: ``addmm`` on the flattened tokens), split into Q, K, V and heads,
attention, ``c_proj``, dropout, residual; ``ln_2``, ``c_fc``, GELU, ``c_proj``, dropout, residual], ``ln_f``
and the LM head tied to ``wte``.  ``attention="sdpa"`` (the default, as transformers' ``attn_implementation``
defaults to ``"sdpa"``) is ``sdpa_attention_forward``; ``"naive"`` is ``eager_attention_forward``: ``(Q K^T) * scaling``
(a Python float: no tensor kept), the additive causal mask (kept by nothing), softmax, dropout, ``@ V``;
``"sdpa"`` calls ``scaled_dot_product_attention(..., is_causal=True)``.
``gelu="new"`` writes out HF's ``gelu_new`` op by op, ``0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3)))``;
``"fused"`` is ``gelu_pytorch_tanh`` (one ``F.gelu`` call).

``cache="dynamic"`` is the config's ``use_cache=True``, which a training forward also takes: ``GPT2Model``
makes a ``DynamicCache`` whose ``update`` stores ``torch.cat([empty, k], -2)``, a contiguous copy of each
layer's key and value, and attention reads those copies.  SDPA keeps them (two (B, h, S, d) tensors per layer
more than views of ``c_attn``'s output); the eager matmuls keep them instead of copies of their own (the same
bytes).  ``cache="none"`` is ``use_cache=False`` (what gradient checkpointing sets).

Checked against transformers 5.23.0 on the CPU by tracing ``GPT2LMHeadModel`` (``tests/test_zoo_drift.py``).
Earlier releases (4.3x/4.4x, which this builder followed before) divided the scores by a 0-dim tensor
``torch.full([], sqrt(d))`` that ``div`` kept (4 bytes a layer), read a (1, 1, 1024, 1024) bool causal-mask
buffer, and built no cache in SDPA's path.

Defaults are GPT-2 small: H=768, h=12, L=12, F=4H, V=50257, S=1024.

>>> from symmem import derive
>>> derive("gpt2").value("parameters")
124439808
"""

from __future__ import annotations

import math

import sympy

from ..graph import GraphBuilder, Model
from ..symbols import B, F, H, L, S, V, h

POSITIONS = 1024  # n_positions: rows of wpe and the side of the causal-mask buffer


def gelu_new(g: GraphBuilder, x: str) -> str:
    """HF ``NewGELUActivation``: ``0.5 * x * (1.0 + tanh(sqrt(2/pi) * (x + 0.044715 * pow(x, 3))))``."""
    half = g.op("scale", x, name="gelu.half", factor=sympy.Rational(1, 2))
    cube = g.op("pow", x, name="gelu.pow", exponent=3)
    cube = g.op("scale", cube, name="gelu.cube_scaled", factor=sympy.Float(0.044715))
    inner = g.op("add", x, cube, name="gelu.inner")
    inner = g.op("scale", inner, name="gelu.inner_scaled", factor=sympy.Float(math.sqrt(2 / math.pi)))
    t = g.op("tanh", inner, name="gelu.tanh")
    t = g.op("scalar_add", t, name="gelu.one_plus", value=1)
    return g.op("mul", half, t, name="gelu.out", role="mlp_act")


def _attention(g: GraphBuilder, x: str, kind: str, dropout: float, cache: bool) -> str:
    hd = H / h
    qkv = g.op("linear", x, name="c_attn", role="qkv", out_features=3 * H)
    heads = []
    for i, part in enumerate(("query", "key", "value")):
        t = g.op("slice", qkv, name=part, dim=2, start=i * H, stop=(i + 1) * H, split=True)  # qkv.split(H, 2)
        t = g.op("reshape", t, name=f"{part}_split", shape=(B, S, h, hd))
        if part == "query":
            g.assume(sympy.Eq(sympy.Mod(H, h), 0))  # the heads divide the hidden size
        heads.append(g.op("transpose", t, name=f"{part}_heads", dim0=1, dim1=2))
    q, k, v = heads
    if cache:  # DynamicLayer.update: torch.cat([empty, states], dim=-2), a contiguous copy
        k = g.op("clone", k, name="cache_key", memory_format="contiguous")
        v = g.op("clone", v, name="cache_value", memory_format="contiguous")
    if kind == "naive":
        kt = g.op("transpose", k, name="key_t", dim0=-1, dim1=-2)
        # q (and, without the cache, k^T and v) are strided views of c_attn's output: the batched matmul keeps
        # contiguous copies; the cache's copies are contiguous and are kept themselves (the strides say which)
        w = g.op("matmul", q, kt, name="scores", role="attn_scores")
        w = g.op("scale", w, name="scaled", factor=hd ** -0.5)  # * scaling, a Python float
        # + the (B, 1, S, S) additive causal mask of create_causal_mask: add keeps nothing
        w = g.op("softmax", w, name="softmax", role="attn_probs", dim=-1)
        w = g.op("dropout", w, name="attn_dropout", role="attn_dropout", p=dropout)
        out = g.op("matmul", w, v, name="attn_v")
        # eager_attention_forward's arguments (under --checkpoint selective the checkpoint saves them): the query,
        # key and value and create_causal_mask's (B, 1, S, S) additive mask, which the graph has no node for
        # GPT2Block holds the weights it returns (``attn_output, _ = self.attn(...)``) until it returns: True
        g.graph.graph.setdefault("recomputed_core", {})[out] = ((q, k, v), (("causal_mask", (B, 1, S, S), "act"),),
                                                                True)
    else:
        out = g.op("attention", q, k, v, name="sdpa", role="attention", causal=True, dropout=dropout)
    out = g.op("transpose", out, name="merge_t", dim0=1, dim1=2)
    out = g.op("contiguous", out, name="merge", role="proj_input")
    out = g.op("reshape", out, name="merge_view", shape=(B, S, H))
    out = g.op("linear", out, name="c_proj", out_features=H)
    return g.op("dropout", out, name="resid_dropout", p=dropout)


def build_gpt2(name: str, attention: str = "sdpa", dropout: float = 0.1, gelu: str = "new",
               cache: str = "dynamic") -> Model:
    g = GraphBuilder(name)
    ids = g.input("input_ids", (B, S), dtype="int64")
    with g.group("embed"):
        tok = g.op("embedding", ids, name="wte", num_embeddings=V, dim=H)
        pos = g.op("constant", name="position_ids", shape=(1, S), dtype="int64")
        pos = g.op("embedding", pos, name="wpe", num_embeddings=POSITIONS, dim=H)
        x = g.op("add", tok, pos, name="embed_add")
        x = g.op("dropout", x, name="drop", p=dropout)
    with g.group("layer"), g.repeat("h", L, x, input_role="residual") as layer:
        with g.scope("attn"):
            a = g.op("layernorm", layer.input, name="ln_1", role="attn_input", eps=1e-5)
            a = _attention(g, a, attention, dropout, cache == "dynamic")
        x = g.op("add", a, layer.input, name="add1", role="residual")
        with g.scope("mlp"):
            m = g.op("layernorm", x, name="ln_2", role="mlp_input", eps=1e-5)
            m = g.op("linear", m, name="c_fc", role="mlp_hidden", out_features=F)
            m = gelu_new(g, m) if gelu == "new" else g.op("gelu", m, name="act", role="mlp_act", approximate="tanh")
            m = g.op("linear", m, name="c_proj", out_features=H)
            m = g.op("dropout", m, name="dropout", p=dropout)
        layer.output(g.op("add", x, m, name="add2"))
    assert layer.result is not None
    # position embeddings have {POSITIONS} rows: S may not exceed them (checked with numbers when derived)
    g.graph.assume("wpe", sympy.Le(S, POSITIONS))
    with g.group("head"):
        x = g.op("layernorm", layer.result, name="ln_f", eps=1e-5)
        g.op("linear", x, name="lm_head", out_features=V, bias=False, tied=True)
    g.graph.graph["causal_lm"] = True  # --loss: labels shifted by one token (symmem.loss)
    defaults = {B: 8, S: 1024, H: 768, h: 12, L: 12, F: 4 * H, V: 50257}
    desc = (f"GPT-2 small (HF GPT2LMHeadModel, transformers 5.23, tied head; {attention} attention, gelu {gelu}, "
            f"dropout {dropout}, cache {cache})")
    return Model(name, g.finish(), defaults, (B, S, H, h, L, F, V), desc, layer="h",
                 options={"attention": attention, "dropout": dropout, "gelu": gelu, "cache": cache})

