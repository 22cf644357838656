"""Memory layouts: the strides of a tensor, and the storage decisions PyTorch takes from them.

A :class:`~symmem.tensor.TensorSpec` carries ``strides`` (in elements, one per dimension), or None for a
contiguous row-major tensor.  The shape rules of :mod:`symmem.ops` set them with the functions here: views
rearrange them (transpose, permute, select, slice, expand, a reshape PyTorch can view), elementwise ops follow
their inputs' memory order as ``TensorIterator`` does, ``clone``/``to`` keep it as ``empty_like`` does, and every
other op makes a contiguous tensor.  From them the rules decide what PyTorch decides at run time:

* whether ``reshape``/``flatten`` is a view or a copy (``computeStride``, ``aten/src/ATen/TensorUtils.cpp``);
* whether ``contiguous()`` returns its input (``is_contiguous``);
* whether ``matmul`` folds a batched operand into ``bmm`` without a copy (``reshape`` to 3 dimensions);
* the memory order of CPU flash attention's output (``empty_like(query)``), and so whether the usual head merge
  after it is a view.

**Symbolic sizes.**  PyTorch's checks skip dimensions of size 1, so with symbols a decision can depend on which
sizes are 1.  A symbolic size is taken to be at least 2 -- generic, as :func:`symmem.shapes.same` takes distinct
symbols to differ -- except the sizes :data:`symmem.symbols.UNIT_SIZES` names (G = 1, multi-query attention; h/G
= 1, multi-head).  Where their symbols appear, a layout is worked out once per :class:`Case` (each such size 1
or not); a decision that differs between cases is a condition over ``Eq(G, 1)`` and ``Eq(h/G, 1)``, which the
derivation resolves per branch (:mod:`symmem.conditions`), and strides that differ are ``Piecewise`` over the same
conditions.  Comparisons the sizes leave open (``S`` against ``h``) count as unequal, and an order between them
as undecided.

>>> from symmem.symbols import B, S, h, H
>>> d = H / h
>>> split = (B * S * h * d, d, h * d, 1)              # (B, S, h, d) memory seen as (B, h, S, d)
>>> reshaped((B, h, S, d), split, (B * h, S, d))      # what matmul does to fold heads into bmm's batch
(None, True)
>>> reshaped((B, S, h, d), None, (B, S, H))
(None, False)
>>> from symmem.symbols import G
>>> repeat = (B * S * G * d, d, 0, G * d, 1)          # repeat_kv: (B, S, G, d) memory, expanded h/G times
>>> strides, copy = reshaped((B, G, h / G, S, d), repeat, (B, h, S, d))
>>> copy
Ne(G, 1) & Ne(h/G, 1)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, TypeVar

import sympy
from sympy.logic import SOPform

from .shapes import broadcast, monomial, same
from .symbols import UNIT_SIZES, UnitSize

Strides = tuple[sympy.Expr, ...]
Shape = tuple[sympy.Expr, ...]
#: a storage decision: True, False, or a condition on the unit sizes (``Ne(G, 1) & Ne(h/G, 1)``)
Flag = Any
T = TypeVar("T")
_ONE = sympy.Integer(1)
_ZERO = sympy.Integer(0)


def contiguous(shape: Sequence[sympy.Expr]) -> Strides:
    """The strides of a contiguous row-major tensor of ``shape``.

    >>> from symmem.symbols import B, S, H
    >>> contiguous((B, S, H))
    (H*S, H, 1)
    """
    return _contiguous(tuple(shape))


@functools.lru_cache(maxsize=4096)
def _contiguous(shape: tuple[sympy.Expr, ...]) -> Strides:
    out = []
    acc: sympy.Expr = _ONE
    for d in reversed(tuple(shape)):
        out.append(acc)
        acc = acc * d
    return tuple(reversed(out))


def of(shape: Sequence[sympy.Expr], strides: Sequence[Any] | None) -> Strides:
    """``strides``, or the contiguous strides of ``shape`` where they are None."""
    return contiguous(shape) if strides is None else _exprs(strides)


def _exprs(values: Sequence[Any]) -> tuple[sympy.Expr, ...]:
    return tuple(sympy.sympify(v, strict=True) for v in values)


# -- comparisons of sizes in one case: numbers decide; a symbolic size is at least 2 -------------------------
def _one(x: sympy.Expr) -> bool:
    return x == 1


def _eq(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or same(a, b) is True


def _powers(e: sympy.Expr) -> tuple[sympy.Expr, tuple[tuple[sympy.Basic, sympy.Expr], ...]]:
    """``e`` as a number times a product of powers: (the number, the powers as sorted (base, exponent) pairs)."""
    coeff, rest = e.as_coeff_Mul()
    found: dict[sympy.Basic, sympy.Expr] = {}
    for f in sympy.Mul.make_args(rest):
        base, exp = f.as_base_exp()
        if base.is_number:
            coeff = coeff * f
        else:
            found[base] = found.get(base, 0) + exp
    return coeff, _vector(found)


def _vector(found: dict[sympy.Basic, sympy.Expr]) -> tuple[tuple[sympy.Basic, sympy.Expr], ...]:
    return tuple(sorted(((b, x) for b, x in found.items() if x != 0), key=lambda kv: sympy.default_sort_key(kv[0])))


def _fraction(x: sympy.Rational) -> Fraction:
    return Fraction(int(x.p), int(x.q))


def _exponent(x: sympy.Rational) -> int | Fraction:
    # an int where whole (the usual exponent: Python's int arithmetic is several times a Fraction's)
    return int(x.p) if x.q == 1 else _fraction(x)


@functools.lru_cache(maxsize=8192)
def _exponents(e: sympy.Expr) -> tuple[Fraction, dict[sympy.Basic, int | Fraction]] | None:
    """A monomial ``e`` (:func:`symmem.shapes.monomial`) as (its coefficient, its exponent per symbol), in Python
    fractions: comparing sizes then builds no sympy expression.  None for any other ``e``."""
    m = monomial(e)
    if m is None:
        return None
    return _fraction(m[0]), {b: _exponent(x) for b, x in m[1]}


def _base_powers(e: sympy.Expr) -> dict[sympy.Basic, Any]:
    """The powers of ``e`` (a size) by base, as :func:`_powers` finds them; Python fractions for a monomial."""
    found = _exponents(e)
    return dict(found[1]) if found is not None else dict(_powers(e)[1])


@functools.lru_cache(maxsize=256)
def _vocabulary(sizes: frozenset[sympy.Expr]
                ) -> tuple[dict[sympy.Basic, int], int, frozenset[tuple[int, ...]]]:
    """The sizes as integer exponent vectors: (an index of the bases they are powers of, the common denominator
    of the exponents, every sum of at most two of the vectors, the zero vector among them).  A set of sizes: the
    order and repeats of a shape do not change the answer, and the ops of a model share their sizes."""
    powers = [_base_powers(d) for d in sizes if not d.is_number]
    index = {b: i for i, b in enumerate(sorted({b for p in powers for b in p}, key=sympy.default_sort_key))}
    den = math.lcm(1, *(x.denominator if isinstance(x, Fraction | int) else int(sympy.Rational(x).q)
                        for p in powers for x in p.values()))
    vectors = sorted({v for v in (tuple(int(p.get(b, 0) * den) for b in index) for p in powers) if any(v)})
    zero = tuple(0 for _ in index)
    # a sum of at most four vectors is a sum of two sums of at most two: the sums of two, once per vocabulary,
    # answer each question with one pass over them (a search of sums of four took most of a model's first build)
    pairs = {zero, *vectors}
    for i, v in enumerate(vectors):
        for w in vectors[i:]:
            pairs.add(tuple(x + y for x, y in zip(v, w, strict=True)))
    return index, den, frozenset(pairs)


def _is_product(vector: dict[sympy.Basic, Any], sizes: tuple[sympy.Expr, ...], sign: int = 1) -> bool:
    """Whether the powers ``vector`` (base -> exponent; times ``sign``) are a product of up to four of
    ``sizes``: at least 2."""
    index, den, pairs = _vocabulary(frozenset(sizes))
    if any(b not in index for b in vector):
        return False
    target = []
    for b in index:
        x = vector.get(b, 0)
        if isinstance(x, Fraction | int):
            t = sign * x * den
            if t.denominator != 1:
                return False
            target.append(int(t))
        else:
            t = sympy.sympify(sign * x * den, strict=True)
            if not t.is_integer:
                return False
            target.append(int(t))
    return any(tuple(t - x for t, x in zip(target, p, strict=True)) in pairs for p in pairs)


@functools.lru_cache(maxsize=4096)
def _cmp(a: sympy.Expr, b: sympy.Expr, sizes: tuple[sympy.Expr, ...]) -> int | None:
    """-1, 0 or 1 as ``a`` is less than, equal to or more than ``b`` (non-negative products of sizes), when every
    symbolic size among ``sizes`` is at least 2 and no two are equal by accident; None when that leaves it open
    (``S`` against ``h``).

    ``a/b`` is more than 1 when it is a product of the sizes: d*h against d is h against 1.
    """
    if _eq(a, b):
        return 0
    if a == 0 or b == 0:
        return -1 if a == 0 else 1
    ea, eb = _exponents(a), _exponents(b)
    coeff: Any
    vector: dict[sympy.Basic, Any]
    if ea is not None and eb is not None:
        # two monomials: their quotient's coefficient and powers, without building a/b in sympy
        coeff, vector = ea[0] / eb[0], dict(ea[1])
        for base, x in eb[1].items():
            vector[base] = vector.get(base, 0) - x
        vector = {base: x for base, x in vector.items() if x != 0}
    else:
        coeff, pairs = _powers(a / b)  # products of sizes divide by themselves; a sum needs cancel
        if any(base.is_Add for base, _ in pairs):
            coeff, pairs = _powers(sympy.cancel(a / b))
        vector = dict(pairs)
    if not vector:
        return 1 if coeff > 1 else -1
    if _is_product(vector, sizes):
        return 1
    if _is_product(vector, sizes, -1):
        return -1
    return None


# -- cases: each unit size 1 or not ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One case of the unit sizes whose symbols a layout involves: which of them are 1 (``truth``), the
    substitution that says so, and whether it leaves every other symbolic size free (G = 1 with h/G = 1 would
    make h = 1: not a case).  The generic case has every unit size at least 2: no substitution."""

    truth: tuple[tuple[sympy.Basic, bool], ...] = ()
    subs: tuple[tuple[sympy.Symbol, sympy.Expr], ...] = ()
    feasible: bool = True

    @property
    def condition(self) -> sympy.Basic:
        return sympy.And(*(atom if value else sympy.Not(atom) for atom, value in self.truth))

    @functools.cached_property
    def _literals(self) -> dict[sympy.Basic, sympy.Basic]:
        found: dict[sympy.Basic, sympy.Basic] = {}
        for atom, value in self.truth:
            found[atom] = sympy.true if value else sympy.false
            found[sympy.Not(atom)] = sympy.false if value else sympy.true
        return found

    def at(self, e: sympy.Expr) -> sympy.Expr:
        """``e`` in this case: ``Piecewise`` strides resolved, the unit sizes that are 1 substituted."""
        if not self.truth:
            return e
        if e.has(sympy.Piecewise):
            e = e.xreplace(self._literals)
        return e.xreplace(dict(self.subs))

    def all(self, exprs: Sequence[sympy.Expr]) -> tuple[sympy.Expr, ...]:
        return tuple(self.at(e) for e in exprs)


