"""Every distinct data-parallel rank's peak as a formula, where the ranks of an engine differ: FSDP2's padding
(the last rank holds fewer rows of a parameter whose dim 0 ``N`` does not divide), ZeroRedundancyOptimizer's
whole-parameter owners, and each stage's data-parallel ranks on a p x N mesh (DDP, ZeRO-1 and FSDP2 on stages).

The ranks are grouped as :func:`~symmem.passes.data_parallel.alike_ranks` groups them at the derivation's ``N``
(ZeRO-1: by the parameters each owns), and each group's formula is its first rank's step -- or, where the group is
the last rank alone, the step of rank ``N - 1`` (:func:`~symmem.passes.data_parallel.rank_of`: the rows it holds
are ``Max(0, d0 - (N - 1)*ceiling(d0/N))``), so "rank N-1" is the last rank's formula at any
``N``, not rank 3's.  Rank 0 always holds whole shards: its formula is every leading rank's.  A middle rank that
holds part of a shard keeps its number (``rank 2``).  The grouping itself is the one at the derivation's ``N``.

* FSDP2 on a built graph: each group's peak (the ``Max`` over its moments) in ``N`` and the model's sizes;
* ZeRO-1: each rank's peak in the sizes the partition does not depend on (``B``, ``S``), at the partition's
  numbers (``N``, the parameters' sizes, the layer count: ``held_at`` says which);
* a p x N mesh: each stage's largest moment at these sizes per group
  (:mod:`.pipeline_formula`, :mod:`.mesh_formula`), at the schedule's numbers; ZeRO-1's at the partition's.

Nothing here is worked out for a plain ``derive``: the views ask (``expressions.peak_per_rank`` in JSON, the
table's "peak per rank as formulas" line), and the FSDP2 ranks' steps are the ones
:func:`~symmem.passes.data_parallel.rank_peaks` walks anyway (kept on the step).

>>> from symmem import derive
>>> d = derive("mlp", convention="pytorch", device="cpu", optimizer="adamw", values={"B": 4, "N": 3},
...            widths="64,127,10", loss="cross-entropy", data_parallel="fsdp")
>>> [(f.label, f.ranks) for f in rank_formulas(d)]
[('ranks 0..N-2', (0, 1)), ('rank N-1', (2,))]
>>> last = rank_formulas(d)[-1].peak
>>> [d.at(N=n).evaluate(last) for n in (2, 3, 4)]  # the last rank's peak at N = 2, 3, 4 (gloo: 134,432 at N = 2)
[134432, 114980, 104352]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy

from ..errors import SymmemError
from ..symbols import N
from .data_parallel import SHARDED, rank_derivations, rank_of


@dataclass(frozen=True)
class RankFormula:
    """One group of alike ranks: their numbers at the derivation's ``N`` (a mesh's ``s*N + r``), what they are
    called in ``N`` (``ranks 0..N-2``, ``rank N-1``; ``stage 1, ...`` on a mesh), their steady and first step's
    peak formulas and what those hold at or where (``""``: in ``N`` and the sizes, everywhere)."""

    ranks: tuple[int, ...]
    label: str
    peak: sympy.Expr
    peak_first_step: sympy.Expr
    held_at: str = ""
    #: the steady step's largest moment at the derivation's numbers (what the table shows; ``peak`` is the ``Max``
    #: over the moments, itself where it is one moment)
    largest: sympy.Expr | None = None

    def as_dict(self, printed: Mapping[sympy.Expr, str] | None = None) -> dict[str, Any]:
        """The JSON's entry; ``printed``: formulas already printed (the derivation's own peak is rank 0's: a long
        ``Max`` is printed once)."""
        def text(e: sympy.Expr) -> str:
            # a long Max printed with its terms as the algebra keeps them: sorting them was most of its time
            return (printed or {}).get(e) or sympy.sstr(e, order="none")

        out = {"ranks": self.label, "rank_numbers": list(self.ranks), "peak": text(self.peak),
               "peak_first_step": text(self.peak_first_step),
               "largest_moment": text(self.peak if self.largest is None else self.largest)}
        if self.held_at:
            out["formula_at"] = self.held_at
        return out


def label(group: Sequence[int], world: int, in_n: bool = True) -> str:
    """``group`` (data-parallel ranks of ``world``), named in ``N`` (``in_n``) where its formula is in ``N``: the
    last rank alone (rank ``N - 1``'s step) and the leading ranks up to the last or the one before (rank 0's);
    otherwise by number (a middle rank's formula is its own number's; ZeRO-1's are at the partition's ``N``).

    >>> label([0, 1, 2], 4), label([3], 4), label([0], 2), label([1], 2), label([2], 4), label([0, 1, 2, 3], 4)
    ('ranks 0..N-2', 'rank N-1', 'rank 0', 'rank N-1', 'rank 2', 'ranks 0..N-1')
    >>> label([3], 4, in_n=False), label([1, 2], 4)
    ('rank 3', 'ranks 1..2')
    """
    first, last = group[0], group[-1]
    if list(group) != list(range(first, last + 1)):
        return "ranks " + ", ".join(map(str, group))
    end = str(last)
    if in_n and world > 1 and (first == 0 or first == last) and last >= world - 2:
        end = "N-1" if last == world - 1 else "N-2" if first == 0 and last > 0 else end
    return f"rank {end}" if first == last else f"ranks {first}..{end}"


def rank_formulas(derivation: Any) -> list[RankFormula] | None:
    """Every distinct data-parallel rank's peak formula (module docstring), rank 0's group first; None where the
    ranks are alike (the peak's formula is every rank's), without a number for ``N``, or for a step whose ranks'
    formulas are not given here (a traced module's; FSDP1 and FSDP x TP, whose peak formula is rank 0's)."""
    from .data_parallel import rank_peaks

    step = getattr(derivation, "step", None)
    regime = derivation.regime
    if step is None or N not in derivation.numbers or regime.tensor_parallel:
        return None
    try:
        if not rank_peaks(derivation):
            return None
        if regime.pipeline_parallel:
            return _stages(derivation, step) if hasattr(step, "at_rank") else None
        if regime.data_parallel in SHARDED and hasattr(step, "graph") and not hasattr(step, "engine"):
            return _fsdp(derivation)
        if regime.data_parallel == "zero-redundancy" and hasattr(step, "graph") and not hasattr(step, "engine"):
            return _zero(derivation)
    except SymmemError:  # no step at these numbers: the peak's views say why
        return None
    return None


def _fsdp(derivation: Any) -> list[RankFormula]:
    world = int(derivation.numbers[N])
    out = []
    for group, d in rank_derivations(derivation):
        # the Max holds where the step's assignments do (GPT-2's layers written out: L >= 4), as the peak's own
        domain = [c for c in d.step.domain() if c is not sympy.true]
        held = f"holds where {', '.join(map(str, domain))}" if domain else ""
        out.append(RankFormula(tuple(group), label(group, world), d.peak, d.peak_first_step, held, d.peak_at().total))
    return out


def _zero(derivation: Any) -> list[RankFormula]:
    """ZeRO-1's ranks (those that own parameters of the same shapes step alike: one :class:`~symmem.peak.Peak`)."""
    from .zero_redundancy import partition_at

    found = derivation._peak(exact=True)
    world = int(derivation.numbers[N])
    at = partition_at(derivation) or {}
    held = "at " + ", ".join(f"{k} = {v:,}" for k, v in at.items()) if at else ""
    groups: dict[int, list[int]] = {}
    peaks = {}
    for r, p in found.per_rank.items():
        groups.setdefault(id(p), []).append(r)
        peaks[id(p)] = p
    return [RankFormula(tuple(g), label(g, world, in_n=False), peaks[k].formula("steady"), peaks[k].formula("first"),
                        held, peaks[k].at(derivation.numbers, "steady").total)
            for k, g in groups.items()]


