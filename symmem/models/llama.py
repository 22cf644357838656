"""Llama as Hugging Face builds it: ``LlamaForCausalLM`` of **transformers 5.23** (``modeling_llama.py``).

Token embedding (no position embedding), ``L`` pre-norm layers [``LlamaRMSNorm`` written out as HF does
(``to(float32)``, ``pow(2).mean(-1)``, ``+ eps``, ``rsqrt``, ``*``, ``to(dtype)``, ``weight *``); Q (h heads),
K and V (G heads) without bias, rotary embeddings ``q*cos + rotate_half(q)*sin`` with the cos/sin tables made
once per forward, the ``DynamicCache`` update (below), attention (``naive``: ``eager_attention_forward``,
``repeat_kv`` to h heads, ``(Q K^T) * scaling`` + the additive causal mask, float32 softmax, dropout, ``@ V``;
``sdpa``: ``sdpa_attention_forward``, ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` on the
G key/value heads, no ``repeat_kv``), ``o_proj``, residual; RMSNorm, SwiGLU ``down(silu(gate(x)) * up(x))``,
residual], a final RMSNorm and an untied LM head.

``cache="dynamic"`` (the default) is the config's ``use_cache=True``, which a training forward also takes: each
layer's key and value go through ``DynamicLayer.update``, ``torch.cat([empty, states], -2)``, a contiguous copy
that attention then reads (the same bytes as the tensors it replaces), and the ``DynamicCache`` holds every
layer's copies until ``LlamaForCausalLM.forward`` returns (its output's ``past_key_values``; with labels, after the
loss) -- past their last use where eager attention's ``repeat_kv`` copies them (1 < h/G); ``cache="none"`` is
``use_cache=False``.  What else HF's forward holds past its last use, the graph holds too (``held_until``): the
position ids and eager attention's whole (B, 1, S, S) mask (``torch.where`` over the expanded boolean mask) are
``LlamaModel.forward``'s locals, gone when it returns after the final norm (before ``lm_head``), RMSNorm's
``variance`` lives until the norm returns, the q and k projections until ``apply_rotary_pos_emb`` returns, and
with the cache the rotary key and projected value until the cache's ``update`` returns, and (eager) the rotary
query until the attention returns, without the cache with the rotary key and the projected value.  Checked
against HF's own model's training step on one device (``tests/test_hf_llama.py``, op by op through eager attention
with and without the cache) and per rank under DTensor's plan (``tests/test_model_parallel.py``).

Checked against transformers 5.23.0 on the CPU by tracing ``LlamaForCausalLM`` (``tests/test_zoo_drift.py``).
Earlier releases (4.4x, which this builder followed before) ran ``repeat_kv`` before SDPA too: for
1 < G < h the fused kernel then kept (B, h, S, d) copies of the key and value instead of the (B, G, S, d)
tensors 5.23 passes with ``enable_gqa`` (8·B·S·d·(h - G) bytes a layer in FP32 more than 5.23 keeps).

Defaults are Llama-2-7B: H=4096, h=32, G=32 (set G < h for grouped-query attention, e.g. G=8 as in
Llama-2-70B), L=32, F=11008, V=32000, S=4096.  In the eager path ``repeat_kv`` is a copy to h heads unless
G = 1 or G = h: its ``reshape`` merges the G heads with the stride-0 repeat dimension of size h/G, which PyTorch
can do as a view only if one of them is 1 (the reshape's rule finds ``Ne(G, 1) & Ne(h/G, 1)`` in the strides,
:mod:`symmem.strides`; for G = h HF returns the tensor itself).  The eager matmuls copy a key or value that is
still a view they cannot fold into ``bmm``'s batch: the rotary query, every G (its (B, S, h, d) layout), the
stride-0 repeated key and value for G = 1, and without the cache the rotary key and the projected value's view for
G = h (with it the cache's contiguous copies fold), each copy born where HF's matmul makes it (op by op as HF's,
with and without the cache); the formula is a ``Piecewise`` where the branches differ.  With SDPA the fused
kernels keep the (B, G, S, d) key and value they are given; the CPU math kernel (dropout > 0) expands them to h
heads itself.  The casts (RMSNorm's ``to(float32)``, the float32 softmax's ``.to(dtype)``) are views in FP32
and copies in 16-bit, as in PyTorch (see :func:`symmem.passes.storage.converts`).

>>> from symmem import derive
>>> derive("llama").value("parameters")
6738415616
"""

