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

import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy

from ..conventions import Convention
from ..errors import SymmemError
from ..graph import Graph
from ..peak import Algebra, Candidate, Peak, summarize, survivors
from ..shapes import numel as shape_numel
from ..step import exact_peak
from ..symbols import N, at_least
from ..timeline import _INDEX, Event, Live, Row, Timeline, Which, checked, make_event, make_live
from ..training import ONE_RANK_DIFFERS, Regime, checkpoint_every
from . import branches as size_branches
from . import zero_redundancy
from .schedule import (
    MICRO_BATCH_PASSES,
    RuleAnswers,
    Simulation,
    optimizer_impl,
    rule_answers,
    simulate,
    state_storages,
    walk_step,
)
from .storage import Branch
from .unroll import iteration, template, unroll


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
        return (at_least(N, 2),) if self.regime.data_parallel in ONE_RANK_DIFFERS else ()

    def ranks_at_numbers(self, derivation: Any) -> tuple[bool, dict[int, tuple[int, int]] | None]:
        """Each data-parallel rank's peaks with every size a number, this step written out there without its
        formulas (:func:`symmem.passes.rank_numbers.at_numbers`)."""
        from . import rank_numbers

        return rank_numbers.at_numbers(derivation)

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        return all(bool(c.xreplace(dict(numbers))) for c in self.domain())  # as Peak.holds_at

    def domain(self) -> tuple[sympy.Basic, ...]:
        # known from the blocks, the size conditions and the engine, without the formulas: a derivation at a layer
        # count below it (L = 2 where they hold from 4) asks for it only to write the step out with that count
        assignments, conditions = self._selected(None)
        found = self._cache.get((None, conditions))
        # ZeRO-1's partition holds at the numbers it was worked out for: its domain says so (zero_redundancy)
        whole = zero_redundancy.engaged(self.regime)
        stacks = None if found is not None or whole else stacks_domain(self.graph, self.regime, self.subs)
        if stacks is None:
            return tuple(self.peak().domain)
        return stacks + conditions + self._ranks_domain()

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        """The step written out at ``at`` (every symbol a number), op by op (ops named by their template node)."""
        tl, values = self._written_out(which, at)
        return [(phase, template(node) if node else None, live) for phase, node, live in tl.rows(values)]

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        tl, values = self._written_out(which, at)
        return tl.allocated(values)

    def allocated_of_rank(self, which: Which, at: Mapping[sympy.Symbol, int], rank: int) -> int:
        """:meth:`allocated` of one data-parallel rank's step (ZeRO-1's ranks own different parameters, FSDP2's
        last shard may be smaller); :meth:`allocated` is the largest rank's."""
        tl, values = self._written_out(which, at, rank)
        return tl.allocated(values)

    def _written_out(self, which: Which, at: Mapping[sympy.Symbol, int], rank: int | None = None
                     ) -> tuple[Timeline, dict[sympy.Symbol, Any]]:
        """The step at ``at`` with every repeated block written out its full number of times, in the branch (a
        size-dependent copy) ``at`` selects, and every symbol's value (of ``rank``'s step: None, the largest
        rank's).  The peak at ``at`` first (:func:`symmem.step.exact_peak`, the one ``value("peak")`` works out,
        kept): the step refuses what the peak refuses there, with the peak's words."""
        checked(which)
        key = _written_key(at, rank)
        if self._written is not None and self._written[0] == key:
            _, (steady, first), values = self._written
        else:
            exact_peak(self, at)
            steady, first, values = self.written_at(at, rank)
            self._written = (key, (steady, first), values)
        return (first if which == "first" else steady), values

    def steady_at(self, at: Mapping[sympy.Symbol, int]) -> tuple[Timeline, dict[sympy.Symbol, Any]]:
        """The largest rank's steady step at ``at`` and every symbol's value: the views' write-out (refusing what
        the peak at ``at`` refuses, in its words), kept for them."""
        return self._written_out("steady", at)

    def counts_at(self, at: Mapping[sympy.Symbol, int]) -> dict[str, sympy.Expr]:
        """How many times each repeated block runs at ``at`` (a number where ``at`` gives its sizes)."""
        subs, full = dict(self.subs), {s: sympy.Integer(int(v)) for s, v in at.items()}
        return {name: b.count.xreplace(subs).xreplace(full) for name, b in self.graph.blocks.items()}

    def written_at(self, at: Mapping[sympy.Symbol, int], rank: int | None = None, shared: dict | None = None
                   ) -> tuple[Timeline, Timeline, dict[sympy.Symbol, Any]]:
        """(steady, first, every symbol's value): the step at ``at`` (every size a number) written out, without
        the peak (:meth:`_written_out` asks for the peak at ``at`` first, for its refusals' words).  ``shared``: a
        dict the caller keeps per ``at``, holding the unrolled graph and ZeRO-1's walks of every rank's forward
        and backward, for the next rank (passes/rank_numbers.py)."""
        subs = dict(self.subs)
        full = {s: sympy.Integer(v) for s, v in at.items()}
        counts = {}
        for name, count in self.counts_at(at).items():
            if not count.is_number:
                raise SymmemError(f"block {name!r} repeats {count} times: give it a number")
            counts[name] = int(count)
        assignments, _ = self._selected(at)
        chosen = next((b for b in assignments if b is None or all(
            bool(c.xreplace(subs).xreplace(full)) == v for c, v in b.items())), assignments[0])
        kept = {} if shared is None else shared
        if "graph" not in kept:
            kept["graph"] = unroll(self.graph, counts) if self.graph.blocks else self.graph
        options = zero_redundancy.written_options(self, full, rank)
        if shared is not None and zero_redundancy.engaged(self.regime):
            options = {**options, zero_redundancy.WALKS_OPTION: shared.setdefault("walks", {})}
        steady, first = simulate(kept["graph"], self.conv, options, self.regime, chosen,
                                 keep_logits=self.regime.keep_logits)
        values = {s: sympy.sympify(e, strict=True).xreplace(full) for s, e in subs.items()}
        return steady, first, {**values, **full}


