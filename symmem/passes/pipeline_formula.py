"""The pipeline peak's moments as formulas in the model's sizes (B, S, H, F, V, h, G and L), not lines in B.

:class:`~symmem.passes.pipeline_step.PipelineStep` reads every stage's moments at numbers, as lines in ``B``.  A
moment's bytes are what its stage holds at rest (:class:`~symmem.passes.model_parallel.StageMemory`'s parts,
formulas in the sizes and ``p``) plus the storages alive at that op of the replay, each a size of the
single-device step's timeline (a formula in the sizes).  So a moment's formula is its stage's replay run again up
to that moment, with what is alive there read off (:class:`_Snapshot`) and summed as formulas.

The layers of a stage are alike: the replay at ``n = L/p`` layers per stage holds the same storages in every layer
of a run of layers between the stage's first layer, the moment's own and the stage's last (a micro-batch's
finished layers, the other micro-batches' in flight, the gradients made so far).  Where one such run is alike
layer by layer, the moment at ``L/p`` layers holds its bytes plus ``(L/p - n)`` more of that run's layers: the
formula is in ``L`` (the moment stays the op of the stage's first or last layer, or the same distance from the
nearer end).  Where no run shows that (``L/p < 3``), ``L`` keeps its number.

The schedule is at numbers: ``p`` and ``M`` decide which micro-batches are in flight, so the formula holds at
those (the peak line says so).  Every formula is checked against the line it replaces at the batches it was
read at; one that differs is not used (the line stays, said so).

>>> from symmem import derive
>>> d = derive("gpt2", pipeline_parallel=True, pipeline_schedule="gpipe", micro_batches=2, loss="cross-entropy",
...            attention="naive", dropout=0.0, device="cpu",
...            values={"B": 2, "S": 32, "H": 32, "h": 2, "L": 6, "V": 64, "F": 128, "p": 2})
>>> m = d.peak_at()
>>> m.where(step=False), m.pinned()
('stage 0 of 2: pipeline h.mlp.gelu.out (layer 3), micro-batch 0', 'at p = 2, M = 2')
>>> sorted(s.name for s in m.total.free_symbols)
['B', 'F', 'H', 'L', 'S', 'V', 'h', 'p']
>>> d.evaluate(m.total) == d.value("peak")
True
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy

from ..evaluator import interpret
from .model_parallel import _REPLAYED, _Cut, _pack, _PackedCut, _Replay, memory_of, pack_parts


def _symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, positive=True, integer=True)


class _Done(Exception):
    """Every moment asked for was seen: the rest of the replay is not run."""


class _Watch(list):
    """A replay's moments list that keeps nothing but, at the first moment showing each of ``targets`` (live
    bytes, packed where the cut is packed -> the lines wanted there and the op each was read at), the storages alive
    there (the moment :mod:`.pipeline_step` reads a line from is the first one with those bytes at that op: two
    lines read from replays on their own can cross at the one batch replayed here): a list, so the replay's own
    loop (``_Replay._alone``) runs as it is."""

    def __init__(self, replay: _Replay, targets: Mapping[int, list[tuple[Any, str | None]]],
                 engine: Any = None) -> None:
        super().__init__()
        self.replay, self.alive, self.targets, self.engine = replay, replay.alive, targets, engine
        self.seen: dict[Any, tuple[str | None, list[int]]] = {}
        self.held: dict[Any, Any] = {}  # what an engine around the stage holds there (its own storages)
        self.tick = getattr(engine, "tick", None)  # told of every moment (which of an op's appends this is)
        self.wanted = sum(len(v) for v in targets.values())

    def append(self, item: tuple[int, str | None, int | None]) -> None:
        if self.tick is not None:
            self.tick(self.replay)
        found = self.targets.get(item[0])
        if found is None:
            return
        for key, node in found:
            if node == item[1] and key not in self.seen:
                # the replay appends a moment with what it made alive and before what it frees: its storages
                self.seen[key] = (item[1], [sid for _, sid in self.alive])
                if self.engine is not None:
                    self.held[key] = self.engine.snapshot(self.replay)
        if len(self.seen) == self.wanted:
            raise _Done


def plans_key(named: Mapping[str, int], b: int) -> tuple[Any, ...]:
    """Where a step keeps each stage's makings of its packed replay at ``named`` read from ``B = b``
    (:func:`keeping`'s list, an engine's own): what a moment's formula is read from again."""
    return ("plans", tuple(sorted(named.items())), b)


