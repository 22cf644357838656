"""Storage and aliasing: which storage a tensor is, and how many copies of it a repeated block keeps.

Views (``view_of``) share their input's storage, so a kept view keeps its base.  A repeated layer's input
(``block_input``) is the block's source in the first iteration and the previous iteration's output in the
others.  A ``cast`` is a view unless the regime's activation dtype makes it change the dtype, and a view whose
``copy`` fact is a condition on the sizes (a reshape of a stride-0 repeat; :mod:`symmem.strides`,
:mod:`symmem.conditions`) is a copy where the branch says so.

>>> from symmem.models import build
>>> g = build("vit-b16").graph
>>> resolve(g, "blocks.q")
[('blocks.qkv', 'same')]
>>> sorted(resolve(g, "blocks.input"))
[('blocks.add2', 'rest'), ('pos_add', 'first')]
"""

from __future__ import annotations

from collections.abc import Mapping

import sympy

from ..conditions import holds
from ..graph import Graph

Branch = Mapping[sympy.Basic, bool]


def converts(graph: Graph, name: str, act_dtype: str | None) -> bool:
    """Whether ``name`` is a ``cast`` that changes the dtype (a copy) under the activation dtype ``act_dtype``."""
    node = graph.node(name)
    if node.kind != "cast" or act_dtype is None:
        return False
    src = graph.node(node.inputs[0]).out.dtype
    dst = node.out.dtype
    return (act_dtype if src == "act" else src) != (act_dtype if dst == "act" else dst)


def is_view(graph: Graph, name: str, act_dtype: str | None = None, branch: Branch | None = None) -> bool:
    """Whether ``name``'s output shares its input's storage under the regime's dtype and the branch."""
    node = graph.node(name)
    return (node.view_of is not None and not converts(graph, name, act_dtype)
            and not holds(node.fact("copy", False), branch))


def resolve(graph: Graph, name: str, steady: bool = False, act_dtype: str | None = None,
            branch: Branch | None = None) -> list[tuple[str, str]]:
    """The storages behind ``name``'s output, each with the iterations in which it is the one seen.

    Views lead to their base.  A repeated layer's input is the block's source in its first iteration
    (``first``) and the block's own output in the others (``rest``); ``steady`` (one layer on its own)
    keeps only the latter, so that a layer's input is counted once.  Anything else is ``same``.
    """
    found: list[tuple[str, str]] = []
    stack = [(name, "same")]
    seen: set[tuple[str, str]] = set()
    while stack:
        n, mode = stack.pop()
        if (n, mode) in seen:
            continue
        seen.add((n, mode))
        node = graph.node(n)
        if node.kind == "block_input" and node.block is not None:
            block = graph.blocks[node.block]
            if not steady:
                stack.append((node.inputs[0], "first"))
            stack.append((block.output, "rest"))
        elif is_view(graph, n, act_dtype, branch):
            assert node.view_of is not None
            stack.append((node.inputs[node.view_of], mode))
        else:
            found.append((n, mode))
    return found


def multiplicity(graph: Graph, storage: str, savers: list[tuple[str, str]]) -> sympy.Expr:
    """How many copies of ``storage`` are alive, given who keeps it (node, mode) and in which iterations."""
    node = graph.node(storage)
    full = rest = external = False
    for saver, mode in savers:
        if mode == "rest":
            rest = True
        elif mode == "same" and graph.node(saver).block == node.block:
            full = True
        else:
            external = True
    if full or (rest and external):
        return node.count
    return (node.count - 1 if rest else sympy.Integer(0)) + (1 if external else 0)
