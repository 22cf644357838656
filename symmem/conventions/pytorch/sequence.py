"""Save rules for the ops of sequence models: norms, activations, arithmetic, attention, embeddings, dropout.

Sources (PyTorch 2.x): ``tools/autograd/derivatives.yaml`` says which tensors each backward formula reads;
the autograd code generator saves an input only when the gradient that needs it is wanted, so ``x * w``
keeps ``w`` only if ``x`` requires grad and ``x`` only if ``w`` does (a mask, a position table or a 0-dim
divisor needs no gradient).  Kernels that pick what to keep at run time:

* Dropout (the rule in :mod:`.common`): CUDA keeps a bool mask, the CPU the noise in the activation dtype.
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
  matmul's rule finds such operands from their strides (the ``copy_inputs`` fact, :mod:`symmem.layout`); the
  copy is a storage only the matmul holds.

Measured on the CPU (``tests/test_pytorch_sequence.py``) for ViT, GPT-2, BERT and Llama at several B and S.

>>> from symmem.conventions.pytorch import rule_kinds
>>> {"layernorm", "attention", "embedding", "mul"} <= set(rule_kinds())
True
"""

from __future__ import annotations

import sympy

from ...branches import holds
from ...errors import node_error
from ...passes.grad import requires_grad
from .. import Saved
from . import RuleContext, saves


def _grad(ctx: RuleContext, i: int) -> bool:
    return requires_grad(ctx.graph, ctx.node.inputs[i])


@saves("constant", "buffer", "scalar_add", "cast", "mean", "rope_table", "scale", "neg", "to_dtype")
def _nothing(ctx: RuleContext) -> list[Saved]:
    """Scalar arithmetic, casts, reductions to a mean and tensors made without gradient keep nothing."""
    return []


@saves("layernorm")
def _layernorm(ctx: RuleContext) -> list[Saved]:
    """Input, mean and rstd (float32 on CUDA, the input's dtype on the CPU), shaped (..., 1)."""
    stats = ctx.inputs[0].shape[:-1] + (sympy.Integer(1),)
    dtype = "float32" if ctx.device == "cuda" else ctx.inputs[0].dtype
    return [ctx.input(0), ctx.new("mean", stats, dtype, "norm_stats"), ctx.new("rstd", stats, dtype, "norm_stats")]


@saves("rmsnorm")
def _rmsnorm(ctx: RuleContext) -> list[Saved]:
    """A fused RMSNorm (``torch.nn.functional.rms_norm`` on CUDA): the input and a float32 rstd (..., 1)."""
    stats = ctx.inputs[0].shape[:-1] + (sympy.Integer(1),)
    return [ctx.input(0), ctx.new("rstd", stats, "float32", "norm_stats")]


@saves("gelu", "silu", "pow")
def _keeps_input(ctx: RuleContext) -> list[Saved]:
    """``gelu``, ``silu`` and ``pow(x, c)`` differentiate from their input."""
    return [ctx.input(0)]


@saves("tanh", "sigmoid", "exp", "rsqrt", "sqrt", "softmax", "log_softmax")
def _keeps_output(ctx: RuleContext) -> list[Saved]:
    """These differentiate from their result (derivatives.yaml uses ``result``)."""
    return [ctx.output()]


@saves("mul")
def _mul(ctx: RuleContext) -> list[Saved]:
    """``x * y`` keeps ``y`` for x's gradient and ``x`` for y's, each only if that gradient is wanted."""
    found = []
    if _grad(ctx, 1):
        found.append(ctx.input(0))
    if _grad(ctx, 0):
        found.append(ctx.input(1))
    return found


@saves("div")
def _div(ctx: RuleContext) -> list[Saved]:
    """``x / y`` keeps ``y`` for x's gradient; y's gradient needs ``x`` and ``y``."""
    found = []
    if _grad(ctx, 1):
        found.append(ctx.input(0))
    if _grad(ctx, 0) or _grad(ctx, 1):
        found.append(ctx.input(1))
    return found


@saves("masked_fill", "where")
def _masked(ctx: RuleContext) -> list[Saved]:
    """``x.masked_fill(mask, v)`` and ``torch.where(mask, x, v)`` keep only the mask (input 1 here)."""
    return [ctx.input(1)]


@saves("embedding")
def _embedding(ctx: RuleContext) -> list[Saved]:
    """``embedding_backward`` needs the indices (and the weight's size)."""
    return [ctx.input(0)]


@saves("matmul")
def _matmul(ctx: RuleContext) -> list[Saved]:
    """Each operand is kept if the other requires grad; ``copy_inputs`` operands as a contiguous copy."""
    # An entry is an index, or (index, condition) for an operand that is foldable only for some sizes
    # (a stride-0 repeat of heads; symmem.branches).
    branch = ctx.options.get("branch")
    copies = {i for i, cond in (e if isinstance(e, tuple) else (e, True) for e in ctx.node.fact("copy_inputs", ()))
              if holds(cond, branch)}
    found = []
    for i, other in ((0, 1), (1, 0)):
        if not _grad(ctx, other):
            continue
        if i in copies:
            spec = ctx.inputs[i]
            found.append(ctx.new(f"input{i}_copy", spec.shape, spec.dtype, "matmul_copy"))
        else:
            found.append(ctx.input(i))
    return found


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


@saves("attention")
def _attention(ctx: RuleContext) -> list[Saved]:
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
