"""The peak of a traced module's training step, as a formula: the ``Max`` over the step's moments.

A :class:`~symmem.importer.recording.StepRecord` gives one first and one steady training step as
:class:`~symmem.timeline.Timeline` values, their bytes in the declared symbols.  The candidate moments are the
ops after which something is freed (and the last of each step): between two of them memory only grows.  Moments
another provably exceeds are dropped by the one peak algebra (:func:`symmem.peak.summarize`: every coefficient
of the difference ≥ 0 once each symbol is written ``x' + 1``; one symbol: the upper envelope), and the peak is
the ``Max`` of the rest -- :class:`symmem.peak.Peak`, what the zoo's derivations return.

Repeated blocks: the step is recorded with the run of identical children written out 4, 5 and 6 times
(:func:`symmem.importer.wrap.with_layers`).  Ops are matched across the records by (phase, module or parameter
with the child index replaced, which layer: ``1``, ``2``, ``L-1``, ``L`` or one in the middle, aten op,
occurrence); the moments of the middle layers repeat those of the second (their live bytes are those of
layer 2 plus a whole number of layers, so an end layer exceeds them).  Each moment's live storages are
interpolated from 4 and 5 layers -- a count per byte size, ``n(L) = n₄ + (n₅ - n₄)(L - 4)`` -- and the
interpolation must give the record at 6 layers exactly, else the peak is given at the module's own layer
count only (and a note says so).  The formulas hold for ``L ≥ 4``; below, the step is recorded at that count.
An op outside the blocks that runs once per layer in every record (a loop over the layers in the container's own
code: transformers' ``DynamicCache`` makes one cache layer per decoder layer) is labelled by its run like a layer.

:class:`StepPeak` is the :class:`~symmem.step.Step` a traced :class:`~symmem.derivation.Derivation` carries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy

from ..errors import SymmemError
from ..peak import BASE, Candidate, Peak, summarize
from ..timeline import Row, Which
from .inputs import Inputs
from .recording import SharedWorld, StepOp, StepOptions, StepRecord, record_step
from .step_cache import Chain, recorded, step_key

#: candidate moments with the same live storages are given to the peak algebra once (False: all, for comparisons)
DISTINCT = True

#: layer counts the repeated blocks are written out at: interpolated from the first two, checked at the third
COUNTS = (4, 5, 6)
EDGE = 2


def _label(k: int | None, count: int | None) -> str:
    """The layer of child ``k`` (0-based) of a run of ``count``: ``1``, ``2``, ``L-1``, ``L`` or ``mid``."""
    if k is None or count is None:
        return ""
    if k < EDGE:
        return str(k + 1)
    if k >= count - EDGE:
        return "L" if k == count - 1 else f"L-{count - 1 - k}"
    return "mid"


def _locate(o: StepOp, layers: Mapping[str, int] | None) -> tuple[str, int | None]:
    """Where op ``o`` ran (the module in the forward and backward, the parameter in the optimizer step), with the
    child of the repeated blocks written ``#``, and that child's index in the run."""
    place = o.module if o.phase == "backward" else o.where
    for child, k in (layers or {}).items():
        if place == child or place.startswith(child + "."):
            container = child.rsplit(".", 1)[0] if "." in child else ""
            return f"{container}.#{place[len(child):]}" if container else f"#{place[len(child):]}", k
    return place, None


def _node(o: StepOp, place: str) -> str:
    """How a moment names its op: ``aten.mm.default in transformer.h.#.mlp`` (backward: with the autograd node)."""
    if o.phase == "backward" and o.where:
        return f"{o.op} ({o.where}) in {place or 'the loss'}"
    return f"{o.op} in {place or 'the module'}" if o.phase != "step" else f"{o.op} on {place or 'all parameters'}"


def _bases(record: StepRecord, step: Which) -> Counter:
    """How many times each op of ``step`` runs outside the repeated blocks, by (phase, place, op)."""
    out: Counter = Counter()
    # every moment of the step (the events it shows); their live storages are not needed
    for o, e in zip(record.ops, record.as_timeline(step).events, strict=True):
        if not e.moment:
            continue
        place, index = _locate(o, record.layers)
        if index is None:
            out[(o.phase, place, o.op)] += 1
    return out


