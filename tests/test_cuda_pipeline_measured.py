"""Pipeline stages against an H200: two ranks on one GPU, each stage's peak read from CUDA's caching allocator.

Oracle: ``tests/data/cuda_h200_pipeline.json``, written by ``benchmarks/check_cuda_parallel.py --only-pipeline``
(torch 2.11 + CUDA 13): the suite's pipeline cases (tests/test_model_parallel.py: GPT-2 and Llama, GPipe and 1F1B,
M = 1 to 4, cross-entropy and the loss ``sum``, eager and SDPA attention, and a wider Llama), each stage a process
on the one GPU, ``torch.distributed.pipelining`` over gloo with the sends and receives staged through host memory
(gloo moves host tensors only; a send keeps its device tensor for its work's life, as c10d's works do), four steps
of ``requested_bytes.all.peak`` -- the bytes the tensors asked the allocator for, before it rounds them into
blocks -- less what the rank held before its stage was built.  Control rows: the whole Llama on one device.

symmem's peak counts tensors wherever they live; the for-loop and foreach AdamW keep their ``step`` counts on the
host (4 bytes a parameter tensor, no device memory), so each device peak is the prediction less those.  Two
things the CPU ranks could not show are in the prediction: softmax's backward ``tmp`` (docs/cuda.md) and, with the
loss ``sum``, the head's backward cloning the expanded gradient dense for cuBLAS (one (B*S, V) tensor beside the
new gradients: the allocator's history with C++ frames put it in ``prepare_matrix_for_cublas``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from symmem import derive
from symmem.passes import data_parallel, rank_numbers
from tests.kept_cases import kept

DATA = json.loads((Path(__file__).parent / "data" / "cuda_h200_pipeline.json").read_text())
#: symmem models the step CUDA runs by default under pipeline stages (foreach)
PIPELINE = [r for r in DATA["rows"] if r["kind"] == "pipeline" and r["impl"] == "foreach"]
SINGLE = [r for r in DATA["rows"] if r["kind"] == "single"]


def _cases() -> list[tuple[tuple, dict[int, list[dict[str, int]]]]]:
    found: dict[tuple, dict[int, list[dict[str, int]]]] = {}
    for r in PIPELINE:
        key = (r["model"], json.dumps(r["values"]), r["schedule"], r["M"], r["loss"], json.dumps(r["options"]))
        found.setdefault(key, {})[r["rank"]] = r["steps"]
    return sorted(found.items())


def _host_steps(model: str, values: dict[str, int], options: dict, rank: int) -> int:
    """The ``step`` counts' bytes of the real stage module's AdamW: one 0-dim FP32 tensor a parameter."""
    pytest.importorskip("torch")
    from symmem.record.model_parallel_runs import _stage_module

    return 4 * len(list(_stage_module(model, values, rank, 2, options).parameters()))


def test_the_measurements_are_an_h200():
    assert "H200" in DATA["device"] and "+cu" in DATA["versions"]["torch"]
    assert len(_cases()) == 8 and len(SINGLE) == 4


#: the cases the default suite replays (stop 42, docs/testing.md): those a greedy cover of each table's line
#: coverage keeps (every model, schedule, engine, loss and micro-batch count stays); -m deep replays every case
STAGE_KEPT = {"gpt2 1f1b 4 cross-entropy", "llama gpipe 2 cross-entropy0", "llama 1f1b 2 cross-entropy",
              "gpt2 gpipe 2 sum", "gpt2 gpipe 1 cross-entropy", "llama 1f1b 4 sum"}
SINGLE_KEPT = {"sdpa foreach", "naive foreach", "sdpa for-loop", "naive for-loop"}
MESH_KEPT = {"gpt2 gpipe 2 cross-entropy zero-redundancy", "gpt2 1f1b 2 cross-entropy ddp",
             "llama 1f1b 2 cross-entropy ddp", "llama gpipe 2 cross-entropy ddp-bucket-view", "llama 1f1b 2 sum ddp",
             "llama gpipe 2 cross-entropy zero-redundancy", "llama gpipe 2 cross-entropy ddp",
             "llama 1f1b 2 cross-entropy zero-redundancy"}
OPTIMIZER_KEPT = {"gpt2 gpipe 2 cross-entropy zero-redundancy", "llama 1f1b 2 sum ddp",
                  "llama gpipe 2 cross-entropy ddp-bucket-view", "llama 1f1b 2 cross-entropy zero-redundancy"}


@pytest.mark.parametrize("case", kept(_cases(), [" ".join(str(k) for k in c[0][:1] + c[0][2:5]) for c in _cases()],
                                      STAGE_KEPT))
def test_every_stage_on_the_h200(case):
    (model, values, schedule, m, loss, options), ranks = case
    values, options = json.loads(values), json.loads(options)
    sizes = {**values, "F": 4 * values["H"]} if model == "gpt2" else values
    d = derive(model, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, loss=loss, device="cuda",
               values={**sizes, "p": 2}, **options)
    step = d._step()
    peaks = [r.peak for r in step._replays(step._named(d.numbers))]
    for rank, steps in sorted(ranks.items()):
        host = _host_steps(model, values, options, rank)
        first, *_, steady = [s["requested"] for s in steps]
        assert steady + host == peaks[rank].bytes, (rank, steps)
        # the first step makes the step counts in AdamW's step: on the host from there on
        in_step = peaks[rank].first == peaks[rank].step
        assert first + (host if in_step else 0) == peaks[rank].first, (rank, steps)
    assert d.value("peak") == max(p.bytes for p in peaks)  # the JSON's peak (test_rank_formulas.py: its views)


@pytest.mark.parametrize("row", kept(SINGLE, [f"{r['options']['attention']} {r['impl']}" for r in SINGLE], SINGLE_KEPT))
def test_one_device_control(row):
    """The whole model on one rank: requested bytes are the peak in bytes of tensors less the host step counts;
    ``peak_allocated`` (the blocks) is ``max_memory_allocated``."""
    d = derive("llama", convention="pytorch", device="cuda", loss="sum", optimizer_impl=row["impl"],
               values=row["values"], **row["options"])
    first, *_, steady = row["steps"]
    host = _one_device_host(row)
    walked = rank_numbers.written(d)  # the step at the row's numbers: its peaks without the formula
    assert (first["requested"], steady["requested"] + host) == (walked.peak("first"), walked.peak("steady"))
    assert (first["allocated"], steady["allocated"]) == (walked.allocated("first"), walked.allocated("steady"))


def _one_device_host(row: dict) -> int:
    pytest.importorskip("torch")
    from symmem.reference.sequence_models import reference

    module, _ = reference("llama", row["values"], **row["options"])
    return 4 * len(list(module.parameters()))


MESH = [r for r in DATA["rows"] if r["kind"] == "mesh"]
#: round 41: the same mesh run again with each rank's allocator history (``SYMMEM_CUDA_SNAPSHOT=DIR
#: check_cuda_parallel.py --mesh``, read by ``--analyze --figures``): each step's optimizer step read apart
HISTORY = json.loads((Path(__file__).parent / "data" / "cuda_h200_mesh_history.json").read_text())


def _mesh_cases() -> list[tuple[tuple, dict[int, dict]]]:
    found: dict[tuple, dict[int, dict]] = {}
    for r in MESH:
        key = (r["model"], json.dumps(r["values"]), r["schedule"], r["M"], r["loss"], json.dumps(r["options"]),
               r["engine"])
        found.setdefault(key, {})[r["rank"]] = r
    return sorted(found.items())


MESH_LABELS = [" ".join(str(k) for k in c[0][:1] + c[0][2:5] + c[0][6:]) for c in _mesh_cases()]


@pytest.mark.parametrize("case", kept(_mesh_cases(), MESH_LABELS, MESH_KEPT))
def test_every_rank_of_ddp_on_stages_on_the_h200(case):
    """DDP, its bucket view and ZeRO-1 around each stage of a (2, 2) mesh: every rank's steady-step peak is the
    prediction less the step counts its real AdamW keeps on the host; the first step's too, less them where the
    first step's peak comes after AdamW made them."""
    (model, values, schedule, m, loss, options, engine), ranks = case
    values, options = json.loads(values), json.loads(options)
    sizes = {**values, "F": 4 * values["H"]} if model == "gpt2" else values
    d = derive(model, data_parallel=engine, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m,
               loss=loss, device="cuda", values={**sizes, "p": 2, "N": 2}, **options)
    # the JSON's peak_per_rank (report/text.py builds it from rank_peaks; test_rank_formulas.py: its views)
    per = {str(r): {"peak": s, "peak_first_step": f} for r, (f, s) in data_parallel.rank_peaks(d).items()}
    assert len(ranks) == 4 and d.value("peak") == max(v["peak"] for v in per.values())
    for rank, row in sorted(ranks.items()):
        first, *_, steady = [s["requested"] for s in row["steps"]]
        want = per[str(rank)]
        assert steady + row["host_state"] == want["peak"], (rank, row["steps"])
        assert want["peak_first_step"] - first in (0, row["host_state"]), (rank, row["steps"])