from __future__ import annotations

import sympy

from ..graph import GraphBuilder, Model
from ..symbols import B, F, G, H, L, S, V, h


def rmsnorm(g: GraphBuilder, x: str, name: str, role: str | None = None) -> str:
    """HF ``LlamaRMSNorm.forward`` op by op."""
    with g.scope(name):
        y = g.op("cast", x, name="to_float32", dtype="float32")
        var = g.op("pow", y, name="pow", exponent=2)
        var = var_mean = g.op("mean", var, name="mean", dim=-1, keepdim=True)
        var = g.op("scalar_add", var, name="add_eps", value=1e-6)
        r = g.op("rsqrt", var, name="rsqrt")
        y = normalized = g.op("mul", y, r, name="normalize")
        y = g.op("cast", y, name="to_input_dtype", dtype="act")
        w = g.parameter("weight", (H,))
        out = g.op("mul", w, y, name="scale", role=role)
    # so does the FP32 ``hidden_states``, which only 16-bit activations leave unkept (to(input_dtype) copies): read
    # under FSDP2's MixedPrecisionPolicy (passes/data_parallel.caller_holds)
    g.graph.graph.setdefault("held_by_caller", {})[normalized] = out
    # the local ``variance`` lives until the norm returns (B*S*4 bytes past rsqrt's read of it)
    g.graph.graph.setdefault("held_until", {})[var_mean] = out
    return out


def _rotary(g: GraphBuilder, x: str, cos: str, sin: str, name: str) -> str:
    """``(x * cos) + (rotate_half(x) * sin)``; ``rotate_half`` is ``cat((-x2, x1), -1)``."""
    hd = H / h
    with g.scope(name):
        a = g.op("mul", x, cos, name="mul_cos")
        x1 = g.op("slice", x, name="x1", dim=-1, start=0, stop=hd / 2)
        x2 = g.op("slice", x, name="x2", dim=-1, start=hd / 2, stop=hd)
        n = g.op("neg", x2, name="neg")
        r = g.op("concat", n, x1, name="rotate_half", dim=-1)
        b = g.op("mul", r, sin, name="mul_sin")
        return g.op("add", a, b, name="add")


def _repeat_kv(g: GraphBuilder, x: str, name: str) -> str:
    hd = H / h
    x = g.op("reshape", x, name=f"{name}_unsqueeze", shape=(B, G, 1, S, hd))
    x = g.op("expand", x, name=f"{name}_expand", shape=(B, G, h / G, S, hd))
    # a copy unless G = 1 or G = h: the strides decide (Ne(G, 1) & Ne(h/G, 1), symmem.strides)
    return g.op("reshape", x, name=f"{name}_repeat", shape=(B, h, S, hd))


