"""Eager attention, its core checkpointed or not, against an H200.

Oracle: ``tests/data/cuda_h200_selective.json``, written by ``benchmarks/check_cuda_selective.py`` (torch 2.11 +
CUDA 13, transformers 5.23): HF GPT-2 and HF Llama with transformers' own ``eager_attention_forward`` in
``torch.utils.checkpoint`` (selective recomputation) and without (the control), ``torch.cuda.max_memory_allocated``
in three steps.  On the GPU softmax's backward first makes ``tmp = grad * output`` (``softmax_backward_cuda_out``),
one (B, h, S, S) tensor the CPU's kernel does not make; where that moment is the step's peak (under selective
recomputation at every size measured from S = 64) the first prediction was exactly that tensor low, which the
allocator's history located (``benchmarks/cuda_history.py``, docs/cuda.md).  With it every Llama row and GPT-2's
narrow rows are exact; GPT-2's wide rows (B = 4, S = 256, H = 256) hold B·S·H·4 more with and without
checkpointing.  That gap is the caching allocator's, not a tensor's: the bytes the tensors asked for
(``requested_bytes.all.peak``, recorded per step since stop 43) equal symmem's device bytes at its peak in every row,
first and steady step (GPT-2's wide rows too), so one block there is handed out 1 MiB larger than asked for
(docs/cuda.md).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from symmem import derive
from symmem.passes import rank_numbers
from tests.kept_cases import kept

DATA = json.loads((Path(__file__).parent / "data" / "cuda_h200_selective.json").read_text())


def test_the_measurements_are_an_h200():
    assert "H200" in DATA["device"] and "+cu" in DATA["versions"]["torch"] and len(DATA["rows"]) == 14
    assert all(len(r["requested"]) == len(r["measured"]) == 3 for r in DATA["rows"])


#: the cases the default suite replays (stop 42, docs/testing.md): those a greedy cover of the cases' line coverage
#: keeps, and Llama's G = 1 (MQA) and G = h = 8 (MHA), where the key/value heads' branch turns; -m deep replays
#: every case
KEPT = {"hf gpt2 eager, no cache selective S=256", "hf llama eager G=2, no cache selective S=64",
        "hf llama eager G=2, cache none S=256", "hf gpt2 eager, cache none S=256",
        "hf llama eager G=1, cache selective S=16", "hf llama eager G=8, no cache selective S=256"}


@pytest.mark.parametrize("row", kept(DATA["rows"], [f"{r['case']} S={r['values']['S']}" for r in DATA["rows"]], KEPT))
def test_eager_attention_on_the_h200(row):
    v = row["values"]
    d = derive(row["model"], convention="pytorch", checkpoint=row["checkpoint"], device="cuda", loss="sum",
               optimizer_impl="for-loop", attention="naive", dropout=0.0, values=v, **row["options"])
    first, *_, steady = row["measured"]
    walked = rank_numbers.written(d)  # ``peak_allocated``: the step at the row's numbers (no formula made)
    over = [first - walked.allocated("first"), steady - walked.allocated("steady")]
    known = v["B"] * v["S"] * v["H"] * 4 if row["model"] == "gpt2" and v["H"] == 256 else 0
    assert over == [known, known]
    asked_first, *_, asked_steady = row["requested"]  # the tensors' own bytes, before the allocator's blocks
    assert [asked_first, asked_steady] == [walked.device_peak("first"), walked.device_peak("steady")]


def test_the_cuda_softmax_backward_makes_one_more_tensor():
    """The kernel's temporary is CUDA's alone: the CPU's peak (exact against the live-bytes tracker,
    tests/test_selective_recompute.py) is one (B, h, S, S) FP32 tensor lower where softmax's backward peaks."""
    v = {"B": 2, "S": 64, "H": 32, "h": 4, "L": 2, "V": 64, "F": 64, "G": 2}

    def peak(device: str) -> int:  # the steady step's largest moment at these numbers (passes/rank_numbers.py)
        return rank_numbers.written(derive("llama", convention="pytorch", checkpoint="selective", device=device,
                                           loss="sum", optimizer_impl="for-loop", attention="naive", values=v,
                                           cache="none")).peak("steady")

    assert peak("cuda") - peak("cpu") == v["B"] * v["h"] * v["S"] ** 2 * 4
