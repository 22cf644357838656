"""Pipeline stages against the real engine: ``torch.distributed.pipelining`` (ScheduleGPipe, Schedule1F1B) on gloo.

The truth is two real processes (127.0.0.1, a free port, bounded time), each training its stage of the GPT-2
reference two steps with FP32 AdamW under the live-bytes recorder (``symmem.record.model_parallel_runs``): per
rank, the steady and the first step's peak, the largest moments of the schedule and of the optimizer step of
each, the most saved activations alive at once, what lives between steps, and the parameter bytes.  symmem's side is
``symmem.api.pipeline_stages``: formulas cut from the single-device derivation and the single-device step's
timeline replayed in the schedule's order.  Every value is compared to the byte.
"""

from __future__ import annotations

import functools

import pytest
import sympy

from symmem.errors import SymmemError

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.pipelining")

#: Small enough to run in seconds, large enough that the pipeline phase is the peak on some stages and the
#: optimizer step (the 1024-row position table's Adam temporaries) on others.
SIZES = {"B": 2, "S": 32, "H": 32, "h": 2, "L": 2, "V": 64}
OPTIONS = {"attention": "naive", "dropout": 0.0, "device": "cpu"}
#: (schedule, micro-batches, loss): GPipe holds every micro-batch, 1F1B min(p - s, M); the loss ``sum`` keeps
#: no loss tensors
CASES = [("gpipe", 1, "cross-entropy"), ("gpipe", 4, "cross-entropy"), ("1f1b", 4, "cross-entropy"),
         ("gpipe", 2, "sum")]