def _attention(g: GraphBuilder, x: str, cos: str, sin: str, mask: str | None, kind: str, dropout: float,
               cache: bool, pos: str = "position_ids") -> str:
    held = g.graph.graph.setdefault("held_until", {})
    hd = H / h
    states, projected = [], []
    for part, heads in (("q", h), ("k", G), ("v", G)):
        t = g.op("linear", x, name=f"{part}_proj", role="qkv", out_features=heads * hd, bias=False)
        projected.append(t)
        t = g.op("reshape", t, name=f"{part}_split", shape=(B, S, heads, hd))
        if part == "q":
            g.assume(sympy.Eq(sympy.Mod(H, h), 0))  # the heads divide the hidden size
            g.assume(sympy.Eq(sympy.Mod(H / h, 2), 0))  # rotate_half splits the head dimension in two
        states.append(g.op("transpose", t, name=f"{part}_heads", dim0=1, dim1=2))
    q, k, v = states
    q = _rotary(g, q, cos, sin, "q_rope")
    k = _rotary(g, k, cos, sin, "k_rope")
    # the caller's query_states and key_states hold the projections until apply_rotary_pos_emb returns
    held[projected[0]] = held[projected[1]] = k
    if cache:  # DynamicLayer.update: torch.cat([empty, states], dim=-2), a contiguous copy
        key, value = k, v
        k = g.op("clone", k, name="cache_key", memory_format="contiguous")
        v = g.op("clone", v, name="cache_value", memory_format="contiguous")
        # key_states and value_states hold the rotary key and the projected value until update returns
        held[key] = held[value] = v
        # the DynamicCache keeps them until LlamaForCausalLM.forward returns (its output's past_key_values):
        # beyond their last use where eager attention's repeat_kv copies them (1 < h/G, B >= 2); every layer's
        held[k] = held[v] = "forward"
    if kind == "naive":
        assert mask is not None
        # LlamaAttention.forward's locals hold the rotary query (both paths) and, without the cache, the rotary
        # key and the projected value's view until it returns, past the copies the matmuls make of them
        locals_ = (q,) if cache else (q, k, v)
        key_in, value_in = k, v
        k = _repeat_kv(g, k, "k")
        v = _repeat_kv(g, v, "v")
        # the matmuls copy an operand that is a view they cannot fold into bmm's batch, as the strides decide:
        # the rotary query's (B, S, h, d) layout (every G), repeat_kv's stride-0 view for G = 1, and without the
        # cache the rotary key's and the value view's layouts for G = h (repeat_kv returns them); repeat_kv's
        # copies (1 < G < h) and the cache's fold
        kt = g.op("transpose", k, name="k_t", dim0=2, dim1=3)
        # the strides see h >= 2: with one head (h = G = 1) bmm folds the query and the key and value, which
        # are then no copies; said, not branched on (a third condition for a model no one trains)
        g.graph.graph["holds_where"] = [sympy.Ne(h, 1)]
        w = g.op("matmul", q, kt, name="scores", role="attn_scores")
        w = g.op("scale", w, name="scaled", factor=hd ** -0.5)
        w = g.op("add", w, mask, name="masked")
        w = g.op("softmax", w, name="softmax", role="attn_probs", dim=-1, dtype="float32")
        w = g.op("cast", w, name="to_query_dtype", dtype="act")
        w = g.op("dropout", w, name="attn_dropout", role="attn_dropout", p=dropout)
        out = g.op("matmul", w, v, name="attn_v")
        # eager_attention_forward(module, query, key, value, attention_mask, ..., position_ids=...): under
        # --checkpoint selective the checkpoint saves these (repeat_kv is inside it); the decoder layer holds the
        # weights it returns (``hidden_states, _ = self.self_attn(...)``) until it returns: True
        g.graph.graph.setdefault("recomputed_core", {})[out] = ((q, key_in, value_in, mask, pos), (), True)
    else:
        # enable_gqa: the kernel reads the G key/value heads; q after the rotary ops keeps the (B, S, h, d) layout
        # of the q_proj view it came from (TensorIterator).  The CPU math kernel (dropout > 0) keeps v itself only
        # when it is contiguous (the cache's copy) and not expanded to h heads (G = h): the strides say so
        out = g.op("attention", q, k, v, name="sdpa", role="attention", causal=True, dropout=dropout)
    out = g.op("transpose", out, name="merge_t", dim0=1, dim1=2)
    out = g.op("contiguous", out, name="merge", role="proj_input")
    out = g.op("reshape", out, name="merge_view", shape=(B, S, H))
    out = g.op("linear", out, name="o_proj", out_features=H, bias=False)
    if kind == "naive":  # the locals named above
        for local in locals_:
            held[local] = out
    return out


