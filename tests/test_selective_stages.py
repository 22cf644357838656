"""Selective recomputation on pipeline stages (``--checkpoint selective --pipeline-parallel``, alone and with DDP,
ZeRO-1 and FSDP2 on the stages) against the real engine.

The truth: ``torch.distributed.pipelining`` on gloo (the runs of tests/test_pipeline_checkpoint.py,
tests/test_ddp_pipeline.py and tests/test_fsdp_pipeline.py), each Llama stage running its layers with the core
attention under ``torch.utils.checkpoint(..., use_reentrant=False)``, called as HF calls it
(``symmem.record.model_parallel_runs``' Llama stage: each stage makes its own mask and position ids and passes the
ids along; the cache on, as HF keeps it where no layer is checkpointed whole).  symmem's side is the single-device
step with each layer's core a checkpointed segment, cut by stage (a recomputed op is its layer's stage's) and
replayed in the schedule's order -- nothing new: the refusal is lifted.  GPT-2's cores are called with a mask the
graph has no node for (made once by the model): on stages that stays refused, in one line.

:data:`JOBS` (the plain stages) ride in tests/test_model_parallel.py's spawn; :data:`MEASURED` holds every case
measured (the engines' mesh runs: 4 ranks, p = 2 x N = 2), replayed here; ``-m deep`` reruns them.
"""

from __future__ import annotations

from typing import Any

import pytest

LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 4, "V": 64, "F": 64}
OPTIONS = {"attention": "naive", "checkpoint": "selective"}
#: the plain stages (p = 2, two layers a stage): 1F1B with the loss sum, GPipe with the cross-entropy
JOBS = [("pipeline", "llama", LLAMA, ("1f1b", 2, "sum", OPTIONS)),
        ("pipeline", "llama", LLAMA, ("gpipe", 2, "cross-entropy", OPTIONS))]
#: (model, sizes, schedule, M, loss, options, engine) on the 2 x 2 mesh: DDP 1F1B and ZeRO-1 GPipe M = 3 (the ranks
#: of a stage own different parameters), FSDP2 resharding 1F1B and without resharding GPipe M = 3 (V = 63 pads the
#: embedding's and head's rows: the data-parallel rank 1 holds less)
MESH = [("llama", {**LLAMA, "L": 2, "V": 63}, "1f1b", 2, "cross-entropy", OPTIONS, "ddp"),
        ("llama", LLAMA, "gpipe", 3, "sum", OPTIONS, "zero-redundancy"),
        ("llama", {**LLAMA, "L": 2, "V": 63}, "1f1b", 2, "cross-entropy", OPTIONS, "fsdp"),
        ("llama", {**LLAMA, "V": 63}, "gpipe", 3, "sum", OPTIONS, "fsdp-no-reshard")]
#: Measured, per stage (plain) or per rank (pp, dp: 0 0, 0 1, 1 0, 1 1): (first-step peak, steady peak, the steady
#: schedule's largest moment, the optimizer step's), gloo on the CPU, torch 2.13, FP32 for-loop AdamW
MEASURED: dict[str, tuple[tuple[int, int, int, int], ...]] = {
    "1f1b": ((409888, 574828, 574828, 363116), (379504, 522620, 522620, 379504)),
    "gpipe": ((409888, 574828, 574828, 363116), (443312, 608512, 608512, 380016)),
    "ddp": ((278048, 368456, 368456, 259272),) * 2 + ((276044, 361176, 361176, 276044),) * 2,
    "zero-redundancy": ((643744, 726212, 726212, 367428), (643744, 726216, 726216, 367432),
                        (680496, 763224, 763224, 391880), (680496, 762968, 762968, 391624)),
    "fsdp": ((280480, 325832, 325832, 111688), (280480, 325576, 325576, 111432),
             (252652, 298136, 298136, 128076), (252652, 297880, 297880, 127820)),
    "fsdp-no-reshard": ((602528, 685036, 685036, 190316), (602528, 684780, 684780, 190060),
                        (638704, 721344, 721344, 214000), (638704, 721088, 721088, 213744)),
}