def keeping(found: Sequence[Any], numbers: Sequence[Mapping[str, int]], schedule: str, m: int
            ) -> tuple[Any, list[tuple[Any, dict[str, int], Any]]]:
    """:func:`~symmem.passes.model_parallel.batch_moments`' ``make`` for a stage alone (what it does without one),
    and the list it fills with each stage's packed cut, parts and plans (``_Replay._events``: a snapshot replay
    walks them again without working them out)."""
    kept: list[tuple[Any, dict[str, int], Any]] = []
    parts: dict[int, list[dict[str, int]]] = {}

    def make(packed: Any, cuts: Any, s: int) -> Any:
        k = 0 if s == 0 else len(found) - 1 if s == packed.p - 1 else 1
        if k not in parts:
            parts[k] = found[k].at_each(numbers, _REPLAYED)
        replay = _Replay(packed, s, pack_parts(parts[k]), schedule, m)
        kept.append((packed, replay.at, replay._events))
        return replay, parts[k]

    return make, kept


class StageFormulas:
    """The formulas of a pipeline step's moments at ``named`` (names -> numbers), read from each stage's replay
    when first asked for; ``packed``: the lines were read from one packed replay of ``B = b, b + 1, b + 2``
    (:func:`~symmem.passes.model_parallel.batch_moments`), else from the replay at ``b`` alone."""

    def __init__(self, step: Any, named: Mapping[str, int], b: int, packed: bool,
                 extra: Callable[[Any, int], sympy.Expr] | None = None,
                 step_extra: Callable[[Any, int], sympy.Expr] | None = None, replay: type = _Replay,
                 state: Callable[[Any, int], sympy.Expr] | None = None, said: str = "", engine: Any = None,
                 lined: bool | None = None) -> None:
        self.step, self.named, self.b, self.packed = step, dict(named), b, packed
        #: the lines were read at three batches (packed, or three replays on their own: each formula is checked at
        #: the three), else at ``b`` alone
        self.lined = packed if lined is None else lined
        #: what an engine around the stage keeps alive the whole step beyond the stage alone (DDP's gradient
        #: buckets), as a formula of stage ``s``'s memory: in every moment of the schedule (``extra``: the replay read
        #: here holds the stage's own only) and of the optimizer step (``step_extra``); ``replay``: the stage's
        #: replay (the bucket view's frees the gradients it hands to the buckets); ``state``: the optimizer state
        #: the first step's schedule lacks (ZeRO-1: the rank's own); ``said``: what else the formulas hold at
        self.extra, self.step_extra, self.replay = extra or _nothing, step_extra or _nothing, replay
        self.state, self.said = state or _state, said
        #: an engine whose replay holds storages of its own around the stage's ops (FSDP's all-gathers, ...): it
        #: makes the stage's replay and says, as formulas, what it holds at rest, in the optimizer step and at a
        #: moment (:class:`~symmem.passes.mesh_formula.FsdpFormulas`); None: the stage alone (with ``extra``)
        self.engine = engine
        self.wanted: dict[int, dict[tuple[int, int], str | None]] = defaultdict(dict)  # stage -> (a, c) -> node
        self.made: dict[int, dict[tuple[int, int], tuple[sympy.Expr | None, str]]] = {}

    def want(self, s: int, a: int, c: int, node: str | None) -> None:
        """Stage ``s``'s pipeline moment ``a + c*B`` (op ``node``: ``merge_chunks`` or a layer's) is asked for."""
        self.wanted[s][(a, c)] = node

    def pinned(self) -> str:
        """What the schedule keeps at its numbers, and the size conditions the step's copies were decided by where
        they are not the batch's (``Ne(G, 1) & Ne(h/G, 1)``: a grouped-query attention's copies; the domain says
        ``B >= 2``)."""
        held = dict.fromkeys(x for c, v in getattr(self, "branch", {}).items() if c.free_symbols - {_symbol("B")}
                             for x in _said(c, v))
        return ", ".join([f"p = {self.named['p']}", f"M = {self.step.micro_batches}", *held,
                          *([self.said] if self.said else [])])

    def formula(self, s: int, a: int, c: int, first: bool, step: bool) -> tuple[sympy.Expr | None, str]:
        """Stage ``s``'s moment ``a + c*B`` (steady; ``first``: the first step's, with no optimizer state in the
        pipeline phase) as a formula and what it holds at (None: no formula, the line stays)."""
        found = self.step._stages()  # None: a traced module's (its engine reads its record)
        memory = memory_of(found, s, int(self.named["p"])) if found is not None else None
        if step:  # the optimizer step: every gradient and the step's temporaries beside what lives at rest
            key = (s, "step")
            if key not in self.__dict__.setdefault("_bases", {}):
                made = sympy.expand(self.engine.step_peak(memory, s) if self.engine is not None else
                                    memory.step_peak + self.step_extra(memory, s))
                self._bases[key] = made if self._holds(made, {}, (a, c)) else None
            if self._bases[key] is None:
                return None, ""
            return self._bases[key], f"at {self.pinned()}"
        if s not in self.made:
            self.made[s] = self._stage(s, memory)
        expr, note = self.made[s].get((a, c), (None, ""))
        if expr is not None and first:
            expr = expr - (self.engine.state(memory, s) if self.engine is not None else self.state(memory, s))
        return expr, note

    def _numbers(self) -> list[dict[str, int]]:
        return [{**self.named, "B": self.b + k} for k in (range(3) if self.packed else range(1))]

    def _checked(self) -> list[dict[str, int]]:
        """The batches a formula is checked at: the three its line was read at (from one packed replay or three
        replays on their own), or ``b`` alone (a batch of one: the domain is B = 1)."""
        return [{**self.named, "B": self.b + k} for k in (range(3) if self.lined else range(1))]

    def _stage(self, s: int, memory: Any) -> dict[tuple[int, int], tuple[sympy.Expr | None, str]]:
        step = self.step
        numbers = self._numbers()
        key = plans_key(self.named, self.b)
        kept = (step._cache.get(key) or step._memo().get(key)) if self.packed else None
        engine = self.engine
        if engine is not None:  # the engine's replay of the stage (it holds the whole moment), from its makings
            replay = engine.again(kept[s], s) if kept is not None else engine.replay(s, numbers, self.packed)
            cut = replay.cut
        else:
            if kept is not None:  # the replay that read the lines: its cut and plans
                cut, at, events = kept[s]
            else:
                cuts = [_Cut(step.graph, step.conv, step.options, step.regime, n, step._memo()) for n in numbers]
                cut = _PackedCut(cuts) if self.packed else cuts[0]
                at = (pack_parts(memory.at_each(numbers, _REPLAYED)) if self.packed else
                      memory.at(numbers[0], _REPLAYED))
                events = {}
            replay = self.replay(cut, s, at, step.schedule, step.micro_batches)
            replay._events = events
        self.branch = getattr(cut, "branch", {})  # the size conditions the step's copies were decided by
        targets: dict[int, list[tuple[Any, str | None]]] = {}
        for k, node in self.wanted[s].items():
            targets.setdefault(self._live(*k, memory, s), []).append((k, node))
        watch = replay.moments = _Watch(replay, targets, self.engine)
        try:
            replay.run()
        except _Done:
            pass
        out = {}
        for key, (node, sids) in watch.seen.items():
            out[key] = self._made(cut, s, sids, node, memory, key, watch.held.get(key))
        return out

    def _live(self, a: int, c: int, memory: Any, s: int) -> int:
        """The moment ``a + c*B``'s bytes as the snapshot replay (the stage alone) holds them (packed at the three
        batches)."""
        extra = self.extra(memory, s) if self.engine is None else 0
        values = [a + c * n["B"] - (math.ceil(interpret(extra, {_symbol(k): v for k, v in n.items()})) if extra
                                    else 0) for n in self._numbers()]
        return _pack(values) if self.packed else values[0]

    def _made(self, cut: Any, s: int, sids: Sequence[int], node: str | None, memory: Any,
              line: tuple[int, int], held: Any = None) -> tuple[sympy.Expr | None, str]:
        """The moment's formula: in ``L`` where a run of alike layers shows what a layer more holds, else with
        ``L`` at its number; the first whose bytes are the line's at the numbers (None: neither)."""
        from .unroll import iteration

        tl, per = cut.tl, getattr(cut, "per", 0)  # a traced cut has no unrolled layers (engine.layer: 0)
        fixed: Counter = Counter()
        layers: dict[int, Counter] = defaultdict(Counter)
        engine = self.engine
        size = engine.size if engine is not None else None  # a storage's bytes on the engine's rank
        for sid in sids:
            st = tl.storages[sid]
            k = iteration(st.name)
            (layers[k - s * per] if k else fixed)[st.nbytes if size is None else size(cut, sid)] += 1
        for k, nbytes, count in engine.terms(held, cut, s) if engine is not None else ():
            (layers[k - s * per] if k else fixed)[nbytes] += count  # the engine's own storages, by layer
        total = sum(layers.values(), fixed)
        at = f"at {self.pinned()}"
        mine = engine.layer(node) if engine is not None else iteration(node) if node else 0
        own = mine - s * per if mine else None
        run = _run(layers, per, own, trim=engine is not None)
        base = self._base(memory, s, node == "merge_chunks")
        # both formulas below are, at the numbers (where L/p is ``per``), the base and every storage alive: checked
        # once, term by term (interpreting the whole sum at each batch was most of a formula's time)
        if not self._holds(base, total, line):
            return None, ""
        if run is not None:
            # the numbers' layers, less ``per`` of the run's, plus L/p of them (Counter arithmetic: no expand)
            one = layers[run[0]]
            rest = Counter(total)
            rest.subtract({e: per * k for e, k in one.items()})
            per_stage = _symbol("L") / _symbol("p")
            return sympy.Add(base, *(k * e for e, k in rest.items() if k),
                             *(per_stage * k * e for e, k in one.items())), at
        count = getattr(engine, "count", "L")  # the layers' symbol (a traced module's own)
        if count not in self.named:
            return sympy.Add(base, *(k * e for e, k in total.items())), at
        lone = {_symbol(count): sympy.Integer(self.named[count])}
        expr = sympy.Add(sympy.expand(base.xreplace(lone)), *(k * e for e, k in total.items()))
        return expr, f"{at}, {count} = {self.named[count]}"

    def _base(self, memory: Any, s: int, merged: bool) -> sympy.Expr:
        """What the stage holds at rest, less the last step's logits unless ``merged`` (they are concatenated
        again at the end of the schedule), expanded once."""
        key = (s, merged)
        found = self.__dict__.setdefault("_bases", {}).get(key)
        if found is None and self.engine is not None:  # expanded already
            found = self._bases[key] = self.engine.rest(memory, s) - (0 if merged else self.engine.outputs(memory, s))
        elif found is None:
            found = self._bases[key] = sympy.expand(memory.at_rest - (0 if merged else memory.outputs)
                                                    + self.extra(memory, s))
        return found

    def _holds(self, base: sympy.Expr, terms: Mapping[sympy.Expr, int], line: tuple[int, int]) -> bool:
        """Whether ``base`` plus ``terms`` (bytes -> how many) is the line ``a + c*B`` at the batches it was read
        at (each term's bytes interpreted once a batch: the stage's storages share a few sizes)."""
        a, c = line
        values = self.__dict__.setdefault("_values", {})
        for k, n in enumerate(self._checked()):
            env = {_symbol(x): v for x, v in n.items()}
            try:
                v = interpret(base, env)
                for e, count in terms.items():
                    key = (k, e)
                    if key not in values:
                        values[key] = interpret(e, env)
                    v += count * values[key]
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                return False
            if v != a + c * n["B"]:
                return False
        return True