def _written_key(at: Mapping[sympy.Symbol, int], rank: int | None) -> tuple:
    """The key of :attr:`GraphStep._written`: the numbers by name, and the rank."""
    return tuple(sorted((s.name, int(v)) for s, v in at.items())), rank


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
           interior: bool = False, ids: dict[tuple[int, Any], int] | None = None,
           together: Callable[[Live], Any] | None = None) -> dict[tuple[Any, ...], Counter | None]:
    """Each moment's key (phase, template node, layer label, occurrence) and its live storages where it is a
    candidate (:meth:`~symmem.timeline.Timeline.counts`).  ``interior``: blocks written out whole (ZeRO-1) leave
    out the forward and backward moments of their layers between the ``edge`` ones (each op's moments are affine
    in the layer there, so the largest is at an end), not the optimizer step's (each parameter's own).  ``ids``:
    the storages keyed by their number there; ``together``: storages alive at the same moments to which it gives the
    same value as one (:meth:`~symmem.timeline.Timeline.counts`)."""
    labels: dict[int, tuple[Any, ...] | None] = {}  # each event's key, None where it is left out
    named: dict[str | None, tuple[Any, str, Any]] = {}  # each node's block, label and template, worked out once
    for k, e in enumerate(tl.events):
        node = e.node
        found = named.get(node)
        if found is None:
            block = blocks_of.get(node.split("#", 1)[0]) if node and "#" in node else None
            found = named[node] = (block, _label(node if block else None, counts.get(block) if block else None,
                                                 block in symbolic, edge), template(node) if node else None)
        block, label, name = found
        if label == "mid" or (interior and block and e.phase in ("forward", "backward")
                              and edge < int(label or 0) <= counts[block] - edge):
            labels[k] = None
        else:
            labels[k] = (e.phase, name, label)
    out: dict[tuple[Any, ...], Counter | None] = {}
    seen: Counter = Counter()
    for k, live, _ in tl.counts(skip=frozenset(k for k, v in labels.items() if v is None), ids=ids,
                                together=together):
        key = labels[k]
        if key is None:
            continue
        seen[key] += 1
        out[(*key, seen[key])] = live
    return out


def _layer(storage: Live) -> int:
    """The layer a storage belongs to (0 outside repeated blocks): storages alive at the same moments are counted as
    one per layer (:meth:`~symmem.timeline.Timeline.counts`), so that a stack's weights are one storage L times -- a
    count that grows with the layers, as the formulas interpolate it -- not one sum per number of layers."""
    return _iteration(storage.name)


#: a storage's layer by its name (the walks of a peak, and both steps of each, name the same storages)
_iteration = functools.lru_cache(maxsize=65536)(iteration)


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


