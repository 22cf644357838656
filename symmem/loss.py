"""Appending a training loss to a built model: the loss is not part of the model, so it is its own group.

:func:`with_loss` copies a model's graph and feeds its single output into a loss op (group ``loss``), with
the target as a new graph input; :func:`symmem.derive.derive` does this for ``loss="cross-entropy"`` and
reports the loss's kept tensors under the category ``loss``.

>>> from symmem.models import build
>>> m = with_loss(build("mlp"), "cross-entropy")
>>> m.graph.nodes["loss"]["kind"], str(m.graph.nodes["target"]["out"])
('cross_entropy', '(B):int64')
"""

from __future__ import annotations

from dataclasses import replace

from .errors import SymmemError
from .graph import GraphBuilder, Model, lint

#: loss name -> the op kind it appends
LOSSES: dict[str, str] = {"cross-entropy": "cross_entropy"}
LOSS_GROUP = "loss"


def model_output(model: Model) -> str:
    """The model's one output node: the node nothing consumes that is not an input or a parameter."""
    graph = model.graph
    outs = [n for n in graph if graph.out_degree(n) == 0 and graph.nodes[n]["kind"] not in ("input", "parameter")]
    if len(outs) != 1:
        raise SymmemError(f"{model.name}: a loss needs exactly one output node, found {outs or 'none'}")
    return outs[0]


def with_loss(model: Model, loss: str) -> Model:
    """A copy of ``model`` whose output feeds ``loss`` (``"cross-entropy"``: logits (..., K), int64 targets)."""
    if loss not in LOSSES:
        raise SymmemError(f"unknown loss {loss!r}; known: {', '.join(LOSSES)}")
    out = model_output(model)
    g = GraphBuilder(model.name)
    graph = model.graph.copy()
    # The copy shares the graph-level containers; the builder appends to them, so give it its own.
    graph.graph["blocks"] = dict(graph.graph.get("blocks", {}))
    graph.graph["assumptions"] = list(graph.graph.get("assumptions", []))
    g.graph = graph
    logits = graph.nodes[out]["out"]
    if logits.rank < 1:
        raise SymmemError(f"{model.name}: output {out!r} is a scalar, not logits")
    with g.group(LOSS_GROUP):
        target = g.input("target", logits.shape[:-1], dtype="int64", role="target")
        g.op(LOSSES[loss], out, target, name="loss", role="loss")
    lint(graph)
    return replace(model, graph=graph, options={**dict(model.options), "loss": loss})