GENERIC = Case()


def _relevant(exprs: Sequence[sympy.Expr]) -> tuple[UnitSize, ...]:
    symbols: set[sympy.Basic] = set()
    for e in exprs:
        symbols |= e.free_symbols
    # a unit size matters only where all its symbols appear (h/G needs G: a ViT with h has no G to be h)
    return tuple(u for u in UNIT_SIZES if u.size.free_symbols <= symbols)


@functools.lru_cache(maxsize=64)
def cases(units: tuple[UnitSize, ...]) -> tuple[Case, ...]:
    """Every case of ``units`` (each 1 or not), the generic case first."""
    if not units:
        return (GENERIC,)
    ones = {u.size for u in units if isinstance(u.size, sympy.Symbol)}
    found = []
    for values in itertools.product((False, True), repeat=len(units)):
        subs: dict[sympy.Symbol, sympy.Expr] = {}
        for u, value in zip(units, values, strict=True):
            if value:
                step = {s: e.xreplace(subs) for s, e in u.one}
                subs = {s: e.xreplace(step) for s, e in subs.items()} | step
        # a case that makes a size 1 that is not a unit size (h, when G = 1 and h/G = 1) is not one
        feasible = all(s in ones or not e.is_number for s, e in subs.items())
        found.append(Case(tuple((u.atom, v) for u, v in zip(units, values, strict=True)), tuple(subs.items()),
                          feasible))
    return tuple(found)


