"""The typed graph: :class:`Node` values in a :class:`Graph` (networkx's layout), built by :class:`GraphBuilder`.

A node is one op: a frozen :class:`Node` holding its kind, its ordered inputs, its attributes (checked against
the kind's schema in :mod:`symmem.ops`), its output :class:`~symmem.tensor.TensorSpec`, its parameters (name ->
shape), which input's storage its output is a view of, the storage decisions its rule took from the input
strides (``facts``: does a reshape copy; :mod:`symmem.strides`), its group and repeated block, and a ``meta`` dict
where analyses (:mod:`symmem.passes`) keep facts that depend on the graph alone.  Edges follow the inputs; the
graph is the only mutable thing.  A stack of identical layers is built once inside :meth:`GraphBuilder.repeat`
and carries its count (``L``, a symbol) instead of being unrolled.

>>> from symmem.symbols import B, H, L
>>> g = GraphBuilder("mlp")
>>> x = g.input("x", (B, H))
>>> with g.repeat("layer", L, x) as layer:
...     y = g.op("linear", layer.input, name="fc", out_features=H)
...     y = g.op("relu", y, name="act", role="hidden")
...     layer.output(y)
>>> graph = g.finish()
>>> fc = graph.node("layer.fc")
>>> fc.kind, fc.count, fc.out.shape
('linear', L, (B, H))
"""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import sympy

from . import ops, roles
from .digraph import CycleError, DiGraph, topological_order
from .errors import SymmemError, node_error
from .shapes import fmt, numel, same
from .tensor import TensorSpec

#: ``Node.meta`` key: the input specs GraphBuilder inferred the node's output from (lint need not again).
INFERRED_FROM = "inferred_from"


