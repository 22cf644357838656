"""The ``pytorch`` convention: what eager PyTorch 2.x autograd saves for backward, one rule per op kind.

Each rule reads one node and returns the tensors its backward needs (:class:`~symmem.conventions.Saved`):
inputs, the output, or new tensors only the op holds (indices, masks, statistics).  The derivation counts
every storage once, resolves views to their base storage, and leaves parameters and the input batch apart.
Rules live by family: :mod:`.common` (views, arithmetic that saves nothing, linear, dropout), :mod:`.vision`
(conv, batchnorm, pools, ReLU), :mod:`.sequence` (norms, activations, attention, embeddings).

>>> from symmem.conventions import convention
>>> convention("pytorch").dedup
True
>>> from symmem import ops
>>> set(ops.kinds()) == set(rule_kinds()) | set(convention("pytorch").unsupported)
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from ...errors import node_error
from ...graph import Graph, Node
from ...tensor import TensorSpec
from .. import Convention, Saved, register


@dataclass(frozen=True)
class RuleContext:
    """What a save rule sees: the node, its input and output specs, its attributes and the options."""

    graph: Graph
    node: Node
    inputs: tuple[TensorSpec, ...]
    options: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return self.node.kind

    @property
    def out(self) -> TensorSpec:
        return self.node.out

    @property
    def attrs(self) -> Mapping[str, Any]:
        return self.node.attrs

    def input(self, i: int = 0, role: str | None = None) -> Saved:
        return Saved("input", index=i, role=role)

    def output(self, role: str | None = None) -> Saved:
        return Saved("output", role=role)

    def new(self, label: str, shape: tuple[Any, ...], dtype: str, role: str | None = None, host: bool = False
            ) -> Saved:
        return Saved("new", label=label, spec=TensorSpec(tuple(sympy.sympify(d, strict=True) for d in shape), dtype,
                                                         role or label), role=role or label, host=host)

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
                   "(see symmem/conventions/pytorch/ for the rule of every op kind and its source).")
    dedup = True
    options: Mapping[str, Any] = {"device": "cuda"}
    #: Op kinds with no save rule, and why.
    unsupported: Mapping[str, str] = {
        "rotary": "a fused rotary-embedding kernel differs per library; build rotary from mul, slice, neg, "
                  "concat and add as Hugging Face does (symmem.models.llama)",
    }

    def saved(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> list[Saved]:
        rule = _RULES.get(node.kind)
        if rule is None:
            why = self.unsupported.get(node.kind, f"it knows: {', '.join(sorted(_RULES))}")
            raise node_error(node.name, node.kind, f"the pytorch convention has no rule for this op kind: {why}")
        if options.get("device", "cuda") not in ("cuda", "cpu"):
            raise node_error(node.name, node.kind, f"device {options.get('device')!r} is not 'cuda' or 'cpu'")
        ctx = RuleContext(graph, node, tuple(graph.node(i).out for i in node.inputs), options)
        return rule(ctx)

    def grads(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> Any:
        """What ``node``'s backward allocates (:mod:`.backward`)."""
        rule = backward.rule(node.kind)
        if rule is None:
            raise node_error(node.name, node.kind, "the pytorch convention has no backward rule for this op kind")
        return rule(RuleContext(graph, node, tuple(graph.node(i).out for i in node.inputs), options))


    def finds_nothing(self, graph: Graph) -> str | None:
        # asked only when nothing was kept: a network that trains keeps something for backward
        if any(graph.node(n).role == "activations" for n in graph.order()):
            return ("the pytorch convention follows real ops, and this graph only stands for a network by its "
                    "activation count, so autograd keeps nothing in it; use --convention cs231n (every layer's "
                    "output, twice for backward) or trace the real module (symmem trace)")
        return ("autograd keeps no activation for backward in this graph (no op whose backward needs a "
                "tensor): the formula is the parameter side and the input alone")


register("pytorch", PytorchConvention())

from . import backward, common, sequence, vision  # noqa: E402,F401  (rules register themselves on import)
