"""Will it fit: the largest batch size (or sequence length) whose training memory fits a budget.

What must fit is the **peak** of a training step (:attr:`~symmem.derivation.Derivation.peak`) where the
convention models the step (``pytorch``), else the derived **total** (kept at the end of the forward pass +
parameter side).  Every other symbol takes its value; the quantity becomes a function ``f(x)`` of the solved
symbol -- a polynomial, or a ``Max`` of polynomials for the peak (each moment of the step) -- the largest real
root of ``f(x) = budget`` is found exactly for each polynomial, and the integer below the smallest is checked
at the boundary, ``f(max) <= budget < f(max + 1)``, in integer arithmetic.

>>> from symmem import derive
>>> r = largest(derive("resnet50-v1", convention="paper"), "B", "80GiB")
>>> r.quantity, r.max, r.total_at_max <= r.budget < r.total_above
('total', 1927, True)
>>> r = largest(derive("resnet50", convention="pytorch"), "B", "80GiB")
>>> r.quantity, r.max
('peak', 987)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy

from ..errors import NothingFits, SymmemError
from ..evaluator import evaluator
from ..simplify import max_of
from ..tensor import MAX_SIZE
from ..units import format_bytes, parse_size

if TYPE_CHECKING:
    from ..derivation import Derivation


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
    #: what had to fit: ``peak`` (of a training step) or ``total``
    quantity: str = "total"
    bound: int | None = None
    refused: str | None = None
    #: the derivation's other sizes, held at their values while ``symbol`` moved (``(("S", 512),)``): the answer
    #: holds at those sizes only
    held: tuple[tuple[str, int], ...] = ()
    #: the held sizes that follow from others (ViT's S from Hi, Wi): ``--set`` refuses them, so the hint names
    #: another (:func:`held_line`)
    follows: tuple[str, ...] = field(default=(), compare=False)

    def to_dict(self) -> dict[str, Any]:
        """The JSON contract of ``symmem fit --format json`` (``total_at_max``/``total_above`` are the
        quantity's bytes, the peak's where ``quantity`` is ``peak``; ``bound`` the largest value that fits,
        ``refused`` why the model refuses the values between ``max`` and ``bound``)."""
        return {"model": self.model, "convention": self.convention, "quantity": self.quantity,
                "symbol": self.symbol, "max": self.max, "budget": self.budget, "total_at_max": self.total_at_max,
                "total_above": self.total_above, "headroom": self.budget - self.total_at_max,
                "formula": str(self.formula), "bound": self.max if self.bound is None else self.bound,
                "refused": self.refused, "held": dict(self.held)}

    def __str__(self) -> str:
        return self.text()

    def text(self, origins: dict[str, str] | None = None) -> str:
        """The answer in words, then the sizes it held (``origins``: where each value came from, e.g. ``--set``)."""
        what = "peak of a training step" if self.quantity == "peak" else "total"
        bound = self.max if self.bound is None else self.bound
        text = (f"{self.model} ({self.convention}): largest {self.symbol} = {self.max:,} whose {what} fits "
                f"{format_bytes(self.budget)}: {self.quantity} {format_bytes(self.total_at_max)} "
                f"({self.total_at_max:,} B); ")
        if bound != self.max:
            span = f"{self.max + 1:,}" + ("" if bound == self.max + 1 else f" to {bound:,}")
            why = self.refused or ""
            why = f"they are {why}" if why.startswith(LIMITS) else f"the model refuses it ({why})"
            text += f"capped at {self.symbol} = {self.max:,}: {self.symbol} = {span} would fit but {why}; "
        text += f"{self.symbol} = {bound + 1:,} needs {format_bytes(self.total_above)} ({self.total_above:,} B)"
        return f"{text}\n{held_line(self.held, origins, self.follows)}"


def held_line(held: tuple[tuple[str, int], ...], origins: dict[str, str] | None = None,
              follows: tuple[str, ...] = ()) -> str:
    """``held: S = 16 (the example input); L = 2 (the traced module's layers); --set S=... answers at another S``:
    the sizes an answer holds at, grouped by where their values come from (``origins``, where known).  The hint
    never names a size that ``follows`` from others (ViT's S from the image: ``--set S=`` is refused there).

    >>> print(held_line((("S", 512), ("L", 12)), {"S": "--set", "L": "the model's default"}))
    held: S = 512 (--set); L = 12 (the model's default); --set L=... answers at another L
    >>> print(held_line((("S", 512), ("L", 12))))
    held: S = 512, L = 12
    """
    if not held:
        return "held: nothing (the formula has no other size)"
    if origins is None:
        return f"held: {held_text(held)}"
    groups: dict[str, list[tuple[str, int]]] = {}
    for name, value in held:
        groups.setdefault(origins.get(name, "?"), []).append((name, value))
    def plural(origin: str, n: int) -> str:  # "the example inputs"; "--set" and "... layers" as they are
        return origin + ("s" if n > 1 and origin != "--set" and not origin.endswith("s") else "")

    parts = "; ".join(f"{held_text(tuple(items))} ({plural(origin, len(items))})" for origin, items in groups.items())
    unset = [n for n, _ in held if origins.get(n) != "--set" and n not in follows]
    example = next((n for n in ("S", "Hi", "B", "L") if n in unset), unset[0] if unset else None)
    tail = f"; --set {example}=... answers at another {example}" if example else ""
    return f"held: {parts}{tail}"


#: How a refusal that is a limit of the formulas or of the model (not of one value) begins: the answer is capped there
LIMITS = ("outside the formulas' domain", "past the model's")


class NoneAccepted(SymmemError):
    """What fits the budget lies only where the model or its formulas refuse it (``B = 1`` under a domain
    ``B >= 2``, or a size the model derives from others), said with ``why``; the command line exits 2 as for
    any refusal (a size to set another way), the paper's fit table says it in its row."""

    def __init__(self, message: str, best: int, why: str) -> None:
        super().__init__(message)
        self.best, self.why, self.quantity = best, why, ""


def held_text(held: tuple[tuple[str, int], ...]) -> str:
    """``S = 512, L = 12``: the sizes an answer holds at.

    >>> held_text((("S", 512), ("L", 12)))
    'S = 512, L = 12'
    """
    return ", ".join(f"{name} = {value:,}" for name, value in held)


def held_sizes(d: Derivation, name: str) -> tuple[tuple[str, int], ...]:
    """Every symbol of the derivation but ``name`` and those that move with it (ViT's S with Hi), at its value
    (the free symbols' and those written as numbers, an image size): what an answer for ``name`` holds at."""
    moving = {s for s, e in d.tied.items() if any(x.name == name for x in e.free_symbols)}
    return tuple((s.name, int(v)) for s, v in d.numbers.items() if s.name != name and s not in moving)


def domain_check(d: Derivation, sym: sympy.Symbol, quantity: str = "total") -> Callable[[int], str | None] | None:
    """Why a value of ``sym`` lies outside the derivation's domain (None inside it), every other symbol at its
    number (those tied to ``sym`` moving with it); None where the domain is everything.  On the ``peak`` the step's
    own domain counts too (where it bounds the solved size)."""
    from ..derivation import failing

    step = getattr(d, "step", None)
    # only conditions on the solved size: the step judges its other sizes itself (a traced step's fold in L holds
    # for L >= 4 and is replaced by the record at fewer layers)
    extra = [c for c in step.domain() if not isinstance(c, sympy.Eq) and sym in c.free_symbols] \
        if quantity == "peak" and step else []
    domain = sympy.And(d.domain, *extra) if extra else d.domain
    if domain is sympy.true:
        return None
    numbers = dict(d.numbers)
    tied = [(s, e) for s, e in d.tied.items() if sym in e.free_symbols]
    moving = {sym, *(s for s, _ in tied)}
    fixed = [c for c in failing(domain, numbers) if not c.free_symbols & moving]
    if fixed:  # the held sizes themselves lie outside: no value of sym brings them back
        at = ", ".join(f"{s.name} = {numbers[s]:,}" for s in sorted(set().union(*(c.free_symbols for c in fixed)),
                                                                    key=lambda s: s.name))
        raise SymmemError(f"{at} lies outside the formulas' domain ({' & '.join(map(str, fixed))}), where they are not "
                          f"known to hold, whatever {sym.name} is: answer at sizes inside it (--set)")

    def check(value: int) -> str | None:
        nums = {**numbers, sym: value}
        for s, e in tied:
            nums[s] = int(e.xreplace({x: sympy.Integer(nums[x]) for x in e.free_symbols}))
        found = failing(domain, nums)
        if not found:
            return None
        return f"outside the formulas' domain ({' & '.join(map(str, found))}), where they are not known to hold"

    return check


#: How many values below the budget's bound :func:`largest` tries one by one before it bisects for one the model
#: accepts (divisibility refuses a few values in a row; a limit such as S <= 1024 refuses a long run).
SCAN = 64


def _budget(budget: int | str) -> int:
    if isinstance(budget, str):
        return parse_size(budget)
    if isinstance(budget, bool) or not isinstance(budget, int) or budget <= 0:
        raise SymmemError(f"the budget must be a positive number of bytes or a size like 80GiB, got {budget!r}")
    return budget


def default_quantity(d: Derivation) -> str:
    """``peak`` where the convention models the training step, else ``total``."""
    return "peak" if d.has_peak else "total"


def polynomial(d: Derivation, name: str, quantity: str | None = None) -> tuple[sympy.Symbol, sympy.Expr]:
    """``quantity`` (``peak``, ``total``, default :func:`default_quantity`) as a function of the symbol ``name``
    alone: every other symbol at its value."""
    quantity = quantity or default_quantity(d)
    if quantity not in ("peak", "total"):
        raise SymmemError(f"what must fit is the 'peak' or the 'total', not {quantity!r}")
    sym = next((s for s in d.free if s.name == name), None)
    if sym is None:
        if any(s.name == name for s in d.numbers):
            raise SymmemError(f"{name} is not kept in {d.model}'s formula (it has {', '.join(s.name for s in d.free)});"
                              f" derive with free=(..., {name!r}) or --free {name}")
        raise SymmemError(f"{d.model} has no symbol {name!r}; it has {', '.join(sorted(s.name for s in d.numbers))}")
    # A symbol that follows from the solved one (ViT's S from Hi) moves with it; the rest keep their numbers.
    others = {s: v for s, v in d.numbers.items() if s != sym}
    for s, e in d.tied.items():
        if sym in e.free_symbols:
            others[s] = e.xreplace({x: d.numbers[x] for x in e.free_symbols if x != sym})
    if quantity == "peak":
        # a peak worked out at numbers (pipeline stages replayed: a formula in B alone) holds at its sizes only
        only = [c for c in d.step.domain() if isinstance(c, sympy.Eq) and sym in c.free_symbols]
        if only:
            raise SymmemError(f"the peak here is a formula in B, the other sizes at their numbers ({only[0]}): "
                              f"{name} cannot be solved for; give {name} a number (--set) and solve for B")
        peak = d.peak_formula()
        if isinstance(peak, sympy.Max):
            return sym, _upper(sym, [sympy.expand(a.xreplace(others)) for a in peak.args])
        return sym, sympy.expand(peak.xreplace(others))
    return sym, sympy.expand(d.total.xreplace(others))


def _upper(sym: sympy.Symbol, pieces: list[sympy.Expr]) -> sympy.Expr:
    """The Max of ``pieces`` (functions of ``sym`` alone) without the ones another bounds on [1, oo).

    sympy's own ``Max`` compares every pair symbolically (seconds for GPT-2's moments); pieces linear in
    ``sym`` compare by their value at 1 and their slope, anything else stays in.
    """
    unique = list(dict.fromkeys(pieces))
    lines: dict[sympy.Expr, tuple[sympy.Rational, sympy.Rational]] = {}
    for p in unique:
        poly = _poly(p, sym)
        if poly is not None and poly.degree() <= 1:
            lines[p] = (sum(poly.coeffs(), sympy.Integer(0)), poly.coeff_monomial(sym))  # value at 1, slope
    kept = [p for p in unique if p not in lines or not any(
        q != p and lines[q][0] >= lines[p][0] and lines[q][1] >= lines[p][1] for q in lines)]
    return max_of(kept)


def _total(f: sympy.Expr, sym: sympy.Symbol, x: int) -> int:
    """``f`` at ``sym = x`` in whole bytes (a fraction rounded up).  A formula in ``sym`` alone is evaluated by its
    compiled evaluator (exact, the same rounding; the search asks it at tens of sizes, each substitution rebuilding
    the expression otherwise)."""
    if f.free_symbols <= {sym}:
        return evaluator(f, (sym,))(x)
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


def _lowest_in_domain(d: Derivation, sym: sympy.Symbol, quantity: str, tries: int = 64) -> int:
    """The smallest value of ``sym`` inside the formulas' domain (1 where it is everything, or none is found
    within ``tries``, or the held sizes themselves lie outside it)."""
    try:
        check = domain_check(d, sym, quantity)
    except SymmemError:
        return 1
    if check is None:
        return 1
    return next((v for v in range(1, tries + 1) if check(v) is None), 1)


def largest(d: Derivation, name: str, budget: int | str, quantity: str | None = None,
            accepts: Callable[[int], str | None] | None = None) -> Fit:
    """The largest positive integer value of ``name`` (``B``, ``S``, ...) whose peak (or total: ``quantity``)
    fits ``budget``; :class:`~symmem.errors.NothingFits` when not even 1 does.

    ``accepts(value)`` says why the model refuses ``value`` for ``name`` (None: accepted; see
    :func:`symmem.api.acceptor`); the answer is then the largest accepted value that fits.
    """
    if accepts is not None and not callable(accepts):
        raise SymmemError(f"accepts must be a function of the value (None when it is accepted, else why not), "
                          f"not {type(accepts).__name__} {accepts!r}")
    cap = _budget(budget)
    quantity = quantity or default_quantity(d)
    sym, f = polynomial(d, name, quantity)
    if sym not in f.free_symbols:
        raise SymmemError(f"the {quantity} of {d.model} does not grow with {name} (it is "
                          f"{format_bytes(_total(f, sym, 1))} whatever {name} is), so there is no largest {name}")
    pieces = f.args if isinstance(f, sympy.Max) else (f,)
    polys = [_poly(p, sym) for p in pieces]
    for poly in polys:
        if poly is not None and (poly.LC() < 0 or any(r >= 1 for r in sympy.real_roots(poly.diff(sym)))):
            raise SymmemError(f"the {quantity} of {d.model} does not grow with {name} for {name} >= 1: {f}")
    at_one = _total(f, sym, 1)
    if at_one > cap:
        low = _lowest_in_domain(d, sym, quantity)  # the figure where the formulas hold (B >= 2: at B = 2)
        need = _total(f, sym, low)
        why = f"{quantity}; the smallest {name} the formulas hold at" if low > 1 else quantity
        raise NothingFits(f"nothing fits: {d.model} needs {format_bytes(need)} ({need:,} B) at {name} = {low} "
                          f"({why}), more than the budget {format_bytes(cap)} ({cap:,} B)")
    if all(p is not None for p in polys):
        # each moment grows on [1, oo): the largest x under the budget is the smallest over the moments
        best = min(_root(poly, sym, cap) for poly in polys)
    else:
        best = _search(f, sym, cap, d.model, name)
    # Guard the exact boundary against any rounding in floor(root): integer values decide.
    while best > 1 and _total(f, sym, best) > cap:
        best -= 1
    while _total(f, sym, best + 1) <= cap:
        best += 1
    if best > MAX_SIZE:
        raise SymmemError(f"the budget {format_bytes(cap)} fits {name} beyond the largest size PyTorch allows "
                          f"(2**63 - 1): it is no limit on {name}")
    chosen, refused = best, None
    domain = domain_check(d, sym, quantity)
    if accepts is not None or domain is not None:
        def either(value: int) -> str | None:  # the model's refusal first, then the formulas' domain
            why = accepts(value) if accepts is not None else None
            return why if why is not None or domain is None else domain(value)

        try:
            chosen, refused = _accepted(either, best, d.model, name, _period(d, sym))
        except NoneAccepted as e:
            e.quantity = quantity  # what was solved for (a table says "peak" or "total" over it)
            raise
    return Fit(d.model, d.convention, name, chosen, cap, _total(f, sym, chosen), _total(f, sym, best + 1), f,
               quantity, best, refused, held_sizes(d, name), tuple(s.name for s in d.tied))


def _period(d: Derivation, sym: sympy.Symbol) -> int:
    """The period of the domain's divisibility conditions in ``sym`` (``Mod(H, 2*h) = 0`` at h = 128: 256), the
    other sizes at their numbers; 1 without any.  Every run of that many values holds each residue once, so the
    largest valid value below a bound lies within one period of it (a bisection would assume a limit instead)."""
    others = {s: sympy.Integer(v) for s, v in d.numbers.items() if s != sym}
    out = 1
    for m in sympy.sympify(d.domain, strict=True).atoms(sympy.Mod):
        if sym in m.args[0].free_symbols:
            k = m.args[1].xreplace(others)
            if k.is_Integer and 0 < int(k) <= MAX_SIZE:
                out = math.lcm(out, int(k))
    return out


def _accepted(accepts: Callable[[int], str | None], best: int, model: str, name: str, period: int = 1
              ) -> tuple[int, str | None]:
    """The largest value up to ``best`` that ``accepts`` takes, and why ``best`` was refused (None if it was
    not): the values just below one by one (at least one ``period`` of the domain's divisibility), then a
    bisection for the largest accepted value (for a limit)."""
    why = accepts(best)
    if why is None:
        return best, None
    lowest = max(1, best - max(SCAN, period) + 1)
    for x in range(best - 1, lowest - 1, -1):
        if accepts(x) is None:
            return x, why
    # the smallest accepted value (a domain may start above 1: B >= 2), then a bisection up to the refused ``lowest``
    lo = next((x for x in range(1, min(SCAN, lowest - 1) + 1) if accepts(x) is None), None)
    hi = lowest
    if lo is None:
        raise NoneAccepted(f"{model} accepts no value of {name} up to {best:,} that fits: {why}", best, why)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if accepts(mid) is None else (lo, mid)
    return lo, why


def _root(poly: sympy.Poly, sym: sympy.Symbol, cap: int) -> int:
    """The largest integer x >= 1 with poly(x) <= cap (poly grows on [1, oo); a constant never passes)."""
    if poly.degree() < 1:
        return 2**62 if poly.LC() <= cap else 0
    roots = [r for r in sympy.real_roots(poly - cap) if r >= 1]
    return int(sympy.floor(max(roots))) if roots else 0


def smallest_budget(d: Derivation, name: str, value: int, quantity: str | None = None) -> int:
    """Bytes the peak (or total) needs when ``name`` = ``value`` (the smallest budget that fits that size)."""
    sym, f = polynomial(d, name, quantity)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise SymmemError(f"{name} must be a positive integer, got {value!r}")
    return _total(f, sym, value)
