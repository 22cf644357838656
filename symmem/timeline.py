"""One model of time: the live storages of a training step and its events, in order.

Both fronts produce a :class:`Timeline`: the schedule of a built graph (:mod:`symmem.passes.schedule` simulates
it op by op) and the recorded step of a traced module (:meth:`symmem.importer.recording.StepRecord.as_timeline`).  The
peak algebra (:mod:`symmem.peak`) reads its candidate moments (:meth:`Timeline.counts`); the views read its live
bytes at numbers (:meth:`Timeline.rows`, :meth:`Timeline.allocated`).

An event allocates (``born``), may grow storages in place (``resized``), is a moment of the step -- live memory
is read right after its allocations, the most the op needs -- and then frees (``freed``).  An event with
``moment=False`` happens without being a moment of this step: a recorded run holds two optimizer steps, and a
steady step's timeline runs through the first one (whose state it keeps) without showing it.

>>> import sympy
>>> B = sympy.Symbol("B", positive=True, integer=True)
>>> tl = Timeline((Live("w", "parameter", sympy.Integer(40)), Live("x", "activation", 8 * B)), (0,),
...               (Event("forward", "fc", (1,), ()), Event("backward", "fc", (), (1,))))
>>> tl.rows({B: 100})[0]
('forward', 'fc', {'parameter': 40, 'optimizer_state': 0, 'gradient': 0, 'input': 0, 'activation': 800, \
'loss': 0, 'activation_grad': 0, 'temporary': 0})
>>> tl.allocated({B: 100})    # each storage rounded up to CUDA's 512-byte blocks
1536
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import sympy

from .categories import STEP
from .errors import SymmemError
from .evaluator import exactly

#: Which training step: the ``first`` creates the optimizer state; a ``steady`` one (step >= 2) starts with it.
Which = Literal["steady", "first"]
#: The steps a derivation's peak and timeline know, in the order they are named.
STEPS: tuple[str, ...] = ("steady", "first")
#: One row of a timeline at numbers: (phase, op, live bytes per category) after the op's allocations.
Row = tuple[str, str | None, dict[str, int]]
#: What CUDA's caching allocator rounds every block up to (what ``max_memory_allocated`` sees).
CUDA_BLOCK = 512

_INDEX = {c: i for i, c in enumerate(STEP)}
_ZERO = sympy.Integer(0)

#: the suffix of a checkpointed op's event when backward runs it again (passes/schedule.py, Simulation.recompute)
RECOMPUTED = ":recompute"



def _copy(counts: dict[int, int]) -> Counter:
    """``Counter(counts)`` without ``Counter.update``'s checks (an ABC ``isinstance``, two Python calls): a copy in
    C, made at every candidate moment of every walk."""
    out: Counter = Counter.__new__(Counter)
    dict.update(out, counts)
    return out


def checked(step: Any) -> Which:
    """``step`` where it names a step (:data:`STEPS`), else a :class:`~symmem.errors.SymmemError` naming them.

    >>> checked("first")
    'first'
    >>> checked("bogus")
    Traceback (most recent call last):
      ...
    symmem.errors.SymmemError: unknown step 'bogus'; known: steady, first
    """
    if not isinstance(step, str) or step not in STEPS:
        raise SymmemError(f"unknown step {step!r}; known: {', '.join(STEPS)}")
    return step  # type: ignore[return-value]


@dataclass(frozen=True)
class Live:
    """One storage of the step: its name, category (:data:`symmem.categories.STEP`), bytes, and the node or module
    that made it; ``host``: held in host memory while the step runs on CUDA (Adam's step counts, the
    memory-efficient attention's Philox seed and offset), so not in what CUDA's allocator counts."""

    name: str
    category: str
    nbytes: sympy.Expr
    node: str | None = None
    host: bool = False


@dataclass(frozen=True)
class Event:
    """One op of the step: what it allocates, what it grows in place (storage, new bytes), and what is freed once
    it has run; ``moment``: whether the step shows it (see the module's note)."""

    phase: str
    node: str | None
    born: tuple[int, ...]
    freed: tuple[int, ...]
    resized: tuple[tuple[int, Any], ...] = ()
    moment: bool = True


def make_live(name: str, category: str, nbytes: sympy.Expr, node: str | None = None, host: bool = False,
         _new: Callable[[type], Any] = object.__new__) -> Live:
    """``Live(name, category, nbytes, node, host)`` without the frozen dataclass's ``__init__`` setting each field
    through ``object.__setattr__`` (half the cost of a storage; a walk makes thousands): the same value.

    >>> make_live("x", "activation", sympy.Integer(8)) == Live("x", "activation", sympy.Integer(8))
    True
    """
    made = _new(Live)
    made.__dict__.update(name=name, category=category, nbytes=nbytes, node=node, host=host)
    return made


def make_event(phase: str, node: str | None, born: tuple[int, ...], freed: tuple[int, ...],
          _new: Callable[[type], Any] = object.__new__) -> Event:
    """``Event(phase, node, born, freed)`` made as :func:`make_live` makes a storage: the same value.

    >>> make_event("forward", "f", (0,), ()) == Event("forward", "f", (0,), ())
    True
    """
    made = _new(Event)
    made.__dict__.update(phase=phase, node=node, born=born, freed=freed, resized=(), moment=True)
    return made


@dataclass(frozen=True)
class Summed:
    """Storages of one category alive at exactly the same moments, counted as one (:meth:`Timeline.counts` with
    ``together``): their sizes with how many of each.  A moment's bytes are linear in what it holds, so holding
    their sum once is holding each of them: the peak's algebra (:class:`symmem.peak.Algebra`) sums the sizes' terms.

    >>> B = sympy.Symbol("B")
    >>> Summed(frozenset({(4 * B, 2), (sympy.Integer(8), 1)})).expr()
    8*B + 8
    """

    sizes: frozenset[tuple[sympy.Expr, int]]

    def expr(self) -> sympy.Expr:
        return sympy.Add(*(k * size for size, k in self.sizes))


@dataclass(frozen=True)
class Timeline:
    """The storages of one training step and its events, in order; ``start`` are the storages alive before
    the first event (weights, the batch, optimizer state in the steady state)."""

    storages: tuple[Live, ...]
    start: tuple[int, ...]
    events: tuple[Event, ...]

    def counts(self, every: bool = False, device_only: bool = False, also: Callable[[int], bool] | None = None,
               skip: frozenset[int] = frozenset(), ids: dict[tuple[int, Any], int] | None = None,
               together: Callable[[Live], Any] | None = None) -> list[tuple[int, Counter | None, bool]]:
        """For each moment: (its event's index, the live storages as one Counter of (category index in
        :data:`~symmem.categories.STEP`, bytes), whether it is a candidate for the peak).  A candidate frees
        something after it, or is the last moment: between candidates memory only grows, so the Counter is given
        for candidates only (for every moment with ``every``; also for those whose event index ``also`` accepts; never
        for those in ``skip``).
        ``device_only`` counts host storages as empty.  ``ids``: the Counters are keyed by each (category, bytes)'s
        number in ``ids`` (given one in the order first met, the mapping filled in; shared by the walks of one
        peak), not by the pair itself: hashing a pair hashes its sympy size in Python, an int's hash is C's.
        ``together`` (with ``ids``): storages of one category alive at exactly the same moments to which it gives the
        same value (:meth:`together`; a layer's number) are one (category, :class:`Summed`) counted once -- an FSDP
        unit's unsharded parameters, a layer's weights and optimizer state -- so a moment names half as many.

        >>> B = sympy.Symbol("B", positive=True, integer=True)
        >>> tl = Timeline((Live("x", "activation", 8 * B), Live("t", "temporary", 4 * B)), (),
        ...               (Event("forward", "f", (0, 1), (1,)), Event("backward", "f", (), (0,))))
        >>> table: dict = {}
        >>> tl.counts(ids=table), list(table) == [(4, 8 * B), (7, 4 * B)]
        ([(0, Counter({0: 1, 1: 1}), True), (1, Counter({0: 1}), True)], True)
        >>> tl.counts()[1]
        (1, Counter({(4, 8*B): 1}), True)
        """
        table = {} if ids is None else ids
        get_id = table.get

        def number(key: tuple[int, Any]) -> int:
            found = get_id(key)
            if found is None:
                found = table[key] = len(table)
            return found

        groups = self.together(together) if together is not None and ids is not None and not device_only else {}
        where = [-1 if i in groups else number((_INDEX[s.category], _ZERO if device_only and s.host else s.nbytes))
                 for i, s in enumerate(self.storages)]
        for first, members in groups.items():
            if first == members[0]:  # the group's first storage stands for all of them, the others count nothing
                sizes: Counter = Counter(self.storages[i].nbytes for i in members)
                where[first] = number((_INDEX[self.storages[first].category], Summed(frozenset(sizes.items()))))
        live: dict[int, int] = {}
        get = live.get
        for i in self.start:
            x = where[i]
            if x >= 0:
                live[x] = get(x, 0) + 1
        last = max((k for k, e in enumerate(self.events) if e.moment), default=-1)
        out: list[tuple[int, Counter | None, bool]] = []
        # with ``ids``, a storage emptied is dropped at once: while no count is below zero the live ones are the
        # dict itself, copied in C at each candidate, not filtered in Python (most of a walk's counting otherwise)
        clean = ids is not None
        for k, e in enumerate(self.events):
            for i in e.born:
                x = where[i]
                if x >= 0:
                    live[x] = get(x, 0) + 1
            for sid, new in e.resized:
                x = where[sid]
                n = get(x, 0) - 1
                if n or not clean:
                    live[x] = n
                    clean = clean and n > 0
                else:
                    del live[x]
                x = where[sid] = number((_INDEX[self.storages[sid].category],
                                         _ZERO if device_only and self.storages[sid].host else new))
                live[x] = get(x, 0) + 1
            if e.moment:
                candidate = bool(e.freed) or k == last
                wanted = (candidate or every or (also is not None and also(k))) and k not in skip
                # the live storages without the emptied ones (what ``+live`` gives)
                out.append((k, (_copy(live) if clean else Counter({x: n for x, n in live.items() if n > 0}))
                            if wanted else None, candidate))
            for i in e.freed:
                x = where[i]
                if x >= 0:
                    if ids is None:
                        live[x] -= 1
                        continue
                    n = get(x, 0) - 1  # (an emptied storage was dropped)
                    if n or not clean:
                        live[x] = n
                        clean = clean and n > 0
                    else:
                        del live[x]
        if ids is not None:
            return out
        keys = list(table)  # back to (category, bytes) pairs, in the same order
        return [(k, None if c is None else Counter({keys[x]: n for x, n in c.items()}), cand) for k, c, cand in out]

    def together(self, split: Callable[[Live], Any] = lambda s: None) -> dict[int, list[int]]:
        """Storages of one category alive at exactly the same moments -- born by the same event (or alive from the
        start) and freed by the same event (or never), each born and freed at most once and never grown in place --
        to which ``split`` gives the same value, in groups of two or more: {storage: its group, in order}.

        >>> B = sympy.Symbol("B")
        >>> tl = Timeline((Live("w", "parameter", sympy.Integer(40)), Live("v", "parameter", sympy.Integer(8)),
        ...                Live("x", "activation", 8 * B), Live("y", "activation", 4 * B)), (0, 1),
        ...               (Event("forward", "f", (2, 3), ()), Event("backward", "f", (), (2,)),
        ...                Event("backward", "g", (), (3,))))
        >>> tl.together()
        {0: [0, 1], 1: [0, 1]}
        >>> tl.together(lambda s: s.name)
        {}
        """
        events = self.events
        # comprehensions, not loops (this runs for every walk of a peak); a storage born or freed twice (none in a
        # simulated step) shows as fewer keys than entries, and is then found and left alone
        born = {i: k for k, e in enumerate(events) for i in e.born}
        freed = {i: k for k, e in enumerate(events) for i in e.freed}
        alone = {i for e in events if e.resized for i, _ in e.resized}
        if len(born) != sum(len(e.born) for e in events) or len(freed) != sum(len(e.freed) for e in events):
            alone |= {i for i, n in Counter(i for e in events for i in e.born).items() if n > 1}
            alone |= {i for i, n in Counter(i for e in events for i in e.freed).items() if n > 1}
        for i in self.start:
            if i in born:
                alone.add(i)
            born[i] = -1
        if len(set(self.start)) != len(self.start):
            alone |= {i for i, n in Counter(self.start).items() if n > 1}
        storages = self.storages
        groups: dict[tuple[str, int, int | None], list[int]] = {}
        for i, k in born.items():
            if i not in alone:
                groups.setdefault((storages[i].category, k, freed.get(i)), []).append(i)
        out: dict[int, list[int]] = {}
        for g in groups.values():
            if len(g) < 2:
                continue
            parts: dict[Any, list[int]] = {}
            for i in g:
                parts.setdefault(split(storages[i]), []).append(i)
            out.update((i, part) for part in parts.values() if len(part) > 1 for i in part)
        return out

    def live(self) -> list[dict[str, sympy.Expr]]:
        """Live bytes per category after each moment's allocations, as exact sympy sums.

        >>> B = sympy.Symbol("B", positive=True, integer=True)
        >>> tl = Timeline((Live("x", "activation", 8 * B), Live("t", "temporary", 4 * B)), (),
        ...               (Event("forward", "f", (0, 1), (1,)), Event("backward", "f", (), (0,))))
        >>> [(m["activation"], m["temporary"]) for m in tl.live()]
        [(8*B, 4*B), (8*B, 0)]
        """
        out = []
        for _, live, _ in self.counts(every=True):
            assert live is not None
            terms: list[list[sympy.Expr]] = [[] for _ in STEP]
            for (c, size), n in live.items():
                terms[c].append(n * size)
            out.append({cat: sympy.Add(*terms[i]) for i, cat in enumerate(STEP)})
        return out

    def _totals(self, values: Mapping[sympy.Symbol, Any], block: int, device_only: bool
                ) -> list[tuple[int, list[int]]]:
        """(event index, live bytes per category) after each moment's allocations at ``values``, every storage
        rounded up to a multiple of ``block`` bytes."""
        subs = {s: sympy.Integer(v) if isinstance(v, int) else v for s, v in values.items()}
        memo: dict[Any, int] = {}
        # every value an int: a size is walked once in Python ints (exact; the same number as sympy's
        # substitution, which rebuilds the expression); sympy decides where the walk gives none
        ints = all(type(v) is int for v in values.values())

        def num(x: Any) -> int:
            found = memo.get(x)
            if found is None:
                v = exactly(x, values) if ints and isinstance(x, sympy.Basic) else None
                if v is None or isinstance(v, bool):
                    v = sympy.sympify(sympy.sympify(x, strict=True).xreplace(subs), strict=True)
                    n = int(v) if v.is_number else 0
                else:
                    n = int(v)
                found = memo[x] = -(-n // block) * block if n else 0
            return found

        size = [0 if device_only and s.host else num(s.nbytes) for s in self.storages]
        cat = [_INDEX[s.category] for s in self.storages]
        live = [0] * len(STEP)
        for i in self.start:
            live[cat[i]] += size[i]
        out = []
        for k, e in enumerate(self.events):
            for i in e.born:
                live[cat[i]] += size[i]
            for sid, new in e.resized:
                live[cat[sid]] -= size[sid]
                size[sid] = 0 if device_only and self.storages[sid].host else num(new)
                live[cat[sid]] += size[sid]
            if e.moment:
                out.append((k, list(live)))
            for i in e.freed:
                live[cat[i]] -= size[i]
        return out

    def rows(self, values: Mapping[sympy.Symbol, Any]) -> list[Row]:
        """(phase, op, live bytes per category) after each moment's allocations at ``values``."""
        return [(self.events[k].phase, self.events[k].node, dict(zip(STEP, live, strict=True)))
                for k, live in self._totals(values, 1, False)]

    def allocated(self, values: Mapping[sympy.Symbol, Any], block: int = CUDA_BLOCK) -> int:
        """The peak at ``values`` with every storage rounded up to ``block`` bytes, as CUDA's caching allocator
        rounds its blocks (what ``torch.cuda.max_memory_allocated`` reports before library workspaces); storages
        in host memory are left out."""
        return max((sum(live) for _, live in self._totals(values, block, True)), default=0)