def _per_layer(records: list[StepRecord], step: Which) -> set[tuple[str, str, str]]:
    """The ops outside the repeated blocks that run once per layer in every record: a loop over the layers in the
    container's own code (transformers' ``DynamicCache`` makes one cache layer, and for a sliding window one tensor,
    per decoder layer before the first runs).  Their runs are labelled like layers (:func:`_label`)."""
    totals = [_bases(r, step) for r in records]
    return {b for b in totals[0] if all(t[b] == r.count for t, r in zip(totals, records, strict=True))}


def _keyed(record: StepRecord, step: Which, per_layer: set[tuple[str, str, str]] | frozenset[Any] = frozenset(),
           every: bool = True) -> dict[tuple[Any, ...], tuple[StepOp, Counter | None, bool, str]]:
    """Every op of ``step`` outside the middle layers, by a key that names the same op at another layer count, with
    its live storages (a Counter of (category index, bytes); without ``every``, for candidates only, else None) and
    whether it is a candidate.  An op outside the blocks that runs once per layer (``per_layer``) is labelled by its
    run like a layer; its middle runs are left out."""
    out: dict[tuple[Any, ...], tuple[StepOp, Counter, bool, str]] = {}
    seen: Counter = Counter()
    runs: Counter = Counter()
    labels: dict[int, tuple[str, str]] = {}
    for k, o in enumerate(record.ops):
        place, index = _locate(o, record.layers)
        if index is None and (o.phase, place, o.op) in per_layer and record.in_step(o, step):
            index = runs[(o.phase, place, o.op)]
            runs[(o.phase, place, o.op)] += 1
        labels[k] = (place, _label(index, record.count))
    # the live storages of the middle layers' moments are left out: copying them is most of the fold's time
    for k, live, candidate in record.as_timeline(step).counts(also=lambda k: every and labels[k][1] != "mid"):
        o = record.ops[k]
        place, label = labels[k]
        if label == "mid":
            continue
        base = (o.phase, place, label, o.op)
        seen[base] += 1
        out[(*base, seen[base])] = (o, live, candidate, place)
    return out


def _fill(record: StepRecord, step: Which, keyed: dict[tuple[Any, ...], tuple[StepOp, Counter | None, bool, str]],
          wanted: set[tuple[Any, ...]]) -> None:
    """Give the moments of ``wanted`` in ``keyed`` (from :func:`_keyed` without ``every``) their live storages."""
    missing = {keyed[key][0].index: key for key in wanted if keyed[key][1] is None}
    if not missing:
        return
    for k, live, _ in record.as_timeline(step).counts(also=missing.__contains__):
        if k in missing:
            o, _, candidate, place = keyed[missing[k]]
            keyed[missing[k]] = (o, live, candidate, place)


def _peak(cands: dict[str, list[Candidate]], syms: list[sympy.Symbol], subs: Mapping[sympy.Symbol, Any],
          numbers: Mapping[sympy.Symbol, int] | None, domain: tuple[Any, ...], names: Mapping[Any, tuple[str, str]]
          ) -> Peak:
    """The first and steady steps' candidates as a :class:`~symmem.peak.Peak` (each ``Max`` built when asked
    for)."""
    return summarize([(_distinct(cands["steady"]), _distinct(cands["first"]))],
                     lambda k: (k.key[0], *names[(k.step, k.key)]), subs, syms, numbers, domain, base=BASE)