@dataclass(frozen=True, eq=False)
class Node:
    """One op of a graph (see the module docstring).  ``count`` is how many copies a repeated block makes of
    it (``L``), 1 elsewhere; ``facts`` are the rule's storage decisions (``copy``, ``copy_inputs``, ``q_bshd``,
    ``v_contiguous``: see :mod:`symmem.ops`); ``meta`` holds graph-only facts that passes compute once (grad)."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    attrs: Mapping[str, Any]
    out: TensorSpec
    params: Mapping[str, tuple[sympy.Expr, ...]] = field(default_factory=dict)
    view_of: int | None = None
    group: str = "model"
    block: str | None = None
    count: sympy.Expr = sympy.Integer(1)
    buffers: Mapping[str, TensorSpec] = field(default_factory=dict)
    facts: Mapping[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))
        object.__setattr__(self, "facts", MappingProxyType(dict(self.facts)))
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))
        object.__setattr__(self, "buffers", MappingProxyType(dict(self.buffers)))

    @property
    def role(self) -> str | None:
        return self.out.role

    def fact(self, name: str, default: Any = None) -> Any:
        """A storage decision of the rule (``facts``), or for a node made without one (``Node(...)`` by hand) the
        attribute of that name a builder stated, else ``default``."""
        return self.facts[name] if name in self.facts else self.attrs.get(name, default)

    def with_(self, **changes: Any) -> Node:
        """A copy with some fields changed and an empty ``meta``."""
        return replace(self, meta={}, **changes)


@dataclass(frozen=True)
class Block:
    """A repeated layer: its count and the names of its input alias and its output node."""

    name: str
    count: sympy.Expr
    input: str
    output: str
    source: str


class Graph(DiGraph):
    """A directed graph whose nodes hold :class:`Node` values (``graph.node(name)``).

    It has ``networkx.DiGraph``'s layout and API without importing networkx until an attribute symmem does
    not implement is used (:mod:`symmem.digraph`); ``to_networkx()`` copies it into a real one.

    Graph-level facts live in ``graph.graph``: ``blocks`` (name -> :class:`Block`), ``assumptions`` (node, lhs,
    rhs) checked with numbers, and flags a builder sets (``causal_lm``, ``no_loss``).
    """

    def __init__(self, incoming_graph_data: Any = None, **attr: Any) -> None:
        super().__init__(incoming_graph_data, **attr)
        self.graph.setdefault("blocks", {})
        self.graph.setdefault("assumptions", [])

    def node(self, name: str) -> Node:
        """The :class:`Node` called ``name``."""
        try:
            return self._node[name]["node"]
        except KeyError:
            raise SymmemError(f"no node {name!r} in graph {self.graph.get('name', '')!r}") from None

    def add(self, node: Node) -> None:
        """Add ``node`` with an edge from each input (which must exist)."""
        if node.name in self:
            raise SymmemError(f"node {node.name!r} ({node.kind}) is defined twice")
        for src in node.inputs:
            if src not in self:
                raise SymmemError(f"node {node.name!r} ({node.kind}): input {src!r} does not exist")
        self.add_node(node.name, node=node)
        for i, src in enumerate(node.inputs):
            self.add_edge(src, node.name, index=i)

    def add_all(self, nodes: Iterable[Node]) -> None:
        """:meth:`add` of each of ``nodes`` in turn -- the same checks, node and edge dicts (in the same order) and
        edge count -- without a mutator's call per node and per edge: unrolling Llama-2-7B's 32 layers adds 1,811
        nodes and 2,288 edges, and their calls were half of it (FSDP's and the tensor-parallel pipeline stages read
        that graph)."""
        succ, pred, attrs = self._succ, self._pred, self._node
        edges = 0
        for node in nodes:
            name = node.name
            if name in attrs:
                raise SymmemError(f"node {name!r} ({node.kind}) is defined twice")
            for src in node.inputs:
                if src not in attrs:
                    raise SymmemError(f"node {name!r} ({node.kind}): input {src!r} does not exist")
            succ[name] = {}
            into = pred[name] = {}
            attrs[name] = {"node": node}
            for i, src in enumerate(node.inputs):
                data = into.get(src)  # an input read twice (x * x) is one edge, its index the last
                if data is None:
                    data = into[src] = succ[src][name] = {}
                    edges += 1
                data["index"] = i
        self._clear_cache(edges)

    @property
    def blocks(self) -> dict[str, Block]:
        return self.graph["blocks"]

    @property
    def assumptions(self) -> list[tuple[str, sympy.Basic, sympy.Expr | None]]:
        return self.graph["assumptions"]

    def assume(self, node: str, condition: Any, rhs: Any = None) -> None:
        """Record what ``node`` needs of the symbols' values, checked with numbers when the model is derived.

        ``assume(node, lhs, rhs)``: ``lhs = rhs``; ``assume(node, condition)``: a sympy relation or a
        combination of relations, such as ``sympy.Le(p, L)`` or ``sympy.Eq(sympy.Mod(H, h), 0)`` (h divides H).
        """
        if node not in self:
            raise SymmemError(f"an assumption names node {node!r}, which is not in the graph")
        if rhs is None:
            cond = _symbolic(f"the assumption of node {node!r}", condition)
            if not isinstance(cond, sympy.logic.boolalg.Boolean) or isinstance(cond, sympy.Symbol):
                raise SymmemError(f"the assumption of node {node!r} must be a relation such as Le(p, L), "
                                  f"got {condition!r}")
            self.assumptions.append((node, cond, None))
        else:
            self.assumptions.append((node, _symbolic(f"the assumption of node {node!r}", condition),
                                     _symbolic(f"the assumption of node {node!r}", rhs)))

    def order(self) -> tuple[str, ...]:
        """Node names in a topological order (inputs first), computed once per graph size.

        A cycle is a :class:`SymmemError` naming it.
        """
        key = (self.number_of_nodes(), self.number_of_edges())
        cached = self.graph.get("_order")
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            found = topological_order(self)
        except CycleError:
            import networkx as nx

            cycle = nx.find_cycle(self.to_networkx())
            path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
            raise SymmemError(f"the graph has a cycle: {path}") from None
        self.graph["_order"] = (key, found)
        return found

    def program_order(self) -> tuple[str, ...]:
        """The nodes in the order they were added -- the order a forward pass runs them, with a repeated block's
        nodes together -- when that is a topological order (always, for :class:`GraphBuilder`); else
        :meth:`order`."""
        key = (self.number_of_nodes(), self.number_of_edges())
        cached = self.graph.get("_program")
        if cached is not None and cached[0] == key:
            return cached[1]
        seen: set[str] = set()
        found = tuple(self._node)
        for name in found:
            if any(p not in seen for p in self._pred[name]):
                found = self.order()
                break
            seen.add(name)
        self.graph["_program"] = (key, found)
        return found

    def nodes_in_order(self) -> list[Node]:
        return [self.node(n) for n in self.order()]

    def copy(self, as_view: bool = False) -> Graph:  # type: ignore[override]
        """A copy with its own nodes (empty ``meta``), blocks and assumptions."""
        if as_view:
            import networkx as nx

            return nx.graphviews.generic_graph_view(self)  # type: ignore[return-value]
        g = Graph()
        g.graph.update({k: v for k, v in self.graph.items() if not k.startswith("_")})
        g.graph["blocks"] = dict(self.blocks)
        g.graph["assumptions"] = list(self.assumptions)
        for name in self.program_order():
            g.add(self.node(name).with_())
        return g


def parameter_shapes(graph: Graph, nodes: list[str] | tuple[str, ...] | None = None, per_layer: bool = False
                     ) -> list[tuple[Node, str, sympy.Expr, tuple[sympy.Expr, ...]]]:
    """(node, parameter name, count, shape) of every parameter of ``nodes`` (default: all), in graph order.

    ``count`` is the node's count (1 with ``per_layer``): the one place that walks parameter shapes.
    """
    found = []
    for name in graph.order() if nodes is None else nodes:
        node = graph.node(name)
        count = sympy.Integer(1) if per_layer else node.count
        for pname, shape in node.params.items():
            found.append((node, pname, count, shape))
    return found


def parameter_count(graph: Graph, nodes: list[str] | tuple[str, ...] | None = None,
                    per_layer: bool = False) -> sympy.Expr:
    """Parameter elements of ``nodes`` (default: the whole graph).

    >>> from symmem.models import build
    >>> m = build("resnet50")
    >>> parameter_count(m.graph).xreplace(dict(m.defaults))
    25557032
    """
    # grouped by (count, shape): a graph of many layers has few shapes, and sympy sums k equal terms as k * term
    groups: dict[tuple[sympy.Expr, tuple[sympy.Expr, ...]], int] = {}
    for _, _, c, s in parameter_shapes(graph, nodes, per_layer):
        groups[(c, s)] = groups.get((c, s), 0) + 1
    return sympy.Add(*(k * c * numel(s) for (c, s), k in groups.items()))


class _RepeatHandle:
    def __init__(self, name: str, count: sympy.Expr, source: str) -> None:
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
        self.graph = Graph(name=name)
        self._prefix: list[str] = []
        self._group: list[str] = []
        self._block: _RepeatHandle | None = None
        self._counter: dict[str, int] = {}

    # -- naming ---------------------------------------------------------------------------------------
    def _name(self, name: str | None, kind: str) -> str:
        if name is not None and (not isinstance(name, str) or not name):
            raise SymmemError(f"a {kind} node needs a non-empty string name, got {name!r}")
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
    def spec(self, node: str) -> TensorSpec:
        """The output of ``node`` as built so far (its shape, dtype and role)."""
        return self.graph.node(node).out

    def input(self, name: str, shape: tuple[Any, ...], dtype: str = "act", role: str = "input") -> str:
        """A graph input (the batch): reported apart from activations."""
        return self.op("input", name=name, role=role, shape=shape, dtype=dtype)

    def parameter(self, name: str, shape: tuple[Any, ...], role: str = "parameter") -> str:
        """A free-standing learned tensor (a class token, a position embedding)."""
        return self.op("parameter", name=name, role=role, shape=shape)

    def op(self, kind: str, *inputs: str, name: str | None = None, role: str | None = None,
           **attrs: Any) -> str:
        """Add an op fed by ``inputs``; returns its node name."""
        if not isinstance(kind, str):
            raise SymmemError(f"an op's kind is its name, a string such as 'linear', not {kind!r}")
        full = self._name(name, kind)
        roles.check(role)
        for src in inputs:
            if not isinstance(src, str) or src not in self.graph:
                raise SymmemError(f"node {full!r} ({kind}): input {src!r} does not exist")
        specs = [self.graph.node(src).out for src in inputs]
        info = _infer(full, kind, specs, attrs)
        block = self._block
        node = Node(full, kind, tuple(inputs), attrs, info.out.with_(role=role), info.params, info.view_of,
                    self._group[-1] if self._group else "model", block.name if block else None,
                    block.count if block else sympy.Integer(1), info.buffers, info.facts)
        node.meta[INFERRED_FROM] = tuple(specs)
        self.graph.add(node)
        for lhs, rhs in info.assumptions:
            self.graph.assumptions.append((full, lhs, rhs))
        return full

    def assume(self, condition: Any, rhs: Any = None, node: str | None = None) -> None:
        """What the model needs of its symbols' values (``h`` divides ``H``, ``S <= 1024``), checked with numbers
        when it is derived; ``node`` (default: the last node added) is named when the values break it.  See
        :meth:`Graph.assume`."""
        if node is None:
            order = list(self.graph.nodes)
            if not order:
                raise SymmemError("an assumption needs a node to name: add one first")
            node = order[-1]
        self.graph.assume(node, condition, rhs)

    @contextmanager
    def repeat(self, name: str, count: Any, source: str, input_role: str | None = None
               ) -> Iterator[_RepeatHandle]:
        """Build one layer that stands for ``count`` identical layers fed by ``source``.

        Inside, ``handle.input`` is the layer's input (an alias with role ``input_role``); call
        ``handle.output(node)``.  After the block, ``handle.result`` is the output of the last layer.
        """
        if self._block is not None:
            raise SymmemError(f"repeat {name!r} is nested inside {self._block.name!r}; nest by flattening")
        if isinstance(count, str | bool | float) or count is None:
            raise SymmemError(f"repeat {name!r}: count {count!r} is not a positive integer or a symbol")
        try:
            count = sympy.sympify(count, strict=True)
        except sympy.SympifyError:
            raise SymmemError(f"repeat {name!r}: count {count!r} is not a positive integer or a symbol") from None
        if not isinstance(count, sympy.Expr) or count.is_positive is False or count.is_integer is False or (
                count.is_number and not (count.is_integer and count >= 1)):
            # a count that cannot be positive (-L) or an integer (L/2 is checked with numbers when derived)
            raise SymmemError(f"repeat {name!r}: count {count} is not a positive integer")
        if name in self.graph.blocks:
            raise SymmemError(f"repeat {name!r} is defined twice")
        handle = _RepeatHandle(name, count, source)
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
        src_shape = self.spec(source).shape
        out_shape = self.spec(handle.result).shape
        if len(src_shape) != len(out_shape) or any(same(a, b) is False for a, b in
                                                   zip(src_shape, out_shape, strict=False)):
            raise SymmemError(f"repeat {name!r}: output {fmt(out_shape)} of {handle.result!r} does not match "
                              f"its input {fmt(src_shape)}, so the layer cannot be stacked")
        self.graph.blocks[name] = Block(name, count, handle.input, handle.result, source)

    def finish(self) -> Graph:
        """Check the graph (see :func:`lint`) and return it."""
        with paused_gc():
            lint(self.graph)
        return self.graph


@contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector paused while a graph is checked or derived.

    A large graph is hundreds of thousands of small objects that all stay alive; the collector would scan them
    again and again (40% of deriving a 30,000-op graph).  Whatever garbage with cycles is made meanwhile is
    collected once the collector runs again.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _infer(name: str, kind: str, specs: list[TensorSpec], attrs: Mapping[str, Any]) -> ops.OpInfo:
    try:
        return ops.infer(kind, specs, attrs)
    except (ops.OpError, SymmemError) as exc:
        raise node_error(name, kind, str(exc), [fmt(s.shape) for s in specs]) from None


def lint(graph: Graph) -> None:
    """Check a graph: acyclic, known op kinds, and shapes that agree on every edge.

    Every node's output is inferred again from its inputs and compared with what the node says it holds,
    except a node that :class:`GraphBuilder` inferred from the very input specs it has now (``Node`` and
    ``TensorSpec`` are immutable: a node or an input replaced since is checked again).

    >>> g = Graph(); g.add_edge("a", "b"); g.add_edge("b", "a")
    >>> lint(g)
    Traceback (most recent call last):
    symmem.errors.SymmemError: the graph has a cycle: a -> b -> a
    """
    if not isinstance(graph, Graph):
        raise SymmemError(f"expected a symmem Graph (from GraphBuilder), got {type(graph).__name__}")
    known = set(ops.kinds())
    for name in graph.order():
        data = graph.nodes[name]
        node = data.get("node")
        if not isinstance(node, Node):
            raise SymmemError(f"node {name!r} is not a symmem Node (add nodes with GraphBuilder or Graph.add)")
        if node.kind not in known:
            raise SymmemError(f"node {name!r}: unknown op kind {node.kind!r}")
        preds = set(graph.predecessors(name))
        if set(node.inputs) != preds:
            raise node_error(name, node.kind, f"inputs {list(node.inputs)} do not match the graph's edges "
                             f"{sorted(preds)}")
        specs = [graph.node(i).out for i in node.inputs]
        made = node.meta.get(INFERRED_FROM)
        if made is not None and len(made) == len(specs) and all(a is b for a, b in zip(made, specs, strict=True)):
            continue  # GraphBuilder inferred this very node from these very (immutable) inputs
        info = _infer(name, node.kind, specs, node.attrs)
        have = node.out.shape
        if len(have) != len(info.out.shape) or any(
                same(a, b) is False for a, b in zip(have, info.out.shape, strict=False)):
            raise node_error(name, node.kind, f"holds {fmt(have)} but its inputs give {fmt(info.out.shape)}",
                             [fmt(s.shape) for s in specs])
    for block in graph.blocks.values():
        for n in (block.input, block.output):
            if n not in graph:
                raise SymmemError(f"repeat {block.name!r}: node {n!r} is missing")


def _symbolic(what: str, value: Any) -> sympy.Expr:
    # Values come from code, never from text: a string is refused, not parsed (sympify would evaluate it).
    if isinstance(value, str | bool) or value is None:
        raise SymmemError(f"{what} must be a number or a sympy expression, not {value!r}")
    try:
        e = sympy.sympify(value, strict=True)
    except sympy.SympifyError:
        raise SymmemError(f"{what} must be a number or a sympy expression, not {value!r}") from None
    if not isinstance(e, sympy.Basic):
        raise SymmemError(f"{what} must be a number or a sympy expression, not {value!r}")
    return e


#: node kinds that hold a value and compute nothing
_LEAVES = ("input", "parameter", "buffer", "constant")


@dataclass(frozen=True)
class Model:
    """A built architecture: its graph, default values for its symbols, and the symbols formulas keep.

    ``defaults`` may map a symbol to an expression in other symbols (``F: 4*H``; ``S`` from the image size).
    ``free`` are the symbols a derived formula is written in; every other symbol is replaced by its default.
    ``layer`` names the repeated block that ``per_layer`` derivations describe.
    """

    name: str
    graph: Graph
    defaults: Mapping[sympy.Symbol, sympy.Expr]
    free: tuple[sympy.Symbol, ...]
    description: str = ""
    layer: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.graph, Graph):
            raise SymmemError(f"model {self.name!r}: the graph must be a symmem Graph (GraphBuilder.finish())")
        defaults = {}
        for sym, value in dict(self.defaults).items():
            if not isinstance(sym, sympy.Symbol):
                raise SymmemError(f"model {self.name!r}: default keys must be sympy symbols, got {sym!r}")
            defaults[sym] = _symbolic(f"model {self.name!r}: the default of {sym}", value)
            if not isinstance(defaults[sym], sympy.Expr):
                raise SymmemError(f"model {self.name!r}: the default of {sym} must be a number or an expression, "
                                  f"not {value!r}")
        object.__setattr__(self, "defaults", defaults)
        free = tuple(self.free)
        for sym in free:
            if not isinstance(sym, sympy.Symbol):
                raise SymmemError(f"model {self.name!r}: free symbols must be sympy symbols, got {sym!r}")
        object.__setattr__(self, "free", free)
        if self.layer is not None and self.layer not in self.graph.blocks:
            raise SymmemError(f"model {self.name!r}: layer {self.layer!r} is not a repeated block "
                              f"({', '.join(self.graph.blocks) or 'none'})")
        if not any(data["node"].kind not in _LEAVES for data in self.graph.nodes.values()):
            # a training step runs ops: with none (no node, or inputs and parameters alone) the schedule has no
            # output to backpropagate from
            raise SymmemError(f"model {self.name!r}: the graph has no op ("
                              f"{'no node at all' if not self.graph.nodes else 'only inputs and parameters'}), "
                              "so there is no step to train; add ops with GraphBuilder.op")

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        """Every symbol the model's shapes, counts or defaults use, in a stable order."""
        found: set[sympy.Symbol] = set(self.defaults)
        seen: set[sympy.Expr] = set()  # layers repeat their sizes: each size's symbols are collected once
        for data in self.graph.nodes.values():  # any order: the result is sorted
            node = data["node"]
            for d in (*node.out.shape, node.count):
                if d not in seen:
                    seen.add(d)
                    found |= d.free_symbols
        return tuple(sorted(found, key=lambda s: s.name))
