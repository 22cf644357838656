"""A traced module under DDP x pipeline: ``DistributedDataParallel`` (or ``ZeroRedundancyOptimizer``: ZeRO-1) around
every pipeline stage of a p x N mesh, per rank.

Each stage is the traced module's cut of :mod:`.traced_pipeline` (its recorded two-micro-batch step cut by stage and
replayed in the schedule's order) with what :mod:`symmem.passes.ddp_pipeline` puts around a built-in model's stage,
the same replays: DDP's gradient buckets (the stage's gradients' bytes) alive the whole step, beside the gradients in
the optimizer step; under ``gradient_as_bucket_view`` (``ddp-bucket-view``) each ``.grad`` freed in the synced (last)
micro-batch's backward once the autograd node that made it has run (a traced op's name repeats within its node, so
after the node's last op), the step's gradients being the buckets; under ``zero-redundancy`` the rank's AdamW state
and its for-loop step of the whole parameters it owns
(:func:`~symmem.passes.zero_redundancy.partition` of the stage's ``parameters()``), stepped in its local
optimizer's order (largest first): the recorded step's ops of each owned parameter run in that order, what a
parameter's ops keep to the next parameter's (the for-loop's ``denom``) freed where the next one's ops free it.

The truth is :mod:`symmem.record.ddp_pipeline_runs` running the module's manual split
(:class:`~symmem.record.traced_pipeline_runs.SequentialSplit`) with each stage wrapped in
``DistributedDataParallel`` over ``mesh["dp"]`` (tests/test_ddp_pipeline.py): exact on every rank of a 2 x 2 gloo
mesh.  Measured for a file module whose forward runs its children one after another (a weight tied within a
stage and to the head: each stage's copy, as the pipeline alone counts it), for Hugging Face GPT-2 (its manual
split, :class:`~symmem.record.traced_pipeline_runs.GPT2Split`, tied or not, with the schedule's loss or the
model's own) and for Hugging Face Llama, Mistral and Qwen2
(:class:`~symmem.record.traced_pipeline_runs.LlamaSplit`: each stage makes its own position ids, mask and rotary
tables), FP32; another Hugging Face model's stages are refused in one line (not measured).

>>> from symmem.training import Regime
>>> refusal(None, Regime(data_parallel="fsdp")) is not None
True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy

from ..errors import SymmemError
from ..passes.ddp_pipeline import DdpPipelineStep, _ViewReplay
from ..passes.model_parallel import _Replay
from ..training import Regime
from .recording import StepRecord
from .traced_pipeline import (
    TracedCut,
    TracedPipelineStep,
    _owners,
    _param_names,
    _state_owners,
    engine_refusal,
)
from .traced_step import StepPeak

#: the engines DDP x pipeline places on every stage
ENGINES = ("ddp", "ddp-bucket-view", "zero-redundancy")
#: the Hugging Face model types whose manual split was measured under DDP x pipeline (record/traced_pipeline_runs)
MEASURED = {"gpt2": "GPT-2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


def refusal(step: StepPeak | None, regime: Regime) -> str | None:
    """Why a traced module's DDP x pipeline peak is not followed (None: it is); ``step`` None checks the regime
    only."""
    if regime.data_parallel not in ENGINES:
        return (f"the DDP x pipeline peak of a traced module is modelled for ddp, ddp-bucket-view and "
                f"zero-redundancy, not data_parallel={regime.data_parallel!r}")
    if step is None:
        return None
    return engine_refusal(step, regime, "DDP x pipeline", MEASURED)


def stage_parameters(cut: TracedCut) -> list[list[int]]:
    """Each stage's trainable parameter storages, in the order ``parameters()`` lists them (the recorded
    optimizer step's order)."""
    owner = _owners(cut.rec, cut)
    return [[sid for sid in _param_names(cut.rec) if owner[sid] == s] for s in range(cut.p)]