def _distinct(cands: list[Candidate]) -> list[Candidate]:
    """The first candidate of each set of live storages: the peak algebra keeps the first of equal candidates
    (:func:`symmem.peak.prune`), so a later one with the same storages can only be dropped.  The optimizer step's
    moments repeat one set (every parameter's temporaries freed, the rest alike): about half of a step's."""
    if not DISTINCT:
        return cands
    seen: set[frozenset[Any]] = set()
    out = []
    for c in cands:
        key = frozenset(c.parts.items())
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def peak_of(record: StepRecord, *, subs: Mapping[sympy.Symbol, Any] | None = None,
            numbers: Mapping[sympy.Symbol, int] | None = None, domain: tuple[Any, ...] = (),
            layers: Mapping[str, int] | None = None) -> Peak:
    """The peak of one recorded step (sizes symbolic, the layer count a number): a :class:`symmem.peak.Peak`.
    ``layers`` (child path -> index) names the layer of each moment."""
    cands: dict[str, list[Candidate]] = {"steady": [], "first": []}
    names: dict[Any, tuple[str, str]] = {}
    for step in ("steady", "first"):
        seen: set[frozenset[Any]] = set()
        for k, live, candidate in record.as_timeline(step).counts():
            if not candidate:
                continue
            if DISTINCT:
                same = frozenset(live.items())
                if same in seen:  # a later moment with the same storages (see _distinct)
                    continue
                seen.add(same)
            o = record.ops[k]
            place, index = _locate(o, layers if layers is not None else record.layers)
            key = (o.phase, o.index)
            cands[step].append(Candidate(key, step, {x: (n, ()) for x, n in live.items()}))
            names[(step, key)] = (_node(o, place), "" if index is None else str(index + 1))
    return _peak(cands, [], subs or {}, numbers, domain, names)


class FoldError(SymmemError):
    """The records at 4, 5 and 6 layers do not line up, or do not grow by the same amount per layer."""