def _key(r: dict) -> tuple:
    return (r["model"], json.dumps(r["values"]), r["schedule"], r["M"], r["loss"], json.dumps(r["options"]),
            r["engine"], r["rank"])


def test_the_history_run_measured_what_the_first_did():
    """Round 41's run with allocator histories measured every rank and step as stop 37's did (32 of 32)."""
    assert "--mesh" in HISTORY["how"] and len(HISTORY["rows"]) == len(MESH) == 32
    assert {_key(r): (r["steps"], r["host_state"]) for r in HISTORY["rows"]} == {
        _key(r): (r["steps"], r["host_state"]) for r in MESH}


@pytest.mark.parametrize("case", kept(_mesh_cases(), MESH_LABELS, OPTIMIZER_KEPT))
def test_every_ranks_optimizer_step_on_the_h200(case):
    """The optimizer step's own peak, which the schedule's hides in the peak: each rank's steady step read from its
    allocator history (from the step's first AdamW allocation on), plus the host step counts, is the rank's replay's
    step to the byte.  ZeroRedundancyOptimizer's local AdamW is foreach on CUDA as PyTorch picks it (a for-loop step,
    symmem's before round 41, is up to 916,480 B high and 132,096 B low on the wide Llama's ranks)."""
    (model, values, schedule, m, loss, options, engine), _ = case
    rows = {r["rank"]: r for r in HISTORY["rows"] if _key(r)[:-1] == case[0]}
    values, options = json.loads(values), json.loads(options)
    sizes = {**values, "F": 4 * values["H"]} if model == "gpt2" else values
    d = derive(model, data_parallel=engine, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m,
               loss=loss, device="cuda", values={**sizes, "p": 2, "N": 2}, **options)
    assert sorted(rows) == [0, 1, 2, 3]
    for rank, row in sorted(rows.items()):
        step = d.step.at_rank(row["dp"])
        want = step._replays(step._named(d.numbers))[row["pp"]].peak
        for w, measured in zip(row["history"], row["steps"], strict=True):
            # the history is the measurement (its requested bytes: a large block can keep an unsplit remainder, so
            # its 512-rounded sum need not be max_memory_allocated on the wide Llama); no gloo temporary nor FSDP2
            # copy-out is alive at a DDP stage's peak
            assert w["peak"] == measured["requested"], (rank, w)
            assert w["peak"] == w["less_c10d"] == w["less_copy-out"], (rank, w)
        steady = row["history"][-1]
        assert steady == row["history"][1], rank  # every steady step alike
        assert steady["optimizer_step"] + row["host_state"] == want.step, (rank, steady)
