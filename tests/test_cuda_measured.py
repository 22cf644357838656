"""The zoo's CUDA formulas against what PyTorch measured on an H100 (no GPU needed here).

Oracle: ``tests/data/cuda_h100.json``, written by ``benchmarks/check_cuda.py --json`` on an NVIDIA H100 (torch
2.11 + CUDA 13, transformers 5.23): for each row, the bytes autograd saved in one forward of the project's
reference module or of the third-party module the zoo describes (torchvision's ResNets, timm's ViT, Hugging
Face's GPT-2, BERT and Llama), the live-bytes peak of two real training steps under the tracker,
``torch.cuda.max_memory_allocated`` of those steps, and what bfloat16 models keep (flash attention).  Each
row's ``spec`` says how to derive the prediction again (four Llama rows, each naming its device, were re-measured
on an H200 with the reference's DynamicCache); it is derived here and compared with the measurement, so
a change to a CUDA save rule or to the step's schedule that the hardware would not agree with fails here, on a
machine without one.  docs/cuda.md has the table and what each row means.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from symmem import derive
from symmem.derivation import CUDA_WORKSPACES
from symmem.passes import rank_numbers
from tests.kept_cases import kept

DATA = json.loads((Path(__file__).parent / "data" / "cuda_h100.json").read_text())
ROWS = [r for r in DATA["rows"] if "spec" in r]
#: the caching allocator hands out a cached block of the large pool whole when less than 1 MiB would be left
#: over (it does not split it), so max_memory_allocated may exceed the blocks the step asks for by up to that
NO_SPLIT = 2**20


def _derivation(spec: dict):
    """One derivation serves every quantity of a spec (a peak row's first and steady step, live and allocated)."""
    return _derived(json.dumps({k: v for k, v in spec.items() if k not in ("quantity", "scratch")}, sort_keys=True))


@functools.cache
def _derived(key: str):
    spec = json.loads(key)
    kw = {k: spec[k] for k in ("optimizer", "precision") if k in spec}
    return derive(spec["model"], convention="pytorch", options={"device": "cuda"}, values=spec["values"],
                  **spec["options"], **kw)


def _predicted(spec: dict) -> int:
    d = _derivation(spec)
    q = spec["quantity"]
    if q == "kept":  # what a measured forward sees: the kept activations (the loss's too) and the batch
        return d.value("activations") + d.value("loss") + d.value("input")
    if q == "activations":  # a bfloat16 model: its kept activations alone
        return d.value("activations")
    if q.startswith("allocated_"):  # the step written out at the row's numbers, in the allocator's blocks
        return rank_numbers.written(d).allocated(q.removeprefix("allocated_"))
    if q in ("peak", "peak_first_step"):
        # the step's largest moment at the row's numbers, read off the step written out there: the value of the
        # peak's formula (tests/test_peak_invariants.py holds the two to each other), without making the formula
        return rank_numbers.written(d).peak("first" if q == "peak_first_step" else "steady")
    return d.value(q)


def test_the_measurements_are_of_cuda():
    assert "H100" in DATA["device"] and "+cu" in DATA["versions"]["torch"]
    assert len(ROWS) >= 90 and {r["section"] for r in ROWS} == {"reference", "third", "peak", "allocated", "bf16"}


LABELS = [f"{r['section']}: {r['case']}" for r in ROWS]
#: the rows the default suite replays (stop 42, docs/testing.md): those a greedy cover of the rows' line coverage
#: keeps, and each section's first row of each model (every model's CUDA measurement of each kind stays); -m deep
#: replays all
KEPT = {"allocated: mlp dropout=0.1 steady", "allocated: resnet50 SGD first (5.271 GiB)",
        "allocated: vit-ti16 attention=naive steady", "bf16: llama G=2 attention=sdpa dropout=0.0",
        "bf16: llama G=4 attention=naive dropout=0.0", "bf16: llama G=4 attention=sdpa dropout=0.0",
        "peak: gpt2 attention=naive dropout=0.1 checkpoint=full first",
        "peak: llama G=2 attention=naive cache=none first", "peak: llama G=2 attention=sdpa checkpoint=full first",
        "peak: mlp dropout=0.1 first",
        "peak: vit-ti16 attention=naive first", "reference: mlp dropout=0.1", "third: hf bert eager p=0.1 B=3 S=11",
        "third: hf bert sdpa p=0.1 B=3 S=11", "third: hf gpt2 sdpa p=0 B=4 S=24", "third: hf llama gqa sdpa B=4 S=24",
        "third: timm vit_tiny_patch16_224 2x3x224x224", "third: torchvision resnet18 2x3x64x96",
        *{(r["section"], r["spec"]["model"]): label for r, label in reversed(list(zip(ROWS, LABELS, strict=True)))}
        .values()}


@pytest.mark.parametrize("row", kept(ROWS, LABELS, KEPT))
def test_formula_equals_the_h100(row):
    spec, measured = row["spec"], row["measured"]
    predicted = _predicted(spec)
    if spec.get("scratch"):  # cuDNN's convolution workspace comes on top, inside an op
        low, high = CUDA_WORKSPACES["scratch"]
        assert low <= measured - predicted <= high, (predicted, measured)
    elif spec["quantity"].startswith("allocated_") and not row["ok"]:
        assert 0 < measured - predicted < NO_SPLIT, (predicted, measured)
    else:
        assert predicted == measured
