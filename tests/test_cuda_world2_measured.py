"""Two ranks on one H200 (gloo, CUDA tensors), replayed without a GPU.

Oracle: ``tests/data/cuda_h200_world2.json``, written by ``benchmarks/check_cuda_engines.py --world 2 --pause 2
--only ddp ddp-bucket-view fsdp fsdp-no-reshard fsdp1 fsdp1-grad-op`` on an NVIDIA H200 (torch 2.11 + CUDA 13): each
case runs as two processes on the one GPU over gloo (NCCL refuses two ranks of one communicator on one device), so
FSDP shards, all-gathers and reduce-scatters on its own CUDA streams as at N = 2; ``torch.cuda.max_memory_allocated``
of each rank in four steps.  docs/cuda.md says what agrees: DDP and the bucket view on every row, FSDP2 without
resharding and FSDP1 SHARD_GRAD_OP on GPT-2 and Llama; with resharding (``fsdp``, ``fsdp1``) the GPU holds more than
the live-bytes model: exactly the device temporaries gloo allocates inside ``all_gather_into_tensor`` for CUDA
tensors (NCCL allocates none), read from the allocator's history of rank 0 (``collective_temporaries``); less those,
the prediction is exact.  Where FSDP2's all-gather copy-out is the peak (three small-MLP rows), CUDA's
``split_with_sizes_copy`` also holds the device tensor it packs its splits' pointers and sizes into (one 512-byte
block, ``copy_out_metadata``, read from the same history).  The other resharding rows must stay above the prediction,
never below it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from symmem import derive
from symmem.passes import rank_numbers
from tests.kept_cases import kept

DATA = json.loads((Path(__file__).parent / "data" / "cuda_h200_world2.json").read_text())

def _case(row: dict) -> str:
    return json.dumps({k: v for k, v in row["spec"].items() if k not in ("quantity", "rank")}, sort_keys=True)


#: the GPT-2 and Llama rows with the foreach AdamW, and every case whose allocator history was read (one derivation
#: serves both ranks and both steps)
RECORDED = {_case(r) for r in DATA["rows"] if "collective_temporaries" in r}
CASES: dict[str, dict[str, list[int]]] = {}
#: ZeroRedundancyOptimizer's rows: each rank owns different parameters, each compared with its own rank's prediction
ZERO: dict[str, list[tuple[str, int, int]]] = {}
for _row in DATA["rows"]:
    _spec = _row["spec"]
    if _spec["engine"] == "zero-redundancy":
        ZERO.setdefault(_case(_row), []).append((_spec["quantity"].removeprefix("allocated_"), _spec["rank"],
                                                 _row["measured"]))
        continue
    if _spec["impl"] == "foreach" and _spec["model"] in ("gpt2", "llama") or _case(_row) in RECORDED:
        _key = _case(_row)
        _step = _spec["quantity"].removeprefix("allocated_")
        CASES.setdefault(_key, {}).setdefault(_step, []).append(_row["measured"])
#: the engines whose rows hold more than the live-bytes model on this set-up (gloo's temporaries for CUDA tensors
#: inside the backward's all-gathers: docs/cuda.md)
UNDER = {"fsdp", "fsdp1"}
#: (case, step) -> bytes the collectives allocated at that rank's peak, read from its allocator history
TEMPORARIES = {(_case(r), r["spec"]["quantity"].removeprefix("allocated_")):
               r["collective_temporaries"] + r.get("copy_out_metadata", 0)
               for r in DATA["rows"] if "collective_temporaries" in r}


def test_the_measurements_are_two_ranks_on_cuda():
    assert "H200" in DATA["device"] and "+cu" in DATA["versions"]["torch"] and len(DATA["rows"]) == 192 + 32
    assert {json.loads(k)["values"]["N"] for k in CASES} == {2} and len(CASES) == 18 and len(TEMPORARIES) == 20
    assert len(ZERO) == 8 and all(len(rows) == 4 for rows in ZERO.values())


#: the cases the default suite replays (stop 42, docs/testing.md): those a greedy cover of the cases' line coverage
#: keeps, and FSDP1's one case of MLP (the one engine the cover leaves out); -m deep replays every case
PEAK_KEPT = {"fsdp-no-reshard mlp0", "ddp-bucket-view gpt2", "fsdp1-grad-op mlp", "fsdp llama", "fsdp mlp1", "ddp gpt2",
             "fsdp1 mlp"}
ZERO_KEPT = {"foreach mlp0", "foreach gpt2", "for-loop llama", "for-loop mlp0"}


def _label(key: str, names: tuple[str, ...]) -> str:
    return " ".join(str(v) for n, v in sorted(json.loads(key).items()) if n in names)


@pytest.mark.parametrize("key", kept(sorted(CASES), [_label(k, ("model", "engine")) for k in sorted(CASES)], PEAK_KEPT))
def test_peak_allocated_against_two_ranks_on_the_h200(key):
    spec = json.loads(key)
    d = derive(spec["model"], convention="pytorch", options={"device": "cuda"}, optimizer="adamw",
               optimizer_impl=spec["impl"], values=spec["values"], data_parallel=spec["engine"], **spec["options"])
    walked = rank_numbers.written(d)  # ``peak_allocated``: the step at the row's numbers (passes/rank_numbers.py)
    for step, measured in CASES[key].items():
        assert len(measured) == 2 and measured[0] == measured[1]  # both ranks alike here (no padding)
        predicted = walked.allocated(step)
        if (key, step) in TEMPORARIES:  # less gloo's temporaries and the copy-out's metadata (rank 0's history), exact
            assert measured[0] - TEMPORARIES[key, step] == predicted, step
        elif spec["engine"] in UNDER:
            assert all(m > predicted for m in measured), (step, predicted, measured)
        else:
            assert measured == [predicted, predicted], step


@pytest.mark.parametrize("key", kept(sorted(ZERO), [_label(k, ("model", "impl")) for k in sorted(ZERO)], ZERO_KEPT))
def test_zero_redundancy_every_rank_against_two_ranks_on_the_h200(key):
    """ZeroRedundancyOptimizer over two ranks: rank 0 owns the larger parameters, so the ranks' peaks differ
    (MLP 64-128-128-10 for-loop: 578,560 and 460,800 bytes); each rank's is exact, the largest is
    ``peak_allocated()``.  No collective allocates on the device here (the histories say so)."""
    spec = json.loads(key)
    d = derive(spec["model"], convention="pytorch", options={"device": "cuda"}, optimizer="adamw",
               optimizer_impl=spec["impl"], values=spec["values"], data_parallel=spec["engine"], **spec["options"])
    for step, rank, measured in ZERO[key]:  # each rank's step at the row's numbers (passes/rank_numbers.py)
        assert rank_numbers.written(d, rank).allocated(step) == measured, (step, rank)
    if spec["model"] == "mlp":  # ``peak_allocated()`` picks the largest rank (ZeRO-1's peak over every rank's
        # moments: one choice for every model; the MLP's formulas are the cheap ones to make)
        for step in ("first", "steady"):
            assert d.peak_allocated(step) == max(m for s, _, m in ZERO[key] if s == step)
