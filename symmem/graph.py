"""Building and checking graphs: ops with symbolic tensors in a ``networkx.DiGraph``.

A node is an op.  Its data holds ``kind``, ``attrs``, ``inputs`` (ordered input node names), ``out`` (a
:class:`~symmem.tensor.TensorSpec`), ``params`` (name -> shape), ``view_of``, ``group``, ``block`` and
``count``.  A stack of identical layers is built once inside :meth:`GraphBuilder.repeat` and carries its
count (``L``, a symbol) instead of being unrolled.

>>> from symmem.symbols import B, H, L
>>> g = GraphBuilder("mlp")
>>> x = g.input("x", (B, H))
>>> with g.repeat("layer", L, x) as layer:
...     y = g.op("linear", layer.input, name="fc", out_features=H)
...     y = g.op("relu", y, name="act", role="hidden")
...     layer.output(y)
>>> graph = g.finish()
>>> graph.nodes["layer.fc"]["count"], graph.nodes["layer.fc"]["out"].shape
(L, (B, H))
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import sympy

from . import ops
from .errors import SymmemError, node_error
from .shapes import fmt, same
from .tensor import TensorSpec


@dataclass(frozen=True)
class Block:
    """A repeated layer: its count and the names of its input alias and its output node."""

    name: str
    count: sympy.Expr
    input: str
    output: str
    source: str


class _RepeatHandle:
    def __init__(self, builder: GraphBuilder, name: str, count: sympy.Expr, source: str) -> None:
        self._builder = builder
        self.name = name
        self.count = count
        self.source = source
        self.input = ""
        self.result: str | None = None

    def output(self, node: str) -> None:
        """Declare the block's output node; after the ``with`` it stands for the last layer's output."""
        self.result = node


class GraphBuilder:
    """Adds ops to a graph, inferring every output shape and parameter from the op rules."""

    def __init__(self, name: str) -> None:
        self.graph = nx.DiGraph(name=name, blocks={}, assumptions=[])
        self._prefix: list[str] = []
        self._group: list[str] = []
        self._block: _RepeatHandle | None = None
        self._counter: dict[str, int] = {}

    # -- naming ---------------------------------------------------------------------------------------
    def _name(self, name: str | None, kind: str) -> str:
        base = name or kind
        full = ".".join(self._prefix + [base])
        if full in self.graph:
            if name is not None:
                raise SymmemError(f"node {full!r} ({kind}) is defined twice")
            n = self._counter.get(full, 1)
            while f"{full}_{n}" in self.graph:
                n += 1
            self._counter[full] = n + 1
            full = f"{full}_{n}"
        return full

    @contextmanager
    def scope(self, name: str, group: str | None = None) -> Iterator[None]:
        """Prefix node names with ``name.``; ``group`` labels the nodes for per-group breakdowns."""
        self._prefix.append(name)
        if group is not None:
            self._group.append(group)
        try:
            yield
        finally:
            self._prefix.pop()
            if group is not None:
                self._group.pop()

    @contextmanager
    def group(self, group: str) -> Iterator[None]:
        """Label the nodes built inside with ``group`` (e.g. "stage 2"), without changing their names."""
        self._group.append(group)
        try:
            yield
        finally:
            self._group.pop()

    # -- building -------------------------------------------------------------------------------------
    def input(self, name: str, shape: tuple[Any, ...], dtype: str = "act", role: str = "input") -> str:
        """A graph input (the batch): reported apart from activations."""
        return self.op("input", name=name, role=role, shape=shape, dtype=dtype)

    def parameter(self, name: str, shape: tuple[Any, ...], role: str = "parameter") -> str:
        """A free-standing learned tensor (a class token, a position embedding)."""
        return self.op("parameter", name=name, role=role, shape=shape)

    def op(self, kind: str, *inputs: str, name: str | None = None, role: str | None = None,
           **attrs: Any) -> str:
        """Add an op fed by ``inputs``; returns its node name."""
        full = self._name(name, kind)
        for src in inputs:
            if src not in self.graph:
                raise SymmemError(f"node {full!r} ({kind}): input {src!r} does not exist")
        specs = [self.graph.nodes[src]["out"] for src in inputs]
        info = _apply(full, kind, specs, attrs)
        self.graph.add_node(
            full, kind=kind, attrs=dict(attrs), inputs=tuple(inputs),
            out=info.out.with_(role=role), params=dict(info.params), view_of=info.view_of,
            group=self._group[-1] if self._group else "model",
            block=self._block.name if self._block else None,
            count=self._block.count if self._block else sympy.Integer(1),
        )
        for i, src in enumerate(inputs):
            self.graph.add_edge(src, full, index=i)
        for lhs, rhs in info.assumptions:
            self.graph.graph["assumptions"].append((full, lhs, rhs))
        return full

    @contextmanager
    def repeat(self, name: str, count: Any, source: str, input_role: str | None = None
               ) -> Iterator[_RepeatHandle]:
        """Build one layer that stands for ``count`` identical layers fed by ``source``.

        Inside, ``handle.input`` is the layer's input (an alias with role ``input_role``); call
        ``handle.output(node)``.  After the block, ``handle.result`` is the output of the last layer.
        """
        if self._block is not None:
            raise SymmemError(f"repeat {name!r} is nested inside {self._block.name!r}; nest by flattening")
        count = sympy.sympify(count, strict=True)
        if count.is_number and not (count.is_integer and count >= 1):
            raise SymmemError(f"repeat {name!r}: count {count} is not a positive integer")
        handle = _RepeatHandle(self, name, count, source)
        self._prefix.append(name)
        self._block = handle
        try:
            handle.input = self.op("block_input", source, name="input", role=input_role)
            yield handle
        finally:
            self._prefix.pop()
            self._block = None
        if handle.result is None:
            raise SymmemError(f"repeat {name!r}: the block never called output()")
        src_shape = self.graph.nodes[source]["out"].shape
        out_shape = self.graph.nodes[handle.result]["out"].shape
        if len(src_shape) != len(out_shape) or any(same(a, b) is False for a, b in
                                                   zip(src_shape, out_shape, strict=False)):
            raise SymmemError(f"repeat {name!r}: output {fmt(out_shape)} of {handle.result!r} does not match "
                              f"its input {fmt(src_shape)}, so the layer cannot be stacked")
        self.graph.graph["blocks"][name] = Block(name, count, handle.input, handle.result, source)

    def finish(self) -> nx.DiGraph:
        """Check the graph (see :func:`lint`) and return it."""
        lint(self.graph)
        return self.graph


def _apply(name: str, kind: str, specs: list[TensorSpec], attrs: Mapping[str, Any]) -> ops.OpInfo:
    try:
        return ops.infer(kind, specs, attrs)
    except ops.OpError as exc:
        raise node_error(name, kind, str(exc), [fmt(s.shape) for s in specs]) from None
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, SymmemError):
            raise node_error(name, kind, str(exc), [fmt(s.shape) for s in specs]) from None
        raise node_error(name, kind, f"bad or missing attribute: {exc!r}", [fmt(s.shape) for s in specs]) \
            from None


def ordered_inputs(graph: nx.DiGraph, node: str) -> tuple[str, ...]:
    """The inputs of ``node`` in argument order."""
    return graph.nodes[node]["inputs"]


def lint(graph: nx.DiGraph) -> None:
    """Check a graph: acyclic, known op kinds, and shapes that agree on every edge.

    Every node's output is inferred again from its inputs and compared with what the node says it holds.

    >>> import networkx as nx
    >>> g = nx.DiGraph(); g.add_edge("a", "b"); g.add_edge("b", "a")
    >>> lint(g)
    Traceback (most recent call last):
    symmem.errors.SymmemError: the graph has a cycle: a -> b -> a
    """
    try:
        cycle = nx.find_cycle(graph)
    except nx.NetworkXNoCycle:
        cycle = None
    if cycle:
        path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
        raise SymmemError(f"the graph has a cycle: {path}")
    known = set(ops.kinds())
    for name in nx.topological_sort(graph):
        data = graph.nodes[name]
        kind = data.get("kind")
        if kind not in known:
            raise SymmemError(f"node {name!r}: unknown op kind {kind!r}")
        inputs = data.get("inputs", ())
        preds = set(graph.predecessors(name))
        if set(inputs) != preds:
            raise node_error(name, kind, f"inputs {list(inputs)} do not match the graph's edges {sorted(preds)}")
        specs = [graph.nodes[i]["out"] for i in inputs]
        info = _apply(name, kind, specs, data.get("attrs", {}))
        have = data["out"].shape
        if len(have) != len(info.out.shape) or any(
                same(a, b) is False for a, b in zip(have, info.out.shape, strict=False)):
            raise node_error(name, kind, f"holds {fmt(have)} but its inputs give {fmt(info.out.shape)}",
                             [fmt(s.shape) for s in specs])
    for block in graph.graph.get("blocks", {}).values():
        for n in (block.input, block.output):
            if n not in graph:
                raise SymmemError(f"repeat {block.name!r}: node {n!r} is missing")


@dataclass(frozen=True)
class Model:
    """A built architecture: its graph, default values for its symbols, and the symbols formulas keep.

    ``defaults`` may map a symbol to an expression in other symbols (``F: 4*H``; ``S`` from the image size).
    ``free`` are the symbols a derived formula is written in; every other symbol is replaced by its default.
    ``layer`` names the repeated block that ``per_layer`` derivations describe.
    """

    name: str
    graph: nx.DiGraph
    defaults: Mapping[sympy.Symbol, sympy.Expr]
    free: tuple[sympy.Symbol, ...]
    description: str = ""
    layer: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        """Every symbol the model's shapes, counts or defaults use, in a stable order."""
        found: set[sympy.Symbol] = set(self.defaults)
        for _, data in self.graph.nodes(data=True):
            for d in data["out"].shape:
                found |= d.free_symbols
            found |= sympy.sympify(data["count"]).free_symbols
        return tuple(sorted(found, key=lambda s: s.name))