def _named_parts(live: Counter, others: Sequence[Counter | None], names: Sequence[Any]
                 ) -> dict[Any, tuple[int, tuple[int, ...]]]:
    """:func:`_parts` with each storage ``x`` keyed by ``names[x]`` (a candidate's (category, size)), in the same
    order: one dict a moment, where renaming :func:`_parts`' made two (an FSDP step's moments hold more storages
    than one device's, and a step has more of them)."""
    if len(others) == 1 and others[0] is not None:
        other = others[0]
        out = {names[x]: (n, (other.get(x, 0) - n,)) for x, n in live.items()}
        for x, n in other.items():
            if x not in live:
                out[names[x]] = (0, (n,))
        return out
    out = {names[x]: (n, tuple((n if o is None else o.get(x, 0)) - n for o in others)) for x, n in live.items()}
    for o in others:
        for x in o or ():
            if x not in live:
                out[names[x]] = (0, tuple(0 if p is None else p.get(x, 0) for p in others))
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


def stacks_domain(graph: Graph, regime: Regime,
                  subs: Mapping[sympy.Symbol, sympy.Expr]) -> tuple[sympy.Basic, ...] | None:
    """Where :func:`symbolic_peak`'s formulas hold in the layer counts: each symbolic stack written out ``base``
    and ``base + period`` times holds from ``base`` on, every ``period`` layers (:func:`layout`); a stack of known
    length is a number.  None where a count is neither (the peak refuses it)."""
    period, _, base = layout(regime)
    syms = []
    for b in graph.blocks.values():
        count = b.count.xreplace(dict(subs))
        if count.is_Symbol and not count.is_number:
            syms.append(count)
        elif not count.is_number:
            return None
    domain = tuple(at_least(s, base) for s in dict.fromkeys(syms))
    if period > 1:
        domain += tuple(sympy.Eq(sympy.Mod(s, period), 0) for s in dict.fromkeys(syms))
    return domain


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
    whole = zero_redundancy.engaged(regime)  # ZeRO-1 partitions every layer's parameters: written out whole
    if whole and options.get(zero_redundancy.WALKS_OPTION) is not None:
        found = _rank_peak(graph, conv, options, regime, subs, branches, merge, numbers, guards, blocks_of)
        if found is not None:
            return found
    symbolic: dict[str, sympy.Symbol] = {}
    fixed = {}
    many: dict[sympy.Symbol, int] = {}  # long stacks of known length: interpolated too, then the length put in
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
    domain = stacks_domain(graph, regime, subs)
    subs = {**dict(subs), **many}
    groups: list[tuple[list[Candidate], list[Candidate]]] = []
    # the walks key their storages by number, one numbering for all; the Candidates get (category, size number)
    # back, the algebra each size from its number (``table``): no sympy size is hashed once the walks are done
    ids: dict[tuple[int, Any], int] = {}
    table: list[sympy.Expr] = []
    # each layer count's graph is written out once for every branch; a branch whose rules answer as an earlier
    # one's did (a size condition no op's rule reads: Llama's h = G where the heads are not repeated) is the same
    # walk, and its moments the same candidates: walked, counted and built once (rule_answers)
    graphs: dict[tuple[tuple[str, int], ...], Graph] = {}
    walked: list[tuple[Graph, RuleAnswers, dict[bool, dict]]] = []
    built: dict[tuple[int, ...], tuple[list[Candidate], list[Candidate]]] = {}
    for branch in branches:
        runs: dict[tuple[str, ...], dict[bool, dict]] = {}
        for bump in [()] + [(n,) for n in names]:
            counts = {**fixed, **{n: base + (period if n in bump else 0) for n in symbolic}}
            key = tuple(sorted(counts.items()))
            if key not in graphs:
                graphs[key] = _unrolled(graph, counts, options) if blocks else graph
            g = graphs[key]
            rules = rule_answers(g, conv, options, regime, branch) if len(branches) > 1 else None
            same = next((r for h, a, r in walked if h is g and a == rules), None) if rules is not None else None
            if same is not None:
                runs[bump] = same
                continue
            both = simulate(g, conv, options, regime, branch, keep_logits=regime.keep_logits, rules=rules)
            runs[bump] = {first: _keyed(tl, counts, blocks_of, symbolic, edge, whole, ids, together=_layer)
                          for first, tl in zip((False, True), both, strict=True)}
            if rules is not None:
                walked.append((g, rules, runs[bump]))
        again = tuple(id(r) for r in runs.values())
        if again in built:
            groups.append(built[again])
            continue
        pairs = _numbered(ids, table)
        found = []
        for first in (False, True):
            cands = []
            for key, live in runs[()][first].items():
                if live is None:
                    continue
                others = [runs[(n,)][first].get(key) for n in names]
                cands.append(Candidate(key, "first" if first else "steady",
                                       _named_parts(live, others, pairs)))
            found.append(cands)
        groups.append((found[0], found[1]))
        built[again] = groups[-1]
    # lazy: a Piecewise over branches is built when first asked for (a peak read at numbers needs none)
    return summarize(groups, lambda k: k.key[:3], subs, syms, numbers, domain, base=base, period=period,
                     merge=merge, guards=guards, lazy=True, table=table)


