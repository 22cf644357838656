"""What each op's backward allocates in eager PyTorch 2.x: one rule per op kind, for the peak of a training step.

A rule says, for every input that requires grad, whether the op's backward makes a **new** gradient tensor the
size of that input (``mm`` for a linear's input, ``threshold_backward`` for a ReLU's, ``zeros`` + copy for a
slice's), passes the gradient it received on as an **alias** (a view of the same storage: ``add``, views,
``clone``), and which **temporaries** it allocates and frees inside (``pow``'s ``x^(c-1)``, the optimizer-free
part of a formula).  Parameters always receive a new gradient of their own size.  Sources:
``tools/autograd/derivatives.yaml`` and the measured timelines of :mod:`symmem.tracker` (docs/peak.md).

Two facts of the autograd engine apply to every op (measured with torch 2.13 on CPU): a value used by several
ops receives one gradient per use, summed **out of place** (``aten.add``: a new tensor the size of the value,
after which both addends are freed), and the gradient an op received is freed once its backward has run,
unless an alias of it is still waiting.

>>> from symmem.conventions.pytorch.backward import grad_kinds
>>> from symmem import ops
>>> set(grad_kinds()) == set(ops.kinds())
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ...passes.grad import requires_grad
from ...shapes import numel
from ...tensor import TensorSpec
from . import RuleContext

NEW, ALIAS = "new", "alias"


@dataclass(frozen=True)
class Grads:
    """What one op's backward allocates: per input index ``new`` or ``alias`` (inputs that need no gradient
    are skipped whatever is said here; an input not named is ``new``), and temporaries that live only while
    the op's backward runs."""

    inputs: Mapping[int, str] = field(default_factory=dict)
    temps: tuple[TensorSpec, ...] = ()

    def of(self, i: int) -> str:
        return self.inputs.get(i, NEW)


GradRule = Callable[[RuleContext], Grads]
_GRADS: dict[str, GradRule] = {}


def grads(*kinds: str) -> Callable[[GradRule], GradRule]:
    """Register a backward rule for the op kinds ``kinds``."""

    def wrap(fn: GradRule) -> GradRule:
        for kind in kinds:
            _GRADS[kind] = fn
        return fn

    return wrap


def grad_kinds() -> tuple[str, ...]:
    return tuple(_GRADS)


def rule(kind: str) -> GradRule | None:
    return _GRADS.get(kind)


@grads("input", "parameter", "buffer", "constant", "rope_table")
def _leaf(ctx: RuleContext) -> Grads:
    """Leaves: nothing runs backward."""
    return Grads()


@grads("block_input", "identity", "reshape", "flatten", "transpose", "permute", "concat", "contiguous", "clone",
       "scalar_add")
def _passes(ctx: RuleContext) -> Grads:
    """Views, copies and ``+ c`` pass the gradient on: ``view``/``permute`` of it, ``clone``'s and ``cat``'s
    backward hand it (or narrow views of it) to their inputs."""
    return Grads({i: ALIAS for i in range(len(ctx.inputs))})


@grads("add", "sub")
def _add(ctx: RuleContext) -> Grads:
    """``a + b`` hands its gradient to both inputs; an input that was broadcast gets ``sum_to_size`` (new), and
    ``a - b`` negates it for ``b`` (new)."""
    found = {}
    for i, x in enumerate(ctx.inputs):
        broadcast = numel(x.shape) != numel(ctx.out.shape)
        found[i] = NEW if broadcast or (ctx.kind == "sub" and i == 1) else ALIAS
    return Grads(found)


@grads("cast", "to_dtype")
def _cast(ctx: RuleContext) -> Grads:
    """``x.to(dtype)`` converts the gradient back (new) when the dtype changed; else it is the same tensor."""
    src, dst = ctx.inputs[0].dtype, ctx.out.dtype
    act = ctx.options.get("activation_dtype", "float32")
    same = (act if src == "act" else src) == (act if dst == "act" else dst)
    return Grads({0: ALIAS if same else NEW})


@grads("dropout")
def _dropout(ctx: RuleContext) -> Grads:
    """Dropout in training multiplies the gradient by its mask or noise (new); p = 0 passes it on."""
    p = ctx.attrs.get("p", 0.5)
    if p == 0 or not ctx.attrs.get("training", True):
        return Grads({0: ALIAS})
    return Grads({0: NEW})


@grads("expand")
def _expand(ctx: RuleContext) -> Grads:
    """``expand`` sums the gradient back to the input's size (new) where it really broadcast."""
    same = numel(ctx.inputs[0].shape) == numel(ctx.out.shape)
    return Grads({0: ALIAS if same else NEW})


@grads("slice", "select")
def _slice(ctx: RuleContext) -> Grads:
    """``x[a:b]`` and ``x[i]``: a zero tensor the size of the input, with the gradient copied in (new).  Parts
    of one ``split``/``unbind`` (``split=True``) share one gradient, gathered by the schedule."""
    return Grads({0: NEW})


@grads("relu", "relu6", "gelu", "silu", "tanh", "sigmoid", "exp", "neg", "softmax", "log_softmax", "scale",
       "rotary", "linear", "conv2d", "patch_embed", "batchnorm", "layernorm", "rmsnorm", "maxpool2d", "avgpool2d",
       "adaptive_avgpool2d", "matmul", "embedding", "masked_fill", "where", "mean", "mul", "attention")
def _new(ctx: RuleContext) -> Grads:
    """One new gradient per input that requires grad (the formulas of derivatives.yaml write fresh tensors)."""
    return Grads()


@grads("rsqrt", "sqrt")
def _root(ctx: RuleContext) -> Grads:
    """``rsqrt``: ``-0.5 * grad * result^3`` makes a temporary the size of the input before the gradient."""
    x = ctx.inputs[0]
    return Grads(temps=(TensorSpec(x.shape, x.dtype),))


@grads("pow")
def _pow(ctx: RuleContext) -> Grads:
    """``pow(x, c)``: ``grad * c * x^(c-1)`` -- ``x^(c-1)`` and ``c * x^(c-1)`` are temporaries the size of x."""
    x = ctx.inputs[0]
    return Grads(temps=(TensorSpec(x.shape, x.dtype), TensorSpec(x.shape, x.dtype)))


@grads("div")
def _div(ctx: RuleContext) -> Grads:
    """``x / y``: ``grad / y`` for x (new); y's gradient ``-grad * x / y^2`` needs a temporary the size of the
    output when y requires grad."""
    out = ctx.out
    temps = (TensorSpec(out.shape, out.dtype),) if requires_grad(ctx.graph, ctx.node.inputs[1]) else ()
    return Grads(temps=temps)


@grads("cross_entropy")
def _cross_entropy(ctx: RuleContext) -> Grads:
    """``nll_loss_backward`` makes a zero tensor the size of the log-probabilities and ``_log_softmax_backward``
    the gradient of the logits: two logits-sized float32 tensors (the first freed once the second exists)."""
    logits = ctx.inputs[0]
    return Grads({1: ALIAS}, temps=(TensorSpec(logits.shape, "float32"),))
