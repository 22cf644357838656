"""Op kinds on tensors of any network: leaves, views and copies, casts, dropout, elementwise arithmetic and
activations, softmax and mean.  For each kind, one :func:`~symmem.ops.registry.op` call gives its shape rule,
its attribute schema, and its pytorch save and gradient rules (:mod:`symmem.ops.autograd`).

Save rules' sources: PyTorch ``tools/autograd/derivatives.yaml``.  Views need only sizes and strides, ``add``,
``sub`` and ``cat`` only sizes; ``x * w`` keeps ``w`` only if ``x`` requires grad and ``x`` only if ``w`` does (a
mask, a position table or a 0-dim divisor needs no gradient).  Measured on the CPU
(``tests/test_pytorch_sequence.py``, ``tests/test_pytorch_vision.py``).

>>> from symmem.tensor import TensorSpec
>>> from symmem.symbols import B, S, H
>>> from symmem.ops import infer
>>> info = infer("transpose", [TensorSpec((B, S, H))], {"dim0": 1, "dim1": 2})
>>> info.out.shape, info.out.strides, info.view_of
((B, H, S), (H*S, 1, H), 0)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sympy

from ..shapes import broadcast, fmt, numel, same
from ..strides import Flag, Strides, elementwise, expanded, made_contiguous, permuted, reshaped, selected, sliced
from ..strides import like as strides_like
from ..tensor import ACT, TensorSpec, as_shape
from .autograd import (
    ALIAS,
    NEW,
    Grads,
    RuleContext,
    Saved,
    keeps_input,
    keeps_nothing,
    keeps_output,
    new_grads,
    no_backward,
    passes_on,
)
from .registry import (
    AXIS,
    BOOL,
    DIM,
    DTYPE,
    FLAG,
    INPLACE,
    NUMBER,
    SHAPE,
    OpError,
    OpInfo,
    Unsupported,
    attr,
    check_eq,
    expr,
    is_dim,
    is_dtype,
    is_ints,
    is_nonneg,
    is_number,
    is_prob,
    one_of,
    op,
    wrap_dim,
)


# -- leaves ----------------------------------------------------------------------------------------------
@op("input", arity=0, attrs={"shape": SHAPE, "dtype": DTYPE}, saves=keeps_nothing, grads=no_backward)
def _input(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    return OpInfo(TensorSpec(a["shape"], a.get("dtype", ACT)))


@op("parameter", arity=0, attrs={"shape": SHAPE, "dtype": DTYPE}, saves=keeps_nothing, grads=no_backward)
def _parameter(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    shape = as_shape(a["shape"])
    return OpInfo(TensorSpec(shape, a.get("dtype", ACT)), {"value": shape})


@op("constant", "buffer", arity=0, attrs={"shape": SHAPE, "dtype": DTYPE}, saves=keeps_nothing, grads=no_backward)
def _constant(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # ``constant``: a tensor the forward makes that needs no gradient (position ids, an additive mask, a
    # 0-dim divisor); an activation if some op saves it.  ``buffer``: module state (a registered causal
    # mask), reported like parameters but with no parameter count.
    return OpInfo(TensorSpec(a["shape"], a.get("dtype", ACT)))


# -- views and copies: the backward needs only sizes and strides -----------------------------------------
@op("block_input", "identity", saves=keeps_nothing, grads=passes_on)
def _alias(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    return OpInfo(ins[0].with_(role=None), view_of=0)


@op("transpose", attrs={"dim0": AXIS, "dim1": AXIS}, saves=keeps_nothing, grads=passes_on)
def _transpose(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    i, j = wrap_dim(x, a.get("dim0", -2)), wrap_dim(x, a.get("dim1", -1))
    dims = list(range(x.rank))
    dims[i], dims[j] = dims[j], dims[i]
    return _permuted(x, dims)


def _permuted(x: TensorSpec, dims: list[int]) -> OpInfo:
    strides = permuted(x.shape, x.strides, dims)
    return OpInfo(TensorSpec(tuple(x.shape[d] for d in dims), x.dtype, strides=strides), view_of=0)


@op("permute", attrs={"dims": attr(is_ints, "a permutation of the dimensions", True)}, saves=keeps_nothing,
    grads=passes_on)
def _permute(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    dims = [wrap_dim(x, d) for d in a["dims"]]
    if sorted(dims) != list(range(x.rank)):
        raise OpError(f"permutation {a['dims']} does not fit rank {x.rank}")
    return _permuted(x, dims)


def _is_expand_shape(x: Any) -> None:
    if not isinstance(x, tuple | list):
        raise OpError("not a tuple of sizes")
    for d in x:
        if not (isinstance(d, int) and not isinstance(d, bool) and d == -1):
            is_dim(d)


def _expand_grads(ctx: RuleContext) -> Grads:
    """``expand`` sums the gradient back to the input's size (new) where it really broadcast."""
    as_big = numel(ctx.inputs[0].shape) == numel(ctx.out.shape)
    return Grads({0: ALIAS if as_big else NEW})


