"""Save rules shared by every family: views and ops whose backward needs no tensor, and linear.

Sources: PyTorch ``tools/autograd/derivatives.yaml``.  ``add``/``sub`` need only sizes; views need only
sizes/strides; ``cat`` needs only sizes; ``addmm``/``mm`` (what ``nn.Linear`` runs) keep the input and
the weight (a parameter, so not an activation).
"""

from __future__ import annotations

from .. import Saved
from . import RuleContext, saves


@saves("input", "parameter", "block_input", "identity", "reshape", "transpose", "permute", "select", "slice",
       "expand", "flatten", "contiguous", "clone", "add", "sub", "concat")
def _nothing(ctx: RuleContext) -> list[Saved]:
    return []


@saves("linear")
def _linear(ctx: RuleContext) -> list[Saved]:
    return [ctx.input(0)]


@saves("dropout")
def _dropout(ctx: RuleContext) -> list[Saved]:
    """Dropout in training keeps a mask whose form depends on the device; p = 0 keeps nothing.

    ``at::dropout`` (aten/src/ATen/native/Dropout.cpp) takes the fused ``native_dropout`` only where
    ``is_fused_kernel_acceptable``: a CUDA (or XPU) tensor and ``0 < p < 1``.  Its entry
    ``native_dropout: input: native_dropout_backward(grad, result1, scale)`` saves ``result1``, a **bool
    mask** (1 byte per element).  Elsewhere -- every CPU dropout -- ``_dropout_impl`` builds
    ``noise = empty_like(input).bernoulli_(1 - p).div_(1 - p)`` and returns ``input * noise``; ``mul``
    saves the operand that does not require grad, the **noise, in the input's dtype** (4 bytes per element
    in fp32).  ``p == 1`` multiplies by a 0-dim zero tensor (saved, one element) on both devices.  ``p == 0``
    returns the input itself (the graph marks it a view): nothing is saved.  The input is never saved.
    """
    p = ctx.attrs.get("p", 0.5)
    x = ctx.inputs[0]
    if p == 0 or not ctx.attrs.get("training", True):
        return []
    if p == 1:
        return [ctx.new("zero", (), x.dtype, role="dropout_mask")]
    if ctx.device == "cuda":
        return [ctx.new("mask", x.shape, "bool", role="dropout_mask")]
    return [ctx.new("noise", x.shape, x.dtype, role="dropout_mask")]


@saves("cross_entropy")
def _cross_entropy(ctx: RuleContext) -> list[Saved]:
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
