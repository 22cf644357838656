"""Stored real gloo runs: each rank's measurement (:class:`symmem.record.distributed.RankPeak`) of a data-parallel
job, made by :func:`symmem.record.distributed.measure_jobs` and kept in ``tests/data/gloo_runs.json``.

A test runs some of its jobs LIVE (one spawn) and REPLAYS the rest from the store: the same checks, against the
derivations made in the test, run on both (a replayed rank is the stored measurement, not a number typed in).  Its
deep twin (``python -m pytest -m deep``) runs every job live and compares each rank with the stored one
(:func:`runs` with ``every=True``): first peak, steady peak, start, where, what step 1 kept, the parameter side, late
frees.  ``SYMMEM_GLOO_STORE=write`` with ``-m deep`` writes the fresh runs into the store instead (regenerating it
after a change that moves the real bytes: torch's version, a reference model).

A stored rank keeps the first step's peak and the lowest steady step's (the checks' own ``min(per_step[1:])``) as
``per_step``: the store was first made with three recorded steps and every FSDP job's one steady step
(:func:`symmem.record.distributed.steps_of`) then equalled it to the byte.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import pytest

from symmem.record.distributed import FSDP1, SHARDED, Job, RankPeak, measure_jobs

STORE = Path(__file__).parent / "data" / "gloo_runs.json"
#: how the suite's real runs start their ranks: forked from the test process, which imports what they need first,
#: once (symmem.record.distributed.preload), not from a forkserver (a fresh interpreter importing torch, its engines
#: and transformers again: ~8.5 CPU-s a process); measured and tested in docs/testing.md, "Stop 41: gloo41"
START = "fork"
ROOT = Path(__file__).resolve().parent.parent


def key(job: Job, world: int) -> str:
    """The job's key in the store: every field that shapes the run (the steps recorded aside: the store keeps the
    first and the lowest steady step), a traced module's file relative to the repository."""
    fields = dataclasses.asdict(job)
    del fields["steps"]
    if job.builder is not None:
        spec, _, rest = job.builder.spec.partition(":") if not job.builder.spec.startswith("hf:") else (
            job.builder.spec, "", "")
        if rest:
            spec = f"{Path(spec).resolve().relative_to(ROOT)}:{rest}"
        fields["builder"] = {"spec": spec, "config": list(map(list, job.builder.config)), "seed": job.builder.seed}
        fields["model"] = spec
    return json.dumps({"world": world, **fields}, sort_keys=True, default=list)


def row(r: RankPeak) -> dict[str, Any]:
    """What the store keeps of a rank."""
    return {"rank": r.rank, "first": r.first, "steady": min(r.per_step[1:]), "start": r.start, "where": r.where,
            "kept": r.kept, "held": r.held, "late": r.late}


def compared(stored: list[dict[str, Any]] | None, engine: str) -> list[dict[str, Any]] | None:
    """What a fresh run must repeat of a stored one: all of it but what gloo's timing moves and no check reads --
    under DDP's reducer (DDP, ZeroRedundancyOptimizer) the count of late frees (C++ all-reduces no wrapper reaches:
    one late free on 3 of 40 job-ranks, none at a peak), under FSDP gloo's own copies (``external``) still alive when
    backward ends (outside tensor accounting; one of 62 job-ranks held one)."""
    if stored is None:
        return None
    sharded = engine in SHARDED or engine in FSDP1
    return [{**r, "late": r["late"] if sharded else None,
             "held": {k: v for k, v in (r["held"] or {}).items() if not (sharded and k == "external")}}
            for r in stored]


def replay(stored: dict[str, Any]) -> RankPeak:
    return RankPeak(stored["rank"], (stored["first"], stored["steady"]), stored["start"], stored["where"],
                    stored["kept"], stored["held"], stored["late"])


def _load() -> dict[str, list[dict[str, Any]]]:
    return json.loads(STORE.read_text()) if STORE.exists() else {}


def runs(jobs: Sequence[Job], world: int, live: Collection[int], *, timeout: float, every: bool = False
         ) -> list[tuple[RankPeak, ...]]:
    """Each job's ranks: the jobs at the indices ``live`` run in one spawn of ``world`` ranks (forked from this
    process: :data:`START`), the others replayed from the store.  ``every``: every job runs live and each is
    compared with its stored ranks (or, under ``SYMMEM_GLOO_STORE=write``, stored)."""
    chosen = range(len(jobs)) if every else sorted(live)
    fresh = dict(zip(chosen, measure_jobs([jobs[i] for i in chosen], world, timeout=timeout, start_method=START),
                     strict=True)) if chosen else {}
    stored = _load()
    if every:
        if os.environ.get("SYMMEM_GLOO_STORE") == "write":
            stored.update({key(job, world): [row(r) for r in fresh[i]] for i, job in enumerate(jobs)})
            STORE.write_text(json.dumps(dict(sorted(stored.items())), indent=0) + "\n")
        else:
            wrong = [f"{key(job, world)}: stored {stored.get(key(job, world))}, measured {[row(r) for r in fresh[i]]}"
                     for i, job in enumerate(jobs) if compared(stored.get(key(job, world)), job.engine)
                     != compared([row(r) for r in fresh[i]], job.engine)]
            assert not wrong, "\n".join(wrong)
        return [fresh[i] for i in range(len(jobs))]
    missing = [key(job, world) for i, job in enumerate(jobs) if i not in fresh and key(job, world) not in stored]
    if missing:
        pytest.fail(f"no stored run of {missing[0]}: run its test's deep twin with SYMMEM_GLOO_STORE=write "
                    f"(tests/gloo_store.py)")
    return [fresh[i] if i in fresh else tuple(replay(s) for s in stored[key(job, world)])
            for i, job in enumerate(jobs)]
