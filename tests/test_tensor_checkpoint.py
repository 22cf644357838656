"""Tensor and sequence parallelism with activation checkpointing against DTensor on gloo:
``derive --tensor-parallel [--sequence-parallel] --checkpoint full|every-K`` (symmem/passes/tensor_checkpoint.py).

Truths, all real ``torch.distributed`` runs (gloo, CPU, the Llama reference checkpointed per layer -- every K layers
for every-K -- with ``torch.utils.checkpoint`` non-reentrant after ``parallelize_module``, the loss ``sum``,
for-loop AdamW, each moment at its fewest bytes over the recorded steps -- 2 + 2 when the stored rows were measured,
1 + 1 live since funcol's collectives release their tensors on the recording thread --
``symmem.record.model_parallel_runs``):

* :data:`JOBS`, run live in test_model_parallel's two-rank spawn (no process group of its own), checked by
  :func:`against_dtensor`;
* ``tests/data/tensor_checkpoint_gloo.json``: every rank's first and steady peak of 23 configurations (two and
  four ranks; t = 2, 4; B = 1, 2; L = 1 to 3; eager and SDPA attention; full and every-2; with and without sequence
  parallelism; peaks in the optimizer step, the layers' backward, the softmax's backward), and of 8 FSDP2 x TP
  ones on the 2 x 2 mesh (``mesh``: torchtitan's order, the checkpoint wrapper inside ``fully_shard``), replayed in
  part by :func:`test_recorded_runs_equal_derive` and :func:`test_fsdp_tensor_recorded_runs_equal_derive`;
  :func:`test_recorded_runs_again` (``deep``: ``python -m pytest -m deep``) replays the rest and measures them all
  anew.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data" / "tensor_checkpoint_gloo.json"

#: Sequence parallelism at B = 1 with eager attention and one key/value head a rank, checkpointed: the
#: recomputation's all-gathers kept once, the down projection's output gradient all-gathered ahead of the
#: recomputation (twice at B = 1), the cache's copies paired per recomputation, the mask held by the frames.
JOBS = [("tensor", "llama", {"B": 1, "S": 64, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 64},
         {"attention": "naive", "checkpoint": "full", "sequence_parallel": True, "peaks": True})]


def _derive(values, options, t):
    from symmem import derive

    options = dict(options)
    options.pop("peaks", None)
    sequence = bool(options.pop("sequence_parallel", False))
    return derive("llama", tensor_parallel=True, sequence_parallel=sequence, values={**values, "t": t},
                  device="cpu", **options)


def _cases():
    return json.loads(DATA.read_text())["cases"]


def against_dtensor(real):
    """``real``: per rank, the :data:`JOBS` runs (test_model_parallel's spawn): every rank's first and steady peak
    equals derive's, to the byte, in every view, where the step's peak is the MLP's down projection's backward."""
    for case, (_, _, values, options) in enumerate(JOBS):
        d = _derive(values, options, 2)
        for rank in real:
            assert (d.value("peak"), d.value("peak_first_step")) == (rank[case].steady_peak, rank[case].first_peak)
        out = d.to_dict()
        assert out["values"]["peak"] == 240_728 and out["peak_at"]["rank"] == 0
        where = d.peak_at().where(step=False)
        assert where == "rank 0 of 2 (every rank alike): backward layers.mlp.down_proj (layer 1)"


#: The recorded configurations replayed by the default suite (the others by the ``deep`` test; the live job,
#: :data:`JOBS`, covers sequence parallelism at B = 1 on two ranks): the norm's casts in place (0), every-2 (4: the
#: middle layer's backward), B = 1's cache copies paired per recomputation (11), four ranks with sequence
#: parallelism at B = 1 (21: funcol's wrapper held past the recomputed linear)
REPLAYED = (0, 4, 11, 21)


def recorded_equal_derive(cases):
    """Every rank of each recorded configuration: derive's steady and first-step peak are the run's, to the byte;
    the phase of the peak is the run's; a formula in B, S and t (L, where not folded, its number)."""
    for case in cases:
        d = _derive(case["values"], case["options"], case["t"])
        ours = [d.value("peak_first_step"), d.value("peak")]
        assert all(ours == rank for rank in case["first_steady"]), (case, ours)
        assert d.peak_at().phase == case["steady_at"][0], (case, d.peak_at().where())
        assert {"B", "S", "t"} <= {s.name for s in d.peak.free_symbols}


def test_recorded_runs_equal_derive():
    """:data:`REPLAYED` of the recorded runs (two and four ranks) equal derive to the byte (every rank alike)."""
    cases = _cases()
    recorded_equal_derive([cases[k] for k in REPLAYED])


def _mesh_cases():
    return json.loads(DATA.read_text())["mesh"]


def mesh_equal_derive(cases):
    """Every rank of each recorded FSDP2 x TP configuration (N x t, rank r at (r // t, r % t)): derive's first and
    steady peak per rank are the run's, to the byte, and the phase of the peak the run's."""
    from symmem import derive, symbol

    for case in cases:
        options = dict(case["options"])
        sequence = bool(options.pop("sequence_parallel", False))
        options.pop("fsdp1", None)  # the run's FSDP1 strategy: the engine's name says it
        values = {**case["values"], "N": case["N"], "t": case["t"]}
        d = derive("llama", data_parallel=case["engine"], tensor_parallel=True, sequence_parallel=sequence,
                   values=values, device="cpu", **options)
        ranks = d.step.ranks({symbol(k): v for k, v in values.items()})
        assert [list(ranks[r]) for r in sorted(ranks)] == case["first_steady"], case
        assert d.peak_at().phase == case["steady_at"][0] and d.value("peak") == case["first_steady"][0][1]


def test_fsdp_tensor_recorded_runs_equal_derive():
    """FSDP2 x TP with full checkpointing (torchtitan's order: the checkpoint wrapper inside ``fully_shard``):
    ``fsdp`` and ``fsdp-no-reshard``, with and without sequence parallelism, B = 1 and 2, L = 2 and 3, V = 2,048
    (the embedding's backward), on the 2 x 2 mesh; FSDP1 x TP likewise (``apply_activation_checkpointing`` after
    wrapping, FSDP1's recipe; ``fsdp1``, ``fsdp1-grad-op``) -- every rank to the byte (four replayed here, all by
    the ``deep`` test)."""
    cases = _mesh_cases()
    mesh_equal_derive([cases[k] for k in (0, 4, 5, 12)])


def test_what_stays_refused(capsys):
    """Each combination not measured says so in one line, in the table and the JSON (exit 0: the rest is given)."""
    from symmem import derive
    from symmem.cli import main

    values = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64, "t": 2}
    alone = ("with checkpointing is modelled alone (full or every-K), with sequence parallelism, and under FSDP x "
             "TP with full checkpointing (measured on gloo): not")
    for kwargs, why in [({"data_parallel": "fsdp", "checkpoint": "every-2"},
                         f"no peak: the FSDP x TP peak {alone} every-2 under fsdp"),
                        ({"data_parallel": "fsdp1", "checkpoint": "every-2"},
                         f"no peak: the FSDP x TP peak {alone} every-2 under fsdp1"),
                        ({"checkpoint": "selective"}, "no peak: the tensor-parallel peak with checkpointing is "
                                                      "modelled for 'full' and 'every-K' (what was measured), not "
                                                      "'selective'")]:
        at = {**values, "N": 2} if "data_parallel" in kwargs else values
        out = derive("llama", tensor_parallel=True, values=at, device="cpu", **{"checkpoint": "full", **kwargs}
                     ).to_dict()
        assert out["values"]["peak"] is None and out["peak_refused"].startswith(why), (kwargs, out["peak_refused"])
    sets = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    assert main(["derive", "llama", "--tensor-parallel", "--data-parallel", "fsdp1", "--checkpoint", "every-2",
                 "--device", "cpu", *sets, "--set", "N=2"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("no peak")]
    assert len(lines) == 1 and "FSDP x TP peak with checkpointing" in lines[0]


def test_cli_table_and_fit(capsys):
    """The CLI's peak line names the rank and the op; ``fit`` solves the largest B under a budget, the peaks at
    that B and the next worked out anew on each side of it."""
    from symmem.apps.budget import largest
    from symmem.cli import main

    values = {"B": 2, "S": 64, "H": 32, "h": 4, "G": 2, "L": 2, "V": 16, "F": 64}
    sets = [a for k, v in {**values, "t": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["derive", "llama", "--tensor-parallel", "--checkpoint", "full", "--attention", "naive",
                 "--device", "cpu", *sets]) == 0
    out = capsys.readouterr().out
    assert "at rank 0 of 2 (every rank alike): backward layers.mlp.gate_up (layer 1)" in " ".join(out.split())
    d = _derive(values, {"attention": "naive", "checkpoint": "full"}, 2)
    assert d.value("peak") == 509_308  # the recorded gloo run's (tests/data/tensor_checkpoint_gloo.json)
    fit = largest(d, "B", 1_000_000)
    at = [_derive({**values, "B": b}, {"attention": "naive", "checkpoint": "full"}, 2).value("peak")
          for b in (fit.max, fit.max + 1)]
    assert at[0] <= 1_000_000 < at[1] and (fit.total_at_max, fit.total_above) == tuple(at)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_recorded_runs_again():
    """The recorded configurations measured anew (two and four ranks): the file's numbers, and derive's."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.record.model_parallel_runs import runs

    recorded_equal_derive([c for k, c in enumerate(_cases()) if k not in REPLAYED])
    for world in (2, 4):
        cases = [c for c in _cases() if c["t"] == world]
        everything = runs(world, [("tensor", "llama", c["values"], {**c["options"], "peaks": True}) for c in cases])
        for k, case in enumerate(cases):
            assert [[rank[k].first_peak, rank[k].steady_peak] for rank in everything] == case["first_steady"]
    from symmem.record.fsdp_tensor_runs import fsdp_tensor_runs

    mesh = _mesh_cases()
    mesh_equal_derive(mesh)
    everything = fsdp_tensor_runs(2, 2, [(c["values"], {**c["options"], "reshard_after_forward": c["engine"] == "fsdp"})
                                         for c in mesh])  # (FSDP1's cases: their options' strategy)
    for k, case in enumerate(mesh):
        assert [[rank[k].first_peak, rank[k].steady_peak] for rank in everything] == case["first_steady"]
