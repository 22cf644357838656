"""Where a module to trace comes from: a SPEC string, its example inputs, and the sizes declared on them.

``symmem trace SPEC`` and ``symmem verify --module SPEC`` take the same forms:

- ``package.module:callable`` or ``path/to/file.py:callable``: a callable (no arguments) returning a
  ``torch.nn.Module``, or a ``(module, example_inputs)`` pair.  A module alone needs its example inputs from
  ``--example 2x3x32x32`` (float) or ``--example 2x8:int64`` (zeros).  A path is imported from that file with
  :mod:`importlib`; a dotted name with :func:`importlib.import_module`.  The text is never evaluated.
- ``hf:MODEL_TYPE``, ``hf:org/name``, ``hf:path/to/dir`` or ``hf:path/to/config.json``: a ``transformers``
  config -- the defaults of the config class of a model type (``transformers.AutoConfig.for_model``), or the
  keys of a ``config.json``: a Hub id's from the local Hugging Face cache, else fetched (that file alone, never
  weights; refused offline), a local directory's or the file given (:mod:`symmem.importer.hub`) -- overridden by
  ``--config key=value``.  Text models are built as the causal LM where transformers has one and the model type
  has no masked-LM head (``gpt2``, ``llama``: ``AutoModelForCausalLM``), encoder-decoders as the
  sequence-to-sequence LM (``t5``, ``bart``: ``AutoModelForSeq2SeqLM``), else as the base model (``bert``:
  ``BertModel`` with its pooler); vision models (a config with ``image_size`` and ``num_channels``) as the image
  classifier (``vit``: ``ViTForImageClassification``).  Text models get ``input_ids`` (batch 2, 8 tokens),
  encoder-decoders also ``decoder_input_ids`` of the same shape, vision ones ``pixel_values`` (batch 2, the
  config's image size); a causal or sequence-to-sequence LM traced with a loss also gets ``labels`` (the model
  computes its own loss).  ``--config attn_implementation=eager`` picks the attention code.  The weights take
  the config's dtype, as ``from_config`` gives them (a Hub config's ``torch_dtype``; a note says so).
  A model with more than :data:`REAL_WEIGHTS_MAX` parameters is built on the ``meta`` device: no weights are
  allocated, and the trace runs without its check forward (a note says so).
- ``torchvision:NAME`` / ``timm:NAME``: ``torchvision.models.get_model(NAME)`` /
  ``timm.create_model(NAME)`` with an image batch of 2 at the model's input size, where those packages import.

Declared sizes (``--dims``): ``B,S`` gives each symbol its conventional position on the first tensor input --
``B`` dimension 0; tokens ``S`` dimension 1; images ``C`` 1, ``Hi`` 2, ``Wi`` 3 -- and on the inputs built
with the same layout (the ``labels`` and ``decoder_input_ids`` of ``hf:`` language models);
``B=input_ids:0,S=input_ids:1`` names the (input, dimension) pairs itself (an input by keyword or by position,
``B=0:0``; a symbol may be named more than once).

>>> parse_value("12"), parse_value("0.1"), parse_value("true"), parse_value("eager")
(12, 0.1, True, 'eager')
>>> parse_dims("B=input_ids:0,S=input_ids:1,B=labels:0", None)
{'B': [('input_ids', 0), ('labels', 0)], 'S': [('input_ids', 1)]}
>>> parse_multiples("Hi=32,Wi=32")
{'Hi': 32, 'Wi': 32}
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import SymmemError
from ..units import MAX_SIZE

#: hf: models with more parameters than this are built on the meta device (no weights allocated, no check)
REAL_WEIGHTS_MAX = 200_000_000
#: more layers than the largest published models (Llama 3.1 405B: 126) are refused: tracing grows with them
MAX_TRACED_LAYERS = 256
#: tokens in the example batch of hf: text models
EXAMPLE_TOKENS = 8
#: the example batch size
EXAMPLE_BATCH = 2
#: conventional positions: symbol -> (dimension, the input ranks it applies to, what it means)
CONVENTIONAL = {"B": (0, None, "the batch"), "S": (1, (2, 3), "tokens: (B, S) token ids or (B, S, H)"),
                "C": (1, (4,), "images: (B, C, Hi, Wi)"), "Hi": (2, (4,), "images: (B, C, Hi, Wi)"),
                "Wi": (3, (4,), "images: (B, C, Hi, Wi)")}

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_INT = re.compile(r"^[+-]?[0-9][0-9_]*$")
_FLOAT = re.compile(r"^[+-]?([0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)([eE][+-]?[0-9]+)?$")
_SHAPE = re.compile(r"^([0-9_]+(?:x[0-9_]+)*)(?::([a-z0-9]+))?$")
#: a whole number as Python writes one: underscores only between digits (``1_000``; not ``0_`` nor ``1__0``)
_WHOLE = re.compile(r"^\+?[0-9]+(?:_[0-9]+)*$")
#: the most dimensions a tensor has (PyTorch's limit is 64)
_MAX_DIMS = 64


@dataclass(frozen=True)
class Loaded:
    """A module and its example inputs, from a SPEC."""

    spec: str
    module: Any
    example_inputs: Any  # a tuple (positional) or a dict (keyword)
    #: inputs built with the first input's layout (hf: labels): conventional dims apply to them too
    follow: tuple[Any, ...] = ()
    notes: tuple[str, ...] = ()
    #: the model computes its own loss (hf: causal LM given labels)
    loss: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def on_meta(self) -> bool:
        return any(p.device.type == "meta" for p in self.module.parameters())

    def to(self, device: str) -> Loaded:
        """The module (moved in place, as ``nn.Module.to`` does) and its tensor inputs on ``device`` where that
        device is here; otherwise (and for a module built on the meta device) unchanged: a CUDA build of torch
        traces fake CUDA tensors without a GPU, and what needs real ones (the check forward, ``verify``) says
        so."""
        import torch

        if self.on_meta or device == "cpu" or (device.startswith("cuda") and not torch.cuda.is_available()):
            return self

        def move(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return x.to(device)
            if isinstance(x, list | tuple):
                return type(x)(move(v) for v in x)
            return x

        ex = self.example_inputs
        inputs = {k: move(v) for k, v in ex.items()} if isinstance(ex, dict) else tuple(move(v) for v in ex)
        return replace(self, module=self.module.to(device), example_inputs=inputs)


def parse_value(text: str) -> Any:
    """A ``--config`` value: an integer, a float, true/false, none, a string in quotes (which may hold commas), or
    the plain string (never evaluated)."""
    t = text.strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if _INT.match(t):
        return int(t.replace("_", ""))
    if _FLOAT.match(t):
        return float(t)
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if t.lower() in ("none", "null"):
        return None
    return t


_PIECE = re.compile(r"""(?:[^,"']|"[^"]*"|'[^']*')+""")
_KEY = re.compile(r"^\s*[A-Za-z_][A-Za-z0-9_]*\s*=")


def _pairs(item: str) -> list[str]:
    """One ``--config`` argument as its ``key=value`` pairs: ``a=1,b=2`` is two; a comma inside quotes
    (``name="a,b"``) is the value's.  A comma not followed by a key, outside quotes, is refused with how to quote it.

    >>> _pairs('n_layer=2,n_embd=32'), _pairs('name="a,b",n_layer=2')
    (['n_layer=2', 'n_embd=32'], ['name="a,b"', 'n_layer=2'])
    """
    if "," not in item:
        return [item]
    pieces = _PIECE.findall(item)
    for i, piece in enumerate(pieces[1:], 1):
        if not _KEY.match(piece):
            key, _, value = pieces[i - 1].partition("=")
            shown = f"{value},{piece}"[:40]
            raise SymmemError(f"--config {item[:60]!r}: a comma separates key=value pairs, and {piece.strip()[:20]!r} "
                              f"is not one; a value with a comma goes in quotes: --config '{key.strip()}=\"{shown}\"'")
    return pieces


def parse_config(items: Sequence[str] | None) -> dict[str, Any]:
    """``--config key=value`` items as a dict (later ones win); a number Python cannot hold as written (``1e400``
    would be infinity, ``1e-400`` zero, an integer of more digits than ``int()`` reads) is refused.

    >>> parse_config(["n_layer=2", "layer_norm_epsilon=1e-5"])
    {'n_layer': 2, 'layer_norm_epsilon': 1e-05}
    >>> parse_config(["x=1e400"])
    Traceback (most recent call last):
    symmem.errors.SymmemError: --config x=1e400: 1e400 is beyond the range of a float (it would be inf); give a ...
    """
    import math

    out: dict[str, Any] = {}
    for item in (one for given in items or () for one in _pairs(given)):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise SymmemError(f"--config {item[:60]!r}: expected key=value, e.g. --config n_layer=2")
        text = value.strip()
        shown = text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
        try:
            parsed = parse_value(value)
        except ValueError:  # more digits than int() converts
            raise SymmemError(f"--config {key}={shown}: an integer of {len(text):,} characters is more than "
                              "a config holds; give a smaller number") from None
        if isinstance(parsed, float) and not math.isfinite(parsed):
            raise SymmemError(f"--config {key}={shown}: {shown} is beyond the range of a float (it would be "
                              f"{parsed}); give a finite number")
        if isinstance(parsed, float) and parsed == 0 and re.search(r"[1-9]", re.split(r"[eE]", value)[0]):
            raise SymmemError(f"--config {key}={shown}: {shown} is below the smallest float (it would be 0.0); give "
                              "a larger number or 0")
        out[key] = parsed
    return out


#: ``--lora`` keys: the name users write -> peft.LoraConfig's keyword
LORA_KEYS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "targets": "target_modules"}
_MODULE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.]*$")


