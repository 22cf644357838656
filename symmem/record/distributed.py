"""The truth for data-parallel engines: real multi-process ``torch.distributed`` training steps on the CPU, each
rank under the live-bytes recorder.

:func:`measure_ranks` takes derivations under a data-parallel regime (``derive(..., data_parallel="ddp")``) and
runs each one's reference module (:mod:`symmem.reference`) wrapped in the engine the regime names, on ``world``
processes: one ``torch.multiprocessing`` spawn per world size runs every derivation in turn inside the workers (the
processes and their ``import torch`` are paid once).  The ranks meet through a ``FileStore`` in a temporary
directory (no port to pick, so parallel test workers cannot collide) and gloo talks over the loopback device only
(``GLOO_SOCKET_IFNAME=lo``: 127.0.0.1); every wait is bounded (``timeout`` seconds for the whole run, the same for
each collective), and a run that overruns is killed and refused with one line.

Each rank runs ``steps`` training steps (forward, the loss, backward, ``optimizer.step()``,
``zero_grad(set_to_none=True)``, as :func:`symmem.record.steps.track_step` does, which runs them) and reports its
peak per step.  Memory an engine allocated when the model was wrapped -- DDP's gradient buckets, made before the
recorder starts -- is first seen by the recorder when an op writes into it (the recorder labels such a storage
``external``); it is counted here as live from the start, which it is.  ``first`` is step 1's peak, ``steady``
the largest of the later steps' (DDP rebuilds its buckets in step 2; :func:`steps_of`).

What the recorder cannot see: gloo's own buffers for a collective (its worker threads allocate outside the
dispatcher; an all-reduce of a contiguous CPU tensor runs in place; the copy of a reduce-scatter's input it
makes, which the recorder does see, is left out of FSDP's peaks, FSDP2's and FSDP1's alike) and, on GPUs,
NCCL's communicator buffers: like the CUDA workspaces they are a band outside tensor accounting
(docs/regimes.md).  Needs ``torch`` with ``torch.distributed`` (imported lazily).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import SymmemError

if TYPE_CHECKING:
    from ..derivation import Derivation

#: The engines :func:`measure_ranks` runs, with the wrapper each builds.
#: FSDP2 (``fully_shard`` on every repeated block and the root; ``reshard_after_forward`` True or False).
SHARDED = ("fsdp", "fsdp-no-reshard")
#: ``DistributedDataParallel(model)`` with ``ZeroRedundancyOptimizer(params, optimizer_class=...)`` (ZeRO-1)
ZERO = "zero-redundancy"
#: FSDP1 (``FullyShardedDataParallel``, FULL_SHARD or SHARD_GRAD_OP): :mod:`symmem.record.fsdp1_runs`
FSDP1 = ("fsdp1", "fsdp1-grad-op")
ENGINES = ("ddp", "ddp-bucket-view", ZERO, *SHARDED, *FSDP1)
#: what a forkserver imports before it forks the ranks (a module that is missing is skipped): torch's engines,
#: DTensor and dynamo (FSDP2 imports them), symmem's recorders and reference models, transformers and its GPT-2
#: (traced hf: jobs; the test suite's); pipelining, the pipeline mesh runs and the traced cases' builder (a process
#: starts one server, with the first list given: whichever run starts it, its ranks import none of these again)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo",
           "torch.distributed.optim", "torch.nn.parallel", "symmem.record.distributed", "symmem.record.steps",
           "symmem.record.sharded", "symmem.record.fsdp1_runs", "symmem.record.collectives", "symmem.reference",
           "transformers", "transformers.models.gpt2.modeling_gpt2", "torch.distributed.pipelining",
           "symmem.record.fsdp_pipeline_runs", "symmem.record.ddp_pipeline_runs", "symmem.record.mesh_runs",
           "symmem.record.traced_pipeline_runs", "symmem.importer.spec_builder")
#: Hugging Face's modules in :data:`PRELOAD` (~3.4 CPU-s of the server's ~8.5): ranks forked from the calling process
#: (``start_method="fork"``) get them imported there only for a job that builds an ``hf:`` model
HF_PRELOAD = ("transformers", "transformers.models.gpt2.modeling_gpt2")
#: how :func:`spawn_ranks` starts the ranks: a fresh interpreter each; forked from a server that imported
#: :data:`PRELOAD` once (a fresh interpreter too: ~8.5 CPU-s, once a process); forked from the calling process, which
#: imports what they need first (once a process, only what it lacks; POSIX only).  The measured bytes are the same.
START_METHODS = ("spawn", "forkserver", "fork")


@dataclass(frozen=True)
class Job:
    """One measurement, picklable for the workers: the reference model at its numbers and the step to run."""

    model: str
    numbers: tuple[tuple[str, int], ...]
    options: tuple[tuple[str, Any], ...]
    engine: str
    optimizer: str
    impl: str
    loss: bool
    keep_logits: bool
    steps: int
    #: ranks per process group (0: the whole world): a world of 4 runs a 2-rank job twice at once, on ranks
    #: {0, 1} and {2, 3} (DDP and ZeroRedundancyOptimizer; each rank reports its rank in its group), or once
    group: int = 0
    #: with ``group``: run on the first group only, the other ranks skipping it (they still make the groups) -- one
    #: run, not one per group: DDP's reducer still frees late now and then (2 of 144 job-ranks, measured), but those
    #: frees landed at no peak in any run (docs/testing.md, "The repeats")
    once: bool = False
    #: a traced module instead of the reference: a picklable callable giving (module, positional inputs)
    #: (symmem.importer.traced_engines.SpecBuilder)
    builder: Any = None
    #: FSDP2's ``MixedPrecisionPolicy`` as (param_dtype, reduce_dtype) names (None: no policy)
    mp: tuple[str, str] | None = None
    #: activation checkpointing of the blocks under FSDP (``full`` or ``every-K``; :func:`.sharded.run_sharded`), or
    #: ``selective`` under every engine (the reference's core attention checkpointed)
    checkpoint: str = "none"
    #: gradient accumulation under FSDP2 and FSDP1 (:func:`.sharded.run_sharded`, :func:`.fsdp1_runs.run_fsdp1`)
    micro_batches: int = 1


@dataclass(frozen=True)
class RankPeak:
    """One rank's measured step: its peak in each step (``per_step[0]`` is step 1), the live bytes at the start
    (memory made before the first op included), where the steady peak occurred, and what step 1 left."""

    rank: int
    per_step: tuple[int, ...]
    start: int
    where: str
    #: what the first step leaves alive (its end less the start): the optimizer state it made
    kept: int = 0
    #: live bytes by recorded category when the last step's backward ends (what the optimizer steps on: the rank's
    #: weights, gradients as the engine holds them, its optimizer state; :attr:`parameter_side`)
    held: dict[str, int] | None = None
    #: frees of counted storages that ran on another thread than the recording one (gloo's worker thread dropping
    #: a collective's last reference: at no fixed op, so a peak may read more); 0 under
    #: :func:`symmem.record.collectives.released`, which every rank runs its jobs in
    late: int = 0

    @property
    def parameter_side(self) -> dict[str, int]:
        """What the rank holds between backward and the optimizer step: ``parameters`` (weights and buffers),
        ``gradients`` (every storage ever a ``.grad``) and ``optimizer_state``, as the recorder labelled them."""
        held = self.held or {}
        return {"parameters": held.get("parameter", 0) + held.get("buffer", 0),
                "gradients": held.get("gradient", 0), "optimizer_state": held.get("optimizer_state", 0)}

    @property
    def first(self) -> int:
        return self.per_step[0]

    @property
    def steady(self) -> int:
        return max(self.per_step[1:])


def steps_of(engine: str) -> int:
    """The steps a job of ``engine`` records by default: FSDP2 and FSDP1 one first and one steady step (every
    collective released on the recording thread, :func:`symmem.record.collectives.released`: no free lands late,
    so the steady steps are equal to the byte; each rank counts late frees and the tests assert none), DDP and
    ZeroRedundancyOptimizer one first and two steady (the reducer all-reduces from C++, which no wrapper reaches: a
    late free there only ever adds, and the lower of two steady steps counts; its buckets are rebuilt in step 2)."""
    return 2 if engine in SHARDED or engine in FSDP1 else 3


def job_of(derivation: Derivation, steps: int | None = None) -> Job:
    """The measurement of ``derivation``'s regime on its model's reference (FP32, a torch optimizer; no
    checkpointing, or under FSDP full and every-K; micro-batches under FSDP2: :func:`.sharded.run_sharded`,
    :func:`.fsdp1_runs.run_fsdp1`), recording ``steps`` steps (None: :func:`steps_of` its engine)."""
    regime = derivation.regime
    if regime.data_parallel not in ENGINES:
        raise SymmemError(f"measure_ranks runs the data-parallel engines {', '.join(ENGINES)}; got "
                          f"data_parallel={regime.data_parallel!r}")
    checkpointed = regime.checkpoint in ("none", "full", "selective") or regime.checkpoint.startswith("every-")
    if derivation.per_layer or regime.precision != "fp32" or not checkpointed \
            or (regime.checkpoint not in ("none", "selective") and regime.data_parallel not in (*SHARDED, *FSDP1)) \
            or regime.optimizer not in ("sgd", "sgd-momentum", "adam", "adamw") \
            or (regime.micro_batches != 1 and regime.data_parallel not in (*SHARDED, *FSDP1)):
        raise SymmemError("measure_ranks runs whole models in fp32 with sgd, sgd-momentum, adam or adamw, one "
                          "micro-batch, no checkpointing or selective (under FSDP also full and every-K, and "
                          "micro-batches)")
    steps = steps_of(regime.data_parallel) if steps is None else steps
    if steps < 2:
        raise SymmemError(f"measure_ranks needs at least 2 steps (a first and a steady one), not {steps}")
    from ..passes.schedule import optimizer_impl

    options = {k: v for k, v in derivation.options.items() if k != "loss"}
    return Job(derivation.model, tuple(sorted((s.name, int(v)) for s, v in derivation.numbers.items())),
               tuple(sorted(options.items())), regime.data_parallel, regime.optimizer,
               optimizer_impl(regime, "cpu"), bool(derivation.options.get("loss")), regime.keep_logits, steps,
               checkpoint=regime.checkpoint, micro_batches=regime.micro_batches,
               mp=None if regime.param_dtype is None else (regime.param_dtype, regime.policy_reduce_dtype or ""))


def measure_ranks(derivations: Sequence[Derivation], world: int = 2, *, steps: int | None = None,
                  timeout: float = 120.0) -> list[tuple[RankPeak, ...]]:
    """Run every derivation's engine on ``world`` CPU processes (one spawn for all of them); per derivation, each
    rank's :class:`RankPeak`, rank 0 first."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise SymmemError(f"the world size is a positive integer, got {world!r}")
    return measure_jobs([job_of(d, steps) for d in derivations], world, timeout=timeout)


