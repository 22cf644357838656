"""Stops 33-36's data-parallel work against two ranks on one GPU, replayed without a GPU.

Oracle: ``tests/data/cuda_h200_stop37.json``, written by ``benchmarks/check_cuda_engines.py --stop37 --live`` on an
NVIDIA H200 (torch 2.11 + CUDA 13): each case two processes on the one GPU over gloo (NCCL refuses two ranks of one
communicator on one device), four steps of foreach AdamW, per rank and step ``max_memory_allocated`` and
``requested_bytes.all.peak`` less the rank's baseline (taken after cuBLAS's workspaces), the bytes of its optimizer
state on the host (AdamW's ``step`` counts), and the live bytes of the same case run on CPU tensors under the
library's recorder in the same process (torch 2.11's CPU ranks).  The cases (``STOP37`` there):

* selective recomputation (the core attention in ``torch.utils.checkpoint``) under DDP, its bucket view, ZeRO-1,
  FSDP2 with and without resharding, FSDP1 FULL_SHARD and SHARD_GRAD_OP -- GPT-2 and Llama (tests/
  test_selective_engines.py's sizes);
* FSDP1's gradient accumulation, M = 2, every micro-batch but the last under ``no_sync()`` -- the MLP, GPT-2 and
  Llama under both strategies (tests/test_fsdp1_accumulation.py's sizes);
* FSDP2's micro-batches (``set_requires_gradient_sync``) with selective recomputation, V = 101 (the last rank's
  padded shard): GPT-2 and Llama with and without resharding;
* two rows of ``--world 2`` again (GPT-2, DDP and FSDP2 without resharding): the control, equal to
  tests/data/cuda_h200_world2.json's.

What is compared, per rank, like with like (docs/cuda.md, "Stops 33-36's data-parallel work on the H200"):

* ``requested_bytes`` (device memory only, before the 512-byte rounding) with the derivation's largest moment of
  device bytes, ``device_peak(d, step, rank)``: the step's timeline with host storages counted as empty and no
  rounding.  The derived peak in bytes also counts the host storages alive at it -- AdamW's ``step`` counts (for-loop
  and foreach) and the memory-efficient SDPA kernel's Philox seed and offset (two 8-byte host tensors per attention
  call) -- which ``requested_bytes`` cannot see; the difference is checked against the measured host ``step`` counts.
* ``max_memory_allocated`` with ``peak_allocated(step, rank)`` (every device storage in 512-byte blocks).

Every row is exact except FSDP1's gradient accumulation with resharding at its peak (``GLOO``): there the backward's
all-gathers run gloo's own device temporaries for CUDA tensors (NCCL allocates none; docs/cuda.md "Two ranks on one
GPU"), and the measurement is above the model by exactly the temporaries rank 0's allocator history recorded: in a
second run (tests/data/cuda_h200_stop37_history.json) for the MLP 64-127-10 under both FSDP1 strategies (16,896
bytes) and GPT-2 FULL_SHARD (35,328), in tests/data/cuda_h200_world2.json for Llama FULL_SHARD at M = 1 (49,664).
The live bytes (the second run's seven cases; the first run's recorder failed) are compared with the CPU
derivation, to the byte, as the suite's gloo tests do on torch 2.13, at or above where gloo freed buffers late.

A JSON from ``--dry-run`` (CPU ranks; ``device`` "cpu ...") is read the same way with the CPU ranks' live bytes
standing in for the measurement (``check_cuda_engines.standin``): every engine exact against ``device="cpu"``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from symmem import derive
from tests.kept_cases import kept

PATH = Path(__file__).parent / "data" / "cuda_h200_stop37.json"
DATA: dict[str, Any] | None = json.loads(PATH.read_text()) if PATH.exists() else None
pytestmark = pytest.mark.skipif(DATA is None, reason=f"tests/data/{PATH.name} is not there yet (written by "
                                "benchmarks/check_cuda_engines.py --stop37 --live on a GPU)")
ROWS: list[dict[str, Any]] = [] if DATA is None else DATA["rows"]
ON_CUDA = DATA is not None and not DATA["device"].startswith("cpu")
#: FSDP1's accumulation (M = 2) rows whose peak holds gloo's device temporaries of an all-gather (model, engine,
#: checkpoint, micro-batches): the MLP 64-127-10 under both strategies (its padded flat parameter is all-gathered
#: at the peak under SHARD_GRAD_OP too), GPT-2 and Llama under FULL_SHARD; SHARD_GRAD_OP's GPT-2 and Llama are exact
GLOO = {("mlp", "fsdp1", "none", 2), ("mlp", "fsdp1-grad-op", "none", 2), ("gpt2", "fsdp1", "none", 2),
        ("llama", "fsdp1", "none", 2)}
WORLD2 = json.loads((Path(__file__).parent / "data" / "cuda_h200_world2.json").read_text())
#: gloo's temporaries (and FSDP2's copy-out metadata) at rank 0's peak, read from its allocator history in the
#: ``--world 2`` run (M = 1): (model, values, options, engine, step) -> bytes
HISTORY = {json.dumps([r["spec"][k] for k in ("model", "values", "options", "engine")], sort_keys=True)
           + r["spec"]["quantity"].removeprefix("allocated_"):
           r["collective_temporaries"] + r.get("copy_out_metadata", 0)
           for r in WORLD2["rows"] if "collective_temporaries" in r and r["spec"]["impl"] == "foreach"}
CASE_KEYS = ("model", "values", "options", "engine", "checkpoint", "micro_batches", "impl")
#: the second device run (tests/data/cuda_h200_stop37_history.json): rank 0's allocator history of cases 14-17 read
#: with --analyze ("collectives": each step's bytes allocated inside the collectives at its peak), and the rows of
#: seven cases with the live bytes of torch 2.11's CPU ranks under the recorder
SECOND_PATH = Path(__file__).parent / "data" / "cuda_h200_stop37_history.json"
SECOND: dict[str, Any] | None = json.loads(SECOND_PATH.read_text()) if SECOND_PATH.exists() else None


def _key(row: dict[str, Any]) -> str:
    return json.dumps({k: row[k] for k in CASE_KEYS}, sort_keys=True)


CASES: dict[str, dict[int, dict[str, Any]]] = {}
for _row in ROWS:
    if "error" not in _row:
        CASES.setdefault(_key(_row), {})[_row["rank"]] = _row


def _label(key: str) -> str:
    c = json.loads(key)
    return f"{c['model']} {c['engine']} {c['checkpoint']} M={c['micro_batches']} V={c['values'].get('V', '')}"


#: the cases each test replays in the default suite (stop 42, docs/testing.md): those a greedy cover of its cases'
#: line coverage keeps, and one case of each engine the cover leaves out (DDP's bucket views for the requested bytes;
#: FSDP2, FSDP2 without resharding, DDP and its bucket views for max_memory_allocated, picked among the requested
#: test's kept cases, whose derivations they share); -m deep replays every case
REQUESTED_KEPT = {"mlp fsdp1-grad-op none M=2 V=", "gpt2 zero-redundancy selective M=1 V=64",
                  "llama fsdp-no-reshard selective M=2 V=101", "mlp fsdp1 none M=2 V=", "gpt2 fsdp selective M=1 V=64",
                  "gpt2 ddp none M=1 V=100", "llama fsdp selective M=1 V=64", "llama fsdp1-grad-op none M=2 V=100",
                  "gpt2 ddp-bucket-view selective M=1 V=64", "gpt2 fsdp selective M=2 V=101"}
ALLOCATED_KEPT = {"gpt2 zero-redundancy selective M=1 V=64", "mlp fsdp1-grad-op none M=2 V=",
                  "llama fsdp1 none M=2 V=100", "gpt2 fsdp selective M=1 V=64",
                  "llama fsdp-no-reshard selective M=2 V=101", "gpt2 ddp none M=1 V=100",
                  "gpt2 ddp-bucket-view selective M=1 V=64", "mlp fsdp1 none M=2 V=", "llama fsdp selective M=1 V=64"}
LIVE_KEPT = {"mlp fsdp1 none M=2 V=", "gpt2 fsdp selective M=1 V=64", "gpt2 zero-redundancy selective M=1 V=64",
             "gpt2 fsdp1-grad-op none M=2 V=100", "gpt2 ddp selective M=1 V=64"}


@functools.cache  # the requested, allocated and live tests of a case share its derivation (conftest.WHOLE)
def _derived(key: str, device: str) -> Any:
    c = json.loads(key)
    return derive(c["model"], convention="pytorch", options={"device": device}, optimizer="adamw",
                  optimizer_impl=c["impl"], values=c["values"], data_parallel=c["engine"], checkpoint=c["checkpoint"],
                  micro_batches=c["micro_batches"], **c["options"])


def _per_rank(d: Any) -> dict[int, tuple[int, int]]:
    """Each rank's derived (first, steady) peak in bytes: per rank under ZeRO-1 and FSDP, DDP's alike on all -- at
    the case's numbers, each group of alike ranks' step walked there (passes/rank_numbers.py: no formula made)."""
    from symmem.passes import rank_numbers

    found = rank_numbers.peaks_per_rank(d)
    assert found is not None
    return found


def _allocated(d: Any, step: str, rank: int) -> int:
    """``peak_allocated(step, rank)``: the rank's step at the case's numbers, every device storage in 512-byte
    blocks (the same walk; passes/rank_numbers.py)."""
    from symmem.passes import rank_numbers

    return rank_numbers.written(d, rank).allocated(step)


def test_every_case_ran_on_both_ranks():
    assert DATA is not None
    errors = [(r.get("case"), r["rank"], r["error"][-200:]) for r in ROWS if "error" in r]
    assert not errors
    assert DATA["world"] == 2 and len(CASES) == 26 and all(sorted(ranks) == [0, 1] for ranks in CASES.values())
    if ON_CUDA:
        assert "H200" in DATA["device"] and "+cu" in DATA["versions"]["torch"]
        # the gloo rows: four cases, each with a recorded history (three this case's, Llama's of M = 1); the one
        # recorded case outside them (GPT-2 SHARD_GRAD_OP, M = 2) allocated nothing inside its collectives
        assert sum(map(_gloo, CASES)) == 4 and all(_recorded(k, s) for k in CASES if _gloo(k) for s in ("first",
                                                                                                      "steady"))
        assert SECOND is not None and [_recorded(k, "steady") for k in CASES if not _gloo(k)].count(0) == 1


def device_peak(d: Any, step: str, rank: int) -> int:
    """The most device bytes alive at any moment of ``rank``'s ``step`` (``first`` or ``steady``), unrounded: the
    derivation's timeline with its host storages counted as empty -- what ``requested_bytes.all.peak`` measures.
    (``Timeline.allocated`` with 1-byte blocks of the rank's step written out at the case's numbers.)"""
    from symmem.passes import rank_numbers

    return rank_numbers.written(d, rank).device_peak(step)


def _gloo(key: str) -> bool:
    c = json.loads(key)
    return (c["model"], c["engine"], c["checkpoint"], c["micro_batches"]) in GLOO


def _recorded(key: str, step: str) -> int | None:
    """gloo's temporaries at this case's peak (rank 0's allocator history): of the second run where it recorded the
    case, else of the same model and engine at M = 1 in the --world 2 run."""
    found = SECOND["collectives"].get(str(CASES[key][0]["case"])) if SECOND else None
    if found is not None:
        return found[0] if step == "first" else found[-1]
    c = json.loads(key)
    return HISTORY.get(json.dumps([c["model"], c["values"], c["options"], c["engine"]], sort_keys=True) + step)


@pytest.mark.parametrize("key", kept(sorted(CASES), map(_label, sorted(CASES)), REQUESTED_KEPT))
def test_requested_bytes_every_rank(key):
    """The bytes the tensors asked for on the device at each rank's peak against the derivation's device bytes at
    its largest moment (a dry run: the CPU ranks' live bytes against the whole peak), first step and the last
    (steady) one; on a GPU, the derived peak less that is the host storages alive at it: the measured ``step``
    counts (once the optimizer made them) plus, where attention's saved tensors are alive, the memory-efficient
    kernel's Philox seed and offset (16 bytes per layer)."""
    d = _derived(key, "cuda" if ON_CUDA else "cpu")
    whole = _per_rank(d)
    layers = int(json.loads(key)["values"].get("L", 0))
    for rank, row in sorted(CASES[key].items()):
        measured = row["steps"][0]["requested"], row["steps"][-1]["requested"]
        if not ON_CUDA:
            assert measured == whole[rank], (rank, row["steps"], whole[rank])
            continue
        want = device_peak(d, "first", rank), device_peak(d, "steady", rank)
        if _gloo(key):  # gloo's temporaries: their bytes asked for, at most their blocks' (the allocated test)
            assert all(m > w for m, w in zip(measured, want, strict=True)), (rank, row["steps"], want)
        else:
            assert measured == want, (rank, row["steps"], want)
        host = [w - dev for w, dev in zip(whole[rank], want, strict=True)]
        assert host[1] - row["host_state"] in (0, 16 * layers), (rank, host, row["host_state"])
        assert host[0] in (0, 16 * layers, row["host_state"], row["host_state"] + 16 * layers), (rank, host)


@pytest.mark.skipif(not ON_CUDA, reason="the caching allocator's blocks are a GPU's (a dry run reads none)")
@pytest.mark.parametrize("key", kept(sorted(CASES), map(_label, sorted(CASES)), ALLOCATED_KEPT))
def test_max_memory_allocated_every_rank(key):
    """``max_memory_allocated`` against ``peak_allocated(step, rank)``: exact, or (``GLOO``) above it by the
    temporaries rank 0's allocator history recorded for the same model and engine at M = 1, where there is one."""
    d = _derived(key, "cuda")
    for rank, row in sorted(CASES[key].items()):
        for step, measured, requested in (("first", row["steps"][0]["allocated"], row["steps"][0]["requested"]),
                                          ("steady", row["steps"][-1]["allocated"], row["steps"][-1]["requested"])):
            want = _allocated(d, step, rank)
            if not _gloo(key):
                assert measured == want, (rank, step, row["steps"], want)
                continue
            recorded = _recorded(key, step)
            if recorded is not None:
                assert measured - want == recorded, (rank, step, measured, want, recorded)
            assert measured > want, (rank, step, measured, want)
            # the temporaries' requested bytes fit in their blocks
            assert requested - device_peak(d, step, rank) <= measured - want, (rank, step)


def _keyed(rows: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for row in rows:
        if "error" not in row:
            out.setdefault(_key(row), {})[row["rank"]] = row
    return out


#: the live bytes: the first run's recorder failed on torch 2.11 (no all_gather_single); the second's came back
LIVE = {k: ranks for k, ranks in {**CASES, **_keyed(SECOND["rows"] if SECOND else [])}.items()
        if all("per_step" in r.get("live", {}) for r in ranks.values())}


@pytest.mark.skipif(SECOND is None, reason="no second run")
def test_the_second_run_repeats_the_first():
    """The second run's CUDA rows (seven cases, both ranks) are the first's, step by step: the same peaks."""
    second = _keyed(SECOND["rows"] if SECOND else [])
    assert len(second) == 7 and all(k in CASES for k in second)
    for key, ranks in second.items():
        for rank, row in ranks.items():
            assert row["steps"] == CASES[key][rank]["steps"] and row["host_state"] == CASES[key][rank]["host_state"]


@pytest.mark.parametrize("key", kept(sorted(LIVE), map(_label, sorted(LIVE)), LIVE_KEPT))
def test_live_bytes_every_rank(key):
    """The same case on CPU ranks under the recorder (on the GPU machine: torch 2.11), against the CPU derivation:
    the first step, and the lowest steady one (gloo's late frees only ever add)."""
    want = _per_rank(_derived(key, "cpu"))
    for rank, row in sorted(LIVE[key].items()):
        first, *steady = row["live"]["per_step"]
        if row["live"]["late"]:
            # gloo's worker threads freed buffers late (GPT-2 FSDP2 selective on torch 2.11: 322 late frees, +2,048
            # bytes in both steps; exact on torch 2.13 here and on the GPU in both runs): a late free only adds
            assert first >= want[rank][0] and min(steady) >= want[rank][1], (rank, row["live"])
            continue
        assert (first, min(steady)) == want[rank], (rank, row["live"])


@pytest.mark.skipif(not ON_CUDA, reason="the control compares two GPU runs")
def test_the_control_rows_equal_the_world2_run():
    """GPT-2 under DDP and FSDP2 without resharding, foreach: the same allocated bytes, rank by rank, as the
    ``--world 2`` run stored in cuda_h200_world2.json (a fresh machine, the same set-up)."""
    world2 = WORLD2
    stored = {(r["spec"]["engine"], _rank(r["case"]), r["spec"]["quantity"]): r["measured"] for r in world2["rows"]
              if "spec" in r and r["spec"]["model"] == "gpt2" and r["spec"]["impl"] == "foreach"
              and r["spec"]["engine"] in ("ddp", "fsdp-no-reshard")}
    controls = [ranks for k, ranks in CASES.items() if json.loads(k)["checkpoint"] == "none"
                and json.loads(k)["model"] == "gpt2" and json.loads(k)["values"].get("S") == 32
                and json.loads(k)["engine"] in ("ddp", "fsdp-no-reshard")]
    assert len(controls) == 2
    for ranks in controls:
        for rank, row in ranks.items():
            first, *_, steady = [s["allocated"] for s in row["steps"]]
            assert (first, steady) == (stored[row["engine"], rank, "allocated_first"],
                                       stored[row["engine"], rank, "allocated_steady"]), (row["engine"], rank)


def _rank(case: str) -> int:
    """The rank in a --world 2 row's name ("gpt2 ddp foreach N=2 rank 1 steady"): its spec does not hold it."""
    return int(case.split(" rank ")[1].split()[0])
