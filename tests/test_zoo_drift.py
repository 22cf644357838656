"""The zoo against the real thing: each built-in model with a third-party counterpart, symbolically.

Oracle: the module the zoo model describes, built from the installed ``transformers`` (5.23.0 here) at a tiny
config and traced with :func:`symmem.trace` (fake tensors, checked against one real forward at the example
sizes): a formula in B, S and L (identical layers folded).  The zoo's ``pytorch``-convention formula on the
CPU, with H, h, F, V, G ... set to the config's values and B, S, L left free, must be the same polynomial:
:func:`drift` lists the terms where the two differ (coefficient by monomial), and the tests assert there are
none.  Parameter counts are compared too.

What cannot be compared by construction is pinned instead: the zoo's ViT follows timm (an MLP dropout after
GELU and a head dropout that HF's ``ViTForImageClassification`` does not have), so with dropout > 0 the
difference is exactly those tensors; torchvision cannot be imported with this torch, so the zoo's ResNet-18
(torchvision's layout) is compared with HF's ResNet of the same layout.  Where torchvision and timm do import
(torch 2.14.1 with torchvision 0.29.1 and timm 1.0.31 here, in a separate environment), the zoo's ResNet-18/50
and ViT-Ti are compared with theirs too; elsewhere those tests skip.
"""

from __future__ import annotations

from typing import Any

import pytest
import sympy

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trace_helpers import BERT, GPT2, LLAMA, VOCAB, at_least_two, bert, drift, gpt2, hf, llama  # noqa: E402

import symmem  # noqa: E402
from symmem import derive  # noqa: E402

B, S, L, Hi, Wi = (symmem.symbol(n) for n in ("B", "S", "L", "Hi", "Wi"))
TEXT = {"B": [("input_ids", 0)], "S": [("input_ids", 1)]}
WITH_LABELS = {"B": [("input_ids", 0), ("labels", 0)], "S": [("input_ids", 1), ("labels", 1)]}


def ids(labels: bool = False) -> dict[str, Any]:
    x = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"input_ids": x, "labels": x.clone()} if labels else {"input_ids": x}


# id, HF module, zoo model, zoo values, zoo options, with labels (the model computes its own loss)
LANGUAGE = [
    ("gpt2-eager-dropout", lambda: gpt2("eager", 0.1), "gpt2", GPT2, {"attention": "naive", "dropout": 0.1}, False),
    ("gpt2-sdpa", lambda: gpt2("sdpa", 0.0), "gpt2", GPT2, {"attention": "sdpa", "dropout": 0.0}, False),
    ("gpt2-sdpa-use-cache-false", lambda: gpt2("sdpa", 0.0, use_cache=False), "gpt2", GPT2,
     {"attention": "sdpa", "dropout": 0.0, "cache": "none"}, False),
    ("gpt2-sdpa-dropout-loss", lambda: gpt2("sdpa", 0.1), "gpt2", GPT2, {"attention": "sdpa", "dropout": 0.1}, True),
    ("bert-sdpa", lambda: bert("sdpa", 0.0), "bert-base", BERT, {"attention": "sdpa", "dropout": 0.0}, False),
    ("llama-gqa-sdpa", lambda: llama("sdpa", 0.0), "llama", LLAMA, {"attention": "sdpa", "dropout": 0.0}, False),
    ("llama-gqa-sdpa-dropout-loss", lambda: llama("sdpa", 0.1), "llama", LLAMA,
     {"attention": "sdpa", "dropout": 0.1}, True),
]


@pytest.fixture(scope="module")
def language():
    """id -> (traced Derivation, zoo Derivation), each HF model traced once."""
    out = {}
    for case, build, name, values, options, labels in LANGUAGE:
        module = build()
        traced = symmem.trace(module, ids(labels), WITH_LABELS if labels else TEXT)
        zoo = derive(name, convention="pytorch", options={"device": "cpu"}, values=values, free=("B", "S", "L"),
                     loss="cross-entropy" if labels else None, **options)
        out[case] = (traced, zoo)
    return out


@pytest.mark.parametrize("case", [c[0] for c in LANGUAGE])
def test_zoo_language_model_equals_the_traced_transformers_module(language, case):
    traced, zoo = language[case]
    kept = at_least_two(zoo.activations + zoo.loss)  # the traced module computes its own loss: one total
    found = drift(traced.activations, kept)
    assert not found, f"{case}: drift by monomial (traced, zoo bytes): {found}"
    assert not drift(traced.input, at_least_two(zoo.input)), (traced.input, zoo.input)
    assert traced.value("parameters") == zoo.value("parameters")


def vit(attn: str, p: float) -> Any:
    return hf("ViTForImageClassification", attn, image_size=32, patch_size=16, hidden_size=32,
              num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=10,
              hidden_dropout_prob=p, attention_probs_dropout_prob=p)


VIT = {"H": 32, "h": 4, "L": 2, "F": 128, "Hi": 32, "Wi": 32, "K": 10}


