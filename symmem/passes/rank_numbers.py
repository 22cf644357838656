"""Each data-parallel rank's peak at numbers, without the symbolic peak: the step written out at the derivation's
numbers (every repeated block its full number of times, the branch the numbers select) for one rank of each group
of ranks that step alike, and the largest moment's bytes read off it.

A peak at numbers is the largest moment of the step at those numbers.  The symbolic peak
(:func:`symmem.passes.graph_step.symbolic_peak`) interpolates the layers and keeps the moments that can be largest
at any sizes, so that its formulas hold everywhere; where every size has a number -- a replayed measurement, a
``--format json`` at one ``N`` -- that work buys nothing, and each rank's step (FSDP2's last ranks hold fewer rows,
ZeRO-1's ranks own different parameters) would pay for it again.  Here each group of alike ranks is walked once at
the numbers, as :meth:`~symmem.passes.graph_step.GraphStep.timeline` and ``peak_allocated(step, rank)`` walk it:
the same timeline, so the same bytes (``tests/test_rank_shortcuts.py`` holds the two paths to each other; the
formulas are still the views' when asked: :func:`symmem.passes.rank_formulas.rank_formulas`).

>>> from symmem import derive
>>> d = derive("mlp", convention="pytorch", device="cpu", values={"B": 4, "N": 4}, data_parallel="zero-redundancy",
...            loss="cross-entropy")
>>> {r: s for r, (f, s) in peaks_per_rank(d).items()}   # zero_redundancy's doctest: the same, to the byte
{0: 39154076, 1: 35221916, 2: 22540700, 3: 22409724}
>>> w = written(d, 3)
>>> w.peak("steady"), w.device_peak("steady") == w.peak("steady"), w.allocated("steady") >= w.peak("steady")
(22409724, True, True)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import sympy

from ..errors import SymmemError
from ..symbols import N
from ..timeline import CUDA_BLOCK, Timeline, Which, checked
from .unroll import template

#: the walks kept per step (numbers, rank): a view asks for both steps and both kinds of bytes at the same numbers
KEPT = 8
#: the longest repeated block :func:`symmem.passes.data_parallel.rank_peaks` walks at numbers (:func:`short`)
WALKED_LAYERS = 8
#: the step's cache entry holding them (``GraphStep._cache``: the step's own peaks are keyed otherwise)
CACHE_KEY = "rank walks at numbers"


@dataclass(frozen=True)
class Written:
    """One rank's step written out at numbers: the steady and first step's timelines and every symbol's value."""

    steady: Timeline
    first: Timeline
    values: Mapping[sympy.Symbol, Any]

    def timeline(self, which: Which) -> Timeline:
        return self.first if checked(which) == "first" else self.steady

    def peak(self, which: Which = "steady") -> int:
        """The most bytes alive at any moment (host storages included), rounded up to a whole byte: the value of
        the peak's formula at these numbers (``d.value("peak")`` of this rank's step)."""
        return whole_peak(self.timeline(which), self.values)

    def where(self, which: Which = "steady") -> tuple[str, str | None]:
        """(phase, op) of the step's first largest moment, the op by its template name (``layers.mlp``): where
        ``peak_at`` says the peak is, at these numbers."""
        tl = self.timeline(which)
        e = tl.events[_largest(tl, self.values)[1]]
        return e.phase, template(e.node) if e.node else None

    def device_peak(self, which: Which = "steady") -> int:
        """The most device bytes alive at any moment, unrounded (host storages counted as empty): what
        ``torch.cuda.memory_stats()["requested_bytes.all.peak"]`` measures."""
        return self.timeline(which).allocated(self.values, block=1)

    def allocated(self, which: Which = "steady", block: int = CUDA_BLOCK) -> int:
        """Every device storage in ``block``-byte blocks: ``peak_allocated(which, rank)``."""
        return self.timeline(which).allocated(self.values, block)


