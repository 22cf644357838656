"""Tensor parallel x pipeline against the real engine: DTensor's standard plan on every stage of a p x t = 2 x 2 mesh.

The truth is four real processes (gloo, 127.0.0.1, bounded time) on ``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("pp", "tp"))``, torchtitan's 2-D recipe: each rank's stage of the Llama reference (the embedding on
the first, the final norm and the head on the last) ``parallelize_module``'d over ``mesh["tp"]`` with the standard
plan, ``PipelineStage`` and ``ScheduleGPipe`` / ``Schedule1F1B``, FP32 for-loop AdamW, each rank under the
DTensor-aware recorder (``symmem.record.tensor_pipeline_runs``: each moment's fewest bytes over repeated steps).
The :data:`LIVE` cases run in the pipeline meshes' one 4-rank spawn (tests/stage_ranks.py, with
tests/test_fsdp_pipeline.py's and tests/test_ddp_pipeline.py's); the other one is replayed from its stored real run
(tests/data/pipeline_meshes_gloo.json), which ``-m deep`` reruns.  symmem's side is
``symmem.passes.tensor_pipeline``; with sequence parallelism (torchtitan's plan on each stage)
``symmem.passes.sequence_pipeline``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.pipelining")

LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64}
T = {"tensor_parallel": True}
#: (model, sizes, schedule, M, loss, options, _): SDPA 1F1B with the pipeline's cross-entropy at B = 1, V = 512
#: (stage 0 peaks at the embedding's backward; stage 1 at the second micro-batch's cross-entropy backward, after the
#: head's backward beside the rank's copy of the logits' gradient was its largest moment in the loss sum), eager
#: GPipe with the loss sum (stage 1 peaks at the final norm's forward of the first micro-batch); small, as the spawn
#: is shared (docs/regimes.md: the other configurations)
CASES = [("llama", {**LLAMA, "B": 1, "V": 512}, "1f1b", 2, "cross-entropy", {"attention": "sdpa", **T}, True),
         ("llama", LLAMA, "gpipe", 2, "sum", {"attention": "naive", **T}, True),
         # torchtitan's sequence-parallel plan on each stage (the boundary (B, S/t, H)): at B = 1 stage 0 peaks in
         # the down projection's backward (its output gradient's all-gather kept twice), stage 1 in the loss's
         # backward with the other micro-batch's shifted labels (whole) held
         ("llama", {**LLAMA, "B": 1}, "gpipe", 2, "cross-entropy", {"attention": "sdpa", **T,
                                                                     "sequence_parallel": True}, True)]
#: run live in every suite run: TP 1F1B (cross-entropy) and SP GPipe; TP GPipe with the loss sum replayed from its
#: stored run (its formulas from other sizes: test_pipeline_formula_mesh.TENSOR_OTHER[1])
LIVE = (0, 2)


def mesh_cases() -> list:
    """The cases of the meshes' spawn from this file: :data:`CASES`."""
    return list(CASES)


def derived(model, values, schedule, m, loss, options, _=True, **more):
    from symmem import derive

    return derive(model, tensor_parallel=True, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m,
                  loss=loss, device="cpu", values={**values, "p": 2, "t": 2},
                  **{k: v for k, v in options.items() if k != "tensor_parallel"}, **more)


