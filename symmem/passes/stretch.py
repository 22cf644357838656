"""A step's timeline at ``L`` identical layers written from the same step simulated at :data:`TEMPLATE` layers.

The pipeline peak cuts the single-device step, simulated on the graph unrolled to all ``L`` layers, by stage
(:class:`symmem.passes.model_parallel._Cut`); at Llama-2-7B's 32 layers that simulation was a third of the peak's
time.  The layers are one repeated block, so the simulated step is the same few ops once per layer: every sweep over
the layers (each micro-batch's forward and backward, the optimizer step, the storages made before the first op)
holds layer 1's storages and events, layer 2's, ... in turn, and a middle layer's are its neighbour's with the
layer's number moved by one.  :func:`stretch` writes the timeline at ``L`` layers from the one at 5: layers 1 and 2
as they are, layer 3 once for each of layers 3 to ``L - 2``, layers 4 and 5 as layers ``L - 1`` and ``L``, each
storage an event makes or frees moved with it.

What it takes, checked on the template (else ``None``: the caller simulates all ``L`` layers): the storages and the
events each come in whole sweeps (layers ``1..5`` or ``5..1``, one run each, nothing between); layers 2, 3 and 4
of every sweep are alike op for op and storage for storage (names without the layer's number, categories, bytes,
what each op makes and frees relative to its own layer); an op of a layer touches its own layer's storages and its
neighbours' only; an op outside the layers touches whole sweeps of layers, or layers 1, 2, 4 and 5 alone.  The
result equals the step simulated at ``L`` layers (``tests/test_pipeline_replay.py``, every built-in model that
takes pipeline stages, its attention kernels, dropout, losses, devices).

>>> from symmem.timeline import Event, Live, Timeline
>>> import sympy
>>> w = [Live(f"x#{k}", "activation", sympy.Integer(4)) for k in range(1, 6)]
>>> ev = [Event("forward", f"f#{k}", (k - 1,), (k - 2,) if k > 1 else ()) for k in range(1, 6)]
>>> big = stretch(Timeline(tuple(w), (), tuple(ev)), 7)
>>> [s.name for s in big.storages], [(e.node, e.born, e.freed) for e in big.events][2:4]
(['x#1', 'x#2', 'x#3', 'x#4', 'x#5', 'x#6', 'x#7'], [('f#3', (2,), (1,)), ('f#4', (3,), (2,))])
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

from ..timeline import Event, Live, Timeline
from .unroll import iteration, template

#: the layers a template step is simulated at: a first and a last layer, and a middle one with middle neighbours
TEMPLATE = 5
_MIDDLE = 3
_MARK = re.compile(r"#(\d+)")


class _NotStretched(Exception):
    """The template is not one run of alike layers (the caller simulates every layer)."""


def passes(tl: Timeline) -> Timeline:
    """``tl`` up to its optimizer step: the micro-batches' forwards and backwards, the storages they make.  (A
    pipeline stage's optimizer step is its parts' (:class:`~symmem.passes.model_parallel.StageMemory`); the
    foreach and fused steps' temporaries are one op's, without a layer to stretch them by.)"""
    end = next((k for k, e in enumerate(tl.events) if e.phase not in ("forward", "backward")), len(tl.events))
    events = tl.events[:end]
    made = max((sid for e in events for sid in e.born), default=-1) + 1
    return Timeline(tl.storages[:max(made, len(tl.start))], tl.start, events)


def stretch(tl: Timeline, layers: int, origin: list[int] | None = None) -> Timeline | None:
    """``tl`` (the :func:`passes` of a step of :data:`TEMPLATE` unrolled layers) at ``layers`` layers, or
    ``None`` where the template does not show alike layers (see the module's note).  ``origin``: filled with each
    storage's template storage (its id in ``tl``), so that what is read from a storage's name (its layer, its name
    without the number) is read once for the storages written from one (their names are the template's, numbered
    anew; the template's layer 1 is written for layer 1 alone)."""
    if not _writable(tl, layers):
        return None
    try:
        found = _Stretch(tl, layers)
        made = found.timeline()
        if origin is not None:
            origin[:] = found.origin
        return made
    except _NotStretched:
        return None


def _writable(tl: Timeline, layers: int) -> bool:
    """What :func:`stretch` asks before it reads the layers (and ``pipeline_layout.Layout`` alike): at least the
    template's layers, forward and backward events only, the start numbered in order, every id a storage."""
    if layers < TEMPLATE or not {e.phase for e in tl.events} <= {"forward", "backward"}:
        return False
    # the largest id, as a comprehension: a generator resumed for each of the step's thousands of ids was a sixth of
    # the layout's reading
    ids = [sid for e in tl.events for sid in e.born]
    ids += [sid for e in tl.events for sid in e.freed]
    return sorted(tl.start) == list(range(len(tl.start))) and max(ids, default=-1) < len(tl.storages)


def _alike_runs(events: Sequence[Event], labels: Sequence[int], runs: Sequence[tuple[int, int]],
                key: Callable[[Event, int], Any]) -> dict[int, tuple[int, int]]:
    """A sweep's runs by layer label, checked: the middle layers' events are alike, each by ``key(event, layer)``
    (:class:`_NotStretched` otherwise); the first and last layers' keys are worked out too (they touch their
    neighbours only).  The written step (:class:`_Stretch`) and its layout (``pipeline_layout.Layout``) check
    alike."""
    by_label = {labels[x]: (x, y) for x, y in runs}
    middle = [events[x:y] for x, y in (by_label[2], by_label[3], by_label[4])]
    if len({len(run) for run in middle}) != 1:
        raise _NotStretched
    for t, run in zip((2, 3, 4), middle, strict=True):
        if t == 2:
            first = [key(e, t) for e in run]
        elif [key(e, t) for e in run] != first:
            raise _NotStretched
    for t in (1, TEMPLATE):
        for e in events[slice(*by_label[t])]:
            key(e, t)
    return by_label


def _sweeps(labels: Sequence[int], whole: bool = True) -> list[tuple[int, int, list[tuple[int, int]] | None]]:
    """``labels`` (each item's layer, 0 outside the layers) in segments: (start, end, None) outside the layers (or,
    not ``whole``, one layer's run outside a sweep), or (start, end, runs): a whole sweep, each layer's (start, end)
    in the sweep's order."""
    runs: list[tuple[int, int, int]] = []  # (label, start, end)
    for k, lab in enumerate(labels):
        if runs and runs[-1][0] == lab:
            runs[-1] = (lab, runs[-1][1], k + 1)
        else:
            runs.append((lab, k, k + 1))
    out: list[tuple[int, int, list[tuple[int, int]] | None]] = []
    i = 0
    while i < len(runs):
        lab, a, b = runs[i]
        order = list(range(1, TEMPLATE + 1)) if lab == 1 else list(range(TEMPLATE, 0, -1))
        if not lab or (not whole and [r[0] for r in runs[i:i + TEMPLATE]] != order):
            out.append((a, b, None))
            i += 1
            continue
        if [r[0] for r in runs[i:i + TEMPLATE]] != order:
            raise _NotStretched
        out.append((a, runs[i + TEMPLATE - 1][2], [(r[1], r[2]) for r in runs[i:i + TEMPLATE]]))
        i += TEMPLATE
    return out


def _renamed(name: str, n: int) -> str:
    """``name`` with its layer's number (the first ``#k``, as :func:`~symmem.passes.unroll.template`) ``n``."""
    head, tail = _split(name)
    return f"{head}{n}{tail}"


@functools.lru_cache(maxsize=1 << 14)
def _split(name: str) -> tuple[str, str]:
    m = _MARK.search(name)
    if m is None:
        raise _NotStretched
    return name[:m.start() + 1], name[m.end():]


class _Stretch:
    """The template's storages and events numbered anew at ``layers`` layers."""

    def __init__(self, tl: Timeline, layers: int) -> None:
        self.tl, self.layers = tl, layers
        self.shift = layers - TEMPLATE
        # each template storage: ("fixed", new id) outside the layers, or (sweep, layer, position in its run)
        self.where: list[Any] = [None] * len(tl.storages)
        # sweep -> new layer -> the new id of that layer's first storage in the sweep (then one id each, in order)
        self.base: dict[int, list[int]] = {}
        self.fixed: dict[int, int] = {}
        self.storages: list[Live] = []
        self.origin: list[int] = []  # each new storage's template storage
        labels = [self._label(s) for s in tl.storages]
        new, put, append, origin = object.__new__, object.__setattr__, self.storages.append, self.origin.extend
        # (each storage made without its frozen __init__ setting each field one by one: half of writing it)
        for w, (a, b, runs) in enumerate(_sweeps(labels)):
            if runs is None:
                for old in range(a, b):
                    self.fixed[old] = len(self.storages)
                    self.storages.append(tl.storages[old])
                    self.origin.append(old)
                continue
            self._alike([tl.storages[x:y] for x, y in runs[1:4]] if labels[runs[0][0]] == 1 else
                        [tl.storages[x:y] for x, y in runs[3:0:-1]])
            by_label = {labels[x]: (x, y) for x, y in runs}
            for lab, (x, y) in by_label.items():
                for q, old in enumerate(range(x, y)):
                    self.where[old] = (w, lab, q)
            base = self.base[w] = [0] * (layers + 1)
            # each template storage's name and op split around the layer's number once, not once a layer written
            split = {lab: [(*_split(s.name), *(_split(s.node) if s.node else (None, None)), s)
                           for s in tl.storages[x:y]] for lab, (x, y) in by_label.items()}
            for n in self._new_layers(labels[runs[0][0]] == 1):
                lab = self._template_of(n)
                x, y = by_label[lab]
                base[n] = len(self.storages)
                origin(range(x, y))
                for head, tail, node_head, node_tail, s in split[lab]:
                    made = new(Live)
                    put(made, "__dict__", {"name": f"{head}{n}{tail}", "category": s.category, "nbytes": s.nbytes,
                                           "node": f"{node_head}{n}{node_tail}" if s.node else s.node,
                                           "host": s.host})
                    append(made)

    @staticmethod
    def _label(s: Live) -> int:
        k = iteration(s.name)
        if s.node and iteration(s.node) not in (0, k):
            raise _NotStretched
        return k

    def _new_layers(self, ascending: bool) -> list[int]:
        return list(range(1, self.layers + 1)) if ascending else list(range(self.layers, 0, -1))

    def _template_of(self, n: int) -> int:
        """The template layer that new layer ``n`` is written from."""
        return n if n < _MIDDLE else _MIDDLE if n <= self.layers - (TEMPLATE - _MIDDLE) else n - self.shift

    @staticmethod
    def _alike(runs: Sequence[Sequence[Live]]) -> None:
        """Layers 2, 3 and 4 of a sweep of storages (in ascending order): one storage for each, alike."""
        keys = [[_storage_key(x) for x in run] for run in runs]
        if keys[0] != keys[1] or keys[1] != keys[2]:
            raise _NotStretched

    def _relative(self, sid: int, t: int) -> Any:
        """Storage ``sid`` as an op of template layer ``t`` (> 0) sees it."""
        found = self.where[sid]
        if found is None:
            return ("fixed", sid)
        w, i, q = found
        if abs(i - t) > 1:
            raise _NotStretched
        return (w, i - t, q)

    def _compiled(self, sids: Sequence[int], t: int) -> list[tuple[list[int], int, int]]:
        """Each storage an op of template layer ``t`` touches, as (its sweep's first ids by layer, its layer less
        ``t``, its place in its layer's run), or (a list of zeros, 0, its new id) outside the layers: its id in new
        layer ``n`` is ``ids[n + d] + q`` either way."""
        out: list[tuple[list[int], int, int]] = []
        for sid in sids:
            found = self.where[sid]
            if found is None:
                out.append((self.zeros, 0, self.fixed[sid]))
            else:
                w, i, q = found
                out.append((self.base[w], i - t, q))
        return out

    def _refs_outside(self, sids: Sequence[int]) -> tuple[int, ...]:
        """What an op outside the layers (or the start) touches: whole sweeps of layers stretched, layers 1, 2, 4
        and 5 moved as those layers are."""
        labels = [0 if self.where[s] is None else self.where[s][1] for s in sids]
        out: list[int] = []
        for a, b, runs in _sweeps(labels, whole=False):
            if runs is None:
                for s in sids[a:b]:
                    out.append(self.fixed[s] if self.where[s] is None else self._moved(s))
                continue
            by_label = {labels[x]: (x, y) for x, y in runs}
            for n in self._new_layers(labels[runs[0][0]] == 1):
                x, y = by_label[self._template_of(n)]
                for s in sids[x:y]:
                    w, _, q = self.where[s]
                    out.append(self.base[w][n] + q)
        return tuple(out)

    def _moved(self, sid: int) -> int:
        w, i, q = self.where[sid]
        if i == _MIDDLE:
            raise _NotStretched  # one middle layer alone: which of the new ones is not said
        return self.base[w][i if i < _MIDDLE else i + self.shift] + q

    def timeline(self) -> Timeline:
        tl = self.tl
        events: list[Event] = []
        labels = [iteration(e.node) if e.node else 0 for e in tl.events]
        if any(e.resized for e in tl.events):
            raise _NotStretched
        for a, b, runs in _sweeps(labels):
            if runs is None:
                for e in tl.events[a:b]:
                    events.append(Event(e.phase, e.node, self._refs_outside(e.born), self._refs_outside(e.freed),
                                        e.resized, e.moment))
                continue
            by_label = _alike_runs(tl.events, labels, runs, self._event_key)
            # each template op's storages worked out once, then written for every new layer it is the template of
            # (one storage alone, as most ops make, also apart: its id without a list made)
            self.zeros = [0] * (self.layers + 2)
            compiled = {t: [(e.phase, *_split(e.node), e.resized, e.moment, *_one(self._compiled(e.born, t)),
                             *_one(self._compiled(e.freed, t))) for e in tl.events[slice(*by_label[t])]]
                        for t in by_label}
            # each event made without its frozen __init__ setting each field one by one, the ids in lists made in C
            # (the thousands of events: most of writing the step out)
            new, put, append = object.__new__, object.__setattr__, events.append
            for n in self._new_layers(labels[runs[0][0]] == 1):
                t = self._template_of(n)
                for phase, head, tail, resized, moment, born, one, freed, alone in compiled[t]:
                    event = new(Event)
                    put(event, "__dict__", {
                        "phase": phase, "node": f"{head}{n}{tail}",
                        "born": (one[0][n + one[1]] + one[2],) if one else tuple([b[n + d] + q for b, d, q in born])
                        if born else (),
                        "freed": (alone[0][n + alone[1]] + alone[2],) if alone else tuple(
                            [b[n + d] + q for b, d, q in freed]) if freed else (),
                        "resized": resized, "moment": moment})
                    append(event)
        return Timeline(tuple(self.storages), self._refs_outside(tl.start), tuple(events))

    def _event_key(self, e: Event, t: int) -> tuple[Any, ...]:
        # what an op frees is a set: the simulation lists it in an order of its own (no replay reads it)
        # each storage as :meth:`_relative` sees it, in comprehensions (a call for each storage of each op was
        # half of the layers' check)
        where = self.where
        born = [("fixed", s) if (f := where[s]) is None else (f[0], f[1] - t, f[2]) for s in e.born]
        freed = [("fixed", s) if (f := where[s]) is None else (f[0], f[1] - t, f[2]) for s in e.freed]
        if [r for r in born if r[0] != "fixed" and not -1 <= r[1] <= 1] or \
                [r for r in freed if r[0] != "fixed" and not -1 <= r[1] <= 1]:
            raise _NotStretched
        return (e.phase, template(e.node), tuple(born), frozenset(freed), e.moment)


def _one(refs: list[tuple[list[int], int, int]]) -> tuple[list[tuple[list[int], int, int]], Any]:
    """``refs`` (:meth:`_Stretch._compiled`) and, where it is one storage, that storage's (else None)."""
    return refs, refs[0] if len(refs) == 1 else None


def _storage_key(s: Live) -> tuple[Any, ...]:
    return (template(s.name), s.category, s.nbytes, template(s.node) if s.node else s.node, s.host)
