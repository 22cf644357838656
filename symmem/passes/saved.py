"""What the convention keeps, as storages: each with its bytes, its copies, its keepers and the phases it lives in.

For every node the convention lists what the op keeps (:class:`~symmem.conventions.Saved`).  A
storage-counting convention (``dedup``) resolves every kept tensor to its storage
(:func:`symmem.passes.storage.resolve`) and counts each storage once, with as many copies as the iterations
of a repeated block that keep it; parameters and buffers are the parameter side, not activations.  A
reference-counting convention (``paper``) counts each kept reference as the accounting it mirrors does.

>>> from symmem.conventions import convention
>>> from symmem.models import build
>>> g = build("mlp").graph
>>> found = kept(g, convention("pytorch"), {"device": "cpu"}, "float32", list(g.order()), False)
>>> [(s.name, s.keepers) for s in found]
[('x', ('fc1',)), ('act1', ('act1', 'fc2')), ('act2', ('act2', 'fc3'))]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import sympy

from ..conventions import Convention, Saved
from ..derivation import Storage
from ..graph import Graph, Node
from ..tensor import TensorSpec, dtype_bytes
from .storage import Branch, multiplicity, resolve


def born(category: str) -> str:
    """The phase a kept storage is born in: inputs exist from the start, the rest is made in the forward; every
    kept storage dies in the backward, once its last keeper has run (the step's op-by-op time is the schedule's
    :class:`~symmem.timeline.Timeline`)."""
    return "start" if category == "input" else "forward"


def category(node: Node) -> str:
    """``input`` for graph inputs (the batch, a loss target), ``loss`` for what a loss appended by
    :mod:`symmem.loss` keeps (its group is ``loss``), ``activation`` otherwise."""
    if node.kind == "input":
        return "input"
    return "loss" if node.group == "loss" else "activation"


def kept(graph: Graph, conv: Convention, options: Mapping[str, Any], act_dtype: str, nodes: list[str],
         per_layer: bool, branch: Branch | None = None, saves: Callable[[Node], list[Saved]] | None = None
         ) -> list[Storage]:
    """The storages ``conv`` keeps for the ``nodes`` (all of them, or one layer with ``per_layer``); ``saves``: what
    ``conv.saved`` answers for a node under these options, where the caller keeps the answers (a walk asks again)."""
    found: list[Storage] = []
    storages: dict[str, list[tuple[str, str, Saved]]] = {}
    order: list[str] = []

    # Layers repeat their shapes: each (count, shape, dtype) is multiplied out once.
    sizes: dict[tuple[sympy.Expr, tuple[sympy.Expr, ...], str], sympy.Expr] = {}

    def size(spec: TensorSpec, count: sympy.Expr | int = 1) -> sympy.Expr:
        """``count`` copies of ``spec``, in bytes."""
        key = (count, spec.shape, spec.dtype)
        got = sizes.get(key)
        if got is None:
            one = size(spec) if count != 1 else elements(spec) * dtype_bytes(spec.dtype, act_dtype)
            got = sizes[key] = one if count == 1 else count * one
        return got

    numels: dict[tuple[sympy.Expr, ...], sympy.Expr] = {}

    def elements(spec: TensorSpec) -> sympy.Expr:
        got = numels.get(spec.shape)
        if got is None:
            got = numels[spec.shape] = spec.numel
        return got

    # Rules may depend on the regime's activation dtype (which attention kernel CUDA picks) and the branch.
    rule_options = {**options, "activation_dtype": act_dtype, "branch": branch}
    for name in nodes:
        node = graph.node(name)
        count = sympy.Integer(1) if per_layer else node.count
        for ref in (conv.saved(graph, node, rule_options) if saves is None else saves(node)):
            if ref.source == "new":
                spec = ref.spec
                assert spec is not None
                cat = "loss" if node.group == "loss" else "activation"
                found.append(Storage(f"{name}.{ref.label}", node.group, cat, size(spec, count),
                                     ref.role or spec.role, name, spec.dtype, elements(spec), count, (name,),
                                     "forward", "backward"))
                continue
            target = name if ref.source == "output" else node.inputs[ref.index]
            if not conv.dedup:
                kept_node = node if target == name else graph.node(target)
                spec = kept_node.out
                cat = category(kept_node)
                label = name if ref.source == "output" else f"{name}.{ref.label or 'input'}"
                found.append(Storage(label, node.group, cat, size(spec, count), ref.role or spec.role, name,
                                     spec.dtype, elements(spec), count, (name,), born(cat), "backward"))
                continue
            for storage, mode in resolve(graph, target, per_layer, act_dtype, branch):
                if storage not in storages:
                    storages[storage] = []
                    order.append(storage)
                storages[storage].append((name, mode, ref))
    for storage in order:
        node = graph.node(storage)
        if node.kind in ("parameter", "buffer"):
            continue
        savers = storages[storage]
        if per_layer:
            if node.block != graph.node(savers[0][0]).block:
                # Made outside the layer (Llama's rotary cos/sin tables, made once and kept by every layer): the
                # whole model counts it once, so it is no part of one layer's memory.
                continue
            count = sympy.Integer(1)
        else:
            count = multiplicity(graph, storage, [(s, mode) for s, mode, _ in savers])
            if count == 0:
                continue
        cat = category(node)
        role = next((r.role for _, _, r in savers if r.role), None) or node.role
        group = "input" if cat == "input" else node.group
        keepers = tuple(dict.fromkeys(s for s, _, _ in savers))
        found.append(Storage(storage, group, cat, size(node.out, count), role, storage, node.out.dtype,
                             node.out.numel, count, keepers, born(cat), "backward"))
    return found