def _numbered(ids: Mapping[tuple[int, Any], int], table: list[sympy.Expr]) -> list[tuple[int, int]]:
    """Each (category, size) of ``ids`` (in its numbering) as (category, the size's number in ``table``), the
    sizes met for the first time appended to ``table``.

    >>> B = sympy.Symbol("B")
    >>> table = [4 * B]
    >>> _numbered({(0, 8 * B): 0, (3, 4 * B): 1, (4, 8 * B): 2}, table), table
    ([(0, 1), (3, 0), (4, 1)], [4*B, 8*B])
    """
    number = {size: i for i, size in enumerate(table)}
    out = []
    for category, size in ids:
        found = number.get(size)
        if found is None:
            found = number[size] = len(table)
            table.append(size)
        out.append((category, found))
    return out


def _rank_peak(graph: Graph, conv: Convention, options: Mapping[str, Any], regime: Regime,
               subs: Mapping[sympy.Symbol, sympy.Expr], branches: Sequence[Branch | None],
               merge: Callable[[list[sympy.Expr]], sympy.Expr] | None, numbers: Mapping[sympy.Symbol, int] | None,
               guards: Sequence[sympy.Basic], blocks_of: Mapping[str, str]) -> Peak | None:
    """One ZeRO-1 rank's peak with its blocks written out whole (what :func:`symbolic_peak` gives), without writing
    them out: the forward and backward are every rank's (walked once, shared through the step's walks), and each
    block's layers there are one device's -- the step is walked with each block written out ``base`` and
    ``base + 1`` times and every moment's storages interpolated to the block's length, the moments of the layers
    between the first and last two left out as the whole walk leaves them out.  The rank's own part -- its
    optimizer state, alive through a steady step, and its optimizer step over the whole parameters it owns -- is
    walked on its own, from the storages alive when the backward ends.  Checkpointing too (the recomputations are
    every rank's; under every-K the blocks are written out ``base`` and ``base + K`` long, as :func:`symbolic_peak`
    writes them): the same formulas and per-rank values as a whole walk per rank (Llama-2-7B at N = 8: full
    checkpointing 4.65M -> 0.91M function calls, one device with it 0.68M; every-4 5.53M -> 1.40M, one device
    1.17M).  None where this does not apply (a block shorter than ``base``, or not ``base`` plus whole periods)."""
    period, edge, base = layout(regime)
    counts = {name: b.count.xreplace(dict(subs)) for name, b in graph.blocks.items()}
    if not (regime.checkpoint in ("none", "full", "selective") or regime.checkpoint.startswith("every-")) or not all(
            c.is_number and int(c) >= base and (int(c) - base) % period == 0 for c in counts.values()):
        return None
    counts = {name: int(c) for name, c in counts.items()}
    symbolic = {name: sympy.Dummy(f"n_{name}", positive=True, integer=True) for name in counts}
    names = list(symbolic)
    walks = options[zero_redundancy.WALKS_OPTION]
    mine = _rank_step(graph, options, regime, counts, blocks_of, edge)
    many = {symbolic[n]: counts[n] for n in names}
    sub, syms = {**dict(subs), **many}, [symbolic[n] for n in names]
    at = {**numbers, **many} if numbers else numbers
    # the rank's own storages: those of its state and of its moments (numbered per step: _rank_step)
    met = {first: set().union(*(c for c in mine[first].values() if c)) for first in (False, True)}
    own = [*mine["states"], *(p for first in (False, True) for i, p in enumerate(mine[("pairs", first)])
                              if i in met[first])]
    known = walks.setdefault(("bytes",), {})  # sizes the ranks share, worked out once
    for _, x in own:
        if x not in known:
            known[x] = _bytes(x, sub)
    sizes = {x: known[x] for _, x in own}  # the rank's own storages: numbers, or None
    groups: list[tuple[list[Candidate], list[Candidate]]] = []
    offsets: list[list[Any]] = []  # what each moment is: a shared one plus bytes (passes/zero_redundancy.py)
    branch_keys = [("shared", None if b is None else tuple(sorted((str(c), v) for c, v in b.items())))
                   for b in branches]
    # the branches walked so far with the convention's answers they got (one walk where two get the same)
    answered = walks.setdefault(("answered",), []) if len(branches) > 1 else None
    for key, branch in zip(branch_keys, branches, strict=True):
        if key not in walks:
            walks[key] = _shared(graph, conv, options, regime, branch, blocks_of, symbolic, base, edge, period,
                                 answered)
    # one algebra for every rank and branch, as one summarize holds (each rank's own sizes, numbers, taken in)
    akey = ("algebra", *branch_keys)
    if akey not in walks:
        walks[akey] = Algebra(list(dict.fromkeys(x for key in branch_keys for parts in
                                                 [*walks[key][0].values(), walks[key][1]] for _, x in parts)),
                              sub, syms, base, period)
    for key in branch_keys:
        moments, end = walks[key]
        if ("kept", key) not in walks:
            # a branch walked as an earlier one (_shared) keeps what it keeps
            walks[("kept", key)] = next((walks[("kept", k)] for k in branch_keys if k != key and walks[k] is
                                         walks[key] and ("kept", k) in walks), None) or _dominant(moments, end,
                                                                                                  walks[akey], at)
        kept = walks[("kept", key)] if all(isinstance(v, int) for v in sizes.values()) else None
        shared = []
        for (phase, node, label, seen), parts in moments.items():
            if kept is not None and (phase, node, label, seen) not in kept.totals:
                continue
            key_label = label
            block = blocks_of.get(node) if len(names) > 1 else names[0] if names else None
            if label.startswith("L"):
                if block is None:
                    return None
                label = str(counts[block] + int(label[1:] or 0))  # L-1 -> 31 of 32
            shared.append(((phase, node, label, seen), (phase, node, key_label, seen), parts))
        found = []
        for first in (False, True):
            step = "first" if first else "steady"
            states = Counter() if first else mine["states"]
            extra = sum(n * sizes[x] for (_, x), n in states.items()) if kept is not None else 0
            where = [(("shared", key, k0), extra) for _, k0, _ in shared]
            own_moments = [(k, live) for k, live in mine[first].items() if live is not None]
            chosen: Sequence[int] = range(len(shared) + len(own_moments))
            pairs = mine[("pairs", first)]
            if kept is not None:
                # the rank's own moments differ by numbers only (the storages alive when the backward ended are
                # in each): the prune keeps the largest, the first of equals
                by_id = [sizes.get(x, 0) for _, x in pairs]  # each numbered storage's bytes (unmet ones: none)
                sized = [sum([n * by_id[i] for i, n in live.items()]) for _, live in own_moments]
                own_moments = [own_moments[sized.index(max(sized))]]
                where.append((("end", key), max(sized)))
                chosen = kept.prune([k0 for _, k0, _ in shared], extra, max(sized))
                where = [where[i] for i in chosen]
            own_moments = [(k, _pairs(live, pairs)) for k, live in own_moments]
            # the candidates the prune keeps only (each shared one with the rank's state is a copy of its parts)
            ns, nn = len(shared), len(names)
            cands = [Candidate(shared[i][0], step, shared[i][2] if first else _plus(shared[i][2], states, nn))
                     if i < ns else Candidate(own_moments[i - ns][0], step, _plus(end, own_moments[i - ns][1], nn))
                     for i in chosen]
            found.append(cands)
            offsets.append(where if kept is not None else [])
        groups.append((found[0], found[1]))
    pruned = all(offsets)
    alg = walks[akey] if pruned else None
    # the candidates' sizes not shared are the rank's own (its state's, its moments'): those taken in
    if alg is not None and not alg.extend(list(sizes)):
        alg = None
    peak = summarize(groups, lambda k: k.key[:3], sub, syms, at, (), base=base, period=period, merge=merge,
                     guards=guards, lazy=True, pruned=pruned, algebra=alg)
    if pruned:
        for m, offset in zip(peak.moments, (o for each in offsets for o in each), strict=True):
            object.__setattr__(m, "offset", offset)
    return peak