def _each(exprs: Sequence[sympy.Expr], fn: Callable[[Case], T]) -> tuple[tuple[Case, ...], list[T | None]]:
    cs = cases(_relevant(exprs))
    return cs, [fn(c) if c.feasible else None for c in cs]


def _flag(cs: Sequence[Case], values: Sequence[bool | None]) -> Flag:
    """One flag from one value per case: a bool where the cases agree, else a condition over the unit sizes."""
    feasible = [bool(v) for c, v in zip(cs, values, strict=True) if c.feasible]
    if all(feasible):
        return True
    if not any(feasible):
        return False
    atoms = [atom for atom, _ in cs[0].truth]
    dummies = [sympy.Dummy() for _ in atoms]
    terms = [[int(v) for _, v in c.truth] for c, value in zip(cs, values, strict=True) if c.feasible and value]
    free = [[int(v) for _, v in c.truth] for c in cs if not c.feasible]
    return SOPform(dummies, terms, free).xreplace(dict(zip(dummies, atoms, strict=True)))


def _strides(cs: Sequence[Case], values: Sequence[Strides | None]) -> Strides:
    """One stride tuple from one per case: the generic case's, with ``Piecewise`` entries where a case differs."""
    generic = values[0]
    assert generic is not None
    out = []
    for i, g in enumerate(generic):
        pieces = [(v[i], c.condition) for c, v in zip(cs[1:], values[1:], strict=True)
                  if v is not None and not _eq(v[i], c.at(g))]
        out.append(sympy.Piecewise(*pieces, (g, True), evaluate=False) if pieces else g)
    return tuple(out)


