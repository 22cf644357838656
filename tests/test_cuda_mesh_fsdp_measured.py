"""FSDP2 on pipeline stages against an H200: four ranks on one GPU, every rank's peak read from CUDA's allocator.

Oracles: ``tests/data/cuda_h200_mesh_fsdp.json`` (stop 37) and ``tests/data/cuda_h200_mesh_fsdp_history.json``
(rounds 38 and 41: the same run again with each rank's allocator history recorded, ``SYMMEM_CUDA_SNAPSHOT=DIR
benchmarks/check_cuda_parallel.py --mesh-fsdp``, read by its ``--analyze --figures``), torch 2.11 + CUDA 13, a
(pp, dp) = (2, 2) mesh, ``fully_shard`` on each layer and the stage root, gloo with CUDA tensors, CUDA's default
foreach AdamW, two unmeasured steps, a first and three steady ones.

symmem's CUDA prediction is each history's peak read without two bands (docs/cuda.md): the allocations gloo makes
inside the collectives (device temporaries NCCL does not make in the caching allocator) and FSDP2's copy-out
metadata (``split_with_sizes_copy`` packs its splits' pointers into a small device tensor on CUDA), plus the real
AdamW's host ``step`` counts (symmem counts them as the state's).  Round 41 ran it again (the history stored now):
stop 37's and round 38's harness kept the reference's tied head on GPT-2's stage 0, which held the embedding's
first tensor beside FSDP2's shards (V x H x 4 bytes, moved to the GPU after the baseline); the stage now holds the
reference's parts only, and that stage measured exactly those bytes less.  The same holds for the
optimizer step's own peak (foreach: one ``sqrt`` of every held parameter at once).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from symmem import derive
from symmem.passes.data_parallel import rank_peaks

HERE = Path(__file__).parent / "data"
MEASURED = json.loads((HERE / "cuda_h200_mesh_fsdp.json").read_text())
HISTORY = json.loads((HERE / "cuda_h200_mesh_fsdp_history.json").read_text())


def _key(r: dict) -> tuple:
    return (r["model"], json.dumps(r["values"]), r["schedule"], r["M"], r["loss"], json.dumps(r["options"]),
            r["engine"])


def _cases() -> list[tuple[tuple, dict[int, dict]]]:
    found: dict[tuple, dict[int, dict]] = {}
    for r in HISTORY["rows"]:
        found.setdefault(_key(r), {})[r["rank"]] = r
    return sorted(found.items())


def _derived(key: tuple) -> tuple[dict[int, dict[str, int]], list]:
    """symmem's CUDA prediction of every rank ({rank: peak, first step's, optimizer step's}) and its stage peaks."""
    model, values, schedule, m, loss, options, engine = key
    values, options = json.loads(values), json.loads(options)
    sizes = {**values, "F": 4 * values["H"]} if model == "gpt2" else values
    d = derive(model, data_parallel=engine, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m,
               loss=loss, device="cuda", values={**sizes, "p": 2, "N": 2}, **options)
    # the JSON's peak_per_rank (report.text.peak) without the rest of the JSON (the formulas printed, every view)
    per = {str(r): {"peak": s, "peak_first_step": f} for r, (f, s) in rank_peaks(d).items()}
    out = {}
    for rank, want in per.items():
        step = d.step.at_rank(int(rank) % 2)
        stage = step._replays(step._named(d.numbers))[int(rank) // 2].peak
        out[int(rank)] = {**want, "optimizer_step": stage.step}
    return out, d


@functools.cache  # both data-parallel ranks of a stage build the same module
def _buffers(model: str, values_json: str, options_json: str, stage: int) -> int:
    """The stage's buffers' bytes, from the real stage module on the CPU: ``Module.to`` moves them to the GPU after
    the baseline and ``fully_shard`` leaves them whole (since round 41 a stage holds the reference's parts, not the
    reference, so no tied head outside the stage keeps a parameter's unsharded tensor: ``moved`` is only these)."""
    pytest.importorskip("torch")
    from symmem.record.model_parallel_runs import _stage_module

    module = _stage_module(model, json.loads(values_json), stage, 2, json.loads(options_json))
    return sum(b.numel() * b.element_size() for b in module.buffers())


def test_the_measurements_are_an_h200_run_twice():
    """The history run (round 41) measured what stop 37's run did, rank by rank and step by step, but on GPT-2's
    stage 0: there stop 37's harness kept the reference's tied head, holding the embedding's first tensor (V x H x 4
    bytes) beside FSDP2's shards in every step, and the round-41 harness does not."""
    assert "H200" in MEASURED["device"] and "+cu" in MEASURED["versions"]["torch"]
    assert HISTORY["bands"] == ["c10d", "copy-out"]
    assert len(HISTORY["rows"]) == len(MEASURED["rows"]) == 12
    stop37 = {(_key(r), r["rank"]): (r["steps"], r["host_state"]) for r in MEASURED["rows"]}
    for r in HISTORY["rows"]:
        old, host = stop37[(_key(r), r["rank"])]
        leftover = r["values"]["V"] * r["values"]["H"] * 4 if (r["model"], r["pp"]) == ("gpt2", 0) else 0
        assert host == r["host_state"]
        assert [{k: v - leftover for k, v in s.items()} for s in old] == r["steps"], r["rank"]


@pytest.mark.parametrize("case", _cases(), ids=lambda c: " ".join(str(k) for k in c[0][:1] + c[0][2:4] + c[0][6:]))
def test_every_rank_of_fsdp2_on_stages_on_the_h200(case):
    """Every rank's first and steady peaks and its optimizer step's peak: the history's, read without gloo's
    collective temporaries and FSDP2's copy-out metadata, less the harness's leftover, plus the host step counts, is
    symmem's CUDA prediction to the byte."""
    key, ranks = case
    model = key[0]
    want, d = _derived(key)
    assert len(ranks) == 4 and d.value("peak") == max(w["peak"] for w in want.values())
    for rank, row in sorted(ranks.items()):
        buffers = _buffers(model, key[1], key[5], row["pp"])
        first, *_, steady = row["history"]
        for w, measured in zip(row["history"], row["steps"], strict=True):
            # the history is the measurement: its peak is requested_bytes' peak, its blocks max_memory_allocated
            assert (w["peak"], w["rounded"]) == (measured["requested"], measured["allocated"]), (rank, w)
            assert w["moved"] == buffers, (rank, w)
        assert steady == row["history"][1], rank  # every steady step alike
        host = row["host_state"]
        assert steady["less_copy-out"] + host == want[rank]["peak"], (rank, steady)
        # the first step's peak is in the schedule, before AdamW makes its state and its step counts
        assert first["less_copy-out"] == want[rank]["peak_first_step"], (rank, first)
        assert steady["optimizer_step"] + host == want[rank]["optimizer_step"], (rank, steady)


def test_the_bands_are_gloo_and_the_copy_out():
    """What the bands are, where they are not zero: gloo's temporaries one unit's all-gather (its whole parameters:
    GPT-2's and Llama's layer, 50,816 and 37,120 bytes, alive at the measured peak), the copy-out metadata under one
    512-byte block."""
    seen = {}
    for r in HISTORY["rows"]:
        w = r["history"][-1]
        c10d, copy_out = w["peak"] - w["less_c10d"], w["less_c10d"] - w["less_copy-out"]
        assert 0 <= copy_out < 512 and c10d >= 0
        assert w["by"].get("c10d", 0) in (0, {"gpt2": 50_816, "llama": 37_120}[r["model"]])
        seen[(r["model"], r["schedule"], r["engine"], r["pp"])] = (c10d, copy_out, w["by"].get("c10d", 0))
    # measured - predicted per stage: llama GPipe fsdp stage 1 +8,192, GPT-2 1F1B fsdp +8,536 / +10,368
    assert seen == {("gpt2", "1f1b", "fsdp", 0): (0, 344, 0), ("gpt2", "1f1b", "fsdp", 1): (10_368, 0, 50_816),
                    ("llama", "1f1b", "fsdp-no-reshard", 0): (0, 0, 0),
                    ("llama", "1f1b", "fsdp-no-reshard", 1): (0, 0, 0),
                    ("llama", "gpipe", "fsdp", 0): (0, 0, 0), ("llama", "gpipe", "fsdp", 1): (7_800, 392, 37_120)}


def test_the_cuda_prediction_is_no_longer_refused(capsys):
    """A new user's ``symmem derive gpt2 --data-parallel fsdp --pipeline-parallel`` (CUDA, the default device) gets
    every rank's peak, with CUDA's foreach step (the CPU's for-loop one stays the CPU's)."""
    from symmem.cli import main

    assert main(["derive", "gpt2", "--data-parallel", "fsdp", "--pipeline-parallel", "--set", "p=2", "--set", "N=2",
                 "--set", "L=2", "--micro-batches", "2", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["values"]["peak"] and len(out["values"]["peak_per_rank"]) == 4 and "peak_refused" not in out
    kw = {"attention": "sdpa", "values": {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64,
                                          "p": 2, "N": 2}}
    steps = {device: derive("llama", data_parallel="fsdp", pipeline_parallel=True, device=device, **kw).step
             for device in ("cpu", "cuda")}
    assert {k: v.regime.optimizer_impl for k, v in steps.items()} == {"cpu": "auto", "cuda": "foreach"}
