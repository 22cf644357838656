"""The one peak algebra: the peak of live memory over a training step, as a formula -- the ``Max`` over the
step's moments that can be largest.

A :class:`~symmem.timeline.Timeline` gives the live storages after every op; its candidate moments are the ops
after which something is freed (between two of them memory only grows).  A front turns each candidate into a
:class:`Candidate`: its live storages as counts per byte size, each count affine in the symbolic layer counts
(a built graph simulated with its blocks written out at two counts, :mod:`symmem.passes.graph_step`; a traced module
recorded at 4, 5 and 6 layers, :mod:`symmem.importer.traced_step`).  :func:`summarize` drops the moments another
provably exceeds (every coefficient of the difference >= 0 once each symbol x >= 1 is written x' + 1 and each
layer count L >= 4 as L' + 4; with one symbol left, the upper envelope) and gives the :class:`Peak`: the ``Max``
of the rest, with where each moment is and what is alive there.

>>> from symmem import derive
>>> d = derive("mlp", convention="pytorch", device="cpu", optimizer="sgd")
>>> d.peak    # which layer's backward is the peak depends on B
Max(7232*B + 14909528, 15424*B + 11694168, 19520*B + 7495768)
>>> d.peak_at().where(), d.value("peak")
('backward fc1, steady step', 15372376)
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import sympy
from sympy.core.add import _addsort
from sympy.core.function import Application

from .categories import STEP
from .errors import SymmemError
from .evaluator import interpret
from .simplify import max_of
from .timeline import Summed, checked

#: Layers a symbolic block is written out with; formulas hold for counts from this on.
BASE = 4


class Lazy(Mapping):
    """A mapping built on first use: most moments are only ever summed (the peak's Max), a few looked into."""

    def __init__(self, make: Callable[[], Mapping[str, sympy.Expr]]) -> None:
        self._make: Callable[[], Mapping[str, sympy.Expr]] | None = make
        self._data: Mapping[str, sympy.Expr] = {}

    def _get(self) -> Mapping[str, sympy.Expr]:
        if self._make is not None:
            self._data, self._make = self._make(), None
        return self._data

    def __getitem__(self, key: str) -> sympy.Expr:
        return self._get()[key]

    def __iter__(self) -> Any:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


@dataclass(frozen=True)
class Moment:
    """A moment of the step: ``phase`` (forward, backward, step, zero_grad), the op (a template node, or a
    parameter in the step), which layer of its repeated block (``1``, ``2``, ``L-1``, ``L``; empty outside a
    block), which step (``first`` creates the optimizer state; ``steady`` is every later one), and the live bytes
    per category."""

    phase: str
    node: str | None
    layer: str
    step: str
    live: Mapping[str, sympy.Expr] = field(compare=False)
    #: how the builder sums the live bytes on demand (the per-category split is built on demand too)
    make: Callable[[], sympy.Expr] | None = field(default=None, compare=False, repr=False)
    #: the builder's exact bytes at given sizes without building the sum (None where it cannot tell)
    measure: Callable[[Mapping[sympy.Symbol, int]], Any] | None = field(default=None, compare=False, repr=False)
    #: which branch of the size conditions (:attr:`Peak.guards`) the moment belongs to (0 where there is one)
    branch: int = 0
    #: the builder's live bytes as exact coefficients by monomial, the sum :attr:`total` builds (None where it has
    #: none): comparing two moments needs no sympy
    poly: Callable[[], Mapping[sympy.Expr, Any]] | None = field(default=None, compare=False, repr=False)
    #: (what the moment shares with others, the bytes it adds to it): two moments that share the same differ by
    #: the difference of their bytes (a ZeRO-1 rank's moments: its optimizer state beside every rank's walk)
    offset: tuple[Any, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def total(self) -> sympy.Expr:
        found = self.__dict__.get("_total")
        if found is None:
            found = self.make() if self.make is not None else sympy.Add(*self.live.values())
            object.__setattr__(self, "_total", found)  # a cache on a frozen value
        return found

    def value(self, numbers: Mapping[sympy.Symbol, int]) -> int | Fraction:
        """The live bytes at ``numbers``, exactly."""
        v = self.measure(numbers) if self.measure is not None else None
        return v if v is not None else interpret(self.total, dict(numbers))

    def where(self, step: bool = True) -> str:
        """``backward blocks.fc2 (layer L), steady step`` (without the step where a label already says it)."""
        layer = f" (layer {self.layer})" if self.layer else ""
        return (f"{self.phase} {self.node or ''}{layer}" + (f", {self.step} step" if step else "")).replace("  ", " ")


class Peak:
    """The peak of a training step: the steady-state formula (``expr``, step >= 2), the first step's (``first``,
    which creates the optimizer state), both a ``Max`` of the moments that can be largest, those moments, and
    the domain the formulas hold on (``L >= 4`` for a symbolic layer count).

    ``expr`` or ``first`` given as None is the ``Max`` of that step's moments, built on first use: the peak's
    bytes at given sizes (:meth:`value`) need no sympy expression at all.

    Where the step differs between branches of size conditions (a view that copies unless ``G = h``), ``guards``
    holds one condition per branch, in the order of the formulas' ``Piecewise`` (the first that holds is taken;
    the last is ``True``), and each moment's :attr:`Moment.branch` says which it belongs to: the moments that
    can be largest at given sizes are those of the branch the sizes select, never another branch's.
    """

    def __init__(self, expr: sympy.Expr | None, first: sympy.Expr | None, moments: tuple[Moment, ...],
                 domain: tuple[sympy.Basic, ...] = (), guards: tuple[sympy.Basic, ...] = ()) -> None:
        self._exprs = {"steady": expr, "first": first}
        self._of_moments = {step: e is None for step, e in self._exprs.items()}  # a plain Max of its moments
        self.moments = moments
        self.domain = domain
        self.guards = guards

    def branch(self, numbers: Mapping[sympy.Symbol, int]) -> int:
        """The branch of the size conditions that ``numbers`` select (0 where there is one)."""
        if len(self.guards) < 2:
            return 0
        env = {s: sympy.Integer(int(v)) for s, v in numbers.items()}
        for i, guard in enumerate(self.guards):
            now = sympy.sympify(guard, strict=True).xreplace(env)
            if now is sympy.true:
                return i
            if now is not sympy.false:
                raise SymmemError(f"the peak depends on {guard}, which these sizes do not decide: give "
                                  f"{', '.join(sorted(s.name for s in now.free_symbols))} a number")
        raise SymmemError(f"no branch of the peak holds at these sizes ({', '.join(map(str, self.guards))})")

    def _of(self, step: str, numbers: Mapping[sympy.Symbol, int] | None) -> list[Moment]:
        """The moments of ``step``; with ``numbers``, those of the branch they select only."""
        checked(step)
        branch = None if numbers is None or len(self.guards) < 2 else self.branch(numbers)
        return [m for m in self.moments if m.step == step and (branch is None or m.branch == branch)]

    def formula(self, step: str = "steady") -> sympy.Expr:
        found = self._exprs[checked(step)]
        if found is None:
            found = self._exprs[step] = peak_max([m for m in self.moments if m.step == step])
        return found

    @property
    def expr(self) -> sympy.Expr:
        return self.formula("steady")

    @property
    def first(self) -> sympy.Expr:
        return self.formula("first")

    def value(self, numbers: Mapping[sympy.Symbol, int], step: str = "steady") -> int | None:
        """The peak's bytes at ``numbers`` (rounded up) where it is the largest of its moments (of the branch
        ``numbers`` select, where the formula is a ``Piecewise`` over size conditions); None where it is a
        formula of another shape, to be evaluated instead."""
        if not self._of_moments[checked(step)] and len(self.guards) < 2:
            return None
        v = self.at(numbers, step).value(numbers)
        return int(v) if isinstance(v, int) else math.ceil(v)

    def candidates(self, step: str = "steady", numbers: Mapping[sympy.Symbol, int] | None = None) -> int:
        """How many moments of ``step`` can be the largest (the ``Max``'s arguments); with ``numbers``, in the
        branch of the size conditions they select."""
        if self._of_moments[checked(step)] or (numbers is not None and len(self.guards) > 1):
            return len(self._of(step, numbers))  # counted without building the Max
        expr = self.formula(step)
        return len(expr.args) if isinstance(expr, sympy.Max) else 1

    def at(self, numbers: Mapping[sympy.Symbol, int], step: str = "steady") -> Moment:
        """The moment of ``step`` (``steady`` or ``first``) that is largest at ``numbers``, in the branch of the
        size conditions they select."""
        key = (checked(step), tuple(sorted((s.name, int(v)) for s, v in numbers.items())))
        cache = self.__dict__.setdefault("_at", {})
        found = cache.get(key)
        if found is None:  # the table asks for the value, the moment and the count at the same numbers
            if len(cache) > 64:
                cache.clear()
            found = cache[key] = max(self._of(step, numbers), key=lambda m: m.value(numbers))
        return found

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        """Whether ``numbers`` lie in the domain of the formulas."""
        return all(bool(c.xreplace(dict(numbers))) for c in self.domain)


@dataclass(frozen=True)
class Candidate:
    """A moment's live storages: per category, byte size -> (count at the base layer counts, change per extra
    layer of each symbolic count)."""

    key: tuple[Any, ...]
    step: str
    #: (category index, byte size) -> (count at the base layer counts, change per step of each symbolic count)
    parts: dict[tuple[int, sympy.Expr], tuple[int, tuple[int, ...]]]


def _compare(a: tuple[Any, Any], b: tuple[Any, Any]) -> int:
    """The order of a monomial's factors (base, exponent): sympy's canonical order of the bases, which tells two
    bases apart by their structure -- any fixed order makes a monomial one key.  (Their printed names were the
    order before: printing an FSDP1 flat shard's ``ceiling(...)`` of a dozen terms costs a quarter millisecond,
    comparing it microseconds.)"""
    return a[0].compare(b[0])


#: sorts a monomial's (base, exponent) factors (:func:`_compare`)
_key = functools.cmp_to_key(_compare)


class Algebra:
    """Exact polynomials in Python dicts, for comparing many candidate moments fast.

    A size expression becomes {monomial: Fraction}; a monomial is a sorted tuple of (base, exponent), where a
    base is a symbol or a non-polynomial factor (``floor(Hi/16)``, a symbol under a negative power) kept whole.
    Comparisons happen after writing each polynomial symbol x >= 1 as x' + 1 and each layer count L >= 4 as
    L' + 4 (here the count's own part is already in L' = L - 4), so a polynomial whose coefficients are all
    >= 0 is >= 0 on the domain.
    """

    def __init__(self, sizes: Sequence[Any], subs: Mapping[sympy.Symbol, sympy.Expr],
                 counts: Sequence[sympy.Symbol], base: int = BASE, period: int = 1,
                 table: Sequence[sympy.Expr] | None = None) -> None:
        self.base, self.period = base, period
        self.subs = dict(subs)
        self.counts = list(counts)
        #: layer counts written in as numbers (long stacks of known length)
        self.many = {c: int(self.subs[c]) for c in self.counts if c in self.subs}
        self.prime = [sympy.Symbol(f"{s.name}'") for s in counts]
        # ``table``: the candidates name their sizes by number (size ``i`` is ``table[i]``), so that every dict
        # keyed by a size below hashes an int in C, not a sympy size in Python (a peak hashes its candidates'
        # parts some 100,000 times); without one a size is its own key
        exprs: dict[Any, sympy.Expr] = {}
        #: a size that is storages counted as one (:class:`~symmem.timeline.Summed`): its sizes' keys, how many of each
        self.members: dict[Any, list[tuple[Any, int]]] = {}
        for e in sizes:
            size = e if table is None else table[e]
            if isinstance(size, Summed):
                self.members[e] = [(("member", x), k) for x, k in size.sizes]
                for x, _ in size.sizes:
                    if ("member", x) not in exprs:
                        exprs[("member", x)] = _expanded(x.xreplace(self.subs))
            else:
                exprs[e] = _expanded(size.xreplace(self.subs))
        terms = {e: self._terms(x) for e, x in exprs.items()}
        # symbols that appear with non-negative integer powers only: shifted by 1
        bad: set[Any] = set()
        for t in terms.values():
            for mono in t:
                bad.update(b for b, k in mono if not (isinstance(b, sympy.Symbol) and k.is_integer and k >= 0))
        self.shifted = {b for t in terms.values() for mono in t for b, _ in mono
                        if isinstance(b, sympy.Symbol) and b not in bad}
        self.rep = {e: self._shift(t) for e, t in terms.items()}
        for e, members in self.members.items():  # the sum of its sizes' (the same totals as each of them held)
            acc: dict[tuple, Any] = defaultdict(int)
            for m, k in members:
                for mono, c in self.rep[m].items():
                    acc[mono] += k * c
            self.rep[e] = {mono: c for mono, c in acc.items() if c}
        # positive scaling keeps every comparison: integer coefficients are faster than Fractions
        self.scale = math.lcm(*(c.denominator for t in self.rep.values() for c in t.values()
                                if isinstance(c, Fraction)))
        self.exprs = exprs
        #: each size's terms before the shift ({monomial: coefficient}): its bytes at numbers from its bases' values
        self.terms = terms
        self._coeffs: dict[sympy.Expr, list[tuple[sympy.Expr, int | Fraction]]] = {}
        #: each part's terms for :meth:`coefficients` (:meth:`_part`), by (size, count, change per layer)
        self._part_terms: dict[tuple, list[tuple[sympy.Expr, int | Fraction]]] = {}
        self._measured: dict[tuple, dict] = {}
        self.monomials: list[tuple] = []  # id -> monomial; totals are keyed by id (hashing sympy tuples is slow)
        self._ids: dict[tuple, int] = {}
        self._memo: dict[sympy.Expr, Any] = {}
        self._products: dict[tuple[sympy.Symbol, sympy.Expr], sympy.Expr] = {}
        self._totals: dict[frozenset, dict[int, int]] = {}
        #: the last total worked out: its parts and its sums (zeros kept), for the next one to start from
        self._last: tuple[frozenset | None, dict[int, int]] = (None, {})

    def extend(self, sizes: Sequence[sympy.Expr]) -> bool:
        """Take in ``sizes`` that are whole numbers at the substitutions (they add no symbol, so every comparison
        stays as it was); False, taking in none, where one is not."""
        new = {e: _expanded(e.xreplace(self.subs)) for e in dict.fromkeys(sizes) if e not in self.exprs}
        if not all(x.is_Integer for x in new.values()):
            return False
        for e, x in new.items():
            self.exprs[e], self.rep[e] = x, ({(): int(x)} if x else {})
            self.terms[e] = self.rep[e]
        return True

    def _id(self, mono: tuple) -> int:
        found = self._ids.get(mono)
        if found is None:
            found = self._ids[mono] = len(self.monomials)
            self.monomials.append(mono)
        return found

    @staticmethod
    def _terms(e: sympy.Expr) -> dict[tuple, Fraction]:
        out: dict[tuple, Any] = defaultdict(int)
        for term, coeff in e.as_coefficients_dict().items():
            c, mono = term.as_coeff_Mul()
            powers = tuple(sorted(mono.as_powers_dict().items(), key=_key))
            if mono == 1:
                powers = ()
            q = coeff * c
            out[powers] += int(q.p) if q.q == 1 else Fraction(int(q.p), int(q.q))
        return dict(out)

    def _shift(self, t: dict[tuple, Any]) -> dict[tuple, Any]:
        out: dict[tuple, Any] = defaultdict(int)
        for mono, c in t.items():
            parts: list[dict[tuple, int]] = [{(): 1}]
            for base, k in mono:
                if base in self.shifted:
                    k = int(k)
                    parts.append({((base, j),) if j else (): math.comb(k, j) for j in range(k + 1)})
                else:
                    parts.append({((base, k),): 1})
            for combo in itertools.product(*(p.items() for p in parts)):
                key = tuple(sorted((x for m, _ in combo for x in m), key=_key))
                n = math.prod(v for _, v in combo)
                out[key] += c * n
        return {k: v for k, v in out.items() if v}

    def _keys(self, size: sympy.Expr) -> tuple[list[tuple[int, int]], list[list[tuple[int, int]]]]:
        """The size's terms (monomial id, scaled integer coefficient), and for each count symbol the same terms
        times that count's L' (cached)."""
        found = self._memo.get(size)
        if found is None:
            items = [(mono, int(c * self.scale)) for mono, c in self.rep[size].items()]
            per: list[list[tuple[int, int]]] = []
            for s, lp in zip(self.counts, self.prime, strict=True):
                known = self.subs.get(s)
                if known is not None and sympy.sympify(known, strict=True).is_number:
                    steps = (int(known) - self.base) // self.period  # a stack of known length
                    per.append([(self._id(mono), c * steps) for mono, c in items])
                else:
                    per.append([(self._id(tuple(sorted(mono + ((lp, 1),), key=_key))), c) for mono, c in items])
            found = ([(self._id(mono), c) for mono, c in items], per)
            self._memo[size] = found
        return found

    def moment(self, cand: Candidate, phase: str, node: str | None, layer: str, step: str | None = None,
               branch: int = 0) -> Moment:
        """The candidate as a :class:`Moment` (of ``branch`` of the size conditions): its total now, its split by
        category on demand."""
        return Moment(phase, node, layer, step or cand.step, Lazy(lambda: self.live(cand)),
                      lambda: self._summed(cand), lambda numbers: self.measure(cand, numbers), branch,
                      lambda: self.coefficients(cand))

    def measure(self, cand: Candidate, numbers: Mapping[sympy.Symbol, int]) -> Any:
        """The candidate's exact bytes at ``numbers`` (the sizes' values kept per set of numbers)."""
        numbers = {**self.many, **numbers}
        return self.value(cand, numbers, self.memo(numbers))

    def memo(self, numbers: Mapping[sympy.Symbol, int]) -> dict:
        """The sizes' bytes at ``numbers`` worked out so far (:meth:`value`'s memo), kept per set of numbers: the
        prune's values and the peak's at the same numbers share them (a size holds no layer count, so the
        stacks' lengths written in as numbers change none of them)."""
        key = tuple(sorted(((s.name, int(v)) for s, v in {**self.many, **numbers}.items())))
        memo = self._measured.get(key)
        if memo is None:
            if len(self._measured) > 64:  # a sweep over many sizes: keep the memory bounded
                self._measured.clear()
            memo = self._measured[key] = {}
        return memo

    def live(self, cand: Candidate) -> dict[str, sympy.Expr]:
        """The candidate's live bytes per category, expanded."""
        return {cat: self._summed(cand, i) for i, cat in enumerate(STEP)}

    def _summed(self, cand: Candidate, category: int | None = None) -> sympy.Expr:
        """The candidate's bytes (of one category, or all), summed monomial by monomial in exact fractions from
        the expanded sizes: sympy only builds the result (multiplying sums by numbers and merging them is most
        of a peak's time otherwise)."""
        acc = self.coefficients(cand, category)
        terms = [_scaled(k, mono) for mono, k in acc.items() if k]
        if len(terms) < 2:
            return terms[0] if terms else sympy.Integer(0)
        # distinct monomials with their coefficients: nothing left to collect, so the sum is built in sympy's own
        # order without its flatten (the same object Add(*terms) gives)
        _addsort(terms)
        return sympy.Add._from_args(terms, is_commutative=True)

    def coefficients(self, cand: Candidate, category: int | None = None) -> dict[sympy.Expr, int | Fraction]:
        """The candidate's bytes (of one category, or all) as exact coefficients by monomial (a number's
        monomial is 1), zeros included."""
        acc: dict[sympy.Expr, int | Fraction] = defaultdict(int)  # ints while they can be: 5x Fraction's speed
        memo = self._part_terms
        for (c, size), (n0, ds) in cand.parts.items():
            if category is not None and c != category:
                continue
            # a step's moments hold the same storages again and again: each (size, count, change) is multiplied
            # out once, in the order of its monomials (the same sums, added in the same order)
            key = (size, n0, ds)
            terms = memo.get(key)
            if terms is None:
                terms = memo[key] = self._part(size, n0, ds)
            for mono, k in terms:
                acc[mono] += k
        return acc

    def _part(self, size: Any, n0: Any, ds: tuple[int, ...]) -> list[tuple[sympy.Expr, int | Fraction]]:
        """The (monomial, coefficient) terms one part of a candidate adds to :meth:`coefficients`, in order."""
        out = []
        whole = self.period == 1 and isinstance(n0, int)  # the same numbers, without Fraction's cost
        const = n0 - sum(ds) * self.base if whole else _number(_number(n0) - Fraction(sum(ds) * self.base,
                                                                                      self.period))
        if const:
            out += [(mono, const * k) for mono, k in self._size_coefficients(size)]
        for d, s in zip(ds, self.counts, strict=True):
            if d:
                scale = d if whole else _number(Fraction(d, self.period))
                out += [(mono, scale * k) for mono, k in self._size_coefficients(size, s)]
        return out

    def _size_coefficients(self, size: Any, count: sympy.Symbol | None = None
                           ) -> list[tuple[sympy.Expr, int | Fraction]]:
        """The size's terms (times the layer count ``count``'s where given) as (monomial, coefficient); a sum of
        sizes (:attr:`members`) gives each of its sizes' terms, as many times as it holds it."""
        members = self.members.get(size)
        if members is None:
            return self._coefficients(self.exprs[size] if count is None else self._times(count, size))
        return [(mono, k * c) for m, k in members for mono, c in self._size_coefficients(m, count)]

    def _coefficients(self, expr: sympy.Expr) -> list[tuple[sympy.Expr, int | Fraction]]:
        found = self._coeffs.get(expr)
        if found is None:
            found = self._coeffs[expr] = [(mono, _number(k)) for k, mono in
                                          (t.as_coeff_Mul() for t in sympy.Add.make_args(expr))]
        return found

    def _times(self, count: sympy.Symbol, size: sympy.Expr) -> sympy.Expr:
        key = (count, size)
        found = self._products.get(key)
        if found is None:
            found = self._products[key] = sympy.expand(count.xreplace(self.subs) * self.exprs[size])
        return found

    def total(self, cand: Candidate) -> dict[int, int]:
        """The candidate's bytes, shifted (a polynomial in x' and L'), times :attr:`scale`, by monomial id (not
        to be changed: a step's moments repeat the same storages -- a size condition's branches, the layers of
        a stack -- so a total is worked out once per set of parts and shared).  Consecutive moments of a step
        differ by a few storages: a total is the last one's plus what changed, where little did."""
        key = _frozen(cand)
        found = self._totals.get(key)
        if found is None:
            parts = cand.parts
            last, acc = self._last
            if last is None or len(last) + len(parts) <= 4 * len(key ^ last):
                acc = defaultdict(int)
                self._add(acc, parts.items(), 1)
            else:
                self._add(acc, key - last, 1)
                self._add(acc, last - key, -1)
            self._last = (key, acc)
            found = self._totals[key] = {k: v for k, v in acc.items() if v}
        return found

    def _add(self, acc: dict[int, int], parts: Any, sign: int) -> None:
        """``sign`` times the parts' (``((category, size), (count, change per layer))``) bytes, added to ``acc``."""
        for (_, size), (n0, ds) in parts:
            items, per = self._keys(size)
            if n0:
                n0 *= sign
                for mono, c in items:
                    acc[mono] += c * n0
            for d, terms in zip(ds, per, strict=True):
                if d:
                    d *= sign
                    for mono, c in terms:
                        acc[mono] += c * d

    def value(self, cand: Candidate, numbers: Mapping[sympy.Symbol, int], memo: dict) -> Fraction | None:
        steps = [(int(numbers.get(s, self.base)) - self.base) // self.period for s in self.counts]
        one = steps[0] if len(steps) == 1 else None
        total: Any = 0
        for (_, size), (n0, ds) in cand.parts.items():
            v = memo.get(size, memo)  # (the memo itself: not measured yet)
            if v is memo:
                v = memo[size] = self._bytes(size, numbers, memo)
            if v is None:
                return None
            n = n0 + ds[0] * one if one is not None else n0 + sum(d * k for d, k in zip(ds, steps, strict=True))
            total += n * v
        return total


    def _bytes(self, size: sympy.Expr, numbers: Mapping[sympy.Symbol, int], memo: dict) -> int | Fraction | None:
        """``size``'s exact bytes at ``numbers`` (None where it is not a rational number there): its terms summed
        from each base's value, a base worked out once per set of numbers (kept in ``memo`` under the base's
        monomial), where sympy would substitute into every size anew -- an FSDP step's sizes share a few
        ceilings.  A base that is not a rational number there leaves the size to sympy.  A sum of sizes
        (:attr:`members`) is its sizes' bytes summed (None where one is None)."""
        total: Any = 0
        members = self.members.get(size)
        if members is not None:
            for m, k in members:
                v = memo.get(m, memo)
                if v is memo:
                    v = memo[m] = self._bytes(m, numbers, memo)
                if v is None:
                    return None
                total += k * v
            return _number(total)
        try:
            for mono, c in self.terms[size].items():
                v: Any = c
                for b, k in mono:
                    key = ((b, 1),)
                    bv = memo.get(key, memo)
                    if bv is memo:
                        bv = memo[key] = self._base(b, numbers)
                    if bv is None or not k.is_Integer:
                        raise _Unmeasured
                    v *= bv ** int(k) if k >= 0 else Fraction(bv) ** int(k)
                total += v
        except (_Unmeasured, ZeroDivisionError):
            x = sympy.sympify(self.exprs[size].xreplace({s: sympy.Integer(k) for s, k in numbers.items()}),
                              strict=True)
            return (int(x.p) if x.q == 1 else Fraction(int(x.p), int(x.q))) if x.is_Rational else None
        return _number(total)

    @staticmethod
    def _base(b: sympy.Expr, numbers: Mapping[sympy.Symbol, int]) -> int | Fraction | None:
        """A monomial's base (a symbol, or a function application kept whole) at ``numbers``."""
        if isinstance(b, sympy.Symbol):
            v = numbers.get(b)
            return None if v is None else int(v)
        x = sympy.sympify(b.xreplace({s: sympy.Integer(k) for s, k in numbers.items()}), strict=True)
        return (int(x.p) if x.q == 1 else Fraction(int(x.p), int(x.q))) if x.is_Rational else None


class _Unmeasured(Exception):
    """A size's base with no rational value at the numbers (:meth:`Algebra._bytes`)."""


def _scaled(k: int | Fraction, mono: sympy.Expr) -> sympy.Expr:
    """``k * mono`` for a monomial without a numeric factor (``as_coeff_Mul``'s second part): the product sympy's
    ``Mul`` makes -- the number first, then the monomial's factors in their order -- built without its flatten
    (a peak's formula multiplies every monomial of every moment; the same object, sympy's own where in doubt).

    >>> from symmem.symbols import B, S, H
    >>> all(_scaled(k, m) == k * m and _scaled(k, m).args == (k * m).args
    ...     for k in (1, -1, 3, Fraction(1, 2)) for m in (B, B * S**2, 1 / H, sympy.ceiling(S / 3), sympy.S.One))
    True
    """
    c = sympy.Integer(k) if isinstance(k, int) else sympy.Rational(k.numerator, k.denominator)
    if c is sympy.S.One:
        return mono
    if mono.is_Mul and not mono.args[0].is_Number and mono.is_commutative:
        return sympy.Mul._from_args((c, *mono.args), is_commutative=True)
    if (mono.is_Symbol or (mono.is_Pow and not mono.base.is_Number) or isinstance(mono, Application)) \
            and mono.is_commutative:
        return sympy.Mul._from_args((c, mono), is_commutative=True)
    return c * mono


def _frozen(cand: Candidate) -> frozenset:
    """The candidate's parts as a set (kept on it)."""
    found = cand.__dict__.get("_frozen")
    if found is None:
        found = frozenset(cand.parts.items())
        object.__setattr__(cand, "_frozen", found)
    return found


def _expanded(size: sympy.Expr) -> sympy.Expr:
    """``sympy.expand(size)``: ``size`` itself where it is a sum of products of numbers, symbols, their whole
    powers and function applications that expanding leaves as they are (most sizes: nothing to multiply out,
    where expand's walk into every ceiling's argument is most of the algebra's set-up).

    >>> from symmem.symbols import H, N
    >>> [_expanded(e) == sympy.expand(e) for e in (4 * H * sympy.ceiling(H / N), N * (H + 1), 8 * H**2 / N)]
    [True, True, True]
    """
    for term in sympy.Add.make_args(size):
        for f in sympy.Mul.make_args(term):
            if not (f.is_Symbol or f.is_Rational or (f.is_Pow and f.exp.is_Integer and f.base.is_Symbol)
                    or (isinstance(f, Application) and _kept(f))):
                return sympy.expand(size)
    return size


@functools.lru_cache(maxsize=4096)
def _kept(f: sympy.Expr) -> bool:
    """Whether expanding the function application ``f`` gives ``f`` back."""
    return sympy.expand(f) == f


def _at_least(a: Mapping[int, int], b: Mapping[int, int]) -> bool:
    """``a >= b`` on the domain: every coefficient of ``a - b`` (shifted) is >= 0."""
    for k, v in b.items():
        if a.get(k, 0) < v:
            return False
    return True


def prune(cands: list[Candidate], alg: Algebra, numbers: Mapping[sympy.Symbol, int] | None,
               memo: dict) -> list[Candidate]:
    """The candidates no other provably exceeds, largest first at ``numbers``: one that holds every storage
    of another exceeds it; so does one whose bytes minus the other's have no negative coefficient on the
    domain (:class:`Algebra`).  With a single symbol left, the upper envelope over its values >= 1."""
    if not cands:
        return []
    # in the step's order: each total the last one's plus a little.  Moments that hold the same storages share
    # one total (the algebra keeps one per set of parts: a later micro-batch's forward repeats the one before),
    # so a value is worked out once per total too
    totals = {c.key: alg.total(c) for c in cands}
    cands = first_of_each(cands, totals)
    if numbers:
        by_total: dict[int, Any] = {}
        values = {}
        for c in cands:
            t = id(totals[c.key])
            v = by_total.get(t, by_total)
            if v is by_total:
                v = by_total[t] = alg.value(c, numbers, memo)
            values[c.key] = v
        if all(v is not None for v in values.values()):
            cands = sorted(cands, key=lambda c: -values[c.key])
    used = set().union(*totals.values())
    bases = {b for i in used for b, _ in alg.monomials[i]}
    if len(bases) <= 1:
        return _envelope(cands, {k: {alg.monomials[i]: v for i, v in t.items()} for k, t in totals.items()})
    by_key = {c.key: c for c in cands}
    return [by_key[k] for k in survivors([c.key for c in cands], totals)]


def first_of_each(cands: list[Candidate], totals: Mapping[Any, Mapping[int, int]]) -> list[Candidate]:
    """``cands`` less each that holds what an earlier one holds (the same total: :meth:`Algebra.total` keeps one per
    set of parts), left out before the comparisons: the first of equals is the one kept either way
    (:func:`survivors`, :func:`_envelope`), and a step repeats its moments (FSDP's policy with full checkpointing
    over four micro-batches: 28% of Llama's 1,270)."""
    seen: set[int] = set()
    out = []
    for c in cands:
        t = id(totals[c.key])
        if t not in seen:
            seen.add(t)
            out.append(c)
    return out


def survivors(order: Sequence[Any], totals: Mapping[Any, Mapping[int, int]]) -> list[Any]:
    """The keys of ``order`` (largest first) whose totals no other's provably exceeds (:func:`_at_least`), in
    the order they were kept: each one drops the kept ones it exceeds, the first of equals stays.

    Each kept total remembers the monomial that last showed it below a candidate (its witness) and tries it
    first: the moments of a step differ in a few monomials, and a scan from the start walks the ones every
    moment shares (an FSDP step's shards and parameters) before it finds one of those -- the same answers, half
    the time.

    >>> survivors("abc", {"a": {0: 2}, "b": {0: 1, 1: 1}, "c": {0: 3, 1: 1}})
    ['c']
    """
    kept: list[Any] = []
    witness: dict[Any, int] = {}
    for c in order:
        b = totals[c]
        for k in kept:  # is c below a kept one?  (_at_least(totals[k], b), its witness first)
            a = totals[k]
            w = witness.get(k)
            if w is not None and a.get(w, 0) < b.get(w, 0):
                continue
            for m, v in b.items():
                if a.get(m, 0) < v:
                    witness[k] = m
                    break
            else:
                break
        else:
            kept = [k for k in kept if not _at_least(b, totals[k])] + [c]
    return kept


def _envelope(cands: list[Candidate], totals: Mapping[tuple, Mapping[tuple, int]]) -> list[Candidate]:
    """With at most one symbol x (shifted: x' = x - 1 >= 0) and lines a x' + c, the lines on the upper envelope
    over the integers x' >= 0 (each kept once: the first of equal lines)."""
    lines: dict[tuple[Fraction, Fraction], Candidate] = {}
    for c in cands:
        t = totals[c.key]
        if any(len(m) > 1 or (m and m[0][1] != 1) for m in t):
            return cands
        key = (sum((v for m, v in t.items() if m), Fraction(0)), t.get((), Fraction(0)))
        lines.setdefault(key, c)
    best: dict[Fraction, Fraction] = {}
    for a, b in lines:
        best[a] = max(best.get(a, b), b)
    hull: list[tuple[Fraction, Fraction]] = []  # the upper envelope, slopes ascending

    def useless(l1: tuple[Fraction, Fraction], l2: tuple[Fraction, Fraction], l3: tuple[Fraction, Fraction]) -> bool:
        # l2 never exceeds both: l3 overtakes l1 no later than l2 does
        return (l3[1] - l1[1]) * (l2[0] - l1[0]) >= (l2[1] - l1[1]) * (l3[0] - l1[0])

    for line in sorted(best.items()):
        while len(hull) >= 2 and useless(hull[-2], hull[-1], line):
            hull.pop()
        hull.append(line)
    # only x' >= 0: drop lines whose stretch of the envelope ends before 0
    while len(hull) >= 2 and hull[1][1] >= hull[0][1]:
        hull.pop(0)
    return [lines[(a, b)] for a, b in hull] or cands


def _number(x: Any) -> int | Fraction:
    """An int, Fraction or sympy Rational as an int where it is whole, else a Fraction."""
    if isinstance(x, sympy.Rational):
        x = Fraction(int(x.p), int(x.q))
    if isinstance(x, Fraction) and x.denominator == 1:
        return x.numerator
    return x


def peak_max(moments: list[Moment]) -> sympy.Expr:
    return max_of(m.total for m in moments)



def summarize(groups: Sequence[tuple[list[Candidate], list[Candidate]]],
              where: Callable[[Candidate], tuple[str, Any, str]], subs: Mapping[sympy.Symbol, Any],
              counts: Sequence[sympy.Symbol], numbers: Mapping[sympy.Symbol, int] | None,
              domain: tuple[sympy.Basic, ...], *, base: int = BASE, period: int = 1,
              merge: Callable[[list[sympy.Expr]], sympy.Expr] | None = None,
              guards: Sequence[sympy.Basic] = (), lazy: bool = False, pruned: bool = False,
              algebra: Algebra | None = None, table: Sequence[sympy.Expr] | None = None) -> Peak:
    """The :class:`Peak` of (steady, first) candidates, one pair per group (a size-dependent branch of the step;
    ``merge`` joins the groups' formulas into one ``Piecewise`` whose conditions are ``guards``, one per group).
    ``where`` names a candidate's moment: (phase, op, layer); ``counts`` are the symbolic layer counts the
    candidates' parts change with.  ``lazy``: a ``Piecewise`` is built when first asked for (a ZeRO-1 rank's
    peak is read at numbers only); ``pruned``: the candidates are what :func:`prune` keeps, in its order;
    ``algebra``: one that holds every candidate's sizes already (shared by ZeRO-1's ranks); ``table``: the
    candidates' parts name each size by its number there (:class:`Algebra`)."""
    if len(groups) > 1 and merge is not None and len(guards) != len(groups):
        raise ValueError("a Piecewise peak needs one guard per group")
    # one algebra for every group: the sizes repeat across branches and steps
    alg = algebra if algebra is not None else Algebra(_sizes_of(groups), subs, counts, base, period, table)
    memo: dict = alg.memo(numbers) if numbers else {}
    per_group: list[tuple[list[Moment], ...]] = []
    done: dict[tuple[int, ...], list[list[Candidate]]] = {}  # a group met again (the same lists): pruned once
    for group in groups:
        again = tuple(id(cands) for cands in group)
        kept = done.get(again)
        if kept is None:
            kept = done[again] = [cands if pruned else prune(cands, alg, numbers, memo) for cands in group]
        per_group.append(tuple([alg.moment(k, *where(k), branch=len(per_group)) for k in ks] for ks in kept))
    moments = tuple(itertools.chain.from_iterable(s + f for s, f in per_group))
    if len(per_group) == 1:  # the Max of the moments, built when asked for
        return Peak(None, None, moments, domain)
    conds = tuple(sympy.sympify(g, strict=True).xreplace(dict(subs)) for g in guards)
    if lazy and merge is not None:
        return _MergedPeak(per_group, merge, moments, domain, conds)
    exprs = [(peak_max(steady), peak_max(first)) for steady, first in per_group]
    if merge is None:  # the first group's formulas: its moments only
        return Peak(*exprs[0], tuple(per_group[0][0] + per_group[0][1]), domain)
    return Peak(merge([e for e, _ in exprs]), merge([e for _, e in exprs]), moments, domain, conds)


def _sizes_of(groups: Sequence[tuple[list[Candidate], list[Candidate]]]) -> list[Any]:
    """Every size the candidates' parts hold, in the order first met: each candidate's (category, size) keys
    merged in C (a dict's update), then their sizes -- a size's first part comes first either way.  A step
    holds some 20 parts a moment over a thousand moments (an FSDP step with its policy, full checkpointing and
    four micro-batches: 104,000 generator steps, one a part, before)."""
    keys: dict[Any, Any] = {}
    for group in groups:
        for cands in group:
            for c in cands:
                keys.update(c.parts)
    return list(dict.fromkeys(x for _, x in keys))


class _MergedPeak(Peak):
    """A :class:`Peak` over branches of size conditions whose ``Piecewise`` formulas are built on first use
    (:func:`summarize` with ``lazy``): the same formulas, the same moments."""

    def __init__(self, per_group: list[tuple[list[Moment], ...]], merge: Callable[[list[sympy.Expr]], sympy.Expr],
                 moments: tuple[Moment, ...], domain: tuple[sympy.Basic, ...], guards: tuple[sympy.Basic, ...]) -> None:
        super().__init__(None, None, moments, domain, guards)
        self._of_moments = {"steady": False, "first": False}  # a Piecewise, not one Max
        self._groups, self._merge = per_group, merge

    def formula(self, step: str = "steady") -> sympy.Expr:
        if self._exprs[checked(step)] is None:
            i = 0 if step == "steady" else 1
            self._exprs[step] = self._merge([peak_max(group[i]) for group in self._groups])
        return self._exprs[step]
