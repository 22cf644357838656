"""The derived peak of a training step against the live bytes of real training steps (symmem.record.steps).

Every case runs two real steps (the first creates the optimizer state; the second is the steady state) of the
project's PyTorch reference at sizes never used to derive the formula, and compares both peaks with
``peak_first_step`` and ``peak`` evaluated there.  Cases rotate through the optimizers and their for-loop and
foreach implementations so that each model meets several of them at three batch sizes (-m deep; the default suite
runs the cases KEPT names).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from symmem import derive  # noqa: E402
from symmem.record.verify import verify_peak  # noqa: E402
from tests.kept_cases import kept  # noqa: E402

OPTIMIZERS = [("sgd", "for-loop"), ("sgd-momentum", "foreach"), ("adam", "for-loop"), ("adamw", "foreach"),
              ("sgd", "foreach"), ("sgd-momentum", "for-loop"), ("adam", "foreach"), ("adamw", "for-loop")]
TINY_GPT = {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100}

#: (model, values, derive keywords) -- batch sizes filled in below
MODELS = [
    ("mlp", {}, {}),
    ("resnet18", {"Hi": 32, "Wi": 32, "K": 10}, {}),
    # 16 x 16 images (was 32 x 32: half the real steps' CPU): the same moments peak at B = 2, 5 and 8 (the foreach
    # step, layer4.0.conv2.weight's update, layer2.0.conv1's backward; ResNet-18 at 16 x 16 would move its B = 8)
    ("resnet50", {"Hi": 16, "Wi": 16, "K": 10}, {}),
    ("vit-ti16", {"Hi": 32, "Wi": 32, "L": 2, "K": 10}, {"attention": "naive"}),
    ("vit-ti16", {"Hi": 32, "Wi": 32, "L": 2, "K": 10}, {"attention": "sdpa"}),
    ("gpt2", TINY_GPT, {"attention": "naive", "dropout": 0.1, "loss": "cross-entropy"}),
    ("gpt2", TINY_GPT, {"attention": "sdpa", "dropout": 0.0, "loss": "cross-entropy"}),
]
CASES = [(name, {**values, "B": b}, kw, *OPTIMIZERS[(i * 3 + j) % len(OPTIMIZERS)])
         for i, (name, values, kw) in enumerate(MODELS) for j, b in enumerate((2, 5, 8))]
IDS = [f"{c[0]}-{c[2].get('attention', '')}-B{c[1]['B']}-{c[3]}-{c[4]}" for c in CASES]
#: the real steps the default suite runs (stop 42, docs/testing.md): the eight a greedy cover of the cases' line
#: coverage keeps (every model and attention once), and ViT's SDPA Adam foreach at B = 8, whose peak is the foreach
#: step's temporaries -- none of the eight peaks there.  The rest run the same lines at other numbers: -m deep
KEPT = {"mlp--B2-sgd-for-loop", "gpt2-sdpa-B5-adamw-foreach", "vit-ti16-naive-B2-sgd-momentum-foreach",
        "resnet18--B5-sgd-foreach", "gpt2-sdpa-B2-adam-for-loop", "gpt2-naive-B8-sgd-momentum-foreach",
        "resnet50--B8-sgd-for-loop", "vit-ti16-sdpa-B2-sgd-foreach", "vit-ti16-sdpa-B8-adam-foreach"}


@pytest.mark.parametrize("name, values, kw, optimizer, impl", kept(CASES, IDS, KEPT, unpack=True))
def test_peak_equals_real_step(name, values, kw, optimizer, impl):
    d = derive(name, convention="pytorch", device="cpu", optimizer=optimizer, optimizer_impl=impl, values=values,
               free=("B",), **kw)
    result = verify_peak(d)
    assert result.exact, result.report()


#: Llama's for-loop AdamW peaks in the head's update, beside the previous parameter's ``denom``: the final norm's
#: (HF registers the norms after the attention and the MLP), not a projection's -- 3,968 bytes over until the
#: step followed model.parameters()' order
LLAMA_STEP = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 32}


@pytest.mark.parametrize("values", [LLAMA_STEP, {**LLAMA_STEP, "L": 2, "S": 16}])
def test_llama_steps_its_parameters_in_registration_order(values):
    d = derive("llama", convention="pytorch", device="cpu", optimizer="adamw", optimizer_impl="for-loop",
               values=values, attention="sdpa")
    result = verify_peak(d)
    assert result.exact, result.report()
    if values["L"] == 1:
        assert d.peak_at().where() == "step lm_head.weight, steady step"


@pytest.mark.parametrize("name, values, optimizer", [("mlp", {"B": 4}, "sgd"),
                                                     ("gpt2", {**TINY_GPT, "B": 4}, "adam")])
def test_gradient_accumulation(name, values, optimizer):
    kw = {"loss": "cross-entropy", "attention": "sdpa", "dropout": 0.0} if name == "gpt2" else {}
    d = derive(name, convention="pytorch", device="cpu", optimizer=optimizer, values=values, free=("B",),
               micro_batches=3, **kw)
    result = verify_peak(d)
    assert result.exact, result.report()


@pytest.mark.parametrize("name, values, kw", [
    ("vit-ti16", {"B": 16, "Hi": 64, "Wi": 64, "L": 4, "K": 10}, {"attention": "naive", "checkpoint": "full"}),
    ("gpt2", {**TINY_GPT, "B": 4, "L": 6}, {"attention": "naive", "dropout": 0.1, "loss": "cross-entropy",
                                          "checkpoint": "every-3"}),
    ("bert-base", {**TINY_GPT, "B": 4, "L": 5}, {"attention": "naive", "checkpoint": "full"}),
    ("llama", {**TINY_GPT, "B": 2, "L": 5, "G": 2, "F": 128}, {"attention": "sdpa", "loss": "cross-entropy",
                                                            "checkpoint": "every-2"}),
], ids=["vit-full", "gpt2-every3", "bert-full", "llama-every2"])
def test_checkpointing_at_its_real_time(name, values, kw):
    """Checkpointed layers keep only their inputs; each is recomputed when its backward starts."""
    d = derive(name, convention="pytorch", device="cpu", optimizer="sgd", values=values, **kw)
    result = verify_peak(d)
    assert result.exact, result.report()
    plain = derive(name, convention="pytorch", device="cpu", optimizer="sgd", values=values,
                   **{k: v for k, v in kw.items() if k != "checkpoint"})
    assert d.value("peak") < plain.value("peak")


def test_keep_logits_holds_the_output_through_backward():
    values = {**TINY_GPT, "B": 4}
    plain = derive("gpt2", convention="pytorch", device="cpu", optimizer="sgd", values=values, free=("B",),
                   attention="sdpa", dropout=0.0)
    held = derive("gpt2", convention="pytorch", device="cpu", optimizer="sgd", values=values, free=("B",),
                  attention="sdpa", dropout=0.0, keep_logits=True)
    for d in (plain, held):
        result = verify_peak(d)
        assert result.exact, result.report()
    assert held.value("peak") > plain.value("peak")


def test_peak_moment_names_the_op_and_what_is_alive():
    d = derive("mlp", convention="pytorch", device="cpu", optimizer="sgd", values={"B": 4})
    m = d.peak_at()
    live = d.live_at_peak()
    assert (m.phase, m.node) == ("backward", "fc1")
    assert sum(live.values()) == d.value("peak")
    # the weights and all the gradients are alive when the first layer's weight gradient is made
    assert live["parameter"] == live["gradient"] == 4 * d.value("parameters")
