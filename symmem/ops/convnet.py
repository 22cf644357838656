"""Op kinds of convolutional networks: convolution, patch embedding, batch norm and pools.  For each kind, one
:func:`~symmem.ops.registry.op` call gives its shape rule, its attribute schema, and its pytorch save and gradient
rules (:mod:`symmem.ops.autograd`).

Every save rule cites the ``tools/autograd/derivatives.yaml`` entry (PyTorch 2.x) whose backward formula names the
tensors autograd saves, and the ATen function that decides which entry runs.  Each rule was checked against a
measurement on CPU (``symmem.record.verify.measure``); CUDA differences are written next to the rule.

>>> from symmem import derive
>>> d = derive("resnet18", convention="pytorch", options={"device": "cpu"})
>>> d.evaluate(d.sum(role="batchnorm_stats"))  # 2 float32 statistics x 4800 channels
38400
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy

from ..shapes import fmt, numel
from ..tensor import TensorSpec
from .autograd import RuleContext, Saved, new_grads
from .registry import (
    BOOL,
    DIM,
    NUMBER,
    PAD,
    PAIR,
    REQ_DIM,
    OpError,
    OpInfo,
    attr,
    check_eq,
    expr,
    is_dim,
    need_rank,
    op,
    pair,
    pair_of,
)


def _window(size: sympy.Expr, k: sympy.Expr, s: sympy.Expr, pad: sympy.Expr, dil: sympy.Expr,
            ceil_mode: bool = False) -> sympy.Expr:
    # PyTorch's output-size formula for conv and pool windows.
    if size.is_Symbol and not ceil_mode and all(v.is_Integer for v in (k, s, pad, dil)):
        # An image side (a positive integer symbol) and integer window sizes: the common case of a first layer.
        # sympy's floor evaluation costs 5-20 ms here; its result is known: floor((x + c)/s) with s | c is
        # floor(x/s) + c/s (unevaluated floor: sympy cannot decide x/s), and x + c for s = 1.
        c = int(2 * pad - dil * (k - 1) - 1)
        step = int(s)
        if step == 1:
            return size + (c + 1)
        if c % step == 0:  # (ceil_mode takes the general path: PyTorch may drop its last window)
            return sympy.floor(size / s, evaluate=False) + (c // step + 1)
    span = size + 2 * pad - dil * (k - 1) - 1
    out = (sympy.ceiling(span / s) if ceil_mode else sympy.floor(span / s)) + 1
    if ceil_mode:
        # PyTorch (pooling_output_shape) drops the last window when it would start in the right padding
        last = (out - 1) * s >= size + pad
        if last is sympy.true:
            out -= 1
        elif last is not sympy.false:
            out = sympy.Piecewise((out - 1, last), (out, True))
    if out.is_number and out < 1:
        raise OpError(f"window {k} with stride {s}, padding {pad} leaves no output on size {size}")
    return out


def _conv2d_saves(ctx: RuleContext) -> list[Saved]:
    """Convolution keeps its input (and its weight, a parameter).

    ``conv2d`` is composite; autograd records ``convolution``, whose entry is
    ``input, weight, bias: convolution_backward(grad, input, weight, ...)``: input and weight are saved on
    every device and by every backend (mkldnn on CPU, cuDNN on CUDA).  ``patch_embed`` is a strided conv.
    """
    return [ctx.input(0)]


@op("conv2d", attrs={"out_channels": REQ_DIM, "kernel": attr(pair_of(is_dim), "a kernel size", True), "stride": PAIR,
                    "padding": PAD, "dilation": PAIR, "groups": DIM, "bias": BOOL},
    saves=_conv2d_saves, grads=new_grads)
def _conv2d(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    need_rank(x, 4)
    n, c, hh, ww = x.shape
    out_c = expr(a["out_channels"])
    kh, kw = pair(a["kernel"])
    sh, sw = pair(a.get("stride", 1))
    ph, pw = pair(a.get("padding", 0))
    dh, dw = pair(a.get("dilation", 1))
    groups = expr(a.get("groups", 1))
    for what, value in (("input channels", c), ("output channels", out_c)):
        q = value / groups
        if q.is_number and not q.is_integer:
            raise OpError(f"{what} {value} are not divisible by groups={groups}")
    out = (n, out_c, _window(hh, kh, sh, ph, dh), _window(ww, kw, sw, pw, dw))
    params: dict[str, tuple[sympy.Expr, ...]] = {"weight": (out_c, c / groups, kh, kw)}
    if a.get("bias", True):
        params["bias"] = (out_c,)
    return OpInfo(TensorSpec(out, x.dtype), params)


@op("patch_embed", attrs={"patch": REQ_DIM, "dim": REQ_DIM, "tokens": DIM}, saves=_conv2d_saves, grads=new_grads)
def _patch_embed(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    need_rank(x, 4)
    n, c, hh, ww = x.shape
    patch, dim = expr(a["patch"]), expr(a["dim"])
    grid = sympy.floor(hh / patch) * sympy.floor(ww / patch)
    tokens = expr(a.get("tokens", grid))
    assumptions = check_eq(tokens, grid, "patch tokens")
    return OpInfo(TensorSpec((n, tokens, dim), x.dtype),
                  {"weight": (dim, c, patch, patch), "bias": (dim,)}, assumptions=assumptions)


def _batchnorm_saves(ctx: RuleContext) -> list[Saved]:
    """Batch norm in training keeps its input and two float32 statistics per channel.

    ``nn.BatchNorm2d`` in training runs ``_batch_norm_with_update``; its entry
    ``batch_norm_backward(grad, input, weight, running_mean, running_var, result1, result2, ...)`` saves the
    input, the weight and running statistics (parameter and buffers, not activations) and ``result1``/``result2``
    = ``save_mean``/``save_invstd``, shape (C,), float32 even for 16-bit inputs.  Its output is not saved.
    CUDA (cuDNN) also keeps ``result3``, the cuDNN reserve space, which is empty for the NCHW
    ``CUDNN_BATCHNORM_SPATIAL`` mode PyTorch picks for contiguous 4-D inputs (``getCudnnBatchNormMode``), so
    both devices keep the same bytes.
    """
    c = ctx.inputs[0].shape[1]
    return [ctx.input(0),
            ctx.new("save_mean", (c,), "float32", role="batchnorm_stats"),
            ctx.new("save_invstd", (c,), "float32", role="batchnorm_stats")]


@op("batchnorm", attrs={"affine": BOOL, "eps": NUMBER, "momentum": NUMBER}, saves=_batchnorm_saves, grads=new_grads)
def _batchnorm(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    if x.rank < 2:
        raise OpError(f"batchnorm needs (N, C, ...), got {fmt(x.shape)}")
    c = x.shape[1]
    params = {"weight": (c,), "bias": (c,)} if a.get("affine", True) else {}
    # training needs more than one value per channel to take statistics (PyTorch refuses one)
    per_channel = numel(x.shape) / c
    found: tuple[tuple[sympy.Basic, None], ...] = ()
    if (per_channel - 1).is_nonpositive or (per_channel.is_number and per_channel <= 1):
        raise OpError(f"batchnorm in training needs more than one value per channel, got {fmt(x.shape)}")
    if not (per_channel - 1).is_positive:
        found = ((sympy.Gt(per_channel, 1), None),)
    buffers = {"running_mean": TensorSpec((c,), "float32"), "running_var": TensorSpec((c,), "float32"),
               "num_batches_tracked": TensorSpec((), "int64")}
    return OpInfo(TensorSpec(x.shape, x.dtype), params, assumptions=found, buffers=buffers)


_POOL = {"kernel": attr(pair_of(is_dim), "a kernel size", True), "stride": PAIR, "padding": PAD, "ceil_mode": BOOL}


def _maxpool2d_saves(ctx: RuleContext) -> list[Saved]:
    """Max pool keeps its input and int64 indices of the output's shape.

    With autograd on, ``max_pool2d`` runs ``max_pool2d_with_indices`` (the index-free CPU kernel is only
    used when no gradient is needed); its entry ``max_pool2d_with_indices_backward(grad, self, ..., result1)``
    saves the input and the indices, int64 on CPU and CUDA.
    """
    return [ctx.input(0), ctx.new("indices", ctx.out.shape, "int64", role="indices")]


def _avgpool2d_saves(ctx: RuleContext) -> list[Saved]:
    """Average pool keeps its input: ``avg_pool2d: self: avg_pool2d_backward(grad, self, ...)``."""
    return [ctx.input(0)]


@op("maxpool2d", attrs={**_POOL, "dilation": PAIR}, saves=_maxpool2d_saves, grads=new_grads)
@op("avgpool2d", attrs=_POOL, saves=_avgpool2d_saves, grads=new_grads)  # F.avg_pool2d takes no dilation
def _pool(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    need_rank(x, 4)
    n, c, hh, ww = x.shape
    kh, kw = pair(a["kernel"])
    sh, sw = pair(a.get("stride", a["kernel"]))
    ph, pw = pair(a.get("padding", 0))
    dh, dw = pair(a.get("dilation", 1))
    ceil_mode = bool(a.get("ceil_mode", False))
    for k, pad in ((kh, ph), (kw, pw)):
        # PyTorch: "pad should be at most half of effective kernel size" (pool2d_shape_check: k/2 >= pad)
        if (pad - sympy.floor(k / 2)).is_positive:
            raise OpError(f"padding {pad} is more than half the kernel {k}")
    out = (n, c, _window(hh, kh, sh, ph, dh, ceil_mode), _window(ww, kw, sw, pw, dw, ceil_mode))
    return OpInfo(TensorSpec(out, x.dtype))


def _adaptive_avgpool2d_saves(ctx: RuleContext) -> list[Saved]:
    """Adaptive average pool keeps its input, except to 1x1, which keeps nothing.

    ATen's ``adaptive_avg_pool2d`` computes a 1x1 output as ``input.mean((-1, -2), keepdim=True)`` (on CPU and
    CUDA; only XPU is excluded), and ``mean`` needs only sizes for backward.  Any other size runs
    ``_adaptive_avg_pool2d: self: _adaptive_avg_pool2d_backward(grad, self)``, which saves the input.
    """
    oh, ow = ctx.out.shape[2], ctx.out.shape[3]
    if oh == sympy.Integer(1) and ow == sympy.Integer(1):
        return []
    return [ctx.input(0)]


@op("adaptive_avgpool2d", attrs={"output_size": PAIR}, saves=_adaptive_avgpool2d_saves, grads=new_grads)
def _adaptive_pool(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    need_rank(x, 4)
    oh, ow = pair(a.get("output_size", 1))
    return OpInfo(TensorSpec((x.shape[0], x.shape[1], oh, ow), x.dtype))
