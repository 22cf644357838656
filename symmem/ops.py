"""The op-rule registry: for each op kind, its output shape and strides, its parameters and whether it is a view.

One small function per op kind, looked up by name (like torch.fx's ``run_node``).  What an op *keeps* for
backward is not here: that depends on the convention (see :mod:`symmem.conventions`).

Layouts (:mod:`symmem.layout`).  Every rule gives its output's strides: views rearrange their input's
(``transpose``, ``permute``, ``select``, ``slice``, ``expand``, ``identity``, ``block_input``), elementwise ops
follow their inputs' memory order as PyTorch's ``TensorIterator`` does, ``clone``/``to_dtype``/``cast`` keep it
(``empty_like``), and every other op makes a contiguous tensor.  Storage decisions come from the input strides
and are the rule's ``facts``: whether ``reshape``/``flatten``/``contiguous`` copies (``copy``), which operands a
batched ``matmul`` copies to fold into ``bmm`` (``copy_inputs``), and the layout ``attention`` sees
(``q_bshd``, ``v_contiguous``).  A builder may still state these as attributes (``copy=``, ``copy_inputs=``,
``q_layout=``, ``v_contiguous=``); a stated value wins over the derived one (graphs built before strides).

>>> from symmem.symbols import B, S, H
>>> from symmem.tensor import TensorSpec
>>> info = infer("linear", [TensorSpec((B, S, H))], {"out_features": 4 * H})
>>> info.out.shape, info.params
((B, S, 4*H), {'weight': (4*H, H), 'bias': (4*H,)})
>>> sorted(kinds())[:5]
['adaptive_avgpool2d', 'add', 'attention', 'avgpool2d', 'batchnorm']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy

from . import layout
from .branches import is_condition
from .errors import SymmemError
from .shapes import broadcast, fmt, numel, same
from .tensor import ACT, DTYPE_BYTES, TensorSpec, as_shape


class OpError(Exception):
    """Raised by a rule; the graph turns it into a SymmemError naming the node, the kind and the shapes."""


@dataclass(frozen=True)
class OpInfo:
    """What a rule infers: the output, the parameters (name -> shape), and whether the output is a view.

    ``view_of`` is the index of the input whose storage the output shares (a view), or None for a new
    storage.  ``assumptions`` are what the rule could not decide without numbers: pairs of expressions that
    must be equal, or ``(condition, None)`` (a slice's ``stop <= size``); the graph keeps them and checks them
    with numbers.  ``facts`` are the storage decisions the rule took from its inputs' strides (module docstring):
    each True, False or a condition on the sizes (``Ne(G, 1) & Ne(h/G, 1)``; :mod:`symmem.branches`).
    """

    out: TensorSpec
    params: Mapping[str, tuple[sympy.Expr, ...]] = field(default_factory=dict)
    view_of: int | None = None
    assumptions: tuple[tuple[sympy.Basic, sympy.Expr | None], ...] = ()
    #: state the module keeps that is not learned (batch norm's running statistics): name -> spec
    buffers: Mapping[str, TensorSpec] = field(default_factory=dict)
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Attr:
    """One attribute an op kind takes: a check of its value (raises :class:`OpError`) and whether it is
    required.  ``what`` says what the value must be, for errors and ``symmem ops``."""

    check: Callable[[Any], None]
    what: str
    required: bool = False


Rule = Callable[[list[TensorSpec], Mapping[str, Any]], OpInfo]
Schema = Mapping[str, Attr]
_RULES: dict[str, tuple[Rule, int | None, Schema]] = {}


def rule(*names: str, arity: int | None = 1, attrs: Schema | None = None) -> Callable[[Rule], Rule]:
    """Register ``fn`` as the rule for the op kinds ``names``; ``arity`` is the number of inputs (None: any);
    ``attrs`` is the schema of the attributes the kinds take (anything else is an error)."""

    def register(fn: Rule) -> Rule:
        for name in names:
            _RULES[name] = (fn, arity, dict(attrs or {}))
        return fn

    return register


def kinds() -> tuple[str, ...]:
    """Every registered op kind."""
    return tuple(_RULES)


def known(kind: object) -> bool:
    """Whether ``kind`` is a registered op kind."""
    return isinstance(kind, str) and kind in _RULES


def schema(kind: str) -> Schema:
    """The attributes ``kind`` takes.

    >>> sorted(schema("conv2d"))
    ['bias', 'dilation', 'groups', 'kernel', 'out_channels', 'padding', 'stride']
    """
    _lookup(kind)
    return dict(_RULES[kind][2])


def _lookup(kind: str) -> tuple[Rule, int | None, Schema]:
    try:
        return _RULES[kind]
    except (KeyError, TypeError):
        raise SymmemError(f"unknown op kind {kind!r}; known kinds: {', '.join(sorted(_RULES))}") from None


def check_attrs(kind: str, attrs: Mapping[str, Any]) -> None:
    """Raise :class:`OpError` for an unknown, missing or malformed attribute of ``kind``."""
    _, _, spec = _lookup(kind)
    for key in attrs:
        if key not in spec:
            import difflib  # only for the error message

            close = difflib.get_close_matches(str(key), list(spec), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            takes = ", ".join(sorted(spec)) or "no attributes"
            raise OpError(f"unknown attribute {key!r}{hint}; {kind} takes {takes}")
    for key, a in spec.items():
        if key not in attrs:
            if a.required:
                raise OpError(f"missing attribute {key!r} ({a.what})")
            continue
        try:
            a.check(attrs[key])
        except OpError as exc:
            raise OpError(f"attribute {key}={attrs[key]!r}: {exc}") from None
        except (TypeError, ValueError, sympy.SympifyError):
            raise OpError(f"attribute {key}={attrs[key]!r} is not {a.what}") from None


def infer(kind: str, inputs: list[TensorSpec], attrs: Mapping[str, Any]) -> OpInfo:
    """Check the attributes and apply the rule for ``kind``; raises OpError (bad attributes or shapes) or
    SymmemError (unknown kind).

    A rule is a pure function of the inputs and the attributes, so results are remembered by (rule, inputs,
    attributes): a graph repeats the same op on the same shapes many times, and :func:`symmem.graph.lint`
    re-infers every node it was just built with.
    """
    fn, arity, _ = _lookup(kind)
    key = _memo_key(fn, inputs, attrs)
    if key is not None:
        found = _MEMO.get(key)
        if found is not None:
            return found
    check_attrs(kind, attrs)
    if arity is not None and len(inputs) != arity:
        raise OpError(f"takes {arity} input(s), got {len(inputs)}")
    info = fn(inputs, attrs)
    if key is not None:
        if len(_MEMO) >= _MEMO_SIZE:
            _MEMO.clear()
        _MEMO[key] = info
    return info


_MEMO: dict[Any, OpInfo] = {}
_MEMO_SIZE = 65536


def _frozen(value: Any) -> Any:
    # The type goes into the key: True == 1 == 1.0 == sympy.Integer(1), but their checks differ.
    if isinstance(value, tuple | list):
        return (type(value), tuple(_frozen(v) for v in value))
    return (type(value), value)


def _memo_key(fn: Rule, inputs: list[TensorSpec], attrs: Mapping[str, Any]) -> Any:
    try:
        key = (fn, tuple(inputs), tuple((k, _frozen(v)) for k, v in attrs.items()))
        hash(key)
    except TypeError:  # an unhashable attribute (a dict): not remembered
        return None
    return key


# -- attribute checks ------------------------------------------------------------------------------------
def _sym(x: Any) -> sympy.Expr:
    # never sympify a string: that would evaluate text
    if isinstance(x, str):
        raise OpError(f"values are ints or sympy expressions, not the string {x!r}")
    if isinstance(x, bool) or x is None:
        raise OpError("not a number or a sympy expression")
    e = sympy.sympify(x, strict=True)
    if not isinstance(e, sympy.Expr):  # a condition, a tuple: not a size
        raise OpError(f"not a number or a sympy expression: {x!r}")
    if e.has(sympy.nan, sympy.oo, -sympy.oo, sympy.zoo):
        raise OpError(f"not a finite number: {x!r}")
    return e


def _is_dim(x: Any) -> None:
    e = _sym(x)
    if e.is_number and not (e.is_integer and e.is_positive):
        raise OpError("not a positive integer")


def _is_nonneg(x: Any) -> None:
    e = _sym(x)
    if e.is_number and not (e.is_integer and e >= 0):
        raise OpError("not a non-negative integer")


def _pair_of(check: Callable[[Any], None]) -> Callable[[Any], None]:
    def pair(x: Any) -> None:
        if isinstance(x, tuple | list):
            if len(x) != 2:
                raise OpError(f"needs one value or two (height, width), got {len(x)}")
            for v in x:
                check(v)
        else:
            check(x)

    return pair


def _is_shape(x: Any) -> None:
    if not isinstance(x, tuple | list):
        raise OpError("not a tuple of sizes")
    for d in x:
        _is_dim(d)


def _is_int(x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, int | sympy.Integer):
        raise OpError("not an integer")


def _is_ints(x: Any) -> None:
    if not isinstance(x, tuple | list):
        raise OpError("not a tuple of integers")
    for d in x:
        _is_int(d)


def _is_bool(x: Any) -> None:
    if not isinstance(x, bool):
        raise OpError("not True or False")


def _is_prob(x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1:
        raise OpError("not a probability in [0, 1]")


def _is_number(x: Any) -> None:
    _sym(x)


def _is_dtype(x: Any) -> None:
    if x != ACT and x not in DTYPE_BYTES:
        raise OpError(f"not a dtype ({', '.join([ACT, *DTYPE_BYTES])})")


def _is_flag(x: Any) -> None:
    # a bool, or a condition on the symbols (a view that copies for some sizes only; symmem.branches)
    if not (isinstance(x, bool) or is_condition(x) or x in (sympy.true, sympy.false)):
        raise OpError("not True, False or a sympy condition")


def _is_copy_inputs(x: Any) -> None:
    if not isinstance(x, tuple | list):
        raise OpError("not a tuple of input indices")
    for e in x:
        if isinstance(e, tuple):
            if len(e) != 2:
                raise OpError("entries are an index or (index, condition)")
            _is_int(e[0])
            _is_flag(e[1])
        else:
            _is_int(e)


def _one_of(*values: Any) -> Callable[[Any], None]:
    def check(x: Any) -> None:
        if x not in values:
            raise OpError(f"not one of {', '.join(map(repr, values))}")

    return check


def _any(x: Any) -> None:
    return None


def _is_text(x: Any) -> None:
    if not isinstance(x, str):
        raise OpError("not a string")


def _a(check: Callable[[Any], None], what: str, required: bool = False) -> Attr:
    return Attr(check, what, required)


DIM = _a(_is_dim, "a positive integer or a symbol")
REQ_DIM = _a(_is_dim, "a positive integer or a symbol", True)
PAIR = _a(_pair_of(_is_dim), "a positive size or a (height, width) pair")
PAD = _a(_pair_of(_is_nonneg), "a non-negative size or a (height, width) pair")
SHAPE = _a(_is_shape, "a tuple of positive sizes", True)
AXIS = _a(_is_int, "a dimension index")
BOOL = _a(_is_bool, "True or False")
DTYPE = _a(_is_dtype, "a dtype name")
NUMBER = _a(_is_number, "a number")
FLAG = _a(_is_flag, "True, False or a condition")
INPLACE = {"inplace": BOOL, "dtype": DTYPE}


def _expr(x: Any) -> sympy.Expr:
    return sympy.sympify(x, strict=True)


def _pair(x: Any) -> tuple[sympy.Expr, sympy.Expr]:
    if isinstance(x, tuple | list):
        return _expr(x[0]), _expr(x[1])
    return _expr(x), _expr(x)


def _need_rank(t: TensorSpec, rank: int, what: str = "input") -> None:
    if t.rank != rank:
        raise OpError(f"{what} must have rank {rank}, got {fmt(t.shape)}")


def _dim(t: TensorSpec, d: int) -> int:
    if not -t.rank <= d < t.rank:
        raise OpError(f"dimension {d} is out of range for {fmt(t.shape)}")
    return d % t.rank


def _reduce_dim(t: TensorSpec, d: int) -> int | None:
    """``_dim`` for ops that take a dimension of a 0-dim tensor too (softmax, mean: PyTorch wraps dims of a scalar
    as if it had one dimension); None for a scalar."""
    if t.rank == 0:
        if d not in (-1, 0):
            raise OpError(f"dimension {d} is out of range for a 0-dim tensor")
        return None
    return _dim(t, d)


def _check_eq(a: sympy.Expr, b: sympy.Expr, what: str | Callable[[], str]
              ) -> tuple[tuple[sympy.Expr, sympy.Expr], ...]:
    """() when ``a`` = ``b``, the pair as an assumption when undecided; ``what`` (text, or a function making it:
    printing shapes costs more than comparing them) names the check in the error when they differ."""
    verdict = same(a, b)
    if verdict is False:
        raise OpError(f"{what() if callable(what) else what}: {a} != {b}")
    return () if verdict else ((a, b),)


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


@rule("input", arity=0, attrs={"shape": SHAPE, "dtype": DTYPE})
def _input(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    return OpInfo(TensorSpec(a["shape"], a.get("dtype", ACT)))


@rule("parameter", arity=0, attrs={"shape": SHAPE, "dtype": DTYPE})
def _parameter(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    shape = as_shape(a["shape"])
    return OpInfo(TensorSpec(shape, a.get("dtype", ACT)), {"value": shape})


@rule("block_input", "identity")
def _alias(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    return OpInfo(ins[0].with_(role=None), view_of=0)


@rule("dropout", attrs={"p": _a(_is_prob, "a probability in [0, 1]"), "training": BOOL})
def _dropout(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # nn.Dropout(p=0) and dropout outside training return their input itself: no new storage.
    p = a.get("p", 0.5)
    if not 0 <= p <= 1:
        raise OpError(f"dropout probability {p} is not in [0, 1]")
    x = ins[0]
    if p == 0 or not a.get("training", True):
        return OpInfo(TensorSpec(x.shape, x.dtype, strides=x.strides), view_of=0)
    # x * noise, the noise empty_like(x): the layout TensorIterator gives x alone
    return OpInfo(TensorSpec(x.shape, x.dtype, strides=layout.elementwise(x.shape, [(x.shape, x.strides)])))


def _unary(ins: list[TensorSpec], a: Mapping[str, Any], strides: layout.Strides | None) -> OpInfo:
    x = ins[0]
    if a.get("inplace", False):
        return OpInfo(TensorSpec(x.shape, a.get("dtype", x.dtype), strides=x.strides), view_of=0)
    return OpInfo(TensorSpec(x.shape, a.get("dtype", x.dtype), strides=strides))


@rule("relu", "relu6", "silu", "tanh", "sigmoid", "exp", "neg", "rsqrt", "sqrt", "rotary", attrs=INPLACE)
@rule("gelu", attrs={**INPLACE, "approximate": _a(_one_of("none", "tanh"), "'none' or 'tanh'")})
@rule("pow", attrs={**INPLACE, "exponent": _a(_is_number, "a number", True)})
def _elementwise(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # TensorIterator: a new output in the memory order of the input (a transposed input gives a transposed
    # output, a strided view a dense one in the same order)
    x = ins[0]
    return _unary(ins, a, layout.elementwise(x.shape, [(x.shape, x.strides)]))


@rule("scale", attrs={**INPLACE, "factor": _a(_is_number, "a number", True)})
def _scale(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]  # x * factor: the number is an operand too (no fast set-up)
    return _unary(ins, a, layout.elementwise(x.shape, [(x.shape, x.strides)], scalar=True))


@rule("clone", attrs={**INPLACE, "memory_format": _a(_one_of("preserve", "contiguous"), "'preserve' or 'contiguous'")})
@rule("to_dtype", attrs=INPLACE)
def _copy_like(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # empty_like(x) then a copy: x's memory order, dense; ``memory_format="contiguous"`` (torch.contiguous_format,
    # and what torch.cat makes) a contiguous copy
    x = ins[0]
    return _unary(ins, a, None if a.get("memory_format") == "contiguous" else layout.like(x.shape, x.strides))


@rule("softmax", "log_softmax", attrs={"dim": AXIS, "dtype": DTYPE})
def _softmax(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]  # the softmax kernels write a contiguous output whatever the input's layout
    if "dim" in a:
        _reduce_dim(x, a["dim"])
    return OpInfo(TensorSpec(x.shape, a.get("dtype", x.dtype)))


def _copy_flag(a: Mapping[str, Any], derived: layout.Flag) -> layout.Flag:
    """Whether the output is a copy: a builder's ``copy=`` if it gave one (graphs written before strides; it
    wins), else what the input's strides decide."""
    copy = a.get("copy", derived)
    return bool(copy) if copy in (sympy.true, sympy.false) else copy


