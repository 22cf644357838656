"""Training regimes applied to derived terms: checkpointing, tensor/sequence/pipeline parallelism and ZeRO.

:func:`symmem.derive.derive` first lists what a convention keeps, then hands the terms to this module:

1. **tensor parallelism** over ``t`` ranks divides the tensors that Megatron-LM splits across the
   tensor-parallel group (roles in :data:`TP_ROLES`: Q/K/V, attention scores/probabilities/dropout, the
   projection input, the MLP hidden and activation); with **sequence parallelism** every activation of a
   repeated layer is split over ``t`` (Korthikanti et al. 2022, sections 4.2.2-4.2.3);
2. **checkpointing** of every repeated block: ``full`` keeps each layer's input and nothing else, with one
   layer's activations alive again during its backward as the ``transient`` term ``<block>.recompute``;
   ``every-k`` keeps the input of every k-th layer and recomputes k layers at a time (Chen et al. 2016);
   ``selective`` drops the attention scores, probabilities and attention dropout (Korthikanti et al. 2022,
   section 5) and shows one layer's recomputed copy as a transient term;
3. **pipeline parallelism** over ``p`` stages: a stage holds ``L/p`` layers and, under the 1F1B schedule,
   the first stage keeps ``p`` micro-batches in flight (Narayanan et al. 2021, section 2.2; Korthikanti et
   al. 2022, section 4.2.3): the term ``pipeline.in_flight`` = (p - 1) more micro-batches of its layers;
4. **parameter side**: tensor parallelism divides every matrix parameter (rank >= 2) by ``t`` (vectors such
   as norms and row-parallel biases stay replicated), pipeline parallelism the repeated layers' parameters by
   ``p``, and ZeRO stage 1/2/3 divides the optimizer side / gradients / weights by ``N``.

>>> from symmem import derive
>>> d = derive("gpt-megatron", convention="megatron", precision="mixed-megatron", per_layer=True,
...            checkpoint="full")
>>> d.activations
2*B*H*S
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import sympy

from .derive import Term, _resolve
from .symbols import N, p, t
from .tensor import dtype_bytes
from .training import Regime, checkpoint_every

#: Activations Megatron-LM splits across the tensor-parallel group (column-parallel outputs and what follows).
TP_ROLES = frozenset({"qkv", "attn_scores", "attn_probs", "attn_dropout", "attention", "proj_input",
                      "mlp_hidden", "mlp_act"})
#: What selective recomputation drops: the core attention (Korthikanti et al. 2022, section 5).
SELECTIVE_ROLES = frozenset({"attn_scores", "attn_probs", "attn_dropout"})
#: Values the regime symbols take when nothing is set: one 8-GPU node of data or tensor parallelism and a
#: 4-stage pipeline.  They only give numbers; formulas keep the symbols.
DEFAULTS: dict[sympy.Symbol, int] = {N: 8, t: 8, p: 4}


def symbols(regime: Regime) -> tuple[sympy.Symbol, ...]:
    """The symbols a regime brings: N with ZeRO, t with tensor parallelism, p with pipeline parallelism."""
    found = []
    if regime.zero:
        found.append(N)
    if regime.tensor_parallel:
        found.append(t)
    if regime.pipeline_parallel:
        found.append(p)
    return tuple(found)


def hint(name: str) -> str:
    """What brings a regime symbol into a derivation ('' for other names).

    >>> hint("t")
    ' (t comes with tensor parallelism: --tensor-parallel)'
    """
    flags = {"N": "ZeRO: --zero 1|2|3", "t": "tensor parallelism: --tensor-parallel",
             "p": "pipeline parallelism: --pipeline-parallel"}
    return f" ({name} comes with {flags[name]})" if name in flags else ""


def _role(graph: nx.DiGraph, term: Term) -> str | None:
    if term.node is not None and term.node in graph:
        return graph.nodes[term.node]["out"].role
    return term.role


def _block(graph: nx.DiGraph, term: Term) -> str | None:
    if term.node is not None and term.node in graph:
        return graph.nodes[term.node]["block"]
    return None


def _divide(term: Term, by: sympy.Expr) -> Term:
    elements = None if term.elements is None else term.elements / by
    return replace(term, expr=term.expr / by, elements=elements)


def _per_layer(term: Term) -> sympy.Expr:
    return term.expr / term.count if term.count != 0 else sympy.Integer(0)


def activations(graph: nx.DiGraph, terms: list[Term], regime: Regime, act_dtype: str,
                per_layer: bool, dedup: bool = False) -> list[Term]:
    """The activation terms under the regime's tensor/sequence parallelism, checkpointing and pipeline.

    ``dedup`` says the terms count storages (the first layer's input is then the block source's storage).
    """
    out = list(terms)
    if regime.tensor_parallel:
        out = [_divide(x, t) if x.category == "activation" and (
            (regime.sequence_parallel and _block(graph, x) is not None) or _role(graph, x) in TP_ROLES) else x
            for x in out]
    if regime.checkpoint != "none":
        out = _checkpoint(graph, out, regime, act_dtype, per_layer, dedup)
    if regime.pipeline_parallel and not per_layer:
        out = _pipeline(graph, out)
    return out


def _checkpoint(graph: nx.DiGraph, terms: list[Term], regime: Regime, act_dtype: str,
                per_layer: bool, dedup: bool) -> list[Term]:
    blocks = graph.graph.get("blocks", {})
    every = checkpoint_every(regime.checkpoint)
    out: list[Term] = []
    dropped: dict[str, list[Term]] = {}
    for x in terms:
        block = _block(graph, x)
        if x.category != "activation" or block is None:
            out.append(x)
            continue
        if regime.checkpoint == "selective" and _role(graph, x) not in SELECTIVE_ROLES:
            out.append(x)
            continue
        dropped.setdefault(block, []).append(x)
    alive_again: list[Term] = []
    for name, gone in dropped.items():
        block = blocks[name]
        group = graph.nodes[block.input]["group"]
        one_layer = sympy.Add(*(_per_layer(x) for x in gone))
        if regime.checkpoint == "selective":
            alive_again.append(Term(f"{name}.recompute", "recompute", "transient", one_layer, "recompute", block.input,
                                    count=sympy.Integer(1)))
            continue
        k = sympy.Integer(every or 1)
        if per_layer:
            kept = 1 / k
        else:
            kept = sympy.ceiling(block.count / k)
            # In a storage-counting convention the first layer's input is the block source's storage, which is
            # already counted outside the block when the first layer keeps it.
            sources = {s for s, _ in _resolve(graph, block.source)}
            if dedup and any(x.node in sources and x.name == x.node and _block(graph, x) is None
                             for x in out if x.category in ("activation", "input")):
                kept -= 1
        spec = graph.nodes[block.input]["out"]
        elements = spec.numel / (t if regime.sequence_parallel else 1)
        if kept != 0:
            out.append(Term(f"{name}.checkpoint", group, "activation",
                            kept * elements * dtype_bytes(spec.dtype, act_dtype), "checkpoint", block.input,
                            spec.dtype, elements, kept))
        alive = k if every is None or not block.count.is_number else sympy.Min(k, block.count)
        alive_again.append(Term(f"{name}.recompute", "recompute", "transient", alive * one_layer, "recompute",
                                block.input, count=alive))
    if len(alive_again) > 1:
        # Backward recomputes one block at a time: the peak is the largest, not the sum.
        peak = sympy.Max(*(x.expr for x in alive_again))
        alive_again = [Term("recompute", "recompute", "transient", peak, "recompute")]
    return out + alive_again


def _pipeline(graph: nx.DiGraph, terms: list[Term]) -> list[Term]:
    out: list[Term] = []
    stage: list[sympy.Expr] = []
    for x in terms:
        if x.category == "activation" and _block(graph, x) is not None:
            x = replace(x, expr=x.expr / p, count=x.count / p)
            stage.append(x.expr)
        out.append(x)
    if stage:
        out.append(Term("pipeline.in_flight", "pipeline", "activation", (p - 1) * sympy.Add(*stage),
                        "in_flight", None, count=p - 1))
    return out


def parameter_shapes(graph: nx.DiGraph, nodes: list[str], regime: Regime, per_layer: bool
                     ) -> list[tuple[sympy.Expr, tuple[sympy.Expr, ...]]]:
    """(count, shape) of every parameter one device holds before ZeRO: TP splits matrices, PP the layers."""
    shapes = []
    for n in nodes:
        data = graph.nodes[n]
        c = sympy.Integer(1) if per_layer else data["count"]
        if regime.pipeline_parallel and not per_layer and data["block"] is not None:
            c = c / p
        for shape in data["params"].values():
            shapes.append((c / t if regime.tensor_parallel and len(shape) >= 2 else c, shape))
    return shapes


def parameters(regime: Regime, shapes: list[tuple[sympy.Expr, tuple[sympy.Expr, ...]]]) -> list[Term]:
    """The parameter-side terms, each component divided by N where the ZeRO stage shards it."""
    found = []
    for name, e in regime.parameter_terms(shapes):
        if regime.shard(name):
            e = e / N
        found.append(Term(name, "parameters", "parameter", e, name))
    return found
