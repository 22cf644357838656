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
    return _same(a, b)


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