def _flat(*parts: Sequence[Any]) -> tuple[sympy.Expr, ...]:
    return tuple(sympy.sympify(e, strict=True) for part in parts for e in part)


# -- PyTorch's checks, in one case -----------------------------------------------------------------------------
def is_contiguous(shape: Shape, strides: Strides) -> bool:
    """``Tensor.is_contiguous()``: each dimension of size > 1 has the stride of the dimensions after it."""
    expected: sympy.Expr = _ONE
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if _one(size):
            continue
        if not _eq(stride, expected):
            return False
        expected = expected * size
    return True


def _channels_last(shape: Shape, strides: Strides) -> bool:
    # is_contiguous(memory_format=torch.channels_last): 4-d, channels fastest, then width, height, batch
    if len(shape) != 4:
        return False
    expected: sympy.Expr = _ONE
    for d in (1, 3, 2, 0):
        if _one(shape[d]):
            continue
        if not _eq(strides[d], expected):
            return False
        expected = expected * shape[d]
    return True


def _dense(shape: Shape, strides: Strides) -> bool:
    """``is_non_overlapping_and_dense``: some order of the dimensions is contiguous."""
    if len(shape) == 0:
        return True
    if len(shape) == 1:
        return _one(shape[0]) or _eq(strides[0], _ONE)
    order = sorted(range(len(shape)), key=functools.cmp_to_key(
        lambda a, b: (0 if _one(shape[a]) and _one(shape[b]) else 1 if _one(shape[a]) else -1 if _one(shape[b])
                      else _cmp(strides[a], strides[b], tuple(shape)) or 0)))
    need: sympy.Expr = _ONE
    for d in order:
        if _one(shape[d]):
            return True
        if not _eq(strides[d], need):
            return False
        need = need * shape[d]
    return True


def compute_stride(old: Shape, strides: Strides, new: Shape) -> Strides | None:
    """PyTorch's ``computeStride``: the strides of ``new`` as a view of a tensor of shape ``old`` and
    ``strides``, or None when no view exists (``reshape`` copies).

    The old dimensions fall into chunks that are contiguous among themselves (size-1 dimensions join any chunk);
    a view must split the sizes at every chunk's boundary.
    """
    if not old:
        return tuple(_ONE for _ in new)
    sizes = tuple(old) + tuple(new)
    out: list[sympy.Expr] = [_ZERO] * len(new)
    view_d = len(new) - 1
    base = strides[-1]
    tensor_numel: sympy.Expr = _ONE
    view_numel: sympy.Expr = _ONE
    for tensor_d in range(len(old) - 1, -1, -1):
        tensor_numel = tensor_numel * old[tensor_d]
        if tensor_d == 0 or (not _one(old[tensor_d - 1])
                             and not _eq(strides[tensor_d - 1], tensor_numel * base)):
            while view_d >= 0 and (_cmp(view_numel, tensor_numel, sizes) == -1 or _one(new[view_d])):
                out[view_d] = view_numel * base
                view_numel = view_numel * new[view_d]
                view_d -= 1
            if not _eq(view_numel, tensor_numel):
                return None
            if tensor_d > 0:
                base = strides[tensor_d - 1]
                tensor_numel = _ONE
                view_numel = _ONE
    if view_d != -1:
        return None
    return tuple(out)


