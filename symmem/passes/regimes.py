"""Training regimes applied to the storages: checkpointing, tensor/sequence/pipeline parallelism and ZeRO.

The derivation first lists what a convention keeps (:mod:`.saved`), then hands the storages to this module:

1. **tensor parallelism** over ``t`` ranks divides the tensors that Megatron-LM splits across the
   tensor-parallel group (roles in :data:`TP_ROLES`: Q/K/V, attention scores/probabilities/dropout, the
   projection input, the MLP hidden and activation); with **sequence parallelism** every activation of a
   repeated layer is split over ``t`` (Korthikanti et al. 2022, sections 4.2.2-4.2.3);
2. **checkpointing** of every repeated block: ``full`` keeps each layer's input and nothing else, with one
   layer's activations alive again during its backward as the ``transient`` term ``<block>.recompute``;
   ``every-k`` keeps the input of every k-th layer and recomputes k layers at a time (Chen et al. 2016);
   ``selective`` drops the attention scores, probabilities and attention dropout (Korthikanti et al. 2022,
   section 5) and shows one layer's recomputed copy as a transient term; in a storage-counting convention on one
   device, what a checkpointed core attention keeps instead (:mod:`.selective`);
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

import warnings
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import sympy

from ..derivation import END, START, Storage
from ..errors import SymmemError, UncountedInput
from ..graph import Graph
from ..shapes import numel
from ..symbols import N, p, t, unordered
from ..tensor import dtype_bytes
from ..training import Regime, checkpoint_every
from . import selective
from .storage import resolve

if TYPE_CHECKING:
    from ..ledger import Parameter

#: Activations Megatron-LM splits across the tensor-parallel group (column-parallel outputs and what follows).
TP_ROLES = frozenset({"qkv", "attn_scores", "attn_probs", "attn_dropout", "attention", "proj_input",
                      "mlp_hidden", "mlp_act"})
#: What selective recomputation drops: the core attention (Korthikanti et al. 2022, section 5).
SELECTIVE_ROLES = frozenset({"attn_scores", "attn_probs", "attn_dropout"})
#: Values the regime symbols take when nothing is set: one 8-GPU node of data or tensor parallelism and a
#: 4-stage pipeline.  They only give numbers; formulas keep the symbols.
DEFAULTS: dict[sympy.Symbol, int] = {N: 8, t: 8, p: 4}


#: What each regime symbol stands for, and the option that brings it.
MEANINGS = {"N": "data-parallel size N", "t": "tensor-parallel size t", "p": "number of pipeline stages p"}
FLAGS = {"N": "ZeRO: --zero 1|2|3", "t": "tensor parallelism: --tensor-parallel",
         "p": "pipeline parallelism: --pipeline-parallel"}


def symbols(regime: Regime) -> tuple[sympy.Symbol, ...]:
    """The symbols a regime brings: N with ZeRO, t with tensor parallelism, p with pipeline parallelism."""
    return _brought(regime)


def _brought(regime: Regime) -> tuple[sympy.Symbol, ...]:
    found = []
    if regime.zero or getattr(regime, "data_parallel", None):
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
    return f" ({name} comes with {FLAGS[name]})" if name in FLAGS else ""


def requirements(graph: Graph, symbols: Sequence[sympy.Symbol], regime: Regime
                 ) -> list[tuple[str, sympy.Basic, None]]:
    """What the regime needs of the model and its symbols, as (node, condition, None) checked with numbers.

    Tensor parallelism splits attention heads and MLP widths (Megatron-LM's column/row-parallel linears), so it
    needs layers with those roles and ``t`` dividing the heads ``h``, the key/value heads ``G`` and the MLP
    width ``F``; sequence parallelism splits ``S`` over ``t`` too.  Pipeline parallelism needs repeated layers
    and at most as many stages as layers, and ``p`` dividing the layers (an even split, as Megatron-LM's).  A
    dimension of the model's own named N, t or p under the regime that brings that size is refused (the two
    would be one symbol).  Checkpointing every K layers needs K <= the layers of a block.
    """
    def split() -> str | None:
        return next((n for n in graph.order() if graph.node(n).role in TP_ROLES), None)

    blocks = [(b.input, b.count) for b in graph.blocks.values()]
    return needs(graph.graph.get("name", "this model"), split, blocks, symbols, regime)


def needs(model: str, split: Callable[[], str | None], blocks: Sequence[tuple[str, sympy.Expr]],
          symbols: Sequence[sympy.Symbol], regime: Regime) -> list[tuple[str, sympy.Basic, None]]:
    """:func:`requirements` of any front: ``split()`` is the first node that tensor parallelism splits (None:
    none), ``blocks`` the repeated blocks as (input node, count)."""
    found: list[tuple[str, sympy.Basic, None]] = []
    names = {s.name: s for s in symbols}
    for own in _brought(regime):
        if own.name in names:
            # N, t and p mean the regime's sizes in every formula, option (--set t=8) and view; a dimension of
            # the model's own under the same name would merge with it (10816/N, N the batch)
            raise SymmemError(f"dimension {own.name!r} of {model} is named like the {MEANINGS[own.name]} "
                              f"({FLAGS[own.name]}), and the formula would merge the two: give the dimension "
                              f"another name (--dims B=..., dims={{'B': ...}} in Python)")
    if regime.tensor_parallel:
        first = split()
        if first is None:
            raise SymmemError(f"tensor parallelism splits attention heads and MLP widths (Megatron-LM); "
                              f"{model} has no such layers (no op with a role in {', '.join(sorted(TP_ROLES))})")
        for name in ("h", "G", "F"):
            if name in names:
                found.append((first, sympy.Eq(sympy.Mod(names[name], t), 0), None))
        if regime.sequence_parallel and "S" in names:
            found.append((first, sympy.Eq(sympy.Mod(names["S"], t), 0), None))
    if regime.pipeline_parallel:
        if not blocks:
            raise SymmemError(f"pipeline parallelism splits repeated layers into stages; {model} has no repeated "
                              "layers")
        layers = sympy.Add(*(count for _, count in blocks))
        # an even split, as Megatron-LM's (get_num_layers_to_build asserts num_layers % p == 0): a stage holds
        # L/p layers, which the formulas divide by
        found += [(blocks[0][0], cond, None) for cond in _stage_conditions(layers)]
    every = checkpoint_every(regime.checkpoint)
    if every is not None:
        for node, count in blocks:
            if not count.is_number:
                found.append((node, sympy.Le(every, count), None))
    return found


def _stage_conditions(layers: sympy.Expr) -> tuple[sympy.Basic, sympy.Basic]:
    """``p <= layers`` and ``layers % p == 0``.  Where ``layers`` is one symbol other than ``p`` (``L``: every
    built-in model) sympy's evaluation leaves both as they are (two positive integers' order and remainder are not
    decided by their assumptions), so they are built unevaluated: the same objects, without asking the assumptions
    (the first ``Le`` of a process set up sympy's assumption system for it: a tenth of a pipeline derivation's
    time).

    >>> from symmem.symbols import L
    >>> import sympy
    >>> fast, slow = _stage_conditions(L), (sympy.Le(p, L), sympy.Eq(sympy.Mod(L, p), 0))
    >>> fast == slow, [sympy.srepr(x) for x in fast] == [sympy.srepr(x) for x in slow]
    (True, True)
    """
    if unordered(layers, p):
        return sympy.Le(p, layers, evaluate=False), sympy.Eq(sympy.Mod(layers, p, evaluate=False), 0, evaluate=False)
    return sympy.Le(p, layers), sympy.Eq(sympy.Mod(layers, p), 0)


def _role(graph: Graph, term: Storage) -> str | None:
    if term.node is not None and term.node in graph:
        return graph.node(term.node).role
    return term.role


def _block(graph: Graph, term: Storage) -> str | None:
    if term.node is not None and term.node in graph:
        return graph.node(term.node).block
    return None


def _divide(term: Storage, by: sympy.Expr) -> Storage:
    elements = None if term.elements is None else term.elements / by
    return replace(term, expr=term.expr / by, elements=elements)


def _warn_uncounted(graph: Graph, kept: list[Storage], dropped: dict[str, list[Storage]]) -> None:
    """Warn where selective recomputation drops a matmul's copy of an input nothing outside the core keeps (eager
    Llama's rotary query: its only saver is the scores matmul's copy), once per derivation: where what the
    checkpoint keeps is not counted (no core marked, as BERT's eager attention; tensor parallelism)."""
    held = {x.node for x in kept if x.category == "activation"}
    for gone in dropped.values():
        for x in gone:
            if x.role != "matmul_copy" or x.node is None or not x.name.startswith(f"{x.node}.input"):
                continue
            source = graph.node(x.node).inputs[int(x.name[len(x.node) + len(".input"):-len("_copy")])]
            if not {s for s, _ in resolve(graph, source)} & held:
                shape = ", ".join(map(str, graph.node(source).out.shape))
                warnings.warn(f"selective recomputation: {source} ({shape}), the input {x.node} copies, is kept by "
                              "nothing outside the recomputed attention; the recompute needs it, so the kept "
                              "activations are low by its bytes per layer (not yet counted)", UncountedInput,
                              stacklevel=2)
                return


def _per_layer(term: Storage) -> sympy.Expr:
    return term.expr / term.count if term.count != 0 else sympy.Integer(0)


def activations(graph: Graph, terms: list[Storage], regime: Regime, act_dtype: str,
                per_layer: bool, dedup: bool = False) -> list[Storage]:
    """The activation storages under the regime's tensor/sequence parallelism, checkpointing and pipeline.

    ``dedup`` says the storages are counted once each (the first layer's input is then the block source's).
    """
    out = list(terms)
    if regime.tensor_parallel:
        out = [_divide(x, t) if x.category == "activation" and (
            (regime.sequence_parallel and _block(graph, x) is not None) or _role(graph, x) in TP_ROLES) else x
            for x in out]
    if regime.checkpoint != "none":
        out = _checkpoint(graph, out, regime, act_dtype, per_layer, dedup)
    if regime.pipeline_parallel and not per_layer:
        out = pipeline(out, lambda x: _block(graph, x))
    return out


def _checkpoint(graph: Graph, terms: list[Storage], regime: Regime, act_dtype: str,
                per_layer: bool, dedup: bool) -> list[Storage]:
    blocks = graph.blocks
    every = checkpoint_every(regime.checkpoint)
    out: list[Storage] = []
    dropped: dict[str, list[Storage]] = {}
    # Storage counting on one device: what a checkpointed core attention really keeps (its inputs, in place of
    # everything its ops save; passes/selective.py).  Elsewhere the roles Korthikanti et al. name.
    cores = selective.cores(graph) if regime.checkpoint == "selective" and dedup and not (
        regime.tensor_parallel or regime.sequence_parallel) else None
    for x in terms:
        block = _block(graph, x)
        if x.category != "activation" or block is None:
            out.append(x)
            continue
        if regime.checkpoint == "selective" and not (
                selective.dropped(x, cores) if cores is not None and cores.nodes
                else _role(graph, x) in SELECTIVE_ROLES):
            out.append(x)
            continue
        dropped.setdefault(block, []).append(x)
    if cores is not None and cores.nodes:
        out.extend(selective.inputs_kept(graph, cores, out, act_dtype, per_layer))
    elif regime.checkpoint == "selective":
        _warn_uncounted(graph, out, dropped)
    alive_again: list[Storage] = []
    for name, gone in dropped.items():
        block = blocks[name]
        group = graph.node(block.input).group
        one_layer = sympy.Add(*(_per_layer(x) for x in gone))
        # recomputed during the block's backward, freed as that backward proceeds
        during = {"born": "backward", "dies": "backward"}
        if regime.checkpoint == "selective":
            alive_again.append(Storage(f"{name}.recompute", "recompute", "transient", one_layer, "recompute",
                                       block.input, count=sympy.Integer(1), **during))
            continue
        k = sympy.Integer(every or 1)
        if per_layer:
            kept = 1 / k
        else:
            kept = sympy.ceiling(block.count / k)
            # In a storage-counting convention the first layer's input is the block source's storage, which is
            # already counted outside the block when the first layer keeps it.
            sources = {s for s, _ in resolve(graph, block.source)}
            if dedup and any(x.node in sources and x.name == x.node and _block(graph, x) is None
                             for x in out if x.category in ("activation", "input")):
                kept -= 1
        spec = graph.node(block.input).out
        elements = spec.numel / (t if regime.sequence_parallel else 1)
        if kept != 0:
            out.append(Storage(f"{name}.checkpoint", group, "activation",
                               kept * elements * dtype_bytes(spec.dtype, act_dtype), "checkpoint", block.input,
                               spec.dtype, elements, kept, (block.input,), "forward", "backward"))
        alive = k if every is None or not block.count.is_number else sympy.Min(k, block.count)
        alive_again.append(Storage(f"{name}.recompute", "recompute", "transient", alive * one_layer, "recompute",
                                   block.input, count=alive, **during))
    if len(alive_again) > 1:
        # Backward recomputes one block at a time: the peak is the largest, not the sum.
        peak = sympy.Max(*(x.expr for x in alive_again))
        alive_again = [Storage("recompute", "recompute", "transient", peak, "recompute",
                               born="backward", dies="step")]
    return out + alive_again


def pipeline(terms: list[Storage], block: Callable[[Storage], str | None]) -> list[Storage]:
    """The activations of one pipeline stage: a repeated block's (``block(storage)``: its block, or None) divided
    over the ``p`` stages, and the micro-batches in flight."""
    out: list[Storage] = []
    stage: list[sympy.Expr] = []
    for x in terms:
        if x.category == "activation" and block(x) is not None:
            x = replace(x, expr=x.expr / p, count=x.count / p)
            stage.append(x.expr)
        out.append(x)
    if stage:
        # the other micro-batches' activations are alive from their forward to their backward
        out.append(Storage("pipeline.in_flight", "pipeline", "activation", (p - 1) * sympy.Add(*stage),
                           "in_flight", None, count=p - 1, born="forward", dies="backward"))
    return out


def parameters(params: Sequence[Parameter], regime: Regime, per_layer: bool) -> list[Storage]:
    """The parameter side of a ledger's parameters (:class:`~symmem.ledger.Parameter`, in the order the model
    holds them), one storage per parameter and component (weights, gradients, optimizer states; a frozen
    parameter's weights only).

    One device holds: tensor parallelism splits matrices (rank >= 2) over t, pipeline parallelism the repeated
    layers over p; the ZeRO stage divides each component it shards by N.  Weights exist all step; gradients
    appear as their op runs backward and last until the step; optimizer state exists from the first step on.
    """
    found = []
    # Every parameter of one (count, shape) has the same components and bytes: worked out once per shape (a
    # graph of many layers has few shapes), only the names and moments are per parameter.
    per_shape: dict[tuple[sympy.Expr, bool, tuple[sympy.Expr, ...], bool],
                    list[tuple[str, bool, Storage]]] = {}
    for param in params:
        owner, in_block = param.owner, param.block is not None
        scale = _own_dtype(regime, param.dtype)
        key = (param.count, in_block, param.shape, param.trainable, scale)
        parts = per_shape.get(key)
        if parts is None:
            # a frozen parameter keeps its weights and has no gradient, master copy or optimizer state
            parts = per_shape[key] = [
                (component, gradient, Storage(component, "parameters", "parameter", expr * scale, component, None,
                                              None, None, each_count, born=START, dies=END, shards=shards))
                for component, expr, each_count, shards, gradient in
                _parameter_parts(regime, param.count, in_block, per_layer, param.shape)
                if param.trainable or regime.kind_of(component) == "weights"]
        for component, gradient, template in parts:
            # gradients appear as their op runs backward and last until the step (DDP's bucket views all step)
            born, dies = ("backward", "step") if gradient and regime.data_parallel != "ddp-bucket-view" else (
                START, END)
            found.append(_like(template, f"{owner}.{param.name}.{component}", owner, born, dies))
    return found


def _own_dtype(regime: Regime, dtype: str | None) -> sympy.Rational:
    """The bytes of a parameter held in a dtype of its own (a traced bfloat16 module, trained as it is: precision
    fp32, the module's own) over FP32's: its weights, gradient and torch.optim's states (``zeros_like`` the
    parameter) are in its dtype.  1 for a built model's parameters (no dtype), a mixed precision (its own byte
    table) and an optimizer whose states keep their own format (8-bit, factored)."""
    spec = regime.optimizer_spec
    if dtype is None or regime.precision != "fp32" or spec.block or spec.factored:
        return sympy.Integer(1)
    return sympy.Rational(dtype_bytes(dtype), 4)


#: Whether a Storage can be copied field by field: it has neither ``__post_init__`` nor ``__slots__``.
_COPYABLE = not hasattr(Storage, "__post_init__") and not hasattr(Storage, "__slots__")


def _like(template: Storage, name: str, node: str, born: str, dies: str) -> Storage:
    """``template`` with its name, node and phases changed.

    The parameter side of a large graph is 100,000s of storages that differ only in these four fields; a
    field-by-field copy of one made by the constructor costs a fifth of the frozen dataclass's ``__init__``
    (Storage checks nothing in ``__post_init__``; if it ever does, this falls back to ``replace``).
    """
    if not _COPYABLE:
        return replace(template, name=name, node=node, born=born, dies=dies)
    s = object.__new__(Storage)
    fields = s.__dict__
    fields.update(template.__dict__)
    fields["name"], fields["node"], fields["born"], fields["dies"] = name, node, born, dies
    return s


def _parameter_parts(regime: Regime, count: sympy.Expr, in_block: bool, per_layer: bool,
                     shape: tuple[sympy.Expr, ...]) -> list[tuple[str, sympy.Expr, sympy.Expr, sympy.Expr, bool]]:
    """(component, bytes, count, shards, whether it is a gradient) of one parameter of ``shape``."""
    if regime.pipeline_parallel and not per_layer and in_block:
        count = count / p
    if regime.tensor_parallel and len(shape) >= 2:
        count = count / t
    n = numel(shape)
    parts = [(name, n * b) for name, b in regime.precision_spec.components]
    parts += regime.optimizer_spec.state_bytes(shape)
    if regime.data_parallel in ("ddp", "zero-redundancy"):
        # DistributedDataParallel's gradient buckets beside the gradients (passes/data_parallel.py)
        parts.append(("ddp_buckets", n * sum(b for name, b in regime.precision_spec.components
                                             if regime.kind_of(name) == "gradients")))
    out = []
    for component, each in parts:
        shards = N if regime.shard(component) else sympy.Integer(1)
        # a gradient lives from its op's backward to the step; DDP's buckets live all step
        gradient = regime.kind_of(component) == "gradients" and component != "ddp_buckets"
        out.append((component, count * each / shards, count, shards, gradient))
    return out
