"""FSDP x pipeline measured per rank: FSDP2's ``fully_shard`` on each pipeline stage of a p x N mesh.

The engine is torchtitan's recipe: ``init_device_mesh("cpu", (p, N), mesh_dim_names=("pp", "dp"))``; each rank
builds its stage of the reference model as symmem's pipeline runs split it
(:func:`symmem.record.model_parallel_runs._stage_module`: the embedding on the first stage, the final norm and the
head on the last, ``L/p`` layers each), ``fully_shard(block, mesh=mesh["dp"])`` on each of its layers and on the
stage root, then ``PipelineStage`` (static shapes, as torchtitan gives them, over ``mesh["pp"]``) and
``ScheduleGPipe`` / ``Schedule1F1B`` with ``M`` micro-batches.  ``PipelineStage.backward_maybe_with_nosync`` turns
off FSDP's gradient sync and its reshard after backward for every micro-batch: the unsharded gradients accumulate
across micro-batches and ``perform_reduce_grad`` reshards and reduce-scatters every unit once, after the last
backward (torch 2.13).

:func:`fsdp_pipeline_runs` starts ``p*N`` processes in one gloo group on 127.0.0.1 (bounded waits), and in each
rank runs one unrecorded step (FSDP's lazy initialization, the stage's receive buffers), then records
:func:`mesh_repeats` steps each with a new for-loop AdamW (a first step) and steady ones with the last one, under
the DTensor- and FSDP-aware recorder (:class:`~symmem.record.sharded.ShardTracker`), every rank's collectives under
:func:`~.model_parallel_runs.released_collectives` (their tensors freed on the recording thread, at a fixed op): one
first and one steady step on a p x N mesh; with tensor parallelism (DTensor's functional collectives, not wrapped)
three of each, each moment at its fewest bytes over the repeats.  gloo's copy of the reduce-scatter input is left
out, as for FSDP2 alone.  Needs ``torch`` with ``torch.distributed`` (imported lazily).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError
from . import model_parallel_runs as _runs
from .model_parallel_runs import _fewest_at

#: (model, sizes, schedule, micro-batches M, loss, reference options, reshard_after_forward), or a traced module's
#: (:class:`~symmem.record.traced_pipeline_runs.TracedCase`, reshard_after_forward): its manual split's stages; a
#: case of :mod:`.ddp_pipeline_runs` (its engine's name last) runs in the same spawn as that module runs it
Case = tuple[str, Mapping[str, int], str, int, str, Mapping[str, Any], bool] | tuple[Any, bool]


@dataclass(frozen=True)
class StageMeshRun:
    """One rank's FSDP x pipeline step: its place on the mesh (stage ``pp``, data-parallel rank ``dp``), the local
    bytes of its parameters (padded shards) and AdamW's state, the first and steady step's peaks (each moment at
    its fewest bytes over the repeats) with where each is (phase, op), and the steady step's largest moment of the
    schedule and of the optimizer step."""

    rank: int
    pp: int
    dp: int
    parameters: int
    optimizer_state: int
    first_peak: int
    steady_peak: int
    first_at: tuple[str, str] = ("", "")
    steady_at: tuple[str, str] = ("", "")
    pipeline_peak: int = 0
    step_peak: int = 0
    #: the tensor-parallel rank on a (p, N, t) mesh (FSDP x TP x pipeline; ``dp`` the data-parallel rank)
    tp: int = 0
    #: frees of counted storages that ran on another thread than the recording one (gloo's worker thread dropping a
    #: collective's last reference, gloo's copies left out): 0 on a p x N mesh, whose collectives are released
    #: (:func:`~.model_parallel_runs.released_collectives`) and which records one first and one steady step
    late: int = 0
    #: the steps recorded: (first steps, steady steps)
    repeats: tuple[int, int] = (0, 0)


def fsdp_pipeline_step(case: Case, rank: int, world: int, stages: int) -> StageMeshRun:
    """This rank's measurement of ``case`` (inside an initialized gloo group of ``world`` ranks, ``stages`` of them
    pipeline stages)."""
    from torch.distributed.fsdp import fully_shard

    from .sharded import units
    from .tensor_pipeline_runs import is_tensor_case, tensor_pipeline_stage

    if is_tensor_case(case):  # tensor parallel x pipeline on a p x t mesh, in the same spawn
        return _record(*tensor_pipeline_stage(case, rank, world, stages), repeats=mesh_repeats(True))
    on = mesh_stage(case, world, stages)
    blocks = on.blocks if on.blocks is not None else units(on.module)
    for block in blocks:
        fully_shard(block, mesh=on.mesh["dp"], reshard_after_forward=on.engine)
    fully_shard(on.module, mesh=on.mesh["dp"], reshard_after_forward=on.engine)
    stage, sched = on.scheduled(on.module)
    return _record(sched, stage, on.module, on.ids, on.labels, on.first, on.last, (rank, on.s, on.dp),
                   repeats=mesh_repeats(False))


def mesh_repeats(tensor: bool) -> tuple[int, int]:
    """The first and steady steps a mesh records: one of each
    (:data:`~.model_parallel_runs.RELEASED_FIRST_STEPS`), with tensor parallelism too since DTensor's functional
    collectives run under :class:`~symmem.record.collectives.FuncolRelease` (:func:`_record`); ``tensor`` is kept
    so that a mesh kind can be given its own count again.  Read when a rank runs (a forked rank sees its parent's)."""
    return _runs.RELEASED_FIRST_STEPS, _runs.RELEASED_STEADY_STEPS


@dataclass(frozen=True)
class MeshStage:
    """This rank's place on the p x N mesh (``init_device_mesh("cpu", (p, N), mesh_dim_names=("pp", "dp"))``) and its
    stage of a case, built or traced, before an engine wraps it: the module, FSDP's units of a traced split
    (``blocks``; None: the built-in reference's layers), ``PipelineStage``'s static shapes, the schedule's loss_fn,
    the batch and labels drawn for data-parallel rank ``dp``, the schedule and ``M``, and the case's engine option
    (FSDP's ``reshard_after_forward``, DDP's engine name)."""

    mesh: Any
    s: int
    dp: int
    stages: int
    module: Any
    blocks: Any
    given: Mapping[str, Any]
    loss_fn: Any
    ids: Any
    labels: Any
    schedule: str
    micro_batches: int
    engine: Any

    @property
    def first(self) -> bool:
        return self.s == 0

    @property
    def last(self) -> bool:
        return self.s == self.stages - 1

    def scheduled(self, wrapped: Any) -> tuple[Any, Any]:
        """``PipelineStage`` of ``wrapped`` (the stage's module as the engine wrapped it) over ``mesh["pp"]`` and
        its ``ScheduleGPipe`` / ``Schedule1F1B`` of ``M`` micro-batches."""
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(wrapped, self.s, self.stages, torch.device("cpu"), group=self.mesh["pp"].get_group(),
                              **self.given)
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[self.schedule]
        return stage, kind(stage, self.micro_batches, loss_fn=self.loss_fn)


def mesh_stage(case: Any, world: int, stages: int) -> MeshStage:
    """This rank's :class:`MeshStage` of ``case`` (:data:`Case`, or :mod:`.ddp_pipeline_runs`' with its engine
    last), inside an initialized gloo group of ``world`` ranks, ``stages`` of them pipeline stages."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (stages, world // stages), mesh_dim_names=("pp", "dp"))
    s, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    if len(case) == 2:  # a traced module's manual split: its blocks on the stage are FSDP's units
        traced, engine = case
        module, blocks, given, loss_fn, ids, labels = _traced_stage(traced, s, stages, dp)
        schedule, m = traced.schedule, traced.micro_batches
    else:
        model, values, schedule, m, loss, options, engine = case
        module, given, loss_fn, ids, labels = _built_stage(model, values, m, loss, options, s, stages, dp)
        blocks = None
    return MeshStage(mesh, s, dp, stages, module, blocks, given, loss_fn, ids, labels, schedule, m, engine)


def _built_stage(model: str, values: Mapping[str, int], m: int, loss: str, options: Mapping[str, Any], s: int,
                 stages: int, dp: int) -> tuple[Any, ...]:
    """Stage ``s`` of a built-in reference (:func:`~symmem.record.model_parallel_runs._stage_module`): (its module,
    the ``PipelineStage``'s static shapes, the schedule's loss_fn, the batch of ``m`` micro-batches, the labels), the
    batch drawn for data-parallel rank ``dp`` (each data-parallel group its own; the stages of one pipeline the same
    one)."""
    import torch

    from ..reference.sequence_models import causal_lm_loss
    from .model_parallel_runs import _stage_module, _sum_loss, static_shapes

    module = _stage_module(model, values, s, stages, options)
    b, seq, v, h = int(values["B"]), int(values["S"]), int(values["V"]), int(values["H"])
    given = static_shapes(s == 0, s == stages - 1, torch.empty(b, seq, dtype=torch.long, device="meta"), (b, seq, v),
                          (b, seq, h))
    gen = torch.Generator().manual_seed(1 + dp)
    ids = torch.randint(0, v, (b * m, seq), generator=gen)
    labels = torch.randint(0, v, (b * m, seq), generator=gen) if loss == "cross-entropy" else torch.empty(b * m, 0)
    return module, given, causal_lm_loss if loss == "cross-entropy" else _sum_loss, ids, labels


def _traced_stage(case: Any, s: int, stages: int, dp: int) -> tuple[Any, ...]:
    """Stage ``s`` of a traced module's manual split (:class:`~symmem.record.traced_pipeline_runs.TracedCase`):
    (its module, its blocks, the ``PipelineStage``'s static shapes, the schedule's loss_fn, the batch, the labels),
    the batch drawn for data-parallel rank ``dp``."""
    import torch

    from .model_parallel_runs import static_shapes
    from .traced_pipeline_runs import _loss, batch_of

    torch.manual_seed(0)
    full, (example,) = case.builder()
    module = case.split.stage(full, s, stages)
    from .sharded import units

    container = getattr(case.split, "container", None)  # GPT2Split's stage: its ModuleList of blocks
    run = list(full.get_submodule(container)) if container is not None else units(module)
    blocks = [child for child in module.modules() if any(child is b for b in run)]
    given = static_shapes(s == 0, s == stages - 1, example, case.output, case.boundary)
    return (module, blocks, given, _loss(case.loss, full), *batch_of(case, example, seed=1 + dp))


def _record(sched: Any, stage: Any, module: Any, ids: Any, labels: Any, first: bool, last: bool,
            where: tuple[int, ...], *, repeats: tuple[int, int]) -> StageMeshRun:
    """One unrecorded step, then the recorded ones, ``repeats`` = (first steps, steady steps) (see the module's
    note); the :class:`StageMeshRun`."""
    from .identity import tensors
    from .model_parallel_runs import _buffers
    from .optim import make_optimizer, state_tensors
    from .sharded import ShardTracker, local

    params = [p for p in module.parameters() if p.requires_grad]

    def step() -> None:
        losses: list[Any] = []
        out = sched.step(ids) if first else sched.step(target=labels, losses=losses) if last else sched.step()
        del out, losses

    opt = make_optimizer(params, "adamw", "for-loop")
    step()  # FSDP's lazy initialization, the receive buffers
    opt.step()
    opt.zero_grad(set_to_none=True)
    del opt

    def nbytes(ts: Any) -> int:  # each storage once
        return sum({id(x): x.nbytes() for x in (local(t).untyped_storage() for t in ts)}.values())

    # funcol's collectives (a tensor-parallel stage's DTensors) released on this thread, inside each op
    # (collectives.FuncolRelease), as the tensor-parallel runs' steps are: their frees land at a fixed op; no
    # settle (it acts only at funcol's wait_tensor, which FuncolRelease and released() leave nothing to wait for)
    tracker = ShardTracker(release=True)
    tracker.register([local(p) for p in params], "parameter")
    tracker.register([local(x) for x in module.buffers()], "buffer")
    tracker.register(_buffers(stage), "buffer")
    tracker.register([t for out in stage.output_chunks for t in tensors(out)], "output")
    tracker.register([ids] if first else [labels] if last else [], "input")
    held: dict[str, Any] = {}
    state = 0
    n_first, n_steady = repeats
    with tracker.resizes(), tracker:
        for k in range(1, n_first + n_steady + 1):
            if k <= n_first:
                held.pop("opt", None)  # the last one's state goes before this step begins
                held["opt"] = make_optimizer(params, "adamw", "for-loop")
            with tracker.phase(k, "forward"), tracker.saving():
                step()
                tracker.label([t for out in stage.output_chunks for t in tensors(out)], "output")
            with tracker.phase(k, "step"):
                tracker.label([local(p.grad) for p in params if p.grad is not None], "gradient")
                held["opt"].step()
                tracker.label([local(t) for t in state_tensors(held["opt"])], "optimizer_state")
                state = nbytes(state_tensors(held["opt"]))
            with tracker.phase(k, "zero_grad"):
                held["opt"].zero_grad(set_to_none=True)
    trace = tracker.trace(n_first + n_steady)
    gloo = {x.sid for x in trace.storages if x.category == "external"}
    firsts, steadies = range(1, n_first + 1), range(n_first + 1, n_first + n_steady + 1)
    first_peak, first_at = _fewest_at(trace, firsts, gloo)
    steady, steady_at = _fewest_at(trace, steadies, gloo)
    phases = {phase: _fewest_phase(trace, steadies, gloo, phase) for phase in ("forward", "step")}
    rank, s, dp, *tp = where
    late = sum(1 for sid in trace.late if sid not in gloo)
    return StageMeshRun(rank, s, dp, nbytes(params), state, first_peak, steady, first_at, steady_at,
                        phases["forward"], phases["step"], *(tp or [0]), late, repeats)


def mesh_of(stages: int, dp: int, start_method: str, runs: str, cases: Sequence[Any] = ()) -> None:
    """A p x N mesh's sizes checked, and what its ranks import (the module ``runs`` too): with ``forkserver`` the
    server's list, with ``fork`` imported here first (Hugging Face's only where a case names an ``hf:`` model)."""
    for n, what in ((stages, "pipeline stages p"), (dp, "data-parallel size N")):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SymmemError(f"the {what} is a positive integer, got {n!r}")
    from .distributed import PRELOAD, preload, rank_imports  # pipelining and these runs among them: one list

    if start_method == "forkserver":  # only read when the server starts (once a process): what the ranks import
        import multiprocessing

        multiprocessing.get_context("forkserver").set_forkserver_preload(list(dict.fromkeys([*PRELOAD, runs])))
    elif start_method == "fork":
        # a traced case of a Hugging Face model names its spec in a string field
        preload([*rank_imports("'hf:" in repr(cases)), runs])


def _fewest_phase(trace: Any, steps: range, left_out: set[int], phase: str) -> int:
    """The largest moment of ``phase`` over the repeated ``steps``, each moment at its fewest bytes."""
    from .model_parallel_runs import _live

    live = _live(trace, left_out)
    rows = [[v for r, v in zip(trace.records, live, strict=True) if r.step == k and r.phase == phase] for k in steps]
    return max(min(column) for column in zip(*rows, strict=True))


def _work(cases: Sequence[Case], stages: int, rank: int, world: int) -> list[StageMeshRun]:
    return [fsdp_pipeline_step(case, rank, world, stages) for case in cases]


def fsdp_pipeline_runs(stages: int, dp: int, cases: Sequence[Case], start_method: str = "fork"
                       ) -> list[list[StageMeshRun]]:
    """Per rank (``stages * dp`` of them, rank ``r`` stage ``r // dp``, data-parallel rank ``r % dp``), one
    :class:`StageMeshRun` per case.  ``start_method`` ``fork``, or ``forkserver`` (the test suite's: one server for
    every gloo run, :func:`symmem.record.distributed.measure_jobs`).  A rank that fails or hangs is a
    :class:`SymmemError`."""
    import torch.distributed.fsdp  # noqa: F401 - imported once here, inherited by the forked ranks
    import torch.distributed.pipelining  # noqa: F401

    from .model_parallel_runs import forked_ranks

    mesh_of(stages, dp, start_method, __name__, cases)
    return forked_ranks(stages * dp, functools.partial(_work, listed(cases), stages), "the FSDP x pipeline run",
                        start_method)


def listed(cases: Sequence[Any]) -> list[Any]:
    """The cases as a rank gets them (mappings as dicts, the engine field as it is: a name or a flag)."""
    return [case if len(case) == 2 else (case[0], dict(case[1]), *case[2:5], dict(case[5]),
                                         case[6] if isinstance(case[6], str) else bool(case[6])) for case in cases]
