"""Comparing and broadcasting symbolic shapes.

Two dimensions are equal when sympy proves their difference is zero.  The symbols are independent, so a
difference that is a nonzero rational function of them (``S - H``, ``H/h - 64``) is a mismatch too.  Only a
difference with functions such as ``floor`` in it (``floor(Hi/16)`` against ``S - 1``) is *undecided*:
the graph records it as an assumption, checked with numbers when numbers come.

>>> import sympy
>>> from symmem.symbols import B, S, Hi
>>> same(B * S, S * B), same(S, S + 1), same(S - 1, B), same(S - 1, sympy.floor(Hi / 16))
(True, False, False, None)
"""

from __future__ import annotations

import functools

import sympy


def same(a: sympy.Expr, b: sympy.Expr) -> bool | None:
    """True, False, or None when sympy cannot decide."""
    if a == b:
        return True
    ma, mb = monomial(a), monomial(b)
    if ma is not None and mb is not None and ma != mb:
        # two different monomials differ as functions of the sizes: their difference has no function in it, so
        # _same would answer False too, after building and expanding it (~0.3 ms each, most of a model's
        # first build)
        return False
    return _same(a, b)


#: a monomial: its rational coefficient and its (symbol, rational exponent) factors, in sympy's order
Monomial = tuple[sympy.Rational, tuple[tuple[sympy.Symbol, sympy.Rational], ...]]


@functools.lru_cache(maxsize=8192)
def monomial(e: object) -> Monomial | None:
    """``e`` as a rational number times powers of distinct symbols with rational exponents (``H*S/(2*h)``,
    ``H**(1/2)``, ``3``), or None when it is anything else (a sum, a ``floor``, a power of a number, a Python
    number, a product sympy left unevaluated with a symbol twice).  Sizes and strides are mostly monomials; two
    different ones are never equal.

    >>> from symmem.symbols import H, S, h
    >>> monomial(H * S / (2 * h)), monomial(H + S)
    ((1/2, ((H, 1), (S, 1), (h, -1))), None)
    """
    if not isinstance(e, sympy.Basic):
        return None
    if e.is_Rational:
        return e, ()  # type: ignore[return-value]
    factors = e.args if e.is_Mul else (e,)
    coeff: sympy.Rational = sympy.Integer(1)
    powers: list[tuple[sympy.Symbol, sympy.Rational]] = []
    for i, f in enumerate(factors):
        if i == 0 and f.is_Rational and e.is_Mul:
            coeff = f  # type: ignore[assignment]
            continue
        base, exp = (f.base, f.exp) if f.is_Pow else (f, sympy.Integer(1))
        if not (base.is_Symbol and base.is_commutative and exp.is_Rational and exp != 0):
            return None
        powers.append((base, exp))  # type: ignore[arg-type]
    if coeff == 0 or len({b for b, _ in powers}) != len(powers):
        return None
    return coeff, tuple(powers)


@functools.lru_cache(maxsize=4096)
def _same(a: sympy.Expr, b: sympy.Expr) -> bool | None:
    # remembered: a graph compares the same sizes again and again (every layer, and lint once more)
    d = sympy.expand(a - b)
    if d == 0:
        return True
    if d.is_number or not d.atoms(sympy.Function):
        return False
    if _both_signs(d):
        return None  # sympy cannot prove a sign it does not have: its answer would be None (and costs 5 ms)
    if d.is_positive or d.is_negative:
        return False
    return None


def _both_signs(d: sympy.Expr) -> bool:
    """Whether ``d`` is positive at some positive integers and negative at others (found by trying a few: each
    symbol large with the others small, and small with the others large).  False when not found."""
    from .evaluator import NotCompilable, interpret

    symbols = sorted(d.free_symbols, key=lambda s: s.name)
    if not all(s.is_integer and s.is_positive for s in symbols):
        return False
    probes = [dict.fromkeys(symbols, 1), dict.fromkeys(symbols, 1000)]
    for s in symbols:
        probes += [{**dict.fromkeys(symbols, 1), s: 10**6}, {**dict.fromkeys(symbols, 1000), s: 1}]
    positive = negative = False
    for values in probes:
        try:
            v = interpret(d, values)
        except (NotCompilable, ZeroDivisionError, TypeError):
            return False
        positive, negative = positive or v > 0, negative or v < 0
        if positive and negative:
            return True
    return False


def broadcast(a: tuple[sympy.Expr, ...], b: tuple[sympy.Expr, ...]) -> tuple[sympy.Expr, ...] | None:
    """The broadcast of two shapes, or None when they cannot broadcast.

    >>> from symmem.symbols import B, S, H
    >>> broadcast((B, S, H), (1, S, H))
    (B, S, H)
    """
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        x = a[-i] if i <= len(a) else sympy.Integer(1)
        y = b[-i] if i <= len(b) else sympy.Integer(1)
        if x == 1:
            out.append(y)
        elif y == 1 or same(x, y) is not False:
            out.append(x)
        else:
            return None
    return tuple(reversed(out))


def numel(shape: tuple[sympy.Expr, ...]) -> sympy.Expr:
    return sympy.Mul(*shape) if shape else sympy.Integer(1)


def fmt(shape: tuple[sympy.Expr, ...]) -> str:
    """A shape as people write it: ``(B, S, 3*H)``."""
    return "(" + ", ".join(str(d) for d in shape) + ")"
