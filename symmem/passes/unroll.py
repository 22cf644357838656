"""Unrolling repeated blocks: a graph whose ``L`` identical layers are written out ``n`` times.

The step's schedule runs each layer of a repeated block in turn, so lifetimes across layers (a layer's output
kept by the next, gradients flowing back through the stack) are simplest to follow on the written-out graph.
Iteration ``k`` of block ``b`` names its nodes ``<node>#k``; iteration 1's block input is the block's source,
iteration k's is iteration k - 1's output.  Every node of the result has count 1.

>>> from symmem.models import build
>>> g = unroll(build("mlp", widths="symbolic").graph, {"hidden": 3})
>>> [n for n in g.program_order() if n.startswith("hidden.fc")]
['hidden.fc#1', 'hidden.fc#2', 'hidden.fc#3']
>>> g.node("hidden.input#2").inputs
('hidden.drop#1',)
>>> template("hidden.fc#2"), iteration("hidden.fc#2"), iteration("fc_out"), template("hidden.fc#3.weight")
('hidden.fc', 2, 0, 'hidden.fc.weight')
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Mapping
from typing import Any

import sympy

from ..errors import SymmemError
from ..graph import Graph, Node

_MARK = re.compile(r"#(\d+)")


# both asked for every op of every micro-batch of a pipeline replay (a name each time, a few thousand names)
@functools.lru_cache(maxsize=1 << 16)
def template(name: str) -> str:
    """The template name of an unrolled node (or of a name built on it, ``fc#2.weight`` -> ``fc.weight``)."""
    return _MARK.sub("", name, count=1)


@functools.lru_cache(maxsize=1 << 16)
def iteration(name: str) -> int:
    """The iteration of an unrolled node (0 outside repeated blocks)."""
    m = _MARK.search(name)
    return int(m.group(1)) if m else 0


def unroll(graph: Graph, counts: Mapping[str, int]) -> Graph:
    """``graph`` with each repeated block written out ``counts[block]`` times (a positive int each)."""
    for name, n in counts.items():
        if name not in graph.blocks:
            raise SymmemError(f"no repeated block {name!r} to unroll")
        if not isinstance(n, int) or n < 1:
            raise SymmemError(f"block {name!r} is unrolled a positive number of times, not {n!r}")
    out = Graph(name=graph.graph.get("name", ""))
    out.graph.update({k: v for k, v in graph.graph.items() if k not in ("blocks", "assumptions")
                      and not k.startswith("_")})
    out.graph["assumptions"] = list(graph.assumptions)
    order = graph.program_order()
    one = sympy.Integer(1)
    renamed: dict[str, str] = {}
    # unrolled node -> (block, iteration), for passes that act per layer (activation checkpointing)
    iterations: dict[str, tuple[str, int]] = out.graph.setdefault("iterations", {})
    written: list[Node] = []  # added at once (Graph.add_all): each copy's inputs are written before it
    add = written.append
    i = 0
    while i < len(order):
        node = graph.node(order[i])
        if node.block is None:
            add(_copy(node, inputs=tuple(renamed.get(x, x) for x in node.inputs)))
            renamed[node.name] = node.name
            i += 1
            continue
        block = graph.blocks[node.block]
        members = [n for n in order if graph.node(n).block == block.name]
        if list(order[i:i + len(members)]) != members:
            raise SymmemError(f"repeated block {block.name!r} is not contiguous in the graph's order")
        previous = renamed.get(block.source, block.source)
        n = counts[block.name] if block.name in counts else _count(block.count, block.name)
        for k in range(1, n + 1):
            local = {m: f"{m}#{k}" for m in members}
            for m in members:
                member = graph.node(m)
                inputs = tuple(previous if m == block.input else local.get(x, renamed.get(x, x))
                               for x in member.inputs)
                add(_copy(member, name=local[m], inputs=inputs, block=None, count=one))
                iterations[local[m]] = (block.name, k)
            previous = local[block.output]
        for m in members:
            renamed[m] = f"{m}#{n}"
        renamed[block.output] = previous
        i += len(members)
    out.add_all(written)
    held = graph.graph.get("held_until")
    if held:
        # a value held past its last use (schedule's held_until): a block member's hold is each iteration's, until
        # the same iteration's node where that is in the block too (RMSNorm's variance, until its own norm returns)
        written: dict[str, str] = {}
        for k, v in held.items():
            copies = itertools.takewhile(iterations.__contains__, (f"{k}#{j}" for j in itertools.count(1)))
            for j, c in enumerate([*copies] or [k], start=1):
                written[c] = f"{v}#{j}" if c != k and f"{v}#{j}" in iterations else renamed.get(v, v)
        out.graph["held_until"] = written
    return out


def _copy(node: Node, **changes: Any) -> Node:
    """``node.with_(**changes)`` without the dataclass's ``__init__``: its mappings are read-only views already
    (``Node.__post_init__`` made them), so the copy shares them (copying every field anew was most of unrolling
    Llama-2-7B's 32 layers, which FSDP's and ZeRO-1's stages and the tensor-parallel ranks read).

    >>> from symmem.models import build
    >>> fc = build("mlp", widths="symbolic").graph.node("fc_out")
    >>> copy = _copy(fc, name="x", inputs=("y",))
    >>> (copy.name, copy.inputs, copy.kind, copy.attrs == fc.attrs, copy.meta, copy.out is fc.out)
    ('x', ('y',), 'linear', True, {}, True)
    """
    new = object.__new__(Node)
    new.__dict__.update(node.__dict__)
    new.__dict__.update(changes, meta={})
    return new


def _count(count: sympy.Expr, name: str) -> int:
    if not count.is_number:
        raise SymmemError(f"block {name!r} repeats {count} times: give a number to unroll it")
    return int(count)
