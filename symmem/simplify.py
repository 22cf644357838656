"""Readable forms of a memory formula: expanded, and factored around its leading term.

>>> from symmem.symbols import B, S, H, h
>>> e = 9*B*S*H + B*h*S**2
>>> expanded(e)
9*B*H*S + B*S**2*h
>>> factored(e)
B*H*S*(9 + S*h/H)
>>> common(e)
B*S*(9*H + S*h)
>>> factored(85307392*B + 212480)
85307392*B + 212480
"""

from __future__ import annotations

import sympy


def expanded(expr: sympy.Expr) -> sympy.Expr:
    """Every product multiplied out: ``9BSH + BhS^2``."""
    return sympy.expand(expr)


def common(expr: sympy.Expr) -> sympy.Expr:
    """The common factor of all terms pulled out: ``BS(9H + hS)``."""
    return sympy.factor_terms(sympy.expand(expr))


def factored(expr: sympy.Expr, leading: sympy.Expr | None = None) -> sympy.Expr:
    """``expr`` written as ``m * (c + ...)`` where ``m`` is the monomial of its leading term.

    The leading term is the one with the largest numeric coefficient (``9BSH`` in ``9BSH + BhS^2``,
    ``34sbh`` in Korthikanti's ``34sbh + 5as^2b``), unless ``leading`` names the monomial to pull out.
    """
    e = sympy.expand(expr)
    terms = sympy.Add.make_args(e)
    if len(terms) < 2 and leading is None:
        return e
    if leading is None:
        best = max(terms, key=lambda t: (abs(t.as_coeff_Mul()[0]), -len(t.free_symbols)))
        leading = best.as_coeff_Mul()[1]
    inner = sympy.expand(e / leading)
    # Pulling the leading monomial out reads well when each term shares a symbol with it and leaves at most one
    # symbol in a denominator (hS/H, 4/L).  A constant next to 85307392*B would leave 212480/B, and a small
    # term like 4*L next to B*H*L*S would leave 4/(B*H*S): then the expanded sum reads better.
    if leading == 1 or any(not (t.free_symbols & leading.free_symbols) for t in terms) or any(
            not (sympy.denom(r) == 1 or sympy.denom(r).is_Symbol) for r in sympy.Add.make_args(inner)):
        return e
    return sympy.Mul(*sympy.Mul.make_args(leading), inner, evaluate=False)
