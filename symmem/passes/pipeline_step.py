"""The peak per device under pipeline parallelism, behind :class:`symmem.step.Step`: the largest stage's.

``torch.distributed.pipelining`` runs each stage on its own device; the number that must fit is the largest
stage's steady-step peak (:func:`symmem.passes.model_parallel.pipeline_peaks`: the single-device step cut by
stage and replayed in the schedule's order, checked to the byte against gloo runs).  That replay works at numbers;
every moment of it is a sum of storages, each affine in the batch ``B`` (one micro-batch) at fixed other sizes,
so the replay at ``B``, ``B + 1`` gives each moment as a line in ``B``, checked at ``B + 2``.  The peak is the
``Max`` of the lines no other bounds on ``B >= 1`` (what ``fit`` solves), the other sizes numbers: the formulas'
domain is those numbers (``S = 1024``, ...), and other numbers replay again.

Each moment's formula in the model's sizes (``L`` as ``L/p``; ``p``, ``M`` and the size conditions of the step's
copies at their numbers) is read from its stage's replay when first asked for (:mod:`.pipeline_formula`): what
the stage holds at rest plus the storages alive at that op, checked against the line; the bytes at these sizes
stay the lines'.  An engine around the stages adds what it holds there (DDP's buckets, ZeRO-1's own state; FSDP's,
DTensor's and the 3-D mesh's storages as formulas in ``N`` and ``t``: :mod:`.mesh_formula`); traced stages keep the
lines (the peak line says so).

The first step differs in one thing: no optimizer state exists during its pipeline phase.  Its optimizer step is
the steady one's: AdamW makes every parameter's state in ``_init_group`` before the first update
(:func:`symmem.passes.schedule.step_events` with ``first_step=True``: one ``init`` event, then each parameter's
temporaries), so every temporary lives beside the whole state, as in a steady step.  With the state gone from the
pipeline phase the optimizer step can be the first step's peak where it is not the steady one's: the first step's
lines are chosen on their own.  Both are exact per stage against the gloo runs, with ``PipelineStage`` given static
shapes (as torchtitan's) and without them: the engine's shape inference then runs in the first step, below the
schedule's own first micro-batch, and frees all it makes (measured, torch 2.13; docs/regimes.md).

>>> from symmem import derive
>>> d = derive("gpt2", pipeline_parallel=True, pipeline_schedule="gpipe", micro_batches=4, loss="cross-entropy",
...            attention="naive", dropout=0.0, device="cpu",
...            values={"B": 2, "S": 32, "H": 32, "h": 2, "L": 2, "V": 64, "F": 128, "p": 2})
>>> d.value("peak"), d.step.per_stage(d.numbers)["peak_per_stage"]
(1708088, [1708088, 1432668])
>>> d.peak_at().where(step=False)
'stage 0 of 2: pipeline h.mlp.gelu.out (layer 1), micro-batch 0'
>>> d.value("peak_first_step"), d.step.per_stage(d.numbers)["peak_first_step_per_stage"]  # no Adam state yet
(1327872, [1327872, 1314080])
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy

from ..errors import SymmemError
from ..graph import Graph
from ..peak import Moment, Peak
from ..timeline import Row, Which
from ..training import Regime

#: the symbol the lines are in: the batch one device processes at once (one micro-batch)
BATCH = "B"


@dataclass(frozen=True)
class StageMoment(Moment):
    """A moment of one stage's step (``phase``: ``pipeline`` or ``step``), with the stage and the micro-batch."""

    stage: int = 0
    stages: int = 1
    micro_batch: int | None = None
    #: what the formula holds at, in words (the schedule's numbers; a line in B where no formula was read):
    #: :mod:`.pipeline_formula`
    held_at: Callable[[], str] | None = field(default=None, compare=False, repr=False)

    def pinned(self) -> str:
        """What the moment's formula keeps at its numbers (``at p = 4, M = 4``), in words."""
        return self.held_at() if self.held_at is not None else ""

    def where(self, step: bool = True) -> str:
        layer = f" (layer {self.layer})" if self.layer else ""
        mb = f", micro-batch {self.micro_batch}" if self.micro_batch is not None else ""
        what = "the optimizer step" if self.phase == "step" else f"pipeline {self.node or ''}{layer}{mb}"
        if self.node == "merge_chunks":
            what = "the end of the schedule (every micro-batch's logits concatenated)"
        return f"stage {self.stage} of {self.stages}: {what}" + (f", {self.step} step" if step else "")