@op("expand", attrs={"shape": attr(_is_expand_shape, "a tuple of sizes (-1 keeps a dimension)", True)},
    saves=keeps_nothing, grads=_expand_grads)
def _expand(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # PyTorch: only size-1 dimensions expand, -1 keeps the input's size, new dimensions go in front.
    x = ins[0]
    target = list(a["shape"])
    if len(target) < x.rank:
        raise OpError(f"cannot expand {fmt(x.shape)} to {len(target)} dimensions")
    lead = len(target) - x.rank
    out: list[sympy.Expr] = []
    found: list[tuple[sympy.Expr, sympy.Expr]] = []
    for i, t in enumerate(target):
        if isinstance(t, int) and t == -1:
            if i < lead:
                raise OpError(f"-1 is not allowed for a new leading dimension (expand to {tuple(target)})")
            out.append(x.shape[i - lead])
            continue
        t = expr(t)
        if i >= lead:
            have = x.shape[i - lead]
            if have != 1:
                if same(have, t) is False:
                    raise OpError(f"cannot expand {fmt(x.shape)} to {tuple(target)}: dimension {i - lead} of size "
                                  f"{have} is not 1")
                found += check_eq(have, t, "expand")
        out.append(t)
    shape = tuple(out)
    return OpInfo(TensorSpec(shape, x.dtype, strides=expanded(x.shape, x.strides, shape)), view_of=0,
                  assumptions=tuple(found))


def _slice_grads(ctx: RuleContext) -> Grads:
    """``x[a:b]`` and ``x[i]``: a zero tensor the size of the input, with the gradient copied in (new).  Parts
    of one ``split``/``unbind`` (``split=True``) share one gradient, gathered by the schedule."""
    return Grads({0: NEW})


@op("slice", attrs={"dim": AXIS, "start": attr(is_nonneg, "a start index"), "stop": DIM, "split": BOOL},
    saves=keeps_nothing, grads=_slice_grads)
def _slice(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    d = wrap_dim(x, a.get("dim", 0))
    size = x.shape[d]
    start = expr(a.get("start", 0))
    stop = expr(a.get("stop", size))
    found: tuple[tuple[sympy.Basic, None], ...] = ()
    # PyTorch clamps a stop past the end to the size; when sympy cannot tell, the formula assumes stop <= size
    # (checked with numbers when derived)
    over = sympy.expand(stop - size)
    if over.is_positive or (over.is_number and over > 0):
        stop = size
    elif not (over.is_nonpositive or (over.is_number and over <= 0)):
        found = ((sympy.Le(stop, size), None),)
    length = stop - start
    if length.is_number and length <= 0:
        raise OpError(f"empty slice [{start}:{stop}] of dimension {d} (size {size})")
    shape = x.shape[:d] + (length,) + x.shape[d + 1:]
    return OpInfo(TensorSpec(shape, x.dtype, strides=sliced(x.shape, x.strides, shape)), view_of=0,
                  assumptions=found)


@op("select", attrs={"dim": AXIS, "index": AXIS, "split": BOOL}, saves=keeps_nothing, grads=_slice_grads)
def _select(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    d = wrap_dim(x, a.get("dim", 0))
    index = expr(a.get("index", 0))
    size = x.shape[d]
    # PyTorch: -size <= index < size; decided now when the numbers allow, else checked with numbers later
    found: tuple[tuple[sympy.Basic, None], ...] = ()
    low, high = (index + size, size - 1 - index) if index < 0 else (index, size - 1 - index)
    for gap in (low, high):
        if gap.is_negative or (gap.is_number and gap < 0):
            raise OpError(f"index {index} is out of range for dimension {d} of size {size}")
        if not (gap.is_nonnegative or (gap.is_number and gap >= 0)):
            found += ((sympy.Ge(gap, 0), None),)
    strides = selected(x.shape, x.strides, d)
    return OpInfo(TensorSpec(x.shape[:d] + x.shape[d + 1:], x.dtype, strides=strides), view_of=0, assumptions=found)


def _copy_flag(a: Mapping[str, Any], derived: Flag) -> Flag:
    """Whether the output is a copy: a builder's ``copy=`` if it gave one (graphs written before strides; it
    wins), else what the input's strides decide."""
    copy = a.get("copy", derived)
    return bool(copy) if copy in (sympy.true, sympy.false) else copy


def _view_or_copy(out: TensorSpec, copy: Flag, **info: Any) -> OpInfo:
    # A copy is a new (contiguous) storage.  A condition is a view in the graph, a copy in the branches where it
    # holds (symmem.conditions); its strides are the view's, contiguous in the cases that copy.
    if copy is True:
        return OpInfo(out.with_(strides=None), facts={"copy": True}, **info)
    return OpInfo(out, view_of=0, facts={"copy": copy}, **info)


@op("reshape", attrs={"shape": SHAPE, "copy": FLAG}, saves=keeps_nothing, grads=passes_on)
def _reshape(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    shape = as_shape(a["shape"])
    assumptions = check_eq(numel(shape), numel(x.shape), lambda: f"reshape {fmt(x.shape)} -> {fmt(shape)}")
    # a view where PyTorch's computeStride finds one, else a copy; a condition where that depends on the sizes
    strides, copies = reshaped(x.shape, x.strides, shape)
    return _view_or_copy(TensorSpec(shape, x.dtype, strides=strides), _copy_flag(a, copies), assumptions=assumptions)


@op("flatten", attrs={"start_dim": AXIS, "end_dim": AXIS, "copy": FLAG}, saves=keeps_nothing, grads=passes_on)
def _flatten(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    start = wrap_dim(x, a.get("start_dim", 1))
    end = wrap_dim(x, a.get("end_dim", -1))
    if end < start:
        raise OpError(f"end_dim {end} before start_dim {start}")
    shape = x.shape[:start] + (numel(x.shape[start:end + 1]),) + x.shape[end + 1:]
    if start == end:  # flatten of one dimension returns its input
        return _view_or_copy(TensorSpec(shape, x.dtype, strides=x.strides), _copy_flag(a, False))
    strides, copies = reshaped(x.shape, x.strides, shape)
    return _view_or_copy(TensorSpec(shape, x.dtype, strides=strides), _copy_flag(a, copies))


@op("contiguous", attrs={"copy": FLAG, "dtype": DTYPE}, saves=keeps_nothing, grads=passes_on)
def _contiguous(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # ``contiguous()`` returns its input when that is contiguous already (made_contiguous)
    x = ins[0]
    strides, copies = made_contiguous(x.shape, x.strides)
    return _view_or_copy(TensorSpec(x.shape, a.get("dtype", x.dtype), strides=strides), _copy_flag(a, copies))


@op("concat", arity=None, attrs={"dim": AXIS}, saves=keeps_nothing, grads=passes_on)
def _concat(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    if len(ins) < 2:
        raise OpError("concat needs at least two inputs")
    first = ins[0]
    d = wrap_dim(first, a.get("dim", 0))
    assumptions: list[tuple[sympy.Expr, sympy.Expr]] = []
    for t in ins[1:]:
        if t.rank != first.rank:
            raise OpError(f"ranks differ: {fmt(first.shape)} and {fmt(t.shape)}")
        for i, (u, v) in enumerate(zip(first.shape, t.shape, strict=True)):
            if i != d:
                assumptions += check_eq(u, v, f"concat dimension {i}")
    total = sympy.Add(*(t.shape[d] for t in ins))
    shape = first.shape[:d] + (total,) + first.shape[d + 1:]
    return OpInfo(TensorSpec(shape, first.dtype), assumptions=tuple(assumptions))


def _unary(ins: list[TensorSpec], a: Mapping[str, Any], strides: Strides | None) -> OpInfo:
    x = ins[0]
    if a.get("inplace", False):
        return OpInfo(TensorSpec(x.shape, a.get("dtype", x.dtype), strides=x.strides), view_of=0)
    return OpInfo(TensorSpec(x.shape, a.get("dtype", x.dtype), strides=strides))


def _cast_grads(ctx: RuleContext) -> Grads:
    """``x.to(dtype)`` converts the gradient back (new) when the dtype changed; else it is the same tensor."""
    src, dst = ctx.inputs[0].dtype, ctx.out.dtype
    act = ctx.options.get("activation_dtype", "float32")
    unchanged = (act if src == "act" else src) == (act if dst == "act" else dst)
    return Grads({0: ALIAS if unchanged else NEW})


@op("clone", attrs={**INPLACE, "memory_format": attr(one_of("preserve", "contiguous"), "'preserve' or 'contiguous'")},
    saves=keeps_nothing, grads=passes_on)
@op("to_dtype", attrs=INPLACE, saves=keeps_nothing, grads=_cast_grads)
def _copy_like(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # empty_like(x) then a copy: x's memory order, dense; ``memory_format="contiguous"`` (torch.contiguous_format,
    # and what torch.cat makes) a contiguous copy
    x = ins[0]
    return _unary(ins, a, None if a.get("memory_format") == "contiguous" else strides_like(x.shape, x.strides))


@op("cast", attrs={"dtype": attr(is_dtype, "a dtype name", True)}, saves=keeps_nothing, grads=_cast_grads)
def _cast(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # ``tensor.to(dtype)`` returns the tensor itself when the dtype already matches: recorded as a view, and
    # the derivation treats it as a new storage when the regime's activation dtype makes the dtypes differ.
    x = ins[0]
    dtype = a.get("dtype", x.dtype)
    # a conversion the graph already sees (two different concrete dtypes) is ``empty_like(x)``; one that depends
    # on the regime's activation dtype keeps the view's strides
    converts = ACT not in (x.dtype, dtype) and x.dtype != dtype
    return OpInfo(TensorSpec(x.shape, dtype, strides=strides_like(x.shape, x.strides) if converts else x.strides),
                  view_of=0)


# -- dropout ---------------------------------------------------------------------------------------------
def _dropout_saves(ctx: RuleContext) -> list[Saved]:
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


def _dropout_grads(ctx: RuleContext) -> Grads:
    """Dropout in training multiplies the gradient by its mask or noise (new); p = 0 passes it on."""
    p = ctx.attrs.get("p", 0.5)
    if p == 0 or not ctx.attrs.get("training", True):
        return Grads({0: ALIAS})
    return Grads({0: NEW})


@op("dropout", attrs={"p": attr(is_prob, "a probability in [0, 1]"), "training": BOOL}, saves=_dropout_saves,
    grads=_dropout_grads)
def _dropout(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # nn.Dropout(p=0) and dropout outside training return their input itself: no new storage.
    p = a.get("p", 0.5)
    if not 0 <= p <= 1:
        raise OpError(f"dropout probability {p} is not in [0, 1]")
    x = ins[0]
    if p == 0 or not a.get("training", True):
        return OpInfo(TensorSpec(x.shape, x.dtype, strides=x.strides), view_of=0)
    # x * noise, the noise empty_like(x): the layout TensorIterator gives x alone
    return OpInfo(TensorSpec(x.shape, x.dtype, strides=elementwise(x.shape, [(x.shape, x.strides)])))


# -- elementwise -----------------------------------------------------------------------------------------
def _relu_saves(ctx: RuleContext) -> list[Saved]:
    """ReLU keeps its output, in place or not: ``relu: threshold_backward(grad, result, 0)``.

    In place (``nn.ReLU(inplace=True)``) the output *is* the input's storage: after a batch norm that is the
    batch norm's output, a storage the batch norm itself does not keep, so the in-place ReLU adds exactly one
    storage per conv-BN-ReLU, as the out-of-place one would (the batch norm's input, the conv output, is the
    other).  The graph marks the in-place output as a view, so the storage resolves to the producer.
    """
    return [ctx.output()]


def _relu6_saves(ctx: RuleContext) -> list[Saved]:
    """ReLU6 is ``hardtanh(x, 0, 6)``: out of place it keeps its *input*, in place its output.

    ``hardtanh: self: hardtanh_backward(grad, self, min_val, max_val)`` saves ``self``;
    ``hardtanh_: self: hardtanh_backward(grad, result, min_val, max_val)`` saves the result, which is the
    input's storage.  Either way one storage of the input's size.
    """
    return [ctx.output()] if ctx.attrs.get("inplace") else [ctx.input(0)]


def _root_grads(ctx: RuleContext) -> Grads:
    """``rsqrt``: ``-0.5 * grad * result^3`` makes a temporary the size of the input before the gradient."""
    x = ctx.inputs[0]
    return Grads(temps=(TensorSpec(x.shape, x.dtype),))


def _pow_grads(ctx: RuleContext) -> Grads:
    """``pow(x, c)``: ``grad * c * x^(c-1)`` -- ``x^(c-1)`` and ``c * x^(c-1)`` are temporaries the size of x."""
    x = ctx.inputs[0]
    return Grads(temps=(TensorSpec(x.shape, x.dtype), TensorSpec(x.shape, x.dtype)))


@op("relu", attrs=INPLACE, saves=_relu_saves, grads=new_grads)
@op("relu6", attrs=INPLACE, saves=_relu6_saves, grads=new_grads)
@op("silu", attrs=INPLACE, saves=keeps_input, grads=new_grads)
@op("tanh", "sigmoid", "exp", attrs=INPLACE, saves=keeps_output, grads=new_grads)
@op("rsqrt", "sqrt", attrs=INPLACE, saves=keeps_output, grads=_root_grads)
@op("neg", attrs=INPLACE, saves=keeps_nothing, grads=new_grads)
@op("rotary", attrs=INPLACE, grads=new_grads,
    saves=Unsupported("a fused rotary-embedding kernel differs per library; build rotary from mul, slice, neg, "
                      "concat and add as Hugging Face does (symmem.models.llama)"))
@op("gelu", attrs={**INPLACE, "approximate": attr(one_of("none", "tanh"), "'none' or 'tanh'")}, saves=keeps_input,
    grads=new_grads)
@op("pow", attrs={**INPLACE, "exponent": attr(is_number, "a number", True)}, saves=keeps_input, grads=_pow_grads)
def _elementwise(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # TensorIterator: a new output in the memory order of the input (a transposed input gives a transposed
    # output, a strided view a dense one in the same order)
    x = ins[0]
    return _unary(ins, a, elementwise(x.shape, [(x.shape, x.strides)]))


@op("scale", attrs={**INPLACE, "factor": attr(is_number, "a number", True)}, saves=keeps_nothing, grads=new_grads)
def _scale(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]  # x * factor: the number is an operand too (no fast set-up)
    return _unary(ins, a, elementwise(x.shape, [(x.shape, x.strides)], scalar=True))


@op("scalar_add", attrs={"value": NUMBER}, saves=keeps_nothing, grads=passes_on)
def _scalar_add(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]  # x + number: TensorIterator with the number as an operand
    strides = elementwise(x.shape, [(x.shape, x.strides)], scalar=True)
    return OpInfo(TensorSpec(x.shape, x.dtype, strides=strides))


def _binary(ins: list[TensorSpec], a: Mapping[str, Any], operands: list[int] | None, scalar: bool = False
            ) -> OpInfo:
    # ``operands``: the inputs in the order PyTorch passes them to TensorIterator (None: a contiguous result)
    x, y = ins
    out = broadcast(x.shape, y.shape)
    if out is None:
        raise OpError(f"shapes {fmt(x.shape)} and {fmt(y.shape)} do not broadcast")
    dtype = a.get("dtype", x.dtype if x.dtype == ACT or y.dtype != ACT else y.dtype)
    if bool(a.get("inplace", False)):
        if out != x.shape:
            raise OpError(f"in-place result {fmt(out)} does not fit its first input {fmt(x.shape)}")
        return OpInfo(TensorSpec(out, dtype, strides=x.strides), view_of=0)
    strides = None if operands is None else elementwise(
        out, [(ins[i].shape, ins[i].strides) for i in operands], scalar=scalar)
    return OpInfo(TensorSpec(out, dtype, strides=strides))


def _add_grads(ctx: RuleContext) -> Grads:
    """``a + b`` hands its gradient to both inputs; an input that was broadcast gets ``sum_to_size`` (new), and
    ``a - b`` negates it for ``b`` (new)."""
    found = {}
    for i, x in enumerate(ctx.inputs):
        was_broadcast = numel(x.shape) != numel(ctx.out.shape)
        found[i] = NEW if was_broadcast or (ctx.kind == "sub" and i == 1) else ALIAS
    return Grads(found)


def _mul_saves(ctx: RuleContext) -> list[Saved]:
    """``x * y`` keeps ``y`` for x's gradient and ``x`` for y's, each only if that gradient is wanted."""
    found = []
    if ctx.requires_grad(1):
        found.append(ctx.input(0))
    if ctx.requires_grad(0):
        found.append(ctx.input(1))
    return found


def _div_saves(ctx: RuleContext) -> list[Saved]:
    """``x / y`` keeps ``y`` for x's gradient; y's gradient needs ``x`` and ``y``."""
    found = []
    if ctx.requires_grad(1):
        found.append(ctx.input(0))
    if ctx.requires_grad(0) or ctx.requires_grad(1):
        found.append(ctx.input(1))
    return found


def _div_grads(ctx: RuleContext) -> Grads:
    """``x / y``: ``grad / y`` for x (new); y's gradient ``-grad * x / y^2`` needs a temporary the size of the
    output when y requires grad."""
    out = ctx.out
    temps = (TensorSpec(out.shape, out.dtype),) if ctx.requires_grad(1) else ()
    return Grads(temps=temps)


@op("add", "sub", arity=2, attrs=INPLACE, saves=keeps_nothing, grads=_add_grads)
@op("mul", arity=2, attrs=INPLACE, saves=_mul_saves, grads=new_grads)
@op("div", arity=2, attrs=INPLACE, saves=_div_saves, grads=_div_grads)
def _arithmetic(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    return _binary(ins, a, [0, 1])


def _masked_saves(ctx: RuleContext) -> list[Saved]:
    """``x.masked_fill(mask, v)`` and ``torch.where(mask, x, v)`` keep only the mask (input 1 here)."""
    return [ctx.input(1)]


@op("where", arity=2, attrs=INPLACE, saves=_masked_saves, grads=new_grads)
def _where(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # torch.where(mask, x, number): the mask (input 1 here) is the first operand, then x, then a number
    return _binary(ins, a, [1, 0], scalar=True)


@op("masked_fill", arity=2, attrs=INPLACE, saves=_masked_saves, grads=new_grads)
def _masked_fill(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # x.masked_fill(mask, v) fills a contiguous clone of x
    return _binary(ins, a, None)


# -- reductions ------------------------------------------------------------------------------------------
def _reduce_dim(t: TensorSpec, d: int) -> int | None:
    """``wrap_dim`` for ops that take a dimension of a 0-dim tensor too (softmax, mean: PyTorch wraps dims of a scalar
    as if it had one dimension); None for a scalar."""
    if t.rank == 0:
        if d not in (-1, 0):
            raise OpError(f"dimension {d} is out of range for a 0-dim tensor")
        return None
    return wrap_dim(t, d)


def _softmax_grads(ctx: RuleContext) -> Grads:
    """``_softmax_backward_data(grad, result, ...)`` writes a new gradient.  On CUDA softmax's (not log-softmax's)
    backward first makes ``tmp = grad * output`` (``softmax_backward_cuda_out``, aten/src/ATen/native/cuda/
    SoftMax.cu): a tensor the size of the output, alive beside the new gradient while the kernel runs (the
    allocator's history on an H200: the peak of eager attention's backward, docs/cuda.md)."""
    if ctx.device == "cuda" and ctx.kind == "softmax":
        return Grads(temps=(ctx.out,))
    return Grads()


@op("softmax", "log_softmax", attrs={"dim": AXIS, "dtype": DTYPE}, saves=keeps_output, grads=_softmax_grads)
def _softmax(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]  # the softmax kernels write a contiguous output whatever the input's layout
    if "dim" in a:
        _reduce_dim(x, a["dim"])
    return OpInfo(TensorSpec(x.shape, a.get("dtype", x.dtype)))


@op("mean", attrs={"dim": AXIS, "keepdim": BOOL}, saves=keeps_nothing, grads=new_grads)
def _mean(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    d = _reduce_dim(x, a.get("dim", -1))
    if d is None:
        return OpInfo(TensorSpec((), x.dtype))
    one = (sympy.Integer(1),) if a.get("keepdim", False) else ()
    return OpInfo(TensorSpec(x.shape[:d] + one + x.shape[d + 1:], x.dtype))