def build_llama(name: str, attention: str = "sdpa", dropout: float = 0.0, cache: str = "dynamic") -> Model:
    g = GraphBuilder(name)
    ids = g.input("input_ids", (B, S), dtype="int64")
    with g.group("embed"):
        x = embedded = g.op("embedding", ids, name="embed_tokens", num_embeddings=V, dim=H)
        pos = g.op("constant", name="position_ids", shape=(1, S), dtype="int64")
        g.op("buffer", name="rotary_emb.inv_freq", shape=(H / h / 2,), dtype="float32")  # module state
        g.op("buffer", name="rotary_emb.original_inv_freq", shape=(H / h / 2,), dtype="float32")
        cos = g.op("rope_table", pos, name="rotary_emb.cos", dim=H / h)
        sin = g.op("rope_table", pos, name="rotary_emb.sin", dim=H / h)
        cos = g.op("reshape", cos, name="cos_unsqueeze", shape=(1, 1, S, H / h))
        sin = g.op("reshape", sin, name="sin_unsqueeze", shape=(1, 1, S, H / h))
        mask = None
        if attention == "naive":
            # create_causal_mask (eager_mask): torch.where over the (B, 1, S, S) expanded boolean mask, a whole
            # (B, 1, S, S) additive float mask; kept by nothing
            mask = g.op("constant", name="causal_mask", shape=(B, 1, S, S), dtype="act")
    with g.group("layer"), g.repeat("layers", L, x, input_role="residual") as layer:
        a = rmsnorm(g, layer.input, "input_layernorm", role="attn_input")
        with g.scope("self_attn"):
            a = _attention(g, a, cos, sin, mask, attention, dropout, cache == "dynamic", pos)
        x = g.op("add", layer.input, a, name="add1", role="residual")
        m = rmsnorm(g, x, "post_attention_layernorm", role="mlp_input")
        with g.scope("mlp"):
            gate = g.op("linear", m, name="gate_proj", role="mlp_hidden", out_features=F, bias=False)
            gate = g.op("silu", gate, name="act_fn", role="mlp_gate_act")
            up = g.op("linear", m, name="up_proj", role="mlp_hidden", out_features=F, bias=False)
            m = g.op("mul", gate, up, name="gate_up", role="mlp_act")
            m = g.op("linear", m, name="down_proj", out_features=H, bias=False)
        layer.output(g.op("add", x, m, name="add2"))
    assert layer.result is not None
    # G must divide h (num_key_value_groups = h // G); checked with numbers when the model is derived.
    g.graph.assume("layers.self_attn.k_proj", sympy.Eq(sympy.Mod(h, G), 0))
    with g.group("head"):
        x = rmsnorm(g, layer.result, "norm")
        # LlamaModel.forward's locals, the position ids and eager attention's mask, live until it returns, after
        # the final norm (before lm_head)
        for local in (pos, mask):
            if local is not None:
                g.graph.graph.setdefault("held_until", {})[local] = x
        # its ``inputs_embeds`` and ``hidden_states`` too, which only 16-bit activations leave unkept (RMSNorm's
        # to(float32) copies): read under FSDP2's MixedPrecisionPolicy (passes/data_parallel.caller_holds)
        g.graph.graph.setdefault("held_by_caller", {})[embedded] = x
        g.graph.graph["result_held_by_caller"] = {"layers": x}
        g.op("linear", x, name="lm_head", out_features=V, bias=False)
    g.graph.graph["causal_lm"] = True  # --loss: labels shifted by one token (symmem.loss)
    # LlamaDecoderLayer registers its norms after self_attn and mlp, LlamaModel its norm after the layers: the
    # order model.parameters() lists them in, and a for-loop optimizer steps them in
    g.graph.graph["registered_after"] = {"input_layernorm": "mlp", "post_attention_layernorm": "input_layernorm",
                                         "norm": "layers"}
    defaults = {B: 1, S: 4096, H: 4096, h: 32, G: 32, L: 32, F: 11008, V: 32000}
    desc = (f"Llama (HF LlamaForCausalLM, transformers 5.23, Llama-2-7B defaults; {attention} attention, dropout "
            f"{dropout}, cache {cache})")
    return Model(name, g.finish(), defaults, (B, S, H, h, G, L, F, V), desc, layer="layers",
                 options={"attention": attention, "dropout": dropout, "cache": cache})

