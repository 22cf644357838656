"""The ``traced`` convention: what a traced module keeps, as PyTorch itself reported it (:mod:`symmem.importer`).

A graph built from a trace (:func:`symmem.tracing.model_of`) has one ``traced`` node per storage autograd kept
-- its bytes measured on fake tensors with symbolic sizes -- and one ``input`` node per input storage kept;
each keeps itself.  There is nothing left to decide, so this convention is the identity.

>>> from symmem.conventions import convention
>>> convention("traced").dedup
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import Convention, Saved, register

if TYPE_CHECKING:
    from ..graph import Graph, Node


class TracedConvention(Convention):
    name = "traced"
    description = "What PyTorch autograd kept in a traced forward of the module itself (symmem.trace)"
    dedup = True
    options: Mapping[str, Any] = {}

    def saved(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> list[Saved]:
        return [Saved("output")] if node.kind in ("traced", "input") else []

    def finds_nothing(self, graph: Graph) -> str | None:
        if any(graph.node(n).kind == "traced" for n in graph.order()):
            return None
        return ("the traced convention counts what symmem.trace recorded of a real module, and this graph was "
                "not traced, so it keeps nothing; use --convention pytorch (or symmem trace for your module)")


register("traced", TracedConvention())