@dataclass(eq=False)
class PipelineStep:
    """The step of a model split into ``p`` stages (``numbers``: the derivation's, ``p`` included) under
    ``schedule`` with ``micro_batches`` per step; ``storages`` and ``options`` are the single-device
    derivation's (pytorch convention), ``regime`` without pipeline parallelism."""

    graph: Graph
    conv: Any
    options: Mapping[str, Any]
    regime: Regime
    storages: Sequence[Any]
    numbers: Mapping[sympy.Symbol, int]
    schedule: str
    micro_batches: int
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def _stages(self) -> Any:
        if "stages" not in self._cache:
            from .model_parallel import stages

            self._cache["stages"] = stages(self.graph, self.storages, self.regime, schedule=self.schedule,
                                           micro_batches=self.micro_batches,
                                           device=str(self.options.get("device", "cpu")))
        return self._cache["stages"]

    def _stage_memory(self, s: int, p: int) -> Any:
        """Stage ``s`` of ``p``'s memory among :meth:`_stages`' three (first, middle, last)."""
        from .model_parallel import memory_of

        return memory_of(self._stages(), s, p)

    def _replays(self, numbers: Mapping[str, int]) -> list[Any]:
        """Every stage's replay, run, at ``numbers`` (names -> values); the last 16 sets of numbers are kept."""
        key = tuple(sorted(numbers.items()))
        if key not in self._cache:
            found = self._make_replays(numbers)
            for r in found:
                r.peak = r.run()
            if len(self._cache) > 16:
                self._cache = {k: v for k, v in self._cache.items() if k in ("stages", "memo")}
            self._cache[key] = found
            settled()
        return self._cache[key]

    def _make_replays(self, numbers: Mapping[str, int]) -> list[Any]:
        """Every stage's replay at ``numbers``, not yet run: the graph's stages replayed."""
        from .model_parallel import replays, requires

        requires(numbers.get("p"), numbers.get("L"), self.schedule, self.micro_batches)
        return replays(self.graph, self.conv, self.options, self.regime, numbers, self._stages(),
                       schedule=self.schedule, micro_batches=self.micro_batches, memo=self._memo())

    def _batch_moments(self, named: Mapping[str, int], b: int) -> Any:
        """Every stage's moments and parts at ``B = b, b + 1, b + 2`` from one replay
        (:func:`~symmem.passes.model_parallel.batch_moments`), or ``None``: each replayed on its own
        (:meth:`_replays`; a subclass's replays, with an engine around the stages, always)."""
        if type(self)._make_replays is not PipelineStep._make_replays:
            return None
        from .model_parallel import requires
        from .pipeline_formula import keeping

        requires(named.get("p"), named.get("L"), self.schedule, self.micro_batches)
        numbers = [{**named, BATCH: b + k} for k in range(3)]
        # each stage's replay as batch_moments makes it, its plans kept for the moments' formulas (pipeline_formula)
        make, kept = keeping(self._stages(), numbers, self.schedule, self.micro_batches)
        return self._kept_moments(named, b, numbers, make, kept)

    def _kept_moments(self, named: Mapping[str, int], b: int, numbers: list[dict[str, int]], make: Any,
                      kept: list[Any]) -> Any:
        """:func:`~symmem.passes.model_parallel.batch_moments` of the stages at ``numbers``, each made by ``make``,
        which appends to ``kept`` what it made of a stage; where every stage was made, ``kept`` is stored for the
        moments' formulas (:func:`~symmem.passes.pipeline_formula.plans_key`)."""
        from .model_parallel import batch_moments
        from .pipeline_formula import plans_key

        out = batch_moments(self.graph, self.conv, self.options, self.regime, numbers, self._stages(),
                            schedule=self.schedule, micro_batches=self.micro_batches, memo=self._memo(), make=make)
        if out is not None and len(kept) == len(out) and len(numbers) == 3:
            self._cache[plans_key(named, b)] = kept
        return out

    def _memo(self) -> dict[Any, Any]:
        """What the replays at several sets of numbers share (the simulated single-device step: :class:`_Cut`)."""
        return self._cache.setdefault("memo", {})

    def _named(self, at: Mapping[sympy.Symbol, int] | None) -> dict[str, int]:
        return {s.name: int(v) for s, v in {**self.numbers, **(at or {})}.items()}

    def per_stage(self, numbers: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Each stage's steady-step peak at ``numbers`` (the largest is ``values.peak``) and first step's, and which
        stage that is, for the views."""
        found = [r.peak for r in self._replays(self._named(numbers))]
        top = max(found, key=lambda x: x.bytes)
        return {"peak_per_stage": [x.bytes for x in found], "peak_first_step_per_stage": [x.first for x in found],
                "peak_stage": top.stage,
                "peak_where": top.where, "pipeline_schedule": self.schedule, "micro_batches": self.micro_batches}

    def stage_moments(self, numbers: Mapping[sympy.Symbol, int], step: str = "steady") -> list[Moment]:
        """Each stage's largest moment of ``step`` at ``numbers`` (its formula: the stage's peak in the sizes, where
        the moments have formulas; :mod:`.pipeline_formula`), stage 0 first."""
        found = self.peak(numbers).moments
        out = []
        for s in sorted({getattr(m, "stage", 0) for m in found}):
            mine = [m for m in found if getattr(m, "stage", 0) == s and m.step == step]
            out.append(max(mine, key=lambda m: m.value(numbers)))
        return out

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None) -> Peak:
        named = self._named(at)
        key = ("peak", tuple(sorted(named.items())))
        if key not in self._cache:
            self._cache[key] = self._peak(named)
            settled()
        return self._cache[key]

    def _peak(self, named: dict[str, int]) -> Peak:
        if BATCH not in named:
            raise SymmemError("the pipeline peak is worked out in the batch B, which this model has not")
        b = named[BATCH]
        if not (b == 1 and self._no_line_from_one(named)):
            try:
                return self._lines(named, b, b)
            except _NotALine:
                if b != 1:
                    raise
        # a batch of one differs (PyTorch makes views, not copies, of size-1 dimensions: GPT-2's shifted labels'
        # contiguous()): B = 1 on its own, its bytes as they are
        return self._lines(named, b, None)

    def _lines(self, named: dict[str, int], b: int, line: int | None, given: Any = None) -> Peak:
        """The stages' moments as lines in B read at ``b``, ``b + 1`` and ``b + 2`` (``line`` None: the bytes at
        ``b`` alone, the domain B = b); the domain B >= 2 where ``b`` is, as a batch of one may differ.  ``given``:
        each stage's moments and parts at the three (at ``b`` three times where ``line`` is None), as
        :func:`~symmem.passes.model_parallel.batch_moments` gives them, read from a replay made already."""
        from .unroll import iteration, template

        found = given if given is not None else self._batch_moments(named, b) if line is not None else None
        packed = found is not None and line is not None
        if found is None:
            runs = [self._replays({**named, BATCH: b + k}) for k in (range(3) if line is not None else (0, 0, 0))]
            found = [([r[s].moments for r in runs], [r[s].at for r in runs]) for s in range(len(runs[0]))]
        batch = sympy.Symbol(BATCH, positive=True, integer=True)
        p = len(found)
        # each moment's formula in the sizes, read when first asked for (the stage alone: an engine around it adds
        # what its replay holds, not yet read as formulas)
        extra = self._formula_extra(named)
        sizes = None if extra is None else _StageFormulaMoments(self, named, b, line is not None and packed, batch,
                                                                 lined=line is not None, **extra)
        steady: list[Moment] = []
        first: list[Moment] = []
        for s, (rows, parts) in enumerate(found):
            state = parts[0]["optimizer_state"]
            uppers = self._stage_uppers(s, rows, parts, b)
            for which, found, upper in (("steady", steady, uppers[0]), ("first", first, uppers[1])):
                for (a, c, is_step), (node, mb) in upper.items():
                    label = None if node in (None, "merge_chunks") else node
                    layer = str(iteration(label)) if label and iteration(label) else ""
                    steady_a = a + (state if which == "first" and not is_step else 0)  # the same moment's
                    made = {} if sizes is None else sizes.of(s, steady_a, a, c, which == "first", is_step, node)
                    found.append(StageMoment("step" if is_step else "pipeline", step=which,
                                             node=template(label) if label else node,
                                             layer=layer, stage=s, stages=p, micro_batch=mb,
                                             **(made or {"live": {"live": a + c * batch},
                                                         "held_at": self._held_at(named)})))
        # a positive size's equation stays as it is: sympy's evaluation only asks the symbols' assumptions whether
        # it is decided (about a millisecond each)
        others = tuple(sympy.Eq(sympy.Symbol(n, positive=True, integer=True), v, evaluate=v < 1)
                       for n, v in sorted(named.items()) if n != BATCH and n in {s.name for s in self.numbers})
        on_b = (sympy.Eq(batch, b),) if line is None else (sympy.Ge(batch, 2),) if b >= 2 else ()
        return Peak(None, None, tuple(steady + first), others + on_b)

    def _no_line_from_one(self, named: Mapping[str, int]) -> bool:
        """Whether the moments at ``B = 1`` are known to lie on no lines through ``B = 2, 3`` (then B = 1 is read
        alone at once: the lines' attempt, a replay of every stage at three batches, would be refused)."""
        return False

    def _stage_uppers(self, s: int, rows: Any, parts: Sequence[Mapping[str, int]], b: int) -> tuple[Lines, Lines]:
        """Stage ``s``'s lines ``a + c*B`` that no other bounds, of the steady step and of the first, from its
        moments at ``B = b, b + 1, b + 2`` (``rows``) and its parts there (:func:`lines_of`)."""
        lines, firsts = lines_of(s, rows, b, parts[0]["optimizer_state"])
        return _upper(lines), _upper(firsts)

    def _formula_extra(self, named: Mapping[str, int]) -> dict[str, Any] | None:
        """What an engine around the stages keeps alive the whole step beyond a stage alone's, as formulas of the
        stage's memory at ``named``, and the stage's replay (:class:`~symmem.passes.pipeline_formula.StageFormulas`'
        keywords);
        None where the moments are not read as formulas (an engine whose replay does more than that: each moment
        stays a line in B)."""
        return {} if type(self) is PipelineStep else None

    def _held_at(self, named: Mapping[str, int]) -> Callable[[], str]:
        """Where a moment is a line in B (an engine around the stages): what it holds at, in words."""
        said = f"a line in B, the other sizes at their numbers, p = {named.get('p')}, M = {self.micro_batches}"
        return lambda: said

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        return self.peak().holds_at(numbers)

    def domain(self) -> tuple[sympy.Basic, ...]:
        return tuple(self.peak().domain)

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        raise SymmemError("a pipeline step's timeline is each stage's own: symmem stages gives every stage's "
                          "memory and peak")

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        raise SymmemError("the pipeline peak in CUDA's 512-byte blocks is not modelled: the peak per device is in "
                          "bytes of tensors")


def settled() -> None:
    """What the replays leave alive (their records, plans and moments, kept for the views' other numbers: tens of
    thousands of small objects) moved into the collector's oldest generation without a walk over it, as ``symmem
    trace`` does (:mod:`symmem.importer.collector`): the peak is worked out with the collector paused
    (:func:`symmem.graph.paused_gc`), and its first young pass afterwards walked all of it again and found no
    garbage (a tenth of the plain pipeline peak).  Cyclic garbage made meanwhile is found by the next full
    collection.  Objects the caller froze are left as they are.

    >>> import gc
    >>> settled(); gc.get_freeze_count()
    0
    """
    import gc

    if gc.get_freeze_count() == 0:
        gc.freeze()
        gc.unfreeze()


class _NotALine(SymmemError):
    """The stages' bytes read at three batches do not lie on lines."""


#: a stage's lines: ``(a, c, the optimizer step's)`` -> the first moment's (op, micro-batch) on the line ``a + c*B``
Lines = dict[tuple[int, int, bool], tuple[str | None, int | None]]


def lines_of(s: int, rows: Sequence[Sequence[tuple[int, str | None, int | None]]], b: int, state: int
             ) -> tuple[Lines, Lines]:
    """Stage ``s``'s moments at ``B = b, b + 1, b + 2`` (``rows``) as lines in B, of the steady step and of the
    first (``state``: the optimizer state its pipeline phase lacks); refused where they are not lines.  Of each
    slope, only the line largest at B = 1 (with the first moment on it): no other of that slope can be one that no
    other bounds (:func:`_upper`), and a stage's replay has thousands of moments on a few slopes.

    >>> lines_of(0, [[(10, "x", 0), (9, "y", 1), (20, None, None)], [(13, "x", 0), (12, "y", 1), (20, None, None)],
    ...              [(16, "x", 0), (15, "y", 1), (20, None, None)]], 1, 4)
    ({(7, 3, False): ('x', 0), (20, 0, True): (None, None)}, {(3, 3, False): ('x', 0), (20, 0, True): (None, None)})
    """
    if len({len(x) for x in rows}) != 1:
        raise _NotALine(f"stage {s}'s step differs between B = {b} and B = {b + 2}: its peak is not a line in B here")
    steady: dict[int, tuple[int, bool, tuple[str | None, int | None]]] = {}  # slope -> (a, the step's, moment)
    firsts: dict[int, tuple[int, bool, tuple[str | None, int | None]]] = {}
    for (v0, node, mb), (v1, _, _), (v2, _, _) in zip(*rows, strict=True):
        c = v1 - v0
        if v2 - v1 != c:
            raise _NotALine(f"stage {s}'s live bytes are not a line in B at {node}: no formula in B")
        is_step = node is None and mb is None
        a = v0 - b * c
        found = steady.get(c)
        if found is None or a > found[0]:
            steady[c] = (a, is_step, (node, mb))
        # the first step: no optimizer state during its pipeline phase, the same optimizer step (the module's
        # note); its own upper lines, as the step may bound them where it bounds no steady one
        if not is_step:
            a -= state
        found = firsts.get(c)
        if found is None or a > found[0]:
            firsts[c] = (a, is_step, (node, mb))
    return ({(a, c, step): where for c, (a, step, where) in steady.items()},
            {(a, c, step): where for c, (a, step, where) in firsts.items()})


def _upper(lines: Mapping[tuple[int, int, bool], Any]) -> dict[tuple[int, int, bool], Any]:
    """The lines ``a + c*B`` no other bounds for every ``B >= 1`` (one at least as large at 1 and as steep).

    Of the lines of one slope only the largest at 1 can be (the first of them, where several are): the rest are
    left out first (a stage has thousands of lines, a few slopes).

    >>> _upper({(5, 1, False): "a", (9, 0, False): "b", (2, 3, False): "c", (5, 1, True): "d", (1, 3, False): "e"})
    {(9, 0, False): 'b', (5, 1, False): 'a', (2, 3, False): 'c'}
    """
    best: dict[int, tuple[int, int, bool]] = {}  # slope -> its line largest at 1, the first of those
    for k in lines:
        found = best.get(k[1])
        if found is None or k[0] > found[0]:
            best[k[1]] = k
    # the largest at 1 (the steeper where two are: each slope is there once, so one), then the largest of those
    # steeper than it, ...: a line is kept where it is above every steeper line at 1, so one walk from the steepest
    # finds them (each picked above the one before, the slopes ascending: that order kept), without a walk over the
    # lines left for each line kept
    above: list[tuple[int, int, bool]] = []
    top = None
    for k in sorted(best.values(), key=_slope, reverse=True):
        if top is None or k[0] + k[1] > top:
            above.append(k)
            top = k[0] + k[1]
    return {k: lines[k] for k in reversed(above)}


def _slope(k: tuple[int, int, bool]) -> int:
    return k[1]


class _StageFormulaMoments:
    """The plain pipeline's moments with their formulas in the sizes (:mod:`.pipeline_formula`), built on first
    use; the bytes at the derivation's sizes stay the lines' (no formula is built to compare moments there)."""

    def __init__(self, step: PipelineStep, named: Mapping[str, int], b: int, packed: bool,
                 batch: sympy.Symbol, **extra: Any) -> None:
        from .pipeline_formula import StageFormulas

        self.formulas = StageFormulas(step, named, b, packed, **extra)
        self.batch = batch
        self.others = {sympy.Symbol(k, positive=True, integer=True): v for k, v in named.items() if k != BATCH}

    def of(self, s: int, a: int, line_a: int, c: int, first: bool, step: bool, node: str | None) -> dict[str, Any]:
        """A :class:`StageMoment`'s ``make``, ``measure``, ``live`` and ``held_at`` for stage ``s``'s moment whose
        steady line is ``a + c*B`` (``line_a + c*B`` in its own step)."""
        from ..peak import Lazy

        if not step:
            self.formulas.want(s, a, c, node)
        others, batch, formulas = self.others, self.batch, self.formulas

        def make() -> sympy.Expr:
            expr, _ = formulas.formula(s, a, c, first, step)
            return line_a + c * batch if expr is None else expr

        def held_at() -> str:
            expr, note = formulas.formula(s, a, c, first, step)
            return note if expr is not None else f"a line in B, the other sizes at their numbers, {formulas.pinned()}"

        def measure(numbers: Mapping[sympy.Symbol, int]) -> int | None:
            if batch not in numbers or any(numbers.get(k, v) != v for k, v in others.items()):
                return None  # other sizes: the moment's formula
            return line_a + c * int(numbers[batch])

        return {"make": make, "measure": measure, "live": Lazy(lambda: {"live": make()}), "held_at": held_at}