def whole_peak(tl: Timeline, values: Mapping[sympy.Symbol, Any]) -> int:
    """The largest moment of ``tl`` at ``values`` in bytes, every storage counted (host ones too), exact (a
    fraction of a byte kept until the end), then rounded up as :meth:`symmem.derivation.Derivation.evaluate`
    rounds a formula.

    >>> from symmem.timeline import Event, Live
    >>> B = sympy.Symbol("B")
    >>> tl = Timeline((Live("x", "activation", 8 * B), Live("t", "temporary", B / 2)), (),
    ...               (Event("forward", "f", (0, 1), (1,)), Event("backward", "f", (), (0,))))
    >>> whole_peak(tl, {B: 3})   # 24 + 1.5
    26
    """
    best, _ = _largest(tl, values)
    return math.ceil(best)


def _largest(tl: Timeline, values: Mapping[sympy.Symbol, Any]) -> tuple[Any, int]:
    """The bytes of ``tl``'s largest moment at ``values``, exact, and its event's index (the first of equals; 0 and
    -1 where there is no moment)."""
    subs = {s: sympy.Integer(v) if isinstance(v, int) else v for s, v in values.items()}
    memo: dict[Any, Any] = {}

    def num(x: Any) -> Any:
        found = memo.get(x)
        if found is None:
            v = sympy.sympify(sympy.sympify(x, strict=True).xreplace(subs), strict=True)
            if not v.is_Rational:
                raise SymmemError(f"a storage of {v} bytes: give its sizes a number")
            found = memo[x] = int(v) if v.is_Integer else Fraction(int(v.p), int(v.q))
        return found

    size = [num(s.nbytes) for s in tl.storages]
    live: Any = sum(size[i] for i in tl.start)
    best: Any = None
    at = -1
    for k, e in enumerate(tl.events):
        for i in e.born:
            live += size[i]
        for sid, new in e.resized:
            live -= size[sid]
            size[sid] = num(new)
            live += size[sid]
        if e.moment and (best is None or live > best):
            best, at = live, k
        for i in e.freed:
            live -= size[i]
    return (0 if best is None else best), at


def numbered(derivation: Any) -> bool:
    """Whether the step is walked here at the derivation's numbers: a built graph's step (not a pipeline's,
    tensor-parallel or traced one) with a number for every size (and for ``N`` under a data-parallel engine)."""
    step = getattr(derivation, "step", None)
    regime = derivation.regime
    # a built graph's step (graph_step.GraphStep, which imports this module where it is asked)
    return (getattr(type(step), "ranks_at_numbers", None) is not None
            and not regime.pipeline_parallel and not regime.tensor_parallel
            and (regime.data_parallel is None or N in derivation.numbers)
            and all(s in derivation.numbers for s in derivation.free))


def applies(derivation: Any) -> bool:
    """Whether the ranks are walked here: :func:`numbered`, under a data-parallel engine."""
    return derivation.regime.data_parallel is not None and numbered(derivation)


def at_numbers(derivation: Any) -> tuple[bool, dict[int, tuple[int, int]] | None]:
    """:func:`symmem.passes.data_parallel.rank_peaks` where it is answered here: (True, the ranks' (first, steady)
    peaks, None where every rank is alike), or (False, None) where each group's formula is read instead."""
    if not applies(derivation):
        return False, None
    if len(rank_groups(derivation)) < 2:
        return True, None  # every rank holds the same rows: alike
    if not formulas_made(derivation.step) and short(derivation):
        # numbers only asked for, a short stack: each group walked there, no formula made
        found = peaks_per_rank(derivation) or {}
        return True, (found if len(set(found.values())) > 1 else None)
    # a view that made the peak's formulas shows each group's next (rank_formulas): their values are these
    return False, None


def short(derivation: Any) -> bool:
    """Whether every repeated block is at most :data:`WALKED_LAYERS` long at the derivation's numbers: the step
    written out there is then no longer than the two the peak's formulas interpolate from (4 and 5 layers), so
    walking it is the cheaper way to a number.  A long stack at its number (GPT-2's 12 layers, Llama's 32) costs
    about as much or more written out (paired, docs/testing.md "Stop 38: ranks-numeric")."""
    return all(count.is_number and int(count) <= WALKED_LAYERS
               for count in derivation.step.counts_at(derivation.numbers).values())