def parse_lora(text: str | None) -> dict[str, Any] | None:
    """``--lora r=8,alpha=16,targets=q_proj,v_proj`` (``dropout=0.05`` too) as ``peft.LoraConfig``'s keywords: a
    part without ``=`` continues the targets; targets left out are peft's defaults for the model type.

    >>> parse_lora("r=8,alpha=16,targets=q_proj,v_proj")
    {'r': 8, 'lora_alpha': 16, 'target_modules': ['q_proj', 'v_proj']}
    >>> parse_lora("rank=8")
    Traceback (most recent call last):
    symmem.errors.SymmemError: --lora rank=8: unknown key 'rank'; the keys are r, alpha, dropout, targets
    """
    if text is None:
        return None
    out: dict[str, Any] = {}
    key = None
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        if not sep and key == "target_modules" and _MODULE_NAME.match(part):
            out[key].append(part)
            continue
        name, value = name.strip(), value.strip()
        if not sep or name not in LORA_KEYS:
            why = f"unknown key {name!r}" if sep else f"{part!r} is not KEY=VALUE"
            raise SymmemError(f"--lora {part}: {why}; the keys are {', '.join(LORA_KEYS)}")
        key = LORA_KEYS[name]
        if key == "target_modules":
            if not _MODULE_NAME.match(value):
                raise SymmemError(f"--lora {part}: {value!r} is not a module name (e.g. targets=q_proj,v_proj)")
            out[key] = [value]
        elif key == "r":
            number = _whole(value, f"--lora {part}", 2**20)
            if not number:
                raise SymmemError(f"--lora {part}: the rank r is a positive whole number, e.g. r=8")
            out[key] = number
        else:
            number = parse_value(value)
            if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(number) \
                    or number < 0 or (key == "lora_dropout" and number >= 1):
                what = "a probability in [0, 1)" if key == "lora_dropout" else "a number >= 0"
                raise SymmemError(f"--lora {part}: {name} is {what}")
            out[key] = number
    if "r" not in out:
        raise SymmemError(f"--lora {text}: give the rank, e.g. --lora r=8,alpha=16,targets=q_proj,v_proj")
    return out