#: Llama's stages (every stage makes its own rotary tables and mask): sizes, and (schedule, M, loss, options)
LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64}
LLAMA_CASES = [("gpipe", 2, "cross-entropy", {"attention": "sdpa"}), ("1f1b", 4, "sum", {"attention": "naive"})]
#: Tensor parallelism (DTensor, Llama's standard plan) over two ranks: grouped-query eager attention, and
#: multi-head SDPA with two layers.
TENSOR = [({"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 64}, {"attention": "naive"}),
          ({"B": 2, "S": 8, "H": 32, "h": 4, "G": 4, "L": 2, "V": 64, "F": 96}, {"attention": "sdpa"})]
#: The same with sequence parallelism (torchtitan's plan: SequenceParallel norms, S split between the layers)
SEQUENCE = [(values, {**options, "sequence_parallel": True}) for values, options in TENSOR]
#: Where the step peaks elsewhere than in TENSOR (the forward's end, the optimizer step): a small vocabulary and a
#: long sequence (the final norm's backward), a wide MLP (the last layer's MLP backward)
PEAKS = [({"B": 2, "S": 64, "H": 32, "h": 4, "G": 2, "L": 2, "V": 16, "F": 64}, {"attention": "naive"}),
         ({"B": 2, "S": 32, "H": 32, "h": 4, "G": 4, "L": 2, "V": 16, "F": 512}, {"attention": "sdpa"})]


def test_against_the_engines():
    """One gloo process group of two ranks runs every pipeline case and every tensor-parallel step (one test, so
    that pytest-xdist runs the processes once), then each comparison below."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.record.model_parallel_runs import runs

    # the pipeline jobs of STAGES[2] in LIVE_STAGES (one a model and schedule), the others replayed from their stored
    # real ranks (tests/tensor_stored.py)
    jobs = [job for job in STAGES[2] if job in LIVE_STAGES]
    # the tensor-parallel ranks: the first step measured, then steps under the DTensor-aware recorder; one live case
    # each of TENSOR and SEQUENCE, the rest replayed from their stored real ranks (LIVE_TWO)
    stages = len(jobs)
    jobs += [("tensor", "llama", values, options) for values, options in LIVE_TWO]
    import test_pipeline_checkpoint as staged  # its gloo jobs (checkpointed layers on stages) ride in this spawn
    import test_pipeline_formula as formula  # its gloo job (three layers a stage) rides in this spawn
    import test_selective_stages as selective  # its gloo jobs (selective recomputation on stages) too
    import test_tensor_checkpoint as checkpointed  # its gloo job (checkpointed sequence parallelism) too

    at = len(jobs)
    jobs += staged.JOBS
    chosen = len(jobs)
    jobs += selective.JOBS
    mine = len(jobs)
    jobs += checkpointed.JOBS
    jobs += formula.JOBS
    everything = runs(2, jobs)
    staged_ranks = _stages(2, [rank[:stages] for rank in everything])  # per job of STAGES[2], its two ranks
    measured = [[staged_ranks[case][rank] for case in range(len(CASES))] for rank in (0, 1)]
    for case in range(len(CASES)):
        if case not in DEEP_ROWS["CASES"]:
            every_stage_to_the_byte(measured, case)
            every_view_names_the_largest_stage(measured, case)
    what_the_engine_holds(measured)
    from tests.tensor_stored import differences

    live = {}  # (values, options) -> its live ranks, each held to its stored row first
    for case, (values, options) in enumerate(LIVE_TWO):
        live[_name(values, options)] = ranks = [rank[stages + case] for rank in everything]
        assert differences("tensor", 2, values, options, ranks) == []

    def ranks_of(values, options):
        return live.get(_name(values, options)) or _stored(2, values, options)

    for case, (values, options) in enumerate(TENSOR):
        tensor_parallel_rank_to_the_byte(ranks_of(values, {**options, "peaks": True}), case)
        tensor_parallel_peak_to_the_byte(ranks_of(values, {**options, "peaks": True}), values, options, 2,
                                         views=case == 0)  # TENSOR[0] live: its JSON and table too
    for case, (values, options) in enumerate(SEQUENCE):
        if case not in DEEP_ROWS["SEQUENCE"]:
            sequence_parallel_rank_to_the_byte(ranks_of(values, options), case)
    for values, options in PEAKS:
        tensor_parallel_peak_to_the_byte(ranks_of(values, {**options, "peaks": True}), values, options, 2)
    values, options = SEQUENCE_PEAKS[2][0]  # its views here (replayed); every case of SEQUENCE_PEAKS in its own test
    where = sequence_parallel_peak_to_the_byte(ranks_of(values, _sequence(options)), values, options, 2, True)
    assert where == "the head's backward (its input gradient's reduce-scatter)"
    for case in range(len(LLAMA_CASES)):
        if case not in DEEP_ROWS["LLAMA_CASES"]:
            llama_stages(staged_ranks[len(CASES) + case], case)
    a_batch_of_one(staged_ranks[-1])
    formula.against_the_engines([rank[-len(formula.JOBS):] for rank in everything], measured, CASES)
    checkpointed.against_dtensor([rank[mine:mine + len(checkpointed.JOBS)] for rank in everything])
    staged.against_the_engines([rank[at:at + len(staged.JOBS)] for rank in everything])
    selective.against_the_engines([rank[chosen:chosen + len(selective.JOBS)] for rank in everything])


#: Replayed rows whose checks run under ``-m deep`` only (test_the_deep_rows_against_their_stored_runs; the
#: default suite's line coverage, docs/testing.md "Stop 42: gloo42"): each runs no line of symmem or the tests the
#: kept rows do not -- GPT-2 under 1F1B M = 4 and GPipe with the loss ``sum`` (GPipe M = 1 and M = 4 kept, 1F1B's
#: replay run by this spawn's other files' checks), Llama under 1F1B with the loss ``sum`` (Llama GPipe live),
#: sequence parallelism's parts with eager attention (SEQUENCE[1], SDPA with two layers, kept)
DEEP_ROWS = {"CASES": (2, 3), "LLAMA_CASES": (1,), "SEQUENCE": (0,)}


@pytest.mark.deep
def test_the_deep_rows_against_their_stored_runs():
    """:data:`DEEP_ROWS`, each against its stored real ranks (tests/tensor_stored.py) through test_against_the_engines'
    checks."""
    from tests.tensor_stored import stage_key, stored

    staged = [stored("stages", *stage_key(2, *job[1:])) for job in STAGES[2]]
    measured = [[staged[case][rank] for case in range(len(CASES))] for rank in (0, 1)]
    for case in DEEP_ROWS["CASES"]:
        every_stage_to_the_byte(measured, case)
        every_view_names_the_largest_stage(measured, case)
    for case in DEEP_ROWS["LLAMA_CASES"]:
        llama_stages(staged[len(CASES) + case], case)
    for case in DEEP_ROWS["SEQUENCE"]:
        sequence_parallel_rank_to_the_byte(_stored(2, *SEQUENCE[case]), case)


#: a batch of one: GPT-2's shifted labels' contiguous() is a view at B = 1 and a copy from 2, so its stages' bytes
#: are not one line in B from B = 1 (the peak at B = 1 is its own, the lines' domain B >= 2); SDPA, as eager
#: attention at B = 1 lies outside the pytorch convention's domain
ONE = ("gpipe", 2, "cross-entropy")


def a_batch_of_one(real):
    d = _derived(*ONE, values={**SIZES, "B": 1, "F": 128}, **{**OPTIONS, "attention": "sdpa"})
    out = d.to_dict()["values"]
    assert out["peak_per_stage"] == [r.peak for r in real]
    assert out["peak_first_step_per_stage"] == [r.first_peak for r in real]
    # from B = 2 the lines, which do not hold at B = 1
    two = _derived(*ONE)
    assert sympy.Ge(sympy.Symbol("B", positive=True, integer=True), 2) in two._peak().domain


def _plan(schedule: str, m: int, loss: str):
    from symmem.api import pipeline_stages

    return pipeline_stages("gpt2", schedule=schedule, micro_batches=m, loss=loss, values={**SIZES, "F": 128, "p": 2},
                           **OPTIONS)


def every_stage_to_the_byte(measured, case):
    schedule, m, loss = CASES[case]
    plan = _plan(schedule, m, loss)
    for rank, memory in enumerate(plan.shown()):
        real = measured[rank][case]
        ours = memory.at(plan.numbers)
        peak = plan.peaks[rank]
        assert (peak.bytes, peak.pipeline, peak.step) == (real.peak, real.pipeline_peak, real.step_peak), (
            CASES[case], rank)
        # the first step: its schedule without optimizer state, AdamW making it in the step (static shapes)
        assert (peak.first, peak.pipeline - ours["optimizer_state"], peak.step) == (
            real.first_peak, real.first_pipeline_peak, real.first_step_peak), (CASES[case], rank)
        assert ours["parameters"] == real.parameters
        assert ours["saved"] == real.saved  # the most saved activations alive at once: in flight x one's
        start = dict(real.start)
        assert ours["at_rest"] == sum(start.values())
        assert (ours["parameters"], ours["optimizer_state"], ours["buffers"], ours["inputs"], ours["outputs"]) == (
            start.get("parameter", 0), start.get("optimizer_state", 0), start.get("buffer", 0),
            start.get("input", 0), start.get("output", 0))
        assert peak.phase == ("step" if real.peak_at[0] == "step" else "pipeline")


def _derived(schedule: str, m: int, loss: str, model: str = "gpt2", values=None, **options):
    from symmem import derive

    values = values or {**SIZES, "F": 128}
    return derive(model, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, loss=loss,
                  values={**values, "p": 2}, **(options or OPTIONS))


def every_view_names_the_largest_stage(measured, case):
    """``derive --pipeline-parallel``: values.peak is the largest rank's steady-step peak the engine reached, with
    that rank named, and every rank's in values.peak_per_stage, the table and Jupyter."""
    schedule, m, loss = CASES[case]
    real = [measured[rank][case].peak for rank in (0, 1)]
    d = _derived(schedule, m, loss)
    out = d.to_dict()
    assert out["values"]["peak_per_stage"] == real and out["values"]["peak"] == max(real)
    assert out["peak_at"]["stage"] == real.index(max(real))
    assert d.peak_at().where(step=False).startswith(f"stage {real.index(max(real))} of 2: ")
    text = d.table() if case else str(d)
    assert "peak per stage" in str(d) and "at stage" in text
    assert "peak per stage" in d._repr_html_()
    # the first step: no optimizer state yet during its pipeline phase; its largest stage's peak, every stage's
    first = [measured[rank][case].first_peak for rank in (0, 1)]
    assert out["values"]["peak_first_step_per_stage"] == first and out["values"]["peak_first_step"] == max(first)
    assert d.value("peak_first_step") == max(first)
    each = ", ".join(f"{i}: {v / 2**20:.2f}" for i, v in enumerate(first))
    assert any(line.startswith("first step") and line.endswith(each) for line in str(d).splitlines())
    assert "; first step: 0: " in d._repr_html_()


def what_the_engine_holds(measured):
    """The engine's own memory, as numbers a reader can check by hand at these sizes: the stage boundary is
    B*S*H*4 = 8192 bytes, the logits B*S*V*4 = 16384."""
    gpipe = {r: measured[r][1] for r in (0, 1)}  # GPipe, M = 4
    assert dict(gpipe[0].start)["buffer"] == 4 * 8192  # a gradient receive buffer per micro-batch
    assert dict(gpipe[1].start)["buffer"] == 4 * 8192  # an activation receive buffer per micro-batch
    assert dict(gpipe[1].start)["output"] == 4 * 16384  # every micro-batch's logits, kept past the step
    # Adam's step count: 4 bytes per parameter tensor (2 + 12 on the first stage, 12 + 3 on the last)
    assert dict(gpipe[0].start)["optimizer_state"] == 2 * 190080 + 4 * 14
    assert dict(gpipe[1].start)["optimizer_state"] == 2 * 59264 + 4 * 15
    # GPipe's first stage holds all M micro-batches, 1F1B's min(p, M) = 2; the last stage one under 1F1B
    assert gpipe[0].saved == 4 * measured[0][0].saved
    assert measured[0][2].saved == 2 * measured[0][0].saved
    assert measured[1][2].saved == measured[1][0].saved


def test_the_papers_stage_is_not_the_engines():
    """Korthikanti's and Narayanan's first stage holds the embedding, the head and p micro-batches; the engine's
    first stage has no head, and its last stage keeps the logits (derive's pipeline term vs the stages)."""
    plan = _plan("1f1b", 4, "cross-entropy")
    first, _, last = plan.stages
    values = first.at(plan.numbers)
    assert values["in_flight"] == 2 and last.at(plan.numbers)["in_flight"] == 1
    assert last.at(plan.numbers)["outputs"] == 4 * 2 * 32 * 64 * 4


@pytest.mark.parametrize("kwargs, message", [
    ({"schedule": "1f1b", "micro_batches": 1}, "the 1F1B schedule needs at least as many micro-batches as stages"),
    ({"schedule": "gpipe", "values": {"p": 5}}, "p=5 pipeline stages do not divide the L=12 layers"),
    ({"schedule": "gpipe", "values": {"p": 1}}, "pipeline parallelism needs p >= 2 stages"),
    ({"schedule": "zero-bubble"}, "unknown pipeline schedule 'zero-bubble'"),
    ({"schedule": "gpipe", "micro_batches": 0}, "micro_batches must be a positive integer"),
    ({"schedule": "gpipe", "precision": "mixed"}, "pipeline stages are modelled for FP32, with full, every-K or "
                                                   "selective checkpointing"),
    # full, every-K and Llama's selective are modelled (tests/test_pipeline_checkpoint.py, test_selective_stages.py)
    ({"schedule": "gpipe", "checkpoint": "selective", "attention": "naive"},
     "selective recomputation on pipeline stages is modelled where the checkpointed cores are called with graph "
     "nodes only"),
    ({"schedule": "gpipe", "optimizer": "sgd"}, "pipeline stages model the Adam/AdamW step; got sgd"),
])
def test_bad_input(kwargs, message):
    from symmem.api import pipeline_stages

    with pytest.raises(SymmemError, match=message.replace("(", r"\(")):
        pipeline_stages("gpt2", **kwargs)


def test_stages_need_one_block():
    from symmem.api import pipeline_stages

    with pytest.raises(SymmemError, match="pipeline stages split one repeated block of layers; mlp has 0"):
        pipeline_stages("mlp", schedule="gpipe")


def test_regime_schedule():
    from symmem.training import Regime

    assert Regime(pipeline_parallel=True, pipeline_schedule="gpipe").pipeline_schedule == "gpipe"
    with pytest.raises(SymmemError, match="pipeline schedule 'gpipe' needs pipeline parallelism"):
        Regime(pipeline_schedule="gpipe")
    with pytest.raises(SymmemError, match="unknown pipeline schedule"):
        Regime(pipeline_parallel=True, pipeline_schedule="interleaved")


def test_cli(capsys):
    from symmem.cli import main

    sets = [a for k, v in {**SIZES, "F": 128, "p": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["stages", "gpt2", "--pipeline-parallel", "--micro-batches", "4", "--loss", "cross-entropy",
                 "--attention", "naive", "--dropout", "0", "--device", "cpu", *sets]) == 0
    out = capsys.readouterr().out
    assert "pipeline stages (1f1b, M=4, p=2)" in out
    assert "peak per device: 1,379,384 bytes, stage 0 of 2 at h.mlp.gelu.out of layer 1, micro-batch 1" in out
    assert main(["stages", "gpt2", "--set", "p=2"]) == 2
    assert capsys.readouterr().err.startswith("symmem: error: symmem stages splits the model into pipeline stages")
    # derive keeps the papers' accounting under --pipeline-parallel, with the schedule named
    assert main(["derive", "gpt2", "--pipeline-parallel", "gpipe", "--convention", "megatron"]) == 0


def tensor_parallel_rank_to_the_byte(everything, case):
    """Each rank's saved activations (a DTensor's local shard), parameters, gradients and Adam state."""
    from symmem import derive
    from symmem.api import tensor_parallel_rank

    values, options = TENSOR[case]
    ours = tensor_parallel_rank("llama", values=values, device="cpu", **options).at({**values, "t": 2})
    for real in everything:  # this case's ranks
        assert (ours["saved"], ours["parameters"], ours["gradients"], ours["optimizer_state"]) == (
            real.saved, real.parameters, real.gradients, real.optimizer_state)
    # Megatron-LM's accounting (derive --tensor-parallel) keeps the query after its rotary embedding (SDPA's; eager
    # attention's scores matmul keeps a copy of it, which it splits with the scores), the keys and values the
    # attention keeps (repeated to h heads by eager attention, the cache's copies by SDPA) and the SiLU output whole
    # on every rank; DTensor splits them: B*S*(3H + F)*4 bytes a layer (eager: B*S*(2H + F)*4), half on each rank
    papers = derive("llama", tensor_parallel=True, values={**values, "t": 2}, device="cpu", **options)
    v, whole = values, 2 if options["attention"] == "naive" else 3
    assert papers.value("activations") - ours["saved"] == v["B"] * v["S"] * (whole * v["H"] + v["F"]) * 4 * v["L"] // 2
    # and the embedding's gradient comes back whole (V x H) while its weight is split
    assert ours["gradients"] - ours["parameters"] == 4 * v["V"] * v["H"] // 2


def sequence_parallel_rank_to_the_byte(everything, case):
    """With sequence parallelism the hidden stream is split over S, but each column-parallel linear keeps its
    all-gathered input whole: Korthikanti's accounting (derive --sequence-parallel) splits it."""
    from symmem import derive
    from symmem.api import tensor_parallel_rank

    values, options = SEQUENCE[case]
    ours = tensor_parallel_rank("llama", values=values, device="cpu", **options).at({**values, "t": 2})
    for real in everything:  # this case's ranks
        assert (ours["saved"], ours["parameters"], ours["gradients"], ours["optimizer_state"]) == (
            real.saved, real.parameters, real.gradients, real.optimizer_state)
    papers = derive("llama", tensor_parallel=True, values={**values, "t": 2}, device="cpu", **options)
    assert papers.value("activations") < ours["saved"]
    # its step's peak is given (each rank's, checked against DTensor in test_sequence_parallel_peak_against_dtensor)
    out = papers.to_dict()
    assert "peak_refused" not in out and out["values"]["peak"] == papers.value("peak") > 0


def llama_stages(ranks, case):
    """Llama's stages each make the rotary tables (and eager attention's mask) for their micro-batches, and hold
    the rotary frequencies.  Exact, the last stage's peak under the cross-entropy included: nll_loss's backward
    frees the shifted labels' copy and the total weight (B*S*8 + 4 bytes) before log_softmax's backward
    allocates (two events of the single-device step)."""
    from symmem.api import pipeline_stages

    schedule, m, loss, options = LLAMA_CASES[case]
    plan = pipeline_stages("llama", schedule=schedule, micro_batches=m, loss=loss, values={**LLAMA, "p": 2},
                           device="cpu", **options)
    for rank, memory in enumerate(plan.shown()):
        real = ranks[rank]
        ours, peak = memory.at(plan.numbers), plan.peaks[rank]
        assert (ours["saved"], ours["parameters"], ours["at_rest"], peak.step) == (
            real.saved, real.parameters, sum(dict(real.start).values()), real.step_peak)
        assert (peak.bytes, peak.pipeline) == (real.peak, real.pipeline_peak)
        assert (peak.first, peak.pipeline - ours["optimizer_state"], peak.step) == (
            real.first_peak, real.first_pipeline_peak, real.first_step_peak)
    # derive's views give the same stages
    d = _derived(schedule, m, loss, "llama", LLAMA, device="cpu", **options)
    out = d.to_dict()["values"]
    assert out["peak_per_stage"] == [x.bytes for x in plan.peaks]
    assert out["peak_first_step_per_stage"] == [x.first for x in plan.peaks]
    assert d.value("peak_first_step") == max(r.first_peak for r in ranks)


#: Four stages, each case's first step measured: GPT-2's 1F1B (stage 0's first step peaks in the optimizer step,
#: below a steady pipeline moment), GPipe without static shapes (the engine's shape inference runs in the first
#: step), Llama's 1F1B with the loss ``sum`` (the last stage's first step peaks in the optimizer step)
FOUR_STAGES = [("gpt2", {"B": 2, "S": 16, "H": 32, "h": 2, "L": 4, "V": 64}, ("1f1b", 4, "cross-entropy", {}, True)),
               ("gpt2", {"B": 2, "S": 16, "H": 32, "h": 2, "L": 4, "V": 64}, ("gpipe", 2, "cross-entropy", {}, False)),
               ("llama", {**LLAMA, "L": 4}, ("1f1b", 4, "sum", {"attention": "naive"}, True))]


def test_first_step_on_four_stages():
    """Every stage's first and steady step, to the byte, against four gloo ranks: the first step holds no optimizer
    state in its schedule, and AdamW makes all of it in ``_init_group`` before the first update, so its optimizer
    step is the steady one's -- which can be the first step's peak where a pipeline moment is the steady one's."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.api import pipeline_stages
    from symmem.record.model_parallel_runs import runs

    # FOUR_STAGES[1] live (GPipe without static shapes), the other two replayed from their stored real ranks
    staged_ranks = _stages(4, runs(4, [job for job in STAGES[4] if job in LIVE_STAGES]))
    for k, (model, values, (schedule, m, loss, options, _)) in enumerate(FOUR_STAGES):
        extra = {**OPTIONS, "values": {**values, "F": 128, "p": 4}} if model == "gpt2" else {
            **options, "device": "cpu", "values": {**values, "p": 4}}
        plan = pipeline_stages(model, schedule=schedule, micro_batches=m, loss=loss, **extra)
        real = staged_ranks[k]
        assert [(x.bytes, x.first, x.pipeline, x.step) for x in plan.peaks] == [
            (r.peak, r.first_peak, r.pipeline_peak, r.step_peak) for r in real], FOUR_STAGES[k]
        assert [r.first_step_peak for r in real] == [r.step_peak for r in real]  # the same optimizer step
        assert "first-step peak of each stage: 0: " in plan.table()
    # where the first step's peak is the optimizer step while the steady one's is in the schedule
    assert staged_ranks[0][0].first_peak == staged_ranks[0][0].step_peak < staged_ranks[0][0].pipeline_peak
    assert staged_ranks[2][3].first_peak == staged_ranks[2][3].step_peak < staged_ranks[2][3].pipeline_peak


def test_ranks_cli_and_refusals(capsys):
    from symmem.api import tensor_parallel_rank
    from symmem.cli import main

    values, options = TENSOR[0]
    sets = [a for k, v in {**values, "t": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["ranks", "llama", "--tensor-parallel", "--attention", "naive", "--device", "cpu", *sets]) == 0
    out = capsys.readouterr().out
    assert "saved                      32,448" in out and "gradients                  31,104" in out
    assert main(["ranks", "llama", "--set", "t=2"]) == 2
    assert "add --tensor-parallel" in capsys.readouterr().err
    with pytest.raises(SymmemError, match="t=3 does not divide h=4"):
        tensor_parallel_rank("llama", values=values, device="cpu").at({**values, "t": 3})
    with pytest.raises(SymmemError, match="the standard tensor-parallel plan is Llama's"):
        tensor_parallel_rank("gpt2")


def test_fit_solves_the_micro_batch_with_the_largest_stage():
    """``fit --pipeline-parallel``: the largest B (one micro-batch) whose largest stage's peak fits: the stages
    replayed at that B fit, at B + 1 one does not (each stage's replay is the one checked against the engine)."""
    from symmem.api import pipeline_stages
    from symmem.apps.budget import largest

    d = _derived("1f1b", 4, "cross-entropy")
    budget = 6 * 2**20
    fit = largest(d, "B", budget)
    at = [pipeline_stages("gpt2", schedule="1f1b", micro_batches=4, loss="cross-entropy",
                          values={**SIZES, "F": 128, "p": 2, "B": b}, **OPTIONS).peak().bytes
          for b in (fit.max, fit.max + 1)]
    assert at[0] <= budget < at[1] and (fit.total_at_max, fit.total_above) == tuple(at)
    # S is a number in the replayed peak: refused, not answered with a formula blind to S
    with pytest.raises(SymmemError, match=r"the peak here is a formula in B, .*\(Eq\(S, 32\)\): S cannot be"):
        largest(d, "S", budget)
    # another S replays the stages there
    assert d.at(S=16).value("peak") == pipeline_stages(
        "gpt2", schedule="1f1b", micro_batches=4, loss="cross-entropy",
        values={**SIZES, "S": 16, "F": 128, "p": 2}, **OPTIONS).peak().bytes


def test_fit_cli_under_pipeline_parallel(capsys):
    from symmem.cli import main

    sets = [a for k, v in {**SIZES, "F": 128, "L": 4, "p": 4}.items() for a in ("--set", f"{k}={v}")]
    assert main(["fit", "gpt2", "--pipeline-parallel", "--micro-batches", "8", "--budget", "80MiB", "--device", "cpu",
                 "--attention", "naive", *sets]) == 0
    out = capsys.readouterr().out
    assert out.startswith("gpt2 (pytorch): largest B = ")
    assert main(["derive", "gpt2", "--pipeline-parallel", "--micro-batches", "2", "--device", "cpu", *sets]) == 0
    out = capsys.readouterr().out
    assert "no peak: the 1F1B schedule needs at least as many micro-batches as stages" in out


def test_the_cross_entropy_backward_is_two_nodes_on_one_device():
    """A real single-device step whose peak is the loss's backward (a vocabulary large beside the model):
    NllLossBackward0 releases the target's copy and total_weight before LogSoftmaxBackward0 makes the logits'
    gradient; symmem's step has them as two events, to the byte (it had B*S*8 + 4 bytes too many)."""
    from symmem import derive
    from symmem.record.verify import verify_peak

    values = {"B": 4, "S": 32, "H": 32, "h": 2, "L": 2, "V": 4096, "F": 128}
    d = derive("gpt2", values=values, loss="cross-entropy", **OPTIONS)
    real = verify_peak(d)
    assert (d.value("peak"), d.value("peak_first_step")) == (real.measured, real.measured_first) == (
        9_586_552, 8_071_944)
    assert real.measured_where == "LogSoftmaxBackward0" and d.peak_at().where() == "backward loss, steady step"


def tensor_parallel_peak_to_the_byte(real, values, options, world, views=False):
    """derive --tensor-parallel [--sequence-parallel]: values.peak and peak_first_step are every rank's measured
    step peaks (DTensor's local ops recorded, each moment at its fewest bytes over the repeated steps), with rank 0
    named (with ``views``, the live cases: in the JSON and the table too, which print every formula); the formula is
    in B, S and t."""
    from symmem import derive

    d = derive("llama", tensor_parallel=True, values={**values, "t": world}, device="cpu", **options)
    assert real and all(rank.steady_peak for rank in real)
    assert [rank.late for rank in real] == [()] * len(real)  # every recorded free on the recording thread
    for rank in real:
        assert (d.value("peak"), d.value("peak_first_step")) == (rank.steady_peak, rank.first_peak), (
            options, rank.rank, rank.peaks)
    assert d.step.per_rank(d.numbers)["peak_rank"] == 0
    if views:
        out = d.to_dict()
        assert out["values"]["peak"] == real[0].steady_peak and out["peak_at"]["rank"] == 0
        assert f"rank 0 of {world} (every rank alike)" in str(d)
    assert {"B", "S", "t"} <= {s.name for s in d.peak.free_symbols}
    return d.peak_at().where(step=False)


#: Four ranks (the heads, the key/value heads, the MLP width and the vocabulary split four ways), SDPA with a wide
#: MLP: the peak in the layers' backward, each of its parts a quarter (the two-rank cases cover the other moments)
FOUR = [({"B": 2, "S": 32, "H": 32, "h": 8, "G": 8, "L": 2, "V": 16, "F": 1024}, {"attention": "sdpa"})]


def tensor_parallel_peak_on_four_ranks(everything):
    """FOUR's ranks (run in test_sequence_parallel_peak_against_dtensor's four-rank spawn) against derive."""
    where = [tensor_parallel_peak_to_the_byte([rank[case] for rank in everything], values, options, 4)
             for case, (values, options) in enumerate(FOUR)]
    assert where == ["rank 0 of 4 (every rank alike): backward layers.mlp.gate_up (layer 2)"]


def test_tensor_parallel_peak_refusals(capsys):
    """Where the tensor-parallel peak was not measured, every view says why in one line."""
    from symmem import derive
    from symmem.cli import main

    values = {**TENSOR[0][0], "t": 2}
    for kwargs, why in [({"device": "cuda"}, "the tensor-parallel peak is measured on CPU ranks (gloo)"),
                        ({"device": "cpu", "loss": "cross-entropy"}, "modelled for the loss 'sum'"),
                        ({"device": "cpu", "precision": "mixed"}, "modelled for FP32 Adam/AdamW")]:
        out = derive("llama", tensor_parallel=True, values=values, **kwargs).to_dict()
        assert out["values"]["peak"] is None and why in out["peak_refused"], kwargs
    assert main(["derive", "gpt2", "--tensor-parallel"]) == 0
    assert "no peak: the tensor-parallel peak follows DTensor's standard plan, which is Llama's; not gpt2" in (
        capsys.readouterr().out)
    # FSDP x TP: modelled on CPU ranks (tests/test_fsdp_tensor.py), refused on CUDA as the tensor-parallel peak is
    assert main(["derive", "llama", "--data-parallel", "fsdp", "--tensor-parallel"]) == 0
    assert "no peak: the FSDP x TP peak is measured on CPU ranks (gloo)" in capsys.readouterr().out
    # t must split the vocabulary evenly too (the heads and the MLP width: derive's own check)
    out = derive("llama", tensor_parallel=True, values={**values, "V": 63}, device="cpu").to_dict()
    assert out["peak_refused"].startswith("no peak: t=2 does not divide V=63: DTensor's plan splits the heads")
    sets = [a for k, v in values.items() for a in ("--set", f"{k}={v}")]
    odd = [a for k, v in {**values, "F": 65}.items() for a in ("--set", f"{k}={v}")]
    assert main(["ranks", "llama", "--tensor-parallel", "--device", "cpu", *odd]) == 2
    assert "needs t to divide F (Mod(F, t) = 0), which fails at F=65, t=2" in capsys.readouterr().err
    # symmem ranks ends with the peak derive gives (the value checked against the engine above)
    assert main(["ranks", "llama", "--tensor-parallel", "--attention", "naive", "--device", "cpu", *sets]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == (
        "peak per rank: 126,992 bytes at rank 0 of 2 (every rank alike): forward's end (the head's all-gather); "
        "first step 124,624")


def test_fit_under_tensor_parallel():
    """``fit --tensor-parallel``: the largest B whose rank's peak fits, the step at that B and at B + 1 worked out
    anew (the layers' moments walked at each B, where the largest op may differ) on each side of the budget."""
    from symmem import derive
    from symmem.apps.budget import largest

    values, options = PEAKS[1]
    d = derive("llama", tensor_parallel=True, values={**values, "t": 2}, device="cpu", **options)
    budget = 4 * 2**20
    fit = largest(d, "B", budget)
    at = [derive("llama", tensor_parallel=True, values={**values, "B": b, "t": 2}, device="cpu", **options)
          .value("peak") for b in (fit.max, fit.max + 1)]
    assert at[0] <= budget < at[1] and (fit.total_at_max, fit.total_above) == tuple(at)


def test_fit_under_sequence_parallel_reaches_b_1():
    """``fit --sequence-parallel``: B = 1 is inside the formulas' domain (its peak is checked against DTensor in
    test_batch_of_one_against_dtensor): a budget between B = 1's peak and B = 2's answers B = 1, one below B = 1's
    says nothing fits, quoting B = 1's peak (a fresh derive there)."""
    from symmem import derive
    from symmem.apps.budget import largest

    values = {"B": 2, "S": 32, "H": 64, "h": 4, "G": 2, "L": 2, "V": 64, "F": 256, "t": 2}
    d = derive("llama", tensor_parallel=True, sequence_parallel=True, values=values, device="cpu")
    one = derive("llama", tensor_parallel=True, sequence_parallel=True, values={**values, "B": 1}, device="cpu")
    fit = largest(d, "B", d.value("peak") - 1)
    assert (fit.max, fit.total_at_max, fit.total_above) == (1, one.value("peak"), d.value("peak"))
    with pytest.raises(SymmemError) as e:
        largest(d, "B", one.value("peak") - 1)
    assert f"needs 1.107 MiB ({one.value('peak'):,} B) at B = 1 (peak)" in str(e.value)


#: Sequence parallelism (torchtitan's plan), small steps whose peak is each somewhere else -- on two ranks: the
#: head's backward (its input gradient's reduce-scatter), the MLP's down projection's backward (its output gradient
#: all-gathered), the forward's end, the MLP's backward; on four: the head's input all-gather (eager attention), and
#: at B = 1 the forward's end (the all-gathers' second copies, the cache's key and value: see BATCH_OF_ONE)
SEQUENCE_PEAKS = {2: [({"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 32}, {"attention": "sdpa"}),
                      ({"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 64}, {"attention": "naive"}),
                      ({"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 32}, {"attention": "sdpa"}),
                      ({"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 256}, {"attention": "sdpa"})],
                  4: [({"B": 2, "S": 64, "H": 64, "h": 8, "G": 4, "L": 1, "V": 16, "F": 32}, {"attention": "naive"}),
                      ({"B": 1, "S": 64, "H": 64, "h": 8, "G": 4, "L": 1, "V": 16, "F": 32}, {"attention": "naive"})]}


def test_sequence_parallel_peak_against_dtensor():
    """derive --tensor-parallel --sequence-parallel: every rank's first and steady step peak equals the real
    DTensor run's (gloo, worlds 2 and 4, the recorder that sees DTensor's local ops), to the byte, in every view;
    the walk models the all-gathers over S, the reduce-scatters and what eager attention holds.  Live: the first
    four-rank case here (with FOUR's tensor-parallel peak on four ranks replayed beside it); on two ranks
    test_batch_of_one_against_dtensor's BATCH_OF_ONE[1]; the rest replayed from their stored real ranks
    (tests/tensor_stored.py; ``-m deep`` measures them anew)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.record.model_parallel_runs import runs
    from tests.tensor_stored import differences

    values, options = SEQUENCE_PEAKS[4][0]
    live = [rank[0] for rank in runs(4, [("tensor", "llama", values, _sequence(options))])]
    assert differences("tensor", 4, values, _sequence(options), live) == []
    tensor_parallel_peak_on_four_ranks([[r] for r in _stored(4, *FOUR_JOBS[0])])
    where = []
    for world, cases in SEQUENCE_PEAKS.items():
        for case, (values, options) in enumerate(cases):
            real = live if (world, case) == (4, 0) else _stored(world, values, _sequence(options))
            where.append(sequence_parallel_peak_to_the_byte(real, values, options, world))
    assert where == ["the head's backward (its input gradient's reduce-scatter)",
                     "backward layers.mlp.down_proj (layer 1)", "forward's end (the head's all-gather)",
                     "backward layers.mlp.gate_up (layer 1)", "forward layers.mlp.down_proj (layer 1)",
                     "forward layers.mlp.down_proj (layer 1)"]


def sequence_parallel_peak_to_the_byte(real, values, options, world, views=False):
    """One sequence-parallel case's ranks (``real``) against derive: every rank's first and steady peak, rank 0
    named (with ``views``: in the JSON and the table too); where the peak is."""
    from symmem import derive

    d = derive("llama", tensor_parallel=True, sequence_parallel=True, values={**values, "t": world},
               device="cpu", **options)
    for rank in real:
        assert (d.value("peak"), d.value("peak_first_step"), rank.late) == (
            rank.steady_peak, rank.first_peak, ()), (world, values, rank.rank, rank.peaks)
    assert d.step.per_rank(d.numbers)["peak_rank"] == 0
    if views:
        out = d.to_dict()
        assert out["values"]["peak"] == real[0].steady_peak and out["peak_at"]["rank"] == 0
        assert f"rank 0 of {world} (every rank alike)" in str(d)
    return d.peak_at().where(step=False).split(": ", 1)[1]


#: B = 1 on two ranks, where funcol's all-gather over S is a view (no concatenation): the asynchronous all-gathers
#: (gate's, up's, the head's) keep the collective's output and funcol's wrapper, two copies where B >= 2 keeps one;
#: eager attention with one key/value head a rank (G = t) keeps the cache's key and value, not the repeated copies
#: (bmm folds a batch of 1 with the stride-0 repeat).  Each peaks elsewhere: the MLP's backward (SDPA), the
#: forward's end (eager, both effects), the softmax's backward (tensor parallel alone, eager, a long sequence); four
#: ranks at B = 1: SEQUENCE_PEAKS
BATCH_OF_ONE = [({"B": 1, "S": 64, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 256},
                 {"attention": "sdpa", "sequence_parallel": True}),
                ({"B": 1, "S": 64, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 64},
                 {"attention": "naive", "sequence_parallel": True}),
                ({"B": 1, "S": 128, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 32}, {"attention": "naive"})]


@functools.cache
def _gloo_two_ranks():
    """The live jobs of test_batch_of_one_against_dtensor (BATCH_OF_ONE[1]) and test_hf_llama_under_the_standard_plan
    (tests/hf_tensor_runs.py's HF[LIVE]) in ONE spawn of two ranks (both tests on the gloo worker; whichever runs
    first pays it): per job, its two ranks' TensorRuns.  One spawn, not two: each fresh rank spends ~1 CPU-s on
    DTensor's first sharding propagations and its start, paid once here."""
    import transformers.models.llama.modeling_llama  # noqa: F401 - imported once: the forked ranks inherit it

    from symmem.record.model_parallel_runs import runs
    from tests.hf_tensor_runs import LIVE, job

    values, options = BATCH_OF_ONE[1]
    found = runs(2, [("tensor", "llama", values, {**options, "peaks": True}), ("tensor", "llama", *job(LIVE))])
    return [[rank[k] for rank in found] for k in range(2)]


@pytest.mark.xdist_group("gloo")  # one test worker runs the gloo tests in turn
def test_batch_of_one_against_dtensor():
    """derive --tensor-parallel [--sequence-parallel] at B = 1: every rank's first and steady step peak equals the
    real DTensor run's (gloo, two ranks), to the byte; fit reaches B = 1 with the measured peak."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem import derive
    from symmem.api import tensor_parallel_rank
    from symmem.apps.budget import largest
    from tests.tensor_stored import differences

    # live: the eager case with sequence parallelism (both of B = 1's effects; fit below); the rest replayed
    values, options = BATCH_OF_ONE[1]
    live = _gloo_two_ranks()[0]
    assert differences("tensor", 2, values, {**options, "peaks": True}, live) == []
    everything = list(zip(*[live if case == 1 else _stored(2, values, {**options, "peaks": True})
                            for case, (values, options) in enumerate(BATCH_OF_ONE)], strict=True))
    # each rank's saved activations, parameter side and Adam state: at B = 1 eager attention with one key/value
    # head a rank keeps the cache's key and value, not the repeated copies (S·(H/h)·(h - G)/t·4 bytes fewer each)
    for case, (values, options) in enumerate(BATCH_OF_ONE):
        ours = tensor_parallel_rank("llama", values=values, device="cpu", **options).at({**values, "t": 2})
        for rank in everything:
            real = rank[case]
            assert ours == {"saved": real.saved, "parameters": real.parameters, "gradients": real.gradients,
                            "optimizer_state": real.optimizer_state}, (case, real.rank)
    where = [tensor_parallel_peak_to_the_byte([rank[case] for rank in everything], values, options, 2,
                                              views=case == 1).split(": ")[1]  # BATCH_OF_ONE[1] live
             for case, (values, options) in enumerate(BATCH_OF_ONE)]
    assert where == ["backward layers.mlp.gate_up (layer 1)", "forward layers.mlp.down_proj (layer 1)",
                     "backward layers.self_attn.softmax (layer 1)"]
    # fit solving B from B = 2 lands on B = 1 with the engine's peak there (the formulas hold at B = 1)
    values, options = BATCH_OF_ONE[1]
    d = derive("llama", tensor_parallel=True, values={**values, "B": 2, "t": 2}, device="cpu", **options)
    fit = largest(d, "B", d.value("peak") - 1)
    assert (fit.max, fit.total_at_max) == (1, everything[0][1].steady_peak)


@pytest.mark.xdist_group("gloo")  # one test worker runs the gloo tests in turn
def test_hf_llama_under_the_standard_plan():
    """Third-party truth: transformers' LlamaForCausalLM parallelized with the standard plan on two gloo ranks
    (FP32 AdamW, loss ``sum``, the DTensor-aware recorder), every rank's first and steady peak equal to
    ``derive("llama", tensor_parallel=True)``'s to the byte, the forward's end and the final norm's forward
    included (the zoo's Llama holds what HF's forward holds: the position ids and eager attention's mask until
    ``LlamaModel.forward`` returns, the ``DynamicCache``'s copies until ``LlamaForCausalLM.forward`` returns)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    pytest.importorskip("transformers")
    from symmem import derive
    from tests.hf_tensor_runs import HF, LIVE
    from tests.tensor_stored import differences

    live = _gloo_two_ranks()[1]  # HF[LIVE], the standard plan; the others replayed from their stored real ranks
    values, options = HF[LIVE]
    assert differences("tensor", 2, values, {**options, "peaks": True, "hf": True}, live) == []
    everything = list(zip(*[live if case == LIVE else _stored(2, values, {**options, "peaks": True, "hf": True})
                            for case, (values, options) in enumerate(HF)], strict=True))
    where = []
    for case, (values, options) in enumerate(HF):
        d = derive("llama", tensor_parallel=True, values={**values, "t": 2}, device="cpu", **options)
        for rank in everything:
            assert (rank[case].steady_peak, rank[case].first_peak, rank[case].late) == (
                d.value("peak"), d.value("peak_first_step"), ()), (case, rank[case].rank)
            # HF's parameters: split, but for the norms' weights (H each, replicated)
            norms = values["H"] * (2 * values["L"] + 1)
            assert rank[case].parameters == 4 * (d.value("parameters") - norms) // 2 + 4 * norms
        where.append(d.peak_at().where(step=False).split(": ")[1])
    assert where == ["the final norm's backward", "forward's end (the head's all-gather)",
                     "forward's end (the head's all-gather)", "the final norm's forward (norm.scale)"]


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")  # one test worker runs the gloo tests in turn
def test_funcol_frees_on_the_recording_thread():
    """funcol's all-gather, reduce-scatter and all-reduce (DTensor's collectives), 300 of each on two gloo ranks
    under the recorder's FuncolRelease: no free runs on gloo's worker thread (without it 4, 0 and 26 of 2,400 did,
    measured; docs/testing.md, "Tensor parallelism: funcol's collectives")."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.record.collective_stress import FUNCOL_STRESSED, stress_funcol

    assert stress_funcol(2, 300, start_method="forkserver", timeout=600) == dict.fromkeys(FUNCOL_STRESSED, (0, 2400))


def _sequence(options):
    """A sequence-parallel case's job options (SEQUENCE_PEAKS')."""
    return {**options, "peaks": True, "sequence_parallel": True}


#: FOUR's job
FOUR_JOBS = [(values, {**options, "peaks": True}) for values, options in FOUR]
#: The two-rank tensor-parallel case run live in test_against_the_engines' spawn, held to its stored row too: tensor
#: parallelism (TENSOR[0]; its job measures the rank's parts as every job does, then its steps' peaks).  Sequence
#: parallelism's parts (SEQUENCE[0], live to stop 39) and its peak on two ranks (SEQUENCE_PEAKS[2][0], live to stop
#: 38) are replayed: the plan runs live at B = 1 (BATCH_OF_ONE[1]), checkpointed (test_tensor_checkpoint.JOBS, in the
#: same spawn), at B = 2 on four ranks (SEQUENCE_PEAKS[4][0]) and with SDPA on the FSDP x TP mesh
#: (test_fsdp_tensor.LIVE), each job measuring its rank's parts first
LIVE_TWO = [(TENSOR[0][0], {**TENSOR[0][1], "peaks": True})]
#: Every tensor-parallel case's job by world, as the spawns run it: each stored (tests/tensor_stored.py, written from
#: fresh runs of these; HF's in tests/hf_tensor_runs.py), the ones not live replayed
STORED = {2: [*[(v, {**o, "peaks": True}) for v, o in TENSOR], *SEQUENCE,
              *[(v, {**o, "peaks": True}) for v, o in PEAKS], *[(v, _sequence(o)) for v, o in SEQUENCE_PEAKS[2]],
              *[(v, {**o, "peaks": True}) for v, o in BATCH_OF_ONE]],
          4: [*[(v, _sequence(o)) for v, o in SEQUENCE_PEAKS[4]], *FOUR_JOBS]}


#: The pipeline jobs of this file by world, each stored (tests/tensor_stored.py, ``stages``: every field of each
#: rank's StageRun, written from fresh runs of these): GPT-2's CASES, Llama's LLAMA_CASES, GPT-2 at B = 1 (two
#: ranks) and FOUR_STAGES (four)
STAGES = {2: [*[("pipeline", "gpt2", SIZES, case) for case in CASES],
              *[("pipeline", "llama", LLAMA, case) for case in LLAMA_CASES],
              ("pipeline", "gpt2", {**SIZES, "B": 1}, (*ONE, {"attention": "sdpa"}))],
          4: [("pipeline", model, values, case) for model, values, case in FOUR_STAGES]}
#: Run live, each also held to its stored row: GPT-2 under GPipe (M = 4), Llama under GPipe (SDPA, cross-entropy;
#: Llama's 1F1B runs live in test_pipeline_checkpoint's and test_selective_stages' jobs in the same spawn, GPT-2's
#: 1F1B in test_pipeline_formula's, M = 3), four stages under GPipe without static shapes.  Replayed: GPT-2 GPipe
#: M = 1 and with the loss ``sum``, 1F1B M = 4 (live to stop 39), at B = 1, Llama 1F1B with the loss ``sum``, four
#: stages' GPT-2 and Llama 1F1B (``-m deep`` measures them anew)
LIVE_STAGES = [STAGES[2][1], STAGES[2][4], STAGES[4][1]]


def _stages(world, live):
    """Per job of ``STAGES[world]``, its ranks' runs: the live ones (``live``: per rank, the results of the live jobs
    in STAGES' order) each held to its stored row first, the others their stored rows."""
    from tests.tensor_stored import differences, stage_key, stored

    found, k = [], 0
    for job in STAGES[world]:
        name = stage_key(world, *job[1:])
        if job in LIVE_STAGES:
            ranks = [rank[k] for rank in live]
            k += 1
            assert differences("stages", *name, ranks) == []
        else:
            ranks = stored("stages", *name)
        found.append(ranks)
    assert k == len(live[0])
    return found


def _name(values, options):
    from tests.tensor_stored import key

    return key(0, values, options)


def _stored(world, values, options):
    from tests.tensor_stored import stored

    return stored("tensor", world, values, options)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")  # one test worker runs the gloo tests in turn
def test_every_stored_tensor_parallel_case_against_fresh_gloo_runs():
    """Every stored tensor-parallel case (two and four ranks, HF's and the FSDP x TP mesh's too) measured anew:
    each rank's bytes equal the stored row (tests/tensor_stored.py), which the default suite replays."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from tests.tensor_stored import _file, measure_all

    found = measure_all()
    stored = _file()
    for section, cases in found.items():
        assert cases == stored[section], section
