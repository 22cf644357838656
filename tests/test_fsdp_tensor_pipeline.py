"""FSDP x TP x pipeline against the real engine: torchtitan's 3-D mesh, p x N x t = 2 x 2 x 2 (eight ranks).

The truth is eight real processes (gloo, 127.0.0.1, bounded time) on ``init_device_mesh("cpu", (2, 2, 2),
mesh_dim_names=("pp", "dp", "tp"))``: each rank's stage of the Llama reference ``parallelize_module``'d over
``mesh["tp"]`` with the standard plan, ``fully_shard`` on each layer and the stage root over ``mesh["dp"]``,
``PipelineStage`` and ``Schedule1F1B`` / ``ScheduleGPipe``, FP32 for-loop AdamW, each rank under the DTensor- and
FSDP-aware recorder (``symmem.record.tensor_pipeline_runs`` with a case's ``data_parallel``; each moment's fewest
bytes over repeated steps).  symmem's side is ``symmem.passes.fsdp_tensor_pipeline``.  Other configurations, by
hand, in docs/regimes.md.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.pipelining")

from gloo_store import START  # noqa: E402
from stage_ranks import replays_are_the_ranks  # noqa: E402

LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64}
MESH = {"p": 2, "N": 2, "t": 2}
#: (model, sizes, schedule, M, loss, options, reshard_after_forward): SDPA GPipe, one micro-batch (an 8-rank case costs
#: ~4.5 s of CPU at M = 1, ~7.4 s at M = 2: the hand runs in docs/regimes.md give the rest), cross-entropy (the head's
#: backward lets the logits' whole gradient go after DTensor's copy of the rank's columns), V = 66: V/t = 33 rows
#: padded to 34 over N = 2, so data-parallel rank 1 of each stage holds fewer
CASES = [("llama", {**LLAMA, "V": 66}, "gpipe", 1, "cross-entropy",
          {"attention": "sdpa", "tensor_parallel": True, "data_parallel": 2}, True)]
#: The cases behind the CLI lines and ``fit`` edges at 1 MiB (1F1B, M = 2, SDPA, cross-entropy, resharding), by
#: (plan, B): tensor parallelism at B = 2 (its CLI line), 15 and 16, with sequence parallelism (torchtitan's plan) at
#: B = 2, 17 and 18.  Their stored real runs (tests/data/pipeline_meshes_gloo.json) are what the CLI tests read; the
#: deep test_every_stored_case_against_fresh_gloo_runs makes them anew (``SYMMEM_STORE_MESHES=1`` writes them)
_TP = {"attention": "sdpa", "tensor_parallel": True, "data_parallel": 2}
CLI = {(plan, b): ("llama", {**LLAMA, "B": b}, "1f1b", 2, "cross-entropy",
                   {**_TP, "sequence_parallel": True} if plan == "sp" else _TP, True)
       for plan, bs in (("tp", (2, 15, 16)), ("sp", (2, 17, 18))) for b in bs}


def derived(model, values, schedule, m, loss, options, reshard=True, **more):
    from symmem import derive

    plain = {k: v for k, v in options.items() if k not in ("tensor_parallel", "data_parallel")}
    return derive(model, data_parallel="fsdp" if reshard else "fsdp-no-reshard", tensor_parallel=True,
                  pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, loss=loss, device="cpu",
                  values={**values, **MESH}, **plain, **more)


def _stage_buffers(case, stage: int) -> int:
    """Bytes of the buffers of the real stage module ``stage`` of ``case`` (p = 2), as the gloo runs build it."""
    from symmem.record.model_parallel_runs import _stage_module

    model, values, _, _, _, options, _ = case
    plain = {k: v for k, v in options.items() if k not in ("tensor_parallel", "data_parallel")}
    module = _stage_module(model, {**values, "p": 2}, stage, 2, plain)
    return sum(b.numel() * b.element_size() for b in module.buffers())


@pytest.mark.xdist_group("gloo")  # one test worker runs the gloo tests in turn
def test_every_rank_of_a_2x2x2_mesh_against_the_engine():
    """Every rank's parameters (padded 2-D shards), AdamW state (the unpadded rows), first and steady peak, and the
    largest moment of its schedule and of its optimizer step equal the real run's to the byte; the views give the
    largest rank's peak, which rank and stage, every rank's (rank s*N*t + d*t + r) and each rank's parameter side."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import _row, _stored, key

    from symmem.record.fsdp_pipeline_runs import fsdp_pipeline_runs

    everything = fsdp_pipeline_runs(2, 4, CASES, start_method=START)
    for k, case in enumerate(CASES):
        real = [rank[k] for rank in everything]
        # the live ranks are the stored ones too (the deep test below reruns and compares them)
        assert [_row(r) for r in real] == _stored()[key(case)], (k, real)
        # FSDP's, pipelining's and DTensor's collectives released on the recording thread: one first and one steady
        # step, no free elsewhere
        assert all(r.repeats == (1, 1) and r.late == 0 for r in real), (k, real)
        assert [(r.pp, r.dp, r.tp) for r in real] == [(s, d, t) for s in (0, 1) for d in (0, 1) for t in (0, 1)]
        d = derived(*case)
        replays_are_the_ranks(d, real, k)
        top = max(real, key=lambda r: (r.steady_peak, -r.rank))
        out = d.to_dict()
        assert (d.value("peak"), d.value("peak_first_step")) == (top.steady_peak, top.first_peak), k
        assert (out["peak_at"]["rank"], out["peak_at"]["stage"]) == (top.rank, top.pp), k
        each = {str(r.rank): {"peak": r.steady_peak, "peak_first_step": r.first_peak} for r in real}
        assert out["values"]["peak_per_rank"] == each, k
        assert out["values"]["peak_per_stage"] == [real[0].steady_peak, real[4].steady_peak], k
        for r in real:  # the real rank's weights (and its stage module's buffers) and AdamW's state; the sharded
            side = out["values"]["parameter_side_per_rank"][str(r.rank)]  # gradients are the weights' shards
            assert (side["parameters"], side["gradients"], side["optimizer_state"]) == (
                r.parameters + _stage_buffers(case, r.pp), r.parameters, r.optimizer_state), (k, r, side)
    # data-parallel rank 1 holds 16 of the embedding's and the head's 17 rows a rank: its state the smaller
    assert [r[0].optimizer_state for r in everything[:4]] == [23080, 23080, 22824, 22824]
    import test_pipeline_formula_mesh as formula  # the 3-D mesh's formulas from other sizes vs these ranks

    formula.mesh_against_the_engines(everything, CASES)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_case_against_fresh_gloo_runs():
    """:data:`CASES` and :data:`CLI` in one fresh spawn of eight ranks: every rank with one first and one steady step
    and no late free, every field equal to its stored row (``SYMMEM_STORE_MESHES=1``: stored), and every rank's
    parameters, AdamW state, first and steady peak and its schedule's and optimizer step's largest moments equal to
    the engine's replay of its stage, to the byte."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import against_stored

    from symmem.record.fsdp_pipeline_runs import fsdp_pipeline_runs

    cases = [*CASES, *CLI.values()]
    everything = fsdp_pipeline_runs(2, 4, cases, start_method=START)
    assert all((r.late, r.repeats) == (0, (1, 1)) for rank in everything for r in rank), everything
    against_stored(cases, everything)
    for k, case in enumerate(cases):
        replays_are_the_ranks(derived(*case), [rank[k] for rank in everything], k)


def _fit(text: str) -> tuple[int, int, int]:
    """``fit``'s answer read back: the largest B, the total there and at B + 1 (``text`` whitespace-collapsed)."""
    import re

    m = re.search(r"largest B = (\d+) .*?\(([\d,]+) B\); B = (\d+) needs .*?\(([\d,]+) B\)", text)
    assert m and int(m[3]) == int(m[1]) + 1, text
    return int(m[1]), int(m[2].replace(",", "")), int(m[4].replace(",", ""))


