"""Every engine on a p x N mesh's stages in one spawn: FSDP2 (and tensor parallelism), DDP, its bucket view and
ZeRO-1, each case run by its own module's step.

The test suite runs the live cases of its three mesh files in one spawn of four ranks (tests/stage_ranks.py);
this module dispatches each case, so that neither runs module imports the other.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .fsdp_pipeline_runs import StageMeshRun, mesh_of


def mesh_step(case: Any, rank: int, world: int, stages: int) -> StageMeshRun:
    """This rank's measurement of ``case``: a DDP-family case (its last field an engine name:
    :mod:`~symmem.record.ddp_pipeline_runs`'), else FSDP2's (or tensor parallelism's) on the stages."""
    if isinstance(case[-1], str):
        from .ddp_pipeline_runs import ddp_pipeline_step

        return ddp_pipeline_step(case, rank, world, stages)
    from .fsdp_pipeline_runs import fsdp_pipeline_step

    return fsdp_pipeline_step(case, rank, world, stages)


def _work(cases: Sequence[Any], stages: int, rank: int, world: int) -> list[StageMeshRun]:
    return [mesh_step(case, rank, world, stages) for case in cases]


def mesh_runs(stages: int, dp: int, cases: Sequence[Any], start_method: str = "fork") -> list[list[StageMeshRun]]:
    """Per rank (``stages * dp`` of them, rank ``r`` stage ``r // dp``), one
    :class:`~symmem.record.fsdp_pipeline_runs.StageMeshRun` per case, each case of
    :func:`~symmem.record.fsdp_pipeline_runs.fsdp_pipeline_runs` or
    :func:`~symmem.record.ddp_pipeline_runs.ddp_pipeline_runs`, in one spawn."""
    import torch.distributed.fsdp  # noqa: F401 - imported once here, inherited by the forked ranks
    import torch.distributed.pipelining  # noqa: F401

    from .fsdp_pipeline_runs import listed
    from .model_parallel_runs import forked_ranks

    mesh_of(stages, dp, start_method, __name__, cases)
    return forked_ranks(stages * dp, functools.partial(_work, listed(cases), stages), "the pipeline meshes' run",
                        start_method)
