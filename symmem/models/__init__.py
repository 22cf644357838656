"""Built-in model builders, looked up by name.

A builder is a function of keyword options that returns a :class:`~symmem.graph.Model`.  The built-in zoo is a
table (name -> builder module and function, description, options); a builder module is imported only when one
of its models is built, so listing the zoo imports neither sympy nor any builder.  Register more models with
:func:`register`; :func:`build` checks the options against what the builder declares.

>>> m = build("vit-b16", attention="sdpa")
>>> m.name, [s.name for s in m.free]
('vit-b16', ['B', 'S', 'H', 'h', 'L'])
>>> "resnet50" in available()
True
"""

from __future__ import annotations

import importlib
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import SymmemError

if TYPE_CHECKING:
    from ..graph import Model


@dataclass(frozen=True)
class Option:
    """A builder option: its default, its allowed values (None: any) and a help line."""

    default: Any
    choices: tuple[Any, ...] | None = None
    help: str = ""


@dataclass(frozen=True)
class Entry:
    """A model of the zoo: its builder (a function, or ``"module:function"`` imported when first built), a
    description, its options and the keywords fixed for this name (``depth=50``)."""

    name: str
    target: Callable[..., Model] | str
    description: str
    options: Mapping[str, Option] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)

    @property
    def builder(self) -> Callable[..., Model]:
        if callable(self.target):
            return self.target
        module, _, function = self.target.partition(":")
        return getattr(importlib.import_module(module, __name__), function)


_ATTENTION = ("naive", "sdpa")
_VIT = {
    "attention": Option("sdpa", _ATTENTION, "naive materializes the B*h*S^2 probabilities; sdpa is the fused kernel"),
    "dropout": Option(0.0, None, "dropout probability (attention, projection, MLP, position embedding)"),
    "patch": Option(16, None, "patch size in pixels"),
}
_VGG = {"dropout": Option(0.5, None, "classifier dropout probability")}
_BERT = {
    "attention": Option("sdpa", _ATTENTION, "sdpa is sdpa_attention_forward (transformers' default "
                        "attn_implementation); naive is eager_attention_forward (B*h*S^2 probabilities kept)"),
    "dropout": Option(0.1, None, "hidden_dropout_prob = attention_probs_dropout_prob (HF default 0.1)"),
}
#: use_cache of transformers 5.23 (gpt2, llama): the config default keeps a DynamicCache in training too
_CACHE = Option("dynamic", ("dynamic", "none"), "dynamic: use_cache=True (the config default), a DynamicCache copies "
                "keys and values with torch.cat; none: use_cache=False")


def _builtin() -> dict[str, Entry]:
    """The built-in zoo as data: listing it (``symmem models``, the command line's options) imports no builder
    module; :func:`build` imports the one module that builds the model asked for."""
    found = [Entry(f"resnet{d}", ".resnet:build_resnet", f"ResNet-{d} (torchvision, stride on the 3x3)",
                   fixed={"depth": d}) for d in (18, 34, 50, 101, 152)]
    found.append(Entry("resnet50-v1", ".resnet:build_resnet",
                       "ResNet-50 v1: stride on the first 1x1 of each stage (the geometry of the FP32 analysis of "
                       "ResNet-50 and ViT-B/16, Bandyopadhyay 2024)",
                       fixed={"depth": 50, "v1": True}))
    for d in (11, 13, 16, 19):
        found.append(Entry(f"vgg{d}", ".vgg:build_vgg", f"VGG-{d} (torchvision)", _VGG, {"depth": d}))
        found.append(Entry(f"vgg{d}_bn", ".vgg:build_vgg", f"VGG-{d} with BatchNorm (torchvision)", _VGG,
                           {"depth": d, "batch_norm": True}))
    found.append(Entry("mlp", ".mlp:build_mlp", "multilayer perceptron of any widths", {
        "widths": Option("784,1024,1024,10", None,
                         "comma-separated layer widths (input first, classes last), or 'symbolic'"),
        "dropout": Option(0.0, None, "dropout after each hidden activation"),
    }))
    for size in ("ti", "s", "b", "l"):
        title = {"ti": "Ti", "s": "S", "b": "B", "l": "L"}[size]  # ViT-Ti/16, ViT-S/16 ...
        found.append(Entry(f"vit-{size}16", ".vit:build_vit", f"ViT-{title}/16 (timm; DeiT shares it)", _VIT,
                           {"size": size}))
    found.append(Entry("gpt2", ".gpt:build_gpt2",
                       "GPT-2 small (Hugging Face GPT2LMHeadModel, transformers 5.23: tied embeddings, gelu_new)", {
        "attention": Option("sdpa", _ATTENTION, "sdpa is sdpa_attention_forward (transformers' default "
                            "attn_implementation); naive is eager_attention_forward (B*h*S^2 probabilities kept)"),
        "dropout": Option(0.1, None, "embd_pdrop = attn_pdrop = resid_pdrop (HF default 0.1)"),
        "gelu": Option("new", ("new", "fused"), "new: HF gelu_new written out in ops; fused: F.gelu(tanh)"),
        "cache": _CACHE,
    }))
    for size in ("base", "large"):
        found.append(Entry(f"bert-{size}", ".bert:build_bert",
                           f"BERT-{size} (Hugging Face BertModel with pooler, post-LN, transformers 5.23)", _BERT,
                           {"size": size}))
    found.append(Entry("llama", ".llama:build_llama",
                       "Llama (Hugging Face LlamaForCausalLM, transformers 5.23: RMSNorm, SwiGLU, rotary, GQA, untied "
                       "head)", {
        "attention": Option("sdpa", _ATTENTION, "naive is eager_attention_forward (repeat_kv; B*h*S^2 probabilities "
                            "kept); sdpa is sdpa_attention_forward (enable_gqa)"),
        "dropout": Option(0.0, None, "attention_dropout (HF default 0.0)"),
        "cache": _CACHE,
    }))
    found.append(Entry("gpt-megatron", ".megatron_gpt:build_gpt_megatron",
                       "GPT as Megatron-LM builds it (Korthikanti et al. 2022)", {
        "size": Option("175b", ("22b", "175b", "530b", "1t"), "Korthikanti et al. 2022 Table 3 model"),
        "dropout": Option(0.1, None, "dropout probability (embedding, attention, hidden); > 0 keeps 1-byte masks"),
    }))
    found.append(Entry("counts", ".counts:build_counts",
                       "a model given only by counts (activations Nact, parameters Psi)", {
        "activations": Option(532_752, None, "activation values per sample (Nact)"),
        "parameters": Option(19_072_984, None, "parameter count (Psi)"),
        "input": Option((1, 50, 180), None, "input (channels, height, width)"),
    }))
    return {e.name: e for e in found}


