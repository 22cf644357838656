"""One pipeline stage's memory as ``torch.distributed.pipelining`` holds it: ScheduleGPipe and Schedule1F1B.

The papers' accounting (:func:`symmem.passes.regimes.pipeline`: a stage holds ``L/p`` layers and ``p``
micro-batches in flight, the embedding and the head on the one stage shown) is not what the engine does.
Measured per rank on gloo (``symmem.record.model_parallel_runs``, torch 2.13; ``tests/test_model_parallel.py``):

* **the split** -- the embedding (and what the model computes before its layers) is on the first stage, the final
  norm, the head and the loss on the last, ``L/p`` layers on each; a tied head is a copy of the embedding on the
  last stage (its own weights, gradient and optimizer state);
* **micro-batches in flight** -- GPipe runs every forward before any backward: every stage holds ``M``
  micro-batches' saved activations; 1F1B holds ``min(p - s, M)`` on stage ``s`` (the first stage the most, the
  last one);
* **per micro-batch in flight** -- what the stage's ops save (the single-device derivation's storages, split by
  group: ``embed`` on the first stage, the layers', ``head`` and ``loss`` on the last) less the stage's output,
  which no op of the stage keeps; a stage that is not the last also holds that output (``fwd_cache``) until the
  micro-batch's backward;
* **held between steps** -- a receive buffer per micro-batch for the activation from the stage before (stages
  after the first) and for the gradient from the stage after (stages before the last), made once and kept; the
  last stage keeps every micro-batch's logits (``output_chunks``, ``M`` x the model's output) until the next step
  begins; Adam's 4-byte ``step`` per parameter tensor;
* **what the layers read besides the layer before** (Llama's rotary tables, eager attention's mask) -- every
  stage makes its own for each micro-batch (:func:`shared_nodes`), and holds the rotary frequencies;
* **checkpointed layers** (``full``, ``every-K``: each stage checkpoints its own layers, K at a time) --
  a micro-batch in flight keeps each run's input and the tensor arguments the checkpoint saves (eager attention's
  mask), and each run is recomputed in its backward: the single-device step's recomputations, each on its layer's
  stage (:data:`symmem.timeline.RECOMPUTED`);
* **the optimizer step** (``for-loop`` Adam/AdamW, the CPU default) -- every gradient, and per parameter two
  temporaries of its size beside the previous parameter's ``denom`` (:func:`symmem.passes.schedule.step_events`).

A :class:`StageMemory` holds each part as a formula in the model's sizes and ``p`` (``M`` and the schedule are
numbers: the micro-batch count is an option, as gradient accumulation's is).  ``step_peak`` is the live memory
at the optimizer step's largest moment; ``held`` is what the pipeline phase holds at its most micro-batches in
flight before any backward op runs (a lower bound of that phase's peak).  The phase's peak itself, op by op, is
:func:`pipeline_peaks` at numbers: the single-device step's timeline cut by stage and replayed in the schedule's
order; :meth:`Pipeline.peak` is the largest stage's, with where.

>>> from symmem.api import pipeline_stages
>>> plan = pipeline_stages("gpt2", schedule="gpipe", micro_batches=4, loss="cross-entropy", attention="naive",
...                        dropout=0.0, device="cpu",
...                        values={"B": 2, "S": 8, "H": 32, "h": 2, "L": 2, "V": 64, "F": 128, "p": 2})
>>> [(s.name, s.in_flight) for s in plan.stages]
[('first', 4), ('middle', 4), ('last', 4)]
>>> plan.values("first")["saved"], plan.values("last")["parameters"]
(234752, 59264)
>>> top = plan.peak()
>>> top.bytes, top.stage, top.where
(1039416, 0, 'the optimizer step')
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from fractions import Fraction
from typing import Any

import sympy

from ..derivation import Storage
from ..errors import SymmemError
from ..evaluator import exactly
from ..graph import Graph
from ..shapes import numel
from ..symbols import p, unordered
from ..tensor import dtype_bytes
from ..timeline import RECOMPUTED
from ..training import SCHEDULES, Regime, checkpoint_every
from .parameters import node_parameters
from .stretch import _renamed
from .unroll import iteration

#: The parts of a stage's memory, in the order the table shows them.
PARTS = ("parameters", "gradients", "optimizer_state", "buffers", "inputs", "outputs", "saved", "in_flight_outputs",
         "step_temporaries")


#: the parts of a stage's parameter side, in :func:`_parameter_sides`' order (made lazily: StageMemory.__getattr__)
_SIDE_PARTS = ("parameters", "gradients", "optimizer_state", "step_temporaries")


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's memory, by part (bytes as formulas; see the module's note)."""

    name: str                       # first, middle (the second stage: the most in flight among the middle) or last
    index: sympy.Expr               # the stage index s
    in_flight: sympy.Expr           # micro-batches whose activations the stage holds at once
    parameters: sympy.Expr          # weights
    gradients: sympy.Expr
    optimizer_state: sympy.Expr     # including Adam's 4-byte step per parameter tensor
    buffers: sympy.Expr             # receive buffers, kept for the stage's life
    inputs: sympy.Expr              # the batch (first stage) or the labels (last stage), all M micro-batches
    outputs: sympy.Expr             # the last stage's logits of every micro-batch, kept until the next step
    saved_per_micro_batch: sympy.Expr
    saved: sympy.Expr               # in_flight x saved_per_micro_batch
    in_flight_outputs: sympy.Expr   # the stage's output per micro-batch in flight (not the last stage)
    step_temporaries: sympy.Expr    # the optimizer step's largest temporaries
    #: of ``buffers``, the modules' own (the rotary frequencies a stage makes; the rest are receive buffers): not a
    #: part of its own, for what a rank stores beside its weights (passes/rank_side.py)
    module_buffers: sympy.Expr = sympy.Integer(0)

    @property
    def at_rest(self) -> sympy.Expr:
        """What lives between steps (after ``zero_grad``)."""
        return self.parameters + self.optimizer_state + self.buffers + self.inputs + self.outputs

    @property
    def step_peak(self) -> sympy.Expr:
        """Live bytes at the optimizer step's largest moment: at rest, every gradient and the step's temporaries."""
        return self.at_rest + self.gradients + self.step_temporaries

    @property
    def held(self) -> sympy.Expr:
        """What the pipeline phase holds with the most micro-batches in flight, before their backward."""
        return self.at_rest + self.saved + self.in_flight_outputs

    def __getattr__(self, name: str) -> Any:
        # the parameter side of a stage made by :func:`stages` without it (``_sides``: the maker and the stage's
        # name): worked out where first read.  The tensor-, sequence- and fully-sharded-parallel pipelines read
        # only the buffers, inputs and outputs of these stages (their ranks' weights are their own): the parameter
        # formulas were a thirtieth of their peaks' calls
        lazy = self.__dict__.get("_sides")
        if lazy is None or name not in _SIDE_PARTS:
            raise AttributeError(name)
        make, stage = lazy
        for part, value in zip(_SIDE_PARTS, make()[stage], strict=True):
            object.__setattr__(self, part, value)
        return self.__dict__[name]

    def at(self, numbers: Mapping[str, int], names: Iterable[str] | None = None) -> dict[str, int]:
        """Every part and total at ``numbers`` (symbol name -> value), as integers; ``names``: only those."""
        subs = {sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v) for k, v in numbers.items()}
        if names is None:  # module_buffers is a share of buffers, read by the parameter side per rank (rank_side)
            names = [*(f.name for f in fields(self) if f.name not in ("name", "module_buffers")), "at_rest",
                     "step_peak", "held"]
        return {name: _integer(getattr(self, name), subs, name) for name in names}

    def at_each(self, numbers: Sequence[Mapping[str, int]], names: Iterable[str]) -> list[dict[str, int]]:
        """:meth:`at` at each of several sets of numbers (the pipeline peak's three batches): each part's exact
        value at each by one walk over its formula (:func:`_exact`); a total (at rest, the step's peak) the sum
        of its parts' exact values, rounded up as its own formula's (the same number: the formula is that sum).
        Where a walk gives no value, :meth:`_at_each` (sympy's substitution) decides, as it always did."""
        names = list(names)
        envs = [_env({sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v) for k, v in n.items()})
                for n in numbers]
        if all(env is not None for env in envs):
            # what the sets share (the three batches differ in B alone): a part whose walk at those values alone
            # gives a value reads nothing else, so it has that value at every set (the weights, their gradients and
            # state, the step's temporaries: most of the walks), walked once
            common = {k: v for k, v in envs[0].items()  # type: ignore[union-attr]
                      if all(env.get(k) == v for env in envs[1:])} if len(envs) > 1 else None  # type: ignore
            exact: dict[str, list[Fraction | int | None]] = {}
            out: list[dict[str, int]] = [{} for _ in numbers]
            for name in names:
                for part in _SUMS.get(name, (name,)):
                    if part not in exact:
                        e = sympy.sympify(getattr(self, part), strict=True)
                        alike = _exact(e, common) if common is not None else None
                        exact[part] = ([alike] * len(envs) if alike is not None else
                                       [_exact(e, env) for env in envs])  # type: ignore[arg-type]
                for k, found in enumerate(out):
                    values = [exact[part][k] for part in _SUMS.get(name, (name,))]
                    if any(v is None for v in values):
                        return self._at_each(numbers, names)
                    total = sum(values)  # type: ignore[arg-type]
                    found[name] = -((-total.numerator) // total.denominator)
            return out
        return self._at_each(numbers, names)

    def _at_each(self, numbers: Sequence[Mapping[str, int]], names: Iterable[str]) -> list[dict[str, int]]:
        """:meth:`at_each` by sympy's substitution: what the sets share put in each part once, then what differs
        (the same integers: sympy's arithmetic is exact)."""
        common = {k: v for k, v in numbers[0].items() if all(n.get(k) == v for n in numbers[1:])}
        shared = {sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v) for k, v in common.items()}
        each = [{sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v) for k, v in n.items()
                 if k not in common} for n in numbers]
        parts: dict[str, sympy.Expr] = {}  # each part with the numbers they share put in
        exact: list[dict[str, sympy.Expr]] = [{} for _ in numbers]  # and at each set of numbers

        def value(name: str, k: int) -> sympy.Expr:
            found = exact[k].get(name)
            if found is None:
                if name not in parts:
                    parts[name] = sympy.sympify(getattr(self, name), strict=True).xreplace(shared)
                found = exact[k][name] = sympy.sympify(parts[name], strict=True).xreplace(each[k])
            return found

        out: list[dict[str, int]] = [{} for _ in numbers]
        for name in names:
            for k, found in enumerate(out):
                summed = [value(x, k) for x in _SUMS.get(name, ())]
                if summed and all(v.is_Integer for v in summed):
                    # a total (at rest, the step's peak) as the sum of its parts' values, each a whole number of
                    # bytes: the same integer as its own formula's (sympy's arithmetic is exact), not worked out
                    # again from a formula holding them all
                    found[name] = int(sum(summed))
                else:
                    found[name] = _rounded(value(name, k), name)
        return out


#: the totals :meth:`StageMemory.at_each` adds up from their parts (StageMemory's properties)
_SUMS = {"at_rest": ("parameters", "optimizer_state", "buffers", "inputs", "outputs"),
         "step_peak": ("parameters", "optimizer_state", "buffers", "inputs", "outputs", "gradients",
                       "step_temporaries")}


def in_flight(index: int, micro_batches: int) -> sympy.Expr:
    """1F1B's micro-batches in flight on stage ``index`` (0 or 1: the first or a middle one) of ``p``:
    ``Min(p - index, M)`` as sympy makes it, without its search for which is smaller (two comparisons under the
    symbols' assumptions, most of the stages' formulas): with ``p`` a positive integer, ``p - index`` is at least
    ``M`` only where ``index`` is 0 and ``M`` is 1; otherwise either may be smaller, and sympy keeps both, in its
    own order (``tests/test_pipeline_replay.py`` checks it against sympy's evaluation).

    >>> in_flight(0, 4), in_flight(1, 4), in_flight(0, 1)
    (Min(4, p), Min(4, p - 1), 1)
    """
    counted = isinstance(micro_batches, int) and not isinstance(micro_batches, bool) and micro_batches >= 1
    if index not in (0, 1) or not counted:
        return sympy.Min(p - index, micro_batches)
    if index == 0 and micro_batches == 1:
        return sympy.Integer(1)
    return sympy.Min(p - index, sympy.Integer(micro_batches), evaluate=False)


