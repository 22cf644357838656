"""Conventions: which tensors a training step keeps for backward.

A convention answers, for one op node, "which tensors does this op keep?" as a list of :class:`Saved`
references: an input of the op, its output, or a new tensor only the op holds (max-pool indices, a dropout
mask, normalization statistics).  Two families:

* **role conventions** (``paper``) are data: a set of tensor roles that are kept, plus extra tensors per op
  kind.  They count tensors as the accounting they reproduce does, with no storage sharing.
* **rule conventions** (``pytorch``) have one rule per op kind and count every storage once.

>>> c = convention("paper")
>>> sorted(c.keep_outputs)[:3]
['attn_probs', 'main_path', 'mlp_hidden']
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from .errors import SymmemError
from .tensor import TensorSpec


@dataclass(frozen=True)
class Saved:
    """One tensor an op keeps: ``source`` is ``"input"`` (with ``index``), ``"output"`` or ``"new"``.

    ``new`` tensors are storages only this op holds; ``spec`` gives their shape and dtype, ``label`` names
    them (``indices``, ``mask``, ``mean`` ...).  ``role`` overrides the role shown in breakdowns.
    """

    source: str
    index: int = 0
    label: str = ""
    spec: TensorSpec | None = None
    role: str | None = None


class Convention:
    """Base class: a name, a description, and :meth:`saved` for one node."""

    # Subclasses set: ``name``, ``description``, ``dedup`` (count each storage once, or each kept reference
    # as the accounting it mirrors does) and ``options`` (what the convention understands, with defaults).
    name: str
    description: str
    dedup: bool
    options: Mapping[str, Any]

    def saved(self, graph: nx.DiGraph, node: str, options: Mapping[str, Any]) -> list[Saved]:
        raise NotImplementedError

    def extra_terms(self, terms: list[Any], options: Mapping[str, Any]) -> list[Any]:
        """Terms the accounting adds on top of the kept tensors (CS231n's x2 for backward); none by default."""
        return []


@dataclass(frozen=True)
class Extra:
    """A tensor a role convention adds for every op of a kind: shaped like the op's output."""

    label: str
    dtype: str
    role: str


@dataclass(frozen=True)
class RoleConvention(Convention):
    """A convention that is data: kept output roles, kept input roles and extra tensors per op kind."""

    name: str
    description: str
    keep_outputs: frozenset[str]
    #: role of a consumer node -> indices of its inputs that are kept (e.g. the projection shortcut's input)
    keep_inputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    extras: Mapping[str, tuple[Extra, ...]] = field(default_factory=dict)
    dedup: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def saved(self, graph: nx.DiGraph, node: str, options: Mapping[str, Any]) -> list[Saved]:
        data = graph.nodes[node]
        role = data["out"].role
        found: list[Saved] = []
        if role in self.keep_outputs:
            found.append(Saved("output", role=role))
        for i in self.keep_inputs.get(role or "", ()):
            found.append(Saved("input", index=i, label=f"input {i}", role=f"{role}_input"))
        for extra in self.extras.get(data["kind"], ()):
            found.append(Saved("new", label=extra.label, role=extra.role,
                               spec=TensorSpec(data["out"].shape, extra.dtype, extra.role)))
        return found


PAPER = RoleConvention(
    name="paper",
    description=(
        "The seed paper's accounting (FP32 analysis of ResNet-50 and ViT-B/16): per ResNet bottleneck the "
        "1x1-reduce, 3x3 and 1x1-expand conv outputs (6PHW), the input of each projection shortcut, the "
        "conv1 and max-pool outputs and max-pool indices at 4 bytes; per transformer layer the two residual "
        "inputs, Q, K, V and the MLP hidden (9BSH) plus the B*h*S^2 attention probabilities when attention "
        "is naive, and the patch-embedding output once."
    ),
    keep_outputs=frozenset({"stem", "stem_pool", "main_path", "residual", "qkv", "mlp_hidden", "attn_probs",
                            "patch_embed"}),
    keep_inputs={"downsample": (0,)},
    extras={"maxpool2d": (Extra("indices", "int32", "indices"),)},
)

_REGISTRY: dict[str, Convention | Callable[[], Convention]] = {"paper": PAPER}


def register(name: str, conv: Convention | Callable[[], Convention]) -> None:
    """Make a convention (or a zero-argument factory for one) available by name."""
    _REGISTRY[name] = conv


def convention(name: str | Convention) -> Convention:
    """The convention called ``name``; a :class:`SymmemError` lists the known ones otherwise."""
    if isinstance(name, Convention):
        return name
    _load_builtin()
    try:
        found = _REGISTRY[name]
    except KeyError:
        raise SymmemError(f"unknown convention {name!r}; known: {', '.join(names())}") from None
    if not isinstance(found, Convention):
        found = found()
        _REGISTRY[name] = found
    return found


def names() -> tuple[str, ...]:
    """Every known convention name."""
    _load_builtin()
    return tuple(_REGISTRY)


def _load_builtin() -> None:
    # Conventions in their own modules register themselves on import; importing here keeps one lookup.
    import importlib

    for module in ("symmem.pytorch", "symmem.megatron", "symmem.cs231n"):
        importlib.import_module(module)
