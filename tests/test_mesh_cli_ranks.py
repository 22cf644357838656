"""The stored real runs behind the pipeline meshes' CLI lines and ``fit`` edges.

A CLI test prints every rank's peak of a case, and a ``fit`` test names the totals of the largest rank at the
largest B that fits and at B + 1.  Those numbers were once typed in as "measured by hand"; their truth is now a
real run made by the repo's code: each case below is a row of the pipeline meshes' store
(tests/data/pipeline_meshes_gloo.json, tests/stage_ranks.py), which the CLI and ``fit`` tests read
(:func:`ranks`, :func:`largest_rank`) in the default suite (no process started: replays only), and which
:func:`test_every_stored_case_against_fresh_gloo_runs` (``-m deep``) reruns in one fresh spawn of four ranks and
checks, rank by rank, against the engine (``SYMMEM_STORE_MESHES=1`` writes the rows); also the rows behind
tests/test_rank_formulas.py's traced-stage formulas that no mesh file stores (:data:`TRACED`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

BLOCK = f"{Path(__file__).parent / 'data' / 'traced_block.py'}:build"
TIED = f"{BLOCK}_tied"
LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64}
TP = {"attention": "naive", "tensor_parallel": True}
SP = {**TP, "sequence_parallel": True}


def tied_case() -> Any:
    """tests/data/traced_block.py:build_tied (one weight read by two modules of stage 0 and by the head: each
    stage's copy fully_shard-ed on its own stage) under FSDP2 x 1F1B, M = 2 on the 2 x 2 mesh: what ``symmem trace
    ...build_tied --pipeline-parallel --data-parallel fsdp --set p=2 --set N=2 --micro-batches 2`` answers."""
    from symmem.importer.spec_builder import SpecBuilder
    from symmem.record.traced_pipeline_runs import SequentialSplit, TracedCase

    split = SequentialSplit(("inp", "mix", "mix2"), "blocks", ("head",))
    return TracedCase(SpecBuilder(TIED), split, "1f1b", 2, "cross-entropy", (4, 24), (4, 24)), True


#: Llama under TP x GPipe (M = 2, eager attention, the loss sum) on the 2 x 2 mesh at the B on each side of a
#: ``fit`` budget (tests/test_tensor_pipeline.py): (model, sizes, schedule, M, loss, options, _) as its CASES; TP at
#: B = 12 and 13, SP (torchtitan's plan) at B = 2 (its CLI line) and at B = 13 and 14, and SP with SDPA and
#: cross-entropy at B = 2 (above the spawn's B = 1)
TENSOR = {("sp", 2): ("llama", LLAMA, "gpipe", 2, "sum", SP, True),
          ("tp", 12): ("llama", {**LLAMA, "B": 12}, "gpipe", 2, "sum", TP, True),
          ("tp", 13): ("llama", {**LLAMA, "B": 13}, "gpipe", 2, "sum", TP, True),
          ("sp", 13): ("llama", {**LLAMA, "B": 13}, "gpipe", 2, "sum", SP, True),
          ("sp", 14): ("llama", {**LLAMA, "B": 14}, "gpipe", 2, "sum", SP, True),
          ("sp-sdpa", 2): ("llama", {**LLAMA, "B": 2}, "gpipe", 2, "cross-entropy",
                           {**SP, "attention": "sdpa"}, True)}


def traced_case(engine: Any, schedule: str, m: int) -> Any:
    """The file module (tests/data/traced_block.py:build) on the 2 x 2 mesh under ``engine`` (True: FSDP2
    resharding, False: without; or a DDP-family name), as tests/test_fsdp_pipeline.py's and test_ddp_pipeline.py's
    mesh_cases() give it."""
    from symmem.importer.spec_builder import SpecBuilder
    from symmem.record.traced_pipeline_runs import SequentialSplit, TracedCase

    split = SequentialSplit(("inp",), "blocks", ("head",))
    return TracedCase(SpecBuilder(BLOCK), split, schedule, m, "cross-entropy", (4, 5), (4, 24)), engine


#: the file module's stored ranks that tests/test_rank_formulas.py's TRACED rows (deep) check formulas against and no
#: mesh file stores: DDP 1F1B (M = 2), FSDP2 without resharding GPipe (M = 3)
TRACED = [("ddp", "1f1b", 2), (False, "gpipe", 3)]


#: the file module under FSDP2 (resharding) x 1F1B, M = 4, on a 2 x 3 mesh (six ranks: the head's 5 rows padded to 6,
#: held 2 / 2 / 2 and, unpadded, 2 / 2 / 1): tests/test_rank_formulas.py's TRACED row derived at N = 2 and 4.  Stored
#: under :data:`WIDE_KEY` (the store's keys name a case, not its mesh: the 2 x 2 meshes' are p = 2, N = 2)
WIDE = (True, "1f1b", 4)
WIDE_KEY = "p=2, N=3"


def wide_ranks() -> list[Any]:
    """Every rank's stored real run of :data:`WIDE` on the 2 x 3 mesh (StageMeshRun, rank by rank)."""
    from stage_ranks import stored

    return [rank[0] for rank in stored([(WIDE_KEY, traced_case(*WIDE))])]


def cases() -> list[Any]:
    return [tied_case(), *TENSOR.values(), *(traced_case(*c) for c in TRACED)]


def ranks(case: Any) -> list[Any]:
    """Every rank's stored real run of ``case`` (StageMeshRun, rank by rank)."""
    from stage_ranks import stored

    return [rank[0] for rank in stored([case])]


def stored_peaks(case: Any) -> dict[int, tuple[int, int]]:
    """Every rank's stored (first step, steady) peak of ``case``: what the CLI's "peak per rank" line gives."""
    return {r.rank: (r.first_peak, r.steady_peak) for r in ranks(case)}


def largest_rank(case: Any) -> int:
    """The steady peak of ``case``'s largest rank, as gloo measured it (what ``fit`` totals)."""
    return max(r.steady_peak for r in ranks(case))


def peaks_in_line(text: str) -> dict[int, tuple[int, int]]:
    """Every rank's (first step, steady) peak read from the CLI's "peak per rank (first step / steady): ranks 0-1:
    a / b B; rank 2: ..." line (``text`` with its whitespace collapsed)."""
    import re

    rest, out = text.split("peak per rank (first step / steady): ", 1)[1], {}
    while True:
        m = re.match(r"ranks? (\d+)(?:-(\d+))?: ([\d,]+) / ([\d,]+) B(;? ?)", rest)
        assert m, rest[:80]
        first, steady = (int(m[k].replace(",", "")) for k in (3, 4))
        out.update({r: (first, steady) for r in range(int(m[1]), int(m[2] or m[1]) + 1)})
        rest = rest[m.end():]
        if not m[5].startswith(";") or not rest.startswith("rank"):
            return out


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_case_against_fresh_gloo_runs():
    """Every case in one fresh spawn: every rank's fields equal the stored ones, and every rank's parameters, AdamW
    state, first and steady peak and its schedule's and optimizer step's largest moments equal the engine's replay
    of its stage, to the byte."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import replays_are_the_ranks, rerun
    from test_tensor_pipeline import derived

    from symmem.importer import sources
    from symmem.record.mesh_runs import mesh_runs

    everything = rerun(mesh_runs, cases())
    loaded = sources.load(TIED)
    d = sources.trace(loaded, sources.parse_dims("B", loaded), optimizer="adamw", loss="cross-entropy", check=False,
                      pipeline_parallel=True, pipeline_schedule="1f1b", data_parallel="fsdp", micro_batches=2,
                      values={"p": 2, "N": 2})
    replays_are_the_ranks(d, [rank[0] for rank in everything], "tied")
    for k, case in enumerate(TENSOR.values(), start=1):
        d = derived(*case)
        replays = d.step._replays({s.name: int(v) for s, v in d.numbers.items()})
        for r in (rank[k] for rank in everything):
            mine = replays[r.pp]
            assert (mine.at["parameters"], mine.at["optimizer_state"]) == (r.parameters, r.optimizer_state), (k, r)
            assert (mine.peak.first, mine.peak.bytes, mine.peak.pipeline, mine.peak.step) == (
                r.first_peak, r.steady_peak, r.pipeline_peak, r.step_peak), (k, r)
        assert d.value("peak") == largest_rank(case), k


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_the_2x3_mesh_against_a_fresh_gloo_run():
    """:data:`WIDE` in a fresh spawn of six ranks: every rank with one first and one steady step and no late free,
    every field equal to its stored row (``SYMMEM_STORE_MESHES=1``: stored), and every rank's parameters, AdamW
    state, first and steady peak and its schedule's and optimizer step's largest moments equal to the engine's replay
    of its stage and data-parallel rank, to the byte."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import against_stored, replays_are_the_ranks

    from symmem.importer import sources
    from symmem.record.fsdp_pipeline_runs import fsdp_pipeline_runs

    everything = fsdp_pipeline_runs(2, 3, [traced_case(*WIDE)], start_method="forkserver")
    assert all((r.late, r.repeats) == (0, (1, 1)) for rank in everything for r in rank), everything
    against_stored([(WIDE_KEY, traced_case(*WIDE))], everything)
    loaded = sources.load(BLOCK)
    _, schedule, m = WIDE
    d = sources.trace(loaded, sources.parse_dims("B", loaded), optimizer="adamw", loss="cross-entropy", check=False,
                      pipeline_parallel=True, pipeline_schedule=schedule, data_parallel="fsdp", micro_batches=m,
                      values={"p": 2, "N": 3})
    replays_are_the_ranks(d, [rank[0] for rank in everything], "2x3")