def with_lora(loaded: Loaded, lora: dict[str, Any] | None) -> Loaded:
    """The loaded module wrapped by ``peft.get_peft_model`` with ``LoraConfig(**lora)`` (in place: its weights
    frozen, adapters added, on the weights' device); unchanged for None.  The adapters are then the only trainable
    parameters (:func:`symmem.trace` counts the frozen weights as weights alone)."""
    if lora is None:
        return loaded
    try:
        import peft
    except Exception as exc:
        raise SymmemError(f"--lora: peft is not importable here ({type(exc).__name__}: {_first_line(exc)}); "
                          "pip install peft==0.21.2") from None
    import warnings

    try:
        with warnings.catch_warnings():  # peft 0.21 asks transformers 5.23 a deprecated question (FutureWarning)
            warnings.simplefilter("ignore", FutureWarning)
            model = peft.get_peft_model(loaded.module, peft.LoraConfig(**lora))
    except Exception as exc:
        raise SymmemError(f"--lora: peft cannot wrap {loaded.spec}: {type(exc).__name__}: {_first_line(exc)}"
                          ) from None
    trainable, total = model.get_nb_trainable_parameters()
    note = f"LoRA ({', '.join(f'{k}={v}' for k, v in lora.items())}): {trainable:,} trainable of {total:,} parameters"
    return replace(loaded, module=model, notes=(*loaded.notes, note), extra={**loaded.extra, "lora": dict(lora)})


def _whole(text: str, what: str, limit: int) -> int | None:
    """``text`` as a whole number in 0..``limit``, or None when it is not one; a number over ``limit`` is an
    error naming ``what`` (its digits are counted first: Python refuses to convert more than 4300 of them)."""
    text = text.strip()
    if not _WHOLE.match(text):
        return None
    digits = text.replace("_", "").lstrip("+").lstrip("0") or "0"
    if len(digits) > len(str(limit)) or int(digits) > limit:
        shown = text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
        raise SymmemError(f"{what}: {shown} is more than {limit:,}")
    return int(digits)


def parse_multiples(text: str | None) -> dict[str, int] | None:
    """``Hi=32,Wi=32`` -> ``{"Hi": 32, "Wi": 32}``."""
    if not text:
        return None
    out: dict[str, int] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name, value = name.strip(), value.strip()
        number = _whole(value, f"--multiple-of {name}", MAX_SIZE) if sep else None
        if not sep or not name.isidentifier() or not number:
            raise SymmemError(f"--multiple-of {text!r}: expected NAME=POSITIVE_INT pairs, e.g. Hi=32,Wi=32")
        out[name] = number
    return out


def _first_tensor(example_inputs: Any) -> tuple[Any, Any]:
    import torch

    items = example_inputs.items() if isinstance(example_inputs, dict) else enumerate(example_inputs)
    for key, value in items:
        if isinstance(value, torch.Tensor):
            return key, value
    raise SymmemError("the example inputs hold no tensor to declare sizes on")


