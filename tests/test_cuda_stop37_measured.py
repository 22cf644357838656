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

What is compared, per rank: ``max_memory_allocated`` with ``peak_allocated(step, rank)`` (every storage in 512-byte
blocks) and ``requested_bytes`` plus the host ``step`` counts with the per-rank peak in bytes, ``derive(...,
device="cuda")``, to the byte; where FSDP reshards (``fsdp``, ``fsdp1``) the backward's all-gathers run gloo's own
device temporaries for CUDA tensors (NCCL allocates none; docs/cuda.md), so there the measurement must stay at or
above the prediction, never below.  The live bytes are compared with the CPU derivation, to the byte, as the suite's
gloo tests do on torch 2.13.

A JSON from ``--dry-run`` (CPU ranks; ``device`` "cpu ...") is read the same way with the CPU ranks' live bytes
standing in for the measurement (``check_cuda_engines.standin``): every engine exact against ``device="cpu"``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from symmem import derive

PATH = Path(__file__).parent / "data" / "cuda_h200_stop37.json"
DATA: dict[str, Any] | None = json.loads(PATH.read_text()) if PATH.exists() else None
pytestmark = pytest.mark.skipif(DATA is None, reason=f"tests/data/{PATH.name} is not there yet (written by "
                                "benchmarks/check_cuda_engines.py --stop37 --live on a GPU)")
ROWS: list[dict[str, Any]] = [] if DATA is None else DATA["rows"]
ON_CUDA = DATA is not None and not DATA["device"].startswith("cpu")
#: where FSDP reshards, gloo's device temporaries inside the all-gathers come on top (docs/cuda.md)
OVER = {"fsdp", "fsdp1"}
CASE_KEYS = ("model", "values", "options", "engine", "checkpoint", "micro_batches", "impl")


def _key(row: dict[str, Any]) -> str:
    return json.dumps({k: row[k] for k in CASE_KEYS}, sort_keys=True)


CASES: dict[str, dict[int, dict[str, Any]]] = {}
for _row in ROWS:
    if "error" not in _row:
        CASES.setdefault(_key(_row), {})[_row["rank"]] = _row


def _label(key: str) -> str:
    c = json.loads(key)
    return f"{c['model']} {c['engine']} {c['checkpoint']} M={c['micro_batches']} V={c['values'].get('V', '')}"


def _derived(key: str, device: str) -> Any:
    c = json.loads(key)
    return derive(c["model"], convention="pytorch", options={"device": device}, optimizer="adamw",
                  optimizer_impl=c["impl"], values=c["values"], data_parallel=c["engine"], checkpoint=c["checkpoint"],
                  micro_batches=c["micro_batches"], **c["options"])


def _per_rank(d: Any) -> dict[int, tuple[int, int]]:
    """Each rank's derived (first, steady) peak in bytes: per rank under ZeRO-1 and FSDP, DDP's alike on all."""
    from symmem.passes import data_parallel, zero_redundancy

    world = int(next(v for s, v in d.numbers.items() if s.name == "N"))
    found = zero_redundancy.rank_peaks(d) or data_parallel.rank_peaks(d) or dict.fromkeys(
        range(world), (d.value("peak_first_step"), d.value("peak")))
    return {r: tuple(found[r]) for r in range(world)}


def _allocated(d: Any, step: str, rank: int) -> int:
    from symmem.errors import SymmemError

    try:
        return d.peak_allocated(step, rank)
    except SymmemError:  # an engine whose ranks hold alike: one allocated peak
        return d.peak_allocated(step)


def test_every_case_ran_on_both_ranks():
    assert DATA is not None
    errors = [(r.get("case"), r["rank"], r["error"][-200:]) for r in ROWS if "error" in r]
    assert not errors
    assert DATA["world"] == 2 and len(CASES) == 26 and all(sorted(ranks) == [0, 1] for ranks in CASES.values())
    if ON_CUDA:
        assert "H200" in DATA["device"] and "+cu" in DATA["versions"]["torch"]


@pytest.mark.parametrize("key", sorted(CASES), ids=_label)
def test_requested_bytes_every_rank(key):
    """The bytes the tensors asked for at each rank's peak (plus the host step counts on a GPU) against the
    per-rank peak of ``derive(..., device=...)``: first step and the last (steady) one."""
    d = _derived(key, "cuda" if ON_CUDA else "cpu")
    want = _per_rank(d)
    engine = json.loads(key)["engine"]
    for rank, row in sorted(CASES[key].items()):
        first, *_, steady = [s["requested"] for s in row["steps"]]
        host = row["host_state"] if ON_CUDA else 0
        wfirst, wsteady = want[rank]
        if ON_CUDA and engine in OVER:
            assert steady + host >= wsteady and first + host >= wfirst, (rank, row["steps"], want[rank])
            continue
        assert steady + host == wsteady, (rank, row["steps"], want[rank])
        # the first step makes the step counts inside AdamW's step: counted at its peak if that comes after them
        assert wfirst - first in {0, host}, (rank, row["steps"], want[rank])


@pytest.mark.skipif(not ON_CUDA, reason="the caching allocator's blocks are a GPU's (a dry run reads none)")
@pytest.mark.parametrize("key", sorted(CASES), ids=_label)
def test_max_memory_allocated_every_rank(key):
    d = _derived(key, "cuda")
    engine = json.loads(key)["engine"]
    for rank, row in sorted(CASES[key].items()):
        first, *_, steady = [s["allocated"] for s in row["steps"]]
        want = (_allocated(d, "first", rank), _allocated(d, "steady", rank))
        if engine in OVER:
            assert first >= want[0] and steady >= want[1], (rank, row["steps"], want)
        else:
            assert (first, steady) == want, (rank, row["steps"], want)


LIVE = {k: ranks for k, ranks in CASES.items() if all("per_step" in r.get("live", {}) for r in ranks.values())}


@pytest.mark.parametrize("key", sorted(LIVE), ids=_label)
def test_live_bytes_every_rank(key):
    """The same case on CPU ranks under the recorder (on the GPU machine: torch 2.11), against the CPU derivation:
    the first step, and the lowest steady one (gloo's late frees only ever add)."""
    want = _per_rank(_derived(key, "cpu"))
    for rank, row in sorted(LIVE[key].items()):
        first, *steady = row["live"]["per_step"]
        assert (first, min(steady)) == want[rank], (rank, row["live"])


@pytest.mark.skipif(not ON_CUDA, reason="the control compares two GPU runs")
def test_the_control_rows_equal_the_world2_run():
    """GPT-2 under DDP and FSDP2 without resharding, foreach: the same allocated bytes, rank by rank, as the
    ``--world 2`` run stored in cuda_h200_world2.json (a fresh machine, the same set-up)."""
    world2 = json.loads((Path(__file__).parent / "data" / "cuda_h200_world2.json").read_text())
    stored = {(r["spec"]["engine"], r["spec"]["rank"], r["spec"]["quantity"]): r["measured"] for r in world2["rows"]
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
