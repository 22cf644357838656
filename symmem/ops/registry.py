"""The op-kind registry: one entry per op kind, made by one :func:`op` call that gives all its rules.

An entry (:class:`OpKind`) holds the kind's **shape rule** (its output's shape and strides, its parameters and
whether it is a view: a function of the input specs and the attributes, :class:`OpInfo`), its arity and its
**attribute schema** (:class:`Attr` per attribute; anything else is an error), and the two rules of eager
PyTorch's training step the ``pytorch`` convention reads (:mod:`symmem.ops.autograd`): the **save rule** (which
tensors the op's backward keeps) and the **gradient rule** (what its backward allocates).  A kind with no such
rule says why (:class:`Unsupported`).  Registering a kind twice is an error, and :func:`check_complete` (run when
:mod:`symmem.ops` is imported) refuses a kind that lacks a rule without saying why.

>>> sorted(schema("conv2d"))
['bias', 'dilation', 'groups', 'kernel', 'out_channels', 'padding', 'stride']
>>> entry("rotary").saves.reason[:54]
'a fused rotary-embedding kernel differs per library; b'
>>> op("relu")(lambda ins, a: None)  # doctest: +ELLIPSIS
Traceback (most recent call last):
symmem.errors.SymmemError: op kind 'relu' is registered twice (...): one registration per op kind
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy

from ..conditions import is_condition
from ..errors import SymmemError
from ..shapes import fmt, same
from ..tensor import ACT, DTYPE_BYTES, TensorSpec

if TYPE_CHECKING:
    from .autograd import GradRule, SaveRule


class OpError(Exception):
    """Raised by a rule; the graph turns it into a SymmemError naming the node, the kind and the shapes."""


@dataclass(frozen=True)
class OpInfo:
    """What a rule infers: the output, the parameters (name -> shape), and whether the output is a view.

    ``view_of`` is the index of the input whose storage the output shares (a view), or None for a new
    storage.  ``assumptions`` are what the rule could not decide without numbers: pairs of expressions that
    must be equal, or ``(condition, None)`` (a slice's ``stop <= size``); the graph keeps them and checks them
    with numbers.  ``facts`` are the storage decisions the rule took from its inputs' strides (:mod:`symmem.ops`):
    each True, False or a condition on the sizes (``Ne(G, 1) & Ne(h/G, 1)``; :mod:`symmem.conditions`).
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


@dataclass(frozen=True)
class Unsupported:
    """Stands for a rule an op kind does not have, with the reason (shown to whoever meets the kind)."""

    reason: str


ShapeRule = Callable[[list[TensorSpec], Mapping[str, Any]], OpInfo]
Schema = Mapping[str, Attr]


@dataclass(frozen=True)
class OpKind:
    """Everything symmem knows of one op kind: its shape rule, arity (None: any), attribute schema, and the
    pytorch convention's save and gradient rules (None until given; :func:`check_complete` refuses None)."""

    name: str
    shape: ShapeRule
    arity: int | None
    attrs: Schema
    saves: SaveRule | Unsupported | None
    grads: GradRule | Unsupported | None


_KINDS: dict[str, OpKind] = {}


def op(*names: str, arity: int | None = 1, attrs: Schema | None = None, saves: SaveRule | Unsupported | None = None,
       grads: GradRule | Unsupported | None = None) -> Callable[[ShapeRule], ShapeRule]:
    """Register the decorated shape rule for the op kinds ``names``, with their ``arity`` (number of inputs;
    None: any), the ``attrs`` schema, and what eager PyTorch's autograd does with them: the ``saves`` rule (the
    tensors the backward keeps) and the ``grads`` rule (what the backward allocates), or :class:`Unsupported`
    with the reason.  A kind registered twice is a :class:`SymmemError` naming it."""

    def register(fn: ShapeRule) -> ShapeRule:
        for name in names:
            if name in _KINDS:
                raise SymmemError(f"op kind {name!r} is registered twice ({_KINDS[name].shape.__module__} and "
                                  f"{fn.__module__}): one registration per op kind")
            _KINDS[name] = OpKind(name, fn, arity, dict(attrs or {}), saves, grads)
        return fn

    return register


def check_complete() -> None:
    """Refuse, naming them, op kinds with no save rule or no gradient rule and no stated reason
    (:class:`Unsupported`): every kind answers for every rule, so no derivation meets a silent gap."""
    for what, field_name in (("save rule", "saves"), ("gradient rule", "grads")):
        missing = sorted(k for k, e in _KINDS.items() if getattr(e, field_name) is None)
        if missing:
            raise SymmemError(f"op kinds without a {what} (give one, or Unsupported with the reason): "
                              f"{', '.join(missing)}")


def kinds() -> tuple[str, ...]:
    """Every registered op kind."""
    return tuple(_KINDS)


def known(kind: object) -> bool:
    """Whether ``kind`` is a registered op kind."""
    return isinstance(kind, str) and kind in _KINDS


def entry(kind: str) -> OpKind:
    """The registry's entry for ``kind``; a :class:`SymmemError` lists the known kinds otherwise."""
    try:
        return _KINDS[kind]
    except (KeyError, TypeError):
        raise SymmemError(f"unknown op kind {kind!r}; known kinds: {', '.join(sorted(_KINDS))}") from None


def schema(kind: str) -> Schema:
    """The attributes ``kind`` takes."""
    return dict(entry(kind).attrs)


def check_attrs(kind: str, attrs: Mapping[str, Any]) -> None:
    """Raise :class:`OpError` for an unknown, missing or malformed attribute of ``kind``."""
    spec = entry(kind).attrs
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
    found_kind = entry(kind)
    fn, arity = found_kind.shape, found_kind.arity
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


def _memo_key(fn: ShapeRule, inputs: list[TensorSpec], attrs: Mapping[str, Any]) -> Any:
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


def is_dim(x: Any) -> None:
    e = _sym(x)
    if e.is_number and not (e.is_integer and e.is_positive):
        raise OpError("not a positive integer")


def is_nonneg(x: Any) -> None:
    e = _sym(x)
    if e.is_number and not (e.is_integer and e >= 0):
        raise OpError("not a non-negative integer")


def pair_of(check: Callable[[Any], None]) -> Callable[[Any], None]:
    def check_pair(x: Any) -> None:
        if isinstance(x, tuple | list):
            if len(x) != 2:
                raise OpError(f"needs one value or two (height, width), got {len(x)}")
            for v in x:
                check(v)
        else:
            check(x)

    return check_pair


def is_shape(x: Any) -> None:
    if not isinstance(x, tuple | list):
        raise OpError("not a tuple of sizes")
    for d in x:
        is_dim(d)


def is_int(x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, int | sympy.Integer):
        raise OpError("not an integer")


def is_ints(x: Any) -> None:
    if not isinstance(x, tuple | list):
        raise OpError("not a tuple of integers")
    for d in x:
        is_int(d)


def is_bool(x: Any) -> None:
    if not isinstance(x, bool):
        raise OpError("not True or False")


def is_prob(x: Any) -> None:
    if isinstance(x, bool) or not isinstance(x, int | float) or not 0 <= x <= 1:
        raise OpError("not a probability in [0, 1]")


def is_number(x: Any) -> None:
    _sym(x)


def is_dtype(x: Any) -> None:
    if x != ACT and x not in DTYPE_BYTES:
        raise OpError(f"not a dtype ({', '.join([ACT, *DTYPE_BYTES])})")


def is_flag(x: Any) -> None:
    # a bool, or a condition on the symbols (a view that copies for some sizes only; symmem.conditions)
    if not (isinstance(x, bool) or is_condition(x) or x in (sympy.true, sympy.false)):
        raise OpError("not True, False or a sympy condition")


def is_copy_inputs(x: Any) -> None:
    if not isinstance(x, tuple | list):
        raise OpError("not a tuple of input indices")
    for e in x:
        if isinstance(e, tuple):
            if len(e) != 2:
                raise OpError("entries are an index or (index, condition)")
            is_int(e[0])
            is_flag(e[1])
        else:
            is_int(e)


def one_of(*values: Any) -> Callable[[Any], None]:
    def check(x: Any) -> None:
        if x not in values:
            raise OpError(f"not one of {', '.join(map(repr, values))}")

    return check


def any_value(x: Any) -> None:
    return None


def is_text(x: Any) -> None:
    if not isinstance(x, str):
        raise OpError("not a string")


def attr(check: Callable[[Any], None], what: str, required: bool = False) -> Attr:
    return Attr(check, what, required)


DIM = attr(is_dim, "a positive integer or a symbol")
REQ_DIM = attr(is_dim, "a positive integer or a symbol", True)
PAIR = attr(pair_of(is_dim), "a positive size or a (height, width) pair")
PAD = attr(pair_of(is_nonneg), "a non-negative size or a (height, width) pair")
SHAPE = attr(is_shape, "a tuple of positive sizes", True)
AXIS = attr(is_int, "a dimension index")
BOOL = attr(is_bool, "True or False")
DTYPE = attr(is_dtype, "a dtype name")
NUMBER = attr(is_number, "a number")
FLAG = attr(is_flag, "True, False or a condition")
INPLACE = {"inplace": BOOL, "dtype": DTYPE}


# -- what the shape rules share --------------------------------------------------------------------------
def expr(x: Any) -> sympy.Expr:
    return sympy.sympify(x, strict=True)


def pair(x: Any) -> tuple[sympy.Expr, sympy.Expr]:
    if isinstance(x, tuple | list):
        return expr(x[0]), expr(x[1])
    return expr(x), expr(x)


def need_rank(t: TensorSpec, rank: int, what: str = "input") -> None:
    if t.rank != rank:
        raise OpError(f"{what} must have rank {rank}, got {fmt(t.shape)}")


def wrap_dim(t: TensorSpec, d: int) -> int:
    if not -t.rank <= d < t.rank:
        raise OpError(f"dimension {d} is out of range for {fmt(t.shape)}")
    return d % t.rank


def check_eq(a: sympy.Expr, b: sympy.Expr, what: str | Callable[[], str]
             ) -> tuple[tuple[sympy.Expr, sympy.Expr], ...]:
    """() when ``a`` = ``b``, the pair as an assumption when undecided; ``what`` (text, or a function making it:
    printing shapes costs more than comparing them) names the check in the error when they differ."""
    verdict = same(a, b)
    if verdict is False:
        raise OpError(f"{what() if callable(what) else what}: {a} != {b}")
    return () if verdict else ((a, b),)
