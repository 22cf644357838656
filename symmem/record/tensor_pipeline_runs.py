"""Tensor parallel x pipeline measured per rank: ``parallelize_module`` on each pipeline stage of a p x t mesh.

The engine is torchtitan's 2-D recipe: ``init_device_mesh("cpu", (p, t), mesh_dim_names=("pp", "tp"))``; each rank
builds its stage of the Llama reference as symmem's pipeline runs split it
(:func:`symmem.record.model_parallel_runs._stage_module`: the embedding on the first stage, the final norm and the
head on the last, ``L/p`` layers each), ``parallelize_module(stage, mesh["tp"], plan)`` with the standard plan
(:func:`~symmem.record.model_parallel_runs.llama_plan`, less the embedding or the head where the stage has none),
then ``PipelineStage`` (static shapes over ``mesh["pp"]``) and ``ScheduleGPipe`` / ``Schedule1F1B`` with ``M``
micro-batches.  What crosses a stage boundary is a plain tensor: the row-parallel outputs and the head's
replicated output come back as local tensors (``use_local_output``), whole on every rank of the tp group.  Every
rank is given the same batch (one pipeline per tensor-parallel rank; the plan replicates the input).  With
``sequence_parallel`` in a case's options each stage gets torchtitan's sequence-parallel plan
(:func:`~symmem.record.model_parallel_runs.llama_sequence_plan`) and the boundary is the last layer's output as a
``(B, S/t, H)`` local shard (torchtitan's ``layers_io_shape``), every stage's rotary tables over the whole S.

Rank ``r`` is stage ``r // t``, tensor-parallel rank ``r % t`` (the mesh's row-major order).  The cases run through
:func:`symmem.record.fsdp_pipeline_runs.fsdp_pipeline_runs` (a case whose options say ``tensor_parallel``: one spawn
for both meshes), and each rank records as that run's ranks do (one unrecorded step, then first and steady steps
under the DTensor-aware recorder, each moment at its fewest bytes over the repeats); the result is a
:class:`~symmem.record.fsdp_pipeline_runs.StageMeshRun` whose ``dp`` field holds the tensor-parallel rank.
Needs ``torch`` with ``torch.distributed`` (imported lazily).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import SymmemError


def stage_plan(module: Any, t: int, sequence: bool = False) -> dict[str, Any]:
    """The standard Llama plan for one pipeline stage: the layers' styles (local indices), the embedding's on the
    first stage only, the head's on the last only; ``sequence``: the plan with sequence parallelism
    (:func:`~symmem.record.model_parallel_runs.llama_sequence_plan`, torchtitan's)."""
    from .model_parallel_runs import llama_plan, llama_sequence_plan

    plan = (llama_sequence_plan if sequence else llama_plan)(module, t)
    return {k: v for k, v in plan.items() if k.split(".")[0] in dict(module.named_children())}


def tensor_pipeline_stage(case: tuple[Any, ...], rank: int, world: int, stages: int) -> tuple[Any, ...]:
    """This rank's stage of ``case`` = (model, sizes, schedule, M, loss, reference options, _) on a p x t mesh
    (``world = p * t`` ranks, ``stages = p``), ready to record: (the schedule, the ``PipelineStage``, the stage
    module, the batch, the labels, whether first, whether last, (rank, stage, tensor-parallel rank)) --
    :func:`symmem.record.fsdp_pipeline_runs.fsdp_pipeline_step` records it as its own."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.distributed.tensor.parallel import parallelize_module

    from ..reference.sequence_models import causal_lm_loss
    from .model_parallel_runs import _stage_module, _sum_loss, static_shapes

    model, values, schedule, m, loss, options, reshard = case
    dp = int(options.get("data_parallel", 1))  # FSDP2's ranks of a stage: a (p, N, t) mesh, torchtitan's 3-D one
    sequence = bool(options.get("sequence_parallel"))
    options = {k: v for k, v in options.items() if k not in ("tensor_parallel", "data_parallel", "sequence_parallel")}
    if model != "llama":
        raise SymmemError(f"the tensor-parallel plan is Llama's, not {model!r}")
    t = world // stages // dp
    if dp > 1:
        mesh = init_device_mesh("cpu", (stages, dp, t), mesh_dim_names=("pp", "dp", "tp"))
    else:
        mesh = init_device_mesh("cpu", (stages, t), mesh_dim_names=("pp", "tp"))
    s, r = mesh.get_local_rank("pp"), mesh.get_local_rank("tp")
    d = mesh.get_local_rank("dp") if dp > 1 else 0
    first, last = s == 0, s == stages - 1
    # under sequence parallelism every stage's rotary tables (and eager mask) cover the whole sequence, as
    # torchtitan's model-wide tables do, though the hidden stream a stage is given is S-split
    module = _stage_module(model, values, s, stages, options, int(values["S"]) if sequence else None)
    parallelize_module(module, mesh["tp"], stage_plan(module, t, sequence))
    if dp > 1:  # torchtitan's order: the plan first, then fully_shard on each layer and the stage root over dp
        from torch.distributed.fsdp import fully_shard

        from .sharded import units

        for block in units(module):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=reshard)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard)
    b, seq, v, h = int(values["B"]), int(values["S"]), int(values["V"]), int(values["H"])
    # the boundary: the last layer's output, whole on every tp rank, or under sequence parallelism its S-split
    # local shard (the row-parallel output's reduce-scatter; torchtitan's (B, S/t, H) ``layers_io_shape``)
    given = static_shapes(first, last, torch.empty(b, seq, dtype=torch.long, device="meta"), (b, seq, v),
                          (b, seq // t if sequence else seq, h))
    stage = PipelineStage(module, s, stages, torch.device("cpu"), group=mesh["pp"].get_group(), **given)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, m, loss_fn=causal_lm_loss if loss == "cross-entropy" else _sum_loss)
    gen = torch.Generator().manual_seed(1 + d)  # every tensor-parallel rank the same batch, each dp group its own
    ids = torch.randint(0, v, (b * m, seq), generator=gen)
    labels = torch.randint(0, v, (b * m, seq), generator=gen) if loss == "cross-entropy" else torch.empty(b * m, 0)
    return sched, stage, module, ids, labels, first, last, (rank, s, d, r) if dp > 1 else (rank, s, r)


def is_tensor_case(case: tuple[Any, ...]) -> bool:
    """Whether a mesh case (:data:`symmem.record.fsdp_pipeline_runs.Case`) is a tensor x pipeline one: its reference
    options say ``tensor_parallel``."""
    return len(case) == 7 and isinstance(case[5], Mapping) and bool(case[5].get("tensor_parallel"))
