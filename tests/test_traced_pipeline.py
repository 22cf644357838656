"""Traced modules under pipeline parallelism (issue 19 item 2, "traced modules alike"): every stage's steady and
first-step peak, derived from the module's step recorded on fake tensors, cut by stage and replayed in the
schedule's order (symmem.importer.traced_pipeline), equals the live bytes measured in each rank of a real
``torch.distributed.pipelining`` run (ScheduleGPipe, Schedule1F1B) of the module's manual split on gloo, to the byte
-- the schedule's and the optimizer step's largest moments too.

One process group of two ranks runs every case (symmem.record.traced_pipeline_runs): a file module with a
ModuleList of 4 blocks (tests/data/traced_block.py; a variant with a weight tied across stages) and Hugging Face's
GPT-2 from a config (n_layer 4, untied head; tied at n_layer 2, each stage holding its own copy) and Hugging
Face's Llama (each stage making its own rotary tables, its own loss the schedule's loss_fn), Mistral (a
sliding-window mask made on every stage) and Qwen2 (q/k/v biases).  A parameter read on another stage than its module's
(traced_block.py:build_reads) is refused in one line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.pipelining")
pytest.importorskip("transformers")

from gloo_store import START  # noqa: E402

from symmem.cli import main  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.importer import sources  # noqa: E402
from symmem.importer.spec_builder import SpecBuilder  # noqa: E402

BLOCK = f"{Path(__file__).parent / 'data' / 'traced_block.py'}:build"
TIED = f"{BLOCK}_tied"  # one weight read before the blocks by two modules (one copy there) and by the head
GPT2 = {"n_layer": 4, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 64, "use_cache": False,
        "tie_word_embeddings": False}
#: Hugging Face Llama (SDPA, G = 1): two decoder layers a stage, each stage making its own position ids and rotary
#: tables (LlamaSplit runs LlamaModel.forward on every stage), the rotary frequencies a buffer of every stage
LLAMA = {"num_hidden_layers": 4, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
         "intermediate_size": 32, "vocab_size": 32, "tie_word_embeddings": False, "use_cache": False}
#: Mistral and Qwen2, the causal LMs built like Llama (LlamaSplit splits them alike), one decoder layer a stage:
#: Mistral with a sliding window shorter than S = 8 (every stage makes its own sliding-window mask, B x 1 x S x S),
#: Qwen2 with its q/k/v biases
MISTRAL = {**LLAMA, "num_hidden_layers": 2, "sliding_window": 4}
QWEN2 = {**LLAMA, "num_hidden_layers": 2}
#: (spec, config, schedule, M, loss): the file module at its example B = 4 (the optimizer step is the peak of some
#: stages, the schedule of others), GPT-2 at B = 2, S = 8; GPT-2 given labels (``output``: HF's own loss, which
#: the real run computes as the schedule's loss_fn, the model's loss_function on the last stage's logits); GPT-2
#: tied as transformers makes it by default (each stage's module holds its own copy: the embedding on stage 0, the
#: head on the last, each with its gradient and AdamW state, not synchronized), under 1F1B with its own loss, at
#: n_layer 2 (one block a stage; several blocks a stage: the file module's and Llama's; a record of ~2/3 of n_layer
#: 4's, stop 39)
CASES = [(BLOCK, (), "gpipe", 4, "cross-entropy"), (BLOCK, (), "1f1b", 2, "cross-entropy"),
         (BLOCK, (), "1f1b", 4, "sum"), ("hf:gpt2", tuple(sorted(GPT2.items())), "gpipe", 2, "output"),
         ("hf:gpt2", tuple(sorted({**GPT2, "n_layer": 2, "tie_word_embeddings": True}.items())), "1f1b", 2,
          "output"),
         (TIED, (), "gpipe", 2, "cross-entropy"), ("hf:llama", tuple(sorted(LLAMA.items())), "1f1b", 3, "output"),
         ("hf:mistral", tuple(sorted(MISTRAL.items())), "1f1b", 2, "output"),
         ("hf:qwen2", tuple(sorted(QWEN2.items())), "gpipe", 2, "sum")]
#: the cases of :data:`CASES` run in every suite run: the file module under both schedules (one trace) and 1F1B
#: M = 4 with the loss ``sum`` (a trace of ~0.5 CPU-s: the loss ``sum`` on stages), Hugging Face GPT-2 tied (1F1B,
#: given labels) and Llama (LlamaSplit).  The others under ``-m deep`` (docs/testing.md, "What is deep"), each a
#: trace of its own in the test's process: GPT-2 untied given labels (untied: tests/test_fsdp_pipeline.py's stored
#: Hugging Face GPT-2 under FSDP2; given labels: GPT-2 tied, Llama, Mistral), the file module's tied variant (a
#: weight tied across stages: GPT-2 tied's, each stage its own copy; its CLI peaks against its stored real ranks
#: on the 2 x 2 mesh: tests/test_fsdp_pipeline.py's test_a_traced_module_in_the_cli[tied]), Mistral and Qwen2
#: (LlamaSplit's stages as Llama's, each making its own rotary tables; Mistral's own sliding-window mask, Qwen2's
#: q/k/v biases; Qwen2 the loss ``sum`` on a Hugging Face model's stages and GPipe on LlamaSplit's: ~2 CPU-s of
#: trace and formula, stop 39)
LIVE = (0, 1, 2, 4, 6)
#: ``-m deep`` too: HF GPT-2 untied under GPipe and 1F1B with the loss ``sum`` -- GPT-2 under each schedule is in
#: CASES (given labels; 1F1B tied), a Hugging Face model's stages with the loss ``sum`` too (Qwen2, also deep)
DEEP_CASES = [("hf:gpt2", tuple(sorted(GPT2.items())), "gpipe", 2, "sum"),
              ("hf:gpt2", tuple(sorted(GPT2.items())), "1f1b", 2, "sum")]


@functools.cache
def _traced(spec, config, loss):
    own = loss == "output"  # hf: given labels (--loss cross-entropy), the model's own loss
    loaded = sources.load(spec, config=dict(config) or None, loss="cross-entropy" if own else None)
    dims = sources.parse_dims("B,S" if spec.startswith("hf:") else "B", loaded)
    return sources.trace(loaded, dims, optimizer="adamw", loss=loss, check=False, pipeline_parallel=True,
                         pipeline_schedule="gpipe", micro_batches=4, values={"p": 2})


def _derived(spec, config, schedule, m, loss):
    """The derivation under ``schedule`` with ``m`` micro-batches: one trace per module and loss, its recorded step
    shared (the schedule and M are the replay's)."""
    d = _traced(spec, config, loss)
    return dataclasses.replace(d, step=dataclasses.replace(d.step, schedule=schedule, micro_batches=m, _cache={}))


def _case(spec, config, schedule, m, loss):
    from symmem.record.traced_pipeline_runs import GPT2Split, LlamaSplit, SequentialSplit, TracedCase

    if spec in ("hf:llama", "hf:mistral", "hf:qwen2"):
        return TracedCase(SpecBuilder(spec, config), LlamaSplit(), schedule, m, loss, (2, 8, 32), (2, 8, 16))
    if spec.startswith("hf:"):
        return TracedCase(SpecBuilder(spec, config), GPT2Split(), schedule, m, loss, (2, 8, 64), (2, 8, 32))
    if spec == TIED:
        return TracedCase(SpecBuilder(spec), SequentialSplit(("inp", "mix", "mix2"), "blocks", ("head",)), schedule,
                          m, loss, (4, 24), (4, 24))
    return TracedCase(SpecBuilder(spec), SequentialSplit(("inp",), "blocks", ("head",)), schedule, m, loss, (4, 5),
                      (4, 24))


@pytest.mark.xdist_group("gloo")  # one test worker runs every gloo test (conftest.py)
def test_every_stage_of_a_traced_module_equals_real_pipelining_runs():
    real = _against_real_runs([CASES[k] for k in LIVE])
    import test_pipeline_formula_mesh as formula  # the stages' formulas from other sizes vs these ranks

    # per rank, each case of CASES at its place (the deep ones None: the formulas' cases are live)
    formula.traced_against_the_engines([[dict(zip(LIVE, rank, strict=True)).get(k) for k in range(len(CASES))]
                                        for rank in real], CASES, _derived)
    # both phases are somebody's peak: the optimizer step (1F1B, M = 2) and the schedule (GPipe, M = 4)
    assert real[0][1].peak == real[0][1].step_peak > real[0][1].pipeline_peak
    assert real[0][0].peak == real[0][0].pipeline_peak > real[0][0].step_peak


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_the_deep_cases_equal_real_pipelining_runs():
    """:data:`CASES` not in :data:`LIVE`, and :data:`DEEP_CASES`, in one spawn of two ranks; the formulas from other
    sizes of those of them test_pipeline_formula_mesh.TRACED_OTHER names (Qwen2's)."""
    deep = [k for k in range(len(CASES)) if k not in LIVE]
    real = _against_real_runs([CASES[k] for k in deep] + DEEP_CASES)
    import test_pipeline_formula_mesh as formula

    formula.traced_against_the_engines([[dict(zip(deep, rank, strict=False)).get(k) for k in range(len(CASES))]
                                        for rank in real], CASES, _derived)


def _against_real_runs(cases: list[tuple]) -> list[list]:
    """Every stage of every case against one real run of two ranks (each rank's runs, case by case)."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.record.traced_pipeline_runs import traced_pipeline_runs

    real = traced_pipeline_runs(2, [_case(*c) for c in cases], start_method=START)
    wrong = []
    for k, case in enumerate(cases):
        d = _derived(*case)
        each = d.step.per_stage(d.numbers)
        replays = d.step._replays(d.step._named(None))
        mine = [r.peak for r in replays]
        ranks = [rank[k] for rank in real]
        got = [(x.bytes, x.first, x.pipeline, x.step) for x in mine]
        want = [(r.peak, r.first_peak, r.pipeline_peak, r.step_peak) for r in ranks]
        if got != want:
            wrong.append(f"{case}: derived {got}, measured {want}")
        # each stage's parameter side, optimizer state and all it keeps between steps (weights, state, receive
        # buffers, its inputs, the last stage's logits): a tied parameter once on each stage holding it
        rest = [(r.at["parameters"], r.at["optimizer_state"], r.at["at_rest"]) for r in replays]
        kept = [(r.parameters, dict(r.start)["optimizer_state"], sum(v for _, v in r.start)) for r in ranks]
        if rest != kept:
            wrong.append(f"{case}: at rest derived {rest}, measured {kept}")
        # the views: the largest stage's steady and first-step peak (formulas in B, at its number), every stage's
        if (each["peak_per_stage"], each["peak_first_step_per_stage"]) != ([r.peak for r in ranks],
                                                                          [r.first_peak for r in ranks]):
            wrong.append(f"{case}: per stage {each}")
        if (d.value("peak"), d.value("peak_first_step")) != (max(r.peak for r in ranks),
                                                             max(r.first_peak for r in ranks)):
            wrong.append(f"{case}: peak {d.value('peak')}, first {d.value('peak_first_step')}")
    assert not wrong, "\n".join(wrong)
    return real


def test_views_name_the_stage_and_fit_solves_b(capsys):
    """The CLI's JSON gives every stage's peak and where; ``fit`` solves B with the largest stage's peak, checked
    against the replay at the B it gives and the next (the replay at numbers, not the formula's lines)."""
    base = [BLOCK, "--dims", "B", "--loss", "cross-entropy", "--optimizer", "adamw", "--pipeline-parallel", "gpipe",
            "--micro-batches", "4", "--set", "p=2"]
    assert main(["trace", *base, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = _derived(BLOCK, (), "gpipe", 4, "cross-entropy")
    assert out["values"]["peak_per_stage"] == d.step.per_stage(d.numbers)["peak_per_stage"]
    assert out["values"]["peak"] == max(out["values"]["peak_per_stage"]) and out["peak_at"]["stage"] == 0
    assert main(["fit", *base, "--budget", "1MiB"]) == 0
    text = capsys.readouterr().out
    b = int(text.split("largest B = ")[1].split()[0])
    at = {s: v for s, v in d.numbers.items() if s.name != "B"}
    fits = [max(d.step.per_stage({**at, next(s for s in d.numbers if s.name == "B"): x})["peak_per_stage"])
            for x in (b, b + 1)]
    assert fits[0] <= 2**20 < fits[1], (b, fits)


@pytest.mark.parametrize("config, args, message", [
    ("", ["--loss", "sum", "--set", "p=3"],
     "symmem: error: node 'blocks.L.norm.weight:param' (parameter): needs p to divide L (Mod(L, p) = 0), which "
     "fails at L=4, p=3"),
    # tied (transformers' default): each stage its own copy (test_every_stage_of_a_traced_module_...): a peak.
    # ``deep`` (docs/testing.md): HF GPT-2 tied and untied on stages are the real runs' CASES, the CLI's pipeline
    # trace is test_views_name_the_stage_and_fit_solves_b's
    pytest.param("hf", ["--loss", "sum", "--set", "p=2"], "peak per stage (MiB) 0: 0.13, 1: 0.13",
                 marks=pytest.mark.deep),
    # given labels, HF's own loss is the schedule's loss_fn (test_every_stage_of_a_traced_module_...): a peak
    pytest.param("hf-untied", ["--loss", "cross-entropy", "--set", "p=2"], "peak per stage (MiB) 0: 0.13, 1: 0.13",
                 marks=pytest.mark.deep),
    # Llama, Mistral, Qwen2: each stage makes its own rotary tables (LlamaSplit), a peak
    # (test_every_stage_of_a_traced_module_...); another model with rotary tables (Qwen3): its split was not measured
    ("qwen3", ["--loss", "sum", "--set", "p=2"], "no peak: the pipeline peak of a traced module is modelled for "
     "modules without buffers (model.rotary_emb.inv_freq: its stage is not followed) and Hugging Face Llama, "
     "Mistral and Qwen2 (each stage of their manual split makes its own rotary tables, their frequencies a buffer of "
     "every stage)"),
    # given labels: the encoder's output every decoder block reads is the obstacle (two tensors a boundary)
    ("bart", ["--loss", "cross-entropy", "--set", "p=2"], "no peak: the pipeline peak of a traced encoder-decoder "
     "is not modelled: every decoder block reads the encoder's output (cross-attention), so its stages pass two "
     "tensors across each boundary (the decoder's stream and the encoder's output, both gradients back) where a "
     "traced module's stages pass one (the labels are not the obstacle: the schedule's loss_fn would be the "
     "model's cross-entropy on the last stage's logits, as for a decoder-only model)"),
])
def test_refusals(capsys, config, args, message):
    gpt2 = "n_layer=2,n_embd=16,n_head=2,vocab_size=32,n_positions=16" + (",tie_word_embeddings=false" if
                                                                             config == "hf-untied" else "")
    llama = ("num_hidden_layers=2,hidden_size=16,num_attention_heads=2,num_key_value_heads=1,intermediate_size=32,"
             "vocab_size=32,tie_word_embeddings=false,use_cache=false")
    bart = ("encoder_layers=2,decoder_layers=2,d_model=16,encoder_attention_heads=2,decoder_attention_heads=2,"
            "encoder_ffn_dim=32,decoder_ffn_dim=32,vocab_size=32,max_position_embeddings=32,use_cache=false")
    spec = {"": [BLOCK, "--dims", "B"], "llama": ["hf:llama", "--config", llama, "--dims", "B,S"],
            "qwen3": ["hf:qwen3", "--config", f"{llama},head_dim=8", "--dims", "B,S"],
            "bart": ["hf:bart", "--config", bart, "--dims", "B,S"]}.get(
        config, ["hf:gpt2", "--config", gpt2, "--dims", "B,S"])
    pipeline = [] if "--pipeline-parallel" in args else ["--pipeline-parallel", "gpipe", "--micro-batches", "2"]
    code = main(["trace", *spec, "--optimizer", "adamw", *pipeline, *args])
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert message in text, text
    assert "Traceback" not in text and code in (0, 2)


class _Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    def forward(self, x, scale):
        return x + self.up(self.norm(x)) * scale


class _SharedTable(torch.nn.Module):
    """A table made once in the module's own code and read by every block (as Llama's rotary tables)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.blocks = torch.nn.ModuleList(_Scaled() for _ in range(4))

    def forward(self, x):
        scale = torch.arange(16.0) / 16
        x = self.inp(x)
        for block in self.blocks:
            x = block(x, scale)
        return self.head(x)


class _OwnLoss(torch.nn.Module):
    """A module computing its own loss from a target it is given (not a Hugging Face model's labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2))

    def forward(self, x, y):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return ((self.head(x) - y) ** 2).mean()


def test_a_module_s_own_loss_from_its_own_target_is_refused():
    """torch.distributed.pipelining gives the last stage only the previous stage's output (the target goes to the
    schedule's loss_fn): a module's own loss from its own target has no such run; HF's given labels does."""
    from symmem.api import trace

    d = trace(_OwnLoss(), (torch.randn(4, 8), torch.randn(4, 4)), {"B": [(0, 0), (1, 0)]}, optimizer="adamw",
              loss="output", pipeline_parallel=True, pipeline_schedule="gpipe", micro_batches=2, values={"p": 2})
    with pytest.raises(SymmemError, match=r"^the pipeline peak of a traced module computing its own loss is "
                       r"modelled for Hugging Face models given labels \(the schedule's loss_fn is then the model's "
                       r"loss_function on the last stage's logits\); torch.distributed.pipelining gives the last "
                       r"stage no target: return the output and give the loss 'sum' or 'cross-entropy' \(--loss\), "
                       r"which the schedule's loss_fn computes$"):
        d.value("peak")


def test_a_table_every_block_keeps_is_refused():
    """Each real stage would make the table for itself; the recorded step makes it once, on stage 0: refused."""
    from symmem.api import trace

    d = trace(_SharedTable(), (torch.randn(4, 8),), {"B": (0, 0)}, optimizer="adamw", loss="sum",
              pipeline_parallel=True, pipeline_schedule="gpipe", micro_batches=2, values={"p": 2})
    with pytest.raises(SymmemError, match=r"^the blocks keep for backward more than one tensor made before them "
                       r"\(64 bytes at aten.div.Tensor in the module, 64\*B bytes at aten.addmm.default in inp\)"):
        d.value("peak")


def test_a_parameter_read_on_another_stage_than_its_module_s_is_refused():
    """``traced_block.ReadNet``'s head is its own code reading the input layer's weight (``x @ self.inp.weight``).
    Measured on two gloo ranks (GPipe, M = 2, cross-entropy, the manual split with the head's code on the last
    stage): that stage runs only if it keeps ``inp`` too (without it, ``AttributeError``), and then holds inp's
    weight and bias (30,048 parameter bytes, as stage 0), the weight's gradient and AdamW state (59,956 bytes of
    state against stage 0's 60,152: no bias state) and peaks at 135,284 bytes, where the cut counting the read on
    stage 0 only gave 131,228.  Refused in one line naming the parameter and both stages."""
    import importlib.util

    from symmem.api import trace

    spec = importlib.util.spec_from_file_location("traced_block_reads", BLOCK.split(":")[0])
    data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(data)
    module, example = data.build_reads()
    d = trace(module, example, {"B": (0, 0)}, optimizer="adamw", loss="cross-entropy", pipeline_parallel=True,
              pipeline_schedule="gpipe", micro_batches=2, values={"p": 2})
    with pytest.raises(SymmemError, match=r"^the parameter inp\.weight is read on stage 1 of 2 \(aten\.mm\.default "
                       r"in the module\) but held on stage 0, its module's: a real stage runs that read only if it "
                       r"keeps the module too \(a copy of the parameter with its own gradient and optimizer state, "
                       r"not synchronized\), which is not modelled for traced modules; give the read a module of "
                       r"its own holding the parameter, tied \(as a head tied to the embedding: symmem counts each "
                       r"stage's copy\)$"):
        d.value("peak")


def test_decoder_layers_of_two_attention_types_are_refused():
    """Qwen2 with ``use_sliding_window`` below ``max_window_layers``: its layers are of two kinds (``layer_types``),
    not one run of alike blocks -- refused in one line naming them (measured: all full or all sliding attention)."""
    from types import SimpleNamespace

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from symmem.importer.traced_pipeline import refusal
    from symmem.training import Regime

    config = Qwen2Config(**{**QWEN2, "num_hidden_layers": 4}, use_sliding_window=True, sliding_window=4,
                         max_window_layers=2)
    step = SimpleNamespace(repeat=1, module=Qwen2ForCausalLM(config))
    assert refusal(step, Regime(pipeline_parallel=True)) == (
        "the pipeline peak of a traced Hugging Face model is modelled when its decoder layers are of one attention "
        "type (measured: all 'full_attention' or all 'sliding_attention'); config.layer_types mixes "
        "'full_attention' and 'sliding_attention'")