def _dominant(moments: Mapping[tuple[Any, ...], dict], end: dict, alg: Algebra,
              numbers: Mapping[sympy.Symbol, int] | None) -> _Shared | None:
    """The shared forward and backward moments no other of them exceeds, as :func:`symmem.peak.prune` keeps them
    (largest first at the numbers, the first of equals): every rank adds the same storages to all of them (its
    optimizer state, numbers), so a moment another exceeds here is exceeded in every rank's step, and pruning the
    rest with the rank's own moments keeps what pruning all of them keeps.  None where that does not hold: a
    value unknown at the numbers (no order), or the moments' sizes in fewer than two symbols (the prune then
    takes the upper envelope, which the left-out moments take part in)."""
    if not numbers:
        return None
    cands = [Candidate(key, "first", parts) for key, parts in moments.items()]
    ended = Candidate(("end",), "first", end)
    memo = alg.memo(numbers)
    values = [alg.value(c, numbers, memo) for c in [*cands, ended]]
    if any(v is None for v in values):
        return None
    order = sorted(range(len(cands)), key=lambda i: -values[i])  # type: ignore[operator]
    totals = [alg.total(c) for c in cands]
    kept = survivors(order, totals)

    def bases(ids: list[int]) -> set[Any]:
        return {b for i in ids for m in totals[i] for b, _ in alg.monomials[m]}

    every = bases(list(range(len(cands))))
    if len(every) < 2 or bases(kept) != every:
        return None
    kept = sorted(kept)
    return _Shared({cands[i].key: totals[i] for i in kept}, {cands[i].key: values[i] for i in kept},
                   alg.total(ended), values[-1], alg._id(()), alg.scale)


