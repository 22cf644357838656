"""FSDP2 and FSDP1 with activation checkpointing (full, every-K) in the CLI, ``fit`` and the API, and what stays
refused.  The per-rank peaks themselves are checked against real gloo runs in
``tests/test_data_parallel.py::test_every_rank_peak_equals_a_real_gloo_run`` (its ``CHECKPOINTED`` cases, which
share that test's spawn): each block ``checkpoint_wrapper``'d inside ``fully_shard`` (torchtitan's order), one
checkpoint around several FSDP2 or FSDP1 units (every-K), the padded last shard, the peak formula in ``N``.
"""

from __future__ import annotations

import json
import re

import pytest

from symmem import derive
from symmem.cli import main
from symmem.errors import SymmemError

TINY = {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100, "B": 2}


def test_cli_answers_fsdp_with_checkpointing(capsys):
    """The issue's command answers (the values are the gloo-checked walk's): a peak per rank in the JSON, located in
    backward (a recomputed layer's)."""
    run = ["derive", "gpt2", "--data-parallel", "fsdp", "--checkpoint", "full", "--device", "cpu",
           *(x for k, v in TINY.items() for x in ("--set", f"{k}={v}")), "--set", "N=4"]
    assert main([*run, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regime"]["checkpoint"] == "full" and out["values"]["peak"] > out["values"]["peak_first_step"] > 0
    assert out["peak_at"]["phase"] == "backward" and out["peak_at"]["node"].startswith("h.")


def test_fit_under_fsdp_with_checkpointing(capsys):
    """The largest per-rank batch whose derived peak fits, with full checkpointing under FSDP2 at N=8."""
    run = ["fit", "gpt2", "--convention", "pytorch", "--budget", "4GiB", "--set", "S=1024", "--set", "N=8",
           "--data-parallel", "fsdp", "--checkpoint", "full"]
    assert main(run) == 0
    b = int(capsys.readouterr().out.split("largest B = ")[1].split()[0])
    peak = [derive("gpt2", convention="pytorch", values={"S": 1024, "N": 8, "B": n}, data_parallel="fsdp",
                   checkpoint="full").value("peak") for n in (b, b + 1)]
    assert peak[0] <= 4 * 2**30 < peak[1]


def test_traced_modules_keep_their_one_line_refusal():
    """A traced module's FSDP step is a rewrite of its recorded step, which has no recompute under FSDP: refused,
    saying that the built-in models' is modelled."""
    torch = pytest.importorskip("torch")
    from symmem import trace

    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    d = trace(net, (torch.zeros(2, 8),), {"B": [(0, 0)]}, data_parallel="fsdp", checkpoint="full")
    with pytest.raises(SymmemError, match=re.escape("a traced module under data_parallel='fsdp' is modelled without "
                                                    "checkpointing (the built-in models' is")) as e:
        d.value("peak")
    assert "\n" not in str(e.value)
