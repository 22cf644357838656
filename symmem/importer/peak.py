"""The peak of a traced module's training step, as a formula: the ``Max`` over the step's moments.

A :class:`~symmem.importer.step.StepRecord` gives the live storages after every op of one first and one steady
training step, their bytes in the declared symbols.  The candidate moments are the ops after which something
is freed (and the last of each step): between two of them memory only grows.  Moments another provably exceeds
are dropped by :mod:`symmem.passes.peak`'s own comparison (``prune``: every coefficient of the difference
≥ 0 once each symbol is written ``x' + 1``; one symbol: the upper envelope), and the peak is the ``Max`` of the
rest -- :class:`symmem.passes.peak.Peak`, what the zoo's derivations return.

Repeated blocks: the step is recorded with the run of identical children written out 4, 5 and 6 times
(:func:`symmem.importer.wrap.with_layers`).  Ops are matched across the records by (phase, module or parameter
with the child index replaced, which layer: ``1``, ``2``, ``L-1``, ``L`` or one in the middle, aten op,
occurrence); the moments of the middle layers repeat those of the second (their live bytes are those of
layer 2 plus a whole number of layers, so an end layer exceeds them).  Each moment's live storages are
interpolated from 4 and 5 layers -- a count per byte size, ``n(L) = n₄ + (n₅ - n₄)(L - 4)`` -- and the
interpolation must give the record at 6 layers exactly, else the peak is given at the module's own layer
count only (and a note says so).  The formulas hold for ``L ≥ 4``; below, the step is recorded at that count.

:class:`StepPeak` is the ``step`` callable a traced :class:`~symmem.derivation.Derivation` carries.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy

from ..errors import SymmemError
from .inputs import Inputs
from .step import StepOp, StepOptions, StepRecord, record_step

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


def _keyed(record: StepRecord, step: str) -> dict[tuple[Any, ...], tuple[StepOp, tuple[Counter, ...], bool, str]]:
    """Every op of ``step`` outside the middle layers, by a key that names the same op at another layer count."""
    out: dict[tuple[Any, ...], tuple[StepOp, tuple[Counter, ...], bool, str]] = {}
    seen: Counter = Counter()
    for o, live, candidate in record.live(step, every=True):
        place, k = _locate(o, record.layers)
        label = _label(k, record.count)
        if label == "mid":
            continue
        base = (o.phase, place, label, o.op)
        seen[base] += 1
        out[(*base, seen[base])] = (o, live, candidate, place)
    return out


def _peak(cands: dict[str, list[Any]], syms: list[sympy.Symbol], subs: Mapping[sympy.Symbol, Any],
          numbers: Mapping[sympy.Symbol, int] | None, domain: tuple[Any, ...], names: Mapping[Any, tuple[str, str]]
          ) -> Any:
    """The first and steady steps' candidates pruned by :mod:`symmem.passes.peak`'s algebra (one for both: the
    sizes repeat), as a :class:`~symmem.passes.peak.Peak`."""
    from ..passes.peak import BASE, Algebra, Peak, prune

    sizes = list(dict.fromkeys(x for cs in cands.values() for c in cs for _, x in c.parts))
    alg = Algebra(sizes, subs, syms, BASE, 1)
    memo: dict = {}
    found: dict[str, list[Any]] = {}
    for step in ("steady", "first"):
        kept = prune(cands[step], alg, numbers, memo)
        found[step] = [alg.moment(k, k.key[0], names[(step, k.key)][0], names[(step, k.key)][1], step)
                       for k in kept]
    return Peak(None, None, tuple(found["steady"] + found["first"]), domain)  # each Max built when asked for


def peak_of(record: StepRecord, *, subs: Mapping[sympy.Symbol, Any] | None = None,
            numbers: Mapping[sympy.Symbol, int] | None = None, domain: tuple[Any, ...] = (),
            layers: Mapping[str, int] | None = None) -> Any:
    """The peak of one recorded step (sizes symbolic, the layer count a number): a
    :class:`symmem.passes.peak.Peak`.  ``layers`` (child path -> index) names the layer of each moment."""
    from ..passes.peak import Candidate
    from ..passes.schedule import CATEGORIES

    cands: dict[str, list[Any]] = {"steady": [], "first": []}
    names: dict[Any, tuple[str, str]] = {}
    for step in cands:
        for o, live, candidate in record.live(step):
            if not candidate:
                continue
            place, k = _locate(o, layers if layers is not None else record.layers)
            key = (o.phase, o.index)
            parts = {(c, x): (n, ()) for c in range(len(CATEGORIES)) for x, n in live[c].items()}
            cands[step].append(Candidate(key, step, parts))
            names[(step, key)] = (_node(o, place), "" if k is None else str(k + 1))
    return _peak(cands, [], subs or {}, numbers, domain, names)


class FoldError(SymmemError):
    """The records at 4, 5 and 6 layers do not line up, or do not grow by the same amount per layer."""


def folded_peak(records: Mapping[int, StepRecord], symbol: sympy.Symbol, *,
                subs: Mapping[sympy.Symbol, Any] | None = None, numbers: Mapping[sympy.Symbol, int] | None = None,
                domain: tuple[Any, ...] = ()) -> Any:
    """The peak in the layer count ``symbol`` from records at :data:`COUNTS` layers (interpolated from the first
    two, checked at the third); a :class:`FoldError` if they do not line up."""
    from ..passes.peak import Candidate
    from ..passes.schedule import CATEGORIES

    a, b, c = (records[n] for n in COUNTS)
    step_b = COUNTS[1] - COUNTS[0]
    step_c = COUNTS[2] - COUNTS[0]
    cands: dict[str, list[Any]] = {"steady": [], "first": []}
    names: dict[Any, tuple[str, str]] = {}
    for step in cands:
        ka, kb, kc = _keyed(a, step), _keyed(b, step), _keyed(c, step)
        if set(ka) != set(kb) or set(ka) != set(kc):
            odd = sorted(set(ka) ^ set(kb) | set(ka) ^ set(kc), key=str)[:3]
            raise FoldError(f"the {step} step's ops differ between {COUNTS} layers (e.g. {odd})")
        for key, (o, la, cand_a, place) in ka.items():
            _, lb, cand_b, _ = kb[key]
            _, lc, cand_c, _ = kc[key]
            if not (cand_a or cand_b or cand_c):
                continue
            parts = {}
            for i in range(len(CATEGORIES)):
                for x in set(la[i]) | set(lb[i]) | set(lc[i]):
                    n0, d = la[i][x], lb[i][x] - la[i][x]
                    if d % step_b or n0 + d // step_b * step_c != lc[i][x]:
                        raise FoldError(f"{_node(o, place)} ({step} step): {x} bytes are alive {la[i][x]}, "
                                        f"{lb[i][x]}, {lc[i][x]} times at {COUNTS} layers: not one more set per "
                                        "layer")
                    parts[(i, x)] = (n0, (d // step_b,))
            cands[step].append(Candidate(key, step, parts))
            names[(step, key)] = (_node(o, place), key[2])
    return _peak(cands, [symbol], subs or {}, numbers, domain, names)


@dataclass
class StepPeak:
    """The ``step`` of a traced :class:`~symmem.derivation.Derivation`: computes the peak of the module's training
    step on first use (see :meth:`__call__`); records are cached.

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
    _peaks: dict[Any, Any] = field(default_factory=dict, repr=False)

    @property
    def count(self) -> int | None:
        return len(self.repeat[1]) if self.repeat is not None else None

    def record(self, count: int | None = None, ones: tuple[str, ...] = ()) -> StepRecord:
        """The step recorded with the repeated blocks written out ``count`` times (None: as the module has them)
        and the sizes in ``ones`` at 1."""
        count = self.count if count is None else count
        key = (count, ones)
        if key not in self._records:
            values = {n: (1 if n in ones else v) for n, v in self.values.items()}
            layers = (self.repeat[0], self.repeat[1], count) if self.repeat is not None else None
            replay = None if ones else self.replay
            try:
                rec = record_step(self.module, self.inputs, values, self.symbols, self.options, device=self.device,
                                  replay=replay, multiple_of={n: m for n, m in (self.multiple_of or {}).items()
                                                              if n not in ones},
                                  concrete=ones, layers=layers)
            except SymmemError:
                raise
            except Exception as exc:  # the module's own code on fake tensors: say what failed, not a traceback
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise SymmemError(f"the training step of this module cannot run on fake tensors: "
                                  f"{type(exc).__name__}: {first}") from exc
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

    def peak(self) -> Any:
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

    def lazy(self) -> Any:
        """The peak, computed when its formulas are first read: whether numbers lie in its domain is known before
        (a layer count below 4 is recorded at that count without folding first)."""
        domain = self._domain()
        if self.repeat is not None and self.symbol is not None:
            domain = (sympy.Ge(self.symbol, COUNTS[0]), *domain)
        return _LazyPeak(domain, self.peak)

    def __call__(self, at: Mapping[sympy.Symbol, int] | None = None, timeline: str | None = None) -> Any:
        """``Derivation.step``: the :class:`~symmem.passes.peak.Peak` (symbolic), or with ``at`` the peak with those
        numbers for the layer count and for sizes at 1 (the rest symbolic), or with ``timeline`` (``first`` or
        ``steady``) the step at ``at`` op by op: (phase, where, live bytes per category); ``allocated-first`` or
        ``allocated-steady``: the peak with every storage rounded up to 512 bytes."""
        if at is None:
            return self.peak() if None in self._peaks else self.lazy()
        count = at.get(self.symbol) if self.symbol is not None else None
        by_symbol = {s: n for n, s in self.symbols.items()}
        ones = tuple(sorted(by_symbol[s] for s, v in at.items() if s in by_symbol and v == 1))
        rec = self.record(int(count) if count is not None else None, ones)
        if timeline is not None:
            values = {**{s: v for s, v in self.numbers.items()}, **dict(at)}
            values = {s: values[s] for s in self.symbols.values() if s in values}
            if timeline.startswith("allocated-"):  # Derivation.peak_allocated: blocks rounded as CUDA's allocator
                return rec.allocated(timeline.removeprefix("allocated-"), values)
            return rec.timeline(timeline, values)
        key = (count, ones)
        if key not in self._peaks:
            layers = rec.layers if rec.layers is not None else self.layer_map()
            self._peaks[key] = peak_of(rec, subs=self.subs, numbers={**self.numbers, **dict(at)}, layers=layers)
        return self._peaks[key]