def _stages(derivation: Any, step: Any) -> list[RankFormula]:
    """A p x N mesh (DDP / ZeRO-1 / FSDP2 on every stage): per stage, per group of alike data-parallel ranks, the
    group's largest moment at these sizes (rank ``s*N + r``)."""
    from .data_parallel import alike_ranks

    numbers = derivation.numbers
    named = {s.name: int(v) for s, v in numbers.items()}
    world = named["N"]
    groups = step._alike(named) if hasattr(step, "_alike") else alike_ranks(step._firsts(derivation), world)
    zero = getattr(step, "zero", False)  # ZeRO-1's ranks: at the partition's numbers
    out = []
    for group in groups:
        mine = step.at_rank(group[0])
        # DDP's step peaks over every group of ranks (passes/ddp_pipeline.py): the group's own moments
        found = mine._rank_peak(named) if hasattr(mine, "_rank_peak") else mine.peak(numbers)
        for s in sorted({getattr(m, "stage", 0) for m in found.moments}):
            pair = []
            for which in ("steady", "first"):
                moments = [m for m in found.moments if getattr(m, "stage", 0) == s and m.step == which]
                pair.append(max(moments, key=lambda m: m.value(numbers)))
            pinned = pair[0].pinned() if hasattr(pair[0], "pinned") else ""
            out.append(RankFormula(tuple(s * world + r for r in group), f"stage {s}, {label(group, world, not zero)}",
                                   pair[0].total, pair[1].total, pinned))
    return sorted(out, key=lambda f: f.ranks)


__all__ = ["RankFormula", "label", "rank_formulas", "rank_of"]
