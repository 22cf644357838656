"""DDP x pipeline against the real engine: ``DistributedDataParallel`` on every stage of a p x N = 2 x 2 gloo mesh.

The truth is four real processes (gloo, 127.0.0.1, bounded time) on ``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("pp", "dp"))``: each rank's stage of the reference (the embedding on the first, the final norm and
the head on the last) wrapped in ``DistributedDataParallel`` over ``mesh["dp"]``, ``PipelineStage`` and
``ScheduleGPipe`` / ``Schedule1F1B`` (whose ``backward_maybe_with_nosync`` runs all micro-batches but the last under
``no_sync``), FP32 for-loop AdamW, each rank under the live-bytes recorder (``symmem.record.ddp_pipeline_runs``:
each moment's fewest bytes over repeated steps, DDP's buckets counted from the start).  symmem's side is
``symmem.passes.ddp_pipeline``: the pipeline's replay of each stage with the stage's gradient buckets.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.pipelining")

from stage_ranks import hf_stage_buffers, replays_are_the_ranks  # noqa: E402

GPT2 = {"B": 2, "S": 16, "H": 32, "h": 2, "L": 2, "V": 65}
LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 63, "F": 64}
#: (model, sizes, schedule, M, loss, options, engine): DDP, GPT-2 1F1B (stage 0 peaks in the optimizer step, the
#: tied head a copy of the embedding on stage 1) and Llama GPipe (stage 1 peaks in micro-batch 0's forward);
#: ZeroRedundancyOptimizer, Llama GPipe (the largest rank is data-parallel rank 1 of stage 1: rank 3) and Llama
#: 1F1B with two layers a stage and M = 3 (rank 1); DDP with gradient_as_bucket_view, GPT-2 1F1B (stage 0 peaks in
#: the schedule: its step no longer holds buckets beside the gradients; its largest moment under DDP was in the last
#: micro-batch's backward, where the views free the accumulated gradients; stage 1's first-step peak comes before
#: the reducer first writes into the buckets)
CASES = [("gpt2", GPT2, "1f1b", 2, "cross-entropy", {"attention": "naive", "dropout": 0.0}, "ddp"),
         ("llama", LLAMA, "gpipe", 2, "cross-entropy", {"attention": "sdpa"}, "ddp"),
         ("llama", LLAMA, "gpipe", 2, "cross-entropy", {"attention": "sdpa"}, "zero-redundancy"),
         ("llama", {**LLAMA, "V": 64, "L": 4}, "1f1b", 3, "sum", {"attention": "naive"}, "zero-redundancy"),
         ("gpt2", GPT2, "1f1b", 2, "cross-entropy", {"attention": "naive", "dropout": 0.0}, "ddp-bucket-view"),
         # every stage's layers checkpointed (tests/test_pipeline_checkpoint.py): the stages alone and the buckets
         ("llama", LLAMA, "1f1b", 2, "cross-entropy", {"attention": "naive", "checkpoint": "full"}, "ddp")]
#: a traced module (tests/data/traced_block.py: 4 blocks, its manual split, symmem.importer.traced_ddp_pipeline) in
#: the same spawn: (schedule, M, engine): the bucket view under 1F1B (every rank peaks in the last micro-batch's
#: backward at a bias gradient's sum, the weight gradient of its AddmmBackward0 not yet handed to the bucket: each
#: gradient goes after its autograd node's last op), ZeRO-1 under GPipe M = 3 (the ranks of a stage own different
#: parameters: rank 0 30,160 B of AdamW state, rank 1 29,992)
BLOCK = f"{Path(__file__).parent / 'data' / 'traced_block.py'}:build"
TRACED = [("1f1b", 2, "ddp-bucket-view"), ("gpipe", 3, "zero-redundancy")]
#: Hugging Face Llama in the same spawn (its manual split, LlamaSplit: every stage makes its own position ids and
#: rotary tables, the frequencies a buffer of every stage), ZeRO-1, 1F1B, M = 2, the loss ``sum``: the last stage's
#: data-parallel rank 0 owns the head and steps it first (ZeroRedundancyOptimizer's largest-first order), the head's
#: ``denom`` alive through the next parameter's ``sqrt`` and ``div`` (once walked 1,984 B low)
LLAMA_HF = {"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 32, "vocab_size": 33, "tie_word_embeddings": False, "use_cache": False}
HAS_HF = importlib.util.find_spec("transformers") is not None


def _derive(model, values, schedule, m, loss, options, engine, **more):
    from symmem import derive

    sizes = {**values, "p": 2, "N": 2, **({"F": 4 * values["H"]} if model == "gpt2" else {})}
    return derive(model, data_parallel=engine, pipeline_parallel=True, pipeline_schedule=schedule,
                  micro_batches=m, loss=loss, device="cpu", values=sizes, **options, **more)


#: the cases of :func:`mesh_cases` run LIVE in every suite run (in the meshes' one spawn of four ranks,
#: tests/stage_ranks.py, with tests/test_fsdp_pipeline.py's and tests/test_tensor_pipeline.py's): ZeRO-1 on Llama GPipe
#: (DDP's reducer around the stage, ZeroRedundancyOptimizer's partition; its largest rank a data-parallel rank 1), the
#: bucket view on GPT-2 1F1B; the others replayed from their stored real runs (tests/data/pipeline_meshes_gloo.json):
#: :data:`REPLAYED` checked in every suite run, all of them (and the formulas from other sizes) against fresh gloo
#: runs under ``-m deep``
LIVE = (2, 4)
#: Llama DDP GPipe (the CLI's table below), the traced module under ZeRO-1 GPipe M = 3
#: (symmem.importer.traced_ddp_pipeline; its ranks' formulas from other B under ``-m deep``).  GPT-2 DDP 1F1B's stored
#: ranks stand beside the bucket view's in every run (its step against DDP's), its derivation checked under ``-m deep``
#: (docs/testing.md, "What is deep": GPT-2's stages under DDP's reducer are the bucket view's, live; plain DDP's on
#: stages Llama's, replayed here)
REPLAYED = (1, 7)


def mesh_cases() -> list:
    """Every case of this file's 2 x 2 mesh as ``ddp_pipeline_runs`` takes them: :data:`CASES`, :data:`TRACED`,
    Hugging Face Llama (with transformers)."""
    from symmem.importer.spec_builder import SpecBuilder
    from symmem.record.traced_pipeline_runs import SequentialSplit, TracedCase

    split = SequentialSplit(("inp",), "blocks", ("head",))
    traced = [(TracedCase(SpecBuilder(BLOCK), split, schedule, m, "cross-entropy", (4, 5), (4, 24)), engine)
              for schedule, m, engine in TRACED]
    if HAS_HF:
        from symmem.record.traced_pipeline_runs import LlamaSplit

        traced.append((TracedCase(SpecBuilder("hf:llama", tuple(sorted(LLAMA_HF.items()))), LlamaSplit(), "1f1b", 2,
                                  "sum", (2, 8, 33), (2, 8, 16)), "zero-redundancy"))
    return [*CASES, *traced]


@pytest.mark.xdist_group("gloo")  # one test worker runs the gloo tests in turn
def test_every_rank_of_a_2x2_mesh_against_the_engine():
    """Every rank's parameters, AdamW state, first and steady peak, and the largest moment of its schedule and of
    its optimizer step equal the real run's to the byte (the :data:`LIVE` cases measured now, :data:`REPLAYED`
    stored); the views give the largest rank's peak, which rank and stage, and every rank's; DDP's buckets are the
    stage's parameters' bytes beside the pipeline alone on every moment measured (an independent count: the plain
    pipeline's replay, itself checked against gloo runs in tests/test_model_parallel.py)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import mesh_ranks

    _check(mesh_ranks(mesh_cases(), LIVE), {*LIVE, *REPLAYED})


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_case_against_fresh_gloo_runs():
    """Every case of :func:`mesh_cases` in a fresh spawn of its own (``ddp_pipeline_runs``): every rank's fields
    equal the stored ones (tests/data/pipeline_meshes_gloo.json; ``SYMMEM_STORE_MESHES=1`` writes them), and every
    check of the default test holds on them, the formulas from other sizes too."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import rerun

    from symmem.record.ddp_pipeline_runs import ddp_pipeline_runs

    # every collective released on the recording thread (pipelining's sends, ZeroRedundancyOptimizer's broadcasts;
    # DDP's C++ reducer all-reduces its persistent buckets in place): no late free, one first and one steady step
    # (measured: the same bytes as the fewest over 3 + 3)
    cases = mesh_cases()
    everything = rerun(ddp_pipeline_runs, cases)
    _check(everything, set(range(len(cases))))


def _check(everything, checked) -> None:
    """The checks of every case of :func:`mesh_cases` in ``checked`` (indices) against ``everything`` (per rank,
    per case: live or stored runs)."""
    from symmem import derive

    _check_traced([rank[len(CASES):len(CASES) + len(TRACED)] for rank in everything],
                  [k - len(CASES) for k in checked if len(CASES) <= k < len(CASES) + len(TRACED)],
                  formulas=checked == set(range(len(everything[0]))))
    if HAS_HF and len(CASES) + len(TRACED) in checked:
        _check_hf_llama([rank[len(CASES) + len(TRACED)] for rank in everything])
    if set(range(len(CASES))) <= checked:
        import test_pipeline_formula as formula  # DDP x pipeline's formulas at other sizes vs these ranks

        formula.ddp_against_the_engines(everything, CASES, _derive)
    derived = {}
    for k, case in enumerate(CASES):
        if k not in checked:
            continue
        real = [rank[k] for rank in everything]
        assert [(r.pp, r.dp) for r in real] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        d = derived[k] = _derive(*case)
        named = {s.name: int(v) for s, v in d.numbers.items()}
        sides = d.to_dict()["values"]["parameter_side_per_rank"]
        replays = {dp: d.step.at_rank(dp)._replays(named) for dp in (0, 1)}
        for r in real:
            mine = replays[r.dp][r.pp]
            assert (mine.at["parameters"], mine.at["optimizer_state"]) == (r.parameters, r.optimizer_state), (k, r)
            # the parameter side per rank (passes/rank_side.py): the real rank's weights and optimizer state, and
            # the buffers of the real stage module it runs (Llama's rotary frequencies on every stage)
            side = sides[str(r.rank)]
            assert (side["parameters"], side["optimizer_state"]) == (
                r.parameters + _stage_buffers(case, r.pp), r.optimizer_state), (k, r, side)
            # FP32: a whole gradient per weight, and the buckets as many bytes again -- or, under the bucket view,
            # the gradients themselves (counted once)
            assert (side["gradients"], side["buckets"]) == (
                r.parameters, 0 if case[-1] == "ddp-bucket-view" else r.parameters), (k, r, side)
            assert (mine.peak.first, mine.peak.bytes, mine.peak.pipeline, mine.peak.step) == (
                r.first_peak, r.steady_peak, r.pipeline_peak, r.step_peak), (k, r)
        model, values, schedule, m, loss, options, engine = case
        top = max(real, key=lambda r: (r.steady_peak, -r.rank))
        out = d.to_dict()
        assert (d.value("peak"), d.value("peak_first_step")) == (top.steady_peak, max(r.first_peak for r in real)), k
        assert (out["peak_at"]["rank"], out["peak_at"]["stage"]) == (top.rank, top.pp), k
        each = {str(r.rank): {"peak": r.steady_peak, "peak_first_step": r.first_peak} for r in real}
        assert out["values"]["peak_per_rank"] == each, k
        assert out["values"]["peak_per_stage"] == [max(real[0].steady_peak, real[1].steady_peak),
                                                   max(real[2].steady_peak, real[3].steady_peak)], k
        if engine == "zero-redundancy":  # whole parameters partitioned: the ranks of a stage differ
            assert real[0].optimizer_state != real[1].optimizer_state, k
            continue
        assert real[0].steady_peak == real[1].steady_peak and real[2].steady_peak == real[3].steady_peak
        if engine == "ddp-bucket-view":  # the step's gradients are the buckets: DDP's step less the buckets
            assert [r.step_peak for r in real] == [d[0].step_peak - d[0].parameters for d in everything], k
            assert real[0].steady_peak < everything[0][0].steady_peak, k
            continue
        alone = derive(model, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, loss=loss,
                       device="cpu", values={n: v for n, v in named.items() if n != "N"}, **options)
        plain = alone.step.per_stage(alone.numbers)
        assert [r.steady_peak - r.parameters for r in real] == [plain["peak_per_stage"][r.pp] for r in real], k
        assert [r.first_peak - r.parameters for r in real] == [
            plain["peak_first_step_per_stage"][r.pp] for r in real], k
    if 0 in checked:
        assert derived[0].peak_at().where(step=False) == (
            "rank 0 (stage 0 of 2, data-parallel rank 0 of N = 2): the optimizer step")
    if 2 in checked:
        assert derived[2].peak_at().where(step=False) == (
            "rank 3 (stage 1 of 2, data-parallel rank 1 of N = 2): pipeline layers.mlp.gate_up (layer 2), "
            "micro-batch 0")


@functools.cache
def _traced(schedule: str, m: int, engine: str):
    from symmem.importer import sources

    loaded = sources.load(BLOCK)
    return sources.trace(loaded, sources.parse_dims("B", loaded), optimizer="adamw", loss="cross-entropy",
                         check=False, pipeline_parallel=True, pipeline_schedule=schedule, data_parallel=engine,
                         micro_batches=m, values={"p": 2, "N": 2})


def _check_traced(everything, checked, formulas=True):
    """A traced module's stages under DDP's bucket view and ZeRO-1 (symmem.importer.traced_ddp_pipeline) against
    the real engine on the module's manual split: every rank's weights, AdamW state, first and steady peak, and the
    largest moment of its schedule and of its optimizer step, to the byte; the views' largest rank, every rank's
    peak and parameter side."""
    from symmem.passes.data_parallel import rank_peaks

    for k, case in enumerate(TRACED):
        if k not in checked:
            continue
        real = [rank[k] for rank in everything]
        d = _traced(*case)
        replays_are_the_ranks(d, real, k)
        top = max(real, key=lambda r: (r.steady_peak, -r.rank))
        assert (d.value("peak"), d.value("peak_first_step")) == (top.steady_peak, max(r.first_peak for r in real))
        assert rank_peaks(d) == {r.rank: (r.first_peak, r.steady_peak) for r in real}, k
        # the parameter side per rank (passes/rank_side.py): the real rank's weights and AdamW state (the module
        # has no buffers); FP32: a whole gradient per weight, and the buckets as many bytes again -- under the bucket
        # view the gradients themselves (counted once)
        view = case[-1] == "ddp-bucket-view"
        side = {str(r.rank): {"parameters": r.parameters, "gradients": r.parameters,
                              "buckets": 0 if view else r.parameters, "optimizer_state": r.optimizer_state,
                              "total": (2 if view else 3) * r.parameters + r.optimizer_state} for r in real}
        assert d.to_dict()["values"]["parameter_side_per_rank"] == side, k
        # an engine on traced stages: each moment a formula in the module's sizes (importer/traced_formula.py), and
        # every rank's, derived at other B, at this mesh's B gives its measured peak where the same moment peaks
        # (``-m deep``: two traces more a case, ~2-3 CPU-s)
        assert d.peak_at().pinned().startswith(f"at p = 2, M = {case[1]}"), (k, d.peak_at().pinned())
        if not formulas:
            continue
        import test_rank_formulas as ranks

        others = [{"B": 2}, {"B": 6}]
        ranks.ranks_from_other_sizes(
            [ranks._traced(case[2], case[0], case[1], tuple(sorted({"B": 4, "N": 2, **o}.items()))) for o in others],
            {"B": 4, "N": 2}, others, {r.rank: (r.first_peak, r.steady_peak) for r in real},
            case[2] == "zero-redundancy")
    assert [(r.steady_at, r.steady_peak) for r in everything[0]] == [
        (("forward", "aten.sum.dim_IntList"), 163_896), (("step", "aten.div.Tensor"), 142_768)]
    assert everything[0][1].optimizer_state - everything[1][1].optimizer_state == 168


def _check_hf_llama(real):
    """Hugging Face Llama's stages under ZeRO-1 (symmem.importer.traced_ddp_pipeline) against the real engine on its
    manual split: every rank's weights, AdamW state of the parameters it owns, first and steady peak, the largest
    moment of its schedule and of its optimizer step, to the byte; the views' largest rank, every rank's peak and
    parameter side (the real rank's weights and state, a whole gradient and DDP's buckets as many bytes again)."""
    from symmem.importer import sources
    from symmem.passes.data_parallel import rank_peaks

    loaded = sources.load("hf:llama", config=LLAMA_HF)
    d = sources.trace(loaded, sources.parse_dims("B,S", loaded), optimizer="adamw", loss="sum", check=False,
                      pipeline_parallel=True, pipeline_schedule="1f1b", data_parallel="zero-redundancy",
                      micro_batches=2, values={"p": 2, "N": 2})
    replays_are_the_ranks(d, real, "hf:llama")
    top = max(real, key=lambda r: (r.steady_peak, -r.rank))
    assert (d.value("peak"), d.value("peak_first_step")) == (top.steady_peak, max(r.first_peak for r in real))
    assert rank_peaks(d) == {r.rank: (r.first_peak, r.steady_peak) for r in real}
    # the parameters a rank stores: its real stage module's weights and buffers (inv_freq, original_inv_freq: 32 B)
    own = [hf_stage_buffers("hf:llama", LLAMA_HF, s) for s in (0, 1)]
    assert own == [32, 32]
    side = {str(r.rank): {"parameters": r.parameters + own[r.pp], "gradients": r.parameters,
                          "buckets": r.parameters, "optimizer_state": r.optimizer_state,
                          "total": 3 * r.parameters + own[r.pp] + r.optimizer_state} for r in real}
    assert d.to_dict()["values"]["parameter_side_per_rank"] == side
    # whole parameters partitioned: the ranks of a stage own different state; rank 2 steps the head (2,112 B) first
    assert real[0].optimizer_state != real[1].optimizer_state and real[2].optimizer_state != real[3].optimizer_state
    assert [r.step_peak for r in real[2:]] == [58_612, 58_552]


def test_the_cli_table_names_the_rank_and_fit(capsys):
    """The table's peak line names the rank; ``fit`` finds the largest B whose largest rank fits (fresh derives on
    each side of the budget)."""
    from symmem.apps.budget import largest
    from symmem.cli import main

    sets = [a for k, v in {**LLAMA, "p": 2, "N": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["derive", "llama", "--data-parallel", "ddp", "--pipeline-parallel", "gpipe", "--micro-batches",
                 "2", "--attention", "sdpa", "--device", "cpu", "--loss", "cross-entropy", *sets]) == 0
    text = " ".join(capsys.readouterr().out.split())
    # the peaks CASES[1] checks against the engine, rank by rank
    assert "peak per rank (first step / steady): ranks 0-1: 274,720 / 365,128 B; ranks 2-3: 307,760 / 398,428 B" \
        in text
    fit = largest(_derive(*CASES[2]), "B", 2**20)
    at = [_derive("llama", {**LLAMA, "B": b}, *CASES[2][2:]).value("peak") for b in (fit.max, fit.max + 1)]
    assert at[0] <= 2**20 < at[1] and (fit.total_at_max, fit.total_above) == tuple(at)


@pytest.mark.parametrize("more, why", [
    ({"optimizer": "sgd"}, "no peak: the DDP x pipeline peak is modelled for FP32 Adam/AdamW's for-loop step"),
])
def test_the_peak_refuses_what_was_not_measured(more, why):
    from symmem import derive

    kw = {"device": "cpu", "attention": "sdpa", "values": {**LLAMA, "p": 2, "N": 2}, **more}
    out = derive("llama", data_parallel="ddp", pipeline_parallel=True, micro_batches=2, **kw).to_dict()
    assert out["values"]["peak"] is None and out["peak_refused"].startswith(why), more


def test_bucket_views_on_stages_in_the_cli(capsys):
    """The table's per-rank peaks under ``--data-parallel ddp-bucket-view``: those CASES[4] checks against the
    engine, rank by rank."""
    from symmem.cli import main

    sets = [a for k, v in {**GPT2, "F": 128, "p": 2, "N": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["derive", "gpt2", "--data-parallel", "ddp-bucket-view", "--pipeline-parallel", "1f1b",
                 "--micro-batches", "2", "--attention", "naive", "--dropout", "0", "--device", "cpu", "--loss",
                 "cross-entropy", *sets]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "peak per rank (first step / steady): ranks 0-1: 1,040,056 / 1,116,216 B; ranks 2-3: 356,236 / 475,080 B" \
        in text


def _stage_buffers(case, stage: int) -> int:
    """Bytes of the buffers of the real stage module ``stage`` of ``case`` (p = 2), as the gloo runs build it."""
    from symmem.record.model_parallel_runs import _stage_module

    model, values, _, _, _, options, _ = case
    sizes = {**values, "p": 2, "N": 2, **({"F": 4 * values["H"]} if model == "gpt2" else {})}
    return sum(b.numel() * b.element_size() for b in _stage_module(model, sizes, stage, 2, options).buffers())


def test_a_traced_module_in_the_cli_and_fit(capsys):
    """``symmem trace ... --pipeline-parallel gpipe --data-parallel zero-redundancy``: every rank's peak and
    parameter side in the table (those TRACED[1] checks against the engine, rank by rank); ``fit`` finds the largest
    B whose largest rank fits (the stages replayed anew at B and B + 1, on each side of the budget)."""
    from symmem.apps.budget import largest
    from symmem.cli import main

    assert main(["trace", BLOCK, "--dims", "B", "--pipeline-parallel", "gpipe", "--data-parallel", "zero-redundancy",
                 "--set", "p=2", "--set", "N=2", "--micro-batches", "3", "--optimizer", "adamw", "--loss",
                 "cross-entropy"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("peak per rank (first step / steady): rank 0: 142,768 / 142,768 B; rank 1: 142,600 / 142,600 B; rank "
            "2: 139,528 / 139,528 B; rank 3: 139,376 / 139,376 B (the peak above is rank 0's, the largest)") in text
    assert "rank 0: 120,304 B; rank 1: 120,136 B; rank 2: 117,304 B; rank 3: 117,152 B" in text
    d = _traced(*TRACED[1])
    fit = largest(d, "B", 2**20)
    at = [d.at(B=b).value("peak") for b in (fit.max, fit.max + 1)]
    assert at[0] <= 2**20 < at[1] and (fit.total_at_max, fit.total_above) == tuple(at)


def test_a_traced_module_not_in_fp32_is_refused():
    """What was not measured is one line, not a guess: FP64 parameters (the DDP x pipeline runs were FP32)."""
    import importlib.util

    from symmem import trace

    spec = importlib.util.spec_from_file_location("traced_block", Path(__file__).parent / "data" / "traced_block.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    d = trace(mod.Net().double(), (torch.randn(4, 12, dtype=torch.float64),), {"B": [(0, 0)]}, optimizer="adamw",
              loss="cross-entropy", check=False, pipeline_parallel=True, data_parallel="ddp", micro_batches=2,
              values={"p": 2, "N": 2})
    assert d.to_dict()["peak_refused"] == (
        "no peak: the DDP x pipeline peak of a traced module is measured for FP32 parameters")


def test_another_hugging_face_model_on_stages_is_refused():
    """A Hugging Face model type whose manual split was not measured (OPT) is one line naming those that were, under
    DDP and FSDP x pipeline alike (the step stands in for a traced one: the refusal reads its module's config)."""
    from types import SimpleNamespace

    from symmem.importer import traced_ddp_pipeline, traced_fsdp_pipeline
    from symmem.training import Regime

    module = torch.nn.Linear(2, 2)
    module.config = SimpleNamespace(model_type="opt", is_encoder_decoder=False)
    step = SimpleNamespace(repeat=1, module=module, options=SimpleNamespace(loss="sum", checkpoint=None,
                                                                           autocast=None, impl="for-loop"))
    for engine, refusal in (("ddp", traced_ddp_pipeline.refusal), ("fsdp", traced_fsdp_pipeline.refusal)):
        layout = "DDP" if engine == "ddp" else "FSDP"
        assert refusal(step, Regime(pipeline_parallel=True, data_parallel=engine, optimizer="adamw")) == (
            f"the {layout} x pipeline peak of a Hugging Face model is measured for GPT-2's, Llama's, Mistral's and "
            "Qwen2's stages, not 'opt''s")
