"""The names users read: models, optimizers, precisions, conventions and the sources symmem reproduces.

Identifiers (``vit-b16``, ``adamw``, ``fp32``, ``paper``) are what one types; plots, notebooks and the paper
print what they stand for (``ViT-B/16``, ``AdamW``, ``FP32``, the accounting of the FP32 analysis).  A name not
in a table is shown as it is (your own model keeps the name you gave it).

>>> model("vit-ti16"), model("resnet50-v1"), model("my-net")
('ViT-Ti/16', 'ResNet-50 v1', 'my-net')
>>> regime("fp32", "adamw")
'FP32 + AdamW'
>>> SOURCES["fp32-analysis"]
'the FP32 analysis of ResNet-50 and ViT-B/16 (Bandyopadhyay, 2024)'
"""

from __future__ import annotations

#: The documents symmem reproduces, named by what they are.
SOURCES: dict[str, str] = {
    "fp32-analysis": "the FP32 analysis of ResNet-50 and ViT-B/16 (Bandyopadhyay, 2024)",
    "cs231n": "the CS231n memory rule",
    "cs231n-qa": "a Q&A about CS231n estimates",
    "transformer-breakdown": "a transformer activation breakdown",
    "korthikanti": "Korthikanti et al. (2022)",
}

_VIT = {"ti": "Ti", "s": "S", "b": "B", "l": "L"}

MODELS: dict[str, str] = {
    **{f"resnet{d}": f"ResNet-{d}" for d in (18, 34, 50, 101, 152)},
    "resnet50-v1": "ResNet-50 v1",
    **{f"vgg{d}": f"VGG-{d}" for d in (11, 13, 16, 19)},
    **{f"vgg{d}_bn": f"VGG-{d}-BN" for d in (11, 13, 16, 19)},
    "mlp": "MLP",
    **{f"vit-{s}16": f"ViT-{t}/16" for s, t in _VIT.items()},
    "gpt2": "GPT-2",
    "bert-base": "BERT-base",
    "bert-large": "BERT-large",
    "llama": "Llama",
    "gpt-megatron": "GPT (Megatron-LM)",
    "counts": "a network given by counts",
}

OPTIMIZERS: dict[str, str] = {
    "sgd": "SGD", "sgd-momentum": "SGD with momentum", "adam": "Adam", "adamw": "AdamW",
    "adafactor": "Adafactor", "adam-8bit": "8-bit Adam", "lion": "Lion",
}

PRECISIONS: dict[str, str] = {
    "fp32": "FP32", "mixed": "mixed precision", "mixed-megatron": "BF16 mixed precision (Megatron-LM)",
    "mixed-full-copies": "FP16 mixed precision with FP32 copies",
}

#: Short names of the conventions, for legends and axis labels (``paper``: the FP32 analysis's accounting).
CONVENTIONS: dict[str, str] = {
    "paper": "FP32 analysis",
    "pytorch": "PyTorch autograd",
    "megatron": "Korthikanti et al.",
    "cs231n": "CS231n rule",
    "traced": "traced from PyTorch",
}

#: What each convention counts, in one phrase (the paper's prose).
CONVENTION_PHRASES: dict[str, str] = {
    "paper": "the accounting of " + SOURCES["fp32-analysis"],
    "pytorch": "what eager PyTorch's autograd keeps for backward",
    "megatron": "the accounting of Korthikanti et al. (2022)",
    "cs231n": SOURCES["cs231n"],
    "traced": "what PyTorch's autograd keeps, traced from the module itself",
}


def model(name: str) -> str:
    """The printed name of a model: ``vit-b16`` -> ``ViT-B/16``; other names are returned as they are."""
    return MODELS.get(name, name)


def optimizer(name: str) -> str:
    """``adamw`` -> ``AdamW``."""
    return OPTIMIZERS.get(name, name)


def precision(name: str) -> str:
    """``fp32`` -> ``FP32``."""
    return PRECISIONS.get(name, name)


def convention(name: str) -> str:
    """A short name for legends: ``pytorch`` -> ``PyTorch autograd``."""
    return CONVENTIONS.get(name, name)


def regime(precision_name: str, optimizer_name: str) -> str:
    """``FP32 + AdamW``."""
    return f"{precision(precision_name)} + {optimizer(optimizer_name)}"


def attention(name: str | None) -> str:
    """``naive`` -> ``naive attention``; ``sdpa`` -> ``fused attention (SDPA)``."""
    if not name:
        return ""
    return {"naive": "naive attention", "eager": "naive attention (eager)", "sdpa": "fused attention (SDPA)",
            "flash_attention_2": "FlashAttention-2"}.get(name, f"{name} attention")
