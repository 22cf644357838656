"""The training step of a built graph, behind :class:`symmem.step.Step`: its peak as formulas, and its
:class:`~symmem.timeline.Timeline` at numbers.

:mod:`.schedule` gives the timeline of one step of a graph whose repeated blocks are written out a given number
of times.  A block repeated ``L`` times (``L`` a symbol) changes the live set by the same amount from one layer
to the next, so every moment's live bytes are affine in ``L`` (for ``L`` >= 4: the first two and the last two
layers are moments of their own, the layers between them repeat the second's pattern).  The step is simulated
with the block written out 4 and 5 times and each moment's live storages interpolated into a
:class:`~symmem.peak.Candidate`; :func:`symmem.peak.summarize` keeps those no other provably exceeds.  Counts that
are numbers are written out as they are.

>>> from symmem import derive
>>> d = derive("mlp", convention="pytorch", device="cpu", optimizer="sgd")
>>> d.peak_at("first").where(), d.peak_allocated("first")
('backward fc1, first step', 15374336)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy

from ..conventions import Convention
from ..errors import SymmemError
from ..graph import Graph
from ..peak import Candidate, Peak, summarize
from ..timeline import Row, Timeline, Which, checked
from ..training import ONE_RANK_DIFFERS, Regime, checkpoint_every, refuse_one_rank
from . import branches as size_branches
from . import zero_redundancy
from .schedule import simulate
from .storage import Branch
from .unroll import iteration, template, unroll

#: the world size
WORLD = sympy.Symbol("N", positive=True, integer=True)


@dataclass(eq=False)
class GraphStep:
    """The :class:`~symmem.step.Step` of a built graph under a convention and regime (``subs``: the symbols
    resolved to the kept ones; ``open_`` and ``decided``: the size conditions of views that copy for some sizes
    only).  With ``every``, the peak is one formula over every truth assignment of the open conditions; else it is
    the step of the assignment the numbers select, and its domain says where that holds.  Peaks are computed on
    first use, once per derivation and its ``at`` copies."""

    graph: Graph
    conv: Convention
    options: Mapping[str, Any]
    regime: Regime
    subs: Mapping[sympy.Symbol, sympy.Expr]
    open_: list
    decided: Mapping[sympy.Basic, bool]
    numbers: Mapping[sympy.Symbol, int]
    every: bool = True
    _cache: dict[Any, Peak] = field(default_factory=dict, repr=False)
    _all: list | None = field(default=None, repr=False)  # every truth assignment, worked out once
    #: the last step written out: (its numbers, (steady, first), the symbols' values); a view asks for both
    #: steps, their rows and their allocated peaks at the same numbers
    _written: tuple | None = field(default=None, repr=False)

    def _selected(self, at: Mapping[sympy.Symbol, int] | None) -> tuple[list, tuple]:
        """The assignments to derive, and the conditions they need (the peak's domain beyond the sizes)."""
        if self.every:
            if self._all is None:
                self._all = size_branches.assignments(self.open_, self.decided)
            return self._all, ()
        env = {s: sympy.Integer(v) for s, v in {**self.numbers, **(at or {})}.items()}
        truth = {c: bool(sympy.sympify(c, strict=True).xreplace(dict(self.subs)).xreplace(env)) for c in self.open_}
        return [{**dict(self.decided), **truth}], tuple(c if v else sympy.Not(c) for c, v in truth.items())

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None) -> Peak:
        """The peak as formulas; ``at``: numbers for the layer counts, where they lie outside the symbolic
        formula's domain."""
        if zero_redundancy.every_rank(self):  # ZeRO-1: the largest rank's, each rank's step its own
            return zero_redundancy.ranks_peak(self, at)
        assignments, conditions = self._selected(at)
        key = (None if at is None else tuple(sorted((s.name, v) for s, v in at.items())), conditions)
        if key not in self._cache:
            fixed = dict(self.subs)
            if at is not None:
                fixed.update({s: sympy.Integer(v) for s, v in at.items()})
            join, guards = None, ()
            if len(assignments) > 1:
                join = size_branches.joiner(self.open_, assignments)
                guards = tuple(size_branches.guards(self.open_, assignments))
            found = symbolic_peak(self.graph, self.conv, self.options, self.regime, fixed, assignments, join,
                                  self.numbers, guards)
            found.domain = tuple(found.domain) + conditions + self._ranks_domain()
            self._cache[key] = found
        return self._cache[key]

    def _ranks_domain(self) -> tuple[sympy.Basic, ...]:
        """FSDP's steps hold for N >= 2: on one rank the engines skip their collectives."""
        return (sympy.Ge(WORLD, 2),) if self.regime.data_parallel in ONE_RANK_DIFFERS else ()

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        refuse_one_rank(self.regime.data_parallel, numbers)
        return self.peak().holds_at(numbers)

    def domain(self) -> tuple[sympy.Basic, ...]:
        return tuple(self.peak().domain)

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        """The step written out at ``at`` (every symbol a number), op by op (ops named by their template node)."""
        tl, values = self._written_out(which, at)
        return [(phase, template(node) if node else None, live) for phase, node, live in tl.rows(values)]

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        tl, values = self._written_out(which, at)
        return tl.allocated(values)

    def _written_out(self, which: Which, at: Mapping[sympy.Symbol, int]
                     ) -> tuple[Timeline, dict[sympy.Symbol, Any]]:
        """The step at ``at`` with every repeated block written out its full number of times, in the branch (a
        size-dependent copy) ``at`` selects, and every symbol's value.  The symbolic peak first: the step refuses
        what the peak refuses, with the peak's words."""
        checked(which)
        refuse_one_rank(self.regime.data_parallel, at)
        key = tuple(sorted((s.name, int(v)) for s, v in at.items()))
        if self._written is not None and self._written[0] == key:
            _, (steady, first), values = self._written
            return (first if which == "first" else steady), values
        self.peak()
        assignments, _ = self._selected(at)
        subs = self.subs
        full = {s: sympy.Integer(v) for s, v in at.items()}
        counts = {}
        for name, b in self.graph.blocks.items():
            count = b.count.xreplace(dict(subs)).xreplace(full)
            if not count.is_number:
                raise SymmemError(f"block {name!r} repeats {count} times: give it a number")
            counts[name] = int(count)
        chosen = next((b for b in assignments if b is None or all(
            bool(c.xreplace(dict(subs)).xreplace(full)) == v for c, v in b.items())), assignments[0])
        g = unroll(self.graph, counts) if self.graph.blocks else self.graph
        options = zero_redundancy.written_options(self, full)
        steady, first = simulate(g, self.conv, options, self.regime, chosen, keep_logits=self.regime.keep_logits)
        values = {s: sympy.sympify(e, strict=True).xreplace(full) for s, e in subs.items()}
        self._written = (key, (steady, first), {**values, **full})
        return (first if which == "first" else steady), self._written[2]