@dataclass(frozen=True)
class _Shared:
    """The shared moments a ZeRO-1 rank's prune compares (:func:`_dominant`): each one's bytes as
    :meth:`symmem.peak.Algebra.total` gives them (``one``: the monomial of numbers, ``scale``: the totals'
    factor) and its value at the numbers, and the same of the storages alive when the backward ends."""

    totals: dict[tuple[Any, ...], dict[int, int]]
    values: dict[tuple[Any, ...], Any]
    end: dict[int, int]
    end_value: Any
    one: int
    scale: int

    def _with(self, total: Mapping[int, int], extra: int) -> dict[int, int]:
        out = dict(total)
        x = out.get(self.one, 0) + extra * self.scale
        if x:
            out[self.one] = x
        else:
            out.pop(self.one, None)  # as Algebra.total leaves a zero out
        return out

    def prune(self, keys: list[tuple[Any, ...]], extra: int, own: int) -> list[int]:
        """:func:`symmem.peak.prune` of a rank's moments: the shared ones (``keys``, in order) with ``extra``
        bytes each, then the storages alive when the backward ended with ``own`` bytes -- the indices it keeps,
        in its order (what :func:`symmem.peak.survivors` keeps of them, ``tests/test_rank_shortcuts.py``).

        The shared moments are what :func:`survivors` kept of them (:func:`_dominant`), so none exceeds another,
        and the same bytes added to each leave it so: only the comparisons with the end's moment are made, each
        shared total with ``extra`` added as it is compared (not copied once per rank)."""
        n = len(keys)
        values = [self.values[k] + extra for k in keys] + [self.end_value + own]
        end, shift, one = self._with(self.end, own), extra * self.scale, self.one
        kept: list[int] = []
        end_kept = False
        for i in sorted(range(n + 1), key=lambda i: -values[i]):
            if i == n:
                if any(_covers(self.totals[keys[k]], shift, one, end) for k in kept):
                    continue  # below a kept one
                kept = [k for k in kept if not _covered(end, self.totals[keys[k]], shift, one)] + [n]
                end_kept = True
                continue
            if end_kept:
                total = self.totals[keys[i]]
                if _covered(end, total, shift, one):
                    continue
                if _covers(total, shift, one, end):
                    kept.remove(n)
                    end_kept = False
            kept.append(i)
        return kept


def _covers(a: Mapping[int, int], shift: int, one: int, b: Mapping[int, int]) -> bool:
    """``a`` with ``shift`` added to its monomial ``one`` is at least ``b``, every coefficient
    (:func:`symmem.peak._at_least`)."""
    get = a.get
    for m, v in b.items():
        if get(m, 0) + (shift if m == one else 0) < v:
            return False
    return True