def folded_peak(records: Mapping[int, StepRecord], symbol: sympy.Symbol, *,
                subs: Mapping[sympy.Symbol, Any] | None = None, numbers: Mapping[sympy.Symbol, int] | None = None,
                domain: tuple[Any, ...] = ()) -> Peak:
    """The peak in the layer count ``symbol`` from records at :data:`COUNTS` layers (interpolated from the first
    two, checked at the third); a :class:`FoldError` if they do not line up."""
    a, b, c = (records[n] for n in COUNTS)
    step_b = COUNTS[1] - COUNTS[0]
    step_c = COUNTS[2] - COUNTS[0]
    cands: dict[str, list[Candidate]] = {"steady": [], "first": []}
    names: dict[Any, tuple[str, str]] = {}
    for step in ("steady", "first"):
        per_layer = _per_layer([a, b, c], step)
        ka, kb, kc = (_keyed(r, step, per_layer, every=False) for r in (a, b, c))
        if set(ka) != set(kb) or set(ka) != set(kc):
            odd = sorted(set(ka) ^ set(kb) | set(ka) ^ set(kc), key=str)[:3]
            raise FoldError(f"the {step} step's ops differ between {COUNTS} layers (e.g. {odd})")
        # a moment that is a candidate at one layer count needs its live storages at the others too
        wanted = {key for key in ka if ka[key][2] or kb[key][2] or kc[key][2]}
        for r, kx in ((a, ka), (b, kb), (c, kc)):
            _fill(r, step, kx, wanted)
        for key, (o, la, cand_a, place) in ka.items():
            _, lb, cand_b, _ = kb[key]
            _, lc, cand_c, _ = kc[key]
            if not (cand_a or cand_b or cand_c):
                continue
            parts = {}
            for x in sorted(set(la) | set(lb) | set(lc), key=lambda x: x[0]):
                n0, d = la[x], lb[x] - la[x]
                if d % step_b or n0 + d // step_b * step_c != lc[x]:
                    raise FoldError(f"{_node(o, place)} ({step} step): {x[1]} bytes are alive {la[x]}, "
                                    f"{lb[x]}, {lc[x]} times at {COUNTS} layers: not one more set per layer")
                parts[x] = (n0, (d // step_b,))
            cands[step].append(Candidate(key, step, parts))
            names[(step, key)] = (_node(o, place), key[2])
    return _peak(cands, [symbol], subs or {}, numbers, domain, names)


@dataclass
class StepPeak:
    """The :class:`~symmem.step.Step` of a traced :class:`~symmem.derivation.Derivation`: computes the peak of the
    module's training step on first use; records are cached.

    ``repeat`` is (container, children) of the folded repeated blocks and ``symbol`` the layer count's symbol in
    the derivation (None: no fold).  ``notes`` says how the peak was found.
    """

    module: Any
    inputs: Inputs
    symbols: dict[str, sympy.Symbol]
    values: dict[str, int]
    options: StepOptions
    device: str = "cpu"
    multiple_of: dict[str, int] | None = None
    replay: list[tuple[str, Any]] | None = None
    repeat: tuple[str, tuple[str, ...]] | None = None
    symbol: sympy.Symbol | None = None
    subs: dict[sympy.Symbol, Any] = field(default_factory=dict)
    numbers: dict[sympy.Symbol, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _records: dict[tuple[Any, ...], StepRecord] = field(default_factory=dict, repr=False)
    _shared: dict[tuple[str, ...], SharedWorld] = field(default_factory=dict, repr=False)  # one fake world per ``ones``
    _peaks: dict[Any, Peak] = field(default_factory=dict, repr=False)

    @property
    def count(self) -> int | None:
        return len(self.repeat[1]) if self.repeat is not None else None

    def seed(self, world: Any) -> None:
        """Record in a trace's fake world (``Trace.extra["fake_world"]``: a weak reference to the module traced, its
        sizes, its multiples and the :class:`SharedWorld`) where that trace's module and sizes are this step's: the
        same records, each op's first occurrence computed once.  Anything else (None, another module or sizes, a
        world of a fit that another configuration's step holds: :meth:`~symmem.importer.fit_world.Lease.claim`)
        leaves the step to its own world."""
        if world is None or world[0]() is not self.module or world[1] != self.values \
                or world[2] != dict(self.multiple_of or {}):
            return
        if world[3].lease is None or world[3].lease.claim(world[3]):
            self._shared[()] = world[3]

    def record(self, count: int | None = None, ones: tuple[str, ...] = ()) -> StepRecord:
        """The step recorded with the repeated blocks written out ``count`` times (None: as the module has them)
        and the sizes in ``ones`` at 1."""
        count = self.count if count is None else count
        key = (count, ones)
        if key not in self._records and next(iter(self.module.parameters()), None) is None:
            raise SymmemError("the module has no parameter: a training step has nothing to update (an "
                              "optimizer refuses an empty parameter list), so there is no peak of one; what is kept "
                              "for backward stands")
        if key not in self._records:
            values = {n: (1 if n in ones else v) for n, v in self.values.items()}
            layers = (self.repeat[0], self.repeat[1], count) if self.repeat is not None else None
            replay = None if ones else self.replay
            multiple_of = {n: m for n, m in (self.multiple_of or {}).items() if n not in ones}
            shared = self._shared.setdefault(ones, SharedWorld())
            if shared.chain is None:  # a world the forward trace ran in (importer.traced.step_of), or a fresh one
                shared.chain = Chain(shared, ("trace" if shared.world is not None else "fresh",))

            def make(world: SharedWorld) -> StepRecord:
                return record_step(self.module, self.inputs, values, self.symbols, self.options, device=self.device,
                                   replay=replay, multiple_of=multiple_of, concrete=ones, layers=layers, shared=world)

            try:
                rec = recorded(shared.chain, step_key(self.module, self.inputs, values, self.symbols,
                                                            self.options, self.device, replay, multiple_of, ones,
                                                            layers), make)
            except SymmemError:
                raise
            except Exception as exc:  # the module's own code on fake tensors: say what failed, not a traceback
                raise cannot_run("the training step of this module", exc) from exc
            self._check(rec, ones)
            self._records[key] = rec
        return self._records[key]

    def _check(self, rec: StepRecord, ones: tuple[str, ...]) -> None:
        """Refuse a step that pinned a declared size (the formula would hold at one value)."""
        free = {self.symbols[n] for n in self.symbols if n not in ones}
        for g in rec.guards:
            expr = g.expr
            if isinstance(expr, sympy.Eq) and expr.free_symbols & free and not all(
                    isinstance(side, sympy.Symbol) for side in (expr.lhs, expr.rhs)):
                raise SymmemError(f"the training step specialized on a size ({expr}, at {g.module} {g.op}): its "
                                  "peak would hold at one value only")

    def layer_map(self) -> dict[str, int] | None:
        if self.repeat is None:
            return None
        return {c: i for i, c in enumerate(self.repeat[1])}

    def _domain(self) -> tuple[Any, ...]:
        return tuple(sympy.Ge(s, 2) for s in self.symbols.values())

    def _symbolic(self) -> Peak:
        """The peak as formulas in the declared sizes (and the layer count, where the blocks fold)."""
        if None not in self._peaks:
            found = None
            if self.repeat is not None and self.symbol is not None:
                try:
                    records = {n: self.record(n) for n in COUNTS}
                    domain = (sympy.Ge(self.symbol, COUNTS[0]), *self._domain())
                    found = folded_peak(records, self.symbol, subs=self.subs, numbers=self.numbers, domain=domain)
                    self.notes.append(f"peak: the step recorded at {', '.join(map(str, COUNTS))} layers of "
                                      f"{self.repeat[0] or 'the module'}, interpolated in {self.symbol} from the "
                                      f"first two and checked at the third (holds for {self.symbol} >= {COUNTS[0]})")
                except FoldError as e:
                    self.notes.append(f"peak: not folded to {self.symbol} ({e}); given at {self.symbol} = "
                                      f"{self.count}, the module's own layer count")
            if found is None:
                domain = self._domain()
                if self.symbol is not None and self.count is not None:
                    domain = (sympy.Eq(self.symbol, self.count), *domain)
                found = peak_of(self.record(), subs=self.subs, numbers=self.numbers, domain=domain,
                                layers=self.layer_map())
            self._peaks[None] = found
        return self._peaks[None]

    def domain(self) -> tuple[Any, ...]:
        """Where the symbolic peak holds: known before it is computed (a layer count below 4 is recorded at that
        count without folding first); once computed, its own (a fold that failed holds at the module's own layer
        count only)."""
        if None in self._peaks:
            return tuple(self._peaks[None].domain)
        domain = self._domain()
        if self.repeat is not None and self.symbol is not None:
            domain = (sympy.Ge(self.symbol, COUNTS[0]), *domain)
        return domain

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        if not all(bool(c.xreplace(dict(numbers))) for c in self.domain()):
            return False  # without computing the peak
        return self._symbolic().holds_at(numbers)

    def _at(self, at: Mapping[sympy.Symbol, int]) -> tuple[StepRecord, Any, tuple[str, ...]]:
        """The record with ``at``'s number for the layer count and its sizes at 1 (the rest symbolic)."""
        count = at.get(self.symbol) if self.symbol is not None else None
        by_symbol = {s: n for n, s in self.symbols.items()}
        ones = tuple(sorted(by_symbol[s] for s, v in at.items() if s in by_symbol and v == 1))
        return self.record(int(count) if count is not None else None, ones), count, ones

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None) -> Peak:
        """The :class:`~symmem.peak.Peak` (symbolic), or with ``at`` the peak with those numbers for the layer
        count and for sizes at 1 (the rest symbolic)."""
        if at is None:
            return self._symbolic()
        rec, count, ones = self._at(at)
        key = (count, ones)
        if key not in self._peaks:
            layers = rec.layers if rec.layers is not None else self.layer_map()
            self._peaks[key] = peak_of(rec, subs=self.subs, numbers={**self.numbers, **dict(at)}, layers=layers)
        return self._peaks[key]

    def _values(self, at: Mapping[sympy.Symbol, int]) -> dict[sympy.Symbol, int]:
        values = {**self.numbers, **dict(at)}
        return {s: values[s] for s in self.symbols.values() if s in values}

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        """The step at ``at`` op by op: (phase, where, live bytes per category)."""
        return self._at(at)[0].timeline(which, self._values(at))

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        """The peak at ``at`` with every storage rounded up to 512 bytes, as CUDA's caching allocator rounds."""
        return self._at(at)[0].allocated(which, self._values(at))


def cannot_run(what: str, exc: Exception) -> SymmemError:
    """The one-line error for ``what`` (a module's step) failing on fake tensors with ``exc``: its type and first
    line, not a traceback.

    >>> print(cannot_run("the training step of this module", RuntimeError("mat1 and mat2 shapes" + chr(10) + "...")))
    the training step of this module cannot run on fake tensors: RuntimeError: mat1 and mat2 shapes
    """
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return SymmemError(f"{what} cannot run on fake tensors: {type(exc).__name__}: {first}")