def check(everything) -> None:
    """Every rank's parameters (local shards), AdamW state, first and steady peak, and the largest moment of its
    schedule and of its optimizer step equal the real run's (live or stored); the views give the largest rank's
    peak, its rank and stage, and every rank's (rank s*t + r)."""
    for k, case in enumerate(CASES):
        real = [rank[k] for rank in everything]
        assert [(r.pp, r.dp) for r in real] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # dp: the tensor-parallel rank
        d = derived(*case)
        named = {s.name: int(v) for s, v in d.numbers.items()}
        replays = d.step._replays(named)
        for r in real:
            mine = replays[r.pp]
            assert (mine.at["parameters"], mine.at["optimizer_state"]) == (r.parameters, r.optimizer_state), (k, r)
            assert (mine.peak.first, mine.peak.bytes, mine.peak.pipeline, mine.peak.step) == (
                r.first_peak, r.steady_peak, r.pipeline_peak, r.step_peak), (k, r)
        top = max(real, key=lambda r: (r.steady_peak, -r.rank))
        out = d.to_dict()
        for r in real:  # the parameter side per rank: the real rank's weights, its stage module's buffers, AdamW
            side = out["values"]["parameter_side_per_rank"][str(r.rank)]
            assert (side["parameters"], side["optimizer_state"]) == (
                r.parameters + _stage_buffers(case, r.pp), r.optimizer_state), (k, r, side)
            # the gradients at the step: the local shards', but the embedding's whole V x H (stage 0)
            whole = case[1]["V"] * case[1]["H"] * 4
            assert side["gradients"] == r.parameters + (whole - whole // 2 if r.pp == 0 else 0), (k, r, side)
        assert (d.value("peak"), d.value("peak_first_step")) == (top.steady_peak, top.first_peak), k
        assert (out["peak_at"]["rank"], out["peak_at"]["stage"]) == (top.rank, top.pp), k
        each = {str(r.rank): {"peak": r.steady_peak, "peak_first_step": r.first_peak} for r in real}
        assert out["values"]["peak_per_rank"] == each, k
        assert out["values"]["peak_per_stage"] == [real[0].steady_peak, real[2].steady_peak], k


def _stage_buffers(case, stage: int) -> int:
    """Bytes of the buffers of the real stage module ``stage`` of ``case`` (p = 2), as the gloo runs build it."""
    from symmem.record.model_parallel_runs import _stage_module

    model, values, _, _, _, options, _ = case
    plain = {k: v for k, v in options.items() if k not in ("tensor_parallel", "sequence_parallel")}
    module = _stage_module(model, {**values, "p": 2}, stage, 2, plain)
    return sum(b.numel() * b.element_size() for b in module.buffers())


@pytest.mark.xdist_group("gloo")  # one test worker runs the gloo tests in turn
def test_every_rank_of_a_2x2_mesh_against_the_engine():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import mesh_ranks

    everything = mesh_ranks(CASES, LIVE)
    check(everything)
    import test_pipeline_formula_mesh as formula  # TP x pipeline's formulas from other sizes vs these ranks

    formula.tensor_against_the_engines(everything, CASES)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_case_against_fresh_gloo_runs():
    """Every case in a fresh spawn of its own: every rank's fields equal the stored ones
    (tests/data/pipeline_meshes_gloo.json; ``SYMMEM_STORE_MESHES=1`` writes them)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import rerun

    from symmem.record.fsdp_pipeline_runs import fsdp_pipeline_runs

    check(rerun(fsdp_pipeline_runs, CASES))


def test_the_cli_and_fit(capsys):
    """The table's peak line names the rank and stage, and every rank's peaks (the second case's, checked rank by
    rank against the engine); ``fit`` finds the largest B whose largest rank fits, gloo's."""
    from test_mesh_cli_ranks import TENSOR, largest_rank, peaks_in_line, stored_peaks

    from symmem.apps.budget import largest
    from symmem.cli import main

    sets = [a for k, v in {**LLAMA, "p": 2, "t": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["derive", "llama", "--tensor-parallel", "--pipeline-parallel", "gpipe", "--micro-batches", "2",
                 "--attention", "naive", "--device", "cpu", *sets]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "rank 2 (stage 1 of 2, tensor-parallel rank 0 of t = 2, every one alike)" in text
    assert peaks_in_line(text) == stored_peaks(CASES[1])  # its stored real ranks
    d = derived(*CASES[1])
    fit = largest(d, "B", 2**20)
    # gloo's largest rank (stage 1) at B = 12 and 13: their stored real runs (tests/test_mesh_cli_ranks.py)
    assert (fit.max, fit.total_at_max, fit.total_above) == (12, *(largest_rank(TENSOR["tp", b]) for b in (12, 13)))


def test_sequence_parallel_cli_and_fit(capsys):
    """``--sequence-parallel`` on stages answers: every rank's peaks as gloo measured them (torchtitan's plan on
    each stage of the 2 x 2 mesh, eager GPipe M = 2, loss sum; docs/regimes.md), and ``fit`` finds the largest B
    whose largest rank fits."""
    from test_mesh_cli_ranks import TENSOR, largest_rank, peaks_in_line, stored_peaks

    from symmem.apps.budget import largest
    from symmem.cli import main

    sets = [a for k, v in {**LLAMA, "p": 2, "t": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["derive", "llama", "--tensor-parallel", "--sequence-parallel", "--pipeline-parallel", "gpipe",
                 "--micro-batches", "2", "--attention", "naive", "--device", "cpu", *sets]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert peaks_in_line(text) == stored_peaks(TENSOR["sp", 2])  # its stored real ranks
    d = derived("llama", LLAMA, "gpipe", 2, "sum", {"attention": "naive", "sequence_parallel": True})
    fit = largest(d, "B", 2**20)
    # gloo's largest rank (stage 1) at B = 13 and 14: their stored real runs (tests/test_mesh_cli_ranks.py)
    assert (fit.max, fit.total_at_max, fit.total_above) == (13, *(largest_rank(TENSOR["sp", b]) for b in (13, 14)))
    # from B = 1 (the suite's case, where the all-gathers over S keep two copies: no line from B = 1) fit solves
    # all the same: gloo's largest rank at B = 1 (the spawn above's, stored) and at B = 2 (stored)
    fit = largest(derived(*CASES[2]), "B", 200_000)
    at = (largest_rank(CASES[2]), largest_rank(TENSOR["sp-sdpa", 2]))
    assert (fit.max, fit.total_at_max, fit.total_above) == (1, *at)


@pytest.mark.parametrize(("more", "why"), [
    ({"sequence_parallel": True, "values": {"B": 1}, "attention": "naive"},
     "at B = 1 with eager attention and one key/value head a rank"),
    ({"values": {"B": 1}, "attention": "naive"}, "at B = 1 with eager attention and one key/value head a rank"),
])
def test_what_was_not_measured_is_refused_in_one_line(more, why):
    values = {**LLAMA, **more.pop("values", {})}
    d = derived("llama", values, "1f1b", 2, "sum", {"attention": more.pop("attention", "sdpa")}, **more)
    from symmem.report.headline import peak_state

    line = peak_state(d)[1]
    assert why in line and "\n" not in line


@pytest.mark.parametrize(("values", "why"), [({"t": 3}, "needs t to divide h"),
                                           ({"F": 66, "t": 4, "h": 8, "G": 4}, "needs t to divide F"),
                                           ({"p": 3, "L": 4}, "needs p to divide L")])
def test_bad_sizes_are_one_line_errors(capsys, values, why):
    from symmem.cli import main

    sets = [x for k, v in {**LLAMA, "p": 2, "t": 2, **values}.items() for x in ("--set", f"{k}={v}")]
    assert main(["derive", "llama", "--tensor-parallel", "--pipeline-parallel", "--device", "cpu", *sets]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1