def _covered(b: Mapping[int, int], a: Mapping[int, int], shift: int, one: int) -> bool:
    """``b`` is at least ``a`` with ``shift`` added to its monomial ``one`` (a zero there left out, as
    :meth:`_Shared._with` leaves it), every coefficient."""
    get = b.get
    for m, v in a.items():
        if m == one:
            v += shift
            if not v:
                continue
        if get(m, 0) < v:
            return False
    if one not in a and shift and get(one, 0) < shift:
        return False
    return True


def _bytes(size: sympy.Expr, subs: Mapping[sympy.Symbol, Any]) -> int | None:
    """``size`` at ``subs`` where it is a whole number, else None."""
    v = sympy.sympify(size, strict=True).xreplace(dict(subs))
    return int(v) if v.is_Integer else None


def _plus(parts: Mapping[Any, tuple[int, tuple[int, ...]]], live: Counter, n: int
          ) -> dict[Any, tuple[int, tuple[int, ...]]]:
    """A moment's parts (:func:`_parts`) with storages ``live`` added, the same at every layer count."""
    out = dict(parts)
    for x, k in live.items():
        k0, ds = out.get(x, (0, (0,) * n))
        out[x] = (k0 + k, ds)
    return out


def _shared(graph: Graph, conv: Convention, options: Mapping[str, Any], regime: Regime, branch: Branch | None,
            blocks_of: Mapping[str, str], symbolic: Mapping[str, sympy.Symbol], base: int, edge: int,
            period: int = 1, answered: list[tuple[list[Any], Any]] | None = None
            ) -> tuple[dict[tuple[Any, ...], dict], dict]:
    """Every ZeRO-1 rank's forward and backward moments (the first step's: no optimizer state yet), keyed as one
    device's (layers ``1``, ``2``, ``L-1``, ``L``), as parts interpolated in the blocks' lengths; and the storages
    alive when the backward ends, the same way.  ``answered`` (where there are several branches): the walks of
    earlier branches with the convention's answers their graphs got (:func:`rule_answers`): a branch whose answers
    are an earlier one's is that walk (as :func:`symbolic_peak` walks it once: Llama's ``G = h`` where no op's
    rule reads it), not walked again; this one's added."""
    names = list(symbolic)
    bumps = [()] + [(n,) for n in names]
    graphs = {bump: _unrolled(graph, {n: base + (period if n in bump else 0) for n in names}, options)
              for bump in bumps}
    rules: dict[tuple[str, ...], Any] = {}
    if answered is not None:
        rules = {bump: rule_answers(graphs[bump], conv, options, regime, branch) for bump in bumps}
        if all(r is not None for r in rules.values()):
            asked = [rules[bump] for bump in bumps]
            same = next((found for earlier, found in answered if earlier == asked), None)
            if same is not None:
                return same
        else:
            answered = None  # a rule refuses an op: walked on its own, as the walk says where it asks
    runs, ends = {}, {}
    ids: dict[tuple[int, Any], int] = {}  # the walks' storages by number (symbolic_peak's)
    for bump in bumps:
        counts = {n: base + (period if n in bump else 0) for n in names}
        sim = Simulation(graphs[bump], conv, options, regime, branch, regime.keep_logits, rules.get(bump))
        for _ in range(min(regime.micro_batches, MICRO_BATCH_PASSES)):
            sim.micro_batch()
        walked = len(sim.events)
        # the walk so far, without the optimizer step (each rank walks its own: _rank_step); an empty moment
        # after it keeps the backward's last op from being the step's last moment, as the step's events would
        tl = Timeline(tuple(sim.storages), tuple(sim.start), (*sim.events, Event("step", None, (), ())))
        runs[bump] = {k: v for k, v in _keyed(tl, counts, blocks_of, symbolic, edge, ids=ids).items()
                      if k[0] in ("forward", "backward")}
        # how many times each storage is alive when the backward ends, then by key: each storage's key made once
        # (Counter's update and subtract, written out: a call per event otherwise)
        net: dict[int, int] = {}
        get = net.get
        for i in tl.start:
            net[i] = get(i, 0) + 1
        for e in tl.events[:walked]:
            for i in e.born:
                net[i] = get(i, 0) + 1
            for i in e.freed:
                net[i] = get(i, 0) - 1
        live: Counter = Counter()
        storages = tl.storages
        for i, n in net.items():  # every storage touched, in order: the keys in the order the events touch them
            s = storages[i]
            live[(_INDEX[s.category], s.nbytes)] += n
        ends[bump] = +live
    pairs = list(ids)
    moments = {key: _named_parts(live, [runs[(n,)].get(key) for n in names], pairs)
               for key, live in runs[()].items() if live is not None}
    out = moments, _parts(ends[()], [ends[(n,)] for n in names])
    if answered is not None:
        answered.append(([rules[bump] for bump in bumps], out))
    return out