def parse_dims(text: str, loaded: Loaded | None) -> dict[str, list[tuple[Any, int]]]:
    """``--dims``: ``B,S`` (conventional positions on the first tensor input) or ``B=input_ids:0,S=input_ids:1``
    (explicit; a keyword or a position, ``B=0:0``).  The forms mix: ``B,S=input_ids:1``."""
    if not text or not text.strip():
        raise SymmemError("--dims names no symbol; e.g. --dims B,S or --dims B=input_ids:0,S=input_ids:1")
    out: dict[str, list[tuple[Any, int]]] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise SymmemError(f"--dims {text!r}: an empty entry")
        name, sep, where = part.partition("=")
        name = name.strip()
        if not name.isidentifier():
            raise SymmemError(f"--dims {text!r}: {name!r} is not a symbol name")
        if sep:
            key, colon, dim = where.strip().rpartition(":")
            number = _whole(dim, f"--dims {part!r}: the dimension", _MAX_DIMS - 1) if colon else None
            if not colon or not key or number is None:
                raise SymmemError(f"--dims {part!r}: expected NAME=INPUT:DIMENSION, e.g. S=input_ids:1")
            key = key.strip()
            index = _whole(key, f"--dims {part!r}: the position", 10**6)
            pos: Any = key if index is None else index
            if isinstance(pos, str) and not pos.isidentifier():
                raise SymmemError(f"--dims {part!r}: {key!r} is neither an input keyword nor a position")
            out.setdefault(name, []).append((pos, number))
            continue
        if name not in CONVENTIONAL:
            raise SymmemError(f"--dims: {name} has no conventional position (those are "
                              f"{', '.join(CONVENTIONAL)}); name its input and dimension: {name}=INPUT:DIMENSION")
        if loaded is None:
            raise SymmemError("--dims with conventional names needs the example inputs")
        key, first = _first_tensor(loaded.example_inputs)
        dim, ranks, what = CONVENTIONAL[name]
        ids = first.dim() == 2 and not (first.is_floating_point() or first.is_complex())
        if ranks is not None and (first.dim() not in ranks or (name == "S" and first.dim() == 2 and not ids)):
            raise SymmemError(f"--dims: {name} is a position of {what}; the first tensor input {key!r} has shape "
                              f"{tuple(first.shape)}: name its dimension, {name}={key}:DIMENSION")
        for k in (key, *loaded.follow):
            out.setdefault(name, []).append((k, dim))
    if loaded is not None:
        # inputs of the first input's shape (labels) must carry the same symbols, or the module sees a fixed-size
        # companion of a symbolic input and the trace only holds where their sizes agree: the Python API's check
        from .inputs import check_companions

        ex = loaded.example_inputs
        check_companions(ex if isinstance(ex, dict) else dict(enumerate(ex)), out, cli=True, follow=loaded.follow)
    return out