def measure_jobs(jobs: Sequence[Job], world: int = 2, *, timeout: float = 120.0, start_method: str = "spawn"
                 ) -> list[tuple[RankPeak, ...]]:
    """:func:`measure_ranks` for jobs given as they are (FSDP2's among them).  ``start_method="forkserver"`` forks
    the ranks from one server process that has imported torch, its distributed engines and these recorders once
    (:data:`PRELOAD`; a fresh interpreter spends ~6 s of CPU a rank on them); ``"fork"`` forks them from this
    process, which imports what they need first (once): the test suite's choice, where many runs share one process
    (no server's start, ~8.5 CPU-s; a 2-rank spawn's start ~0.05 CPU-s).  The ranks' measurements are the same
    (docs/testing.md, "Stop 41: gloo41").  A job run ``once`` in groups gives its first group's ranks only."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise SymmemError(f"the world size is a positive integer, got {world!r}")
    for job in jobs:
        if job.group and (job.group < 1 or world % job.group or job.engine in SHARDED):
            raise SymmemError(f"a {job.engine} job in groups of {job.group} ranks cannot run in a world of {world} "
                              "(groups divide the world; FSDP2 takes the whole world)")
        if job.once and not job.group:
            raise SymmemError(f"a {job.engine} job runs once on its first group: give it a group smaller than the "
                              "world")
    if start_method not in START_METHODS:
        raise SymmemError(f"the ranks start by {', '.join(map(repr, START_METHODS))}, not {start_method!r}")
    imports = rank_imports(any(job.builder is not None and str(job.builder.spec).startswith("hf:") for job in jobs))
    with tempfile.TemporaryDirectory(prefix="symmem-dist-") as tmp:
        spawn_ranks(_worker, (world, tmp, jobs, timeout), world, timeout=timeout, start_method=start_method,
                    what=f"the {world}-process run", imports=imports)
        found = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                found.append([None if r is None else RankPeak(**r) for r in json.load(f)])
    return [tuple(r for rank in range(world) if (r := found[rank][i]) is not None) for i in range(len(jobs))]


def spawn_ranks(fn: Any, args: tuple, world: int, *, timeout: float, start_method: str, what: str,
                imports: Sequence[str] = PRELOAD) -> None:
    """``fn(rank, *args)`` on ``world`` processes, joined within ``timeout`` seconds; a rank that fails, exits or
    overruns is one :class:`SymmemError` naming ``what`` (and the processes this call started are killed).
    ``start_method="forkserver"``: forked from a server that has imported :data:`PRELOAD` once; ``"fork"``: forked
    from this process, which imports ``imports`` first (:func:`preload`)."""
    import multiprocessing

    import torch.multiprocessing as mp

    if start_method not in START_METHODS:
        raise SymmemError(f"the ranks start by {', '.join(map(repr, START_METHODS))}, not {start_method!r}")
    if start_method == "forkserver":  # only read when the server starts (once a process)
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    if start_method == "fork":
        preload(imports)
    ctx = mp.start_processes(fn, args=args, nprocs=world, join=False, start_method=start_method)
    deadline = time.monotonic() + timeout
    try:
        while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise SymmemError(f"{what} did not finish within {timeout:g} s")
    except mp.ProcessRaisedException as e:
        last = str(e).strip().splitlines()[-1] if str(e).strip() else "no message"
        raise SymmemError(f"a rank of {what} failed: {last}") from None
    except mp.ProcessExitedException as e:
        raise SymmemError(f"a rank of {what} exited: {e}") from None
    finally:
        for p in ctx.processes:  # only the processes this call started
            if p.is_alive():
                p.kill()
                p.join(5)


def rank_imports(hf: bool) -> tuple[str, ...]:
    """What forked ranks need imported first: :data:`PRELOAD`, Hugging Face's modules only where a job builds an
    ``hf:`` model (``hf``)."""
    return tuple(n for n in PRELOAD if hf or n not in HF_PRELOAD)


def preload(names: Sequence[str]) -> None:
    """Import ``names`` in this process (a module that is missing is skipped): ranks forked from it afterwards
    (``start_method="fork"``) inherit them instead of each importing them."""
    import importlib

    for name in names:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def rank_starts() -> None:
    """What every rank does first: the objects it started with (a forked rank's: its parent's whole heap) set aside
    from the cyclic collector, so that no collection in the rank walks them (or writes their pages, copied on
    write).  The rank's own objects are collected as before; what a rank measures is unchanged."""
    import gc

    gc.freeze()


