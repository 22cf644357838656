"""Built-in model builders, looked up by name.

A builder is a function of keyword options that returns a :class:`~symmem.graph.Model`.  Register one with
:func:`register`; :func:`build` checks the options against what the builder declares.

>>> m = build("vit-b16", attention="sdpa")
>>> m.name, [s.name for s in m.free]
('vit-b16', ['B', 'S', 'H', 'h', 'L'])
>>> "resnet50" in available()
True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import SymmemError
from ..graph import Model


@dataclass(frozen=True)
class Option:
    """A builder option: its default, its allowed values (None: any) and a help line."""

    default: Any
    choices: tuple[Any, ...] | None = None
    help: str = ""


@dataclass(frozen=True)
class Entry:
    name: str
    builder: Callable[..., Model]
    description: str
    options: Mapping[str, Option] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)


_MODELS: dict[str, Entry] = {}
_MODULES = ("resnet", "vgg", "mlp", "vit", "gpt", "bert", "llama", "megatron_gpt", "counts")


def register(name: str, builder: Callable[..., Model], description: str,
             options: Mapping[str, Option] | None = None, **fixed: Any) -> None:
    """Make ``builder`` (called with ``fixed`` and the user's options) available as ``name``."""
    _MODELS[name] = Entry(name, builder, description, dict(options or {}), fixed)


def _load() -> None:
    for module in _MODULES:
        importlib.import_module(f"{__name__}.{module}")


def available() -> dict[str, Entry]:
    """Every built-in model, by name."""
    _load()
    return dict(_MODELS)


def entry(name: str) -> Entry:
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
        allowed = e.options[key].choices
        if allowed is not None and value not in allowed:
            raise SymmemError(f"model {name!r}: option {key}={value!r} is not one of {list(allowed)}")
        chosen[key] = value
    return e.builder(name=name, **e.fixed, **chosen)
