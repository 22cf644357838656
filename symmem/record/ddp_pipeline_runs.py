"""DDP x pipeline measured per rank: ``DistributedDataParallel`` around each pipeline stage of a p x N mesh.

The engine: ``init_device_mesh("cpu", (p, N), mesh_dim_names=("pp", "dp"))``; each rank builds its stage of the
reference model as symmem's pipeline runs split it (:func:`symmem.record.model_parallel_runs._stage_module`: the
embedding on the first stage, the final norm and the head on the last, ``L/p`` layers each), wraps it in
``DistributedDataParallel(stage, process_group=mesh["dp"].get_group())`` (``gradient_as_bucket_view`` for
``ddp-bucket-view``), then ``PipelineStage`` (static shapes, over ``mesh["pp"]``) and ``ScheduleGPipe`` /
``Schedule1F1B`` with ``M`` micro-batches.  ``PipelineStage.backward_maybe_with_nosync`` runs every micro-batch's
backward but the last under ``no_sync()`` and prepares the reducer by hand for the last (torch 2.13).

:func:`ddp_pipeline_runs` starts ``p*N`` processes in one gloo group on 127.0.0.1 (bounded waits), and in each
rank runs two unrecorded steps (the receive buffers; DDP's first synced backward, then its buckets rebuilt in the
second step's forward), then records :func:`~symmem.record.fsdp_pipeline_runs.mesh_repeats` steps each with a new
for-loop AdamW (a first step) and steady ones with the last one (:class:`~symmem.record.sharded.ShardTracker`), the
collectives released on the recording thread (:func:`~symmem.record.collectives.released`; each rank reports the
frees that ran elsewhere, ``late``).  DDP's gradient buckets
were made when the stage was wrapped, before the recorder starts: it first sees them when the reducer copies a
gradient in (labelled ``external``); they are counted as live from the start, which they are (as
:mod:`symmem.record.distributed` does).  Needs ``torch`` with ``torch.distributed`` (imported lazily).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import SymmemError
from .fsdp_pipeline_runs import StageMeshRun, mesh_of, mesh_repeats

#: (model, sizes, schedule, micro-batches M, loss, reference options, engine: ``ddp``, ``ddp-bucket-view`` or
#: ``zero-redundancy``), or a traced module's (:class:`~symmem.record.traced_pipeline_runs.TracedCase`, engine): its
#: manual split's stages
Case = tuple[str, Mapping[str, int], str, int, str, Mapping[str, Any], str] | tuple[Any, str]


def ddp_pipeline_step(case: Case, rank: int, world: int, stages: int) -> StageMeshRun:
    """This rank's measurement of ``case`` (inside an initialized gloo group of ``world`` ranks, ``stages`` of them
    pipeline stages)."""
    from torch.nn.parallel import DistributedDataParallel

    from .fsdp_pipeline_runs import mesh_stage

    on = mesh_stage(case, world, stages)
    wrapped = DistributedDataParallel(on.module, process_group=on.mesh["dp"].get_group(),
                                      gradient_as_bucket_view=on.engine == "ddp-bucket-view")
    stage, sched = on.scheduled(wrapped)
    group = on.mesh["dp"].get_group() if on.engine == "zero-redundancy" else None
    return _record(sched, stage, on.module, on.ids, on.labels, on.first, on.last, (rank, on.s, on.dp), group,
                   views=on.engine == "ddp-bucket-view", repeats=mesh_repeats(False))


def _record(sched: Any, stage: Any, module: Any, ids: Any, labels: Any, first: bool, last: bool,
            where: tuple[int, int, int], zero_group: Any = None, views: bool = False,
            repeats: tuple[int, int] = (1, 1)) -> StageMeshRun:
    """Two unrecorded steps, then the recorded ones, ``repeats`` = (first steps, steady steps) (see the module's
    note); the :class:`StageMeshRun`.
    ``zero_group``: ``ZeroRedundancyOptimizer`` over that group around the for-loop AdamW (None: AdamW alone).
    ``views`` (``gradient_as_bucket_view``): the buckets, which the ``.grad``s are views of after a synced backward,
    are taken from those views before ``zero_grad`` drops them and counted from the start."""
    from .distributed import zero_optimizer
    from .identity import tensors
    from .model_parallel_runs import _buffers
    from .optim import make_optimizer, state_tensors
    from .sharded import ShardTracker

    params = [p for p in module.parameters() if p.requires_grad]

    def optimizer() -> Any:
        if zero_group is None:
            return make_optimizer(params, "adamw", "for-loop")
        return zero_optimizer(params, "adamw", "for-loop", 1e-3, group=zero_group)

    def states(opt: Any) -> list[Any]:  # ZeroRedundancyOptimizer's rank keeps its state in its local optimizer
        return state_tensors(getattr(opt, "optim", opt))

    def step() -> None:
        losses: list[Any] = []
        out = sched.step(ids) if first else sched.step(target=labels, losses=losses) if last else sched.step()
        del out, losses

    buckets: list[Any] = []
    for _ in range(2):  # the receive buffers; DDP's first synced backward, then its buckets rebuilt (step 2)
        opt = optimizer()
        step()
        opt.step()
        # under the bucket view the .grads are views of the (rebuilt) buckets: the storages the rank holds from
        # here on; the recorder sees them only when the reducer first writes into them, which in a first step is
        # its last micro-batch's backward -- counting them from there undercounts the moments before it
        buckets = [p.grad for p in params if p.grad is not None] if views else []
        opt.zero_grad(set_to_none=True)
        del opt

    def nbytes(ts: Any) -> int:  # each storage once
        return sum({id(x): x.nbytes() for x in (t.untyped_storage() for t in ts)}.values())

    # no settle: the collectives run under released() (symmem.record.collectives), their frees on this thread
    tracker = ShardTracker()
    tracker.register(params, "parameter")
    tracker.register(list(module.buffers()), "buffer")
    tracker.register(_buffers(stage), "buffer")
    tracker.register(buckets, "gradient")
    tracker.register([t for out in stage.output_chunks for t in tensors(out)], "output")
    tracker.register([ids] if first else [labels] if last else [], "input")
    held: dict[str, Any] = {}
    state = 0
    n_first, n_steady = repeats
    with tracker:
        for k in range(1, n_first + n_steady + 1):
            if k <= n_first:
                held.pop("opt", None)  # the last one's state goes before this step begins
                held["opt"] = optimizer()
            with tracker.phase(k, "forward"), tracker.saving():
                step()
                tracker.label([t for out in stage.output_chunks for t in tensors(out)], "output")
            with tracker.phase(k, "step"):
                tracker.label([p.grad for p in params if p.grad is not None], "gradient")
                held["opt"].step()
                tracker.label(states(held["opt"]), "optimizer_state")
                state = nbytes(states(held["opt"]))
            with tracker.phase(k, "zero_grad"):
                held["opt"].zero_grad(set_to_none=True)
    trace = tracker.trace(n_first + n_steady)
    live = _live(trace)
    firsts, steadies = range(1, n_first + 1), range(n_first + 1, n_first + n_steady + 1)
    first_peak, first_at = _fewest(trace, live, firsts)
    steady, steady_at = _fewest(trace, live, steadies)
    phases = {phase: _fewest(trace, live, steadies, phase)[0] for phase in ("forward", "step")}
    rank, s, dp = where
    return StageMeshRun(rank, s, dp, nbytes(params), state, first_peak, steady, first_at, steady_at,
                        phases["forward"], phases["step"], late=len(trace.late), repeats=repeats)


def _live(trace: Any) -> list[int]:
    """Each record's live bytes, with the storages made before the recorder started (DDP's buckets, first seen
    when an op writes into them) counted from the start."""
    extra = [(s.born, s.nbytes) for s in trace.storages if s.category == "external" and s.born is not None]
    return [r.live + sum(n for born, n in extra if born > r.index) for r in trace.records]


def _fewest(trace: Any, live: list[int], steps: range, phase: str | None = None) -> tuple[int, tuple[str, str]]:
    """The largest moment (of ``phase``, or all) of a step repeated ``steps``, each moment at its fewest bytes
    over the repeats, and where it is (phase, op)."""
    rows = [[(v, r) for r, v in zip(trace.records, live, strict=True)
             if r.step == k and (phase is None or r.phase == phase)] for k in steps]
    if len({len(r) for r in rows}) != 1:
        raise SymmemError(f"the repeated steps ran different ops ({', '.join(str(len(r)) for r in rows)})")
    columns = [min(column, key=lambda x: x[0]) for column in zip(*rows, strict=True)]
    v, r = max(columns, key=lambda x: x[0])
    return v, (r.phase, r.op)


def _work(cases: Sequence[Case], stages: int, rank: int, world: int) -> list[StageMeshRun]:
    return [ddp_pipeline_step(case, rank, world, stages) for case in cases]


def ddp_pipeline_runs(stages: int, dp: int, cases: Sequence[Case], start_method: str = "fork"
                      ) -> list[list[StageMeshRun]]:
    """Per rank (``stages * dp`` of them, rank ``r`` stage ``r // dp``, data-parallel rank ``r % dp``), one
    :class:`~symmem.record.fsdp_pipeline_runs.StageMeshRun` per case.  ``start_method`` ``fork``, or
    ``forkserver``.  A rank that fails or hangs is a :class:`SymmemError`."""
    import torch.distributed.pipelining  # noqa: F401 - imported once here, inherited by the forked ranks

    from .model_parallel_runs import forked_ranks

    mesh_of(stages, dp, start_method, __name__, cases)
    listed = [case if len(case) == 2 else (case[0], dict(case[1]), *case[2:5], dict(case[5]), case[6])
              for case in cases]
    return forked_ranks(stages * dp, functools.partial(_work, listed, stages), "the DDP x pipeline run",
                        start_method)