def test_the_cli_and_fit(capsys):
    """The table's peak line names the rank (stage, data-parallel rank, the tensor-parallel ranks alike) and gives
    every rank's peaks, gloo's; ``fit`` at 1 MiB finds gloo's largest B: every rank of the 2 x 2 x 2 mesh at B = 2, 15
    and 16, their stored real runs (:data:`CLI`)."""
    from test_mesh_cli_ranks import largest_rank, peaks_in_line, stored_peaks

    from symmem.cli import main

    sets = [a for k, v in {**LLAMA, **MESH}.items() for a in ("--set", f"{k}={v}")]
    args = ["llama", "--data-parallel", "fsdp", "--tensor-parallel", "--pipeline-parallel", "--micro-batches", "2",
            "--loss", "cross-entropy", "--attention", "sdpa", "--device", "cpu", *sets]
    assert main(["derive", *args]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "rank 0 (stage 0 of 2, data-parallel rank 0 of N = 2, the t = 2 tensor-parallel ranks alike)" in text
    assert peaks_in_line(text) == stored_peaks(CLI["tp", 2])  # its stored real ranks
    assert main(["fit", *args, "--budget", "1MiB"]) == 0
    fit = _fit(" ".join(capsys.readouterr().out.split()))
    # gloo's largest rank at B = 15 and 16 (stored), on each side of the budget
    assert fit == (15, largest_rank(CLI["tp", 15]), largest_rank(CLI["tp", 16])) and fit[1] <= 2**20 < fit[2]


@pytest.mark.parametrize(("engine", "more", "why"), [
    ("ddp", {}, "data_parallel='ddp' with tensor and pipeline parallelism (a 3-D mesh) is not modelled"),
    ("zero-redundancy", {}, "data_parallel='zero-redundancy' with tensor and pipeline parallelism"),
    ("fsdp1", {}, "data_parallel='fsdp1' with tensor and pipeline parallelism"),
])
def test_other_engines_on_the_3d_mesh_are_one_line_errors(capsys, engine, more, why):
    from symmem.cli import main

    sets = [a for k, v in {**LLAMA, **MESH}.items() for a in ("--set", f"{k}={v}")]
    assert main(["derive", "llama", "--data-parallel", engine, "--tensor-parallel", "--pipeline-parallel",
                 "--device", "cpu", *sets]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1 and err.startswith("symmem: error: ")


def test_sequence_parallel_on_the_3d_mesh(capsys):
    """``--sequence-parallel`` on the 3-D mesh answers (torchtitan's sequence-parallel plan on every stage, then
    FSDP2): every rank's peaks and ``fit`` at 1 MiB as gloo measured them on the 2 x 2 x 2 mesh at B = 2, 17 and 18
    (their stored real runs, :data:`CLI`)."""
    from test_mesh_cli_ranks import largest_rank, peaks_in_line, stored_peaks

    from symmem.cli import main

    sets = [a for k, v in {**LLAMA, **MESH}.items() for a in ("--set", f"{k}={v}")]
    args = ["llama", "--data-parallel", "fsdp", "--tensor-parallel", "--sequence-parallel", "--pipeline-parallel",
            "--micro-batches", "2", "--loss", "cross-entropy", "--attention", "sdpa", "--device", "cpu", *sets]
    assert main(["derive", *args]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert peaks_in_line(text) == stored_peaks(CLI["sp", 2])  # its stored real ranks
    assert main(["fit", *args, "--budget", "1MiB"]) == 0
    fit = _fit(" ".join(capsys.readouterr().out.split()))
    assert fit == (17, largest_rank(CLI["sp", 17]), largest_rank(CLI["sp", 18])) and fit[1] <= 2**20 < fit[2]


@pytest.mark.parametrize(("more", "why"), [
    ({"model": "gpt2"}, "standard plan, which is Llama's; not gpt2"),
])
def test_what_was_not_measured_is_refused_in_one_line(more, why):
    from symmem.report.headline import peak_state

    model = more.pop("model", "llama")
    values = {k: v for k, v in LLAMA.items() if model == "llama" or k != "G"}
    d = derived(model, values, "1f1b", 2, "sum", {"attention": "sdpa"}, **more)
    line = peak_state(d)[1]
    assert why in line and "\n" not in line