# -- loading ----------------------------------------------------------------------------------------------
def load(spec: str, *, config: dict[str, Any] | None = None, loss: str | None = None,
         inputs: Sequence[str] = ()) -> Loaded:
    """The module and example inputs ``spec`` names (module docstring)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SymmemError("tracing runs PyTorch, which is not installed: pip install torch==2.13.0") from None
    if not isinstance(spec, str) or ":" not in spec:
        raise SymmemError(f"unknown SPEC {spec!r}: expected package.module:callable, path/to/file.py:callable, "
                          "hf:MODEL_TYPE (or hf:org/name, hf:path/to/config.json), torchvision:NAME or timm:NAME")
    prefix, _, rest = spec.partition(":")
    if config and prefix != "hf":
        raise SymmemError("--config sets keys of a transformers config: it applies to hf: models only")
    if prefix == "hf":
        if inputs:
            raise SymmemError("--example gives example inputs to a callable that returns a module alone; hf: models "
                              "get theirs from the config")
        return _hf(spec, rest, config or {}, loss)
    if loss is not None:
        raise SymmemError(f"--loss {loss}: only hf: causal language models take it (they compute the loss from "
                          "labels); compute your module's loss inside its forward instead")
    if prefix in ("torchvision", "timm"):
        if inputs:
            raise SymmemError(f"--example: {prefix}: models get an image batch at their own input size")
        return _vision_zoo(spec, prefix, rest)
    return _callable(spec, inputs)


def _vision_zoo(spec: str, package: str, name: str) -> Loaded:
    import torch

    try:
        lib = importlib.import_module(package)
    except Exception as exc:  # ImportError, or a build that does not match this torch
        raise SymmemError(f"{spec}: {package} is not importable here ({type(exc).__name__}: "
                          f"{_first_line(exc)}); install a {package} built for this torch, or trace the module "
                          "through package.module:callable") from None
    if not name:
        raise SymmemError(f"{spec}: name a model, e.g. {package}:resnet18")
    try:
        if package == "torchvision":
            module = lib.models.get_model(name, weights=None)
            size = (3, 224, 224)
        else:
            module = lib.create_model(name, pretrained=False)
            size = tuple(getattr(module, "pretrained_cfg", {}).get("input_size", (3, 224, 224)))
    except Exception as exc:
        raise SymmemError(f"{spec}: {package} cannot build {name!r}: {_first_line(exc)}") from None
    g = torch.Generator().manual_seed(0)
    return Loaded(spec, module, (torch.randn(EXAMPLE_BATCH, *size, generator=g),))


def _callable(spec: str, inputs: Sequence[str]) -> Loaded:
    import torch

    where, _, attr = spec.rpartition(":")
    if not where or not attr or not _NAME.match(attr):
        raise SymmemError(f"unknown SPEC {spec!r}: expected package.module:callable or path/to/file.py:callable")
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise SymmemError(f"{spec}: no file {where}")
        name = f"symmem_user_{re.sub(r'[^A-Za-z0-9_]', '_', path.stem)}"
        try:
            found = importlib.util.spec_from_file_location(name, path)
            if found is None or found.loader is None:
                raise ImportError(f"cannot load {where}")
            mod = importlib.util.module_from_spec(found)
            sys.modules[name] = mod
            with user_code(f"{spec}: importing {where}"):
                found.loader.exec_module(mod)
        except SymmemError:
            sys.modules.pop(name, None)
            raise
        except Exception as exc:
            sys.modules.pop(name, None)
            raise SymmemError(f"{spec}: {where} does not import: {type(exc).__name__}: {_first_line(exc)}") from None
    else:
        if not _NAME.match(where):
            raise SymmemError(f"unknown SPEC {spec!r}: {where!r} is not a module path (package.module) or a .py file")
        try:
            with user_code(f"{spec}: importing {where}"):
                mod = importlib.import_module(where)
        except SymmemError:
            raise
        except Exception as exc:
            raise SymmemError(f"{spec}: module {where!r} does not import: {type(exc).__name__}: "
                              f"{_first_line(exc)}") from None
    target: Any = mod
    for part in attr.split("."):
        if not hasattr(target, part):
            known = sorted(n for n, v in vars(mod).items() if not n.startswith("_") and callable(v)
                           and getattr(v, "__module__", None) == mod.__name__)
            raise SymmemError(f"{spec}: {where} has no {attr!r}; its callables: {', '.join(known[:12]) or 'none'}")
        target = getattr(target, part)
    if not callable(target):
        raise SymmemError(f"{spec}: {attr} is a {type(target).__name__}, not a callable")
    try:
        with user_code(f"{spec}: calling {attr}()"):
            result = target()
    except SymmemError:
        raise
    except Exception as exc:
        raise SymmemError(f"{spec}: calling {attr}() failed: {type(exc).__name__}: {_first_line(exc)}") from None
    if isinstance(result, torch.nn.Module):
        if not inputs:
            raise SymmemError(f"{spec}: {attr}() returned a module without example inputs: give them with "
                              f"--example {_example_hint(result)}, or return (module, example_inputs)")
        return Loaded(spec, result, tuple(_example(text) for text in inputs))
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.nn.Module):
        if inputs:
            raise SymmemError(f"{spec}: {attr}() returns its example inputs; drop --example")
        module, example = result
        if isinstance(example, torch.Tensor):
            example = (example,)
        if not isinstance(example, tuple | list | dict):
            raise SymmemError(f"{spec}: {attr}() returned example inputs of type {type(example).__name__}; expected "
                              "a tuple (positional) or a dict (keyword) of tensors and values")
        return Loaded(spec, module, tuple(example) if isinstance(example, list) else example)
    raise SymmemError(f"{spec}: {attr}() returned {type(result).__name__}, not a torch.nn.Module or a "
                      "(module, example_inputs) pair")


def _example_hint(module: Any) -> str:
    """An ``--example`` that fits the first layer that fixes an input width (the hint a user can paste)."""
    import torch

    conv = {torch.nn.Conv1d: "16", torch.nn.Conv2d: "32x32", torch.nn.Conv3d: "8x8x8"}
    for layer in module.modules():
        if isinstance(layer, torch.nn.Embedding | torch.nn.EmbeddingBag):
            return "2x8:int64 (token ids)"
        if isinstance(layer, torch.nn.Linear):
            return f"2x{layer.in_features} (float; {type(layer).__name__} takes {layer.in_features} features)"
        for kind, space in conv.items():
            if type(layer) is kind:
                name = type(layer).__name__
                return f"2x{layer.in_channels}x{space} (float; {name} takes {layer.in_channels} channels)"
    return "2x784 (float) or --example 2x8:int64"


def _example(text: str) -> Any:
    """``--example 2x3x32x32`` (float32, random) or ``2x8:int64`` (zeros)."""
    import torch

    m = _SHAPE.match(text.strip())
    if not m:
        raise SymmemError(f"--example {text!r}: expected sizes like 2x3x32x32, optionally :int64 or :float32")
    shown = text if len(text) <= 60 else f"{text[:40]}...({len(text)} characters)"
    found = [_whole(x, f"--example {shown}: a size", MAX_SIZE) for x in m.group(1).split("x")]
    if any(x is None for x in found):
        raise SymmemError(f"--example {shown}: expected sizes like 2x3x32x32 (underscores only between digits)")
    sizes = tuple(int(x) for x in found if x is not None)
    dtype = getattr(torch, m.group(2) or "float32", None)
    if not isinstance(dtype, torch.dtype):
        raise SymmemError(f"--example {shown}: unknown dtype {m.group(2)!r}")
    nbytes = math.prod(sizes) * dtype.itemsize
    if nbytes > _memory():
        raise SymmemError(f"--example {shown}: a tensor of {nbytes:,} bytes, more than this machine's memory "
                          f"({_memory():,} bytes); give smaller example sizes (the formula keeps them symbolic)")
    try:
        if dtype.is_floating_point:
            return torch.randn(sizes, generator=torch.Generator().manual_seed(0)).to(dtype)
        return torch.zeros(sizes, dtype=dtype)
    except (RuntimeError, MemoryError) as exc:
        raise SymmemError(f"--example {shown}: cannot allocate a tensor of {nbytes:,} bytes: "
                          f"{type(exc).__name__}: {_first_line(exc)[:160]}") from None


def _memory() -> int:
    """This machine's physical memory in bytes (the largest size PyTorch allows where it cannot be read)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return MAX_SIZE


