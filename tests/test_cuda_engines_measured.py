"""DDP and ZeroRedundancyOptimizer on real CUDA (NCCL, one H200), replayed without a GPU.

Oracle: ``tests/data/cuda_h200_engines.json``, written by ``benchmarks/check_cuda_engines.py --pause 2 --only ddp
ddp-bucket-view zero-redundancy`` on an NVIDIA H200 (torch 2.11 + CUDA 13, NCCL 2.28.9; world size 1, each case
in a process of its own): ``torch.cuda.max_memory_allocated`` in four training steps of the project's MLP, GPT-2 and
Llama references wrapped in each engine, with the for-loop and foreach AdamW, and the same references on one
device.  Each row is derived again here (``peak_allocated``: every storage in the caching allocator's 512-byte
blocks, Adam's host-side step counts left out) and must equal the measurement to the byte: DDP's buckets, its
rebuild in step 2 and the bucket view each take blocks of their own.  docs/cuda.md says what the two-second pause
after each step is for (NCCL's watchdog lets go of a finished all-reduce's buffers on its own schedule).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from symmem import derive
from symmem.passes import rank_numbers
from tests.kept_cases import kept

DATA = json.loads((Path(__file__).parent / "data" / "cuda_h200_engines.json").read_text())
#: one derivation per (model, engine, optimizer) serves its first and steady rows
CASES: dict[str, dict] = {}
for _row in DATA["rows"]:
    _key = json.dumps({k: v for k, v in _row["spec"].items() if k != "quantity"}, sort_keys=True)
    CASES.setdefault(_key, {})[_row["spec"]["quantity"].removeprefix("allocated_")] = _row["measured"]


def test_the_measurements_are_of_cuda():
    assert "H200" in DATA["device"] and "+cu" in DATA["versions"]["torch"]
    engines = {json.loads(k)["engine"] for k in CASES}
    assert engines == {None, "ddp", "ddp-bucket-view", "zero-redundancy"} and len(CASES) == 32


#: the cases the default suite replays (stop 42, docs/testing.md): those a greedy cover of the cases' line coverage
#: keeps, and DDP's (the one engine the cover leaves out) with the for-loop step on the first MLP; -m deep replays
#: every case
KEPT = {"zero-redundancy foreach mlp1", "None for-loop gpt2", "None foreach llama", "ddp-bucket-view for-loop mlp0",
        "zero-redundancy foreach gpt2", "ddp for-loop mlp0"}
LABELS = [" ".join(str(v) for n, v in sorted(json.loads(k).items()) if n in ("model", "engine", "impl"))
          for k in sorted(CASES)]


@pytest.mark.parametrize("key", kept(sorted(CASES), LABELS, KEPT))
def test_peak_allocated_equals_the_h200(key):
    spec = json.loads(key)
    d = derive(spec["model"], convention="pytorch", options={"device": "cuda"}, optimizer="adamw",
               optimizer_impl=spec["impl"], values=spec["values"], data_parallel=spec["engine"], **spec["options"])
    # the step written out at the row's numbers in the allocator's blocks: ``peak_allocated`` without the peak's
    # formula (passes/rank_numbers.py); ZeroRedundancyOptimizer's one rank (N = 1) owns every parameter
    walked = rank_numbers.written(d, 0 if spec["engine"] == "zero-redundancy" else None)
    assert {step: walked.allocated(step) for step in CASES[key]} == CASES[key]
