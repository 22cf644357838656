"""One peak, however it is asked for: the moment (``peak_at``), its formula at the numbers (``peak_formula``), the
bytes alive then (``live_at_peak``) and ``value("peak")`` are the same number, for every built-in model at its
defaults (both devices, SGD and AdamW; each optimizer on a small model of each kind: CASES says which; the
default suite asks the cases KEPT names, -m deep the rest) -- and that number is the truth: the most live bytes
after any op of the step written out at the numbers (``timeline``).

The timeline is an independent computation of the same quantity: it writes every repeated block out its full
number of times (Llama's 32 layers) in the branch of the size conditions the numbers select and adds the live
storages' bytes at the numbers op by op, host storages included and nothing rounded, as the peak counts them;
the peak's formulas come from the step written out at 4 and 5 layers, interpolated in L, with one formula per
branch.  Between two moments that free something memory only grows, so the largest row is the largest candidate.

Issue 22, item 1: Llama's peak (``Piecewise`` over ``Eq(h/G, 1)``) was right, but its moment, the formula shown
and ``live_at_peak`` were the largest moment of *any* branch -- the ``G != h`` one, where the eager attention
keeps B*h*S^2 probabilities (195,278,505,620 B against the true 134,768,346,764 B at the defaults).
"""

from __future__ import annotations

import functools
import warnings

import pytest

import symmem
from symmem import derive
from symmem.errors import SymmemError
from symmem.training import OPTIMIZERS
from tests.kept_cases import kept

MODELS = list(symmem.available_models())
DEVICES = ("cpu", "cuda")
#: every model meets these; the other optimizers (their states, 8-bit blocks, factored statistics) meet a small
#: model of each kind of layer.  Adam is among those: the one-device step treats Adam and AdamW alike (the same
#: states, the same for-loop and foreach temporaries), and over every model and both devices their moments, peaks
#: and timelines were the same (50 pairs, 27 November 2026), so a product with both repeated every case.
MAIN = ("sgd", "adamw")
FAMILIES = ("mlp", "resnet18", "vit-ti16", "gpt2")
#: models whose peak is one op of the backward in every optimizer and on both devices (the layer stacks of
#: ResNet, VGG, ViT, BERT: measured over the whole product), apart from one of each kind of block (basic,
#: bottleneck, plain, batch-normed, ViT, BERT): SGD on the CPU and AdamW on CUDA (the for-loop step without state,
#: the foreach step with its temporaries and the cuBLAS copies), not the other two pairs.  The models whose moment
#: moves with the optimizer or device (MLP, GPT-2, Llama, Megatron's GPT, counts) and those six meet all four.
SAME_MOMENT = ("resnet34", "resnet101", "resnet152", "resnet50-v1", "vgg13", "vgg16", "vgg19", "vgg13_bn",
               "vgg16_bn", "vgg19_bn", "vit-s16", "vit-b16", "vit-l16", "bert-large")
DIAGONAL = (("sgd", "cpu"), ("adamw", "cuda"))
#: Llama on CUDA is derived and asked every way in test_llama_peak_is_the_moment_of_its_own_branch (its branch
#: too), at the same options: not twice
OWN_TEST = {("llama", "adamw", "cuda"), ("llama", "sgd", "cuda")}
CASES = [(m, o, dev) for m in MODELS for o in MAIN for dev in DEVICES
         if (m not in SAME_MOMENT or (o, dev) in DIAGONAL) and (m, o, dev) not in OWN_TEST]
CASES += [(m, o, "cuda") for m in FAMILIES for o in OPTIMIZERS if o not in MAIN]
#: the cases the default suite asks (stop 42, docs/testing.md): together they run every line of symmem and of these
#: tests that all CASES run (a greedy cover of each case's line coverage); the other models, optimizers and devices
#: are the same code at other numbers, asked under -m deep
KEPT = {"mlp-adafactor-cuda", "resnet18-sgd-cpu", "vit-ti16-sgd-cuda", "counts-adamw-cpu", "vgg13-sgd-cpu",
        "gpt-megatron-sgd-cpu", "bert-base-sgd-cpu", "llama-sgd-cpu", "gpt2-sgd-momentum-cuda", "mlp-adam-8bit-cuda",
        "vgg13_bn-sgd-cpu", "counts-sgd-cuda", "resnet101-sgd-cpu", "vit-ti16-adamw-cuda", "resnet152-sgd-cpu",
        "gpt2-sgd-cpu", "gpt-megatron-adamw-cuda"}


@functools.lru_cache(maxsize=4)  # the branch tests ask Llama's and GPT-2's at other numbers; the memory stays bounded
def at_defaults(name: str, optimizer: str, device: str) -> symmem.Derivation:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # `counts` under pytorch keeps nothing, and says so
        return derive(name, convention="pytorch", optimizer=optimizer, device=device)