# -- Hugging Face ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    """transformers' own warnings (config checks, weight initialisation) off while a model is built."""
    logging = transformers.utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def _transformers(spec: str) -> Any:
    try:
        import transformers
    except Exception as exc:
        raise SymmemError(f"{spec}: transformers is not importable here ({type(exc).__name__}: "
                          f"{_first_line(exc)}); pip install transformers==5.23.0") from None
    return transformers


def _hf_config(transformers: Any, found: Any, overrides: dict[str, Any]) -> Any:
    """The transformers config: the class's defaults (a model type) or the file's keys, then ``--config``."""
    model_type, where = found.model_type, found.target
    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type not in known:
        close = difflib.get_close_matches(model_type, known, n=4)
        hint = f"; did you mean {', '.join(close)}?" if close else "; e.g. gpt2, bert, llama, vit"
        hub = "" if found.origin != "model type" else " (a Hub id is org/name: hf:openai-community/gpt2)"
        of = "" if found.origin == "model type" else f" (the model_type of {found.origin})"
        raise SymmemError(f"unknown model type {model_type!r}{of} for transformers {transformers.__version__}{hint}"
                          f"{hub}")
    cls = transformers.CONFIG_MAPPING[model_type]
    with _quiet_transformers(transformers):
        try:
            default = cls(**found.values)
        except Exception as exc:
            raise SymmemError(f"hf:{where}: transformers' {cls.__name__} refuses the keys of {found.origin}: "
                              f"{type(exc).__name__}: {_first_line(exc)}") from None
        for key in overrides:
            if not hasattr(default, key):
                raise SymmemError(f"--config {key}: the {model_type} config ({cls.__name__}) has no key "
                                  f"{key!r}; {key_hint(default, key)}")
        if not overrides:
            return default
        try:  # given to the class, as the file's keys are: values derived from them (head_dim) follow
            return cls(**{**found.values, **overrides})
        except Exception as exc:
            raise SymmemError(f"--config: the {model_type} config refuses {overrides}: {_first_line(exc)}") from None


def _hf_class(transformers: Any, model_type: str, cfg: Any) -> tuple[str, Any]:
    """How the model is built: ``vision``, ``seq2seq`` (encoder-decoder), ``causal`` or ``base``, and its auto
    class."""
    from transformers.models.auto import modeling_auto

    vision = hasattr(cfg, "image_size") and hasattr(cfg, "num_channels") and not hasattr(cfg, "vocab_size")
    if vision and model_type in modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES:
        return "vision", transformers.AutoModelForImageClassification
    if vision:
        return "vision", transformers.AutoModel
    seq2seq = modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    if getattr(cfg, "is_encoder_decoder", False) and model_type in seq2seq:
        return "seq2seq", transformers.AutoModelForSeq2SeqLM
    if (model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
            and model_type not in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES):
        return "causal", transformers.AutoModelForCausalLM
    return "base", transformers.AutoModel


