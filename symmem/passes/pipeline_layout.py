"""The plain pipeline's stage plans read from the step simulated at :data:`~symmem.passes.stretch.TEMPLATE`
layers, without writing that step out at ``L`` layers.

:func:`symmem.passes.stretch.stretch` writes the single-device step at ``L`` layers from the one simulated at 5
(layers 1 and 2 as they are, layer 3 once for each of layers 3 to ``L - 2``, layers 4 and 5 as ``L - 1`` and
``L``), and each stage's replay (:class:`symmem.passes.model_parallel._Replay`) then sorted out its ops, asked of
each storage it makes who frees it first, and planned what becomes of it: at Llama-2-7B's 32 layers, writing the
step out (7,557 storages, 7,869 ops), sorting it by stage and planning it were a third of the pipeline peak's
time, while each stage's layers are one layer repeated.

:class:`Layout` numbers the written step's storages and ops as the writing does (the same ids, the same order,
the same refusals: the step stays the one ``stretch`` writes, written only when something asks for it: an engine
around the stages, a moment's formula), and :func:`plan` gives a stage's plan of a pass from the template: where
an op of a layer frees what it reads first, and so what becomes of each storage, depends only on which template
layer the op and its neighbours two layers either way are written from and which of them are on the stage; a
layer's plan is worked out once for each such way and written for every layer that has it with its storages' ids
moved.  ``tests/test_pipeline_layout.py`` holds every plan and every send against the ones read from the written
step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..timeline import RECOMPUTED, Event, Live, Timeline
from .stretch import _MIDDLE, TEMPLATE, _alike_runs, _NotStretched, _split, _Stretch, _sweeps, _writable
from .unroll import iteration

#: a written storage whose first freeing op is not worked out yet
_UNKNOWN = object()


class NoLayout(Exception):
    """The template is stretched (``stretch`` writes it), but not as :class:`Layout` reads it: the step is written
    out and read as before."""


class Layout(_Stretch):
    """The step ``stretch`` writes at ``layers`` from ``tl`` (the template's passes), numbered without being
    written.  Raises :class:`~symmem.passes.stretch._NotStretched` where ``stretch`` gives None (the same checks),
    :class:`NoLayout` where a sweep of layers mixes phases (the passes would then be read from the written step).
    """

    def __init__(self, tl: Timeline, layers: int) -> None:
        if not _writable(tl, layers):  # stretch()'s own checks before it writes anything
            raise _NotStretched
        self.tl, self.layers = tl, layers
        self.shift = layers - TEMPLATE
        self.where: list[Any] = [None] * len(tl.storages)
        self.base: dict[int, list[int]] = {}
        self.fixed: dict[int, int] = {}
        #: each written storage's template storage and its layer (0 outside the layers)
        self.origin: list[int] = []
        self.layer: list[int] = []
        # each storage's layer, and its op's (-1: none), checked as _Stretch._label checks them (in comprehensions)
        labels = [iteration(s.name) for s in tl.storages]
        nodes = [iteration(s.node) if s.node else -1 for s in tl.storages]
        if [k for k, m in zip(labels, nodes, strict=True) if m > 0 and m != k]:
            raise _NotStretched
        origin, layer = self.origin, self.layer
        # _Stretch.__init__'s numbering, each storage counted, not written
        for w, (a, b, runs) in enumerate(_sweeps(labels)):
            if runs is None:
                for old in range(a, b):
                    self.fixed[old] = len(origin)
                    origin.append(old)
                    layer.append(0)
                continue
            ascending = labels[runs[0][0]] == 1
            self._alike([tl.storages[x:y] for x, y in runs[1:4]] if ascending else
                        [tl.storages[x:y] for x, y in runs[3:0:-1]])
            by_label = {labels[x]: (x, y) for x, y in runs}
            for lab, (x, y) in by_label.items():
                for q, old in enumerate(range(x, y)):
                    self.where[old] = (w, lab, q)
                # the writing splits each name and op around its layer's number: a layer's storages have one in
                # their names (their label), an op outside the layers none (_split refuses it)
                if 0 in nodes[x:y]:
                    raise _NotStretched
            base = self.base[w] = [0] * (layers + 1)
            for n in self._new_layers(ascending):
                x, y = by_label[self._template_of(n)]
                base[n] = len(origin)
                origin.extend(range(x, y))
                layer.extend([n] * (y - x))
        self._read_events()

    def _read_events(self) -> None:
        """_Stretch.timeline's checks, and where each written op is: ``segments`` in the written order, each
        ``("op", te, k, born, freed)`` (an op outside the layers, its index ``k`` and written ids) or ``("sweep",
        ascending, runs, compiled, starts)`` (template layer -> its ops' (start, end); template layer -> each op's
        node split and ids as (sweep's first ids by layer, layer less the op's, place); new layer -> the index of
        its first written op)."""
        tl, layers = self.tl, self.layers
        labels = [iteration(e.node) if e.node else 0 for e in tl.events]
        if any(e.resized for e in tl.events):
            raise _NotStretched
        self.zeros = [0] * (layers + 2)
        self.segments: list[Any] = []
        #: template op -> ("op", its written index) or (segment, template layer, place in its layer's run)
        self.op_at: list[Any] = [None] * len(tl.events)
        k = 0
        for a, b, runs in _sweeps(labels):
            if runs is None:
                for te in range(a, b):
                    e = tl.events[te]
                    self.segments.append(("op", te, k, self._refs_outside(e.born), self._refs_outside(e.freed)))
                    self.op_at[te] = ("op", k)
                    k += 1
                continue
            by_label = _alike_runs(tl.events, labels, runs, self._event_key)
            if len({e.phase for e in tl.events[a:b]}) != 1:
                raise NoLayout
            compiled = {t: [(*_split(e.node), self._compiled(e.born, t), self._compiled(e.freed, t))
                            for e in tl.events[slice(*by_label[t])]] for t in by_label}
            ascending = labels[runs[0][0]] == 1
            starts = [0] * (layers + 2)
            for n in self._new_layers(ascending):
                starts[n] = k
                x, y = by_label[self._template_of(n)]
                k += y - x
            segment = len(self.segments)
            for t, (x, y) in by_label.items():
                for j, te in enumerate(range(x, y)):
                    self.op_at[te] = (segment, t, j)
            self.segments.append(("sweep", ascending, by_label, compiled, starts))
        self.start = self._refs_outside(tl.start)  # the written step's start: refused as the writing refuses it
        self.ops = k
        # each template op's pass and kind (the written step's passes: a sweep is one phase, so they begin where
        # the template's do)
        self.pass_of: list[tuple[int, str]] = []
        count, previous = -1, None
        for e in tl.events:
            if e.phase == "forward" and previous != "forward":
                count += 1
            self.pass_of.append((count, "F" if e.phase == "forward" else "B"))
            previous = e.phase
        # each template storage's first freeing op in the template
        self.first_free: dict[int, int] = {}
        for te, e in enumerate(tl.events):
            for sid in e.freed:
                self.first_free.setdefault(sid, te)
        self._freers: list[Any] = [_UNKNOWN] * len(self.origin)

    def written(self) -> tuple[Timeline, list[int]]:
        """The step written out (``stretch``'s: the same storages and ops, in the same order) and each storage's
        template storage, from what the layout read (its checks not made again).  Each storage and op made
        without its frozen ``__init__``, as ``stretch`` makes them; in comprehensions, each template storage's
        parts and each template op's storages (one alone: its id without a list made, as ``stretch`` writes it)
        worked out once (a call or two for each of the thousands of storages and ops written was half of this)."""
        tl = self.tl
        new, put = object.__new__, object.__setattr__
        # each template storage of a layer: its name and op split around the layer's number, its fields
        parts: list[Any] = [None] * len(tl.storages)
        for ts in {ts for ts, n in zip(self.origin, self.layer, strict=True) if n}:
            st = tl.storages[ts]
            parts[ts] = (*_split(st.name), *(_split(st.node) if st.node else (None, None)), st.category, st.nbytes,
                         st.node, st.host)
        storages = [tl.storages[ts] if not n else (
            put(made := new(Live), "__dict__", {
                "name": f"{(q := parts[ts])[0]}{n}{q[1]}", "category": q[4], "nbytes": q[5],
                "node": f"{q[2]}{n}{q[3]}" if q[6] else q[6], "host": q[7]}) or made)
            for ts, n in zip(self.origin, self.layer, strict=True)]
        events: list[Event] = []
        add, extend = events.append, events.extend
        for segment in self.segments:
            if segment[0] == "op":
                _, te, _, born, freed = segment
                e = tl.events[te]
                add(Event(e.phase, e.node, born, freed, e.resized, e.moment))
                continue
            _, ascending, by_label, compiled, _ = segment
            # each template op's fields and storages, one storage alone apart (most ops make or free one)
            ops = {t: [(head, tail, (e := tl.events[by_label[t][0] + j]).phase, e.resized, e.moment,
                        born_refs, born_refs[0] if born_refs and not born_refs[1:] else None,
                        freed_refs, freed_refs[0] if freed_refs and not freed_refs[1:] else None)
                       for j, (head, tail, born_refs, freed_refs) in enumerate(compiled[t])] for t in compiled}
            for n in self._new_layers(ascending):
                extend([put(event := new(Event), "__dict__", {
                    "phase": phase, "node": f"{head}{n}{tail}",
                    "born": (one[0][n + one[1]] + one[2],) if one else
                    tuple([b[n + d] + q for b, d, q in born_refs]) if born_refs else (),
                    "freed": (alone[0][n + alone[1]] + alone[2],) if alone else
                    tuple([b[n + d] + q for b, d, q in freed_refs]) if freed_refs else (),
                    "resized": resized, "moment": moment}) or event
                    for head, tail, phase, resized, moment, born_refs, one, freed_refs, alone in
                    ops[self._template_of(n)]])
        return Timeline(tuple(storages), self.start, tuple(events)), list(self.origin)

    def name(self, sid: int) -> str:
        """Written storage ``sid``'s name."""
        st, n = self.tl.storages[self.origin[sid]], self.layer[sid]
        if not n:
            return st.name
        head, tail = _split(st.name)
        return f"{head}{n}{tail}"

    def freer(self, sid: int) -> tuple[int, int, int] | None:
        """Where written storage ``sid`` is first freed: (the op's written index, its template op, its layer (0:
        outside the layers)), or None; each worked out once (a stage's plans and sends ask each a few times)."""
        found = self._freers[sid]
        if found is _UNKNOWN:
            found = self._freers[sid] = self._freer(sid)
        return found

    def _freer(self, sid: int) -> tuple[int, int, int] | None:
        te = self.first_free.get(self.origin[sid])
        if te is None:
            return None
        at = self.op_at[te]
        if at[0] == "op":
            return at[1], te, 0
        segment, lt, j = at
        _, ascending, _, _, starts = self.segments[segment]
        m = self.layer[sid]
        if m:  # a layer's storage: freed by the op in the same place of the layer as the template's
            n = m + lt - self._template_of(m)
        elif lt == _MIDDLE:  # a storage outside the layers: the first op written from the template's
            n = _MIDDLE if ascending else self.layers - (TEMPLATE - _MIDDLE)
        else:
            n = lt if lt < _MIDDLE else lt + self.shift
        return starts[n] + j, te, n


#: what becomes of a storage a stage's op makes (model_parallel's _HELD, _AT_ONCE, _WITH_FORWARD, _WITH_BACKWARD)
_HELD, _AT_ONCE, _WITH_FORWARD, _WITH_BACKWARD = range(4)
_OUTSIDE = ("parameter", "optimizer_state", "input")


class _Stage:
    """What a stage's plans ask of the layout, for cut ``cut``'s stage ``s`` (``p`` stages of ``per`` layers)."""

    def __init__(self, layout: Layout, cut: Any, s: int, sized: Callable[[Any, int], int]) -> None:
        self.layout, self.cut, self.s = layout, cut, s
        self.p, self.per = cut.p, cut.per
        self.sized = sized
        from .stretch import _renamed

        tl = layout.tl
        stage_of = cut.stage_of
        self.op_in_small, self.storage_in_small = _in_small(layout, cut.small)
        self.stage_of, self.shared = stage_of, cut.shared
        keep = cut.keep
        self.keep: set[int] = set()
        for k, ts in layout.fixed.items():
            if tl.storages[k].name in keep:
                self.keep.add(ts)
        for name in keep:
            m = iteration(name) if name else 0
            if m and 1 <= m <= layout.layers:
                t = layout._template_of(m)
                for w, base in layout.base.items():
                    for ts in range(len(tl.storages)):
                        found = layout.where[ts]
                        if found is not None and found[0] == w and found[1] == t and \
                                _renamed(tl.storages[ts].name, m) == name:
                            self.keep.add(base[m] + found[2])

    def layer_stage(self, m: int, in_small: bool) -> int:
        return (m - 1) // self.per if in_small else self.p - 1

    def op_on(self, te: int, n: int) -> bool:
        """Whether the written op of template op ``te`` at layer ``n`` (0: outside) is on this stage (``_ops``)."""
        if n:
            return self.layer_stage(n, self.op_in_small[te]) == self.s
        node = self.layout.tl.events[te].node
        return node in self.shared or self.stage_of(node) == self.s

    def op_stage(self, te: int, n: int) -> int:
        """The stage of the written op's node (``stage_of``, as the sends ask)."""
        if n:
            return self.layer_stage(n, self.op_in_small[te])
        return self.stage_of(self.layout.tl.events[te].node)

    def born(self, sid: int, pass_: int, kind: str) -> tuple[int, int] | None:
        """(bytes, fate) of written storage ``sid`` made by an op of this stage in ``pass_``'s ``kind`` (None: not
        the stage's), as ``_Replay._plan`` decides it."""
        layout = self.layout
        ts = layout.origin[sid]
        st = layout.tl.storages[ts]
        category = st.category
        if category in _OUTSIDE:
            return None
        m = layout.layer[sid]
        if m:
            if self.layer_stage(m, self.storage_in_small[ts]) != self.s:
                return None
        elif st.node not in self.shared and self.stage_of(st.node) != self.s:
            return None
        freed = layout.freer(sid)
        mine = freed is not None and layout.pass_of[freed[1]] == (pass_, kind) and self.op_on(freed[1], freed[2])
        if category == "gradient":
            fate = _AT_ONCE if pass_ > 0 and not mine else _HELD
        elif sid in self.keep:
            fate = _HELD
        elif kind == "F" and freed is not None and layout.pass_of[freed[1]][1] == "F":
            fate = _WITH_FORWARD
        elif not mine:
            fate = _WITH_BACKWARD
        else:
            fate = _HELD
        return self.sized(st.nbytes, sid), fate

    def dies(self, sid: int, k: int) -> bool:
        """Whether the op at written index ``k`` is the first to free ``sid`` (and it is not kept to the end)."""
        freed = self.layout.freer(sid)
        return freed is not None and freed[0] == k and sid not in self.keep

    def sent(self, sid: int, on: bool) -> bool:
        """``_sent_on`` (``on``) or ``_sent_back`` of written storage ``sid`` from this stage."""
        layout = self.layout
        freed = layout.freer(sid)
        if not on and (layout.tl.storages[layout.origin[sid]].category != "activation_grad" or freed is None
                       or self.s == 0):
            return False
        if freed is None:
            return False
        _, te, n = freed
        if layout.tl.events[te].node is None:
            return False
        stage = self.op_stage(te, n)
        return stage > self.s if on else stage < self.s


def _in_small(layout: Layout, small: Any) -> tuple[list[bool], list[bool]]:
    """Whether each template op and each template storage's node is a layer's whose node the graph at 5 layers has
    (then on its layer's stage, else on the last: ``_Cut._stage_of``), read once a layout and graph."""
    found = layout.__dict__.setdefault("_in_small", {})
    if id(small) not in found:
        from .stretch import _renamed

        def in_small(node: str | None) -> bool:
            if node is None:
                return False
            if node.endswith(RECOMPUTED):
                node = node[:-len(RECOMPUTED)]
            return _renamed(node, 1) in small

        tl = layout.tl
        # each node asked once (an op's node is met in each micro-batch's forward and backward, a storage's by each
        # storage it makes), then read for every op and storage
        nodes = {e.node for e in tl.events if e.node} | {st.node for st in tl.storages if st.node}
        answer = {n: bool(iteration(n)) and in_small(n) for n in nodes}
        found[id(small)] = (small, [answer[e.node] if e.node else False for e in tl.events],
                            [answer[st.node] if st.node else False for st in tl.storages])
    return found[id(small)][1], found[id(small)][2]


def stage_of_layout(cut: Any, s: int, sized: Callable[[Any, int], int]) -> _Stage:
    """The stage's questions to the layout, made once a cut and stage."""
    found = cut.__dict__.setdefault("_layout_stages", {})
    if s not in found:
        found[s] = _Stage(cut.layout, cut, s, sized)
    return found[s]


def plan(stage: _Stage, pass_: int, kind: str) -> tuple[list[tuple[str | None, list[tuple[int, int, int]],
                                                                   list[int]]], set[int]]:
    """Stage ``stage``'s plan of ``pass_``'s forward or backward (``kind``), as ``_Replay._plan`` makes it from
    the written step, and what it makes or frees (``_Replay._touched``)."""
    layout = stage.layout
    tl = layout.tl
    out: list[tuple[str | None, list[tuple[int, int, int]], list[int]]] = []
    touched: set[int] = set()
    shapes = stage.cut.__dict__.setdefault("_layout_shapes", {})
    s, per, layers = stage.s, stage.per, layout.layers
    ends = (stage.s == 0, stage.s == stage.p - 1)
    for segment in layout.segments:
        if segment[0] == "op":
            _, te, k, born_ids, freed_ids = segment
            if layout.pass_of[te] != (pass_, kind) or not stage.op_on(te, 0):
                continue
            born = []
            for sid in born_ids:
                found = stage.born(sid, pass_, kind)
                if found is not None:
                    born.append((sid, *found))
                    touched.add(sid)
            dying = [sid for sid in freed_ids if stage.dies(sid, k)] if freed_ids else []
            touched.update(dying)
            out.append((tl.events[te].node, born, dying))
            continue
        _, ascending, by_label, compiled, starts = segment
        if layout.pass_of[by_label[1][0]] != (pass_, kind):
            continue
        # the stage's layers in the sweep's order (a layer's ops are on its stage: the graph has each, checked)
        lo, hi = s * per + 1, min((s + 1) * per, layers)
        group = shapes.setdefault((id(segment), pass_, kind, ends), [])
        for n in (range(lo, hi + 1) if ascending else range(hi, lo - 1, -1)):
            shape = None
            for offsets, table in group:
                shape = table.get(_way(layout, n, offsets, s, per))
                if shape is not None:
                    break
            if shape is None:
                shape, offsets_ = _shape(stage, segment, layout._template_of(n), n, pass_, kind)
                if offsets_ is not None:
                    for offsets, table in group:
                        if offsets == offsets_:
                            table[_way(layout, n, offsets, s, per)] = shape
                            break
                    else:
                        group.append((offsets_, {_way(layout, n, offsets_, s, per): shape}))
            append, note, update = out.append, touched.add, touched.update
            for head, tail, born, dying in shape:
                if born:
                    made = [(b[n + d] + q, nbytes, fate) for b, d, q, nbytes, fate in born]
                    for x in made:
                        note(x[0])
                else:
                    made = []
                if dying:
                    gone = [b[n + d] + q for b, d, q in dying]
                    update(gone)
                else:
                    gone = []
                append((f"{head}{n}{tail}", made, gone))
    return out, touched


def _way(layout: Layout, n: int, offsets: tuple[int, ...], s: int, per: int) -> tuple[Any, ...]:
    """What a layer's plan reads of the layers at ``offsets`` from layer ``n``: each one's template layer and
    whether it is on stage ``s`` (None: no such layer)."""
    layers = layout.layers
    return tuple((layout._template_of(n + o), (n + o - 1) // per == s) if 1 <= n + o <= layers else None
                 for o in offsets)


def _shape(stage: _Stage, segment: Any, t: int, n: int, pass_: int, kind: str
           ) -> tuple[list[Any], tuple[int, ...] | None]:
    """A layer's plan worked out at layer ``n`` (template layer ``t``), its storages as ids to move to another
    layer (``plan``), and the layers it read, as offsets from ``n``: each one's template layer (which template
    storage a storage is written from, so its category, bytes and who frees it first) and whether it is on the
    stage (the storages' and the freeing ops').  Another layer whose layers at those offsets are alike so has
    this plan, moved.  None for the offsets where an op of the layer makes or frees a storage outside the layers
    (who frees that first is one op of one layer, anywhere): worked out at every layer."""
    layout = stage.layout
    _, _, _, compiled, starts = segment
    zeros, freer, keep, born_of = layout.zeros, layout.freer, stage.keep, stage.born
    out = []
    offsets: set[int] = {0}
    alike = True
    for j, (head, tail, born_refs, freed_refs) in enumerate(compiled[t]):
        k = starts[n] + j
        born = []
        for b, d, q in born_refs:
            sid = b[n + d] + q
            found = born_of(sid, pass_, kind)
            if found is not None:
                born.append((b, d, q, *found))
            if b is zeros:
                alike = False
            else:  # what the plan read: the storage's layer, its first freeing op's
                offsets.add(d)
                freed = freer(sid)
                if freed is not None and freed[2]:
                    offsets.add(freed[2] - n)
        dying = []
        for b, d, q in freed_refs:
            sid = b[n + d] + q
            freed = freer(sid)
            if freed is not None and freed[0] == k and sid not in keep:
                dying.append((b, d, q))
            if b is zeros:
                alike = False
            else:
                offsets.add(d)
                if freed is not None and freed[2]:
                    offsets.add(freed[2] - n)
        out.append((head, tail, born, dying))
    return out, tuple(sorted(offsets)) if alike else None


def checked(layout: Layout, cut: Any) -> bool:
    """Whether the stages' plans can be read from ``layout`` for ``cut``: every op of a layer on its layer's
    stage (the graph has its node), none of them shared."""
    found = cut.__dict__.get("_layout_checked")
    if found is None:
        op_in_small, _ = _in_small(layout, cut.small)
        events, shared = layout.tl.events, cut.shared
        # the ops that are not (a comprehension: a generator resumed for each of the layers' ops was most of this)
        found = not [te for segment in layout.segments if segment[0] == "sweep"
                     for x, y in segment[2].values() for te in range(x, y)
                     if not (op_in_small[te] and events[te].node not in shared)]
        found = found and not any(iteration(name) for name in cut.shared if name)
        cut.__dict__["_layout_checked"] = found
    return found

