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

import functools
from collections.abc import Iterable

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


def _quotient(x: sympy.Expr) -> tuple[sympy.Expr, int] | None:
    """``x`` as ``q / n`` with ``q`` integer-valued and ``n`` a positive integer, or None."""
    num, den = sympy.fraction(sympy.together(x))
    if not den.is_Integer:
        return None
    if den < 0:
        num, den = -num, -den
    if num.is_integer is not True:
        return None
    return num, int(den)


# memoized: a view rounds the same floors again and again (every row of a table, every width and view of the same
# derivation: ResNet's image sizes), and sympy's together() is most of a table's time otherwise
@functools.lru_cache(maxsize=4096)
def _rounding(kind: type, arg: sympy.Expr) -> sympy.Expr:
    """``kind(arg)`` (``floor`` or ``ceiling``) with nested roundings merged and the shift made canonical."""
    for _ in range(64):
        qn = _quotient(arg)
        if qn is None:
            return kind(arg)
        num, n = qn
        inner = [a for a in sympy.Add.make_args(num) if isinstance(a, sympy.floor | sympy.ceiling)]
        k = num - inner[0] if len(inner) == 1 else None
        if k is None or k.is_integer is not True:
            break
        y = inner[0].args[0]
        if not isinstance(inner[0], kind):
            # ceil(q/m) = floor((q + m - 1)/m) and floor(q/m) = ceil((q - m + 1)/m) for integer q
            ym = _quotient(y)
            if ym is None:
                break
            q, m = ym
            y = sympy.Rational(1, m) * (q + m - 1 if kind is sympy.floor else q - m + 1)
        # floor((floor(y) + k)/n) = floor((y + k)/n) for integer k and positive integer n; the same for ceiling
        arg = (y + k) / n
    qn = _quotient(arg)
    if qn is None:
        return kind(arg)
    num, n = qn
    if n == 1:
        return num
    r, q = num.as_coeff_Add()
    if not r.is_Integer or q.is_integer is not True:
        return kind(arg)
    # every rounding written as floor((q + a)/n): ceil(x/n) = floor((x + n - 1)/n)
    a = int(r) if kind is sympy.floor else int(r) + n - 1
    if a % n == 0:
        return sympy.floor(q / n) + a // n
    if a % n == n - 1:
        return sympy.ceiling(q / n) + (a - n + 1) // n
    shift = int(r) % n
    return kind((q + shift) / n) + (int(r) - shift) // n


def rounded(expr: sympy.Expr) -> sympy.Expr:
    """Nested floors and ceilings of integer quotients merged, and shifts folded into ceilings.

    ``floor((floor(x) + k)/n) = floor((x + k)/n)`` for an integer ``k`` and a positive integer ``n`` (the same for
    ceilings), and for an integer ``q``: ``floor((q + n - 1)/n) = ceil(q/n)``, ``floor(q/m)`` and ``ceil(q/m)``
    convert into each other.  Image sizes after strided layers read as ``ceil(Hi/4)`` instead of
    ``floor(floor(Hi/2 - 1/2)/2) + 1``.  Symbols must be integers (symmem's are) for the rules to apply; an
    expression they do not fit is returned unchanged.

    >>> from symmem.symbols import Hi
    >>> rounded(sympy.floor(sympy.floor(Hi / 2) / 2))
    floor(Hi/4)
    >>> rounded(sympy.floor(sympy.floor(Hi / 2 - sympy.Rational(1, 2)) / 2) + 1)
    ceiling(Hi/4)
    """
    if not expr.args or not expr.has(sympy.floor, sympy.ceiling):
        return expr
    args = [rounded(a) for a in expr.args]
    e = expr.func(*args) if args != list(expr.args) else expr
    if isinstance(e, sympy.floor | sympy.ceiling):
        return _rounding(type(e), e.args[0])
    return e