def _hf(spec: str, target: str, config: dict[str, Any], loss: str | None) -> Loaded:
    import torch

    from .hub import locate

    transformers = _transformers(spec)
    found = locate(target)
    overrides = dict(config)
    attn = overrides.pop("attn_implementation", None)
    cfg = _hf_config(transformers, found, overrides)
    model_type = found.model_type
    layers = getattr(cfg, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > MAX_TRACED_LAYERS:
        # each layer is built and traced (about 0.15 s a layer for GPT-2), yet the formula has them as L
        raise SymmemError(f"hf:{target} with {layers:,} layers would take minutes to build and trace; trace "
                          f"it with a few (--config num_hidden_layers=2): the layers that repeat stay symbolic "
                          f"(L), and --set L={layers} evaluates the formula at {layers:,} (at most "
                          f"{MAX_TRACED_LAYERS} layers are traced)")
    kind, auto = _hf_class(transformers, model_type, cfg)
    if loss is not None and kind not in ("causal", "seq2seq"):
        raise SymmemError(f"--loss {loss}: hf:{target} is built with {auto.__name__}, not as a causal language "
                          "model nor a sequence-to-sequence one; only those compute their loss from labels here")
    kwargs = {"attn_implementation": attn} if attn is not None else {}
    notes = [] if found.origin == "model type" else [f"config: {found.origin}"]
    with _quiet_transformers(transformers):
        try:
            with torch.device("meta"):
                module = auto.from_config(cfg, **kwargs)
            count = sum(p.numel() for p in module.parameters())
            if count <= REAL_WEIGHTS_MAX:
                torch.manual_seed(0)
                module = auto.from_config(cfg, **kwargs)
            else:
                notes.append(f"built on the meta device: {count:,} parameters > {REAL_WEIGHTS_MAX:,}; no weights "
                             "allocated, no check forward")
        except Exception as exc:
            raise SymmemError(f"{spec}: transformers cannot build {auto.__name__}.from_config: "
                              f"{type(exc).__name__}: {_first_line(exc)}") from None
    dtypes = {p.dtype for p in module.parameters()}
    if dtypes and dtypes != {torch.float32}:
        # from_config builds in the config's dtype (a Hub config's "torch_dtype"), as transformers does
        notes.append(f"built in {', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}, the config's "
                     "dtype (--config dtype=float32 for FP32 weights)")
    example, follow = _hf_inputs(target, kind, cfg, loss)
    return Loaded(spec, module, example, follow, tuple(notes), loss if kind != "vision" else None,
                  {"config": cfg, "class": type(module).__name__, "origin": found.origin})


def _hf_inputs(target: str, kind: str, cfg: Any, loss: str | None) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The example inputs of an ``hf:`` model and those built with the first input's layout: ``pixel_values``
    (vision), ``input_ids`` (text), with ``decoder_input_ids`` for an encoder-decoder and ``labels`` (shaped like
    the tokens the model predicts) for a loss."""
    import torch

    g = torch.Generator().manual_seed(0)
    if kind == "vision":
        side = cfg.image_size
        hi, wi = (side, side) if isinstance(side, int) else tuple(side)
        return {"pixel_values": torch.randn(EXAMPLE_BATCH, cfg.num_channels, hi, wi, generator=g)}, ()
    vocab = getattr(cfg, "vocab_size", None)
    if not isinstance(vocab, int):
        raise SymmemError(f"hf:{target}: its config has neither a vocabulary (text) nor an image size "
                          "(vision); trace it from Python with symmem.trace")
    tokens = EXAMPLE_TOKENS
    limit = getattr(cfg, "max_position_embeddings", None)
    if isinstance(limit, int) and limit >= 2:
        tokens = min(tokens, limit)
    ids = torch.randint(0, vocab, (EXAMPLE_BATCH, tokens), generator=g)
    example: dict[str, Any] = {"input_ids": ids}
    if kind == "seq2seq":
        # as a seq2seq data collator does: the decoder's inputs given, not shifted from the labels by the model
        # (T5's config has no decoder_start_token_id to shift with unless its file sets one)
        example["decoder_input_ids"] = torch.randint(0, vocab, (EXAMPLE_BATCH, tokens), generator=g)
    if loss is not None:
        example["labels"] = ids.clone() if kind != "seq2seq" else example["decoder_input_ids"].clone()
    return example, tuple(k for k in example if k != "input_ids")


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run the user's code (a module's import, its callable, its forward): a ``sys.exit`` in it, or a
    ``KeyboardInterrupt`` it raises itself, is a :class:`SymmemError` naming ``what`` and what the code did,
    instead of a silent exit or a traceback.  A real Ctrl-C (SIGINT while it runs) still interrupts: a SIGINT
    handler notes it, then does what the one before it did.

    Python runs a signal's handler in whatever Python code the main thread runs next; when that is a weak
    reference's callback (the recorder's storage finalizers run on every free), a ``__del__`` or a collection's
    callback, the ``KeyboardInterrupt`` it raises is printed as unraisable and lost, and the code would run on to
    exit 0.  So an interrupt the handler raised that did not come out is raised again when the code returns."""
    import signal
    import threading

    pressed: list[int] = []
    raised: list[int] = []  # the handler raised KeyboardInterrupt (the one before it did, or would have)
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)

        def noted(signum: int, frame: Any) -> None:
            pressed.append(signum)
            if callable(previous):
                try:
                    previous(signum, frame)
                except KeyboardInterrupt:
                    raised.append(signum)
                    raise
            elif previous != signal.SIG_IGN:
                raised.append(signum)
                raise KeyboardInterrupt

        signal.signal(signal.SIGINT, noted)
    try:
        yield
        if raised:  # swallowed on its way out (an unraisable context): the Ctrl-C still interrupts
            raise KeyboardInterrupt
    except SystemExit as exc:
        raise SymmemError(f"{what}: the code called sys.exit({exc.code!r}); symmem runs it and needs it to return "
                          "(exit only under if __name__ == '__main__')") from None
    except KeyboardInterrupt:
        if pressed:  # Ctrl-C
            raise
        raise SymmemError(f"{what}: the code raised KeyboardInterrupt itself (no Ctrl-C was pressed); symmem runs "
                          "it and needs it to return") from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def key_hint(config: Any, key: str) -> str:
    """What to say of a ``key`` a transformers ``config`` does not have: the close names, else its first keys."""
    keys = sorted(k for k in config.to_dict() if not k.startswith("_"))
    close = difflib.get_close_matches(key, keys, n=3)
    return f"did you mean {', '.join(close)}?" if close else f"its keys: {', '.join(keys[:20])} …"


