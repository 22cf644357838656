"""The anchors side by side in docs/regimes.md (benchmarks/anchors.py): the block is what the script computes now,
and DeepSpeed's inputs taken from symmem's graph are what DeepSpeed's ``model_to_params`` takes from the real
PyTorch modules."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _anchors():
    spec = importlib.util.spec_from_file_location("anchors", ROOT / "benchmarks" / "anchors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("anchors", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


anchors = _anchors()
TINY = [c for c in anchors.CASES if c.measured]


def _deepspeed_model_to_params(module) -> tuple[int, int]:
    """DeepSpeed's ``stage3.model_to_params`` (0.19.8), as it reads a live module: shared parameters once, the
    largest layer the most elements one module owns without recursing."""
    total = sum(dict((p.data_ptr(), p.numel()) for p in module.parameters()).values())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    return total, largest


@pytest.mark.parametrize("case", TINY, ids=[c.model for c in TINY])
def test_deepspeeds_inputs_from_the_graph_are_the_modules(case):
    pytest.importorskip("torch")
    from symmem.reference import reference

    module, _ = reference(case.model, case.values, case.options)
    psi, largest, _ = anchors._sizes(case)
    assert (psi, largest) == _deepspeed_model_to_params(module)


@pytest.mark.parametrize("case", anchors.CASES, ids=[c.title.split(" (")[0] for c in anchors.CASES])
def test_deepspeeds_zero2_is_mixed_full_copies_zero2(case):
    # DeepSpeed's 2Ψ + 18Ψ/N against symmem's own precision table (2 + 2 + 4 + 4 + 8 bytes, weights unsharded)
    from symmem import derive

    psi, _, _ = anchors._sizes(case)
    d = derive(case.model, convention="pytorch", values={**case.values, "N": case.N}, precision="mixed-full-copies",
               zero=2, **case.options)
    assert anchors.deepspeed_zero2(psi, case.N) == d.evaluate(d.parameter_memory)
    assert anchors.deepspeed_zero2(psi, case.N) == 2 * psi + 18 * psi // case.N


def test_the_doc_is_current():
    text = (ROOT / "docs" / "regimes.md").read_text()
    found = re.search(re.escape(anchors.BEGIN) + r"\n(.*)\n" + re.escape(anchors.END), text, re.S)
    assert found, "docs/regimes.md has no anchors block"
    assert found.group(1) == anchors.block(), "stale: run python benchmarks/anchors.py"