#: the last ``subs`` :func:`_integer` was given and its :func:`_env` (a cut's numbers, asked for each of its sizes:
#: the env made again each time was a third of each size's value); held, so its id is not another dict's
_LAST_ENV: list[Any] = [None, None]


def _integer(expr: sympy.Expr, subs: Mapping[sympy.Symbol, sympy.Expr], name: str) -> int:
    e = sympy.sympify(expr, strict=True)
    if subs is _LAST_ENV[0]:
        env = _LAST_ENV[1]
    else:
        env = _env(subs)
        _LAST_ENV[0], _LAST_ENV[1] = subs, env
    if env is not None:
        found = _exact(e, env)
        if found is not None:
            return -((-found.numerator) // found.denominator)  # its ceiling, as _rounded's
    return _rounded(e.xreplace(subs), name)


def _env(subs: Mapping[sympy.Symbol, Any]) -> dict[sympy.Symbol, int] | None:
    """``subs`` (symbol -> sympy integer) as Python ints for :func:`_exact`; None where a value is not an integer."""
    env = {}
    for k, v in subs.items():
        if type(v) is int:
            env[k] = v
        elif getattr(v, "is_Integer", False):
            env[k] = int(v)
        else:
            return None
    return env


def _exact(e: sympy.Basic, env: Mapping[sympy.Symbol, int]) -> Fraction | int | None:
    """``e``'s exact value at ``env`` (an int or a fraction) by one walk over its tree
    (:func:`symmem.evaluator.interpret`); None where the walk does not give one (a symbol without a value, an
    unsupported function, a float, no branch, a zero denominator): the caller substitutes with sympy then, whose
    answer or refusal was always the one given.  (Substituting rebuilt every formula through sympy's
    constructors and its cache, each storage's size and each stage's part at each batch: a seventh of a pipeline
    peak's time; the arithmetic is exact both ways, so the same integers.)"""
    found = exactly(e, env)
    return None if isinstance(found, bool) or not isinstance(found, int | Fraction) else found


def _rounded(value: sympy.Expr, name: str) -> int:
    """A part's value at numbers as whole bytes (``name``: what is refused where symbols are left)."""
    if not value.is_number:
        raise SymmemError(f"the stage's {name} needs values for {', '.join(sorted(map(str, value.free_symbols)))}")
    return int(sympy.ceiling(value))


def memory_of(found: Sequence[Any], s: int, p: int) -> Any:
    """Stage ``s`` of ``p``'s memory among :func:`stages`' three: the first, a middle one (all alike) or the last."""
    return found[0] if s == 0 else found[-1] if s == p - 1 else found[1]


def stages(graph: Graph, storages: Sequence[Storage], regime: Regime, *, schedule: str = "1f1b",
           micro_batches: int = 1, device: str = "cpu") -> tuple[StageMemory, ...]:
    """The first stage, a middle one (the second: with ``p = 2`` it does not exist, but its formula is given for
    ``p >= 3``) and the last, for the single-device ``storages`` of ``graph`` (a derivation without pipeline
    parallelism, the pytorch convention) under ``regime``'s precision and optimizer.

    Only a model whose layers are one repeated block takes stages: the embedding before it, the head after it.
    """
    if regime.tensor_parallel or regime.zero or regime.precision != "fp32":
        raise SymmemError("pipeline stages are modelled for FP32, with full, every-K or selective checkpointing, "
                          "without ZeRO or tensor parallelism (what was measured)")
    if regime.checkpoint == "selective" and any(extras for _, extras, _ in graph.graph.get("recomputed_core",
                                                                                       {}).values()):
        # GPT-2's cores are called with a mask the graph has no node for (made once by the model's forward): which
        # stage makes it, and when, was not measured (Llama's mask and position ids are nodes each stage makes)
        raise SymmemError("selective recomputation on pipeline stages is modelled where the checkpointed cores are "
                          "called with graph nodes only (Llama: measured), not with GPT-2's model-wide mask")
    if schedule not in SCHEDULES:
        raise SymmemError(f"unknown pipeline schedule {schedule!r}; known: {', '.join(SCHEDULES)}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise SymmemError(f"micro_batches must be a positive integer, got {micro_batches!r}")
    blocks = list(graph.blocks.values())
    if len(blocks) != 1:
        raise SymmemError(f"pipeline stages split one repeated block of layers; {graph.graph.get('name', 'this model')}"
                          f" has {len(blocks)}")
    from .schedule import optimizer_impl

    impl = optimizer_impl(regime, device)  # for-loop on the CPU (measured), foreach on CUDA, unless given
    block = blocks[0]
    shared = shared_nodes(graph)
    layers = block.count
    act = regime.activation_dtype
    boundary = _bytes(graph, block.output, act)
    output = _model_output(graph)
    logits = _bytes(graph, output, act) if output is not None else sympy.Integer(0)
    per_group = _saved_by_group(storages, layers)
    out_kept = _kept_per_layer(storages, block.output, layers)
    per_stage = layers / p
    m = sympy.Integer(micro_batches)
    batch = sum((s.expr for s in storages if s.category == "input" and s.group == "input"), sympy.Integer(0))
    labels = _label_bytes(graph)
    params: dict[str, Any] = {}

    def sides() -> dict[str, tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]]:
        # made once for the three stages, where one of them is first asked for its parameter side
        if not params:
            params.update(_parameter_sides(graph, regime, per_stage, impl))
        return params
    module_buffers = _module_buffers(graph, act)
    found = []
    # layers checkpointed K at a time (full: K = 1), or None
    every = None if regime.checkpoint == "none" else (checkpoint_every(regime.checkpoint) or 1)
    for name, index in (("first", sympy.Integer(0)), ("middle", sympy.Integer(1)), ("last", p - 1)):
        first, last = name == "first", name == "last"
        flight = m if schedule == "gpipe" else (sympy.Integer(1) if last else in_flight(int(index), micro_batches))
        if every is not None:
            runs = sympy.ceiling(per_stage / every)  # a stage's runs of K layers (the last one shorter)
            saved = _checkpointed_saved(storages, shared, per_group, boundary, runs, first, last) + (
                _checkpoint_arguments(graph, shared, act))
        else:
            saved = per_stage * per_group["layer"] - (0 if last else out_kept)
            if first:
                saved += per_group["embed"]
            else:
                saved += sum((x.expr for x in storages if x.node in shared and x.category == "activation"),
                             sympy.Integer(0))
            if last:
                saved += per_group["head"] + per_group["loss"]
        # one receive buffer per micro-batch: the activation from the stage before, the gradient from the one after;
        # and the module's own buffers (a stage that makes the rotary tables holds their frequencies)
        own = module_buffers["layer"] * per_stage + (module_buffers["first"] if first or shared else 0) + (
            module_buffers["last"] if last else 0)
        buffers = (0 if first else 1) * m * boundary + (0 if last else 1) * m * boundary + own
        stage = object.__new__(StageMemory)  # without its parameter side (StageMemory.__getattr__ makes it)
        for part, value in (
                ("name", name), ("index", index), ("in_flight", flight),
                ("buffers", sympy.sympify(buffers, strict=True)),
                ("inputs", m * batch if first else (m * labels if last else sympy.Integer(0))),
                ("outputs", m * logits if last else sympy.Integer(0)), ("saved_per_micro_batch", saved),
                ("saved", flight * saved), ("in_flight_outputs", sympy.Integer(0) if last else flight * boundary),
                ("module_buffers", sympy.sympify(own, strict=True)), ("_sides", (sides, name))):
            object.__setattr__(stage, part, value)
        found.append(stage)
    return tuple(found)


def _checkpointed_saved(storages: Sequence[Storage], shared: set[str], per_group: Mapping[str, sympy.Expr],
                        boundary: sympy.Expr, segments: sympy.Expr, first: bool, last: bool) -> sympy.Expr:
    """What one micro-batch's forward leaves on a stage whose layers are checkpointed (``segments`` runs of K
    layers, :func:`~symmem.reference.sequence_models.run_layers` on the stage's own layers): each run's input, the
    first of which is the embedding's output (first stage, counted with ``embed``) or the receive buffer (counted
    with ``buffers``); the last stage's final norm keeps the last layer's output, and its head and loss what they
    save.  The rotary tables the layers read are the checkpoints' arguments, not saved (measured, gloo)."""
    saved = (segments - 1) * boundary
    if first:
        saved += per_group["embed"] - sum((x.expr for x in storages if x.node in shared and x.group == "embed"
                                           and x.category == "activation"), sympy.Integer(0))
    if last:
        saved += boundary + per_group["head"] + per_group["loss"]
    return saved


def _checkpoint_arguments(graph: Graph, shared: set[str], act: str) -> sympy.Expr:
    """The tensors every checkpointed run of layers is called with besides its input that it saves itself
    (``torch.utils.checkpoint`` saves its tensor arguments for backward, ``_NoopSaveInputs``): eager attention's
    mask, one storage for every run of the micro-batch.  HF's rotary tables come in a tuple, which it does not save
    (measured, gloo: the tables are alive, not saved)."""
    read = {i for n in graph.program_order() if graph.node(n).block is not None for i in graph.node(n).inputs}
    return sum((_bytes(graph, n, act) for n in sorted(shared & read) if graph.node(n).kind == "constant"),
               sympy.Integer(0))


def runs_restart(checkpoint: str, p_value: Any, layers: Any) -> bool:
    """Whether ``every-K`` runs of layers begin again at a stage's boundary where the whole model's would cross it:
    each stage checkpoints its own layers (``run_layers`` on the stage's ``L/p``), so where K does not divide
    ``L/p`` a stage's runs are K, K, ..., and the rest (:func:`_restarted`)."""
    every = checkpoint_every(checkpoint)
    return bool(every and isinstance(p_value, int) and isinstance(layers, int) and p_value and
                (layers // p_value) % every)


def _restarted(g: Graph, every: int, per: int) -> Graph:
    """``g`` (unrolled) with its layers numbered for the checkpoint's runs as the stages make them: stage ``s``'s
    layer ``j`` (from 0) in the run ``s * ceil(per / K) + j // K`` (:func:`symmem.passes.schedule._segments` reads
    the numbers; the nodes' names keep their layers)."""
    runs = -(-per // every)
    out = g.copy()
    out.graph["iterations"] = {n: (block, (k - 1) // per * runs * every + (k - 1) % per + 1)
                               for n, (block, k) in g.graph.get("iterations", {}).items()}
    return out


def shared_nodes(graph: Graph) -> set[str]:
    """What the layers read besides the layer before, and what it is made from: every stage makes its own
    (Llama's rotary tables and eager attention's mask, made before the layers).  One made from the model's
    input or the embedding could not be: refused."""
    block = next(iter(graph.blocks.values()))
    todo = [i for n in graph.program_order() if graph.node(n).block is not None for i in graph.node(n).inputs
            if graph.node(i).block is None and i != block.source]
    found: set[str] = set()
    while todo:
        n = todo.pop()
        node = graph.node(n)
        if n in found or node.kind in ("parameter", "buffer"):
            continue
        if node.kind == "input" or n == block.source or node.kind == "embedding":
            raise SymmemError(f"the layers of {graph.graph.get('name', 'this model')} read what the model makes "
                              f"from its input before them ({n}): a pipeline stage could not make it")
        found.add(n)
        todo += list(node.inputs)
    return found


def _module_buffers(graph: Graph, act: str) -> dict[str, sympy.Expr]:
    """Bytes of the modules' buffers before the layers (``first``), in one layer, and after them (``last``)."""
    out = {k: sympy.Integer(0) for k in ("first", "layer", "last")}
    for n in graph.program_order():
        node = graph.node(n)
        where = "layer" if node.block is not None else ("last" if node.group in ("head", "loss") else "first")
        if node.kind == "buffer":
            out[where] += _bytes(graph, n, act)
        for spec in node.buffers.values():
            out[where] += spec.numel * dtype_bytes(spec.dtype, act)
    return out


def _bytes(graph: Graph, node: str, act: str) -> sympy.Expr:
    spec = graph.node(node).out
    return spec.numel * dtype_bytes(spec.dtype, act)


def _model_output(graph: Graph) -> str | None:
    """The model's output: the last node outside the loss that no other node outside the loss reads."""
    order = list(graph.program_order())
    inside = [n for n in order if graph.node(n).group != "loss"]
    read = {i for n in inside for i in graph.node(n).inputs}
    found = [n for n in inside if n not in read and graph.node(n).kind not in ("input", "parameter", "buffer",
                                                                                  "constant")]
    return found[-1] if found else None


def _label_bytes(graph: Graph) -> sympy.Expr:
    """The labels the last stage is given: the loss's input nodes (int64 ids)."""
    total = sympy.Integer(0)
    for n in graph.program_order():
        node = graph.node(n)
        if node.kind == "input" and node.group == "loss":
            total += _bytes(graph, n, "float32")
    return total


def _saved_by_group(storages: Iterable[Storage], layers: sympy.Expr) -> dict[str, sympy.Expr]:
    """Bytes one micro-batch's ops keep, by group: ``layer`` is one layer's."""
    terms: dict[str, list[sympy.Expr]] = {g: [] for g in ("embed", "layer", "head", "loss")}
    for s in storages:
        if s.category in ("activation", "loss") and s.group in terms:
            terms[s.group].append(s.expr / layers if s.group == "layer" else s.expr)
    # each group's terms added at once (sympy's Add is the same sum; adding term by term flattened it every time)
    return {g: sympy.Add(sympy.Integer(0), *t) for g, t in terms.items()}


def _kept_per_layer(storages: Iterable[Storage], output: str, layers: sympy.Expr) -> sympy.Expr:
    """Bytes of one layer's output that the next op keeps (a stage's output, which no op of that stage keeps)."""
    return sum((s.expr / layers for s in storages if s.node == output and s.category == "activation"
                and s.group == "layer"), sympy.Integer(0))


def _parameter_sides(graph: Graph, regime: Regime, per_stage: sympy.Expr, impl: str
                     ) -> dict[str, tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]]:
    """(weights, gradients, optimizer state, the optimizer step's largest temporaries) of each stage."""
    owned: dict[str, list[tuple[sympy.Expr, tuple[sympy.Expr, ...]]]] = {"first": [], "layer": [], "last": []}
    for n in graph.program_order():
        node = graph.node(n)
        where = "layer" if node.block is not None else ("last" if node.group in ("head", "loss") else "first")
        shapes = [shape for _, shape in node_parameters(n, node)]
        if node.kind == "linear" and node.attrs.get("tied"):
            # the last stage's own copy of the tied embedding (Megatron-LM, torchtitan)
            shapes.append((node.attrs["out_features"], graph.node(node.inputs[0]).out.shape[-1]))
        owned[where] += [(sympy.Integer(1), shape) for shape in shapes]
    layer = [shape for _, shape in owned["layer"]]
    first = [shape for _, shape in owned["first"]]
    last = [shape for _, shape in owned["last"]]
    # each parameter's terms and the step's candidates made once for the three stages (the layers' are every
    # stage's: making them again was two thirds of the stages' formulas), the same objects in the same order
    terms = {"first": _terms(regime, first, sympy.Integer(1)), "layer": _terms(regime, layer, per_stage),
             "last": _terms(regime, last, sympy.Integer(1))}
    memo: dict[Any, Any] = {}
    return {"first": _side(regime, first, layer, [], per_stage, impl, terms, memo),
            "middle": _side(regime, [], layer, [], per_stage, impl, terms, memo),
            "last": _side(regime, [], layer, last, per_stage, impl, terms, memo)}


def _terms(regime: Regime, shapes: list[tuple[sympy.Expr, ...]], count: sympy.Expr
           ) -> list[tuple[list[sympy.Expr], list[sympy.Expr], list[sympy.Expr]]]:
    """Each of ``shapes``' (weights, gradients, optimizer state) terms, ``count`` of each."""
    out = []
    for shape in shapes:
        n = numel(shape)
        weights: list[sympy.Expr] = []
        grads: list[sympy.Expr] = []
        state: list[sympy.Expr] = []
        for c in regime.precision_spec.parts:
            (grads if c.kind == "gradients" else weights if c.kind == "weights" else state).append(count * n * c.bytes)
        state.append(count * sum((e for _, e in regime.optimizer_spec.state_bytes(shape)), sympy.Integer(0)))
        if regime.optimizer in ("adam", "adamw"):
            state.append(count * 4)  # the step count: a 0-dim FP32 tensor per parameter
        out.append((weights, grads, state))
    return out


def _side(regime: Regime, before: list[tuple[sympy.Expr, ...]], layer: list[tuple[sympy.Expr, ...]],
          after: list[tuple[sympy.Expr, ...]], layers: sympy.Expr, impl: str,
          terms: Mapping[str, list[tuple[list[sympy.Expr], list[sympy.Expr], list[sympy.Expr]]]],
          memo: dict[Any, Any]) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, sympy.Expr]:
    """(weights, gradients, optimizer state, step temporaries) of the parameters ``before`` the layers, ``layers``
    x ``layer``'s and those ``after``, in the order ``module.parameters()`` lists them (``terms``: each group's
    parameters' terms, :func:`_terms`; ``memo``: the step's candidates, :func:`_step_temporaries`)."""
    # each sum's terms added at once (sympy's Add is the same sum; adding term by term flattened it every time); the
    # layers' sums made once, each stage's ends' terms added to them (an Add's terms are flattened into the sum:
    # the same sum, its like terms already collected)
    if "layer sums" not in memo:
        memo["layer sums"] = [sympy.Add(sympy.Integer(0), *[x for each in terms["layer"] for x in each[k]])
                              for k in range(3)]
    ends = [*(terms["first"] if before else ()), *(terms["last"] if after else ())]
    sums = [sympy.Add(sympy.Integer(0), *[x for each in ends for x in each[k]], total) if ends else total
            for k, total in enumerate(memo["layer sums"])]
    return (*sums, _step_temporaries(regime, before, layer, after, layers, impl, memo))  # type: ignore[return-value]


def _step_temporaries(regime: Regime, before: list[tuple[sympy.Expr, ...]], layer: list[tuple[sympy.Expr, ...]],
                      after: list[tuple[sympy.Expr, ...]], layers: sympy.Expr, impl: str,
                      memo: dict[Any, Any] | None = None) -> sympy.Expr:
    """The for-loop Adam step's largest temporaries: ``sqrt`` and ``denom`` of one parameter beside the previous
    parameter's ``denom`` (:func:`symmem.passes.schedule.step_events`), in the order the stage lists them.
    ``memo``: the sizes and candidates made for another stage of the same parameters (by the shapes' objects:
    the stages share the layers' and their own ends'), made once."""
    if regime.optimizer not in ("adam", "adamw"):
        raise SymmemError(f"pipeline stages model the Adam/AdamW step; got {regime.optimizer}")
    if memo is None:
        memo = {}
    shapes = before + layer + after

    def sized(shape: tuple[sympy.Expr, ...]) -> sympy.Expr:
        key = ("size", id(shape))
        found = memo.get(key)
        if found is None:
            found = memo[key] = (numel(shape) * 4, shape)  # the shape kept: its id stays its own
        return found[0]

    def made(key: tuple[Any, ...], build: Any) -> Any:
        found = memo.get(key)
        if found is None:
            found = memo[key] = (build(), key)
        return found[0]

    size = [sized(shape) for shape in shapes]
    if not size or impl == "fused":
        return sympy.Integer(0)
    if impl == "foreach":
        # _foreach_sqrt of every state at once: one copy of every parameter (step_events)
        return sympy.Add(*size[:len(before)], layers * sympy.Add(*size[len(before):len(before) + len(layer)]),
                         *size[len(before) + len(layer):])
    ids = [id(shape) for shape in shapes]
    candidates = [made(("first", ids[0]), lambda: 2 * size[0])] + [
        made(("pair", a, b), lambda prev=prev, cur=cur: prev + 2 * cur)
        for a, b, prev, cur in zip(ids, ids[1:], size, size[1:], strict=False)]
    if layer:
        # with two or more layers a layer's first parameter follows the last of the layer before
        k = len(before)
        candidates.append(made(("again", ids[k + len(layer) - 1], ids[k], layers), lambda: _at_least_two(
            size[k + len(layer) - 1] + 2 * size[k], layers)))
    if any(isinstance(c, sympy.Basic) and c.free_symbols for c in candidates):
        # left unevaluated: sympy's Max compares every pair of formulas under the symbols' assumptions (a quarter
        # of a pipeline peak's time); the stage's parts are only ever read at numbers, where it is a number
        return sympy.Max(*dict.fromkeys(candidates), evaluate=False)
    return sympy.Max(*candidates)


def _at_least_two(again: sympy.Expr, layers: sympy.Expr) -> sympy.Expr:
    """``Piecewise((again, layers >= 2), (0, True))``.  Where ``layers`` is ``L/p`` (two positive-integer symbols:
    every stage of a built-in model) sympy's evaluation leaves the condition and the Piecewise as they are (``L/p -
    2`` has no sign its assumptions decide), so both are built unevaluated: the same objects, without asking the
    assumptions (three relationals a pipeline peak: most of its stages' formulas' time).

    >>> from symmem.symbols import L
    >>> fast, slow = _at_least_two(L, L / p), sympy.Piecewise((L, sympy.Ge(L / p, 2)), (0, True))
    >>> fast == slow, sympy.srepr(fast) == sympy.srepr(slow)
    (True, True)
    """
    args = layers.args if getattr(layers, "is_Mul", False) else ()  # (a number of layers: an int too)
    if len(args) == 2 and 1 / p in args:
        count = args[0] if args[1] == 1 / p else args[1]
        if unordered(count, p):
            return sympy.Piecewise((again, sympy.Ge(layers, 2, evaluate=False)), (0, True), evaluate=False)
    return sympy.Piecewise((again, sympy.Ge(layers, 2)), (0, True))


@dataclass(frozen=True)
class Pipeline:
    """The stages of one model under one schedule, and the numbers they are evaluated at (``p`` included)."""

    stages: tuple[StageMemory, ...]
    numbers: Mapping[str, int]
    schedule: str
    micro_batches: int
    #: every stage's steady-step peak at the numbers (:func:`pipeline_peaks`)
    peaks: tuple[Any, ...] = ()

    def shown(self) -> tuple[StageMemory, ...]:
        """The stages that exist at these numbers: no middle one with two stages."""
        return tuple(s for s in self.stages if s.name != "middle" or self.numbers.get("p", 3) >= 3)

    def values(self, name: str) -> dict[str, int]:
        """Stage ``name``'s parts at the numbers."""
        return next(s for s in self.stages if s.name == name).at(self.numbers)

    def peak(self) -> StagePeak:
        """The peak per device: the largest stage's steady-step peak, which stage and where."""
        if not self.peaks:
            raise SymmemError("these stages were made without their peaks (pipeline_peaks)")
        return max(self.peaks, key=lambda x: x.bytes)

    def table(self) -> str:
        text = table(self.shown(), self.numbers, self.schedule, self.micro_batches)
        if not self.peaks:
            return text
        top = self.peak()
        each = ", ".join(f"{x.stage}: {x.bytes:,}" for x in self.peaks)
        firsts = ", ".join(f"{x.stage}: {x.first:,}" for x in self.peaks)
        return (f"{text}\npeak per device: {top.bytes:,} bytes, stage {top.stage} of {len(self.peaks)} at {top.where}"
                f"\nsteady-step peak of each stage: {each}\nfirst-step peak of each stage: {firsts}")


def table(found: Sequence[StageMemory], numbers: Mapping[str, int], schedule: str, micro_batches: int) -> str:
    """The stages at ``numbers`` as text: one column per stage, one row per part."""
    values = [s.at(numbers) for s in found]
    rows = [("in flight", [str(v["in_flight"]) for v in values])]
    rows += [(part.replace("_", " "), [f"{v[part]:,}" for v in values]) for part in (*PARTS, "held", "step_peak")]
    head = f"pipeline stages ({schedule}, M={micro_batches}, p={numbers.get('p', '?')}): bytes per stage"
    width = max(len(r[0]) for r in rows)
    cols = [max(len(s.name), *(len(r[1][i]) for r in rows)) for i, s in enumerate(found)]
    lines = [head, " " * width + "  " + "  ".join(s.name.rjust(c) for s, c in zip(found, cols, strict=True))]
    lines += [name.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(vals, cols, strict=True))
              for name, vals in rows]
    return "\n".join(lines)


def requires(p_value: Any, layers: Any, schedule: str = "gpipe", micro_batches: int = 1) -> None:
    """Refuse what the engine refuses: ``p >= 2`` stages dividing the layers; 1F1B with fewer micro-batches than
    stages (``Schedule1F1B`` raises)."""
    if schedule == "1f1b" and isinstance(p_value, int) and micro_batches < p_value:
        raise SymmemError(f"the 1F1B schedule needs at least as many micro-batches as stages (Schedule1F1B): "
                          f"M={micro_batches} < p={p_value}; give --micro-batches {p_value} or more, or gpipe")
    if isinstance(p_value, int) and p_value < 2:
        raise SymmemError(f"pipeline parallelism needs p >= 2 stages, got p={p_value}")
    if isinstance(p_value, int) and isinstance(layers, int) and layers % p_value:
        raise SymmemError(f"p={p_value} pipeline stages do not divide the L={layers} layers (an even split)")


# -- the pipeline phase, op by op ------------------------------------------------------------------------------
@dataclass(frozen=True)
class StagePeak:
    """One stage's steady-step peak at numbers: its bytes, and where (``phase``: ``pipeline`` or ``step``; the op
    and the micro-batch in the pipeline phase)."""

    stage: int
    bytes: int
    phase: str
    node: str | None
    micro_batch: int | None
    pipeline: int   # the pipeline phase's largest moment
    step: int       # the optimizer step's largest moment
    #: the first step's peak: its pipeline phase without optimizer state (AdamW makes it in the step), and the same
    #: optimizer step (``_init_group`` makes every parameter's state before the first update: ``step_events``)
    first: int = 0

    @property
    def where(self) -> str:
        """Where the peak is, in words: ``the optimizer step``, or the op, its layer and the micro-batch."""
        if self.phase == "step":
            return "the optimizer step"
        if self.node is None or self.micro_batch is None:
            return "the end of the schedule" if self.node == "merge_chunks" else "the schedule's start"
        from .unroll import iteration, template

        layer = f" of layer {iteration(self.node)}" if iteration(self.node) else ""
        return f"{template(self.node)}{layer}, micro-batch {self.micro_batch}"


def order(schedule: str, stage: int, p_value: int, m: int) -> list[tuple[str, int]]:
    """The forwards and backwards stage ``stage`` runs, in order: ``("F", i)``, ``("B", i)`` (torch 2.13's
    ``ScheduleGPipe`` and ``Schedule1F1B._step_microbatches``).

    >>> order("1f1b", 0, 2, 3)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('B', 2)]
    >>> order("gpipe", 1, 2, 2)
    [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
    """
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warmup = min(m, p_value - stage)
    out = [("F", i) for i in range(warmup)]
    f, b = warmup, 0
    while True:
        out.append(("B", b))
        b += 1
        if f == m:
            break
        out.append(("F", f))
        f += 1
    out += [("B", i) for i in range(b, m)]
    return out


def pipeline_peaks(graph: Graph, conv: Any, options: Mapping[str, Any], regime: Regime,
                   numbers: Mapping[str, int], found: Sequence[StageMemory], *, schedule: str,
                   micro_batches: int) -> list[StagePeak]:
    """Every stage's steady-step peak at ``numbers`` (``p`` and ``L`` included), from the single-device step's
    timeline (:class:`~symmem.passes.schedule.Simulation`, two micro-batches: the first makes the gradients, the
    second adds into them) cut by stage and replayed in the schedule's order (:func:`order`).

    What the engine does beyond the single-device step (see the module's note): a stage's output lives until its
    micro-batch's backward ends (``fwd_cache``); the gradient a stage sends back lives until the send is waited on
    (GPipe: the end of the backward phase; 1F1B: the end of the next backward); the last stage keeps each
    micro-batch's logits and loss to the end of the phase, then concatenates the logits (``merge_chunks``).
    """
    return [r.run() for r in replays(graph, conv, options, regime, numbers, found, schedule=schedule,
                                     micro_batches=micro_batches)]


def replays(graph: Graph, conv: Any, options: Mapping[str, Any], regime: Regime, numbers: Mapping[str, int],
            found: Sequence[StageMemory], *, schedule: str, micro_batches: int,
            memo: dict[Any, Any] | None = None) -> list[_Replay]:
    """Every stage's replay at ``numbers`` (not yet run: :meth:`_Replay.run` gives its peak and fills
    :attr:`_Replay.moments`, every moment of its step; :mod:`.pipeline_step` makes formulas of them); ``memo``:
    :class:`_Cut`'s."""
    cut = _Cut(graph, conv, options, regime, numbers, memo)
    out = []
    parts: dict[int, dict[str, int]] = {}  # the middle stages share one StageMemory: its parts worked out once
    for s in range(cut.p):
        k = 0 if s == 0 else len(found) - 1 if s == cut.p - 1 else 1
        if k not in parts:
            parts[k] = found[k].at(numbers)
        out.append(_Replay(cut, s, parts[k], schedule, micro_batches))
    return out


#: :func:`batch_moments`' packing: three integers in one, ``_DIGIT`` bits each (balanced digits, so negative sums
#: come back too); every packed size must be below ``_BOUND`` in magnitude, so that the sums of a replay's moments
#: (far fewer than 2**60 terms) stay inside a digit
_DIGIT = 128
_BOUND = 1 << 64
#: the parts of a stage a replay reads (:class:`_Replay`), and the peak's first-step lines
_REPLAYED = ("at_rest", "outputs", "step_peak", "optimizer_state")


def batch_moments(graph: Graph, conv: Any, options: Mapping[str, Any], regime: Regime,
                  numbers: Sequence[Mapping[str, int]], found: Sequence[StageMemory], *, schedule: str,
                  micro_batches: int, memo: dict[Any, Any] | None = None, make: Any = None
                  ) -> list[tuple[list[list[tuple[int, str | None, int | None]]], list[dict[str, int]]]] | None:
    """Every stage's moments (:attr:`_Replay.moments`) and parts at each of three sets of ``numbers`` that differ
    in sizes only, from one replay: each storage's bytes and each part are the three values packed into one integer
    (:func:`_pack`), and a replay only adds, subtracts and orders what it holds by the ops -- never by bytes, except
    in choosing its largest moment, which is not read here -- so each moment unpacks into the three replays' (the
    replays at ``B``, ``B + 1`` and ``B + 2`` cost one).  ``None`` where the three do not share one simulated step
    (a size branch, as at ``B = 1``), where the last stage's logits are empty at some but not all, or where a size
    is too large to pack: then each is replayed on its own.  ``make(packed, cuts, s)``: stage ``s``'s replay on the
    packed cut and its parts at each of the three (None: not packed), where an engine wraps the stages
    (:mod:`.fsdp_pipeline`); by default the stage alone.

    >>> from symmem.passes.model_parallel import _pack, _unpack
    >>> _unpack(_pack([5, 7, 9]) - _pack([6, 6, 6]))
    [-1, 1, 3]
    """
    cuts = [_Cut(graph, conv, options, regime, n, memo) for n in numbers]
    if any(c._sim is not cuts[0]._sim for c in cuts):
        return None
    parts: dict[int, list[dict[str, int]]] = {}
    out = []
    packed = _PackedCut(cuts)
    try:
        for s in range(packed.p):
            if make is None:
                k = 0 if s == 0 else len(found) - 1 if s == packed.p - 1 else 1
                if k not in parts:
                    parts[k] = found[k].at_each(numbers, _REPLAYED)
                made = (_Replay(packed, s, pack_parts(parts[k]), schedule, micro_batches), parts[k])
            else:
                made = make(packed, cuts, s)
            if made is None:
                return None
            made[0].run()
            out.append((_unpacked(made[0].moments, len(numbers)), made[1]))
    except _Unpackable:
        return None
    return out


def pack_parts(parts: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """A stage's parts at the three sets of numbers, packed (:func:`batch_moments`); unpackable where the last
    stage's logits are empty at some but not all (the replays would differ in its ``merge_chunks`` moment)."""
    if len({bool(a["outputs"]) for a in parts}) > 1:
        raise _Unpackable
    return {name: _pack([a[name] for a in parts]) for name in parts[0]}


def pack_alike(value: int) -> int:
    """``value`` at each of the three sets of numbers, packed (bytes that do not depend on them)."""
    return _pack([value, value, value])


class _Unpackable(Exception):
    """A size too large for :func:`_pack`'s digits."""


def _pack(values: Sequence[int]) -> int:
    """Three integers (each below ``_BOUND`` in magnitude) as one: the sum of ``values[i] << i*_DIGIT``."""
    if any(abs(v) >= _BOUND for v in values):
        raise _Unpackable
    return sum(v << (i * _DIGIT) for i, v in enumerate(values))


def _unpacked(moments: Sequence[tuple[int, str | None, int | None]], count: int = 3
              ) -> list[list[tuple[int, str | None, int | None]]]:
    """A packed replay's moments as the three replays' (:func:`_unpack` inlined: a replay has thousands), each
    value once in each phase (the pipeline's, the step's) with the first op and micro-batch that shows it: the
    lines read from them (:mod:`.pipeline_step`) keep the first moment of each line only, and the schedule repeats
    its micro-batches' live bytes (60% of a 1F1B replay's moments are repeats).  ``count``: the replays packed (four
    where B = 1 is read beside the lines from B = 2: :mod:`.sequence_pipeline`).

    >>> _unpacked([(_pack([1, -2, 3, 4]), "x", 0), (_pack([1, -2, 3, 4]), "y", 1), (_pack([5, 5, 5, 5]), None, None)],
    ...           4)
    [[(1, 'x', 0), (5, None, None)], [(-2, 'x', 0), (5, None, None)], [(3, 'x', 0), (5, None, None)], \
[(4, 'x', 0), (5, None, None)]]
    """
    if count != 3:
        return _unpacked_each(moments, count)
    mask, half, full = (1 << _DIGIT) - 1, 1 << (_DIGIT - 1), 1 << _DIGIT
    rows: list[list[tuple[int, str | None, int | None]]] = [[], [], []]
    first, second, third = rows
    # the first moment of each value, in order, the optimizer step's moments (op and micro-batch None) apart from
    # the pipeline's
    seen: set[Any] = set()
    add = seen.add
    for live, node, mb in moments:
        key = live if node is not None or mb is not None else (live, True)
        if key in seen:
            continue
        add(key)
        a = live & mask
        if a >= half:
            a -= full
        live = (live - a) >> _DIGIT
        b = live & mask
        if b >= half:
            b -= full
        c = (live - b) >> _DIGIT
        if not -half <= c < half:
            raise _Unpackable
        first.append((a, node, mb))
        second.append((b, node, mb))
        third.append((c, node, mb))
    return rows


def _unpacked_each(moments: Sequence[tuple[int, str | None, int | None]], count: int
                   ) -> list[list[tuple[int, str | None, int | None]]]:
    """:func:`_unpacked` of ``count`` packed replays (the first moment of each value, :func:`_unpack`'s digits)."""
    rows: list[list[tuple[int, str | None, int | None]]] = [[] for _ in range(count)]
    seen: set[Any] = set()
    for live, node, mb in moments:
        key = live if node is not None or mb is not None else (live, True)
        if key in seen:
            continue
        seen.add(key)
        for row, value in zip(rows, _unpack(live, count), strict=True):
            row.append((value, node, mb))
    return rows


def _lined_at(cut: Any) -> tuple[int, int] | None:
    """``(b, count)`` where ``cut`` is packed at ``count`` batches ``B = b, b + 1, ...``, whose moments are read as
    lines in B (:func:`~symmem.passes.pipeline_step.lines_of`): three (:func:`batch_moments`), or four (the first
    read alone, the lines from the other three: :mod:`.sequence_pipeline` at B = 1); else None (a replay at
    numbers)."""
    cuts = getattr(cut, "__dict__", {}).get("cuts")
    if not isinstance(cuts, (list, tuple)) or len(cuts) not in (3, 4):
        return None
    batch = sympy.Symbol("B", positive=True, integer=True)
    found = [getattr(c, "subs", {}).get(batch) for c in cuts]
    if any(x is None for x in found) or [int(x) - int(found[0]) for x in found] != list(range(len(cuts))):
        return None
    return int(found[0]), len(cuts)


def bounding(deltas: Sequence[int], b: int, count: int = 3) -> list[int] | None:
    """Which of a segment's moments (``deltas``: their packed bytes less the live bytes the segment begins at, at
    ``B = b, b + 1, b + 2``) can bound a stage's lines (:func:`~symmem.passes.pipeline_step._upper` of
    :func:`~symmem.passes.pipeline_step.lines_of`), wherever the segment is moved to: their indices, in order.
    ``count`` 4: packed at ``b`` to ``b + 3``, the bytes at ``b`` read alone (the first of the largest can bound
    them) and the lines from ``b + 1`` (those that can bound them), both kept.

    A moment is the line ``a + c*B`` read at the three; the lines kept are, of each slope, the first of the
    largest, where it is above every steeper line at ``B = 1`` (``_upper``).  A segment's moments all gain the
    live bytes it begins at, one line for all (the first step's schedule loses its optimizer state from all, a
    ZeRO-1 rank's moments are moved by one line): so a moment that another of its segment bounds so -- of its slope
    and earlier with as much, or steeper with as much at 1 -- is bounded wherever the segment is moved and is left
    out (most of a stage's moments: each layer's activations make the next ones steeper).  The first moment stays,
    whatever it is (where the segment begins at bytes on no line, it is the first moment refused there, as the
    replay moment by moment refuses it); None where a moment is no line (every moment kept, refused as before).

    >>> from symmem.passes.model_parallel import _pack
    >>> bounding([_pack([1, 1, 1]), _pack([5, 5, 5]), _pack([2, 4, 6]), _pack([3, 5, 7]), _pack([0, 3, 6])], 1)
    [0, 1, 3, 4]
    >>> bounding([_pack([1, 2, 4])], 1) is None
    True
    """
    mask, half, full = (1 << _DIGIT) - 1, 1 << (_DIGIT - 1), 1 << _DIGIT
    best: dict[int, tuple[int, int]] = {}  # slope -> (a, the first moment with that a)
    alone: tuple[int, int] | None = None  # count 4: the first of the largest at the first batch
    if count == 4:
        b += 1
    for k, d in enumerate(deltas):
        if count == 4:
            x = d & mask
            if x >= half:
                x -= full
            d = (d - x) >> _DIGIT
            if alone is None or x > alone[0]:
                alone = (x, k)
        x0 = d & mask
        if x0 >= half:
            x0 -= full
        d = (d - x0) >> _DIGIT
        x1 = d & mask
        if x1 >= half:
            x1 -= full
        x2 = (d - x1) >> _DIGIT
        c = x1 - x0
        if x2 - x1 != c:
            return None
        a = x0 - b * c
        found = best.get(c)
        if found is None or a > found[0]:
            best[c] = (a, k)
    kept = {0} if deltas else set()
    if alone is not None:
        kept.add(alone[1])
    top = None
    for c in sorted(best, reverse=True):
        a, k = best[c]
        if top is None or a + c > top:
            kept.add(k)
            top = a + c
    return sorted(kept)


def _unpack(packed: int, count: int = 3) -> list[int]:
    """:func:`_pack`'s three (``count``) integers back (balanced digits: each in ``[-2**127, 2**127)``)."""
    out = []
    for _ in range(count):
        digit = packed & ((1 << _DIGIT) - 1)
        if digit >> (_DIGIT - 1):
            digit -= 1 << _DIGIT
        out.append(digit)
        packed = (packed - digit) >> _DIGIT
    if packed:
        raise _Unpackable
    return out


class _Cut:
    """The single-device step at numbers, cut by stage: which stage runs each op and owns each storage.

    ``memo`` (a dict the caller keeps for one graph, convention, options and regime): the simulated step is the
    same at every set of numbers with the same ``L`` and the same size branches -- only the storages' sizes at the
    numbers differ -- so the peak's three batches (``B``, ``B + 1``, ``B + 2``) simulate it once."""

    def __init__(self, graph: Graph, conv: Any, options: Mapping[str, Any], regime: Regime,
                 numbers: Mapping[str, int], memo: dict[Any, Any] | None = None) -> None:
        from .stretch import TEMPLATE

        self.p, self.layers = int(numbers["p"]), int(numbers["L"])
        layers = self.layers
        self.per = layers // self.p
        self.graph = graph
        self.subs = {sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v) for k, v in numbers.items()}
        self.memo = memo = {} if memo is None else memo
        if ("layers", layers) not in memo and len(memo) > 8:
            memo.clear()  # a step simulated at many numbers of layers (each a graph of L layers) is not all kept
        memo[("layers", layers)] = True
        # the layers are alike: the sizes' branches and the stages' nodes are read from the graph at 5 layers where
        # the step is written from it (passes/stretch.py), the graph at all L layers (``g``) made only if asked for
        small = TEMPLATE if layers > TEMPLATE + 1 else layers
        self.small = _unrolled(graph, small, memo)
        # the branch the numbers select where a copy depends on the sizes (at B = 1 a view instead of a copy)
        open_, decided = _conditions(self.small, small, self.subs, memo)
        branch = {**decided, **{c: bool(c.xreplace(self.subs)) for c in open_}}
        self.branch = branch
        key = ("step", layers, frozenset(branch.items()))
        restart = runs_restart(regime.checkpoint, self.p, layers)
        if restart:  # every-K runs that a stage's boundary cuts: the step with each stage's runs, for this p
            key += (("runs restart at every stage of", self.p),)
        if key not in memo:
            memo[key] = _simulated(graph, conv, options, regime, branch, layers, memo, self.p if restart else None)
        self._sim: _Simulated = memo[key]
        self.shared, self.keep, self.layout = self._sim.shared, self._sim.keep, self._sim.layout
        self.cache: dict[int, int] = {}  # id of a size (held by the timeline) -> bytes
        # node -> stage, asked for every op of every micro-batch: the same for every cut of this step with these
        # p and L (the three batches, their packed cut, an engine's cuts), so shared by them through the memo
        self._stage: dict[str | None, int] = memo.setdefault(("stages", layers, self.p), {})

    @functools.cached_property
    def g(self) -> Graph:
        """The graph unrolled to all ``L`` layers (FSDP's units read its parameters)."""
        return _unrolled(self.graph, self.layers, self.memo)

    # the simulated step's parts (:class:`_Simulated`: the step at L layers written out only when asked for)
    @property
    def tl(self) -> Any:
        return self._sim.tl

    @property
    def passes(self) -> list[dict[str, list[tuple[int, Any]]]]:
        return self._sim.passes

    @property
    def forwards(self) -> set[int]:
        return self._sim.forwards

    @property
    def frees(self) -> dict[int, int]:
        return self._sim.frees

    def storage(self, sid: int) -> Any:
        """Storage ``sid`` of the step (:meth:`_Simulated.storage`: the step not written out for it)."""
        return self._sim.storage(sid)

    def size(self, sid: int) -> int:
        # by the size's object: the layers' storages share their template's (passes/stretch.py), and a sympy
        # expression's hash and equality were a tenth of a packed replay
        return self.sized(self._sim.nbytes(sid), sid)

    def sized(self, e: Any, sid: int) -> int:
        """Storage ``sid``'s bytes, its size ``e`` (the storage's own object)."""
        found = self.cache.get(id(e))
        if found is None:
            found = self.cache[id(e)] = _integer(e, self.subs, self._sim.name(sid))
        return found

    def stage_of(self, node: str | None) -> int:
        found = self._stage.get(node)
        if found is None:
            found = self._stage[node] = self._stage_of(node)
        return found

    def _stage_of(self, node: str | None) -> int:
        if node is not None and node.endswith(RECOMPUTED):
            node = node[:-len(RECOMPUTED)]  # a checkpointed op run again in backward: its layer's stage runs it
        k = iteration(node) if node is not None else 0
        # a layer's node is in the graph at L layers where its first layer's is (the layers are alike)
        if node is None or not (k <= self.layers and _renamed(node, 1) in self.small if k else node in self.small):
            return self.p - 1  # the loss's gradient seed; the output's sum (no loss in the graph)
        if k:
            return (k - 1) // self.per
        return self.p - 1 if self.small.node(node).group in ("head", "loss") else 0

    def on(self, node: str | None, s: int) -> bool:
        """Whether stage ``s`` runs ``node`` (what the layers read besides the layer before: every stage)."""
        return node in self.shared or self.stage_of(node) == s


class _PackedCut(_Cut):
    """Three :class:`_Cut` of one simulated step at numbers that differ in sizes only: each storage's bytes are the
    three packed into one integer (:func:`batch_moments`)."""

    def __init__(self, cuts: Sequence[_Cut]) -> None:
        # the first cut's parts (the step, its passes, which stage runs each op), not worked out again
        self.__dict__.update(cuts[0].__dict__)
        self.cuts = cuts
        self.cache = {}

    def size(self, sid: int) -> int:
        return self.sized(self._sim.nbytes(sid), sid)

    def sized(self, e: Any, sid: int) -> int:
        found = self.cache.get(id(e))
        if found is None:
            found = self.cache[id(e)] = _pack([c.sized(e, sid) for c in self.cuts])
        return found


def _conditions(small: Graph, layers: int, subs: Mapping[sympy.Symbol, sympy.Expr], memo: dict[Any, Any]
                ) -> tuple[list[Any], dict[Any, bool]]:
    """:func:`~symmem.passes.branches.conditions` of every node of ``small`` (the graph unrolled to ``layers``) at
    ``subs``: the conditions found once a ``memo`` (the three batches' cuts walked the graph's attributes three
    times for the same conditions), each then decided or left open at ``subs`` as ``conditions`` does."""
    from sympy.logic.boolalg import BooleanAtom

    key = ("conditions", layers)
    if key not in memo:
        from ..conditions import canonical
        from .branches import _walk

        found: dict[Any, None] = {}  # each condition's canonical form, in the order conditions() meets them
        for n in small.program_order():
            node = small.node(n)
            for value in (*node.attrs.values(), *node.facts.values()):
                for cond in _walk(value):
                    found.setdefault(canonical(cond)[0])
        memo[key] = list(found)
    open_: list[Any] = []
    decided: dict[Any, bool] = {}
    at = dict(subs)
    for base in memo[key]:
        now = base.xreplace(at)
        if isinstance(now, BooleanAtom):
            decided[base] = bool(now)
        else:
            open_.append(base)
    return open_, decided


def _unrolled(graph: Graph, layers: int, memo: dict[Any, Any]) -> Graph:
    """``graph`` unrolled to ``layers``, made once a ``memo``."""
    if ("unrolled", layers) not in memo:
        from .unroll import unroll

        memo[("unrolled", layers)] = unroll(graph, {next(iter(graph.blocks)): layers})
    return memo[("unrolled", layers)]


def _simulated(graph: Graph, conv: Any, options: Mapping[str, Any], regime: Regime, branch: Mapping[Any, bool],
               layers: int, memo: dict[Any, Any], restart: int | None = None) -> _Simulated:
    """The single-device step of ``graph`` unrolled to ``layers`` over two micro-batches at ``branch``, up to its
    optimizer step (a stage's is its parts'): its timeline, the shared nodes, what the last stage keeps, the two
    passes, the forwards' indices and where each storage is first freed (:class:`_Cut`'s parts that do not depend
    on the numbers).  ``restart``: the number of stages, where ``every-K`` runs begin again at each (a K that does
    not divide ``L/p``: :func:`runs_restart`)."""
    from .pipeline_layout import Layout, NoLayout
    from .stretch import TEMPLATE, _NotStretched, _renamed, passes, stretch
    from .unroll import iteration

    tl = layout = None
    if restart is not None:
        every = checkpoint_every(regime.checkpoint) or 1
        tl = passes(_simulation(_restarted(_unrolled(graph, layers, memo), every, layers // restart), conv, options,
                                regime, branch))
    if tl is None and layers > TEMPLATE + 1:
        # written from the step at 5 layers (passes/stretch.py; simulating each of Llama-2-7B's 32 layers was a
        # third of its pipeline peak's time); a template whose layers are not alike is not stretched.  Not written
        # out unless asked for: the stages' plans are read from the template (passes/pipeline_layout.py)
        template_tl = passes(_simulation(_unrolled(graph, TEMPLATE, memo), conv, options, regime, branch))
        try:
            layout = Layout(template_tl, layers)
        except _NotStretched:
            pass
        except NoLayout:
            origin: list[int] = []
            tl = stretch(template_tl, layers, origin)
            if tl is not None:
                memo[("origin", id(tl))] = (tl, origin)  # each storage's template storage (stretch)
    if tl is None and layout is None:
        tl = passes(_simulation(_unrolled(graph, layers, memo), conv, options, regime, branch))
    output = _model_output(_unrolled(graph, TEMPLATE if layers > TEMPLATE + 1 else layers, memo))
    if output is not None and iteration(output):
        output = _renamed(output, layers)  # the last layer's output (a model without a head)
    # the last stage keeps its logits (output_chunks) and losses to the end of the phase
    keep = {output, "loss", "output.sum"}
    return _Simulated(tl, layout, shared_nodes(graph), keep, memo)


class _Simulated:
    """:func:`_simulated`'s step: its timeline (``tl``; where a :class:`~.pipeline_layout.Layout` numbers it, written
    out when first asked for), the shared nodes, what the last stage keeps, the two passes, the forwards' indices
    and where each storage is first freed."""

    def __init__(self, tl: Any, layout: Any, shared: set[str], keep: set[str | None], memo: dict[Any, Any]) -> None:
        self._tl, self.layout, self.shared, self.keep, self.memo = tl, layout, shared, keep, memo

    @functools.cached_property
    def tl(self) -> Any:
        if self._tl is None:
            self._tl, origin = self.layout.written()
            self.memo[("origin", id(self._tl))] = (self._tl, origin)  # each storage's template storage (stretch)
        return self._tl

    @functools.cached_property
    def passes(self) -> list[dict[str, list[tuple[int, Any]]]]:
        return _passes(self.tl)

    @functools.cached_property
    def forwards(self) -> set[int]:
        return {k for pass_ in self.passes for k, _ in pass_["F"]}

    @functools.cached_property
    def frees(self) -> dict[int, int]:
        frees: dict[int, int] = {}
        for k, e in enumerate(self.tl.events):
            for sid in e.freed:
                frees.setdefault(sid, k)
        return frees

    def nbytes(self, sid: int) -> Any:
        """Storage ``sid``'s size (the object the written step holds: its template storage's)."""
        if self._tl is None:
            return self.layout.tl.storages[self.layout.origin[sid]].nbytes
        return self._tl.storages[sid].nbytes

    def name(self, sid: int) -> str:
        return self.layout.name(sid) if self._tl is None else self._tl.storages[sid].name

    def storage(self, sid: int) -> Any:
        """Storage ``sid`` as the written step holds it (its name and op numbered for its layer), without writing
        the step out."""
        if self._tl is not None:
            return self._tl.storages[sid]
        made = self.__dict__.setdefault("_made", {})
        found = made.get(sid)
        if found is None:
            from ..timeline import make_live
            from .stretch import _split

            layout = self.layout
            st, n = layout.tl.storages[layout.origin[sid]], layout.layer[sid]
            node = st.node
            if n and node:
                head, tail = _split(node)
                node = f"{head}{n}{tail}"
            found = made[sid] = make_live(layout.name(sid), st.category, st.nbytes, node, st.host)
        return found

    def gradient_of(self, node: str) -> str:
        """The name of the first gradient storage ``node`` makes ("" where none): a node outside the layers, whose
        storages are the template's as they are."""
        if self._tl is not None:
            return next((st.name for st in self._tl.storages if st.category == "gradient" and st.node == node), "")
        storages, where = self.layout.tl.storages, self.layout.where
        return next((st.name for k, st in enumerate(storages)
                     if where[k] is None and st.category == "gradient" and st.node == node), "")


def _simulation(g: Graph, conv: Any, options: Mapping[str, Any], regime: Regime, branch: Mapping[Any, bool]) -> Any:
    """The steady step of ``g`` over two micro-batches (the first makes the gradients, the second adds into them)."""
    from dataclasses import replace as _replace

    from .schedule import Simulation

    sim = Simulation(g, conv, options, _replace(regime, micro_batches=2), dict(branch), False)
    sim.micro_batch()
    sim.micro_batch()
    return sim.timeline(first=False)


#: what becomes of a storage an op of a stage makes (:meth:`_Replay._plan`): kept until something else frees it
#: (an op of the same pass, the step, the end of the phase), freed at once (a gradient added into ``.grad``), freed
#: with the forward (read last by a later stage's forward), freed with the micro-batch's backward
_HELD, _AT_ONCE, _WITH_FORWARD, _WITH_BACKWARD = range(4)


class _Replay:
    """One stage's forwards and backwards in the schedule's order: the live bytes after every op, the largest."""

    def __init__(self, cut: _Cut, s: int, at: Mapping[str, int], schedule: str, m: int) -> None:
        self.cut, self.s, self.at, self.schedule, self.m = cut, s, at, schedule, m
        self.live = at["at_rest"] - at["outputs"]  # the last step's logits are dropped as the step begins
        self.best: tuple[int, str, str | None, int | None] = (self.live, "pipeline", None, None)
        self.alive: dict[tuple[int, int], int] = {}
        self.later: list[tuple[int, tuple[int, int]]] = []  # (the backward after which it goes, key)
        self.backwards = 0
        self.deferred: dict[int, list[tuple[int, int]]] = {}  # made in a forward, dying with its backward
        #: every moment of the phase, in order: (live bytes, op, micro-batch); the step's last (op ``None``)
        self.moments: list[tuple[int, str | None, int | None]] = []
        self._events: dict[tuple[int, str], list[tuple[str | None, list[tuple[int, int, int]], list[int]]]] = {}
        # _repeated's: each segment's record by how it begins, what each micro-batch's segments left alive
        self._records: dict[Any, Any] = {}
        self._left: dict[int, frozenset[int]] = {}
        self._sends: dict[tuple[int, bool], bool] = {}
        #: a packed replay (batch_moments reads each of its values once a phase)
        self.packed = isinstance(cut, _PackedCut)
        #: the batch ``b`` of a replay packed at ``B = b, b + 1, b + 2``, whose moments are read as lines only
        #: (:func:`bounding`); None: every moment kept
        self.lined = _lined_at(cut)

    def run(self) -> StagePeak:
        cut, s = self.cut, self.s
        for kind, mb in order(self.schedule, s, cut.p, self.m):
            ends = self.segment(kind, mb)
            if kind == "F":
                self.end_forward(mb, ends)
            else:
                self.end_backward(mb, ends)
        self.finish()
        if s == cut.p - 1 and self.at["outputs"]:
            self.moment(self.live + self.at["outputs"], "merge_chunks", None)  # every micro-batch's logits
        step = self.at["step_peak"]
        self.moments.append((step, None, None))
        top = self.best if self.best[0] >= step else (step, "step", None, None)
        first = max(self.best[0] - self.at["optimizer_state"], step)
        return StagePeak(s, top[0], top[1], top[2], top[3], self.best[0], step, first)

    def moment(self, live: int, node: str | None, mb: int | None) -> None:
        self.moments.append((live, node, mb))
        if live > self.best[0]:
            self.best = (live, "pipeline", node, mb)

    def free(self, key: tuple[int, int]) -> None:
        self.live -= self.alive.pop(key, 0)

    def segment(self, kind: str, mb: int) -> list[tuple[int, int]]:
        """Micro-batch ``mb``'s forward or backward on this stage; returns what dies when its backward ends."""
        if type(self).before is _Replay.before and type(self).after is _Replay.after:
            return self._alone(kind, mb)
        if type(self.moments) is list:
            state = self._hook_state(kind, mb)
            if state is not None:  # the engine's hooks begin alike: a segment begun so before is its record moved
                return self._repeated(kind, mb, self._hooked, state)
        return self._hooked(kind, mb)

    # what an engine's hooks (begin, before, after, end) carry from one segment to the next, for _repeated: the
    # stage alone's have nothing to carry
    def _hook_state(self, kind: str, mb: int) -> Any:
        """What the hooks hold as micro-batch ``mb``'s ``kind`` segment begins that decides what they do in it
        (hashable), or None: the segment is walked op by op every time (an engine whose hooks do not say)."""
        return None

    def _hook_mark(self) -> Any:
        """Before a segment is first walked: what :meth:`_hook_effect` compares with after it."""
        return None

    def _hook_effect(self, mark: Any) -> Any:
        """After a segment's first walk: what its hooks changed beyond the live bytes (their state as it ends)."""
        return None

    def _hook_redo(self, effect: Any) -> None:
        """A recorded segment replayed: the hooks' state changed as :meth:`_hook_effect` recorded it."""

    def _acting(self, pass_: int, kind: str) -> Any:
        """The indices of the ops of the plan of ``pass_`` and ``kind`` around which the engine's hooks (``before``,
        ``after``, its ``moment``) may act, a set worked out once a plan; at every other op they would change
        nothing and :meth:`moment` would be the stage alone's (so :meth:`_hooked` runs those ops as :meth:`_walked`
        does, without a call).  None: every op (hooks this class does not know: a subclass's)."""
        return None

    def _hooked(self, kind: str, mb: int) -> list[tuple[int, int]]:
        """:meth:`segment` op by op with the engine's hooks around the ops where they act (:meth:`_acting`), or
        around every op (``_at``: the op's index in the plan, for the hooks that read the plan)."""
        pass_ = 0 if mb == 0 else 1
        plan = self._plan(pass_, kind)
        # moments watched as they come (a list of its own: passes/pipeline_formula.py) see every op's hooks
        acting = self._acting(pass_, kind) if type(self.moments) is list else None
        if acting is None:
            acting = range(len(plan))
        alive, append = self.alive, self.moments.append
        ends: list[tuple[int, int]] = []
        done: list[tuple[int, int]] = []
        self.begin(kind, mb)
        before, after, moment, free = self.before, self.after, self.moment, self.free
        live, best = self.live, self.best
        for i, (node, born, freed) in enumerate(plan):
            if i in acting:  # the hooks around the op, the engine's moment
                self.live, self.best, self._at = live, best, i
                before(kind, node, mb)
                for sid, nbytes, fate in born:
                    alive[(mb, sid)] = nbytes
                    self.live += nbytes
                    if fate == _AT_ONCE:
                        moment(self.live, node, mb)
                        free((mb, sid))
                    elif fate == _WITH_FORWARD:
                        done.append((mb, sid))
                    elif fate == _WITH_BACKWARD:
                        ends.append((mb, sid))
                moment(self.live, node, mb)
                for sid in freed:
                    if (mb, sid) in alive:
                        free((mb, sid))
                after(kind, node, mb)
                live, best = self.live, self.best
                continue
            # nothing around the op: _walked's body
            for sid, nbytes, fate in born:
                alive[(mb, sid)] = nbytes
                live += nbytes
                if fate == _AT_ONCE:
                    append((live, node, mb))
                    if live > best[0]:
                        best = (live, "pipeline", node, mb)
                    live -= alive.pop((mb, sid), 0)
                elif fate == _WITH_FORWARD:
                    done.append((mb, sid))
                elif fate == _WITH_BACKWARD:
                    ends.append((mb, sid))
            append((live, node, mb))
            if live > best[0]:
                best = (live, "pipeline", node, mb)
            for sid in freed:
                if (mb, sid) in alive:
                    live -= alive.pop((mb, sid))
        self.live, self.best = live, best
        self.end(kind, mb)
        for key in done:
            self.free(key)
        return ends

    def _alone(self, kind: str, mb: int) -> list[tuple[int, int]]:
        """:meth:`segment` where nothing acts around the stage's ops (no ``before``, ``after``): the same moments,
        with :meth:`moment` and :meth:`free` inlined over the thousands of ops of a stage's replay."""
        if type(self) is _Replay and type(self.moments) is list:
            return self._repeated(kind, mb, self._walked, ())
        # an engine's replay, or moments watched as they come (a list of its own whose append reads what is alive
        # then: passes/pipeline_formula.py), walks every op
        return self._walked(kind, mb)

    def _repeated(self, kind: str, mb: int, walk: Any, state: Any) -> list[tuple[int, int]]:
        """:meth:`_walked` once for each way a segment can begin, then its record moved to the live bytes it
        begins at (the stage alone: 1F1B and GPipe repeat a stage's forward and backward over the micro-batches).

        A segment's moments less the live bytes it begins at, and what it leaves alive, depend only on its plan
        (the pass and ``kind``) and on which of the storages the plan makes or frees are alive for ``mb`` as it
        begins (a storage's bytes are its size's, the same wherever it is made): so a segment that begins alike
        is its record moved.  Only this micro-batch's segments make its storages (``_left``: what each left
        alive), so that is what is looked up.  In a packed replay (:func:`batch_moments`, which reads each value
        once a phase) a segment that begins alike at the same live bytes as one before shows no value of its own.

        ``walk`` is the segment op by op (:meth:`_walked`, or :meth:`_hooked` where an engine's hooks act around
        the ops); ``state``, what the hooks carry into it (:meth:`_hook_state`), is part of how it begins, and what
        they change is recorded with it (:meth:`_hook_effect`, :meth:`_hook_redo`).
        """
        pass_ = 0 if mb == 0 else 1
        touched = self._touched(pass_, kind)
        alive = self.alive
        left = self._left.get(mb, frozenset())
        present = frozenset({sid for sid in left if sid in touched and (mb, sid) in alive})
        key = (pass_, kind, present, state)
        found = self._records.get(key)
        live0 = self.live
        if found is None:
            start = len(self.moments)
            mark = self._hook_mark()
            ends = walk(kind, mb)
            made = self.moments[start:]
            values = [v for v, _, _ in made]
            # the first of the largest (max and index run in C over the segment's hundreds of moments)
            top = values.index(max(values)) if values else None
            highest = None if top is None else (made[top][0] - live0, made[top][1])
            if self.lined is not None:  # the moments that can bound a line, wherever the record is moved to
                bound = bounding([v - live0 for v in values], *self.lined)
                if bound is not None:
                    made = self.moments[start:] = [made[k] for k in bound]
            final = [(sid, alive[(mb, sid)]) for sid in touched if (mb, sid) in alive]
            self._records[key] = found = (
                [(v - live0, node) for v, node, _ in made], self.live - live0,
                highest, final,
                [sid for sid in present if (mb, sid) not in alive], [sid for _, sid in ends], {live0},
                self._hook_effect(mark), frozenset({sid for sid, _ in final}))
            self._left[mb] = left | found[-1]
            return ends
        deltas, net, top, final, popped, ends_, seen, effect, kept = found
        self._hook_redo(effect)
        if not (self.packed and live0 in seen):
            seen.add(live0)
            self.moments += [(live0 + d, node, mb) for d, node in deltas]
        if top is not None and live0 + top[0] > self.best[0]:
            self.best = (live0 + top[0], "pipeline", top[1], mb)
        for sid in popped:
            del alive[(mb, sid)]
        for sid, nbytes in final:
            alive[(mb, sid)] = nbytes
        self.live = live0 + net
        self._left[mb] = left | kept
        return [(mb, sid) for sid in ends_]

    def _touched(self, pass_: int, kind: str) -> frozenset[int]:
        """The storages the plan of ``pass_`` and ``kind`` makes or frees (:meth:`_plan` notes them as it makes the
        plan; a plan given to the replay, :mod:`.pipeline_formula`'s, is read here)."""
        key = (pass_, kind)
        touches = self.__dict__.setdefault("_touches", {})
        found = touches.get(key)
        if found is None:
            plan = self._plan(pass_, kind)
            found = touches.get(key)
            if found is None:
                found = touches[key] = frozenset(
                    sid for _, born, freed in plan for sid in (*(x[0] for x in born), *freed))
        return found

    def _walked(self, kind: str, mb: int) -> list[tuple[int, int]]:
        """:meth:`_alone` op by op."""
        alive, append = self.alive, self.moments.append
        ends: list[tuple[int, int]] = []
        done: list[tuple[int, int]] = []
        self.begin(kind, mb)
        live, best = self.live, self.best
        for node, born, freed in self._plan(0 if mb == 0 else 1, kind):
            for sid, nbytes, fate in born:
                alive[(mb, sid)] = nbytes
                live += nbytes
                if fate == _AT_ONCE:
                    append((live, node, mb))
                    if live > best[0]:
                        best = (live, "pipeline", node, mb)
                    live -= alive.pop((mb, sid), 0)
                elif fate == _WITH_FORWARD:
                    done.append((mb, sid))
                elif fate == _WITH_BACKWARD:
                    ends.append((mb, sid))
            append((live, node, mb))
            if live > best[0]:
                best = (live, "pipeline", node, mb)
            for sid in freed:
                if (mb, sid) in alive:
                    live -= alive.pop((mb, sid))
        self.live, self.best = live, best
        self.end(kind, mb)
        for key in done:
            self.free(key)
        return ends

    def _plan(self, pass_: int, kind: str) -> list[tuple[str | None, list[tuple[int, int, int]], list[int]]]:
        """What :meth:`segment` does at each op of this stage in the single-device pass ``pass_`` (0: the first
        micro-batch, 1: any later one) and ``kind``: (the op, the storages it makes with their bytes and fate, the
        storages it frees).  Alike for every micro-batch after the first, so worked out once (80% of a replay was
        working it out again at every micro-batch)."""
        key = (pass_, kind)
        if key in self._events:
            return self._events[key]
        layout = self._layout()
        if layout is not None:  # read from the template, the step not written out (passes/pipeline_layout.py)
            from .pipeline_layout import plan

            made, touched_ = plan(layout, pass_, kind)
            self._events[key] = made
            self.__dict__.setdefault("_touches", {})[key] = frozenset(touched_)
            return made
        cut, s, tl = self.cut, self.s, self.cut.tl
        mine = _ops(cut, pass_, kind)[s]
        indices = {k for k, _ in mine}
        # the lookups hoisted out of the thousands of ops (a stage's plans were most of its replay)
        storages, size, frees, keep, forwards = tl.storages, cut.size, cut.frees.get, cut.keep, cut.forwards
        on, shared, stage_of = cut.on, cut.shared, cut.stage_of
        stages = _known_stages(cut)  # (a lookup for each storage a stage makes)
        alone = type(cut).on is _Cut.on  # then on() is: shared, or the op's stage
        # a plain or packed cut's size() is its cache by the size's object, else worked out: looked up here first
        # (a call for each of the thousands of storages a stage makes)
        sized = cut.cache.get if type(cut).size in (_Cut.size, _PackedCut.size) else _unknown
        unsized = sized is _unknown  # (then size() at once)
        outside = ("parameter", "optimizer_state", "input")
        forward, later = kind == "F", pass_ > 0
        plan = []
        for k, e in mine:
            born = []
            for sid in e.born:
                st = storages[sid]
                category = st.category
                if category in outside:
                    continue
                node = st.node
                if alone:
                    if node not in shared and (stages[node] if node in stages else stage_of(node)) != s:
                        continue
                elif not on(node, s):
                    continue
                freed = frees(sid)
                if category == "gradient":
                    # a tied weight's gradient waits for its other use on one device; a stage's own copy adds the
                    # new gradient into .grad at once; otherwise held to the step
                    fate = _AT_ONCE if later and freed not in indices else _HELD
                elif st.name in keep:
                    fate = _HELD  # to the end of the phase
                elif forward and freed in forwards:
                    fate = _WITH_FORWARD  # last read by a later stage's forward: gone with this forward
                elif freed not in indices:
                    fate = _WITH_BACKWARD
                else:
                    fate = _HELD  # freed by an op of this pass
                nbytes = None if unsized else sized(id(st.nbytes))
                born.append((sid, size(sid) if nbytes is None else nbytes, fate))
            if e.freed:
                dying = [sid for sid in e.freed if frees(sid) == k and storages[sid].name not in keep]
            else:
                dying = []
            plan.append((e.node, born, dying))
        self._events[key] = plan
        # what the plan makes or frees (_touched; not in _records: no segment's)
        self.__dict__.setdefault("_touches", {})[key] = frozenset(
            {sid for _, born, _ in plan for sid, _, _ in born} | {sid for _, _, dying in plan for sid in dying})
        return plan

    # what a data-parallel engine wrapped around the stage does around its ops (none here: the stage alone;
    # passes/fsdp_pipeline.py: FSDP2's units)
    def begin(self, kind: str, mb: int) -> None:
        """Before micro-batch ``mb``'s forward (``kind`` ``F``) or backward (``B``) on this stage."""

    def before(self, kind: str, node: str | None, mb: int) -> None:
        """Before the op ``node`` of micro-batch ``mb``'s forward or backward."""

    def after(self, kind: str, node: str | None, mb: int) -> None:
        """After the op ``node`` (its outputs made, what it last read freed)."""

    def end(self, kind: str, mb: int) -> None:
        """After micro-batch ``mb``'s forward or backward on this stage."""

    def finish(self) -> None:
        """After the last backward, before the last stage concatenates its logits."""

    def end_forward(self, mb: int, ends: list[tuple[int, int]]) -> None:
        """The stage's output, sent on: GPipe's send works hold every one to the end of the phase; 1F1B's warmup
        holds the one before its last in ``send_work`` until the steady loop ends."""
        cut, s = self.cut, self.s
        # _sent's answers looked up first (every micro-batch's forward ends with the same storages)
        known, sent = self._sends, self._sent
        sent_on = [x for x in ends if (known[(x[1], True)] if (x[1], True) in known else sent(x[1], True))]
        warmup = min(self.m, cut.p - s)
        if self.schedule == "gpipe":
            ends = [x for x in ends if not self._sent(x[1], True)]
        elif warmup >= 2 and mb == warmup - 2:
            # freed once both its backward (the (mb + 1)-th) and the steady loop are done
            self.later += [(max(mb + 1, self.m - warmup + 1), x) for x in sent_on]
            ends = [x for x in ends if not self._sent(x[1], True)]
        self.deferred[mb] = ends

    def _sent(self, sid: int, on: bool) -> bool:
        """:func:`_sent_on` (``on``) or :func:`_sent_back` of storage ``sid`` from this stage, asked once a storage:
        every micro-batch's forward and backward ends with the same storages."""
        found = self._sends.get((sid, on))
        if found is None:
            cut = self.cut
            layout = self._layout()
            if layout is not None:
                found = self._sends[(sid, on)] = layout.sent(sid, on)
            else:
                found = self._sends[(sid, on)] = (_sent_on if on else _sent_back)(sid, cut.stage_of, cut.frees,
                                                                                 cut.tl, self.s)
        return found

    def _layout(self) -> Any:
        """This stage's questions to the step's :class:`~.pipeline_layout.Layout` where its plans and sends are read
        from the template (a plain or packed cut of a written-from-template step whose layers' ops are each on
        their layer's stage), else None (read from the written step)."""
        found = self.__dict__.get("_layout_stage", False)
        if found is False:
            cut = self.cut
            found = None
            if type(cut) in (_Cut, _PackedCut) and cut.layout is not None:
                from .pipeline_layout import checked, stage_of_layout

                if checked(cut.layout, cut):
                    found = stage_of_layout(cut, self.s, cut.sized)
            self.__dict__["_layout_stage"] = found
        return found

    def end_backward(self, mb: int, ends: list[tuple[int, int]]) -> None:
        """What dies with the micro-batch's backward; the gradient sent back lives until its send is waited on."""
        ends = ends + self.deferred.pop(mb, [])
        self.backwards += 1
        sent = []
        # each storage asked once (thousands a replay): _sent's answers looked up here first, free() inlined
        known, alive, live = self._sends.get, self.alive, self.live
        for key in ends:
            found = known((key[1], False))
            if found is None:
                self.live = live
                found = self._sent(key[1], False)
            if found:
                sent.append(key)
            else:
                live -= alive.pop(key, 0)
        self.live = live
        last = self.m * 2 if self.schedule == "gpipe" else self.backwards + 1
        self.later += [(last, key) for key in sent]
        for _, key in [x for x in self.later if x[0] <= self.backwards]:
            self.free(key)
        self.later = [x for x in self.later if x[0] > self.backwards]


def _ops(cut: Any, pass_: int, kind: str) -> list[list[tuple[int, Any]]]:
    """Each stage's ops (``cut.on``) in pass ``pass_``'s forward or backward (``kind``), with their indices: sorted
    out once for every stage of the cut (each stage's replay filtered every op of the step)."""
    found = cut.__dict__.setdefault("_ops", {})
    if (pass_, kind) not in found:
        shared, stage_of = cut.shared, cut.stage_of
        stages = _known_stages(cut)  # (thousands of ops a pass)
        ops = cut.passes[pass_][kind]
        # each op's stage, -1 for what the layers read besides the layer before (every stage makes its own)
        where = [-1 if node in shared else stages[node] if node in stages else stage_of(node)
                 for node in [e.node for _, e in ops]]
        found[(pass_, kind)] = [[op for op, w in zip(ops, where, strict=True) if w == s or w < 0] for s in range(cut.p)]
    return found[(pass_, kind)]


def _known_stages(cut: Any) -> dict[str | None, int]:
    """What the cut's ``stage_of`` found so far, read without a call (``_Cut.stage_of``'s own cache, which it fills;
    nothing for a cut of another kind: a traced module's), for the loops over every op of a step."""
    return cut._stage if getattr(type(cut), "stage_of", None) is _Cut.stage_of else {}


def _unknown(node: str | None) -> None:
    return None


def _sent_on(sid: int, stage_of: Any, frees: Mapping[int, int], tl: Any, s: int) -> bool:
    """Whether storage ``sid`` is stage ``s``'s output: single-device, an op of a later stage frees it."""
    k = frees.get(sid)
    node = tl.events[k].node if k is not None else None
    return node is not None and stage_of(node) > s


def _sent_back(sid: int, stage_of: Any, frees: Mapping[int, int], tl: Any, s: int) -> bool:
    """Whether storage ``sid`` is the gradient stage ``s`` sends to the stage before: single-device, an op of an
    earlier stage frees it.  (By index: finding a storage by equality walked every storage, 65% of a replay.)"""
    k = frees.get(sid)
    if tl.storages[sid].category != "activation_grad" or k is None or s == 0:
        return False
    node = tl.events[k].node
    return node is not None and stage_of(node) < s


def _passes(tl: Any) -> list[dict[str, list[tuple[int, Any]]]]:
    """The two micro-batch passes of a simulated step: each pass's forward and backward events (with their index
    in the timeline)."""
    out: list[dict[str, list[tuple[int, Any]]]] = []
    previous = None
    for k, e in enumerate(tl.events):
        if e.phase not in ("forward", "backward"):
            continue
        if e.phase == "forward" and previous != "forward":
            out.append({"F": [], "B": []})
        out[-1]["F" if e.phase == "forward" else "B"].append((k, e))
        previous = e.phase
    return out


# -- tensor parallelism as DTensor runs it ---------------------------------------------------------------------
#: Dimensions a tensor-parallel plan splits: the attention heads (query and key/value) and the MLP width.
SPLIT_DIMS = ("h", "G", "F")


@dataclass(frozen=True)
class TensorRank:
    """One tensor-parallel rank's memory under DTensor's standard plan (formulas in ``t``): the activations
    autograd keeps, the parameters' local shards, their gradients (the embedding's comes back whole), Adam's
    state (the local shards, and a 4-byte step per parameter tensor)."""

    saved: sympy.Expr
    parameters: sympy.Expr
    gradients: sympy.Expr
    optimizer_state: sympy.Expr

    def at(self, numbers: Mapping[str, int]) -> dict[str, int]:
        """Every part at ``numbers`` (``t`` included), which must split evenly: ``t`` divides the heads, the MLP
        width and the vocabulary (DTensor would pad uneven shards: not modelled)."""
        size = numbers.get("t")
        if isinstance(size, int) and size < 1:
            raise SymmemError(f"the tensor-parallel size t must be at least 1, got t={size}")
        for name in ("h", "G", "F", "V"):
            if isinstance(size, int) and name in numbers and numbers[name] % size:
                raise SymmemError(f"t={size} does not divide {name}={numbers[name]}: the plan splits the heads (h, "
                                  "G), the MLP width (F) and the vocabulary (V) evenly over the ranks")
        subs = {sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v) for k, v in numbers.items()}
        return {f.name: _integer(getattr(self, f.name), subs, f.name) for f in fields(self)}


def tensor_rank(graph: Graph, storages: Sequence[Storage], regime: Regime, sequence: bool = False) -> TensorRank:
    """One rank of ``t`` under ``parallelize_module`` with the standard plan (the embedding row-wise, q/k/v and
    the MLP's gate/up column-wise, o/down row-wise, the head column-wise), from the single-device ``storages``
    of ``graph`` (the pytorch convention, no tensor parallelism in ``regime``).

    What DTensor splits is every tensor between a column-parallel linear and the row-parallel one after it:
    whatever has a head or MLP-width dimension (:data:`SPLIT_DIMS`) -- the rotary query, the repeated keys and
    values kept by the attention's matmuls, the SiLU output -- beside the roles Megatron-LM's accounting splits
    (:data:`symmem.passes.regimes.TP_ROLES`); everything else is whole on every rank.

    With ``sequence`` (DTensor's ``SequenceParallel`` norms, the layer input split over S between the row-parallel
    outputs' reduce-scatter and the column-parallel inputs' all-gather) the rest of the hidden stream -- every
    (B, S, ...) tensor, the embedding's output, the norms', the residual sums -- is split over S too, except what
    a column-parallel linear keeps: the all-gathered input, whole, once per all-gather (the attention gathers
    once for q, k and v; linears outside it each gather their own).  Korthikanti's accounting splits those too.
    """
    from ..symbols import t

    saved = sum((local_saved(graph, s, sequence) for s in storages if s.category in ("activation", "loss")),
                sympy.Integer(0)) + at_one(graph, storages, sequence)
    weights = grads = state = sympy.Integer(0)
    for n in graph.program_order():
        node = graph.node(n)
        for _, shape in node_parameters(n, node):
            count = node.count
            local = numel(shape) / t if len(shape) >= 2 else numel(shape)
            weights += count * local * 4
            # the embedding's gradient comes back whole: embedding_dense_backward of the replicated ids
            grads += count * (numel(shape) if node.kind == "embedding" else local) * 4
            state += count * (2 * local * 4 + (4 if regime.optimizer in ("adam", "adamw") else 0))
    if regime.precision != "fp32" or regime.optimizer not in ("adam", "adamw"):
        raise SymmemError("the tensor-parallel ranks are modelled for FP32 Adam/AdamW, as measured")
    return TensorRank(saved, weights, grads, state)


def at_one(graph: Graph, storages: Sequence[Storage], sequence: bool) -> sympy.Expr:
    """What a rank's saved activations hold more at B = 1 (0 from B = 2): with eager attention and one key/value
    head a rank, the cache's key and value in place of the repeated copies
    (:func:`~symmem.passes.batch_of_one.collapsed`, the rule the step's walk follows).

    >>> from symmem.api import tensor_parallel_rank
    >>> v = {"B": 1, "S": 128, "H": 32, "h": 4, "G": 2, "L": 1, "V": 16, "F": 32}
    >>> rank = tensor_parallel_rank("llama", values=v, device="cpu", attention="naive")
    >>> rank.at({**v, "t": 2})["saved"], rank.at({**v, "B": 2, "t": 2})["saved"]  # B = 1: gloo's, measured
    (345600, 699392)
    """
    from ..symbols import t
    from .batch_of_one import cache_for_repeats, collapsed, single_copy

    where = collapsed(graph.program_order())
    if where is sympy.false:
        return sympy.Integer(0)

    def local(name: str) -> sympy.Expr:  # the cache copy, split over t by its key/value heads
        whole = graph.node(name).count * _bytes(graph, name, "float32")
        return whole / t if _splits(graph, name, name) else whole

    more = cache_for_repeats(((s.node, local_saved(graph, s, sequence)) for s in storages
                              if s.node is not None and s.node in graph and s.category == "activation"), local)
    return single_copy() * sympy.Piecewise((more, where), (0, True))


def local_saved(graph: Graph, s: Storage, sequence: bool) -> sympy.Expr:
    """The bytes one rank keeps of the single-device storage ``s`` (see :func:`tensor_rank`)."""
    from ..symbols import t
    from .regimes import TP_ROLES

    if s.role in TP_ROLES or (s.node is not None and s.node in graph and _splits(graph, s.node, s.name)):
        return s.expr / t
    if sequence and s.node in graph:
        gathers = _gathers(graph, s.keepers)
        if gathers:
            return gathers * s.expr  # the all-gathered full-S input of column-parallel linears
        return s.expr / t if _stream(graph, s.node) else s.expr
    return s.expr


def _gathers(graph: Graph, keepers: Iterable[str]) -> int:
    """How many all-gathered copies of a tensor column-parallel linears keep under sequence parallelism: one for
    the attention's q/k/v, one each for the others (the MLP's gate and up, the head)."""
    colwise = [k for k in keepers if k in graph and graph.node(k).kind == "linear" and (
        graph.node(k).role in ("qkv", "mlp_hidden") or graph.node(k).group == "head")]
    attention = [k for k in colwise if graph.node(k).role == "qkv"]
    return (1 if attention else 0) + len(colwise) - len(attention)


def _stream(graph: Graph, node: str) -> bool:
    """Whether ``node``'s output is of the hidden stream: (B, S, ...), which sequence parallelism splits over S."""
    shape = [str(d) for d in graph.node(node).out.shape]
    return shape[:2] == ["B", "S"]


def _splits(graph: Graph, node: str, name: str) -> bool:
    """Whether the tensor a storage holds has a head or MLP-width dimension (an input copy: that input's)."""
    spec = graph.node(node).out
    suffix = name[len(node):] if name.startswith(node) else ""
    if suffix.startswith(".input") and suffix.endswith("_copy"):
        index = int(suffix[len(".input"):-len("_copy")])
        spec = graph.node(graph.node(node).inputs[index]).out
    names = {str(x) for d in spec.shape for x in sympy.sympify(d, strict=True).free_symbols}
    return graph.node(node).block is not None and bool(names & set(SPLIT_DIMS))