def factor_leading(expr: sympy.Expr, values: dict | None = None) -> sympy.Expr:
    """``m * (c + ...) + rest``: a leading monomial ``m`` pulled out of the terms it reads well with.

    A term goes inside the parentheses when it shares a symbol with ``m`` and leaves at most one symbol below
    the line (``4/L``, ``4 S h / H``); the others (constants, ``192 H^2 L`` next to ``36 B H L S``) stay outside,
    so they do not turn into ratios.  ``m`` is the monomial of the largest term that takes another term in
    (and, where every symbol has a number in ``values``, half the value or more); the largest at ``values``,
    else the term in the most symbols, then with the largest coefficient.  The result is an unevaluated sum,
    the factored part first; it equals ``expr`` (returned expanded where no monomial takes two terms).

    >>> from symmem.symbols import B, H, L, S, h
    >>> factor_leading(36*B*H*L*S + 4*B*H*S + 4*B*L*S**2*h + 192*H**2*L + 16000)
    B*H*L*S*(36 + 4/L + 4*S*h/H) + 192*H**2*L + 16000
    """
    e = sympy.expand(expr)
    terms = sympy.Add.make_args(e)
    if len(terms) < 2:
        return e

    def size(term: sympy.Expr) -> tuple:
        coeff = abs(term.as_coeff_Mul()[0])
        if values:
            v = term.xreplace(values)
            if v.is_number:
                return (1, abs(v), coeff)
        return (0, len(term.free_symbols), coeff)

    found = []
    for cand in sorted(terms, key=size, reverse=True):
        leading = cand.as_coeff_Mul()[1]
        if leading == 1:
            continue
        inside, outside = [], []
        for term in terms:
            r = sympy.expand(term / leading)
            den = sympy.denom(r)
            if term.free_symbols & leading.free_symbols and (den == 1 or den.is_Symbol):
                inside.append((term, r))
            else:
                outside.append(term)
        if len(inside) >= 2:
            found.append((leading, inside, outside))
    if not found:
        return e
    best = found[0]
    sizes = [size(t) for t in terms]
    if all(s[0] for s in sizes):  # the first that takes at least half the value in, if one does
        whole = sum(s[1] for s in sizes)
        best = next((f for f in found if 2 * sum(size(t)[1] for t, _ in f[1]) >= whole), found[0])
    leading, inside, outside = best
    inside_r = [r for _, r in inside]
    part = sympy.Mul(*sympy.Mul.make_args(leading), sympy.Add(*inside_r), evaluate=False)
    if not outside:
        return part
    return sympy.Add(part, *sympy.Add.make_args(sympy.Add(*outside)), evaluate=False)


def common_branches(expr: sympy.Expr) -> tuple[sympy.Expr, sympy.Expr]:
    """``(common, rest)`` with ``expr = common + rest``: the terms every branch of a ``Piecewise`` shares, and a
    ``Piecewise`` of what differs (``rest`` is 0 for an expression without branches, ``common`` 0 when nothing
    is shared).

    >>> from symmem.symbols import B, S, V
    >>> common_branches(sympy.Piecewise((4*B*V + 8*S, sympy.Eq(B, 1)), (4*B*V, True)))
    (4*B*V, Piecewise((8*S, Eq(B, 1)), (0, True)))
    """
    if not isinstance(expr, sympy.Piecewise):
        return expr, sympy.Integer(0)
    branches = [sympy.Add.make_args(sympy.expand(e)) for e, _ in expr.args]
    shared = [t for t in branches[0] if all(t in b for b in branches[1:])]
    if not shared:
        return sympy.Integer(0), expr
    common = sympy.Add(*shared)
    rest = sympy.Piecewise(*[(sympy.expand(e - common), c) for e, c in expr.args])
    return common, rest


def max_of(args: Iterable[sympy.Expr]) -> sympy.Expr:
    """``Max`` of ``args`` unevaluated, in the order given (duplicates dropped).

    sympy's own unevaluated ``Max`` still sorts its arguments canonically, which for long polynomials costs
    more than the rest of a peak; the peak's moments come largest-first at the default sizes, a deterministic
    order worth keeping.

    >>> from symmem.symbols import B
    >>> max_of([2*B + 1, B + 7, 2*B + 1]).args    # printing sorts them as sympy does
    (2*B + 1, B + 7)
    """
    unique = list(dict.fromkeys(sympy.sympify(a, strict=True) for a in args))
    if len(unique) == 1:
        return unique[0]
    obj = sympy.Expr.__new__(sympy.Max, *unique)
    obj._argset = frozenset(unique)
    return obj