def _pairs(live: Counter, pairs: Sequence[tuple[int, Any]]) -> Counter:
    """A moment of :func:`_rank_step` (storages by number) as (category, size) pairs, in the order a walk without
    numbers lists them: the order each was first met (its number; the step's storages are born as they are
    made), not the order the numbered count, which drops an emptied storage and puts it back last, holds them."""
    return Counter({pairs[i]: live[i] for i in sorted(live)})


def _storage_key(s: Live) -> tuple[int, sympy.Expr]:
    return (_INDEX[s.category], s.nbytes)


def _rank_step(graph: Graph, options: Mapping[str, Any], regime: Regime, counts: Mapping[str, int],
               blocks_of: Mapping[str, str], edge: int) -> dict[Any, Any]:
    """A ZeRO-1 rank's own part of the step, with the blocks ``counts`` long: its optimizer state (``states``), and
    the moments of its optimizer step and zero_grad (``False``: a steady step's, ``True``: the first's) as the
    storages alive there besides those alive when the backward ended."""
    walks = options[zero_redundancy.WALKS_OPTION]
    key = ("listed", tuple(sorted(counts.items())))
    if key not in walks:
        walks[key] = zero_redundancy.listed_whole(graph, counts)
    if ("partition", key) in walks:  # worked out once for every rank (zero_redundancy.ranks_peak)
        owned = [walks[key][i] for i in walks[("partition", key)][int(options[zero_redundancy.RANK_OPTION])]]
    else:
        owned = zero_redundancy.owned(regime, walks[key], options) or []
    device = str(options.get("device", "cpu"))
    impl = optimizer_impl(regime, device)
    on_host = device == "cuda" and impl != "fused"
    # each shape's state storages (named "" here: ".exp_avg", ...) and elements, worked out once for every rank
    # (a stack's layers own the same few shapes), each parameter's named as state_storages names them
    by_shape = walks.setdefault(("state", on_host), {})
    lives: list[Live] = []
    state_ids: dict[str, list[int]] = {}
    numel: dict[str, sympy.Expr] = {}
    for name, shape in owned:
        found = by_shape.get(shape)
        if found is None:
            found = by_shape[shape] = (state_storages(regime, "", shape, on_host), shape_numel(shape))
        state_ids[name] = list(range(len(lives), len(lives) + len(found[0])))
        lives += [make_live(name + suffix, *rest) for suffix, *rest in found[0]]
        numel[name] = found[1]
    states = list(range(len(lives)))
    out: dict[Any, Any] = {}
    for first in (False, True):
        sim = _Steps()
        sim.storages = list(lives)  # the state, the same storages in both steps (the first creates it)
        walk_step(sim, regime, impl, owned, numel, state_ids, first)
        sim.event("zero_grad", None, [], [])
        tl = Timeline(tuple(sim.storages), () if first else tuple(states), tuple(sim.events))
        # the moments' storages by number (each (category, size) its own, in the order the walk first meets it):
        # a rank's moments are summed without hashing a sympy size (_rank_peak; _pairs turns one back)
        ids: dict[tuple[int, Any], int] = {}
        out[first] = _keyed(tl, counts, blocks_of, {}, edge, True, ids=ids)
        out[("pairs", first)] = list(ids)
        if not first:
            out["states"] = Counter(_storage_key(sim.storages[i]) for i in states)
    return out


class _Steps:
    """The storages and events of an optimizer step walked on its own (:func:`~symmem.passes.schedule.walk_step`)."""

    def __init__(self) -> None:
        self.storages: list[Live] = []
        self.events: list[Event] = []

    def new(self, name: str, category: str, nbytes: sympy.Expr, node: str | None = None, host: bool = False) -> int:
        self.storages.append(make_live(name, category, nbytes, node, host))
        return len(self.storages) - 1

    def event(self, phase: str, node: str | None, born: list[int], freed: list[int]) -> None:
        self.events.append(make_event(phase, node, tuple(born), tuple(dict.fromkeys(freed))))