_MODELS: dict[str, Entry] = _builtin()
#: Modules that register models when imported (none of the built-in zoo: it is the data above).
_MODULES: tuple[str, ...] = ()


def register(name: str, builder: Callable[..., Model] | str, description: str,
             options: Mapping[str, Option] | None = None, **fixed: Any) -> None:
    """Make ``builder`` (called with ``fixed`` and the user's options) available as ``name``; ``builder`` may be
    ``"package.module:function"``, imported when the model is first built."""
    _MODELS[name] = Entry(name, builder, description, dict(options or {}), fixed)


def _load() -> None:
    for module in _MODULES:
        importlib.import_module(f"{__name__}.{module}")


def available() -> dict[str, Entry]:
    """Every built-in model, by name (no builder module is imported)."""
    _load()
    return dict(_MODELS)


def entry(name: str) -> Entry:
    if name not in _MODELS:
        _load()
    try:
        return _MODELS[name]
    except KeyError:
        raise SymmemError(f"unknown model {name!r}; known models: {', '.join(sorted(_MODELS))}") from None


def build(name: str, **options: Any) -> Model:
    """Build the model called ``name`` with ``options`` (see ``symmem models``)."""
    e = entry(name)
    chosen = {k: o.default for k, o in e.options.items()}
    for key, value in options.items():
        if value is None:
            continue
        if key not in e.options:
            known = ", ".join(sorted(e.options)) or "none"
            raise SymmemError(f"model {name!r} has no option {key!r}; its options: {known}")
        _check_type(name, key, value, e.options[key].default)
        allowed = e.options[key].choices
        if allowed is not None and value not in allowed:
            raise SymmemError(f"model {name!r}: option {key}={value!r} is not one of {list(allowed)}")
        chosen[key] = value
    return e.builder(name=name, **e.fixed, **chosen)


def _check_type(model: str, key: str, value: Any, default: Any) -> None:
    """A builder option has its default's type: a string where the default is one (``widths='784,10'``), a
    number where it is a number (an int also where the default is a float; never a bool), a tuple of positive
    integers where it is a tuple."""
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    elif isinstance(default, tuple):
        ok = isinstance(value, tuple | list) and all(isinstance(v, numbers.Integral) and not isinstance(v, bool)
                                                     and v > 0 for v in value)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    else:
        ok = True
    if not ok:
        kind = {bool: "true or false", int: "an integer", float: "a number", tuple: "a tuple of positive integers",
                str: "a string"}[type(default)]
        raise SymmemError(f"model {model!r}: option {key} must be {kind} like {default!r}, not {value!r}")
