"""Options accepted with no effect are refused (issue 22, item 4), and the refusals are honest.

An option a derivation would accept and ignore -- a step option where no step is modelled, checkpointing of a
model with no repeated layer, a builder option or a loss the convention does not count -- is one line
``symmem: error: ...`` with exit status 2 (a :class:`SymmemError` in Python) naming why and the way out.  The
truth each refusal is checked against is the derivation itself, made through the engine without the front's
check: with the option, it is the derivation without it (so the option had no effect), while under the pytorch
convention the same option changes the numbers (so the refusal is the convention's, not the option's).
"""

from __future__ import annotations

import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symmem import SymmemError, derive
from symmem.cli import main
from symmem.conventions import convention, names
from symmem.engine import derivation
from symmem.models import available, build
from symmem.training import Regime
from tests.kept_cases import kept

#: a value of each builder option other than every model's default, and a model that has the option
OTHER = {"dropout": ("gpt2", 0.0), "cache": ("gpt2", "none"), "gelu": ("gpt2", "fused"),
         "attention": ("vit-b16", "naive")}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def terms(model, conv: str) -> list[tuple[str, str]]:
    """The derivation's terms under the default regime, made by the engine without the front's checks."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = derivation(model, convention(conv), Regime())
    return sorted((t.name, str(t.expr)) for t in d.terms)


BLIND = [(c, o) for c in names() for o in sorted(convention(c).blind_to)]


def test_every_convention_says_what_it_does_not_see():
    assert {c: sorted(convention(c).blind_to) for c in names()} == {
        "cs231n": ["attention", "cache", "dropout", "gelu", "loss"],
        "megatron": ["cache", "loss"],
        "paper": ["cache", "dropout", "gelu", "loss"],
        "pytorch": [],
    }


#: the pairs the default suite asks (stop 42, docs/testing.md): a greedy cover of the pairs' line coverage (every
#: convention and every option stays); -m deep asks all
BLIND_KEPT = {"paper-dropout", "cs231n-loss", "cs231n-attention", "cs231n-cache", "cs231n-gelu", "megatron-cache"}


@pytest.mark.parametrize("conv, option", kept(BLIND, [f"{c}-{o}" for c, o in BLIND], BLIND_KEPT, unpack=True))
def test_an_option_the_convention_does_not_see_is_refused(capsys, conv, option):
    why = convention(conv).blind_to[option]
    if option == "loss":
        model, value, flag = "vgg16", "cross-entropy", ["--loss", "cross-entropy"]
        built, plain = build(model), build(model)
        from symmem.loss import with_loss

        built = with_loss(built, value)
    else:
        model, value = OTHER[option]
        flag = [f"--{option}", str(value)]
        built, plain = build(model, **{option: value}), build(model)
    code, out, err = cli(capsys, "derive", model, "--convention", conv, *flag)
    assert code == 2 and out == ""
    assert err == (f"symmem: error: {option}={value!r} has no effect under the {conv} convention ({why}): leave "
                   "it out, or use convention pytorch\n")
    with pytest.raises(SymmemError, match=f"^{option}="):
        derive(model, convention=conv, **{option: value})
    # honest: the convention's terms with the option are its terms without; pytorch's differ
    assert terms(built, conv) == terms(plain, conv)
    assert terms(built, "pytorch") != terms(plain, "pytorch")


STEP = [("--keep-logits", "keep_logits=True", {"keep_logits": True}),
        ("--micro-batches=2", "micro_batches=2", {"micro_batches": 2}),
        ("--optimizer-impl=fused", "optimizer_impl='fused'", {"optimizer_impl": "fused"})]


@pytest.mark.parametrize("conv", [c for c in names() if not convention(c).models_step])
@pytest.mark.parametrize("flag, shown, field", STEP, ids=[s[0] for s in STEP])
def test_step_options_without_a_step_are_refused(capsys, conv, flag, shown, field):
    code, out, err = cli(capsys, "derive", "gpt2", "--convention", conv, flag)
    assert code == 2 and out == ""
    assert err == (f"symmem: error: {shown} shapes the training step's peak, which the {conv} convention (an "
                   "accounting with no step) does not model: leave it out, or use convention pytorch\n")
    with pytest.raises(SymmemError, match="does not model"):
        derive("gpt2", convention=conv, **field)
    # honest: such a convention has no step (no peak) at all, while under pytorch the option moves the peak
    assert not derivation(build("gpt2"), convention(conv), Regime(**field)).has_peak


def test_step_options_move_pytorchs_peak():
    """The other side of the refusals: where the step is modelled each option changes the peak.  ResNet-18 at its
    defaults (B = 64, 1000 classes): the held logits are 64 x 1000 FP32 values, 256,000 bytes."""
    base = derive("resnet18").value("peak")
    assert derive("resnet18", keep_logits=True).value("peak") - base == 64 * 1000 * 4
    assert derive("resnet18", micro_batches=2).value("peak") > base
    assert derive("mlp", optimizer_impl="for-loop").value("peak") != derive("mlp").value("peak")


def test_step_options_for_one_layer_are_refused(capsys):
    code, _, err = cli(capsys, "derive", "gpt2", "--per-layer", "--keep-logits")
    assert code == 2 and err == ("symmem: error: keep_logits=True shapes the training step's peak, which one layer "
                                 "(per_layer) does not model: leave it out\n")


#: the cover's models (the MLP and a batch-normed VGG: the same refusal, built from each model's name); -m deep all
FLAT = [m for m in available() if m != "counts" and not build(m).graph.blocks]


@pytest.mark.parametrize("model", kept(FLAT, FLAT, {"mlp", "vgg11_bn"}))
def test_checkpointing_a_model_without_a_repeated_layer_is_refused(capsys, model):
    code, out, err = cli(capsys, "derive", model, "--checkpoint", "full")
    assert code == 2 and out == ""
    assert err == (f"symmem: error: checkpoint='full' recomputes repeated layers, and {model} has none: leave it "
                   "out\n")
    # honest: the engine, asked anyway, keeps the same terms and the same peak
    with_ckpt = derivation(build(model), convention("pytorch"), Regime(checkpoint="full"))
    without = derivation(build(model), convention("pytorch"), Regime())
    assert sorted(map(str, (t.expr for t in with_ckpt.terms))) == sorted(map(str, (t.expr for t in without.terms)))
    assert with_ckpt.value("peak") == without.value("peak")


def test_what_has_an_effect_stays_accepted(capsys):
    """The documented uses: the paper convention with naive attention, Megatron's dropout masks, the pytorch
    convention with every option, checkpointing a model with repeated layers."""
    assert cli(capsys, "derive", "vit-b16", "--convention", "paper", "--attention", "naive")[0] == 0
    assert derive("gpt2", convention="megatron", dropout=0.0).value("activations") < derive(
        "gpt2", convention="megatron").value("activations")
    assert cli(capsys, "derive", "gpt2", "--dropout", "0.0", "--cache", "none", "--gelu", "fused", "--loss",
               "cross-entropy", "--keep-logits", "--micro-batches", "2", "--optimizer-impl", "fused")[0] == 0
    assert cli(capsys, "derive", "resnet18", "--convention", "paper", "--checkpoint", "full")[0] == 0


# -- --width is honoured (issue 22, item 5) ------------------------------------------------------------------
def test_width_is_honoured(capsys):
    """``derive vgg11 --width 70`` printed a 98-column line: the peak's formula with its note in words, which
    the formula wrapper cannot cut.  Every line now fits, and nothing is lost: the note is all there."""
    code, out, _ = cli(capsys, "derive", "vgg11", "--width", "70")
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 70
    assert "(the largest of 2 moments at these sizes)" in " ".join(x.strip() for x in out.splitlines())


@pytest.mark.parametrize("model, options", [("vgg11", {}), ("llama", {}), ("resnet50", {}), ("mlp", {}),
                                            ("gpt2", {"zero": 3, "tensor_parallel": True})])
def test_no_line_is_wider_than_the_width(model, options):
    from symmem.report.text import summary

    d = derive(model, **options)
    for width in (40, 41, 45, 46, 50, 57, 70, 85, 95, 100, 120):
        for cut in (False, True):
            for fold in (False, True):
                text = summary(d, width=width, cut=cut, fold=fold)
                assert max(len(line) for line in text.splitlines()) <= width, (width, cut, fold)


# -- the family the fuzz corpus found: options under every convention ----------------------------------------
def bounded(n: int) -> settings:
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


DRAWS = dict(model=st.sampled_from(["mlp", "vgg11", "resnet18", "vit-ti16", "gpt2", "bert-base", "llama"]),
             conv=st.sampled_from(["pytorch", "paper", "megatron", "cs231n"]),
             flags=st.lists(st.sampled_from([("--keep-logits",), ("--micro-batches", "2"),
                                             ("--optimizer-impl", "fused"), ("--checkpoint", "full"),
                                             ("--loss", "cross-entropy"), ("--dropout", "0.2"), ("--cache", "none"),
                                             ("--gelu", "fused"), ("--attention", "naive"), ("--per-layer",),
                                             ("--device", "cpu")]), max_size=3, unique=True))


def _answer_or_refuse_in_one_line(model, conv, flags):
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        small = ["--set", "B=2"] + (["--set", "L=2"] if model not in ("mlp", "vgg11", "resnet18") else [])
        code = main(["derive", model, "--convention", conv, *small, *[x for f in flags for x in f]])
    if code == 2:
        assert out.getvalue() == "" and err.getvalue().startswith("symmem: error: ")
        assert err.getvalue().count("\n") == 1
    else:
        assert code == 0 and out.getvalue()
        given_ = {f[0] for f in flags}
        # what is refused under a convention never passes
        assert not ({"--keep-logits", "--micro-batches", "--optimizer-impl"} & given_
                    and (conv != "pytorch" or "--per-layer" in given_))
        assert not any(f"--{o}" in given_ for o in convention(conv).blind_to if o != "loss")


# 12 command lines in the default suite (was 40), 60 under -m deep: the same body, drawn twice
test_options_under_every_convention_answer_or_refuse_in_one_line = bounded(12)(given(**DRAWS)(
    _answer_or_refuse_in_one_line))
test_more_options_under_every_convention_answer_or_refuse_in_one_line = pytest.mark.deep(bounded(60)(given(**DRAWS)(
    _answer_or_refuse_in_one_line)))


def test_step_options_where_the_step_is_refused_are_refused(capsys, monkeypatch):
    """Under tensor or pipeline parallelism the step (one device's, op by op) is not modelled, in a built graph or
    a traced module (ZeRO too), and a traced module's step runs its own dtypes: the step's options change nothing
    there (no peak at all), and are refused. A built graph under ZeRO alone has its peak (the papers' accounting
    of one device's step), which the step's options shape."""
    from symmem.report.text import step_peaks

    assert step_peaks(derive("gpt2", zero=3, values={"N": 8}))  # ZeRO's peak: tests/test_regimes.py
    assert step_peaks(derive("gpt2", tensor_parallel=True)) == []  # honest: no peak under TP to shape
    for flags in (["--tensor-parallel"], ["--pipeline-parallel"]):
        code, _, err = cli(capsys, "derive", "gpt2", *flags, "--keep-logits")
        assert code == 2 and err == (
            "symmem: error: keep_logits=True shapes the training step's peak, which the pytorch convention under "
            "tensor or pipeline parallelism (it follows one device) does not model: leave it out\n")
    torch = pytest.importorskip("torch")
    from pathlib import Path

    import symmem

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from tests.trace_helpers import mlp_with_inputs

    net, inputs = mlp_with_inputs()

    with pytest.raises(SymmemError, match=r"^micro_batches=2 shapes the training step's peak, which is not modelled "
                                          r"here \(the peak under data_parallel='fsdp' is modelled for one micro"):
        symmem.trace(net, inputs, {"B": [(0, 0)]}, data_parallel="fsdp", micro_batches=2)
    with pytest.raises(SymmemError, match=r"^keep_logits=True shapes the training step's peak, which is not "
                                          r"modelled here \(precision='mixed' sets the parameter side only"):
        symmem.trace(net.to(torch.bfloat16), tuple(x.to(torch.bfloat16) for x in inputs), {"B": [(0, 0)]},
                     precision="mixed", keep_logits=True)  # a 16-bit module: the precision is its own