def _worker(rank: int, world: int, tmp: str, jobs: Sequence[Job], timeout: float) -> None:
    """One rank: join the group, run every job, write its peaks to ``rank{rank}.json``."""
    from datetime import timedelta

    rank_starts()

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # 127.0.0.1 only
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    from .collectives import released

    try:
        groups: dict[int, Any] = {}
        with released():  # every collective's tensors released on this thread, at a fixed op (not gloo's)
            out = [None if job.once and job.group and rank >= job.group else _run_job(job, rank, group).__dict__
                   for job in jobs for group in (_group(job.group, world, rank, groups),)]
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.json.part"), "w") as f:
        json.dump(out, f)
    os.replace(os.path.join(tmp, f"rank{rank}.json.part"), os.path.join(tmp, f"rank{rank}.json"))


def _group(size: int, world: int, rank: int, made: dict[int, Any]) -> Any:
    """This rank's process group of ``size`` consecutive ranks (None: the whole world); every rank makes every
    group, in the same order, once per size."""
    if not size or size == world:
        return None
    if size < 1 or world % size:
        raise SymmemError(f"a group of {size} ranks does not divide a world of {world}")
    if size not in made:
        import torch.distributed as dist

        mine = [dist.new_group(list(range(i, i + size))) for i in range(0, world, size)]
        made[size] = mine[rank // size]
    return made[size]


def _run_job(job: Job, rank: int, group: Any = None) -> RankPeak:
    """Wrap the reference in the engine and record ``job.steps`` steps (in ``group``: None, the world)."""
    import functools
    from unittest import mock

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from . import steps as steps_module
    from .live_bytes import LiveTracker

    module, inputs, target = _reference(job)
    if job.engine in SHARDED or job.engine in FSDP1:
        if group is not None:
            raise SymmemError("FSDP's runs take the whole world, not a group of it")
        return _run_sharded(job, rank, module, inputs, target)
    if job.checkpoint == "selective":  # each layer's core attention checkpointed (the reference's eager path)
        module.checkpoint = job.checkpoint
    wrapped = DistributedDataParallel(module, gradient_as_bucket_view=job.engine == "ddp-bucket-view",
                                      process_group=group)
    rank = dist.get_rank(group)
    before: list[set[int]] = []

    class Tracker(LiveTracker):
        """The recorder, noting before it closes which storages were made before it started (``external``)."""

        def trace(self, *args: Any, **kwargs: Any) -> Any:
            before.append({s.sid for s in self.storages if "external" in s.labels})
            return super().trace(*args, **kwargs)

    # track_step builds its own recorder (and optimizer): this worker process swaps in the one that notes
    # pre-existing memory (and ZeroRedundancyOptimizer around the optimizer make_optimizer picks)
    with mock.patch.object(steps_module, "LiveTracker", Tracker), \
            mock.patch.object(steps_module, "make_optimizer", functools.partial(zero_optimizer, group=group)
                              if job.engine == ZERO
                              else steps_module.make_optimizer):
        trace = steps_module.track_step(wrapped, inputs, loss="cross-entropy" if job.loss else "sum",
                                        target=target, optimizer=job.optimizer, impl=job.impl, steps=job.steps,
                                        keep_output=job.keep_logits)
    return _peaks(trace, before[0], rank)


def zero_optimizer(params: Sequence[Any], optimizer: str, impl: str, lr: float, group: Any = None) -> Any:
    """``ZeroRedundancyOptimizer(params, optimizer_class=...)`` around the optimizer :func:`make_optimizer` picks,
    with its settings (each rank's local optimizer steps the whole parameters it owns)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from .optim import make_optimizer

    ref = make_optimizer(params, optimizer, impl, lr)  # the class and settings, no state yet
    keys = ("lr", "momentum", "weight_decay", "foreach", "fused")
    return ZeroRedundancyOptimizer(params, optimizer_class=type(ref), process_group=group,
                                   **{k: ref.defaults[k] for k in keys if ref.defaults.get(k) is not None})


def _run_sharded(job: Job, rank: int, module: Any, inputs: tuple[Any, ...], target: Any) -> RankPeak:
    if job.engine in FSDP1:
        from .fsdp1_runs import STRATEGIES, run_fsdp1

        trace = run_fsdp1(module, inputs, target, loss=job.loss, optimizer=job.optimizer, impl=job.impl,
                          steps=job.steps, strategy=STRATEGIES[job.engine], checkpoint=job.checkpoint,
                          micro_batches=job.micro_batches)
    else:
        from .sharded import run_sharded

        trace = run_sharded(module, inputs, target, loss=job.loss, optimizer=job.optimizer, impl=job.impl,
                            steps=job.steps, reshard=job.engine == "fsdp", checkpoint=job.checkpoint,
                            micro_batches=job.micro_batches, mp=job.mp)
    # storages first seen as an op's aliased output here are gloo's copies inside a collective (the reduce-scatter
    # input, split on the way out): outside tensor accounting, as NCCL's buffers are on a GPU; left out
    gloo = {s.sid for s in trace.storages if s.category == "external"}
    return _peaks(trace, set(), rank, gloo)


def _reference(job: Job) -> tuple[Any, tuple[Any, ...], Any]:
    """The job's reference module, its inputs and the class targets of its loss (None: the module takes labels,
    or the loss is the output's sum)."""
    import torch

    from ..reference import reference
    from .identity import first_tensor

    if job.builder is not None:
        module, inputs = job.builder()
    else:
        module, inputs = reference(job.model, dict(job.numbers), dict(job.options))
    target = None
    if job.loss and not getattr(module, "takes_labels", False):
        with torch.no_grad():
            logits = first_tensor(module(*inputs))
        target = torch.randint(0, logits.shape[-1], tuple(logits.shape[:-1]),
                               generator=torch.Generator().manual_seed(0))
        del logits
    return module, inputs, target


def _peaks(trace: Any, made_before: set[int], rank: int, left_out: set[int] = frozenset()) -> RankPeak:
    """Per-step peaks with the storages made before recording counted from the start, and those ``left_out`` not
    counted at all."""
    extra = [(s.born, s.nbytes) for s in trace.storages if s.sid in made_before and s.born is not None]
    out = [(s.born, len(trace.records) if s.died is None else s.died, s.nbytes) for s in trace.storages
           if s.sid in left_out and s.born is not None]
    per_step: dict[int, tuple[int, str]] = {}
    for r in trace.records:
        live = r.live + sum(n for born, n in extra if born > r.index)
        live -= sum(n for born, died, n in out if born <= r.index < died)
        if live > per_step.get(r.step, (-1, ""))[0]:
            per_step[r.step] = (live, f"{r.phase} {r.where}".strip())
    steady = max(range(2, trace.steps + 1), key=lambda s: per_step[s][0])
    end = trace.boundary(1, "zero_grad")
    kept = end.live - trace.start.live - sum(n for born, n in extra if born <= end.index)
    # the last backward's end (with gradient accumulation, the last micro-batch's: the one that reduces)
    held = dict([b for b in trace.boundaries if b.step == trace.steps and b.phase == "backward"][-1].by_category)
    late = sum(1 for sid in trace.late if sid not in left_out)
    return RankPeak(rank, tuple(per_step[s][0] for s in range(1, trace.steps + 1)),
                    trace.start.live + sum(n for _, n in extra), per_step[steady][1], kept, held, late)


def compare(derivation: Derivation, ranks: Sequence[RankPeak], steady_gap: int = 0) -> list[str]:
    """Where the derivation's per-rank peaks differ from the measured ranks (empty: equal to the byte); a known
    ``steady_gap`` (derived minus measured) is taken out of the steady peak first."""
    want = {"first": derivation.value("peak_first_step"), "steady": derivation.value("peak") - steady_gap}
    # gloo's worker threads drop a finished collective's buffers when the load lets them: a late free reads as more
    # memory, never less, so the steady peak compared is the lowest of the identical steady steps
    got = {r.rank: {"first": r.first, "steady": min(r.per_step[1:])} for r in ranks}
    return [f"rank {r.rank} {which}: derived {v}, measured {got[r.rank][which]} (at {r.where})"
            for r in ranks for which, v in want.items() if got[r.rank][which] != v]


def compare_parameter_side(derivation: Derivation, ranks: Sequence[RankPeak]) -> list[str]:
    """Where the derivation's parameter side per rank (:func:`symmem.passes.rank_side.parameter_side_per_rank`)
    differs from what each measured rank holds when its last backward ends (empty: equal to the byte): weights
    and buffers, every ``.grad`` storage, the optimizer state.  Two things the recorder cannot label are checked by
    what is left: DDP's buckets (made before the recorder, or rebuilt inside it by an op, not a ``.grad``) and
    ZeroRedundancyOptimizer's state (its local optimizer's, not in the wrapper's ``optimizer.state``: it is what
    the first step leaves alive, :attr:`RankPeak.kept`)."""
    from ..passes.rank_side import parameter_side_per_rank

    derived = parameter_side_per_rank(derivation)
    if derived is None:
        return [f"no parameter side per rank under data_parallel={derivation.regime.data_parallel!r}"]
    zero = derivation.regime.data_parallel == ZERO
    wrong = []
    for r in ranks:
        want, got = derived[r.rank], dict(r.parameter_side)
        held = r.held or {}
        if zero:
            got["optimizer_state"] = r.kept
        if derivation.regime.data_parallel not in (*SHARDED, *FSDP1):  # gloo's late frees are FSDP's only
            got["buckets"] = held.get("temporary", 0) + held.get("external", 0) - (r.kept if zero else 0)
        wrong += [f"rank {r.rank} {k}: derived {want[k]}, measured {v}" for k, v in got.items() if want[k] != v]
    return wrong


def summary(ranks: Sequence[RankPeak]) -> Mapping[str, Any]:
    """The measured ranks as plain values (for docs and reports)."""
    return {f"rank{r.rank}": {"first": r.first, "steady": r.steady, "start": r.start, "where": r.where}
            for r in ranks}