def _first_line(exc: BaseException) -> str:
    """The start of an exception's message on one line (a message ending in ':' takes its next line too)."""
    lines = [x.strip() for x in str(exc).strip().splitlines() if x.strip()]
    if not lines:
        return type(exc).__name__
    text = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return text[:300]


# -- tracing and measuring -------------------------------------------------------------------------------
def trace(loaded: Loaded, dims: dict[str, Any], *, method: str = "auto", check: bool = True,
          multiple_of: dict[str, int] | None = None, device: str = "cpu", **options: Any) -> Any:
    """:func:`symmem.api.trace` of a loaded module; a module that fails on fake tensors (an error that is
    not symmem's own) is a :class:`SymmemError` naming the exception."""
    from ..api import trace as trace_module

    try:
        if loaded.loss is not None:  # the model computes its loss from the labels: the step is that loss
            options.setdefault("loss", "output")
        with user_code(f"{loaded.spec}: tracing the module"):
            return trace_module(loaded.module, loaded.example_inputs, dims, method=method, check=check,
                                multiple_of=multiple_of, device=device, name=loaded.spec, **options)
    except SymmemError:
        raise
    except Exception as exc:
        raise SymmemError(f"{loaded.spec} cannot be traced on fake tensors: {type(exc).__name__}: "
                          f"{_first_line(exc)} (try --method fit, which runs real tensors)") from None


def _tile(t: Any, dim: int, size: int) -> Any:
    n = t.shape[dim]
    reps = [1] * t.dim()
    reps[dim] = -(-size // n)
    return t.repeat(*reps).narrow(dim, 0, size).clone()


def resized(loaded: Loaded, dims: dict[str, Any], values: dict[str, int]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example inputs with every declared dimension at ``values`` (tiled: token ids and masks keep their
    patterns), as positional and keyword arguments."""
    import torch

    from .inputs import normalize_dims

    wanted: dict[Any, dict[int, int]] = {}
    for name, pairs in normalize_dims(dims).items():
        for key, dim in pairs:
            wanted.setdefault(key, {})[dim] = values[name]
    ex = loaded.example_inputs
    items = list(ex.items()) if isinstance(ex, dict) else list(enumerate(ex))
    out = []
    for key, value in items:
        if isinstance(value, torch.Tensor) and key in wanted:
            t = value.detach()
            for dim, size in wanted[key].items():
                t = _tile(t, dim % t.dim(), size)
            value = t.requires_grad_(value.requires_grad) if value.is_floating_point() else t
        out.append((key, value))
    if isinstance(ex, dict):
        return (), dict(out)
    return tuple(v for _, v in out), {}


def verify_module(loaded: Loaded, derivation: Any, dims: dict[str, Any]) -> Any:
    """Measure one real training-mode forward of the loaded module at the derivation's numbers and compare
    with its formula (:func:`symmem.record.verify.compare`)."""
    from ..record.verify import compare, measure

    if loaded.on_meta:
        raise SymmemError(f"{loaded.spec}: the weights are on the meta device; there is no real forward to measure")
    device = str(derivation.options.get("device", "cpu"))
    where = {p.device.type for p in loaded.module.parameters()} or {"cpu"}
    if where != {device.split(":")[0]}:
        raise SymmemError(f"the formula is for {device} and the module is on {', '.join(sorted(where))}: measuring "
                          f"it there would compare another device's kernels (verify on {device} needs that device)")
    numbers = {s.name: int(v) for s, v in derivation.numbers.items()}
    args, kwargs = resized(loaded, dims, numbers)
    from .wrap import autocasting

    # measured as it was traced: under the derivation's autocast (--autocast), else the module's own dtypes
    with user_code(f"{loaded.spec}: measuring the module"), autocasting(derivation.options.get("autocast"), device):
        measured = measure(loaded.module, *args, **kwargs)
    return compare(derivation, measured)