def derived(name: str, optimizer: str, device: str, **values: int) -> symmem.Derivation:
    """The derivation at the model's defaults, or at ``values`` (``at``: the same formulas and step, derived once
    for the defaults and the three Llama branches; each number set's timeline is still written out afresh)."""
    d = at_defaults(name, optimizer, device)
    return d.at(**values) if values else d


def ways(d: symmem.Derivation, step: str) -> dict[str, int]:
    """The step's peak asked for every way there is."""
    moment = d.peak_at(step)
    return {"moment": moment.value(d.numbers),
            "moment total": d.evaluate(moment.total),
            "formula": d.evaluate(d.peak_formula(step)),
            "live_at_peak": sum(d.live_at_peak(step).values()),
            "value": d.value("peak" if step == "steady" else "peak_first_step"),
            "timeline": max(sum(live.values()) for _, _, live in d.timeline(step))}


def agree(d: symmem.Derivation, step: str) -> int:
    found = ways(d, step)
    assert len(set(found.values())) == 1, found
    return found["value"]


@pytest.mark.parametrize("name, optimizer, device", kept(CASES, ["-".join(c) for c in CASES], KEPT, unpack=True))
def test_every_way_of_asking_gives_the_largest_moment(name, optimizer, device):
    d = derived(name, optimizer, device)
    for step in ("steady", "first"):
        agree(d, step)
    # the moment is one of the branch the numbers select (there is one branch where no size decides a copy)
    peak = d.step.peak()
    assert d.peak_at().branch == peak.branch(d.numbers)


@pytest.mark.parametrize("optimizer, steady, first, phase", [
    ("adamw", 134_768_346_764, 134_768_346_764, "step"),  # the foreach step's temporaries, G = h: no probs kept
    # the head's backward: the loss sum's gradient cloned dense for cuBLAS (B·S·V·4, the H200's pipeline check;
    # 72,668,480,520 at the last layer's gate_up before it was counted)
    ("sgd", 72_853_029_896, 72_853_029_896, "backward"),
])
def test_llama_peak_is_the_moment_of_its_own_branch(optimizer, steady, first, phase):
    """Issue 22, item 1: at the defaults (G = h = 32) the moment, the formula shown and live_at_peak were the
    G != h branch's (195,278,505,620 B with AdamW; 141,371,179,528 B with SGD)."""
    d = derived("llama", optimizer, "cuda")
    assert d.numbers[symmem.symbol("G")] == d.numbers[symmem.symbol("h")] == 32
    assert agree(d, "steady") == steady
    assert agree(d, "first") == first
    assert d.peak_at().phase == phase
    assert d.peak_at().branch == d.step.peak().branch(d.numbers)
    out = d.to_dict()  # what `symmem derive llama --format json` prints
    assert sum(out["live_at_peak"].values()) == out["values"]["peak"] == steady
    assert out["peak_at"]["phase"] == phase
    assert d.peak_candidates() == sum(1 for m in d.step.peak().moments if m.step == "steady" and m.branch == 0)


@pytest.mark.parametrize("name, values", [
    ("llama", {"G": 8}), ("llama", {"G": 1}), ("llama", {"G": 8, "h": 8, "L": 3}),
    ("gpt2", {"B": 1}), ("gpt2", {"B": 1, "L": 2}),
], ids=["llama-gqa", "llama-mqa", "llama-mha-L3", "gpt2-B1", "gpt2-B1-L2"])
def test_each_branch_of_the_size_conditions(name, values):
    """The other branches (G < h: repeat_kv copies; B = 1: the shifted labels are a view) and layer counts below
    the formula's domain agree too."""
    d = derived(name, "adamw", "cuda", **values)
    for step in ("steady", "first"):
        agree(d, step)


def test_gpt2_cross_entropy_moment_is_its_branch():
    """Issue 22, item 1: ``gpt2 --loss cross-entropy`` showed the B = 1 branch's moment, 64 B over the peak."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = derive("gpt2", convention="pytorch", loss="cross-entropy", attention="naive")
    # the loss's backward is NllLossBackward0 then LogSoftmaxBackward0: the target's copy and total_weight
    # (B*S*8 + 4 = 65,540 bytes) are gone before the logits' gradient is made (tests/test_model_parallel.py checks
    # that moment against a real step)
    assert agree(d, "steady") == 25_970_556_508 - 65_540
    assert agree(d, "first") == 24_975_037_452 - 65_540


@pytest.mark.parametrize("ask", ["peak_at", "live_at_peak", "timeline", "peak_formula", "peak_candidates",
                                 "peak_allocated"])
@pytest.mark.parametrize("step", ["bogus", "", "Steady", 1, None])
def test_an_unknown_step_is_refused(ask, step):
    """Issue 22, item 12: ``d.peak_at('bogus')`` raised a KeyError, ``d.timeline('bogus')`` gave the steady step."""
    d = derived("mlp", "sgd", "cpu")
    with pytest.raises(SymmemError) as e:
        getattr(d, ask)(step)
    assert str(e.value) == f"unknown step {step!r}; known: steady, first"
    assert "\n" not in str(e.value)