def _label(name: str | None, count: int | None, symbolic: bool, edge: int) -> str:
    """The layer of an unrolled node: its number for a block repeated a number of times; for a symbolic count,
    the first ``edge`` layers by number and the last ``edge`` as ``L``, ``L-1`` ..., and ``mid`` for the layers
    in between (their moments repeat those of the layers ``edge`` before)."""
    k = iteration(name) if name else 0
    if not k or count is None or count == 1:
        return ""
    if not symbolic or k <= edge:
        return str(k)
    if k > count - edge:
        return "L" if k == count else f"L-{count - k}"
    return "mid"


def layout(regime: Regime) -> tuple[int, int, int]:
    """(period, edge, base): the step repeats every ``period`` layers (K with every-K checkpointing, else 1);
    ``edge`` layers at each end of a stack are moments of their own; a symbolic stack is written out ``base``
    and ``base + period`` times, and the formulas hold for counts ``base + j * period``."""
    period = (checkpoint_every(regime.checkpoint) or 1) if regime.checkpoint.startswith("every-") else 1
    edge = max(2, period)
    base = -(-2 * edge // period) * period
    return period, edge, base


def _keyed(tl: Timeline, counts: Mapping[str, int], blocks_of: Mapping[str, str], symbolic: Any, edge: int,
           interior: bool = False) -> dict[tuple[Any, ...], Counter | None]:
    """Each moment's key (phase, template node, layer label, occurrence) and its live storages where it is a
    candidate (:meth:`~symmem.timeline.Timeline.counts`).  ``interior``: blocks written out whole (ZeRO-1) leave
    out the forward and backward moments of their layers between the ``edge`` ones (each op's moments are affine
    in the layer there, so the largest is at an end), not the optimizer step's (each parameter's own)."""
    labels: dict[int, tuple[Any, ...] | None] = {}  # each event's key, None where it is left out
    for k, e in enumerate(tl.events):
        node = e.node
        block = blocks_of.get(node.split("#", 1)[0]) if node and "#" in node else None
        label = _label(node if block else None, counts.get(block) if block else None, block in symbolic, edge)
        if label == "mid" or (interior and block and e.phase in ("forward", "backward")
                              and edge < int(label or 0) <= counts[block] - edge):
            labels[k] = None
        else:
            labels[k] = (e.phase, template(node) if node else None, label)
    out: dict[tuple[Any, ...], Counter | None] = {}
    seen: Counter = Counter()
    for k, live, _ in tl.counts(skip=frozenset(k for k, v in labels.items() if v is None)):
        key = labels[k]
        if key is None:
            continue
        seen[key] += 1
        out[(*key, seen[key])] = live
    return out


def _parts(live: Counter, others: Sequence[Counter | None]) -> dict[Any, tuple[int, tuple[int, ...]]]:
    """A moment's live storages at the base counts (``live``) and with one more layer of each symbolic count
    (``others``; None where the moment is not one there): per storage, (count, change per layer of each)."""
    if len(others) == 1 and others[0] is not None:  # one symbolic count: most models, most of the time
        other = others[0]
        out = {x: (n, (other.get(x, 0) - n,)) for x, n in live.items()}
        for x, n in other.items():
            if x not in out:
                out[x] = (0, (n,))
        return out
    out = {x: (n, tuple((n if o is None else o.get(x, 0)) - n for o in others)) for x, n in live.items()}
    for o in others:
        for x in o or ():
            if x not in out:
                out[x] = (0, tuple(0 if p is None else p.get(x, 0) for p in others))
    return out


def _unrolled(graph: Graph, counts: Mapping[str, int], options: Mapping[str, Any]) -> Graph:
    """``unroll(graph, counts)``, written out once for all of ZeRO-1's ranks (their shared walks hold it)."""
    walks = options.get(zero_redundancy.WALKS_OPTION)
    if walks is None:
        return unroll(graph, counts)
    key = ("unrolled", id(graph), tuple(sorted(counts.items())))
    if key not in walks:
        walks[key] = unroll(graph, counts)
    return walks[key]


def symbolic_peak(graph: Graph, conv: Convention, options: Mapping[str, Any], regime: Regime,
                  subs: Mapping[sympy.Symbol, sympy.Expr], branches: Sequence[Branch | None] = (None,),
                  merge: Callable[[list[sympy.Expr]], sympy.Expr] | None = None,
                  numbers: Mapping[sympy.Symbol, int] | None = None, guards: Sequence[sympy.Basic] = ()) -> Peak:
    """The steady-state and first-step peak of one training step of ``graph`` (one branch per entry of
    ``branches``; ``merge`` joins per-branch expressions into one ``Piecewise`` over ``guards``, the condition
    each branch is taken under, :func:`symmem.passes.branches.guards`)."""
    blocks = graph.blocks
    blocks_of = {m: b.name for b in blocks.values() for m in graph.program_order() if graph.node(m).block == b.name}
    period, edge, base = layout(regime)
    symbolic: dict[str, sympy.Symbol] = {}
    fixed = {}
    many: dict[sympy.Symbol, int] = {}  # long stacks of known length: interpolated too, then the length put in
    whole = zero_redundancy.engaged(regime)  # ZeRO-1 partitions every layer's parameters: written out whole
    for name, b in blocks.items():
        count = b.count.xreplace(dict(subs))
        if count.is_number and not whole and int(count) > base + period and (int(count) - base) % period == 0:
            symbolic[name] = sympy.Dummy(f"n_{name}", positive=True, integer=True)
            many[symbolic[name]] = int(count)
        elif count.is_number:
            fixed[name] = int(count)
        elif count.is_Symbol:
            symbolic[name] = count
        else:
            raise SymmemError(f"block {name!r} repeats {count} times: the peak needs a symbol or a number")
    names = list(symbolic)
    syms = [symbolic[n] for n in names]
    domain = tuple(sympy.Ge(s, base) for s in dict.fromkeys(syms) if s not in many)
    if period > 1:
        domain += tuple(sympy.Eq(sympy.Mod(s, period), 0) for s in dict.fromkeys(syms) if s not in many)
    subs = {**dict(subs), **many}
    groups: list[tuple[list[Candidate], list[Candidate]]] = []
    for branch in branches:
        runs: dict[tuple[str, ...], dict[bool, dict]] = {}
        for bump in [()] + [(n,) for n in names]:
            counts = {**fixed, **{n: base + (period if n in bump else 0) for n in symbolic}}
            g = _unrolled(graph, counts, options) if blocks else graph
            both = simulate(g, conv, options, regime, branch, keep_logits=regime.keep_logits)
            runs[bump] = {first: _keyed(tl, counts, blocks_of, symbolic, edge, whole)
                          for first, tl in zip((False, True), both, strict=True)}
        found = []
        for first in (False, True):
            cands = []
            for key, live in runs[()][first].items():
                if live is None:
                    continue
                others = [runs[(n,)][first].get(key) for n in names]
                cands.append(Candidate(key, "first" if first else "steady", _parts(live, others)))
            found.append(cands)
        groups.append((found[0], found[1]))
    return summarize(groups, lambda k: k.key[:3], subs, syms, numbers, domain, base=base, period=period,
                     merge=merge, guards=guards)