def owned(cut: TracedCut, params: Sequence[int], world: int, rank: int) -> list[int]:
    """The parameters of ``params`` (one stage's, :func:`stage_parameters`) ``ZeroRedundancyOptimizer``'s rank
    ``rank`` of ``world`` owns, in its local optimizer's order."""
    from ..passes.zero_redundancy import partition

    return [params[i] for i in partition([cut.size(sid) // 4 for sid in params], world)[rank]]


def ordered_step_peak(rec: StepRecord, cut: TracedCut, order: Sequence[str], base: int) -> int:
    """The largest moment of a steady optimizer step running the recorded step's ops of the parameters ``order``
    names, in that order, from ``base``: what one parameter's ops keep past them (the for-loop's ``denom``) is freed
    at the op of the next parameter in ``order`` that frees its predecessor's in the recorded step (every
    parameter's ops alike: one pattern, or an error) -- the recorded last parameter's too, which the recorded step
    frees at its own last op, the step's end (measured on HF Llama's last stage, where ZeRO-1's rank steps the head
    first: its ``denom`` alive through the next parameter's ``sqrt`` and ``div``, 1,984 B above the walk that
    freed it with the head).

    With ``order`` the recorded order it is :func:`~.traced_pipeline._step_peak`'s walk."""
    blocks: dict[str, list[Any]] = {}
    for o in rec.ops:
        if o.phase == "step" and o.step == 2 and o.where:
            blocks.setdefault(o.where, []).append(o)
    role = {i: (name, k, j) for name, ops in blocks.items() for k, o in enumerate(ops) for j, i in enumerate(o.born)}
    recorded = list(blocks)
    patterns = set()
    for before, name in zip(recorded, recorded[1:], strict=False):
        found = []
        for k, o in enumerate(blocks[name]):
            for i in o.freed:
                if i in role and role[i][0] != name:
                    if role[i][0] != before:
                        raise SymmemError(f"the recorded optimizer step frees at {name} what {role[i][0]} made: its "
                                          "parameters' order cannot be changed (ZeroRedundancyOptimizer's)")
                    found.append((k, role[i][1], role[i][2]))
        patterns.add(tuple(found))
    if len(patterns) > 1:
        raise SymmemError("the recorded optimizer step runs different ops per parameter: its parameters' order "
                          "cannot be changed (ZeroRedundancyOptimizer's)")
    pattern = patterns.pop() if patterns else ()
    # what the next parameter frees (the for-loop's denom): the recorded last parameter's own last op frees it too
    # (the step returns), which in another order is not the step's end -- it goes with the next one's
    carried = {(k2, j2) for _, k2, j2 in pattern}
    live = best = base
    kept: dict[tuple[int, int], int] = {}  # the previous parameter's storages still alive
    for name in order:
        mine: dict[tuple[int, int], int] = {}
        for k, o in enumerate(blocks[name]):
            for j, i in enumerate(o.born):
                mine[(k, j)] = cut.size(i)
                live += mine[(k, j)]
            best = max(best, live)
            for i in o.freed:
                if i in role and role[i][0] == name and role[i][1:] not in carried:
                    live -= mine.pop(role[i][1:], 0)
            for at, k2, j2 in pattern:
                if at == k:
                    live -= kept.pop((k2, j2), 0)
        kept = mine
    return best


def _zero_at(at: Mapping[str, int], cut: TracedCut, s: int, params: Sequence[int], world: int,
             rank: int) -> dict[str, int]:
    """Stage ``s``'s parts (``at``, the stage alone's) on ZeRO-1's rank ``rank``: AdamW's state of the parameters
    it owns, its step over them."""
    rec = cut.rec
    names = _param_names(rec)
    mine = owned(cut, params, world, rank)
    state = set(rec.state())
    by_name = {n: sid for sid, n in names.items()}
    made_for = _state_owners(rec, state)
    wanted = set(mine)
    opt = sum(cut.size(i) for i in state if by_name.get(made_for.get(i, ""), -1) in wanted)
    rest = at["at_rest"] - at["optimizer_state"] + opt
    step = ordered_step_peak(rec, cut, [names[sid] for sid in mine], rest + at["gradients"])
    return {**at, "at_rest": rest, "optimizer_state": opt, "step_peak": step}


class _TracedViewReplay(_ViewReplay):
    """:class:`~symmem.passes.ddp_pipeline._ViewReplay` on a traced cut: the reducer's hook takes a gradient once
    the autograd node that made it has run, so the gradients an op of a node made go after the node's last op
    (its consecutive ops under one autograd node and module: ``mm`` and ``sum`` of one ``AddmmBackward0``)."""

    def __init__(self, cut: TracedCut, s: int, at: Mapping[str, int], schedule: str, m: int) -> None:
        super().__init__(cut, s, at, schedule, m)  # type: ignore[arg-type]
        # each op's autograd node and module (a backward op's name is "op (node) in module")
        self.node_of = {e.node: (o.where, o.module) for o, e in zip(cut.rec.ops, cut.tl.events, strict=True)}
        self.names: list[str | None] = []
        self.at_op = 0
        self.pending: list[str] = []

    def begin(self, kind: str, mb: int) -> None:
        super().begin(kind, mb)
        self.names = [node for node, _, _ in self._plan(0 if mb == 0 else 1, kind)]
        self.at_op = 0
        self.pending = []

    def after(self, kind: str, node: str | None, mb: int) -> None:
        k = self.at_op
        self.at_op += 1
        if node is None or not self.last:
            return
        self.pending.append(node)
        if k + 1 < len(self.names) and self.node_of.get(self.names[k + 1]) == self.node_of.get(node):
            return  # the node's next op: its gradients go to the reducer after the node's last
        for name in self.pending:
            super().after(kind, name, mb)
        self.pending = []


@dataclass(eq=False)
class TracedDdpPipelineStep(TracedPipelineStep, DdpPipelineStep):
    """:class:`~symmem.passes.ddp_pipeline.DdpPipelineStep` of a traced module: every stage's replay
    (:class:`~.traced_pipeline.TracedCut`) with DDP's buckets; under ``zero`` data-parallel rank ``rank``'s owned
    parameters' state and step."""

    def _make_replays(self, numbers: Mapping[str, int]) -> list[Any]:
        world = numbers.get("N")
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise SymmemError(f"DDP x pipeline needs N >= 1 data-parallel ranks a stage, got N={world}")
        alone, whole = self._cut(numbers)
        out = []
        for replay, params in zip(alone, whole, strict=True):
            cut, s = replay.cut, replay.s
            at = self._engine_at(replay.at, cut, s, params, world)
            kind = _TracedViewReplay if self.view else _Replay
            out.append(kind(cut, s, at, self.schedule, self.micro_batches))  # type: ignore[arg-type]
        return out

    def _engine_at(self, alone: Mapping[str, Any], cut: Any, s: int, params: Sequence[int], world: int
                   ) -> dict[str, Any]:
        """Stage ``s``'s parts (``alone``: the stage alone's) on this rank: DDP's buckets, ZeRO-1's owned state and
        step.  Sizes or formulas alike: on a cut whose sizes carry their formulas (:mod:`.traced_formula`) the
        parts are formulas in the module's sizes too."""
        at = dict(alone)
        at["gradients"] = at["parameters"]  # FP32 AdamW: each trainable parameter's gradient its size
        if self.zero:
            at = _zero_at(at, cut, s, params, world, self.rank)
        # DDP's buckets: every trainable parameter's gradient once, the stage's gradients' bytes
        at["ddp_buckets"] = at["gradients"]
        at["at_rest"] += at["ddp_buckets"]
        if not self.view:  # under the bucket view the step's gradients are the buckets
            at["step_peak"] += at["ddp_buckets"]
        return at

    def _formula_extra(self, named: Mapping[str, int]) -> Any:
        """Each moment as a formula in the module's sizes (:mod:`.traced_formula`): the stage's parts at rest with
        this rank's engine (:meth:`_engine_at` on the cut whose sizes carry their formulas), the blocks at their
        number; ZeRO-1's partition at these sizes (said)."""
        if type(self) is not TracedDdpPipelineStep:
            return None
        from .traced_formula import TracedFormulas
        from .traced_pipeline import stage_memory

        world = self._world(named)

        def memory(cut: Any, m: int) -> list[dict[str, Any]]:
            whole = stage_parameters(cut)
            return [self._engine_at(at, cut, s, whole[s], world) for s, at in enumerate(stage_memory(cut, m))]

        said = {"said": "ZeroRedundancyOptimizer's partition at these sizes"} if self.zero else {}
        return {"engine": TracedFormulas(self, named, memory, TracedCut._boundaries), **said}

    def _cut(self, numbers: Mapping[str, int]) -> Any:
        """The stage alone's replays (not run) and each stage's parameters at ``numbers``, shared by every
        data-parallel rank's step."""
        cuts = self._cache.setdefault("cuts", {})
        key = tuple(sorted(numbers.items()))
        if key not in cuts:
            if len(cuts) > 8:
                cuts.clear()
            alone = TracedPipelineStep._make_replays(self, numbers)
            cuts[key] = (alone, stage_parameters(alone[0].cut))
        return cuts[key]

    def _alike(self, named: Mapping[str, int]) -> list[list[int]]:
        """The data-parallel ranks grouped by the parameters each owns on every stage (DDP: all alike)."""
        world = int(named["N"])
        if not self.zero:
            return [list(range(world))]
        alone, whole = self._cut(named)
        groups: dict[Any, list[int]] = {}
        for r in range(world):
            held = tuple(tuple(owned(alone[0].cut, params, world, r)) for params in whole)
            groups.setdefault(held, []).append(r)
        return list(groups.values())


def ddp_pipeline_step(step: StepPeak, regime: Regime, numbers: Mapping[sympy.Symbol, int]) -> Any:
    """``step`` (one device's) as every rank's of DDP (or ZeRO-1) on a p x N mesh of pipeline stages, or a
    :class:`~symmem.step.Refused` saying why not."""
    from ..step import Refused
    from .traced_pipeline import pipeline_step

    why = refusal(step, regime)
    if why is not None:
        return Refused(f"no peak: {why}")
    alone = pipeline_step(step, dataclasses.replace(regime, data_parallel=None), numbers)
    dp = regime.data_parallel
    return TracedDdpPipelineStep(None, None, {}, alone.regime, (), dict(numbers),  # type: ignore[arg-type]
                                 regime.pipeline_schedule, regime.micro_batches, zero=dp == "zero-redundancy",
                                 view=dp == "ddp-bucket-view", step=alone.step)