def _nothing(memory: Any, s: int) -> sympy.Expr:
    """No bytes beyond the stage's own (the stage alone)."""
    return sympy.Integer(0)


def _state(memory: Any, s: int) -> sympy.Expr:
    """The stage's optimizer state (what the first step's schedule lacks)."""
    return memory.optimizer_state


def _said(cond: Any, value: bool) -> list[str]:
    """A size condition that holds (``value``) or fails, in words: its parts where a failing ``Or`` (a holding
    ``And``) says each fails (holds).

    >>> from symmem.symbols import G, h
    >>> _said(sympy.Or(sympy.Eq(G, 1), sympy.Eq(h / G, 1)), False)
    ['G != 1', 'h/G != 1']
    """
    if isinstance(cond, sympy.Or if not value else sympy.And):
        return [x for c in cond.args for x in _said(c, value)]
    if isinstance(cond, sympy.Eq):
        return [f"{cond.lhs} {'=' if value else '!='} {cond.rhs}"]
    return [str(cond) if value else f"not {cond}"]


def _run(layers: Mapping[int, Counter], per: int, own: int | None, trim: bool = False) -> list[int] | None:
    """The stage's layers (1 to ``per``) between its first, its last and the moment's own (``own``; None outside
    the layers) that grow with ``L/p``: those after the moment's layer where it is nearer the first, else those
    before it; None where that run is empty or its layers are not alike.  ``trim`` (an engine around the stage):
    without the layers next to the moment's, which hold what its op does to its neighbours (the gradient a
    backward receives from the layer after, FSDP's prefetch of the layer before), alike or not at these sizes.

    >>> a, b = Counter({8: 1}), Counter({8: 1, 4: 1})
    >>> _run({2: a, 3: a, 4: b}, 6, 5), _run({2: a, 3: a, 4: b}, 6, 5, trim=True)
    (None, [2, 3])
    """
    if own is None or own in (1, per):
        found = list(range(2, per))
    elif own - 1 <= per - own:
        found = list(range(own + 1, per))
    else:
        found = list(range(2, own))
    if trim and own is not None:
        found = [k for k in found if abs(k - own) > 1]
    if not found or any(layers.get(k, Counter()) != layers.get(found[0], Counter()) for k in found):
        return None
    return found
