"""Save rules for vision ops: convolution, batch norm, ReLU/ReLU6, pools.

Every rule cites the ``tools/autograd/derivatives.yaml`` entry (PyTorch 2.x) whose backward formula names the
tensors autograd saves, and the ATen function that decides which entry runs.  Each rule was checked against a
measurement on CPU (``symmem.verify.measure``); CUDA differences are written next to the rule.

>>> from symmem import derive
>>> d = derive("resnet18", convention="pytorch", options={"device": "cpu"})
>>> d.evaluate(d.sum(role="batchnorm_stats"))  # 2 float32 statistics x 4800 channels
38400
"""

from __future__ import annotations

import sympy

from .. import Saved
from . import RuleContext, saves


@saves("conv2d", "patch_embed")
def conv2d(ctx: RuleContext) -> list[Saved]:
    """Convolution keeps its input (and its weight, a parameter).

    ``conv2d`` is composite; autograd records ``convolution``, whose entry is
    ``input, weight, bias: convolution_backward(grad, input, weight, ...)``: input and weight are saved on
    every device and by every backend (mkldnn on CPU, cuDNN on CUDA).  ``patch_embed`` is a strided conv.
    """
    return [ctx.input(0)]


@saves("batchnorm")
def batchnorm(ctx: RuleContext) -> list[Saved]:
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


@saves("relu")
def relu(ctx: RuleContext) -> list[Saved]:
    """ReLU keeps its output, in place or not: ``relu: threshold_backward(grad, result, 0)``.

    In place (``nn.ReLU(inplace=True)``) the output *is* the input's storage: after a batch norm that is the
    batch norm's output, a storage the batch norm itself does not keep, so the in-place ReLU adds exactly one
    storage per conv-BN-ReLU, as the out-of-place one would (the batch norm's input, the conv output, is the
    other).  The graph marks the in-place output as a view, so the storage resolves to the producer.
    """
    return [ctx.output()]


@saves("relu6")
def relu6(ctx: RuleContext) -> list[Saved]:
    """ReLU6 is ``hardtanh(x, 0, 6)``: out of place it keeps its *input*, in place its output.

    ``hardtanh: self: hardtanh_backward(grad, self, min_val, max_val)`` saves ``self``;
    ``hardtanh_: self: hardtanh_backward(grad, result, min_val, max_val)`` saves the result, which is the
    input's storage.  Either way one storage of the input's size.
    """
    return [ctx.output()] if ctx.attrs.get("inplace") else [ctx.input(0)]


@saves("maxpool2d")
def maxpool2d(ctx: RuleContext) -> list[Saved]:
    """Max pool keeps its input and int64 indices of the output's shape.

    With autograd on, ``max_pool2d`` runs ``max_pool2d_with_indices`` (the index-free CPU kernel is only
    used when no gradient is needed); its entry ``max_pool2d_with_indices_backward(grad, self, ..., result1)``
    saves the input and the indices, int64 on CPU and CUDA.
    """
    return [ctx.input(0), ctx.new("indices", ctx.out.shape, "int64", role="indices")]


@saves("avgpool2d")
def avgpool2d(ctx: RuleContext) -> list[Saved]:
    """Average pool keeps its input: ``avg_pool2d: self: avg_pool2d_backward(grad, self, ...)``."""
    return [ctx.input(0)]


@saves("adaptive_avgpool2d")
def adaptive_avgpool2d(ctx: RuleContext) -> list[Saved]:
    """Adaptive average pool keeps its input, except to 1x1, which keeps nothing.

    ATen's ``adaptive_avg_pool2d`` computes a 1x1 output as ``input.mean((-1, -2), keepdim=True)`` (on CPU and
    CUDA; only XPU is excluded), and ``mean`` needs only sizes for backward.  Any other size runs
    ``_adaptive_avg_pool2d: self: _adaptive_avg_pool2d_backward(grad, self)``, which saves the input.
    """
    oh, ow = ctx.out.shape[2], ctx.out.shape[3]
    if oh == sympy.Integer(1) and ow == sympy.Integer(1):
        return []
    return [ctx.input(0)]
