"""BERT as Hugging Face builds it: ``BertModel`` with its pooler, **transformers 5.23** (``modeling_bert.py``).

Embeddings: word (V) + token type (2 types) + position (512 positions, ids a slice of a buffer), LayerNorm,
dropout.  The token-type ids are made in the forward: ``torch.gather`` of the zero ``token_type_ids`` buffer
at the position ids gives a new (1, S) int64 tensor, expanded to (B, S), which the embedding keeps (8·S
bytes).  ``L`` post-LN layers: Q, K, V linears split into heads, attention (``attention="sdpa"``, the default as
in transformers: ``sdpa_attention_forward``; ``"naive"``: ``eager_attention_forward``, ``(Q K^T) * scaling``,
softmax, dropout, ``@ V``; without an attention mask ``create_bidirectional_mask`` gives none to either), output
dense, dropout, ``LayerNorm(x + input)``; intermediate dense, exact GELU, output dense, dropout,
``LayerNorm(x + input)``.  The pooler is ``tanh(dense(x[:, 0]))``.  No MLM head.

Checked against transformers 5.23.0 on the CPU by tracing ``BertModel`` (``tests/test_zoo_drift.py``).
Earlier releases (4.3x/4.4x, which this builder followed before) sliced the token-type buffer (a view of
module state, kept by nothing) and added an extended all-ones (B, 1, 1, S) mask in the eager path.

``bert-base``: H=768, h=12, L=12; ``bert-large``: H=1024, h=16, L=24; F=4H, V=30522, S=512.

>>> from symmem import derive
>>> derive("bert-base").value("parameters")
109482240
"""

from __future__ import annotations

import sympy

from ..graph import GraphBuilder, Model
from ..symbols import B, F, H, L, S, V, h

POSITIONS, TYPES = 512, 2
_SIZES = {"base": (768, 12, 12), "large": (1024, 16, 24)}


def _self_attention(g: GraphBuilder, x: str, kind: str, dropout: float) -> str:
    hd = H / h
    heads = []
    for part in ("query", "key", "value"):
        t = g.op("linear", x, name=part, role="qkv", out_features=H)
        t = g.op("reshape", t, name=f"{part}_split", shape=(B, S, h, hd))
        if part == "query":
            g.assume(sympy.Eq(sympy.Mod(H, h), 0))  # the heads divide the hidden size
        heads.append(g.op("transpose", t, name=f"{part}_heads", dim0=1, dim1=2))
    q, k, v = heads
    if kind == "naive":
        kt = g.op("transpose", k, name="key_t", dim0=-1, dim1=-2)
        # q and k^T are strided views of the projections: the batched matmul keeps contiguous copies (strides)
        s = g.op("matmul", q, kt, name="scores", role="attn_scores")
        s = g.op("scale", s, name="scaled", factor=hd ** -0.5)
        s = g.op("softmax", s, name="softmax", role="attn_probs", dim=-1)
        s = g.op("dropout", s, name="attn_dropout", role="attn_dropout", p=dropout)
        out = g.op("matmul", s, v, name="attn_v")
        # eager_attention_forward(module, query, key, value, None): under --checkpoint selective the checkpoint
        # saves q, k, v (views of the three projections); BertLayer holds the weights it returns
        # (``self_attention_output, _ = self.attention(...)``) until it returns: True
        g.graph.graph.setdefault("recomputed_core", {})[out] = ((q, k, v), (), True)
    else:
        out = g.op("attention", q, k, v, name="sdpa", role="attention", dropout=dropout)
    out = g.op("transpose", out, name="merge_t", dim0=1, dim1=2)
    out = g.op("contiguous", out, name="merge", role="proj_input")
    return g.op("reshape", out, name="merge_view", shape=(B, S, H))


def build_bert(name: str, size: str, attention: str = "sdpa", dropout: float = 0.1) -> Model:
    hidden, heads, layers = _SIZES[size]
    g = GraphBuilder(name)
    ids = g.input("input_ids", (B, S), dtype="int64")
    with g.group("embed"), g.scope("embeddings"):
        word = g.op("embedding", ids, name="word_embeddings", num_embeddings=V, dim=H)
        g.op("buffer", name="token_type_ids", shape=(1, POSITIONS), dtype="int64")
        # torch.gather(token_type_ids.expand(1, -1), 1, position_ids): a new (1, S) tensor made in the forward
        types = g.op("constant", name="token_type_gather", shape=(1, S), dtype="int64")
        types = g.op("expand", types, name="token_type_expand", shape=(B, S))
        types = g.op("embedding", types, name="token_type_embeddings", num_embeddings=TYPES, dim=H)
        x = g.op("add", word, types, name="add_types")
        pos = g.op("buffer", name="position_ids", shape=(1, POSITIONS), dtype="int64")
        pos = g.op("slice", pos, name="position_slice", dim=1, start=0, stop=S)
        pos = g.op("embedding", pos, name="position_embeddings", num_embeddings=POSITIONS, dim=H)
        x = g.op("add", x, pos, name="add_positions")
        x = g.op("layernorm", x, name="LayerNorm", eps=1e-12)
        x = g.op("dropout", x, name="dropout", p=dropout)
    with g.group("layer"), g.repeat("layer", L, x, input_role="attn_input") as layer:
        with g.scope("attention"):
            a = _self_attention(g, layer.input, attention, dropout)
            a = g.op("linear", a, name="output.dense", out_features=H)
            a = g.op("dropout", a, name="output.dropout", p=dropout)
            a = g.op("add", a, layer.input, name="output.add", role="residual")
            a = g.op("layernorm", a, name="output.LayerNorm", role="mlp_input", eps=1e-12)
        m = g.op("linear", a, name="intermediate.dense", role="mlp_hidden", out_features=F)
        m = g.op("gelu", m, name="intermediate.gelu", role="mlp_act")
        m = g.op("linear", m, name="output.dense", out_features=H)
        m = g.op("dropout", m, name="output.dropout", p=dropout)
        m = g.op("add", m, a, name="output.add", role="residual")
        layer.output(g.op("layernorm", m, name="output.LayerNorm", eps=1e-12))
    assert layer.result is not None
    # position embeddings have {POSITIONS} rows: S may not exceed them (checked with numbers when derived)
    g.graph.assume("embeddings.position_embeddings", sympy.Le(S, POSITIONS))
    with g.group("pooler"), g.scope("pooler"):
        first = g.op("select", layer.result, name="first_token", dim=1, index=0)
        p = g.op("linear", first, name="dense", out_features=H)
        g.op("tanh", p, name="activation")
    g.graph.graph["no_loss"] = ("HF BertModel has no LM head (its output is the pooled (B, H) tensor, not logits "
                                "over a vocabulary); use gpt2 or llama for a language-model loss")
    defaults = {B: 32, S: 512, H: hidden, h: heads, L: layers, F: 4 * H, V: 30522}
    desc = f"BERT-{size} (HF BertModel with pooler, transformers 5.23; {attention} attention, dropout {dropout})"
    return Model(name, g.finish(), defaults, (B, S, H, h, L, F, V), desc, layer="layer",
                 options={"attention": attention, "dropout": dropout})