def _expand(shape: Shape, strides: Strides, new: Shape) -> Strides:
    # inferExpandGeometry: an expanded size-1 dimension gets stride 0; a new leading one too, unless it has size 1
    out: list[sympy.Expr] = [_ZERO] * len(new)
    lead = len(new) - len(shape)
    for i in range(len(new) - 1, -1, -1):
        d = i - lead
        size = shape[d] if d >= 0 else _ONE
        stride = strides[d] if d >= 0 else (new[i + 1] * out[i + 1] if i + 1 < len(new) else _ONE)
        if not _eq(size, new[i]):
            stride = _ZERO
        out[i] = stride
    return tuple(out)


def _swap(out_shape: Shape, operands: Sequence[Strides], d0: int, d1: int, sizes: tuple[sympy.Expr, ...]) -> int:
    # TensorIterator's should_swap: the first operand with different nonzero strides decides; equal strides put
    # the smaller size first
    for st in operands:
        s0, s1 = st[d0], st[d1]
        if s0 == 0 or s1 == 0:
            continue
        c = _cmp(s0, s1, sizes)
        if c is None:
            continue
        if c:
            return c
        if _cmp(out_shape[d0], out_shape[d1], sizes) == 1:
            return 1
    return 0


def _permutation(out_shape: Shape, operands: Sequence[Strides], sizes: tuple[sympy.Expr, ...]) -> list[int]:
    """TensorIterator's ``reorder_dimensions``: the dimensions from fastest to slowest."""
    n = len(out_shape)
    perm = list(range(n - 1, -1, -1))
    for i in range(1, n):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            c = _swap(out_shape, operands, perm[dim0], perm[dim1], sizes)
            if c > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif c < 0:
                break
    return perm


def _dense_in(shape: Shape, perm: Sequence[int]) -> Strides:
    out: list[sympy.Expr] = [_ZERO] * len(shape)
    acc: sympy.Expr = _ONE
    for d in perm:
        out[d] = acc
        acc = acc * shape[d]
    return tuple(out)


def _broadcast_strides(out_shape: Shape, shape: Shape, strides: Strides) -> Strides:
    lead = len(out_shape) - len(shape)
    return tuple(_ZERO if i < lead or (_one(shape[i - lead]) and not _one(out_shape[i]))
                 else strides[i - lead] for i in range(len(out_shape)))


def _iterator(out_shape: Shape, operands: Sequence[tuple[Shape, Strides]], scalar: bool) -> Strides:
    """The strides TensorIterator gives a new output (``fast_set_up``, else ``reorder_dimensions``)."""
    if not scalar and all(len(s) == len(out_shape) and all(_eq(a, b) for a, b in zip(s, out_shape, strict=True))
                          for s, _ in operands):
        if all(is_contiguous(s, st) for s, st in operands):
            return contiguous(out_shape)
        if all(_channels_last(s, st) for s, st in operands):
            return _dense_in(out_shape, (1, 3, 2, 0))
        last = operands[-1][1]
        if all(_dense(s, st) for s, st in operands) and all(
                all(_eq(a, b) for a, b in zip(st, last, strict=True)) for _, st in operands):
            return last
    broadcast_strides = [_broadcast_strides(out_shape, s, st) for s, st in operands]
    sizes = tuple(out_shape) + tuple(d for s, _ in operands for d in s)
    return _dense_in(out_shape, _permutation(out_shape, broadcast_strides, sizes))


def _like(shape: Shape, strides: Strides) -> Strides:
    # empty_like(memory_format=preserve): the same strides when dense, else dense in the same memory order
    if _dense(shape, strides):
        return strides
    return _dense_in(shape, _permutation(shape, [strides], tuple(shape)))


# -- what the shape rules call: any case, any strides ----------------------------------------------------------
def _key(value: Any) -> Any:
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, tuple | list):
        return tuple(_key(v) for v in value)
    return sympy.sympify(value, strict=True)


