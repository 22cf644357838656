"""The ``pytorch`` convention: what eager PyTorch 2.x autograd saves for backward, one rule per op kind.

Each rule reads one node and returns the tensors its backward needs (:class:`~symmem.conventions.Saved`):
inputs, the output, or new tensors only the op holds (indices, masks, statistics).  The derivation counts
every storage once, resolves views to their base storage, and leaves parameters and the input batch apart.
Rules live by family: :mod:`.common` (views, arithmetic that saves nothing, linear, dropout), :mod:`.vision`
(conv, batchnorm, pools, ReLU), :mod:`.sequence` (norms, activations, attention, embeddings).

>>> from symmem.conventions import convention
>>> convention("pytorch").dedup
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import networkx as nx
import sympy

from ..conventions import Convention, Saved, register
from ..errors import node_error
from ..tensor import TensorSpec


@dataclass(frozen=True)
class RuleContext:
    """What a save rule sees: the node, its input and output specs, its attributes and the options."""

    graph: nx.DiGraph
    node: str
    kind: str
    inputs: tuple[TensorSpec, ...]
    out: TensorSpec
    attrs: Mapping[str, Any]
    options: Mapping[str, Any]

    def input(self, i: int = 0, role: str | None = None) -> Saved:
        return Saved("input", index=i, role=role)

    def output(self, role: str | None = None) -> Saved:
        return Saved("output", role=role)

    def new(self, label: str, shape: tuple[Any, ...], dtype: str, role: str | None = None) -> Saved:
        return Saved("new", label=label, spec=TensorSpec(tuple(sympy.sympify(d) for d in shape), dtype,
                                                         role or label), role=role or label)

    @property
    def device(self) -> str:
        return str(self.options.get("device", "cuda"))


SaveRule = Callable[[RuleContext], list[Saved]]
_RULES: dict[str, SaveRule] = {}


def saves(*kinds: str) -> Callable[[SaveRule], SaveRule]:
    """Register a save rule for the op kinds ``kinds``."""

    def wrap(fn: SaveRule) -> SaveRule:
        for kind in kinds:
            _RULES[kind] = fn
        return fn

    return wrap


def rule_kinds() -> tuple[str, ...]:
    """Op kinds the pytorch convention has a rule for."""
    return tuple(_RULES)


class PytorchConvention(Convention):
    name = "pytorch"
    description = ("What eager PyTorch 2.x autograd keeps for backward, op by op, each storage counted once "
                   "(see symmem/pytorch/ for the rule of every op kind and its source).")
    dedup = True
    options: Mapping[str, Any] = {"device": "cuda"}

    def saved(self, graph: nx.DiGraph, node: str, options: Mapping[str, Any]) -> list[Saved]:
        data = graph.nodes[node]
        kind = data["kind"]
        rule = _RULES.get(kind)
        if rule is None:
            raise node_error(node, kind, "the pytorch convention has no rule for this op kind; "
                             f"it knows: {', '.join(sorted(_RULES))}")
        if options.get("device", "cuda") not in ("cuda", "cpu"):
            raise node_error(node, kind, f"device {options.get('device')!r} is not 'cuda' or 'cpu'")
        ctx = RuleContext(graph, node, kind, tuple(graph.nodes[i]["out"] for i in data["inputs"]), data["out"],
                          data["attrs"], options)
        return rule(ctx)


register("pytorch", PytorchConvention())

from . import common, sequence, vision  # noqa: E402,F401  (rules register themselves on import)
