"""Appending a training loss to a built model: the loss is not part of the model, so it is its own group.

:func:`with_loss` copies a model's graph and feeds its single output into a loss op (group ``loss``), with
the target as a new graph input; :func:`symmem.api.derive` does this for ``loss="cross-entropy"`` and
reports the loss's kept tensors under the category ``loss``.

A builder can say how its model is trained through graph attributes.  ``graph.graph["causal_lm"]``: a language
model whose logits (..., S, V) are scored against the next token, as Hugging Face's ``GPT2LMHeadModel`` and
``LlamaForCausalLM`` do with ``labels`` (transformers 5.23, ``loss_utils.ForCausalLMLoss``): ``logits.float()``
flattened, the labels padded with ``-100`` (``F.pad(labels, (0, 1))``) and shifted,
``labels[..., 1:].contiguous()``, then ``cross_entropy(..., ignore_index=-100)``.  What that keeps (measured):
the float32 log-probabilities (B S, V), the shifted labels' contiguous copy (B S int64, a new tensor, so
``loss`` and not ``input``; for B = 1 the padded (1, S + 1) labels themselves) and the 0-dim ``total_weight``.
Releases before 4.46 sliced the logits to S - 1 positions instead (``logits[..., :-1, :]``).
``graph.graph["no_loss"]``: why the model has no logits to score (an error names it).

>>> from symmem.models import build
>>> m = with_loss(build("mlp"), "cross-entropy")
>>> m.graph.node("loss").kind, str(m.graph.node("target").out)
('cross_entropy', '(B):int64')
"""

from __future__ import annotations

from dataclasses import replace

from .conditions import slice_copies
from .errors import SymmemError
from .graph import GraphBuilder, Model, lint
from .shapes import numel

#: loss name -> the op kind it appends
LOSSES: dict[str, str] = {"cross-entropy": "cross_entropy"}
LOSS_GROUP = "loss"


def model_output(model: Model) -> str:
    """The model's one output node: the node nothing consumes that is not an input or a parameter."""
    graph = model.graph
    outs = [n for n in graph.order()
            if graph.out_degree(n) == 0 and graph.node(n).kind not in ("input", "parameter", "buffer", "constant")]
    if len(outs) != 1:
        raise SymmemError(f"{model.name}: a loss needs exactly one output node, found {outs or 'none'}")
    return outs[0]


def with_loss(model: Model, loss: str) -> Model:
    """A copy of ``model`` whose output feeds ``loss`` (``"cross-entropy"``: logits (..., K), int64 targets)."""
    if loss not in LOSSES:
        raise SymmemError(f"unknown loss {loss!r}; known: {', '.join(LOSSES)}")
    reason = model.graph.graph.get("no_loss")
    if reason:
        raise SymmemError(f"{model.name}: --loss {loss} is not available: {reason}")
    out = model_output(model)
    g = GraphBuilder(model.name)
    graph = model.graph.copy()
    g.graph = graph
    graph.graph["model_output"] = out
    logits = graph.node(out).out
    if logits.rank < 1:
        raise SymmemError(f"{model.name}: output {out!r} is a scalar, not logits")
    with g.group(LOSS_GROUP):
        target = g.input("target", logits.shape[:-1], dtype="int64", role="target")
        if graph.graph.get("causal_lm"):
            out, target = _shift(g, model, out, target)
        g.op(LOSSES[loss], out, target, name="loss", role="loss")
    lint(graph)
    return replace(model, graph=graph, options={**dict(model.options), "loss": loss})


def _shift(g: GraphBuilder, model: Model, logits: str, labels: str) -> tuple[str, str]:
    """transformers 5.23 ``ForCausalLMLoss``: ``logits.float()`` flattened to (B S, V); the labels padded with one
    ``-100`` on the right (``F.pad``, a new (..., S + 1) tensor) and shifted, ``labels[..., 1:].contiguous()``, as
    the target of every position (the last one ignored); ``cross_entropy(..., ignore_index=-100)``."""
    spec = g.spec(logits)
    if spec.rank < 2:
        raise SymmemError(f"{model.name}: a causal LM loss needs logits (..., S, V), got {spec}")
    *lead, seq, vocab = spec.shape
    rows = numel(tuple(lead)) * seq
    x = g.op("cast", logits, name="logits_float", dtype="float32")  # logits.float(): a view in FP32
    x = g.op("reshape", x, name="logits_view", shape=(rows, vocab))
    pad = g.op("constant", name="ignore_index", shape=(*lead, 1), dtype="int64")
    y = g.op("concat", labels, pad, name="labels_padded", dim=-1)  # F.pad(labels, (0, 1), value=-100)
    # the loss function's local ``labels`` holds the padded labels until it returns, after cross_entropy
    # (measured: B*(S+1)*8 bytes alive at the loss's forward); the step keeps them until the loss op
    g.graph.graph.setdefault("held_until", {})[y] = "loss"
    y = g.op("slice", y, name="shift_labels", dim=-1, start=1, stop=seq + 1)
    # a copy for B >= 2; for B = 1 the slice is contiguous already and nll_loss keeps the padded labels.  ``copy``
    # stated, not left to the strides: layouts take B >= 2 (symmem.strides), and the loss is exact at B = 1 too
    y = g.op("contiguous", y, name="shift_labels_contiguous", role="target",
             copy=slice_copies((*lead, seq + 1), -1))
    y = g.op("reshape", y, name="shift_labels_view", shape=(rows,))
    return x, y
