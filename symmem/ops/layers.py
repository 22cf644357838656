"""Op kinds of the layers of sequence models: linear, matmul, attention, embeddings, norms, rotary tables and the
cross-entropy loss.  For each kind, one :func:`~symmem.ops.registry.op` call gives its shape rule, its attribute
schema, and its pytorch save and gradient rules (:mod:`symmem.ops.autograd`).

Save rules' sources (PyTorch 2.x): ``tools/autograd/derivatives.yaml`` says which tensors each backward formula
reads.  Kernels that pick what to keep at run time:

* ``aten/src/ATen/native/transformers/attention.cpp`` and ``sdp_utils_cpp.cpp``: on the CPU with dropout 0
  the flash kernel runs and keeps q, k, v, the output and a float32 log-sum-exp (B, h, S); with dropout > 0
  the CPU has no fused kernel and falls back to ``_scaled_dot_product_attention_math``: ``q*sqrt(scale)``
  and ``k^T*sqrt(scale)`` (new tensors kept by the batched matmul), the softmax output, the dropout noise,
  the dropped probabilities, and ``v`` (a contiguous copy when ``v`` is a strided view).  On CUDA the
  flash kernel (16-bit) and the memory-efficient kernel (FP32) keep q, k, v, the output, a float32
  log-sum-exp and the Philox seed and offset (two int64 scalars: on the GPU from flash, in host memory from
  the memory-efficient kernel outside CUDA-graph capture).  Which kernel runs follows the regime's activation
  dtype: 16-bit runs flash (log-sum-exp (B, h, S)); FP32 runs the memory-efficient kernel
  (``_efficient_attention_forward``), whose log-sum-exp is (B, h, 32*ceil(S/32)), unless the key and value
  have fewer heads than the query (grouped-query attention, G < h): that kernel takes equal head counts only,
  and FP32 falls back to the math kernel as the CPU does with dropout (its dropout keeps a bool mask on CUDA).
  Measured on an H100 (``benchmarks/check_cuda.py``, docs/cuda.md).
* ``native_layer_norm`` keeps input, mean and rstd (B, ..., 1): float32 on CUDA (the accumulate type), the
  input's dtype on the CPU; weight and bias are parameters.
* ``matmul`` of batched operands folds them to ``bmm`` with ``reshape``: a strided view (a head split by
  ``permute``, a transposed key) cannot be folded in place, so the product keeps a contiguous copy.  The
  matmul's rule finds such operands from their strides (the ``copy_inputs`` fact, :mod:`symmem.strides`); the
  copy is a storage only the matmul holds.

Measured on the CPU (``tests/test_pytorch_sequence.py``) for ViT, GPT-2, BERT and Llama at several B and S.

>>> from symmem.symbols import B, S, H
>>> from symmem.tensor import TensorSpec
>>> from symmem.ops import infer
>>> info = infer("linear", [TensorSpec((B, S, H))], {"out_features": 4 * H})
>>> info.out.shape, info.params
((B, S, 4*H), {'weight': (4*H, H), 'bias': (4*H,)})
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy

from ..conditions import holds
from ..errors import node_error
from ..shapes import broadcast, fmt, numel, same
from ..strides import Flag, attention_keeps_value, heads_outer, matmul_copies
from ..tensor import ACT, TensorSpec
from .autograd import ALIAS, Grads, RuleContext, Saved, keeps_input, keeps_nothing, new_grads, no_backward
from .registry import (
    AXIS,
    BOOL,
    DIM,
    DTYPE,
    FLAG,
    NUMBER,
    REQ_DIM,
    OpError,
    OpInfo,
    any_value,
    attr,
    check_eq,
    expr,
    is_copy_inputs,
    is_prob,
    one_of,
    op,
)


@op("linear", attrs={"out_features": REQ_DIM, "in_features": DIM, "bias": BOOL, "tied": BOOL}, saves=keeps_input,
    grads=new_grads)
def _linear(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    if x.rank < 1:
        raise OpError("linear needs at least one dimension")
    d_in = x.shape[-1]
    assumptions = check_eq(d_in, expr(a.get("in_features", d_in)), "in_features")
    out_f = expr(a["out_features"])
    params: dict[str, tuple[sympy.Expr, ...]] = {}
    if not a.get("tied"):
        params["weight"] = (out_f, d_in)
    if a.get("bias", True):
        params["bias"] = (out_f,)
    return OpInfo(TensorSpec(x.shape[:-1] + (out_f,), x.dtype), params, assumptions=assumptions)


def _matmul_saves(ctx: RuleContext) -> list[Saved]:
    """Each operand is kept if the other requires grad; ``copy_inputs`` operands as a contiguous copy."""
    # An entry is an index, or (index, condition) for an operand that is foldable only for some sizes
    # (a stride-0 repeat of heads; symmem.conditions).
    branch = ctx.options.get("branch")
    copies = {i for i, cond in (e if isinstance(e, tuple) else (e, True) for e in ctx.node.fact("copy_inputs", ()))
              if holds(cond, branch)}
    found = []
    for i, other in ((0, 1), (1, 0)):
        if not ctx.requires_grad(other):
            continue
        if i in copies:
            spec = ctx.inputs[i]
            found.append(ctx.new(f"input{i}_copy", spec.shape, spec.dtype, "matmul_copy"))
        else:
            found.append(ctx.input(i))
    return found


@op("matmul", arity=2, attrs={"copy_inputs": attr(is_copy_inputs, "input indices, each maybe with a condition")},
    saves=_matmul_saves, grads=new_grads)
def _matmul(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x, y = ins
    if x.rank < 2 or y.rank < 2:
        raise OpError(f"matmul needs rank >= 2, got {fmt(x.shape)} @ {fmt(y.shape)}")
    assumptions = check_eq(x.shape[-1], y.shape[-2],
                           lambda: f"inner dimensions of {fmt(x.shape)} @ {fmt(y.shape)}")
    batch = broadcast(x.shape[:-2], y.shape[:-2])
    if batch is None:
        raise OpError(f"batch dimensions of {fmt(x.shape)} @ {fmt(y.shape)} do not broadcast")
    if "copy_inputs" in a:  # a builder's statement wins (graphs written before strides)
        copies = tuple(a["copy_inputs"])
    else:
        # an operand whose batch cannot be folded into bmm's by a view is copied (matmul_copies)
        flags = matmul_copies((x.shape, x.strides), (y.shape, y.strides))
        copies = tuple(i if f is True else (i, f) for i, f in enumerate(flags) if f is not False)
    return OpInfo(TensorSpec(batch + (x.shape[-2], y.shape[-1]), x.dtype), assumptions=assumptions,
                  facts={"copy_inputs": copies})


def _merged_by_copy(ctx: RuleContext) -> bool:
    """Whether the output feeds a head merge (transpose/permute, then a copying contiguous/reshape)."""
    g = ctx.graph
    for t in g.successors(ctx.node.name):
        if g.node(t).kind not in ("transpose", "permute"):
            continue
        for c in g.successors(t):
            node = g.node(c)
            if node.view_of is None and node.kind in ("contiguous", "reshape", "flatten", "clone"):
                return True
    return False


def _attention_saves(ctx: RuleContext) -> list[Saved]:
    """``scaled_dot_product_attention``: what the kernel the device picks keeps (module docstring)."""
    q, k, v = ctx.inputs
    if ctx.attrs.get("mask") is not None:
        raise node_error(ctx.node.name, ctx.kind, "explicit attention masks are not modelled; use causal=True")
    dropout = ctx.attrs.get("dropout", 0.0)
    lse = ctx.new("logsumexp", q.shape[:-1], "float32", "attn_lse")
    if ctx.device == "cuda" and ctx.options.get("activation_dtype", "float32") == "float32":
        # FP32 on CUDA runs the memory-efficient kernel, whose log-sum-exp rows are padded to kAlignLSE = 32.
        rows = 32 * sympy.ceiling(q.shape[-2] / 32)
        lse = ctx.new("logsumexp", q.shape[:-2] + (rows,), "float32", "attn_lse")
    # The fused kernels write the output as (B, S, h, d) and return it transposed (CUDA always; the CPU
    # flash kernel when q itself is a head split of (B, S, H) memory: it makes the output with empty_like(q),
    # the ``q_bshd`` fact the rule reads from q's strides), so the builders' merge ``transpose(1, 2).reshape(B,
    # S, H)`` is a view of it; the graph shows the merge as a copy the output projection keeps, which then *is*
    # this storage: the output is not counted twice.
    branch = ctx.options.get("branch")
    if "q_layout" in ctx.attrs or "q_bshd" not in ctx.node.facts:
        q_bshd = ctx.attrs.get("q_layout", "bhsd") == "bshd"
    else:
        q_bshd = holds(ctx.node.facts["q_bshd"], branch)
    merged_view = (ctx.device == "cuda" or q_bshd) and _merged_by_copy(ctx)
    out = [] if merged_view else [ctx.output()]
    low = ctx.options.get("activation_dtype") in ("float16", "bfloat16")
    # grouped-query inputs (G key/value heads for h query heads): the memory-efficient kernel takes equal head
    # counts only (sdp_utils: check_batch_size_and_num_heads_dense<supports_gqa=false>), so FP32 on CUDA falls
    # back to the math kernel when G != h; flash (16-bit) reads the G heads itself
    gqa = holds(ctx.node.fact("gqa", False), branch)
    if ctx.device == "cuda" and (low or not gqa):
        # the Philox seed and offset: two int64 scalars, on the GPU from flash, in host memory from the
        # memory-efficient kernel (``at::scalar_tensor`` outside CUDA-graph capture; measured on an H100)
        philox = [ctx.new(f"philox_{part}", (), "int64", "rng_state", host=not low) for part in ("seed", "offset")]
        return [ctx.input(0), ctx.input(1), ctx.input(2), *out, lse, *philox]
    if dropout == 0 and ctx.device != "cuda":
        return [ctx.input(0), ctx.input(1), ctx.input(2), *out, lse]
    # the math kernel: scaled q and k^T are new tensors the batched matmul keeps.  With 16-bit inputs the CPU's
    # computes in float32 (q, k, v upcast first; measured), so every tensor it keeps is float32.
    # Grouped-query inputs (``enable_gqa``: G key/value heads for h query heads) are expanded to h heads first
    # (``repeat_interleave``, a new tensor), so the scaled key and the value it keeps have the query's heads.
    # Dropout is ``at::dropout``: the CPU keeps float noise, CUDA (``native_dropout``) a bool mask; without
    # dropout the product keeps the softmax output itself.
    dt = "float32" if low else q.dtype
    scores = q.shape[:-1] + (k.shape[-2],)
    k_shape, v_shape = (t.shape[:-3] + (q.shape[-3],) + t.shape[-2:] if t.rank >= 3 and q.rank == t.rank
                        else t.shape for t in (k, v))
    found = [ctx.new("q_scaled", q.shape, dt, "matmul_copy"),
             ctx.new("k_scaled", k_shape, dt, "matmul_copy"),
             ctx.new("probs", scores, dt, "attn_probs")]
    if dropout:
        found += [ctx.new("mask", scores, "bool", "dropout_mask") if ctx.device == "cuda"
                  else ctx.new("noise", scores, dt, "dropout_mask"),
                  ctx.new("dropped", scores, dt, "attn_dropout")]
    if ctx.device == "cuda":  # only grouped-query FP32 gets here: the value expanded to h heads is new
        return [*found, ctx.new("v_copy", v_shape, dt, "matmul_copy")]
    if holds(ctx.node.fact("v_contiguous", False), branch) and not low:
        found.append(ctx.input(2))
    else:
        found.append(ctx.new("v_copy", v_shape, dt, "matmul_copy"))
    return found


@op("attention", arity=3, attrs={"causal": BOOL, "dropout": attr(is_prob, "a probability in [0, 1]"),
                                "q_layout": attr(one_of("bhsd", "bshd"), "'bhsd' or 'bshd'"), "v_contiguous": FLAG,
                                "mask": attr(any_value, "an attention mask"), "scale": NUMBER},
    saves=_attention_saves, grads=new_grads)
def _attention(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    q, k, v = ins
    for t in (q, k, v):
        if t.rank < 3:
            raise OpError(f"attention needs (..., heads, seq, dim), got {fmt(t.shape)}")
    found = list(check_eq(q.shape[-1], k.shape[-1], "query/key head dims"))
    found += check_eq(k.shape[-2], v.shape[-2], "key/value sequence lengths")
    kv_lead = [k.shape[:-2], v.shape[:-2]]
    heads = q.shape[-3]
    for i, t in enumerate((k, v)):
        if t.shape[-3] != 1 and same(heads, t.shape[-3]) is False:
            # Grouped-query attention: the query heads are a multiple of the key/value heads, which repeat.
            ratio = heads / t.shape[-3]
            if ratio.is_number and not ratio.is_integer:
                raise OpError(f"query heads {heads} are not a multiple of key/value heads {t.shape[-3]}")
            kv_lead[i] = t.shape[:-3] + (heads,)
    # the other leading dimensions broadcast, as in scaled_dot_product_attention
    lead = broadcast(q.shape[:-2], kv_lead[0])
    lead = None if lead is None else broadcast(lead, kv_lead[1])
    if lead is None:
        raise OpError(f"batch dimensions of {fmt(q.shape)}, {fmt(k.shape)}, {fmt(v.shape)} do not broadcast")
    return OpInfo(TensorSpec(lead + (q.shape[-2], v.shape[-1]), q.dtype), assumptions=tuple(found),
                  facts=_attention_facts(q, k, v, a, lead))


def _attention_facts(q: TensorSpec, k: TensorSpec, v: TensorSpec, a: Mapping[str, Any],
                     lead: tuple[sympy.Expr, ...]) -> dict[str, Any]:
    """What scaled_dot_product_attention's kernels do with the layouts they are given (a builder's
    ``q_layout``/``v_contiguous`` win): ``q_bshd``, the CPU flash kernel's output is ``empty_like(q)``, which is
    (B, S, h, d) in memory when q is a head split of (B, S, H); ``v_contiguous``, the CPU math kernel keeps v
    itself: v has q's heads (grouped heads are repeated first) and ``matmul(probs, v)`` folds it without a copy;
    ``gqa``, the key has fewer heads than the query (a condition where symbols decide, ``Ne(h/G, 1)``): CUDA's
    memory-efficient kernel takes equal head counts only."""
    heads, kv_heads = q.shape[-3], k.shape[-3]
    gqa: Flag = False
    if same(heads, kv_heads) is not True:
        gqa = True if (heads - kv_heads).is_number else sympy.Ne(heads / kv_heads, 1)
    if "q_layout" in a:
        q_bshd: Flag = a["q_layout"] == "bshd"
    else:
        q_bshd = heads_outer(q.shape, q.strides)
    if "v_contiguous" in a:
        v_contiguous = a["v_contiguous"]
    else:
        v_contiguous = attention_keeps_value(lead + (q.shape[-2], k.shape[-2]), v.shape, v.strides)
    return {"q_bshd": q_bshd, "v_contiguous": v_contiguous, "gqa": gqa}


def _embedding_saves(ctx: RuleContext) -> list[Saved]:
    """``embedding_backward`` needs the indices (and the weight's size)."""
    return [ctx.input(0)]


@op("embedding", attrs={"num_embeddings": REQ_DIM, "dim": REQ_DIM, "padding_idx": AXIS}, saves=_embedding_saves,
    grads=new_grads)
def _embedding(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    ids = ins[0]
    if ids.dtype not in ("int64", "int32"):
        raise OpError(f"embedding needs integer ids, got dtype {ids.dtype}")
    num, dim = expr(a["num_embeddings"]), expr(a["dim"])
    if a.get("padding_idx") is not None:
        pad = expr(a["padding_idx"])
        low, high = (pad + num, num - 1 - pad) if pad < 0 else (pad, num - 1 - pad)
        if (low.is_number and low < 0) or (high.is_number and high < 0):
            raise OpError(f"padding_idx {pad} is out of range for {num} embeddings")
    return OpInfo(TensorSpec(ids.shape + (dim,), ACT), {"weight": (num, dim)})


def _layernorm_saves(ctx: RuleContext) -> list[Saved]:
    """Input, mean and rstd (float32 on CUDA, the input's dtype on the CPU), shaped (..., 1)."""
    stats = ctx.inputs[0].shape[:-1] + (sympy.Integer(1),)
    dtype = "float32" if ctx.device == "cuda" else ctx.inputs[0].dtype
    return [ctx.input(0), ctx.new("mean", stats, dtype, "norm_stats"), ctx.new("rstd", stats, dtype, "norm_stats")]


@op("layernorm", attrs={"affine": BOOL, "bias": BOOL, "eps": NUMBER}, saves=_layernorm_saves, grads=new_grads)
def _layernorm(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    if x.rank < 1:
        raise OpError("layernorm needs at least one dimension")
    d = x.shape[-1]
    params: dict[str, tuple[sympy.Expr, ...]] = {}
    if a.get("affine", True):
        params["weight"] = (d,)
        if a.get("bias", True):
            params["bias"] = (d,)
    return OpInfo(TensorSpec(x.shape, x.dtype), params)


def _rmsnorm_saves(ctx: RuleContext) -> list[Saved]:
    """A fused RMSNorm (``torch.nn.functional.rms_norm`` on CUDA): the input and a float32 rstd (..., 1)."""
    stats = ctx.inputs[0].shape[:-1] + (sympy.Integer(1),)
    return [ctx.input(0), ctx.new("rstd", stats, "float32", "norm_stats")]


@op("rmsnorm", attrs={"affine": BOOL, "eps": NUMBER}, saves=_rmsnorm_saves, grads=new_grads)
def _rmsnorm(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    if x.rank < 1:
        raise OpError("rmsnorm needs at least one dimension")
    return OpInfo(TensorSpec(x.shape, x.dtype), {"weight": (x.shape[-1],)} if a.get("affine", True) else {})


@op("rope_table", attrs={"dim": REQ_DIM, "dtype": DTYPE}, saves=keeps_nothing, grads=no_backward)
def _rope_table(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # cos or sin of the rotary angles for position ids (..., S): (..., S, dim), computed without gradient.
    return OpInfo(TensorSpec(ins[0].shape + (expr(a["dim"]),), a.get("dtype", ACT)))


def _cross_entropy_saves(ctx: RuleContext) -> list[Saved]:
    """``F.cross_entropy`` = ``log_softmax`` then ``nll_loss``: log-probabilities, the target and one scalar.

    ``_log_softmax: self: _log_softmax_backward_data(grad, result, dim, ...)`` saves its output (the logits
    are not saved); ``nll_loss_forward: self: nll_loss_backward(grad, self, target, weight, reduction,
    ignore_index, total_weight)`` saves the same log-probabilities again (one storage), the target (an input)
    and ``total_weight`` = ``result1``, a 0-dim float32 tensor (4 bytes).  Same on CPU and CUDA.  Under autocast
    both ops run in float32, so the log-probabilities are float32 in every regime.
    """
    return [ctx.new("log_probs", ctx.inputs[0].shape, "float32", role="loss"),
            ctx.input(1),
            ctx.new("total_weight", (), "float32", role="loss")]


def _cross_entropy_grads(ctx: RuleContext) -> Grads:
    """``nll_loss_backward`` makes a zero tensor the size of the log-probabilities and ``_log_softmax_backward``
    the gradient of the logits: two logits-sized float32 tensors (the first freed once the second exists)."""
    logits = ctx.inputs[0]
    return Grads({1: ALIAS}, temps=(TensorSpec(logits.shape, "float32"),))


@op("cross_entropy", arity=2, attrs={"reduction": attr(one_of("mean", "sum"), "'mean' or 'sum'")},
    saves=_cross_entropy_saves, grads=_cross_entropy_grads)
def _cross_entropy(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    logits, target = ins
    if logits.rank < 1:
        raise OpError("cross-entropy needs logits with a class dimension, got a 0-dim tensor")
    assumptions = check_eq(numel(logits.shape[:-1]), numel(target.shape), "cross-entropy targets")
    return OpInfo(TensorSpec((), "float32" if logits.dtype != ACT else ACT), assumptions=assumptions)