def _view_or_copy(out: TensorSpec, copy: layout.Flag, **info: Any) -> OpInfo:
    # A copy is a new (contiguous) storage.  A condition is a view in the graph, a copy in the branches where it
    # holds (symmem.branches); its strides are the view's, contiguous in the cases that copy.
    if copy is True:
        return OpInfo(out.with_(strides=None), facts={"copy": True}, **info)
    return OpInfo(out, view_of=0, facts={"copy": copy}, **info)


@rule("contiguous", attrs={"copy": FLAG, "dtype": DTYPE})
def _contiguous(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # ``contiguous()`` returns its input when that is contiguous already (layout.made_contiguous)
    x = ins[0]
    strides, copies = layout.made_contiguous(x.shape, x.strides)
    return _view_or_copy(TensorSpec(x.shape, a.get("dtype", x.dtype), strides=strides), _copy_flag(a, copies))


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
    strides = None if operands is None else layout.elementwise(
        out, [(ins[i].shape, ins[i].strides) for i in operands], scalar=scalar)
    return OpInfo(TensorSpec(out, dtype, strides=strides))


@rule("add", "mul", "sub", "div", arity=2, attrs=INPLACE)
def _arithmetic(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    return _binary(ins, a, [0, 1])


@rule("where", arity=2, attrs=INPLACE)
def _where(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # torch.where(mask, x, number): the mask (input 1 here) is the first operand, then x, then a number
    return _binary(ins, a, [1, 0], scalar=True)


@rule("masked_fill", arity=2, attrs=INPLACE)
def _masked_fill(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # x.masked_fill(mask, v) fills a contiguous clone of x
    return _binary(ins, a, None)


@rule("conv2d", attrs={"out_channels": REQ_DIM, "kernel": _a(_pair_of(_is_dim), "a kernel size", True), "stride": PAIR,
                      "padding": PAD, "dilation": PAIR, "groups": DIM, "bias": BOOL})
def _conv2d(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    _need_rank(x, 4)
    n, c, hh, ww = x.shape
    out_c = _expr(a["out_channels"])
    kh, kw = _pair(a["kernel"])
    sh, sw = _pair(a.get("stride", 1))
    ph, pw = _pair(a.get("padding", 0))
    dh, dw = _pair(a.get("dilation", 1))
    groups = _expr(a.get("groups", 1))
    for what, value in (("input channels", c), ("output channels", out_c)):
        q = value / groups
        if q.is_number and not q.is_integer:
            raise OpError(f"{what} {value} are not divisible by groups={groups}")
    out = (n, out_c, _window(hh, kh, sh, ph, dh), _window(ww, kw, sw, pw, dw))
    params: dict[str, tuple[sympy.Expr, ...]] = {"weight": (out_c, c / groups, kh, kw)}
    if a.get("bias", True):
        params["bias"] = (out_c,)
    return OpInfo(TensorSpec(out, x.dtype), params)


@rule("patch_embed", attrs={"patch": REQ_DIM, "dim": REQ_DIM, "tokens": DIM})
def _patch_embed(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    _need_rank(x, 4)
    n, c, hh, ww = x.shape
    patch, dim = _expr(a["patch"]), _expr(a["dim"])
    grid = sympy.floor(hh / patch) * sympy.floor(ww / patch)
    tokens = _expr(a.get("tokens", grid))
    assumptions = _check_eq(tokens, grid, "patch tokens")
    return OpInfo(TensorSpec((n, tokens, dim), x.dtype),
                  {"weight": (dim, c, patch, patch), "bias": (dim,)}, assumptions=assumptions)


@rule("batchnorm", attrs={"affine": BOOL, "eps": NUMBER, "momentum": NUMBER})
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


@rule("layernorm", attrs={"affine": BOOL, "bias": BOOL, "eps": NUMBER})
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


@rule("rmsnorm", attrs={"affine": BOOL, "eps": NUMBER})
def _rmsnorm(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    if x.rank < 1:
        raise OpError("rmsnorm needs at least one dimension")
    return OpInfo(TensorSpec(x.shape, x.dtype), {"weight": (x.shape[-1],)} if a.get("affine", True) else {})


_POOL = {"kernel": _a(_pair_of(_is_dim), "a kernel size", True), "stride": PAIR, "padding": PAD, "ceil_mode": BOOL}


@rule("maxpool2d", attrs={**_POOL, "dilation": PAIR})
@rule("avgpool2d", attrs=_POOL)  # F.avg_pool2d takes no dilation
def _pool(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    _need_rank(x, 4)
    n, c, hh, ww = x.shape
    kh, kw = _pair(a["kernel"])
    sh, sw = _pair(a.get("stride", a["kernel"]))
    ph, pw = _pair(a.get("padding", 0))
    dh, dw = _pair(a.get("dilation", 1))
    ceil_mode = bool(a.get("ceil_mode", False))
    for k, pad in ((kh, ph), (kw, pw)):
        # PyTorch: "pad should be at most half of effective kernel size" (pool2d_shape_check: k/2 >= pad)
        if (pad - sympy.floor(k / 2)).is_positive:
            raise OpError(f"padding {pad} is more than half the kernel {k}")
    out = (n, c, _window(hh, kh, sh, ph, dh, ceil_mode), _window(ww, kw, sw, pw, dw, ceil_mode))
    return OpInfo(TensorSpec(out, x.dtype))


@rule("adaptive_avgpool2d", attrs={"output_size": PAIR})
def _adaptive_pool(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    _need_rank(x, 4)
    oh, ow = _pair(a.get("output_size", 1))
    return OpInfo(TensorSpec((x.shape[0], x.shape[1], oh, ow), x.dtype))


@rule("flatten", attrs={"start_dim": AXIS, "end_dim": AXIS, "copy": FLAG})
def _flatten(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    start = _dim(x, a.get("start_dim", 1))
    end = _dim(x, a.get("end_dim", -1))
    if end < start:
        raise OpError(f"end_dim {end} before start_dim {start}")
    shape = x.shape[:start] + (numel(x.shape[start:end + 1]),) + x.shape[end + 1:]
    if start == end:  # flatten of one dimension returns its input
        return _view_or_copy(TensorSpec(shape, x.dtype, strides=x.strides), _copy_flag(a, False))
    strides, copies = layout.reshaped(x.shape, x.strides, shape)
    return _view_or_copy(TensorSpec(shape, x.dtype, strides=strides), _copy_flag(a, copies))


@rule("reshape", attrs={"shape": SHAPE, "copy": FLAG})
def _reshape(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    shape = as_shape(a["shape"])
    assumptions = _check_eq(numel(shape), numel(x.shape), lambda: f"reshape {fmt(x.shape)} -> {fmt(shape)}")
    # a view where PyTorch's computeStride finds one, else a copy; a condition where that depends on the sizes
    strides, copies = layout.reshaped(x.shape, x.strides, shape)
    return _view_or_copy(TensorSpec(shape, x.dtype, strides=strides), _copy_flag(a, copies), assumptions=assumptions)


@rule("transpose", attrs={"dim0": AXIS, "dim1": AXIS})
def _transpose(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    i, j = _dim(x, a.get("dim0", -2)), _dim(x, a.get("dim1", -1))
    dims = list(range(x.rank))
    dims[i], dims[j] = dims[j], dims[i]
    return _permuted(x, dims)


def _permuted(x: TensorSpec, dims: list[int]) -> OpInfo:
    strides = layout.permuted(x.shape, x.strides, dims)
    return OpInfo(TensorSpec(tuple(x.shape[d] for d in dims), x.dtype, strides=strides), view_of=0)


@rule("permute", attrs={"dims": _a(_is_ints, "a permutation of the dimensions", True)})
def _permute(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    dims = [_dim(x, d) for d in a["dims"]]
    if sorted(dims) != list(range(x.rank)):
        raise OpError(f"permutation {a['dims']} does not fit rank {x.rank}")
    return _permuted(x, dims)


def _is_expand_shape(x: Any) -> None:
    if not isinstance(x, tuple | list):
        raise OpError("not a tuple of sizes")
    for d in x:
        if not (isinstance(d, int) and not isinstance(d, bool) and d == -1):
            _is_dim(d)


@rule("expand", attrs={"shape": _a(_is_expand_shape, "a tuple of sizes (-1 keeps a dimension)", True)})
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
        t = _expr(t)
        if i >= lead:
            have = x.shape[i - lead]
            if have != 1:
                if same(have, t) is False:
                    raise OpError(f"cannot expand {fmt(x.shape)} to {tuple(target)}: dimension {i - lead} of size "
                                  f"{have} is not 1")
                found += _check_eq(have, t, "expand")
        out.append(t)
    shape = tuple(out)
    return OpInfo(TensorSpec(shape, x.dtype, strides=layout.expanded(x.shape, x.strides, shape)), view_of=0,
                  assumptions=tuple(found))


@rule("slice", attrs={"dim": AXIS, "start": _a(_is_nonneg, "a start index"), "stop": DIM, "split": BOOL})
def _slice(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    d = _dim(x, a.get("dim", 0))
    size = x.shape[d]
    start = _expr(a.get("start", 0))
    stop = _expr(a.get("stop", size))
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
    return OpInfo(TensorSpec(shape, x.dtype, strides=layout.sliced(x.shape, x.strides, shape)), view_of=0,
                  assumptions=found)


@rule("select", attrs={"dim": AXIS, "index": AXIS, "split": BOOL})
def _select(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    d = _dim(x, a.get("dim", 0))
    index = _expr(a.get("index", 0))
    size = x.shape[d]
    # PyTorch: -size <= index < size; decided now when the numbers allow, else checked with numbers later
    found: tuple[tuple[sympy.Basic, None], ...] = ()
    low, high = (index + size, size - 1 - index) if index < 0 else (index, size - 1 - index)
    for gap in (low, high):
        if gap.is_negative or (gap.is_number and gap < 0):
            raise OpError(f"index {index} is out of range for dimension {d} of size {size}")
        if not (gap.is_nonnegative or (gap.is_number and gap >= 0)):
            found += ((sympy.Ge(gap, 0), None),)
    strides = layout.selected(x.shape, x.strides, d)
    return OpInfo(TensorSpec(x.shape[:d] + x.shape[d + 1:], x.dtype, strides=strides), view_of=0, assumptions=found)


@rule("concat", arity=None, attrs={"dim": AXIS})
def _concat(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    if len(ins) < 2:
        raise OpError("concat needs at least two inputs")
    first = ins[0]
    d = _dim(first, a.get("dim", 0))
    assumptions: list[tuple[sympy.Expr, sympy.Expr]] = []
    for t in ins[1:]:
        if t.rank != first.rank:
            raise OpError(f"ranks differ: {fmt(first.shape)} and {fmt(t.shape)}")
        for i, (u, v) in enumerate(zip(first.shape, t.shape, strict=True)):
            if i != d:
                assumptions += _check_eq(u, v, f"concat dimension {i}")
    total = sympy.Add(*(t.shape[d] for t in ins))
    shape = first.shape[:d] + (total,) + first.shape[d + 1:]
    return OpInfo(TensorSpec(shape, first.dtype), assumptions=tuple(assumptions))


@rule("linear", attrs={"out_features": REQ_DIM, "in_features": DIM, "bias": BOOL, "tied": BOOL})
def _linear(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    if x.rank < 1:
        raise OpError("linear needs at least one dimension")
    d_in = x.shape[-1]
    assumptions = _check_eq(d_in, _expr(a.get("in_features", d_in)), "in_features")
    out_f = _expr(a["out_features"])
    params: dict[str, tuple[sympy.Expr, ...]] = {}
    if not a.get("tied"):
        params["weight"] = (out_f, d_in)
    if a.get("bias", True):
        params["bias"] = (out_f,)
    return OpInfo(TensorSpec(x.shape[:-1] + (out_f,), x.dtype), params, assumptions=assumptions)


@rule("matmul", arity=2, attrs={"copy_inputs": _a(_is_copy_inputs, "input indices, each maybe with a condition")})
def _matmul(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x, y = ins
    if x.rank < 2 or y.rank < 2:
        raise OpError(f"matmul needs rank >= 2, got {fmt(x.shape)} @ {fmt(y.shape)}")
    assumptions = _check_eq(x.shape[-1], y.shape[-2],
                            lambda: f"inner dimensions of {fmt(x.shape)} @ {fmt(y.shape)}")
    batch = broadcast(x.shape[:-2], y.shape[:-2])
    if batch is None:
        raise OpError(f"batch dimensions of {fmt(x.shape)} @ {fmt(y.shape)} do not broadcast")
    if "copy_inputs" in a:  # a builder's statement wins (graphs written before strides)
        copies = tuple(a["copy_inputs"])
    else:
        # an operand whose batch cannot be folded into bmm's by a view is copied (layout.matmul_copies)
        flags = layout.matmul_copies((x.shape, x.strides), (y.shape, y.strides))
        copies = tuple(i if f is True else (i, f) for i, f in enumerate(flags) if f is not False)
    return OpInfo(TensorSpec(batch + (x.shape[-2], y.shape[-1]), x.dtype), assumptions=assumptions,
                  facts={"copy_inputs": copies})


@rule("attention", arity=3, attrs={"causal": BOOL, "dropout": _a(_is_prob, "a probability in [0, 1]"),
                                  "q_layout": _a(_one_of("bhsd", "bshd"), "'bhsd' or 'bshd'"), "v_contiguous": FLAG,
                                  "mask": _a(_any, "an attention mask"), "scale": NUMBER})
def _attention(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    q, k, v = ins
    for t in (q, k, v):
        if t.rank < 3:
            raise OpError(f"attention needs (..., heads, seq, dim), got {fmt(t.shape)}")
    found = list(_check_eq(q.shape[-1], k.shape[-1], "query/key head dims"))
    found += _check_eq(k.shape[-2], v.shape[-2], "key/value sequence lengths")
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
    gqa: layout.Flag = False
    if same(heads, kv_heads) is not True:
        gqa = True if (heads - kv_heads).is_number else sympy.Ne(heads / kv_heads, 1)
    if "q_layout" in a:
        q_bshd: layout.Flag = a["q_layout"] == "bshd"
    else:
        q_bshd = layout.heads_outer(q.shape, q.strides)
    if "v_contiguous" in a:
        v_contiguous = a["v_contiguous"]
    else:
        v_contiguous = layout.attention_keeps_value(lead + (q.shape[-2], k.shape[-2]), v.shape, v.strides)
    return {"q_bshd": q_bshd, "v_contiguous": v_contiguous, "gqa": gqa}


@rule("embedding", attrs={"num_embeddings": REQ_DIM, "dim": REQ_DIM, "padding_idx": AXIS})
def _embedding(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    ids = ins[0]
    if ids.dtype not in ("int64", "int32"):
        raise OpError(f"embedding needs integer ids, got dtype {ids.dtype}")
    num, dim = _expr(a["num_embeddings"]), _expr(a["dim"])
    if a.get("padding_idx") is not None:
        pad = _expr(a["padding_idx"])
        low, high = (pad + num, num - 1 - pad) if pad < 0 else (pad, num - 1 - pad)
        if (low.is_number and low < 0) or (high.is_number and high < 0):
            raise OpError(f"padding_idx {pad} is out of range for {num} embeddings")
    return OpInfo(TensorSpec(ids.shape + (dim,), ACT), {"weight": (num, dim)})


@rule("cross_entropy", arity=2, attrs={"reduction": _a(_one_of("mean", "sum"), "'mean' or 'sum'")})
def _cross_entropy(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    logits, target = ins
    if logits.rank < 1:
        raise OpError("cross-entropy needs logits with a class dimension, got a 0-dim tensor")
    assumptions = _check_eq(numel(logits.shape[:-1]), numel(target.shape), "cross-entropy targets")
    return OpInfo(TensorSpec((), "float32" if logits.dtype != ACT else ACT), assumptions=assumptions)


# -- sequence-model helpers: tensors made inside the forward, module buffers, reductions, casts ----------
@rule("constant", "buffer", arity=0, attrs={"shape": SHAPE, "dtype": DTYPE})
def _constant(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # ``constant``: a tensor the forward makes that needs no gradient (position ids, an additive mask, a
    # 0-dim divisor); an activation if some op saves it.  ``buffer``: module state (a registered causal
    # mask), reported like parameters but with no parameter count.
    return OpInfo(TensorSpec(a["shape"], a.get("dtype", ACT)))


@rule("scalar_add", attrs={"value": NUMBER})
def _scalar_add(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]  # x + number: TensorIterator with the number as an operand
    strides = layout.elementwise(x.shape, [(x.shape, x.strides)], scalar=True)
    return OpInfo(TensorSpec(x.shape, x.dtype, strides=strides))


@rule("cast", attrs={"dtype": _a(_is_dtype, "a dtype name", True)})
def _cast(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # ``tensor.to(dtype)`` returns the tensor itself when the dtype already matches: recorded as a view, and
    # the derivation treats it as a new storage when the regime's activation dtype makes the dtypes differ.
    x = ins[0]
    dtype = a.get("dtype", x.dtype)
    # a conversion the graph already sees (two different concrete dtypes) is ``empty_like(x)``; one that depends
    # on the regime's activation dtype keeps the view's strides
    converts = ACT not in (x.dtype, dtype) and x.dtype != dtype
    return OpInfo(TensorSpec(x.shape, dtype, strides=layout.like(x.shape, x.strides) if converts else x.strides),
                  view_of=0)


@rule("mean", attrs={"dim": AXIS, "keepdim": BOOL})
def _mean(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    x = ins[0]
    d = _reduce_dim(x, a.get("dim", -1))
    if d is None:
        return OpInfo(TensorSpec((), x.dtype))
    one = (sympy.Integer(1),) if a.get("keepdim", False) else ()
    return OpInfo(TensorSpec(x.shape[:d] + one + x.shape[d + 1:], x.dtype))


@rule("rope_table", attrs={"dim": REQ_DIM, "dtype": DTYPE})
def _rope_table(ins: list[TensorSpec], a: Mapping[str, Any]) -> OpInfo:
    # cos or sin of the rotary angles for position ids (..., S): (..., S, dim), computed without gradient.
    return OpInfo(TensorSpec(ins[0].shape + (_expr(a["dim"]),), a.get("dtype", ACT)))