def _plain(job: tuple[Any, ...]) -> Any:
    from symmem import derive

    _, model, values, (schedule, m, loss, options) = job
    return derive(model, convention="pytorch", device="cpu", optimizer="adamw", pipeline_parallel=True,
                  pipeline_schedule=schedule, micro_batches=m, loss=loss, values={**values, "p": 2}, **options)


def _mesh(case: tuple[Any, ...]) -> Any:
    from symmem import derive

    model, values, schedule, m, loss, options, engine = case
    return derive(model, data_parallel=engine, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m,
                  loss=loss, device="cpu", values={**values, "p": 2, "N": 2}, **options)


def _peaks(replay: Any) -> tuple[int, int, int, int]:
    p = replay.peak
    return p.first, p.bytes, p.pipeline, p.step


def _derived_plain(job: tuple[Any, ...]) -> tuple[tuple[int, int, int, int], ...]:
    d = _plain(job)
    return tuple(_peaks(r) for r in d.step._replays({s.name: int(v) for s, v in d.numbers.items()}))


def _derived_mesh(case: tuple[Any, ...]) -> tuple[tuple[int, int, int, int], ...]:
    d = _mesh(case)
    named = {s.name: int(v) for s, v in d.numbers.items()}
    replays = {dp: (d.step if dp == 0 else d.step.at_rank(dp))._replays(named) for dp in (0, 1)}
    return tuple(_peaks(replays[dp][pp]) for pp in (0, 1) for dp in (0, 1))


@pytest.mark.parametrize("case", MESH, ids=[c[-1] for c in MESH])
def test_every_rank_on_the_mesh_equals_its_stored_gloo_measurement(case):
    d = _mesh(case)
    assert _derived_mesh(case) == MEASURED[case[-1]]
    ranks = MEASURED[case[-1]]
    assert (d.value("peak"), d.value("peak_first_step")) == (max(r[1] for r in ranks), max(r[0] for r in ranks))


def against_the_engines(real: list[list[Any]]) -> None:
    """``real``: per rank (stage), the :data:`JOBS` runs: every stage's peaks, derived and stored, to the byte."""
    for k, job in enumerate(JOBS):
        got = tuple((r[k].first_peak, r[k].peak, r[k].pipeline_peak, r[k].step_peak) for r in real)
        assert got == _derived_plain(job) == MEASURED[job[3][0]], (job[3][0], got)


def test_gpt2_and_sdpa_stay_refused_in_one_line():
    from symmem import derive

    for model, attention, why in (("gpt2", "naive", "not with GPT-2's model-wide mask"),
                                  ("llama", "sdpa", "modelled for eager attention")):
        d = derive(model, pipeline_parallel=True, micro_batches=2, attention=attention, checkpoint="selective",
                   device="cpu", values={"L": 2, "p": 2})
        refused = d.to_dict()["peak_refused"]
        assert why in refused and "\n" not in refused, refused


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_the_mesh_cases_against_fresh_gloo_runs():
    from symmem.record.ddp_pipeline_runs import ddp_pipeline_runs
    from symmem.record.fsdp_pipeline_runs import fsdp_pipeline_runs

    ddp = [c for c in MESH if c[-1].startswith(("ddp", "zero"))]
    fsdp = [(*c[:-1], c[-1] == "fsdp") for c in MESH if c[-1].startswith("fsdp")]
    for cases, found in ((ddp, ddp_pipeline_runs(2, 2, ddp, start_method="forkserver")),
                         (fsdp, fsdp_pipeline_runs(2, 2, fsdp, start_method="forkserver"))):
        for k, case in enumerate(cases):
            real = sorted((r[k] for r in found), key=lambda r: (r.pp, r.dp))
            got = tuple((r.first_peak, r.steady_peak, r.pipeline_peak, r.step_peak) for r in real)
            name = case[-1] if isinstance(case[-1], str) else ("fsdp" if case[-1] else "fsdp-no-reshard")
            assert got == MEASURED[name], (name, got)
