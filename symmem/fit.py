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

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy

from .errors import SymmemError
from .tensor import MAX_SIZE
from .units import format_bytes, parse_size

if TYPE_CHECKING:
    from .derivation import Derivation


@dataclass(frozen=True)
class Fit:
    """The largest value ``max`` of ``symbol`` whose total fits ``budget`` (bytes), with the totals either
    side of the boundary and the polynomial it was solved from.

    ``bound`` is the largest value whose total fits; ``max`` is the largest value up to ``bound`` that the model
    accepts (the same unless the model refuses some values, e.g. heads that do not divide the hidden size:
    ``refused`` then says why).  ``total_above`` is the total at ``bound + 1``, which does not fit.
    """

    model: str
    convention: str
    symbol: str
    max: int
    budget: int
    total_at_max: int
    total_above: int
    formula: sympy.Expr
    bound: int | None = None
    refused: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of ``symmem fit --format json``."""
        return {"model": self.model, "convention": self.convention, "symbol": self.symbol, "max": self.max,
                "budget": self.budget, "total_at_max": self.total_at_max, "total_above": self.total_above,
                "headroom": self.budget - self.total_at_max, "formula": str(self.formula),
                "bound": self.max if self.bound is None else self.bound, "refused": self.refused}

    def __str__(self) -> str:
        bound = self.max if self.bound is None else self.bound
        text = (f"{self.model} ({self.convention}): largest {self.symbol} = {self.max:,} fits "
                f"{format_bytes(self.budget)}: total {format_bytes(self.total_at_max)} ({self.total_at_max:,} B); ")
        if bound != self.max:
            span = f"{self.max + 1:,}" + ("" if bound == self.max + 1 else f" to {bound:,}")
            text += f"{self.symbol} = {span} would fit but the model refuses it ({self.refused}); "
        return text + (f"{self.symbol} = {bound + 1:,} needs {format_bytes(self.total_above)} "
                       f"({self.total_above:,} B)")


#: How many values below the budget's bound :func:`largest` tries one by one before it bisects for one the model
#: accepts (divisibility refuses a few values in a row; a limit such as S <= 1024 refuses a long run).
SCAN = 64


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
        if hi > MAX_SIZE:
            if _total(f, sym, hi) > _total(f, sym, 1):
                raise SymmemError(f"the budget fits {name} beyond the largest size PyTorch allows (2**63 - 1): "
                                  f"it is no limit on {name}")
            raise SymmemError(f"the total of {model} does not grow with {name}: {f}")
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if _total(f, sym, mid) <= cap else (lo, mid)
    return lo


def largest(d: Derivation, name: str, budget: int | str,
            accepts: Callable[[int], str | None] | None = None) -> Fit:
    """The largest positive integer value of ``name`` (``B``, ``S``, ...) whose total fits ``budget``.

    ``accepts(value)`` says why the model refuses ``value`` for ``name`` (None: accepted; see
    :func:`symmem.engine.acceptor`); the answer is then the largest accepted value that fits.
    """
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
    if best > MAX_SIZE:
        raise SymmemError(f"the budget {format_bytes(cap)} fits {name} beyond the largest size PyTorch allows "
                          f"(2**63 - 1): it is no limit on {name}")
    chosen, refused = best, None
    if accepts is not None:
        chosen, refused = _accepted(accepts, best, d.model, name)
    return Fit(d.model, d.convention, name, chosen, cap, _total(f, sym, chosen), _total(f, sym, best + 1), f,
               best, refused)


def _accepted(accepts: Callable[[int], str | None], best: int, model: str, name: str) -> tuple[int, str | None]:
    """The largest value up to ``best`` that ``accepts`` takes, and why ``best`` was refused (None if it was
    not): the values just below one by one, then a bisection for the largest accepted value (for a limit)."""
    why = accepts(best)
    if why is None:
        return best, None
    lowest = max(1, best - SCAN + 1)
    for x in range(best - 1, lowest - 1, -1):
        if accepts(x) is None:
            return x, why
    lo, hi = 1, lowest  # hi is refused
    if lowest == 1 or accepts(lo) is not None:
        raise SymmemError(f"{model} accepts no value of {name} up to {best:,} that fits: {why}")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if accepts(mid) is None else (lo, mid)
    return lo, why


def smallest_budget(d: Derivation, name: str, value: int) -> int:
    """Bytes the total needs when ``name`` = ``value`` (the smallest budget that fits that size)."""
    sym, f = polynomial(d, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SymmemError(f"{name} must be a positive integer, got {value!r}")
    return _total(f, sym, value)