def formulas_made(step: Any) -> bool:
    """Whether a peak formula of ``step`` was made (a view's: the table and the JSON show the peak's formulas, and
    each group of ranks' after them), so that each rank's value is best read off its group's formula; the step's
    cache holds nothing but this module's walks otherwise."""
    return any(key != CACHE_KEY for key in getattr(step, "_cache", {}))


def rank_groups(derivation: Any) -> list[list[int]]:
    """The ranks ``0 .. N-1`` grouped by the step they run: FSDP2's by the rows they hold
    (:func:`symmem.passes.data_parallel.alike_ranks`), ZeRO-1's by the shapes they own
    (:func:`symmem.passes.zero_redundancy.rank_groups`), the other engines' ranks all alike."""
    from .data_parallel import SHARDED, _stored, alike_ranks
    from .zero_redundancy import engaged
    from .zero_redundancy import rank_groups as zero_groups

    step = derivation.step
    world = int(derivation.numbers[N])
    if engaged(derivation.regime):
        return zero_groups(step, dict(derivation.numbers))
    if derivation.regime.data_parallel in SHARDED:
        firsts = [derivation.evaluate(shape[0]) for shape in _stored(step.graph).values() if shape]
        return alike_ranks(firsts, world)
    return [list(range(world))]


def written(derivation: Any, rank: int | None = None) -> Written:
    """``rank``'s step written out at the derivation's numbers (kept on the step: a view asks again); None: one
    device's step, or under a data-parallel engine rank 0's (ZeRO-1's ranks differ: name one)."""
    from .zero_redundancy import engaged, refuse_precision

    step = derivation._step()  # the engine's refusal of one rank, as every peak's view refuses it
    if not numbered(derivation):
        raise SymmemError("a step at numbers is walked for a built graph's step (a data-parallel engine's too) with "
                          "every size a number (N included)")
    zero = engaged(step.regime)
    if rank is None and zero:
        raise SymmemError("ZeroRedundancyOptimizer's ranks own different parameters: name a rank")
    if rank is not None:
        world = int(derivation.numbers[N]) if derivation.regime.data_parallel is not None else 1
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise SymmemError(f"rank must be an integer from 0 to N - 1 = {world - 1}, not {rank!r}")
    at = {s: int(v) for s, v in derivation.numbers.items()}
    named = tuple(sorted((s.name, v) for s, v in at.items()))
    kept = step._cache.setdefault(CACHE_KEY, {})
    key = (named, rank)
    if key in kept:
        return kept[key]
    if zero:
        refuse_precision(step)
    # the unrolled graph, and ZeRO-1's forward and backward (every rank's, schedule.simulate), once per numbers
    shared = kept.setdefault((named, "shared"), {})
    steady, first, values = step.written_at(at, rank, shared)
    if len(kept) > KEPT:
        kept.clear()
        kept[(named, "shared")] = shared
    found = kept[key] = Written(steady, first, values)
    return found


def peaks_per_rank(derivation: Any) -> dict[int, tuple[int, int]] | None:
    """``{rank: (first-step peak, steady peak)}`` of every rank ``0 .. N-1`` at the derivation's numbers, each
    group of alike ranks walked once (:func:`rank_groups`); None where :func:`applies` does not hold.  Every
    engine's, alike or not (:func:`symmem.passes.data_parallel.rank_peaks` gives only ranks that differ)."""
    if not applies(derivation):
        return None
    out: dict[int, tuple[int, int]] = {}
    for group in rank_groups(derivation):
        w = written(derivation, group[0])
        out.update(dict.fromkeys(group, (w.peak("first"), w.peak("steady"))))
    return dict(sorted(out.items()))


__all__ = ["Written", "applies", "formulas_made", "numbered", "peaks_per_rank", "rank_groups", "short",
           "whole_peak", "written"]