def _lazy_base() -> type:
    from ..passes.peak import Peak

    return Peak


class _LazyPeak(_lazy_base()):  # type: ignore[misc]
    """A :class:`~symmem.passes.peak.Peak` whose formulas are computed on first use.  Its domain is known before:
    :meth:`holds_at` answers False without computing anything where a number lies below it (the derivation then
    asks for the step at those numbers), and otherwise computes the peak and asks the real one (a fold that
    failed holds at the module's own layer count only)."""

    def __init__(self, domain: tuple[Any, ...], compute: Any) -> None:  # noqa: D107 - a frozen dataclass
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "_compute", compute)
        object.__setattr__(self, "_done", None)

    def _force(self) -> Any:
        if self._done is None:
            found = self._compute()
            object.__setattr__(self, "_done", found)
            object.__setattr__(self, "domain", found.domain)
        return self._done

    def __getattr__(self, name: str) -> Any:
        if name in ("expr", "first", "moments"):
            return getattr(self._force(), name)
        raise AttributeError(name)

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        if not all(bool(c.xreplace(dict(numbers))) for c in self.domain):
            return False
        return self._force().holds_at(numbers)

    def at(self, numbers: Mapping[sympy.Symbol, int], step: str = "steady") -> Any:
        return self._force().at(numbers, step)

    def formula(self, step: str = "steady") -> Any:
        return self._force().formula(step)

    def candidates(self, step: str = "steady") -> int:
        return self._force().candidates(step)

    def value(self, numbers: Mapping[sympy.Symbol, int], step: str = "steady") -> Any:
        return self._force().value(numbers, step)
