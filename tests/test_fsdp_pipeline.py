"""FSDP x pipeline against the real engine: FSDP2's ``fully_shard`` on every stage of a p x N = 2 x 2 gloo mesh.

The truth is four real processes (gloo, 127.0.0.1, bounded time) on ``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("pp", "dp"))``, torchtitan's recipe: each rank's stage of the reference (the embedding on the first,
the final norm and the head on the last) with ``fully_shard`` on each layer and the stage root over ``mesh["dp"]``,
``PipelineStage`` and ``ScheduleGPipe`` / ``Schedule1F1B``, FP32 for-loop AdamW, each rank under the DTensor- and
FSDP-aware recorder (``symmem.record.fsdp_pipeline_runs``: each moment's fewest bytes over repeated steps).
symmem's side is ``symmem.passes.fsdp_pipeline``: the pipeline's replay of each stage with FSDP2's units.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.pipelining")

from gloo_store import START  # noqa: E402  (how the suite's ranks start)
from stage_ranks import hf_stage_buffers, replays_are_the_ranks, sharded_side  # noqa: E402

GPT2 = {"B": 2, "S": 16, "H": 32, "h": 2, "L": 2, "V": 65}
LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 63, "F": 64}
#: (model, sizes, schedule, M, loss, options, reshard_after_forward): an odd vocabulary pads the embedding's (and
#: the head's) rows to a multiple of N = 2, so the data-parallel rank 1 of each stage holds one row fewer of AdamW's
#: state than rank 0; GPT-2 1F1B resharding (stage 0 peaks at the embedding's all-gather beside layer 1's unsharded
#: parameters, at the first backward); Llama GPipe without resharding; Llama 1F1B, two layers a stage, M = 3
CASES = [("gpt2", GPT2, "1f1b", 2, "cross-entropy", {"attention": "naive", "dropout": 0.0}, True),
         ("llama", LLAMA, "gpipe", 2, "cross-entropy", {"attention": "sdpa"}, False),
         ("llama", {**LLAMA, "V": 64, "L": 4}, "1f1b", 3, "sum", {"attention": "naive"}, True),
         # every stage's layers checkpointed (tests/test_pipeline_checkpoint.py): each recomputed layer gathered again
         ("llama", {**LLAMA, "V": 64}, "1f1b", 2, "cross-entropy", {"attention": "sdpa", "checkpoint": "full"}, True)]
#: a traced module (tests/data/traced_block.py: 4 blocks, a head of 5 rows, padded to 6 over N = 2) in the same
#: spawn: (schedule, M, reshard_after_forward): 1F1B resharding (stage 1 peaks at an all-gather in backward), GPipe
#: without resharding, M = 3
BLOCK = f"{Path(__file__).parent / 'data' / 'traced_block.py'}:build"
TRACED = [("1f1b", 2, True)]
#: ``-m deep`` (docs/testing.md): the traced module under GPipe without resharding, M = 3 -- the traced module's
#: stages are TRACED's, GPipe without resharding the built-in Llama's (CASES[1]), M = 3 the built-in Llama's
#: 1F1B (CASES[2])
DEEP_TRACED = [("gpipe", 3, False)]
#: Hugging Face GPT-2 (untied, V = 65 padded to 66 over N = 2) in the same spawn, its manual split (GPT2Split): ONE
#: block a stage under fsdp, GPipe, B = 2, S = 8 -- stage 0's root (wte, wpe) and its only block end their forward
#: in the same op name (the block's last add, its attention's residual's too): the root's post-forward was once
#: taken at the first of them, 22,784 B below the real peak
HF = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 65, "n_positions": 64, "use_cache": False,
      "tie_word_embeddings": False}
#: more Hugging Face stages in the same spawn: (spec, config, split, schedule, M, loss, reshard, boundary): GPT-2
#: tied (each stage's copy fully_shard-ed on its own stage: the embedding's on stage 0, the head's on the last, never
#: synchronized) and Llama (LlamaSplit: each stage makes its own position ids and rotary tables; V = 33 padded to
#: 34), each with its own loss (given labels: the schedule's loss_fn, model.loss_function, after the head)
LLAMA_HF = {"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 32, "vocab_size": 33, "tie_word_embeddings": False, "use_cache": False}
MORE_HF = [("hf:gpt2", {**HF, "tie_word_embeddings": True}, "GPT2Split", "gpipe", 2, "output", True, (2, 8, 32)),
           ("hf:llama", LLAMA_HF, "LlamaSplit", "1f1b", 2, "output", False, (2, 8, 16))]
HAS_HF = importlib.util.find_spec("transformers") is not None


def _derive(model, values, schedule, m, loss, options, reshard, **more):
    from symmem import derive

    sizes = {**values, "p": 2, "N": 2, **({"F": 4 * values["H"]} if model == "gpt2" else {})}
    return derive(model, data_parallel="fsdp" if reshard else "fsdp-no-reshard", pipeline_parallel=True,
                  pipeline_schedule=schedule, micro_batches=m, loss=loss, device="cpu", values=sizes,
                  **options, **more)


#: the cases of :func:`mesh_cases` run LIVE in every suite run (in the meshes' one spawn of four ranks,
#: tests/stage_ranks.py, with tests/test_tensor_pipeline.py's and tests/test_ddp_pipeline.py's): Llama GPipe without
#: resharding, the traced module (1F1B, resharding); the others replayed from their stored real runs
#: (tests/data/pipeline_meshes_gloo.json): :data:`REPLAYED` checked in every suite run, all of them rerun against
#: fresh gloo runs under ``-m deep``
LIVE = (1, 4)
#: the stored cases checked against the engine in every suite run: GPT-2 1F1B resharding (GPT-2 runs live on stages
#: under DDP's bucket view, tests/test_ddp_pipeline.py) and Llama 1F1B, L = 4, M = 3 (two layers a stage, M = 3, the
#: loss sum); the rest, and the formulas from other sizes, under ``-m deep`` (docs/testing.md):
#: the checkpointed Llama, and the Hugging Face stages (GPT-2 untied and tied, Llama), each a trace of ~4-6 CPU-s in
#: the test's process (the Hugging Face families run live on stages in tests/test_traced_pipeline.py)
REPLAYED = (0, 2)


def mesh_cases() -> list:
    """Every case of this file's 2 x 2 mesh as ``fsdp_pipeline_runs`` takes them: :data:`CASES`, :data:`TRACED`,
    :data:`HF`, :data:`MORE_HF` (the last two with transformers)."""
    from symmem.importer.spec_builder import SpecBuilder
    from symmem.record.traced_pipeline_runs import GPT2Split, LlamaSplit, SequentialSplit, TracedCase

    split = SequentialSplit(("inp",), "blocks", ("head",))
    traced = [(TracedCase(SpecBuilder(BLOCK), split, schedule, m, "cross-entropy", (4, 5), (4, 24)), reshard)
              for schedule, m, reshard in TRACED]
    hf = [(TracedCase(SpecBuilder("hf:gpt2", tuple(sorted(HF.items()))), GPT2Split(), "gpipe", 2, "sum", (2, 8, 65),
                      (2, 8, 32)), True)] if HAS_HF else []
    splits = {"GPT2Split": GPT2Split(), "LlamaSplit": LlamaSplit()}
    hf += [(TracedCase(SpecBuilder(spec, tuple(sorted(config.items()))), splits[split], schedule, m, loss,
                       (2, 8, config["vocab_size"]), boundary), reshard)
           for spec, config, split, schedule, m, loss, reshard, boundary in MORE_HF] if HAS_HF else []
    return [*CASES, *traced, *hf]


@pytest.mark.xdist_group("gloo")  # one test worker runs the gloo tests in turn
def test_every_rank_of_a_2x2_mesh_against_the_engine():
    """Every rank's parameters (padded shards), AdamW state (the unpadded rows), first and steady peak, and the
    largest moment of its schedule and of its optimizer step equal the real run's to the byte (the :data:`LIVE`
    cases measured now, :data:`REPLAYED` stored); the views give the largest rank's peak, which rank and stage,
    and every rank's."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import mesh_ranks

    _check(mesh_ranks(mesh_cases(), LIVE), {*LIVE, *REPLAYED})


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_case_against_fresh_gloo_runs():
    """Every case of :func:`mesh_cases` in a fresh spawn of its own: every rank's fields equal the stored ones
    (tests/data/pipeline_meshes_gloo.json; ``SYMMEM_STORE_MESHES=1`` writes them), and every check of the default
    test holds on them -- the replayed cases' and the formulas' from other sizes of the stored ones."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from stage_ranks import rerun

    from symmem.record.fsdp_pipeline_runs import fsdp_pipeline_runs

    cases = mesh_cases()
    everything = rerun(fsdp_pipeline_runs, cases)
    _check(everything, set(range(len(cases))))


def _check(everything, checked) -> None:
    """The checks of every case of :func:`mesh_cases` in ``checked`` (indices) against ``everything`` (per rank,
    per case: live or stored runs)."""
    at = len(CASES) + len(TRACED)
    if set(range(len(CASES), at)) <= checked:  # its ranks' formulas from other sizes (two more traces) when deep
        _check_traced([rank[len(CASES):at] for rank in everything],
                      formulas=checked == set(range(len(everything[0]))))
    if HAS_HF:
        if at in checked:
            _check_hf([rank[at] for rank in everything])
        for k, case in enumerate(MORE_HF):
            if at + 1 + k in checked:
                _check_more_hf([rank[at + 1 + k] for rank in everything], *case)
    # FSDP x pipeline's formulas from other sizes (N = 3 and 4 among them: ten derivations) against these ranks,
    # under ``-m deep`` (the formulas against the engine's replay at other sizes: test_pipeline_formula_mesh.py;
    # the replay against these ranks: below)
    if checked == set(range(len(everything[0]))):
        import test_pipeline_formula_mesh as formula
        import test_rank_formulas as ranks  # each stage's last data-parallel rank's formula from N = 3 and 4

        formula.fsdp_against_the_engines(everything, CASES)
        ranks.last_ranks_against_the_engines(everything, CASES)
    derived = {}
    for k, case in enumerate(CASES):
        if k not in checked:
            continue
        real = [rank[k] for rank in everything]
        assert [(r.pp, r.dp) for r in real] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        d = derived[k] = _derive(*case)
        named = {s.name: int(v) for s, v in d.numbers.items()}
        sides = d.to_dict()["values"]["parameter_side_per_rank"]
        replays = {dp: (d.step if dp == 0 else d.step.at_rank(dp))._replays(named) for dp in (0, 1)}
        for r in real:
            mine = replays[r.dp][r.pp]
            assert (mine.at["parameters"], mine.at["optimizer_state"]) == (r.parameters, r.optimizer_state), (k, r)
            # the parameter side per rank (passes/rank_side.py): the real rank's weights and optimizer state, and
            # the buffers of the real stage module it runs (Llama's rotary frequencies on every stage)
            side = sides[str(r.rank)]
            assert (side["parameters"], side["optimizer_state"]) == (
                r.parameters + _stage_buffers(case, r.pp), r.optimizer_state), (k, r, side)
            assert (mine.peak.first, mine.peak.bytes, mine.peak.pipeline, mine.peak.step) == (
                r.first_peak, r.steady_peak, r.pipeline_peak, r.step_peak), (k, r)
        top = max(real, key=lambda r: (r.steady_peak, -r.rank))
        out = d.to_dict()
        assert (d.value("peak"), d.value("peak_first_step")) == (top.steady_peak, top.first_peak), k
        assert (out["peak_at"]["rank"], out["peak_at"]["stage"]) == (top.rank, top.pp), k
        each = {str(r.rank): {"peak": r.steady_peak, "peak_first_step": r.first_peak} for r in real}
        assert out["values"]["peak_per_rank"] == each, k
        if k < 2:  # the padded vocabulary: the data-parallel rank 1 holds one row fewer of AdamW's two moments
            assert real[0].optimizer_state - real[1].optimizer_state == 2 * 32 * 4
        else:
            assert real[0].steady_peak == real[1].steady_peak
        assert out["values"]["peak_per_stage"] == [real[0].steady_peak, real[2].steady_peak], k
    if 0 in checked:  # where GPT-2's largest rank peaks: the first backward's all-gather of the embedding
        assert derived[0].peak_at().where(step=False) == (
            "rank 0 (stage 0 of 2, data-parallel rank 0 of N = 2): pipeline all-gather before h.add2's backward "
            "(layer 1), micro-batch 0")


@functools.cache
def _traced():
    from symmem.importer import sources

    loaded = sources.load(BLOCK)
    return sources.trace(loaded, sources.parse_dims("B", loaded), optimizer="adamw", loss="cross-entropy",
                         check=False, pipeline_parallel=True, data_parallel="fsdp", micro_batches=2,
                         values={"p": 2, "N": 2})


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_a_traced_module_under_gpipe_without_resharding():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.importer.spec_builder import SpecBuilder
    from symmem.record.fsdp_pipeline_runs import fsdp_pipeline_runs
    from symmem.record.traced_pipeline_runs import SequentialSplit, TracedCase

    split = SequentialSplit(("inp",), "blocks", ("head",))
    traced = [(TracedCase(SpecBuilder(BLOCK), split, schedule, m, "cross-entropy", (4, 5), (4, 24)), reshard)
              for schedule, m, reshard in DEEP_TRACED]
    _check_traced(fsdp_pipeline_runs(2, 2, traced, start_method=START), DEEP_TRACED)


def _check_traced(everything, cases=TRACED, formulas=True):
    """A traced module's stages under FSDP2 (symmem.importer.traced_fsdp_pipeline) against the real engine on the
    module's manual split: every rank's shards, AdamW state of the held rows, first and steady peak, and the largest
    moment of its schedule and of its optimizer step, to the byte; the views' largest rank and every rank's."""
    from symmem.passes.data_parallel import rank_peaks

    for k, (schedule, m, reshard) in enumerate(cases):
        real = [rank[k] for rank in everything]
        d = _traced()
        d = dataclasses.replace(d, step=dataclasses.replace(d.step, schedule=schedule, micro_batches=m,
                                                            reshard=reshard, _cache={}))
        replays_are_the_ranks(d, real, k)
        top = max(real, key=lambda r: (r.steady_peak, -r.rank))
        assert (d.value("peak"), d.value("peak_first_step")) == (top.steady_peak, top.first_peak), k
        assert rank_peaks(d) == {r.rank: (r.first_peak, r.steady_peak) for r in real}, k
        assert d.to_dict()["values"]["parameter_side_per_rank"] == sharded_side(real), k  # the module has no buffers
        # the head's 5 rows padded to 6: rank 3 (stage 1's data-parallel rank 1) holds 2 of 3, AdamW's state 2 rows
        # of 24 floats (and a bias element) fewer
        assert real[2].optimizer_state - real[3].optimizer_state == 2 * 4 * (24 + 1), k
        # every rank's formula in B and N (importer/traced_fsdp_pipeline.TracedFsdpFormulas), derived at N = 3 and
        # N = 4, at this mesh's sizes gives this rank's measured peak where the same moment peaks there (-m deep:
        # two traces more, ~3 CPU-s; the same formulas against the stored ranks: test_rank_formulas.TRACED)
        if not formulas:
            continue
        import test_rank_formulas as ranks

        others = [{"N": 3}, {"N": 4, "B": 3}]
        engine = "fsdp" if reshard else "fsdp-no-reshard"
        ranks.ranks_from_other_sizes(
            [ranks._traced(engine, schedule, m, tuple(sorted({"B": 4, "N": 2, **o}.items()))) for o in others],
            {"B": 4, "N": 2}, others, {r.rank: (r.first_peak, r.steady_peak) for r in real})
    assert _traced().peak_at().where(step=False) == (
        "rank 2 (stage 1 of 2, data-parallel rank 0 of N = 2): pipeline all-gather before aten.detach.default "
        "(AddmmBackward0) in blocks.2.down's backward, micro-batch 1")


def _check_hf(real):
    """Hugging Face GPT-2's stages under FSDP2 against the real engine on its manual split: every rank's shards,
    AdamW state, first and steady peak, its schedule's and optimizer step's largest moments, to the byte; stage 0
    peaks in the second micro-batch's forward, at the block's last dropout (the root's and the block's unsharded
    parameters and the block's all-gather output all alive)."""
    from symmem.importer import sources

    loaded = sources.load("hf:gpt2", config=HF)
    d = sources.trace(loaded, sources.parse_dims("B", loaded), optimizer="adamw", loss="sum", check=False,
                      pipeline_parallel=True, pipeline_schedule="gpipe", data_parallel="fsdp", micro_batches=2,
                      values={"p": 2, "N": 2})
    replays_are_the_ranks(d, real, "hf:gpt2")
    assert real[0].steady_at == ("forward", "aten.mul.Tensor")
    assert d.to_dict()["values"]["parameter_side_per_rank"] == sharded_side(real)
    assert (d.value("peak"), d.value("peak_first_step")) == (real[0].steady_peak, real[0].first_peak)
    assert d.peak_at().where(step=False) == (
        "rank 0 (stage 0 of 2, data-parallel rank 0 of N = 2): pipeline aten.mul.Tensor in "
        "transformer.h.0.mlp.dropout, micro-batch 1")


def _check_more_hf(real, spec, config, split, schedule, m, loss, reshard, boundary):
    """A Hugging Face model's stages (MORE_HF) under FSDP2 against the real engine: every rank's shards, AdamW
    state, first and steady peak, its schedule's and optimizer step's largest moments; the views' largest rank."""
    from symmem.importer import sources

    own = loss == "output"  # given labels (--loss cross-entropy): the model's own loss
    loaded = sources.load(spec, config=config, loss="cross-entropy" if own else None)
    d = sources.trace(loaded, sources.parse_dims("B,S", loaded), optimizer="adamw", loss=loss, check=False,
                      pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m,
                      data_parallel="fsdp" if reshard else "fsdp-no-reshard", values={"p": 2, "N": 2})
    replays_are_the_ranks(d, real, spec)
    top = max(real, key=lambda r: (r.steady_peak, -r.rank))
    assert (d.value("peak"), d.value("peak_first_step")) == (top.steady_peak, top.first_peak), spec
    # the padded vocabulary (GPT-2 65 rows, Llama 33, over N = 2): the last stage's data-parallel rank 1 holds one
    # row fewer of the head's AdamW state
    assert real[2].optimizer_state - real[3].optimizer_state == 2 * 4 * boundary[-1], spec
    # the parameter side per rank: the real rank's shards and state, and its real stage module's buffers (Llama's
    # rotary inv_freq and original_inv_freq, 32 B on every stage; GPT-2's stages hold none)
    own = [hf_stage_buffers(spec, config, s, split=split) for s in (0, 1)]
    assert own == ([32, 32] if spec == "hf:llama" else [0, 0]), spec
    side = sharded_side(real)
    for r in real:
        side[str(r.rank)]["parameters"] += own[r.pp]
        side[str(r.rank)]["total"] += own[r.pp]
    assert d.to_dict()["values"]["parameter_side_per_rank"] == side, spec


def _block_case():
    """TRACED[0] as :func:`mesh_cases` gives it (the file module, 1F1B, M = 2, resharding)."""
    return mesh_cases()[len(CASES)]


def _tied_case():
    from test_mesh_cli_ranks import tied_case

    return tied_case()


@pytest.mark.parametrize("spec, case", [
    # the peaks of TRACED[0]'s stored ranks (live in the 2 x 2 test, which also checks them against the engine;
    # ``-m deep``: the CLI's same path is [tied]'s, the same derivation the 2 x 2 test's)
    pytest.param(BLOCK, _block_case, marks=pytest.mark.deep),
    # one weight shared by two modules of stage 0 (one copy there) and the head (the last stage's copy): its stored
    # real ranks on the 2 x 2 gloo mesh (tests/test_mesh_cli_ranks.py, which reruns them under ``-m deep`` and checks
    # every rank's shards, state and peaks against the engine)
    (f"{BLOCK}_tied", _tied_case),
], ids=["every-rank", "tied"])
def test_a_traced_module_in_the_cli(capsys, spec, case):
    """``symmem trace ... --pipeline-parallel --data-parallel fsdp``: every rank's peak in the table (the real
    ranks' first and steady peaks, stored), a module with a tied weight too (each stage's copy sharded on its own
    stage)."""
    from test_mesh_cli_ranks import peaks_in_line, stored_peaks

    from symmem.cli import main

    assert main(["trace", spec, "--dims", "B", "--pipeline-parallel", "--data-parallel", "fsdp", "--set", "p=2",
                 "--set", "N=2", "--micro-batches", "2", "--optimizer", "adamw", "--loss", "cross-entropy"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    real = stored_peaks(case())
    assert peaks_in_line(text) == real
    top = max(real, key=lambda r: (real[r][1], -r))
    assert f"(the peak above is rank {top}'s, the largest)" in text


def test_the_cli_table_and_fit(capsys):
    """The table's peak line names the rank and gives every rank's peaks (CASES[1]'s real ranks: live in the 2 x 2
    test, equal to their stored row there); ``fit`` finds the largest B whose largest rank fits (the stages
    replayed anew at B and B + 1, fresh derives, on each side of the budget)."""
    from test_mesh_cli_ranks import peaks_in_line, stored_peaks

    from symmem.apps.budget import largest
    from symmem.cli import main

    sets = [a for k, v in {**LLAMA, "p": 2, "N": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["derive", "llama", "--data-parallel", "fsdp-no-reshard", "--pipeline-parallel", "gpipe",
                 "--micro-batches", "2", "--attention", "sdpa", "--device", "cpu", "--loss", "cross-entropy",
                 *sets]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert peaks_in_line(text) == stored_peaks(CASES[1])
    d = _derive(*CASES[1])
    budget = 2**20
    fit = largest(d, "B", budget)
    at = [_derive("llama", {**LLAMA, "B": b}, *CASES[1][2:]).value("peak") for b in (fit.max, fit.max + 1)]
    assert at[0] <= budget < at[1] and (fit.total_at_max, fit.total_above) == tuple(at)


@pytest.mark.parametrize("engine, why", [
    ("fsdp1", "PipelineStage handles DDP and FSDP2 only (backward_maybe_with_nosync), so FSDP1 would "
              "reduce-scatter after every micro-batch, which was not measured"),
])
def test_other_engines_on_stages_are_one_line_errors(capsys, engine, why):
    from symmem.cli import main

    assert main(["derive", "gpt2", "--data-parallel", engine, "--pipeline-parallel", "--set", "p=2"]) == 2
    assert capsys.readouterr().err == (f"symmem: error: data_parallel={engine!r} with pipeline parallelism is not "
                                       f"modelled: {why}; DDP, ZeRO-1 and FSDP2 on every stage are (ddp, "
                                       "ddp-bucket-view, zero-redundancy, fsdp, fsdp-no-reshard)\n")


@pytest.mark.parametrize("more, why", [
    ({"optimizer": "sgd"}, "no peak: the FSDP x pipeline peak is modelled for FP32 Adam/AdamW's for-loop step"),
    ({"values": {**LLAMA, "p": 2, "N": 1}}, "no peak: data_parallel='fsdp' at N = 1: FSDP2 on one rank"),
])
def test_the_peak_refuses_what_was_not_measured(more, why):
    from symmem import derive

    kw = {"device": "cpu", "attention": "sdpa", "values": {**LLAMA, "p": 2, "N": 2}, **more}
    out = derive("llama", data_parallel="fsdp", pipeline_parallel=True, micro_batches=2, **kw).to_dict()
    assert out["values"]["peak"] is None and out["peak_refused"].startswith(why), more


def test_stages_without_the_engine_are_refused(capsys):
    """``symmem stages`` gives one pipeline's stages: with an engine it says where every rank's peak is."""
    from symmem.cli import main

    assert main(["stages", "gpt2", "--data-parallel", "fsdp", "--pipeline-parallel", "gpipe", "--set", "p=2",
                 "--set", "N=2", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("symmem: error: the stages here are one pipeline's, without an engine: with "
                                       "data_parallel='fsdp' derive gives every rank's peak (values.peak_per_rank)\n")
    assert main(["stages", "llama", "--tensor-parallel", "--pipeline-parallel", "gpipe", "--set", "p=2",
                 "--set", "t=2", "--device", "cpu"]) == 2
    assert capsys.readouterr().err == ("symmem: error: the stages here are one pipeline's, at whole tensors: with "
                                       "tensor parallelism derive gives every rank's peak (values.peak_per_rank, "
                                       "values.peak_per_stage)\n")


def _stage_buffers(case, stage: int) -> int:
    """Bytes of the buffers of the real stage module ``stage`` of ``case`` (p = 2), as the gloo runs build it."""
    from symmem.record.model_parallel_runs import _stage_module

    model, values, _, _, _, options, _ = case
    sizes = {**values, "p": 2, "N": 2, **({"F": 4 * values["H"]} if model == "gpt2" else {})}
    return sum(b.numel() * b.element_size() for b in _stage_module(model, sizes, stage, 2, options).buffers())
