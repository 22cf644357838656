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
