"""A GPT as Megatron-LM builds it and Korthikanti et al. 2022 count it: ``gpt-megatron``.

Token and position embeddings with dropout, then L pre-LN layers: LayerNorm -> QKV -> naive (materialized)
causal attention with dropout on the probabilities -> output projection -> dropout -> residual add ->
LayerNorm -> fc1 (4H) -> GeLU -> fc2 -> dropout -> residual add; a final LayerNorm and the output layer tied
to the embedding.  Unlike timm's MLP there is no dropout between the activation and fc2.  The causal mask is
one constant (S, S) buffer that Megatron's fused scale-mask-softmax applies; it costs no per-batch memory and
is not modelled.

Sizes are the models of Korthikanti et al. 2022, Table 3 (``size``: 22b, 175b (GPT-3), 530b, 1t); their
symbols map to ours as s -> S, b -> B, h -> H, a -> h, L -> L, v -> V, t -> t, p -> p.

>>> from symmem.models import build
>>> m = build("gpt-megatron", size="22b")
>>> [m.defaults[s] for s in m.free]
[4, 2048, 6144, 64, 48]
"""

from __future__ import annotations

from ..graph import GraphBuilder, Model
from ..symbols import B, F, H, L, S, V, h
from .transformer import attention

#: hidden, heads, layers (Korthikanti et al. 2022, Table 3; micro-batch 4 for 22B, 1 for the others).
SIZES = {"22b": (6144, 64, 48, 4), "175b": (12288, 96, 96, 1), "530b": (20480, 128, 105, 1),
         "1t": (25600, 160, 128, 1)}


def _layer(g: GraphBuilder, x: str, dropout: float) -> str:
    a = g.op("layernorm", x, name="norm1", role="attn_input", eps=1e-5)
    a = attention(g, a, kind="naive", attn_drop=dropout, proj_drop=dropout, causal=True)
    x = g.op("add", x, a, name="add1", role="residual")
    m = g.op("layernorm", x, name="norm2", role="mlp_input", eps=1e-5)
    m = g.op("linear", m, name="fc1", role="mlp_hidden", out_features=F)
    m = g.op("gelu", m, name="act", role="mlp_act")
    m = g.op("linear", m, name="fc2", out_features=H)
    m = g.op("dropout", m, name="drop", p=dropout)
    return g.op("add", x, m, name="add2")


def build_gpt_megatron(name: str, size: str = "175b", dropout: float = 0.1) -> Model:
    hidden, heads, layers, micro = SIZES[size]
    g = GraphBuilder(name)
    ids = g.input("tokens", (B, S), dtype="int64")
    labels = g.input("labels", (B, S), dtype="int64", role="labels")
    with g.group("embed"):
        x = g.op("embedding", ids, name="word_embeddings", num_embeddings=V, dim=H)
        pos = g.parameter("position_embeddings", (S, H))
        x = g.op("add", x, pos, name="embed_add", role="embedding")
        x = g.op("dropout", x, name="embed_drop", p=dropout)
    with g.group("layer"), g.repeat("layers", L, x, input_role="residual") as layer:
        layer.output(_layer(g, layer.input, dropout))
    assert layer.result is not None
    with g.group("head"):
        x = g.op("layernorm", layer.result, name="final_norm", eps=1e-5)
        x = g.op("linear", x, name="output", role="logits", out_features=V, bias=False, tied=True)
        g.op("cross_entropy", x, labels, name="loss", role="loss")
    defaults = {B: micro, S: 2048, H: hidden, h: heads, L: layers, F: 4 * H, V: 51200}
    desc = (f"GPT as Megatron-LM builds it (Korthikanti et al. 2022, {size.upper()}): H={hidden}, h={heads}, "
            f"L={layers}, naive causal attention, dropout {dropout}")
    return Model(name, g.finish(), defaults, (B, S, H, h, L), desc, layer="layers",
                 options={"size": size, "dropout": dropout})

