"""A traced module under FSDP x pipeline: FSDP2's ``fully_shard`` on every stage of a p x N mesh, per rank.

Each stage is the traced module's cut of :mod:`.traced_pipeline` (its recorded two-micro-batch step cut by stage and
replayed in the schedule's order), with FSDP2's units around its ops as :mod:`symmem.passes.fsdp_pipeline` places
them for the built-in models (:class:`~symmem.passes.fsdp_pipeline._FsdpReplay`, the same hooks): each block of the
repeated run a unit, the stage's other parameters (the input layer on stage 0, the head on the last) the stage
root's, each parameter stored as its padded dim-0 shard and AdamW's state following the rank's unpadded rows
(:func:`~symmem.passes.data_parallel.held_shape`, as :mod:`.traced_fsdp` shards a traced module).  The stage's
optimizer step is the recorded steady step's ops for its parameters, each temporary of a parameter's size at the
rank's held rows.  The truth is :mod:`symmem.record.fsdp_pipeline_runs` running the module's manual split
(:class:`~symmem.record.traced_pipeline_runs.SequentialSplit`) with ``fully_shard`` on each of a stage's blocks and
on the stage root over ``mesh["dp"]`` (tests/test_fsdp_pipeline.py).

Measured (and so modelled) for a file module whose forward runs its children one after another and for Hugging
Face GPT-2, Llama, Mistral and Qwen2 (their manual splits, :class:`~symmem.record.traced_pipeline_runs.GPT2Split`
and :class:`~symmem.record.traced_pipeline_runs.LlamaSplit`: each Llama, Mistral or Qwen2 stage makes its own rotary
tables and mask), FP32, tied
parameters too (each stage's copy a parameter of its own stage's root, sharded there, never synchronized), and a
Hugging Face model's own loss (the schedule's ``loss_fn`` after the head: the stage root's post-forward before it);
another Hugging Face model's stages under FSDP are refused in one line.

>>> from symmem.training import Regime
>>> refusal(None, Regime(data_parallel="ddp")) is not None
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from ..errors import SymmemError
from ..passes.fsdp_pipeline import FsdpPipelineStep, _FsdpReplay, _Param, _Units
from ..passes.model_parallel import requires
from ..training import Regime
from .recording import StepRecord
from .traced_fsdp import parameters_of, within
from .traced_pipeline import (
    TracedCut,
    TracedPipelineStep,
    _owners,
    _step_peak,
    engine_refusal,
    own_loss,
    per_stage,
    stage_copies,
    stage_memory,
)
from .traced_step import StepPeak, _locate

#: the engines FSDP x pipeline places on every stage (FSDP2; reshard_after_forward or not)
ENGINES = ("fsdp", "fsdp-no-reshard")
#: the Hugging Face model types whose manual split was measured under FSDP x pipeline (record/traced_pipeline_runs)
MEASURED = {"gpt2": "GPT-2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def refusal(step: StepPeak | None, regime: Regime) -> str | None:
    """Why a traced module's FSDP x pipeline peak is not followed (None: it is); ``step`` None checks the regime
    only."""
    if regime.data_parallel not in ENGINES:
        return (f"the pipeline peak of a traced module is modelled with FSDP2 on every stage (fsdp, "
                f"fsdp-no-reshard), not data_parallel={regime.data_parallel!r}")
    if step is None:
        return None
    return engine_refusal(step, regime, "FSDP x pipeline", MEASURED)


class _TracedUnits(_Units):
    """FSDP2's units of one stage of a traced module at numbers: each block's parameters (the unit is the block's
    1-based index in the run) and the stage root's, with the rank's shards; each parameter's gradient is the storage
    the first micro-batch's backward made for it (its unit's, of its bytes)."""

    def __init__(self, rec: StepRecord, cut: TracedCut, module: Any, repeat: Any, s: int, world: int,
                 rank: int, untie: tuple[tuple[str, ...], ...] = ()) -> None:
        from ..passes.data_parallel import held_shape, shard_rows

        layers = rec.layers or {}
        owner = _owners(rec, cut)

        def unit_of(path: str) -> int | None:
            return next((k + 1 for child, k in layers.items() if within(path, child)), None)

        grads: dict[int | None, list[int]] = {}
        for i in _first_gradients(rec):
            grads.setdefault(unit_of(rec.storages[i].module), []).append(i)
        self.params: list[_Param] = []
        for p in parameters_of(rec, module, repeat, untie):
            if owner[p.sid] != s:
                continue
            unit = unit_of(p.name)
            mine = grads.get(unit, [])
            grad = next((g for g in mine if cut.size(g) == cut.size(p.sid)), None)
            if grad is None:
                raise SymmemError(f"FSDP's unit {p.name}: no gradient of its bytes was made by the recorded "
                                  "backward in its unit: the stage's gradients cannot be followed")
            mine.remove(grad)
            shard = int(shard_rows(p.shape, world)) * int(sympy.Mul(*p.shape[1:])) if p.shape else 1
            held = tuple(int(x) for x in held_shape(p.shape, world, rank))
            self.params.append(_Param(p.name, unit, shard, held, str(grad)))
        self._arrange(world)


def _first_gradients(rec: StepRecord) -> list[int]:
    """The gradient storages the first backward makes (the ``.grad`` of every parameter; the second micro-batch's
    are added into them)."""
    out: list[int] = []
    started = False
    for o in rec.ops:
        if o.phase == "backward":
            started = True
            out += [i for i in o.born if rec.storages[i].category == "gradient"]
        elif started:
            break
    return out


class _TracedFsdpReplay(_FsdpReplay):
    """:class:`~symmem.passes.fsdp_pipeline._FsdpReplay` on a traced cut: an op's unit is its block's (by the
    recorded op's module), the loss's ops are the recorded loss's, and a unit's first and last forward op are
    counted (an op's name may repeat within a unit)."""

    def __init__(self, cut: TracedCut, s: int, at: Mapping[str, int], schedule: str, m: int, units: _Units,
                 reshard: bool) -> None:
        self.units_of: dict[str, int | None] = {}
        self.loss: set[str] = set()
        # a Hugging Face model's own loss (cut.own): its forward's ops after the head's are the schedule's loss_fn's,
        # run on the stage's output outside the stage module (FSDP's root post-forward before them)
        after = {o.index for o in _after_head(cut.rec)} if cut.own else set()
        for o in cut.rec.ops:
            name = cut.tl.events[o.index].node
            if name is None:
                continue
            index = _locate(o, cut.rec.layers)[1]
            self.units_of[name] = index + 1 if index is not None else None
            if o.phase == "loss" or (o.phase == "backward" and not o.module) or o.index in after:
                self.loss.add(name)
        self.seen: dict[int | None, int] = {}
        super().__init__(cut, s, at, schedule, m, units, reshard)
        self.total: dict[int | None, int] = {}
        # a traced op's name repeats (GPT-2's block ends in the add its attention's residual also is), so the root's
        # post-forward is after the stage's last op before the loss by count, not by name
        self.model_ops = 0
        self.ran = 0
        for _, e in cut.passes[0]["F"]:
            if cut.on(e.node, s):
                unit = self._unit(e.node)
                self.total[unit] = self.total.get(unit, 0) + 1
                self.model_ops += not self._in_loss(e.node)

    def _unit(self, node: str | None) -> int | None:
        return self.units_of.get(node) if node is not None else None

    def _in_loss(self, node: str | None) -> bool:
        return node is None or node in self.loss

    def _is_first(self, unit: int | None, node: str | None) -> bool:
        return self.seen.get(unit) == 1

    def _is_last(self, unit: int | None, node: str | None) -> bool:
        return self.seen.get(unit) == self.total.get(unit)

    def _is_root_end(self, node: str | None) -> bool:
        return not self._in_loss(node) and self.ran == self.model_ops

    def begin(self, kind: str, mb: int) -> None:
        super().begin(kind, mb)
        self.seen = {}
        self.ran = 0

    def before(self, kind: str, node: str | None, mb: int) -> None:
        if kind == "F":
            unit = self._unit(node)
            self.seen[unit] = self.seen.get(unit, 0) + 1
            self.ran += not self._in_loss(node)
        super().before(kind, node, mb)


def _after_head(rec: StepRecord) -> list[Any]:
    """The ops of each forward after its last submodule's (a Hugging Face model's own loss after its head)."""
    out: list[Any] = []
    run: list[Any] = []
    for o in [*rec.ops, None]:
        if o is not None and o.phase == "forward":
            run.append(o)
            continue
        last = max((k for k, x in enumerate(run) if x.where), default=len(run))
        out += run[last + 1:]
        run = []
    return out


class _HeldSizes:
    """The cut's sizes with what the optimizer step makes for a parameter at the parameter's bytes taken at the
    rank's held rows (AdamW's temporaries over the unpadded shard), for :func:`~.traced_pipeline._step_peak`."""

    def __init__(self, cut: TracedCut, rec: StepRecord, units: _Units, names: Mapping[int, str]) -> None:
        self.cut = cut
        whole = {name: cut.size(sid) for sid, name in names.items()}
        held = {p.name: 4 * int(sympy.Mul(*p.held)) if p.held else 4 for p in units.params}
        self.scaled: dict[int, int] = {}
        for o in rec.ops:
            if o.phase == "step" and o.where in held:
                for i in o.born:
                    if cut.size(i) == whole[o.where]:
                        self.scaled[i] = held[o.where]

    def size(self, sid: int) -> int:
        return self.scaled.get(sid, self.cut.size(sid))


def _stage_at(at: Mapping[str, int], cut: TracedCut, s: int, units: _Units) -> dict[str, int]:
    """The stage's memory (:func:`~.traced_pipeline.stage_memory`) under FSDP: the shards for the weights (and
    their sharded gradients in the step), AdamW's state of the held rows, the step's temporaries at those rows."""
    from .traced_pipeline import _param_names

    rec = cut.rec
    weights, state = units.at_rest()
    rest = at["at_rest"] - at["parameters"] - at["optimizer_state"] + weights + state
    sizes = _HeldSizes(cut, rec, units, _param_names(rec))
    step = _step_peak(rec, sizes, s, _owners(rec, cut), rest + weights)  # type: ignore[arg-type]
    return {**at, "at_rest": rest, "parameters": weights, "gradients": weights, "optimizer_state": state,
            "step_peak": step}


@dataclass(eq=False)
class TracedFsdpPipelineStep(TracedPipelineStep, FsdpPipelineStep):
    """:class:`~symmem.passes.fsdp_pipeline.FsdpPipelineStep` of a traced module: every stage's replay
    (:class:`~.traced_pipeline.TracedCut`) with FSDP2's units of data-parallel rank ``rank``."""

    def _make_replays(self, numbers: Mapping[str, int]) -> list[Any]:
        assert self.step is not None
        p = numbers.get("p")
        rec = self._record(numbers)
        requires(p, rec.count, self.schedule, self.micro_batches)
        world = self._world(numbers)
        forward = [o for o in rec.ops if o.phase == "forward"]
        own = own_loss(self.step)  # the model's own loss: the schedule's loss_fn after the head (TracedCut)
        if forward and not forward[-1].module and not own:
            # FSDP's root pre-backward runs as the output's gradient is made; made by the module's own code, the
            # last stage's backward of that code and the loss's look alike (as for FSDP alone, importer/traced_fsdp)
            raise SymmemError(f"the FSDP x pipeline peak of a traced module follows a module whose output is made by "
                              f"a submodule (its head), not by its own code ({forward[-1].op})")
        cut = TracedCut(rec, int(p), numbers, own, per_stage(self.step))  # type: ignore[arg-type]
        untie = stage_copies(self.step.module, rec, cut, self.step.options.untie)
        if untie != self.step.options.untie:  # a tied parameter two modules of one stage share: one copy there
            self.step = dataclasses.replace(self.step, options=dataclasses.replace(self.step.options, untie=untie),
                                            _records={}, _peaks={}, _shared={})
            rec = self._record(numbers)
            cut = TracedCut(rec, int(p), numbers, own, per_stage(self.step))  # type: ignore[arg-type]
        out = []
        for s, at in enumerate(stage_memory(cut, self.micro_batches)):
            units = _TracedUnits(rec, cut, self.step.module, self.step.repeat, s, world, self.rank,
                                 self.step.options.untie)
            out.append(_TracedFsdpReplay(cut, s, _stage_at(at, cut, s, units), self.schedule, self.micro_batches,
                                         units, self.reshard))
        return out

    def _formula_extra(self, named: Mapping[str, int]) -> Any:
        """Each moment as a formula in the module's sizes and ``N`` (:class:`TracedFsdpFormulas`), the blocks at
        their number."""
        if type(self) is not TracedFsdpPipelineStep:
            return None
        return {"engine": TracedFsdpFormulas(self, named)}

    def _firsts(self, derivation: Any) -> list[Any]:
        assert self.step is not None
        rec = self._record({s.name: int(v) for s, v in derivation.numbers.items()})
        return [q.shape[0] for q in parameters_of(rec, self.step.module, self.step.repeat, self.step.options.untie)
                if q.shape]


def fsdp_pipeline_step(step: StepPeak, regime: Regime, numbers: Mapping[sympy.Symbol, int]) -> Any:
    """``step`` (one device's) as every rank's of FSDP2 on a p x N mesh of pipeline stages, or a
    :class:`~symmem.step.Refused` saying why not."""
    from ..step import Refused
    from .traced_pipeline import pipeline_step

    why = refusal(step, regime)
    if why is not None:
        return Refused(f"no peak: {why}")
    alone = pipeline_step(step, dataclasses.replace(regime, data_parallel=None), numbers)
    return TracedFsdpPipelineStep(None, None, {}, alone.regime, (), dict(numbers),  # type: ignore[arg-type]
                                  regime.pipeline_schedule, regime.micro_batches,
                                  reshard=regime.data_parallel == "fsdp", step=alone.step)


def _shard(shape: tuple[int, ...]) -> sympy.Expr:
    """A parameter's padded shard in elements, in ``N``: ``ceiling(d0/N)`` rows of its stored shape."""
    from ..passes.data_parallel import ceil_div
    from ..symbols import N

    return ceil_div(sympy.Integer(shape[0]), N) * int(sympy.Mul(*shape[1:])) if shape else sympy.Integer(1)


class TracedFsdpFormulas:
    """:class:`~symmem.passes.pipeline_formula.StageFormulas`' ``engine`` for FSDP2 on a traced module's stages
    (``step``: a :class:`TracedFsdpPipelineStep`, its data-parallel rank ``step.rank``): the recorded storages'
    sizes as the record's formulas in the module's sizes (:mod:`.traced_formula`), and FSDP's own -- the padded
    shards, the all-gather outputs and reduce-scatter inputs (``N`` shards of a unit), each unsharded parameter,
    the sharded gradients, AdamW's state of the rows the rank holds and the step's temporaries at those rows -- in
    ``N`` (a traced module's parameters have numbers for their shapes: ``ceiling(d0/N)`` rows; the last rank's
    rows as rank ``N - 1``'s, :func:`~symmem.passes.data_parallel.rank_of`).  The blocks at their number (said)."""

    def __init__(self, step: TracedFsdpPipelineStep, named: Mapping[str, int]) -> None:
        from .traced_formula import TracedFormulas

        self.step, self.named = step, dict(named)
        # the parts at rest and the optimizer step as TracedFormulas reads them, from this engine's stage memory
        self.base = TracedFormulas(step, named, self._memory, TracedCut._boundaries)
        self.count = self.base.count
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.units: dict[int, Any] = {}

    def _memory(self, cut: Any, m: int) -> list[dict[str, Any]]:
        """Each stage's parts under FSDP (:func:`_stage_at`'s), as sizes that carry their formulas."""
        from ..passes.data_parallel import held_shape, rank_of
        from ..symbols import N
        from .traced_formula import _Sized
        from .traced_pipeline import _param_names

        step = self.step
        assert step.step is not None
        rec = cut.rec
        world = step._world(self.named)
        rank = rank_of([step.rank], world)
        params = parameters_of(rec, step.step.module, step.step.repeat, step.step.options.untie)
        self.shapes = {q.name: q.shape for q in params}
        names = _param_names(rec)
        out = []
        for s, at in enumerate(stage_memory(cut, step.micro_batches)):
            units = self.units[s] = _TracedUnits(rec, cut._cut, step.step.module, step.step.repeat, s, world,
                                                 step.rank, step.step.options.untie)
            weights_n, state_n = units.at_rest()
            held = {q.name: held_shape(self.shapes[q.name], N, rank) for q in units.params}
            weights = _Sized(weights_n, sympy.Add(*(4 * _shard(self.shapes[q.name]) for q in units.params)))
            state = _Sized(state_n, sympy.Add(*(8 * sympy.Mul(*held[q.name]) + 4 for q in units.params)))
            rest = at["at_rest"] - at["parameters"] - at["optimizer_state"] + weights + state
            sizes = _HeldSizes(cut, rec, units, names)
            at_rows = {q.name: 4 * sympy.Mul(*held[q.name]) if held[q.name] else sympy.Integer(4)
                       for q in units.params}
            # the step's temporaries of a parameter at the rank's rows, each value with its formula in N
            for o in rec.ops:
                if o.phase == "step" and o.where in at_rows:
                    for i in o.born:
                        if i in sizes.scaled:
                            sizes.scaled[i] = _Sized(sizes.scaled[i], at_rows[o.where])
            top = _step_peak(rec, sizes, s, _owners(rec, cut), rest + weights)  # type: ignore[arg-type]
            out.append({**at, "at_rest": rest, "parameters": weights, "gradients": weights,
                        "optimizer_state": state, "step_peak": top})
        return out

    # the stage's replay and its parts: TracedFormulas' (its replay is this step's, FSDP's units around it)
    def replay(self, s: int, numbers: Any, packed: bool) -> Any:
        return self.base.replay(s, numbers, packed)

    def rest(self, memory: Any, s: int) -> sympy.Expr:
        return self.base.rest(memory, s)

    def outputs(self, memory: Any, s: int) -> sympy.Expr:
        return self.base.outputs(memory, s)

    def step_peak(self, memory: Any, s: int) -> sympy.Expr:
        return self.base.step_peak(memory, s)

    def state(self, memory: Any, s: int) -> sympy.Expr:
        return self.base.state(memory, s)

    def layer(self, node: str | None) -> int:
        return 0  # the blocks at their number

    def size(self, cut: Any, sid: int) -> sympy.Expr:
        return cut.tl.storages[sid].nbytes

    def snapshot(self, replay: Any) -> list[tuple[str, Any]]:
        """FSDP's storages alive at a moment of ``replay`` (their keys)."""
        return list(replay.held)

    def terms(self, held: Any, cut: Any, s: int) -> list[tuple[int, sympy.Expr, int]]:
        """FSDP's storages alive at stage ``s``'s moment, each in ``N``: an unsharded parameter (``N`` padded
        shards), a unit's all-gather output and reduce-scatter input (``N`` shards of it), its sharded gradients."""
        from ..symbols import N

        units = self.units[s]
        out = []
        for kind, key in held or ():
            if kind == "P" and isinstance(key, tuple):
                out.append((0, 4 * N * _shard(self.shapes[key[1]]), 1))
            elif kind in ("A", "R", "G"):
                times = 4 if kind == "G" else 4 * N
                out.append((0, sympy.Add(*(times * _shard(self.shapes[q.name]) for q in units.of(key))), 1))
        return out