@pytest.fixture(scope="module")
def vits():
    out = {}
    for attn, p in (("sdpa", 0.0), ("eager", 0.1)):
        traced = symmem.trace(vit(attn, p), (torch.randn(2, 3, 32, 32),), {"B": [(0, 0)]})
        zoo = derive("vit-ti16", convention="pytorch", options={"device": "cpu"}, values=VIT, free=("B", "L"),
                     attention="naive" if attn == "eager" else "sdpa", dropout=p)
        out[(attn, p)] = (traced, zoo)
    return out


def test_vit_without_dropout_equals_hf_vit(vits):
    """timm's fused qkv and HF's three projections keep the same bytes: exact at dropout 0."""
    traced, zoo = vits[("sdpa", 0.0)]
    assert not drift(traced.activations, zoo.activations, (B, L))
    assert traced.input == zoo.input == 4 * 3 * 32 * 32 * B
    # HF's ViT classifies K labels from the class token like timm's head: the same parameters
    assert traced.value("parameters") == zoo.value("parameters")


def test_vit_with_dropout_differs_by_construction(vits):
    """With dropout, timm (the zoo) has two dropouts HF's ViT lacks: after the MLP's GELU (the CPU keeps its
    (B, S, F) noise) and on the class token before the head (noise and output, (B, H) each, kept instead of the
    final norm's (B, S, H) output that HF's classifier keeps through its class-token view)."""
    traced, zoo = vits[("eager", 0.1)]
    s, h, f = 5, 32, 128  # tokens (2 x 2 patches + the class token), hidden, MLP width
    assert sympy.expand(zoo.activations - traced.activations - (L * 4 * B * s * f + 8 * B * h - 4 * B * s * h)) == 0


def test_resnet18_equals_hf_resnet_of_the_same_layout():
    """torchvision does not import with this torch: HF's ResNet with basic blocks (2, 2, 2, 2) is ResNet-18,
    the zoo's ``resnet18`` (torchvision's layout).  Compared on image sides that are multiples of 32."""
    module = hf("ResNetForImageClassification", "eager", layer_type="basic", depths=[2, 2, 2, 2],
                hidden_sizes=[64, 128, 256, 512], embedding_size=64, num_labels=1000)
    traced = symmem.trace(module, (torch.randn(2, 3, 64, 64),), {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]},
                          multiple_of={"Hi": 32, "Wi": 32})
    zoo = derive("resnet18", convention="pytorch", options={"device": "cpu"}, free=("B", "Hi", "Wi"))
    a, b = (sympy.Symbol(n, positive=True, integer=True) for n in ("a", "b"))
    on_multiples = {Hi: 32 * a, Wi: 32 * b}
    assert not drift(traced.activations.subs(on_multiples), zoo.activations.subs(on_multiples), (B, a, b))
    assert traced.value("parameters") == zoo.value("parameters") == 11_689_512


# --- torchvision and timm themselves, where they import -------------------------------------------------------------
def _vision_zoo(name: str) -> Any:
    try:
        return __import__(name)
    except Exception as exc:  # torchvision's compiled ops do not load with every torch build (this project's CPU one)
        pytest.skip(f"{name} is not importable here ({type(exc).__name__})")


@pytest.mark.parametrize("depth", [18, 50])
def test_resnet_equals_torchvision(depth):
    """The zoo's ResNets follow torchvision's: the formula traced from torchvision's own module, on image sides
    that are multiples of 32, is the zoo's term by term (torchvision imports beside torch 2.14.1, not 2.13.0)."""
    tv = _vision_zoo("torchvision")
    torch.manual_seed(0)
    module = getattr(tv.models, f"resnet{depth}")()
    traced = symmem.trace(module, (torch.randn(2, 3, 64, 64),), {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]},
                          multiple_of={"Hi": 32, "Wi": 32})
    zoo = derive(f"resnet{depth}", convention="pytorch", options={"device": "cpu"}, free=("B", "Hi", "Wi"))
    a, b = (sympy.Symbol(n, positive=True, integer=True) for n in ("a", "b"))
    # a run of identical bottlenecks is folded to L in the trace: its length, as the module has it
    on_multiples = {Hi: 32 * a, Wi: 32 * b, **{s: v for s, v in traced.numbers.items() if s == L}}
    assert not drift(traced.activations.subs(on_multiples), zoo.activations.subs(on_multiples), (B, a, b))
    assert not drift(traced.input.subs(on_multiples), zoo.input.subs(on_multiples), (B, a, b))
    assert traced.value("parameters") == zoo.value("parameters") == sum(p.numel() for p in module.parameters())


def test_vit_equals_timm():
    """The zoo's ViT follows timm's: ViT-Ti/16 at 224 x 224, traced with B free and its 12 blocks folded to L."""
    timm = _vision_zoo("timm")
    torch.manual_seed(0)
    module = timm.create_model("vit_tiny_patch16_224")
    traced = symmem.trace(module, (torch.randn(2, 3, 224, 224),), {"B": [(0, 0)]})
    zoo = derive("vit-ti16", convention="pytorch", options={"device": "cpu"}, free=("B", "L"), attention="sdpa",
                 dropout=0.0)
    assert not drift(traced.activations, zoo.activations, (B, L))
    assert traced.value("parameters") == zoo.value("parameters") == sum(p.numel() for p in module.parameters())
