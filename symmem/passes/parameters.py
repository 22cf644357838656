"""A graph's parameters as PyTorch holds them: each node's (name, shape), and the order ``model.parameters()``
lists them in -- the order a for-loop optimizer steps them and ZeroRedundancyOptimizer partitions them.

A free-standing parameter node is a ``nn.Parameter`` of the module its name's scope names: one at the root (a
class token, a position table: no dot in its name) is the root's own and comes first; one inside a submodule
(Llama's norm weights) stands with that submodule.  Submodules are listed in the order they run, except where
the model's graph says a module registers a child after others (``graph.graph["registered_after"]``: child ->
the sibling it follows, as HF's LlamaDecoderLayer registers its norms after ``self_attn`` and ``mlp``).

>>> from symmem.models import build
>>> g = build("llama").graph
>>> [n for n, _ in in_registration_order(g, program_parameters(g))][-5:]  # as LlamaForCausalLM lists them
['layers.mlp.down_proj.weight', 'layers.input_layernorm.weight', 'layers.post_attention_layernorm.weight', \
'norm.weight', 'lm_head.weight']

Each parameter's optimizer state, as storages (:func:`state_storages`), is here too: the schedule's step and
ZeroRedundancyOptimizer's per-rank state count it by the one rule.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import Any

import sympy

from ..symbols import N
from ..training import Regime
from .unroll import iteration, template

Listed = list[tuple[str, tuple[sympy.Expr, ...]]]


def node_parameters(name: str, node: Any) -> Listed:
    """The parameters one node holds, as the schedule names them: a parameter node is one (its own name), an op
    node one per parameter (``<node>.<param>``)."""
    if node.kind == "parameter":
        return [(name, tuple(node.params["value"]))]
    return [(f"{name}.{p}", tuple(shape)) for p, shape in node.params.items()]


def program_parameters(graph: Any, named: Iterable[tuple[str, Any]] | None = None) -> Listed:
    """Every parameter of ``graph`` (or of the ``(name, node)`` pairs ``named``), in the order the nodes run."""
    pairs = named if named is not None else ((n, graph.node(n)) for n in graph.program_order())
    return [p for n, node in pairs for p in node_parameters(n, node)]


def in_registration_order(graph: Any, params: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """``params`` (in the order their nodes run) as ``model.parameters()`` lists them (module docstring)."""
    listed = sorted(params, key=lambda p: "." in template(p[0]))  # the root's own first; stable otherwise
    for child, anchor in graph.graph.get("registered_after", {}).items():
        listed = _registered_after(listed, child, anchor)
    return listed


def _registered_after(listed: list[tuple[str, Any]], child: str, anchor: str) -> list[tuple[str, Any]]:
    """``listed`` with each parameter of a submodule named ``child`` moved after the last parameter of the
    submodule ``anchor`` in the same layer."""
    # each name's module path and layer worked out once (a 32-layer stack moves a parameter per layer past
    # every other: ~20,000 look-ups)
    segments = {q[0]: template(q[0]).split(".") for q in listed}
    layer_of = {q[0]: iteration(q[0]) for q in listed}
    out = list(listed)
    for item in [q for q in listed if child in segments[q[0]]]:
        out.remove(item)
        layer = layer_of[item[0]]  # 0: outside the repeated blocks, after the anchor's last parameter anywhere
        last = next((i for i in range(len(out) - 1, -1, -1)
                     if anchor in segments[out[i][0]] and layer in (0, layer_of[out[i][0]])), None)
        out.insert(last + 1 if last is not None else len(out), item)
    return out


def state_storages(regime: Regime, name: str, held: tuple[sympy.Expr, ...], on_host: bool
                   ) -> list[tuple[str, str, sympy.Expr, None, bool]]:
    """The optimizer state of one parameter (``held``: the shape its optimizer steps on) as storages
    (:meth:`symmem.passes.schedule.Simulation.new`'s arguments): one per component, each divided by ``N`` where
    ``--zero`` shards it, and Adam's step count.

    >>> [(n, str(b)) for n, _, b, _, _ in state_storages(Regime(optimizer="adamw"), "fc.weight", (3, 4), False)]
    [('fc.weight.exp_avg', '48'), ('fc.weight.exp_avg_sq', '48'), ('fc.weight.step', '4')]
    """
    out = [(f"{name}.{s}", "optimizer_state", e, None, False) for s, e in _state_sizes(regime, tuple(held))]
    # Adam's step count is a scalar, not a per-element component: no stage shards it (the papers omit it)
    if regime.optimizer in ("adam", "adamw") and out:
        out.append((f"{name}.step", "optimizer_state", sympy.Integer(4), None, on_host))  # fp32
    return out


@functools.lru_cache(maxsize=8192)
def _state_sizes(regime: Regime, held: tuple[sympy.Expr, ...]) -> list[tuple[str, sympy.Expr]]:
    """Each state component's bytes for a parameter stepped as ``held``: the same sympy sizes for every parameter
    of a shape (a stack's layers, every walk of a peak, each ZeRO-1 rank's step), so built once per shape.  (Read
    only: :func:`state_storages` copies it.)"""
    return [(s, e / N if regime.zero and regime.shard(s) else e) for s, e in regime.optimizer_spec.state_bytes(held)]