_MISS = object()


def _memo(fast: Callable[..., Any]) -> Callable[[Callable[..., T]], Callable[..., T]]:
    """Remember the answers of a function (a graph is built and then linted, so every rule runs twice, and models
    are built again for every derivation); ``fast`` answers the common contiguous case first, or gives _MISS."""

    def wrap(fn: Callable[..., T]) -> Callable[..., T]:
        cached = functools.lru_cache(maxsize=4096)(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> T:
            found = fast(*args, **kwargs)
            if found is not _MISS:
                return found
            return cached(*(_key(a) for a in args), **{k: _key(v) for k, v in kwargs.items()})

        return call

    return wrap


def _no(*args: Any, **kwargs: Any) -> Any:
    return _MISS


def _result(shape: Shape, cs: Sequence[Case], values: Sequence[Strides | None]) -> Strides | None:
    found = _strides(cs, values)
    return None if found == contiguous(shape) else found


def permuted(shape: Shape, strides: Strides | None, dims: Sequence[int]) -> Strides | None:
    """The strides of ``x.permute(dims)`` (transpose is a permutation of two)."""
    shape, st = _exprs(shape), of(shape, strides)
    found = tuple(st[d] for d in dims)
    return None if found == contiguous(tuple(shape[d] for d in dims)) else found


def selected(shape: Shape, strides: Strides | None, dim: int) -> Strides | None:
    """``x.select(dim, i)`` (and ``unbind``): the dimension goes, the other strides stay."""
    shape, st = _exprs(shape), of(shape, strides)
    new = shape[:dim] + shape[dim + 1:]
    found = st[:dim] + st[dim + 1:]
    return None if found == contiguous(new) else found


def sliced(shape: Shape, strides: Strides | None, new_shape: Shape) -> Strides | None:
    """``x[..., a:b, ...]``: the strides stay (the sizes change)."""
    st = of(shape, strides)
    return None if st == contiguous(_exprs(new_shape)) else st


@_memo(_no)
def expanded(shape: Shape, strides: Strides | None, new_shape: Shape) -> Strides | None:
    """``x.expand(new_shape)``: repeated dimensions have stride 0."""
    shape, new_shape = _exprs(shape), _exprs(new_shape)
    cs, values = _each(_flat(shape, of(shape, strides), new_shape),
                       lambda c: _expand(c.all(shape), c.all(of(shape, strides)), c.all(new_shape)))
    return _result(new_shape, cs, values)


@_memo(lambda shape, strides, new_shape: (None, False) if strides is None else _MISS)
def reshaped(shape: Shape, strides: Strides | None, new_shape: Shape) -> tuple[Strides | None, Flag]:
    """``x.reshape(new_shape)`` (and ``flatten``): its strides, and whether it copies (a flag).

    A contiguous tensor always views.  Otherwise the view exists where :func:`compute_stride` finds one, and the
    copy is contiguous.
    """
    if strides is None:
        return None, False
    shape, strides, new_shape = _exprs(shape), _exprs(strides), _exprs(new_shape)

    def one(c: Case) -> tuple[Strides, bool]:
        new = c.all(new_shape)
        found = compute_stride(c.all(shape), c.all(strides), new)
        return (contiguous(new), True) if found is None else (found, False)

    cs, values = _each(_flat(shape, strides, new_shape), one)
    return (_result(new_shape, cs, [None if v is None else v[0] for v in values]),
            _flag(cs, [None if v is None else v[1] for v in values]))


@_memo(lambda shape, strides: (None, False) if strides is None else _MISS)
def made_contiguous(shape: Shape, strides: Strides | None) -> tuple[Strides | None, Flag]:
    """``x.contiguous()``: its strides, and whether it copies (it returns ``x`` itself when contiguous)."""
    if strides is None:
        return None, False
    shape, strides = _exprs(shape), _exprs(strides)

    def one(c: Case) -> tuple[Strides, bool]:
        s, st = c.all(shape), c.all(strides)
        return (st, False) if is_contiguous(s, st) else (contiguous(s), True)

    cs, values = _each(_flat(shape, strides), one)
    return (_result(shape, cs, [None if v is None else v[0] for v in values]),
            _flag(cs, [None if v is None else v[1] for v in values]))


@_memo(lambda out_shape, operands, scalar=False: None if all(
    st is None and tuple(s) == tuple(out_shape) for s, st in operands) else _MISS)
def elementwise(out_shape: Shape, operands: Sequence[tuple[Shape, Strides | None]],
                scalar: bool = False) -> Strides | None:
    """The strides of a new output of an elementwise op (``TensorIterator``), operands in PyTorch's order;
    ``scalar``: a Python number is one of them (``x * 0.5``: no fast set-up)."""
    out_shape = _exprs(out_shape)
    full = [(_exprs(s), of(s, st)) for s, st in operands]
    cs, values = _each(_flat(out_shape, *(s for s, _ in full), *(st for _, st in full)),
                       lambda c: _iterator(c.all(out_shape), [(c.all(s), c.all(st)) for s, st in full], scalar))
    return _result(out_shape, cs, values)


@_memo(lambda shape, strides: None if strides is None else _MISS)
def like(shape: Shape, strides: Strides | None) -> Strides | None:
    """``empty_like(x)``, what ``clone()`` and ``x.to(dtype)`` make: dense in ``x``'s memory order."""
    if strides is None:
        return None
    shape, strides = _exprs(shape), _exprs(strides)
    cs, values = _each(_flat(shape, strides), lambda c: _like(c.all(shape), c.all(strides)))
    return _result(shape, cs, values)


@_memo(lambda a, b: (False, False) if a[1] is None and b[1] is None and tuple(a[0][:-2]) == tuple(b[0][:-2])
       else _MISS)
def matmul_copies(a: tuple[Shape, Strides | None], b: tuple[Shape, Strides | None]) -> tuple[Flag, Flag]:
    """Whether ``torch.matmul`` copies each operand to fold its batch into ``bmm``.

    Both operands batched (rank >= 3): each is expanded to the broadcast batch and reshaped to
    (batch, rows, columns) -- a copy where that reshape cannot view.  Other ranks fold or call ``mm`` on views:
    no copy.
    """
    (sa, ta), (sb, tb) = (_exprs(a[0]), a[1]), (_exprs(b[0]), b[1])
    if len(sa) < 3 or len(sb) < 3:
        return False, False
    batch = broadcast(sa[:-2], sb[:-2])
    if batch is None:
        return False, False
    flags = []
    for shape, strides in ((sa, ta), (sb, tb)):
        full = batch + shape[-2:]
        st = expanded(shape, strides, full)
        flags.append(reshaped(full, st, (sympy.Mul(*batch),) + shape[-2:])[1])
    return flags[0], flags[1]


@_memo(_no)
def attention_keeps_value(probs_shape: Shape, shape: Shape, strides: Strides | None) -> Flag:
    """Whether the CPU math kernel of ``scaled_dot_product_attention`` keeps the value itself: it has the query's
    heads (grouped heads are repeated to them first, ``repeat_interleave``: a copy) and ``probs @ v`` folds it
    into ``bmm`` without a copy."""
    probs_shape, shape = _exprs(probs_shape), _exprs(shape)
    st = of(shape, strides)

    def one(c: Case) -> bool:
        ps, vs, vt = c.all(probs_shape), c.all(shape), c.all(st)
        if len(vs) >= 3 and len(ps) >= 3 and not _eq(vs[-3], ps[-3]):
            return False
        batch = broadcast(ps[:-2], vs[:-2])
        if batch is None:
            return False
        full = batch + vs[-2:]
        return compute_stride(full, _expand(vs, vt, full), (sympy.Mul(*batch),) + vs[-2:]) is not None

    cs, values = _each(_flat(probs_shape, shape, st), one)
    return _flag(cs, values)


@_memo(lambda shape, strides: False if strides is None or len(shape) != 4 else _MISS)
def heads_outer(shape: Shape, strides: Strides | None) -> Flag:
    """Whether ``empty_like(q)`` of a (B, h, S, d) query is (B, S, h, d) in memory -- what CPU flash attention
    returns, so that ``out.transpose(1, 2)`` is contiguous (the head merge after it is a view)."""
    if len(shape) != 4 or strides is None:
        return False
    shape, strides = _exprs(shape), _exprs(strides)

    def one(c: Case) -> bool:
        s = c.all(shape)
        st = _like(s, c.all(strides))
        return is_contiguous((s[0], s[2], s[1], s[3]), (st[0], st[2], st[1], st[3]))

    cs, values = _each(_flat(shape, strides), one)
    return _flag(cs, values)
