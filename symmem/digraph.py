"""A directed graph with networkx's layout and API, without importing networkx until it is needed.

``import networkx`` costs 0.1-0.2 s, about a third of ``import sympy``, and deriving a formula needs none of
its algorithms: a topological order is a few lines.  :class:`DiGraph` stores its data exactly as
``networkx.DiGraph`` does (``graph``, ``_node``, ``_adj`` = ``_succ``, ``_pred``), implements the methods symmem
uses natively, and hands every other attribute to ``networkx.DiGraph``'s own implementation, bound to this
graph, on first use (``g.edges``, ``g.subgraph(...)``, ``g.to_undirected()`` ...); networkx's algorithms take
it as they take their own graphs (``nx.descendants(g, "x")``).  :meth:`DiGraph.to_networkx` copies it into a
real ``networkx.DiGraph``.

>>> g = DiGraph()
>>> g.add_edge("a", "b"); g.add_edge("a", "c"); g.add_edge("b", "c")
>>> list(g.successors("a")), list(g.predecessors("c")), g.out_degree("a"), g.number_of_edges()
(['b', 'c'], ['a', 'b'], 2, 3)
>>> topological_order(g)
('a', 'b', 'c')
>>> sorted(g.edges)  # networkx's own EdgeView, loaded on first use
[('a', 'b'), ('a', 'c'), ('b', 'c')]
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Iterable, Iterator, Mapping
from typing import Any


class _NodeSet:
    """Iteration, length and membership over the nodes in ``_node``, as networkx's graphs and node views have them
    (an unhashable object is not a node, not an error)."""

    __slots__ = ()
    _node: dict[Hashable, dict[str, Any]]

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self._node)

    def __len__(self) -> int:
        return len(self._node)

    def __contains__(self, n: object) -> bool:
        try:
            return n in self._node
        except TypeError:
            return False


class _Nodes(_NodeSet, Mapping):
    """``g.nodes``: node -> its attribute dict (``g.nodes[n]["node"]``); ``g.nodes(data=True)`` as networkx."""

    __slots__ = ("_node",)

    def __init__(self, node: dict[Hashable, dict[str, Any]]) -> None:
        self._node = node

    def __getitem__(self, n: Hashable) -> dict[str, Any]:
        return self._node[n]

    def __call__(self, data: bool | str = False, default: Any = None) -> Any:
        if data is False:
            return self
        if data is True:
            return list(self._node.items())
        return [(n, d.get(data, default)) for n, d in self._node.items()]

    def __repr__(self) -> str:
        return f"NodeView({tuple(self._node)!r})"


class _Degree:
    """``g.in_degree`` / ``g.out_degree``: ``deg(n)`` and ``deg[n]`` are ints, ``deg()`` and ``deg`` iterate
    (node, degree) pairs, as networkx's degree views do."""

    __slots__ = ("_adj",)

    def __init__(self, adj: dict[Hashable, dict[Hashable, Any]]) -> None:
        self._adj = adj

    def __call__(self, nbunch: Any = None, weight: str | None = None) -> Any:
        if weight is not None:
            raise NotImplementedError("weighted degrees: use g.to_networkx()")
        if nbunch is None:
            return self
        try:
            if nbunch in self._adj:
                return len(self._adj[nbunch])
        except TypeError:
            pass
        return [(n, len(self._adj[n])) for n in nbunch if n in self._adj]

    def __getitem__(self, n: Hashable) -> int:
        return len(self._adj[n])

    def __iter__(self) -> Iterator[tuple[Hashable, int]]:
        return ((n, len(nbrs)) for n, nbrs in self._adj.items())

    def __len__(self) -> int:
        return len(self._adj)


def _not_in_graph(n: Hashable) -> Exception:
    import networkx as nx

    return nx.NetworkXError(f"The node {n} is not in the digraph.")


