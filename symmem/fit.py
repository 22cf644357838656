"""Will it fit: the largest batch size (or sequence length) whose training memory fits a budget.

The answer is solved from the derived total: every other symbol takes its value, the total becomes a
polynomial ``f(x)`` in the solved symbol, the largest real root of ``f(x) = budget`` is found exactly, and the
integer below it is checked at the boundary, ``f(max) <= budget < f(max + 1)``, in integer arithmetic.

>>> from symmem import derive
>>> r = largest(derive("resnet50-v1"), "B", "80GiB")
>>> r.max, r.total_at_max <= r.budget < r.total_above
(1927, True)
>>> smallest_budget(derive("resnet50-v1"), "B", 64) / 2**30 == derive("resnet50-v1").value("total") / 2**30
True
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy

from .errors import SymmemError
from .units import format_bytes, parse_size

if TYPE_CHECKING:
    from .derivation import Derivation


@dataclass(frozen=True)
class Fit:
    """The largest value ``max`` of ``symbol`` whose total fits ``budget`` (bytes), with the totals either
    side of the boundary and the polynomial it was solved from."""

    model: str
    convention: str
    symbol: str
    max: int
    budget: int
    total_at_max: int
    total_above: int
    formula: sympy.Expr

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of ``symmem fit --format json``."""
        return {"model": self.model, "convention": self.convention, "symbol": self.symbol, "max": self.max,
                "budget": self.budget, "total_at_max": self.total_at_max, "total_above": self.total_above,
                "headroom": self.budget - self.total_at_max, "formula": str(self.formula)}

    def __str__(self) -> str:
        return (f"{self.model} ({self.convention}): largest {self.symbol} = {self.max:,} fits "
                f"{format_bytes(self.budget)}: total {format_bytes(self.total_at_max)} "
                f"({self.total_at_max:,} B); {self.symbol} = {self.max + 1:,} needs "
                f"{format_bytes(self.total_above)} ({self.total_above:,} B)")


def _budget(budget: int | str) -> int:
    if isinstance(budget, str):
        return parse_size(budget)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise SymmemError(f"the budget must be a positive number of bytes or a size like 80GiB, got {budget!r}")
    return budget


def polynomial(d: Derivation, name: str) -> tuple[sympy.Symbol, sympy.Expr]:
    """The total as a function of the symbol ``name`` alone: every other symbol at its value."""
    sym = next((s for s in d.free if s.name == name), None)
    if sym is None:
        if any(s.name == name for s in d.numbers):
            raise SymmemError(f"{name} is not kept in {d.model}'s formula (it has {', '.join(s.name for s in d.free)});"
                              f" derive with free=(..., {name!r}) or --free {name}")
        raise SymmemError(f"{d.model} has no symbol {name!r}; it has {', '.join(sorted(s.name for s in d.numbers))}")
    others = {s: v for s, v in d.numbers.items() if s != sym}
    return sym, sympy.expand(d.total.xreplace(others))


def _total(f: sympy.Expr, sym: sympy.Symbol, x: int) -> int:
    v = f.xreplace({sym: sympy.Integer(x)})
    return int(v) if v.is_integer else int(sympy.ceiling(v))


def _poly(f: sympy.Expr, sym: sympy.Symbol) -> sympy.Poly | None:
    """``f`` as a polynomial in ``sym``, or None when it is not one (floor terms of an image size)."""
    try:
        poly = sympy.Poly(f, sym)
    except sympy.PolynomialError:
        return None
    return poly if all(c.is_rational for c in poly.all_coeffs()) else None


def _search(f: sympy.Expr, sym: sympy.Symbol, cap: int, model: str, name: str) -> int:
    """Largest x with f(x) <= cap for a non-polynomial total (floors of image sizes): doubling, then
    bisection on exact integer totals (f must not decrease; floors make it grow in steps)."""
    lo, hi = 1, 2
    while _total(f, sym, hi) <= cap:
        if hi > 2**48:  # a total that never passes the budget does not grow with the symbol
            raise SymmemError(f"the total of {model} does not grow with {name}: {f}")
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _total(f, sym, mid) <= cap else (lo, mid)
    return lo


def largest(d: Derivation, name: str, budget: int | str) -> Fit:
    """The largest positive integer value of ``name`` (``B``, ``S``, ...) whose total fits ``budget``."""
    cap = _budget(budget)
    sym, f = polynomial(d, name)
    if sym not in f.free_symbols:
        raise SymmemError(f"the total of {d.model} does not grow with {name} (it is {format_bytes(int(f))} "
                          f"whatever {name} is), so there is no largest {name}")
    poly = _poly(f, sym)
    if poly is not None and (poly.LC() <= 0 or any(r >= 1 for r in sympy.real_roots(poly.diff(sym)))):
        raise SymmemError(f"the total of {d.model} does not grow with {name} for {name} >= 1: {f}")
    at_one = _total(f, sym, 1)
    if at_one > cap:
        raise SymmemError(f"nothing fits: {d.model} needs {format_bytes(at_one)} ({at_one:,} B) at {name}=1, "
                          f"more than the budget {format_bytes(cap)} ({cap:,} B)")
    if poly is not None:
        # f grows on [1, oo) and f(1) <= cap, so exactly one root lies there; the integer below it is the answer.
        best = int(sympy.floor(max(r for r in sympy.real_roots(poly - cap) if r >= 1)))
    else:
        best = _search(f, sym, cap, d.model, name)
    # Guard the exact boundary against any rounding in floor(root): integer totals decide.
    while _total(f, sym, best) > cap:
        best -= 1
    while _total(f, sym, best + 1) <= cap:
        best += 1
    return Fit(d.model, d.convention, name, best, cap, _total(f, sym, best), _total(f, sym, best + 1), f)


def smallest_budget(d: Derivation, name: str, value: int) -> int:
    """Bytes the total needs when ``name`` = ``value`` (the smallest budget that fits that size)."""
    sym, f = polynomial(d, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SymmemError(f"{name} must be a positive integer, got {value!r}")
    return _total(f, sym, value)
