"""The defaults size real training (issue 10, item 1): the `pytorch` convention with the peak of a step, and a
convention that sees nothing in a graph says so instead of printing 0."""

from __future__ import annotations

import json
import warnings

import pytest

import symmem
from symmem.cli import main
from symmem.errors import NothingCounted
from symmem.units import parse_size


@pytest.mark.parametrize("argv", [
    ["derive", "mlp", "--format", "json"],
    ["derive", "vit-b16", "--format", "json"],
    ["fit", "vit-b16", "--budget", "80GiB", "--format", "json"],
])
def test_the_command_line_defaults_to_pytorch(argv, capsys):
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["convention"] == "pytorch"


def test_the_default_is_what_autograd_keeps():
    """mlp under the default convention against the tensors real autograd saves (the paper convention keeps 0)."""
    pytest.importorskip("torch")
    from symmem.record.verify import verify

    d = symmem.derive("mlp", device="cpu", values={"B": 3})
    assert d.convention == "pytorch" and d.value("activations") > 0
    report = verify(d)
    assert report.exact, report


@pytest.mark.parametrize("model, paper_answer", [("vit-b16", 1_281), ("resnet50-v1", 1_927)])
def test_fit_answers_with_the_peak(model, paper_answer, capsys):
    """`fit MODEL --budget 80GiB` answers with the peak of a training step: the largest B whose peak fits and the
    next one's does not, well below what the FP32 analysis' accounting would allow."""
    assert main(["fit", model, "--budget", "80GiB", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    budget = parse_size("80GiB")
    assert out["quantity"] == "peak" and out["budget"] == budget
    d = symmem.derive(model)
    assert d.at(B=out["max"]).value("peak") <= budget < d.at(B=out["max"] + 1).value("peak")
    assert out["max"] < 0.6 * paper_answer
    assert main(["fit", model, "--budget", "80GiB", "--convention", "paper", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["max"] == paper_answer


CASES = [  # model, convention, whether it finds nothing to count
    ("mlp", "paper", True),
    ("mlp", "megatron", True),
    ("resnet18", "megatron", True),
    ("mlp", "pytorch", False),
    ("counts", "pytorch", True),                   # a stand-in for a network: no real op keeps anything
    ("counts", "cs231n", False),
    ("mlp", "cs231n", False),
    ("vit-b16", "paper", False),
    ("gpt2", "megatron", False),
]


@pytest.mark.parametrize("model, convention, nothing", CASES)
def test_a_convention_that_sees_nothing_says_so(model, convention, nothing):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = symmem.derive(model, convention=convention)
    said = [w for w in caught if issubclass(w.category, NothingCounted)]
    assert bool(said) == nothing == bool(d.notes)
    if nothing:
        assert d.value("activations") == 0 and model in d.notes[0] and convention in d.notes[0]
        assert said[0].filename == __file__  # the warning points at the caller's line


def test_nothing_counted_shows_in_every_view(capsys):
    assert main(["derive", "mlp", "--convention", "paper"]) == 0
    out, err = capsys.readouterr()
    assert err.count("\n") == 1 and err.startswith("symmem: warning: mlp: the paper convention counts tensors by role")
    assert "NOTE: mlp: the paper convention" in out
    assert main(["derive", "mlp", "--convention", "paper", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["notes"][0].startswith("mlp: the paper convention") and err.startswith("symmem: warning:")
    assert main(["derive", "mlp", "--convention", "paper", "--format", "latex"]) == 0
    assert "% NOTE: mlp: the paper convention" in capsys.readouterr().out
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NothingCounted)
        html = symmem.derive("mlp", convention="paper")._repr_html_()
    assert "<b>Note:</b> mlp: the paper convention" in html
    assert main(["derive", "mlp", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert "notes" not in json.loads(out) and err == ""


# --- one set of defaults across the fronts (issue 21, item 3) ------------------------------------------------------
#: the defaults every front shares: what the step backpropagates from, whether the loop holds the output through
#: backward, the optimizer and its implementation, the precision and autocast
SHARED = {"loss": "sum", "keep_output": False, "optimizer": "adamw", "impl": "auto", "precision": "fp32",
          "autocast": None}


def _python_front(name: str) -> dict:
    import inspect

    from symmem.api import derive, trace
    from symmem.options import resolve
    from symmem.training import Regime

    regime = Regime()
    common = {"keep_output": regime.keep_logits, "optimizer": regime.optimizer, "impl": regime.optimizer_impl,
              "precision": regime.precision}
    if name == "derive":
        return {**common, "loss": inspect.signature(derive).parameters["loss"].default,
                "autocast": resolve("derive").autocast}
    if name == "trace":
        signature = inspect.signature(trace).parameters
        return {**common, "loss": signature["loss"].default, "autocast": signature["autocast"].default}
    from symmem.record.steps import track_step

    signature = inspect.signature(track_step).parameters  # a real module: its own dtypes, no autocast of its own
    return {"loss": signature["loss"].default, "keep_output": signature["keep_output"].default,
            "optimizer": signature["optimizer"].default, "impl": signature["impl"].default}


def _cli_front(argv: list[str]) -> dict:
    from symmem.cli import _parser

    args = _parser(argv).parse_args(argv)
    found = {"loss": args.loss, "keep_output": args.keep_logits, "optimizer": args.optimizer,
             "impl": args.optimizer_impl, "precision": args.precision, "autocast": args.autocast}
    assert args.device is None  # the model's own (options.DEVICE_DEFAULT), as in Python
    return found


FRONTS = {
    "derive": lambda: _python_front("derive"),
    "trace": lambda: _python_front("trace"),
    "track_step": lambda: _python_front("track_step"),
    "symmem derive": lambda: _cli_front(["derive", "mlp"]),
    "symmem trace": lambda: _cli_front(["trace", "m.py:build", "--dims", "B"]),
    "symmem verify --peak": lambda: _cli_front(["verify", "mlp", "--peak"]),
}


@pytest.mark.parametrize("front", FRONTS)
def test_every_front_has_the_same_defaults(front):
    found = FRONTS[front]()
    assert found == {k: v for k, v in SHARED.items() if k in found}
    assert {"loss", "keep_output", "optimizer", "impl"} <= set(found)


def test_the_device_default_is_said_once_and_followed():
    """The device default is the model's own: a built-in model's cuda, a traced module's (the CPU for one just
    built, as every SPEC the command line loads); `--help` and `symmem models -v` say it in the same words."""
    torch = pytest.importorskip("torch")
    from symmem.options import DEVICE_DEFAULT, HELP

    assert DEVICE_DEFAULT in HELP["device"]
    assert symmem.derive("mlp").options["device"] == "cuda"
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    d = symmem.trace(net, (torch.zeros(2, 4),), {"B": [(0, 0)]})
    assert d.options["device"] == "cpu" and d.title().endswith("; on cpu")


def test_models_verbose_says_the_defaults(capsys):
    from symmem.options import DEVICE_DEFAULT

    assert main(["models", "-v"]) == 0
    out = capsys.readouterr().out
    assert DEVICE_DEFAULT in out and "SDPA for gpt2, bert-*" in out and "loss         sum" in out
    assert "--attention sdpa (naive|sdpa): sdpa is sdpa_attention_forward (transformers' default" in out


def test_the_default_step_lets_the_output_go():
    """track_step's default is the loop that lets the output go once the loss is computed (HF Trainer, Lightning),
    as derive and trace assume: Linear(4, 3) on a (2, 4) batch with SGD peaks at W 48 + b 12 + x 32 + loss 4 +
    seed 4 + dW 48 + db 12 = 160 bytes; holding the output (keep_output=True) adds y's 24."""
    torch = pytest.importorskip("torch")
    from symmem.record.steps import track_step

    def linear():
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    assert track_step(linear(), torch.zeros(2, 4), optimizer="sgd", steps=1).peak.bytes == 160
    assert track_step(linear(), torch.zeros(2, 4), optimizer="sgd", steps=1, keep_output=True).peak.bytes == 184


def test_trace_and_derive_defaults_are_a_real_default_step():
    """With every option left out, the traced peak and the built-in mlp's peak (on the CPU) are what two real
    training steps of track_step with ITS defaults reach (AdamW as PyTorch picks it, the output's sum, the output
    let go)."""
    torch = pytest.importorskip("torch")
    from symmem.record.steps import track_step
    from symmem.reference import reference

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(3, 16)
    d = symmem.trace(net, (x,), {"B": [(0, 0)]})
    real = track_step(net, x)
    assert (d.value("peak_first_step"), d.value("peak")) == (real.first.bytes, real.steady.bytes)

    built = symmem.derive("mlp", device="cpu", widths="16,32,4", values={"B": 3})
    module, inputs = reference("mlp", {s.name: v for s, v in built.numbers.items()}, built.options)
    real = track_step(module, inputs)
    assert (built.value("peak_first_step"), built.value("peak")) == (real.first.bytes, real.steady.bytes)


def test_built_in_transformers_follow_transformers_default_attention():
    """gpt2 and bert-* default to what transformers runs by default (its attn_implementation: sdpa); the new
    default is checked against the real GPT-2 in tests/test_zoo_drift.py (gpt2-sdpa-dropout-loss)."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from symmem.models import entry

    tiny = {"n_layer": 1, "n_embd": 16, "n_head": 2, "vocab_size": 64, "bos_token_id": 0, "eos_token_id": 0}
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(**tiny))
    bert = transformers.BertModel(transformers.BertConfig(num_hidden_layers=1, hidden_size=16, num_attention_heads=2,
                                                          intermediate_size=32, vocab_size=64))
    for name, model in (("gpt2", gpt2), ("bert-base", bert)):
        assert entry(name).options["attention"].default == model.config._attn_implementation == "sdpa"
        assert symmem.derive(name).options["attention"] == "sdpa"
    assert "fused attention (SDPA)" in symmem.derive("gpt2").title()


def test_autocast_on_the_command_line(capsys):
    """`--autocast bfloat16` is Python's autocast=: the traced activations are what a real forward under
    torch.autocast saves, storage by storage, and the header says it ran under bfloat16 autocast."""
    torch = pytest.importorskip("torch")
    from symmem.record.verify import compare, measure

    spec = "tests.trace_helpers:mlp_with_inputs"
    assert main(["trace", spec, "--dims", "B", "--autocast", "bfloat16", "--set", "B=3", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["options"]["autocast"] == "bfloat16"
    from tests.trace_helpers import mlp_with_inputs

    net, (x,) = mlp_with_inputs()
    d = symmem.trace(net, (x,), {"B": [(0, 0)]}, autocast="bfloat16", values={"B": 3})
    assert out["expressions"]["activations"] == str(d.activations)
    assert "FP32 weights under bfloat16 autocast + AdamW" in d.title()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m = measure(net, torch.randn(3, 16))
    assert compare(d, m).exact, compare(d, m).report()
    assert {t.dtype for t in d.terms if t.category == "activation"} >= {"bfloat16"}  # it ran under autocast
    # verify --module measures the real forward under the same autocast
    assert main(["verify", "--module", spec, "--dims", "B", "--autocast", "bfloat16"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("exact")


@pytest.mark.parametrize("argv, message", [
    (["derive", "gpt2", "--autocast", "bfloat16"],
     "symmem: error: autocast='bfloat16' runs a traced module's forward under torch.autocast; a built-in model's "
     "activations follow precision= (mixed: 16-bit)\n"),
    (["derive", "gpt2", "--loss", "output"],
     "symmem: error: loss='output' is the module's own loss (a traced module that returns it); a built-in model "
     "takes loss='sum' or 'cross-entropy'\n"),
    (["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B", "--precision", "mixed"],
     "symmem: error: precision='mixed' counts 16-bit weight copies and runs 16-bit activations, but this module's "
     "weights are FP32: for PyTorch's mixed precision (torch.autocast over FP32 weights) give autocast='bfloat16' "
     "or 'float16' (--autocast), or cast the module to bfloat16\n"),
])
def test_precision_and_autocast_mean_one_thing(argv, message, capsys):
    pytest.importorskip("torch")
    assert main(argv) == 2
    assert capsys.readouterr().err == message
