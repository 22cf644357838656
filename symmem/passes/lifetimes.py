"""When each storage is born and dies on the training step's schedule.

The schedule of a step: the forward pass runs the nodes in graph order, the backward pass runs them in reverse,
then the optimizer steps.  A saved activation is born when its producer runs forward and dies once the last
op that keeps it has run backward -- the keeper that comes *first* in forward order.  Inputs exist from the
start.  In a repeated block, a layer's output is kept by the next layer: it dies one iteration later
(``lag=1``).  Moments name template nodes; the iteration is relative to the storage's own.

>>> from symmem.models import build
>>> g = build("mlp").graph
>>> born, dies = lifetime(g, "act1", "activation", [("act1", "same"), ("fc2", "same")])
>>> born, dies
(Moment(phase='forward', node='act1', lag=0), Moment(phase='backward', node='act1', lag=0))
"""

from __future__ import annotations

from ..derivation import START, Moment
from ..graph import Graph


def position(graph: Graph) -> dict[str, int]:
    """Each node's index in forward order (cached per graph size)."""
    key = (graph.number_of_nodes(), graph.number_of_edges())
    cached = graph.graph.get("_position")
    if cached is not None and cached[0] == key:
        return cached[1]
    found = {n: i for i, n in enumerate(graph.order())}
    graph.graph["_position"] = (key, found)
    return found


def lifetime(graph: Graph, producer: str, category: str, keepers: list[tuple[str, str]]
             ) -> tuple[Moment, Moment]:
    """(born, dies) of the storage made by ``producer`` and kept by ``keepers`` (node, mode) pairs.

    ``mode`` is ``rest`` when the keeper sees the storage one iteration later (a block's output kept as the
    next layer's input), as :func:`symmem.passes.storage.resolve` reports it.
    """
    born = START if category == "input" else Moment("forward", producer)
    if not keepers:
        return born, Moment("backward", producer)
    pos = position(graph)
    first, mode = min(keepers, key=lambda km: (km[1] != "rest", pos[km[0]]))
    return born, Moment("backward", first, 1 if mode == "rest" else 0)
