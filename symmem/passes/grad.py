"""Which node outputs require grad: parameters do; inputs, constants, buffers and integer tensors do not; any
other op does if one of its inputs does or it owns parameters.  A graph-only fact, kept in ``node.meta``.

>>> from symmem.models import build
>>> g = build("gpt2").graph
>>> requires_grad(g, "position_ids"), requires_grad(g, "h.attn.c_attn")
(False, True)
"""

from __future__ import annotations

from ..graph import Graph

#: Op kinds whose output never requires grad, whatever their inputs.
NO_GRAD = frozenset({"input", "constant", "buffer", "rope_table"})
INT_DTYPES = frozenset({"bool", "int64", "int32", "int16", "int8", "uint8"})


def requires_grad(graph: Graph, name: str) -> bool:
    """Whether ``name``'s output requires grad (computed once per node, iteratively: deep graphs are fine)."""
    stack = [name]
    while stack:
        node = graph.node(stack[-1])
        if "requires_grad" in node.meta:
            stack.pop()
            continue
        if node.kind == "parameter":
            node.meta["requires_grad"] = True
        elif node.kind in NO_GRAD or node.out.dtype in INT_DTYPES:
            node.meta["requires_grad"] = False
        else:
            todo = [i for i in node.inputs if "requires_grad" not in graph.node(i).meta]
            if todo:
                stack.extend(todo)
                continue
            node.meta["requires_grad"] = bool(node.params) or any(
                graph.node(i).meta["requires_grad"] for i in node.inputs)
        stack.pop()
    return graph.node(name).meta["requires_grad"]