class DiGraph(_NodeSet):
    """A directed graph stored as ``networkx.DiGraph`` stores one (see the module docstring)."""

    #: networkx's dispatcher takes a graph whose backend is "networkx" as one of its own.
    __networkx_backend__ = "networkx"

    def __init__(self, incoming_graph_data: Any = None, **attr: Any) -> None:
        self.graph: dict[str, Any] = {}
        self._node: dict[Hashable, dict[str, Any]] = {}
        self._adj: dict[Hashable, dict[Hashable, dict[str, Any]]] = {}
        self._succ = self._adj
        self._pred: dict[Hashable, dict[Hashable, dict[str, Any]]] = {}
        self.__networkx_cache__: dict[str, Any] = {}
        if incoming_graph_data is not None:
            from networkx import convert

            convert.to_networkx_graph(incoming_graph_data, create_using=self)
        attr.pop("backend", None)
        self.graph.update(attr)

    def __getattr__(self, name: str) -> Any:
        # Everything not implemented here is networkx.DiGraph's own code, bound to this graph (same layout).
        if name.startswith("__") or name in ("graph", "_node", "_adj", "_succ", "_pred"):
            raise AttributeError(name)
        import networkx as nx

        try:
            attr = inspect.getattr_static(nx.DiGraph, name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None
        return attr.__get__(self, type(self)) if hasattr(attr, "__get__") else attr

    # -- nodes and edges ------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.graph.get("name", "")

    @property
    def nodes(self) -> _Nodes:
        return _Nodes(self._node)

    @property
    def in_degree(self) -> _Degree:
        return _Degree(self._pred)

    @property
    def out_degree(self) -> _Degree:
        return _Degree(self._succ)

    def __getitem__(self, n: Hashable) -> dict[Hashable, dict[str, Any]]:
        return self._adj[n]

    def has_node(self, n: Hashable) -> bool:
        return n in self

    def has_edge(self, u: Hashable, v: Hashable) -> bool:
        return u in self._succ and v in self._succ[u]

    def is_directed(self) -> bool:
        return True

    def is_multigraph(self) -> bool:
        return False

    # The number of edges is kept in networkx's cache dict: networkx's own mutators (reached through
    # __getattr__) clear that dict, so a count they could make stale is recounted; the mutators here keep it.
    _EDGES = "symmem_edges"

    def _clear_cache(self, edges: int = 0) -> None:
        cache = self.__networkx_cache__
        count = cache.get(self._EDGES)
        if cache:
            cache.clear()
        if count is not None:
            cache[self._EDGES] = count + edges

    def add_node(self, node_for_adding: Hashable, **attr: Any) -> None:
        n = node_for_adding
        if n not in self._succ:
            if n is None:
                raise ValueError("None cannot be a node")
            self._succ[n] = {}
            self._pred[n] = {}
            self._node[n] = dict(attr)
        else:
            self._node[n].update(attr)
        self._clear_cache()

    def add_nodes_from(self, nodes_for_adding: Iterable[Any], **attr: Any) -> None:
        for n in nodes_for_adding:
            if isinstance(n, tuple) and len(n) == 2 and isinstance(n[1], dict) and n not in self._node:
                self.add_node(n[0], **{**attr, **n[1]})
            else:
                self.add_node(n, **attr)

    def add_edge(self, u_of_edge: Hashable, v_of_edge: Hashable, **attr: Any) -> None:
        u, v = u_of_edge, v_of_edge
        for n in (u, v):
            if n not in self._succ:
                if n is None:
                    raise ValueError("None cannot be a node")
                self._succ[n] = {}
                self._pred[n] = {}
                self._node[n] = {}
        datadict = self._adj[u].get(v)
        new = datadict is None
        if new:
            datadict = {}
        datadict.update(attr)
        self._succ[u][v] = datadict
        self._pred[v][u] = datadict
        self._clear_cache(1 if new else 0)

    def add_edges_from(self, ebunch_to_add: Iterable[Any], **attr: Any) -> None:
        for e in ebunch_to_add:
            u, v, *rest = e
            self.add_edge(u, v, **{**attr, **(rest[0] if rest else {})})

    def remove_node(self, n: Hashable) -> None:
        if n not in self._node:
            raise _not_in_graph(n)
        gone = len(self._succ[n]) + len(self._pred[n]) - (n in self._succ[n])
        for u in self._succ[n]:
            del self._pred[u][n]
        for u in self._pred[n]:
            if u != n:
                del self._succ[u][n]
        del self._succ[n], self._pred[n], self._node[n]
        self._clear_cache(-gone)

    def remove_edge(self, u: Hashable, v: Hashable) -> None:
        try:
            del self._succ[u][v]
            del self._pred[v][u]
        except KeyError:
            import networkx as nx

            raise nx.NetworkXError(f"The edge {u}-{v} not in graph.") from None
        self._clear_cache(-1)

    def successors(self, n: Hashable) -> Iterator[Hashable]:
        try:
            return iter(self._succ[n])
        except KeyError:
            raise _not_in_graph(n) from None

    neighbors = successors

    def predecessors(self, n: Hashable) -> Iterator[Hashable]:
        try:
            return iter(self._pred[n])
        except KeyError:
            raise _not_in_graph(n) from None

    def number_of_nodes(self) -> int:
        return len(self._node)

    def number_of_edges(self, u: Hashable | None = None, v: Hashable | None = None) -> int:
        """The number of edges (in constant time), or whether the edge u -> v exists."""
        if u is not None:
            return int(self.has_edge(u, v))
        count = self.__networkx_cache__.get(self._EDGES)
        if count is None:
            count = sum(len(nbrs) for nbrs in self._succ.values())
            self.__networkx_cache__[self._EDGES] = count
        return count

    def to_networkx(self) -> Any:
        """A real ``networkx.DiGraph`` with the same nodes, edges and attributes (attribute dicts copied)."""
        import networkx as nx

        g = nx.DiGraph()
        g.graph.update(self.graph)
        g.add_nodes_from((n, dict(d)) for n, d in self._node.items())
        g.add_edges_from((u, v, dict(d)) for u, nbrs in self._succ.items() for v, d in nbrs.items())
        return g


class CycleError(ValueError):
    """The graph has a cycle, so it has no topological order."""


def topological_order(graph: DiGraph) -> tuple[Hashable, ...]:
    """The nodes in networkx's ``topological_sort`` order (Kahn's algorithm, generation by generation, in
    insertion order); a cycle raises :class:`CycleError`."""
    succ, pred = graph._succ, graph._pred
    indegree = {v: len(p) for v, p in pred.items() if p}
    generation = [v for v, p in pred.items() if not p]
    out: list[Hashable] = []
    while generation:
        out.extend(generation)
        following = []
        for node in generation:
            for child in succ[node]:
                left = indegree[child] - 1
                if left:
                    indegree[child] = left
                else:
                    following.append(child)
                    del indegree[child]
        generation = following
    if indegree:
        raise CycleError("the graph contains a cycle")
    return tuple(out)
