"""What each rank of a data-parallel engine holds on its parameter side: its weights, its gradients as the engine
holds them when the optimizer steps, and its optimizer state, with FSDP's padding and Adam's 4-byte ``step`` counts.

``parameter_memory`` and ``total`` stay the papers' accounting (16Ψ/N of FP32 AdamW under FSDP, no padding, no step
scalars: docs/regimes.md); this is the engine's, read off the step the peak is derived from -- each rank's steady
step written out at the derivation's numbers (:mod:`.schedule`'s storages, so every rule the peak follows: FSDP2's
padded per-parameter shards and padded sharded gradients, its optimizer state over the unpadded rows; FSDP1's flat
shards, padding included; DDP's whole gradients and its buckets; ZeroRedundancyOptimizer's state of the whole
parameters a rank owns), the live bytes just before ``optimizer.step()``:

* ``parameters`` -- the weights (and buffers) a rank stores: under FSDP its shards (the unsharded copies are freed
  by then);
* ``gradients`` -- the ``.grad`` storages at the step: FSDP2's padded sharded gradients, FSDP1's flat shards, DDP's
  whole gradients (under ``ddp-bucket-view`` the buckets themselves: every ``.grad`` is a view of them);
* ``buckets`` -- DDP's (and ZeRO-1's) flat gradient buckets, alive the whole step, beside the gradients (0 without
  DDP, and under the bucket view, where they are the gradients);
* ``optimizer_state`` -- AdamW's moments and step counts of what the rank steps on;
* ``total`` -- their sum.

>>> from symmem import derive
>>> d = derive("mlp", convention="pytorch", device="cpu", optimizer="adamw", values={"B": 4, "N": 4},
...            widths="64,128,128,10", loss="cross-entropy", data_parallel="fsdp")
>>> side = parameter_side_per_rank(d)
>>> side[0]["parameters"], side[0]["optimizer_state"] - side[3]["optimizer_state"]  # the head: 3 + 3 + 3 + 1 rows
(26380, 2064)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import sympy

from ..errors import SymmemError
from ..symbols import N
from . import zero_redundancy
from .data_parallel import SHARDED, alike_ranks, grads_in_buckets, held_shape, stored_shapes
from .parameters import program_parameters, state_storages
from .unroll import unroll

#: The engines a rank's parameter side is given for (:data:`symmem.training.DATA_PARALLEL`).
ENGINES = ("ddp", "ddp-bucket-view", "zero-redundancy", "fsdp", "fsdp-no-reshard", "fsdp1", "fsdp1-grad-op")
#: The keys of one rank's parameter side, in the order the views list them.
KEYS = ("parameters", "gradients", "buckets", "optimizer_state", "total")
#: The storage DDP's reducer keeps its gradient buckets in (:func:`.data_parallel.buckets`).
_BUCKETS = "ddp.buckets"


def parameter_side_per_rank(derivation: Any) -> dict[int, dict[str, int]] | None:
    """``{rank: {parameters, gradients, buckets, optimizer_state, total}}`` in bytes for every rank ``0 .. N-1``
    at the derivation's numbers (module docstring); on a mesh every rank of it, as its step's per-rank peaks number
    them (:func:`_tensor_mesh`: FSDP2/FSDP1 x TP; :func:`_traced_tensor_mesh`: a traced module's FSDP2 x TP;
    :func:`_pipeline_mesh`: DDP/ZeRO-1/FSDP2 on pipeline stages of a built graph or a traced module). None without a
    data-parallel engine, without a number for ``N``, where the step has no peak at the numbers, or for the meshes
    not modelled here (TP x pipeline).

    The step written out (the one the views' timeline shows: rank 0's, ZeRO-1's largest rank's) gives the weights,
    gradients and buckets, which every rank holds alike; the ranks differ only in their optimizer state (FSDP2's
    unpadded rows, ZeRO-1's owned parameters): a traced module's FSDP2 ranks are each read off their own step
    (:meth:`symmem.importer.traced_engines.EngineStepPeak.at_rank`), a built graph's worked out by the rules its
    step follows; ZeRO-1's are the ranks' state the peak holds (:func:`.zero_redundancy.state_per_rank`)."""
    regime = derivation.regime
    step = getattr(derivation, "step", None)
    if regime.tensor_parallel and regime.pipeline_parallel and hasattr(step, "rank_sides"):
        try:  # tensor parallel x pipeline on a p x t mesh: each stage's replay (passes/tensor_pipeline.py)
            return step.rank_sides(derivation)
        except SymmemError:
            return None
    world = derivation.numbers.get(N)
    if regime.data_parallel not in ENGINES or world is None:
        return None
    if regime.tensor_parallel and not regime.pipeline_parallel and hasattr(step, "rank_parts"):
        try:  # FSDP/FSDP1 x TP: each data-parallel rank's parts as the mesh step holds them (passes/fsdp_tensor.py)
            return _tensor_mesh(derivation, step)
        except SymmemError:
            return None
    if regime.tensor_parallel and not regime.pipeline_parallel and hasattr(step, "groups") and hasattr(step, "_at"):
        try:  # a traced module's FSDP2 x TP (importer/traced_fsdp_tensor.py): each data-parallel rank's own step
            return _traced_tensor_mesh(derivation, step)
        except SymmemError:
            return None
    if regime.pipeline_parallel and not regime.tensor_parallel and _engine_on_stages(step):
        try:  # DDP/ZeRO-1/FSDP2 on pipeline stages: each stage's replay of each data-parallel rank
            return _pipeline_mesh(derivation, step)
        except SymmemError:
            return None
    if regime.tensor_parallel or regime.pipeline_parallel:
        return None
    numbers, apart = dict(derivation.numbers), not grads_in_buckets(regime)
    try:
        if hasattr(step, "steady_at"):  # a built graph's step (passes/graph_step.py)
            tl, values = step.steady_at(numbers)
            values = {**values, **numbers}
            side = held(tl, values, _buckets(tl, apart))
            states = _states(derivation, step, int(world), values)
        elif getattr(step, "engine", None) is not None and hasattr(step, "_at"):  # a traced module's
            side, states = _traced(derivation, step, int(world), numbers, apart)
        else:
            return None
    except SymmemError:  # no step at these numbers (the peak's views say why): nothing per rank to add
        return None
    found = {}
    for rank in range(int(world)):
        one = dict(side if not isinstance(side, list) else side[rank])
        if states is not None:
            one["optimizer_state"] = states[rank]
            one["total"] = sum(one[k] for k in KEYS[:-1])
        found[rank] = one
    return found


def _tensor_mesh(derivation: Any, step: Any) -> dict[int, dict[str, int]]:
    """Every rank of an N x t mesh under FSDP2 or FSDP1 over tensor parallelism, rank ``r`` at mesh coordinates
    ``(r // t, r % t)``: the parts the step's peak holds at rest (:meth:`~.fsdp_tensor.MeshStep.rank_parts`, FSDP1's
    :func:`~.fsdp1_tensor.mesh1_rank`: the padded 2-D shards, their sharded gradients, AdamW's state of the rows a
    data-parallel rank holds) with the modules' buffers, whole on every rank
    (:meth:`~.fsdp_tensor.MeshStep.module_buffers`); the tensor-parallel ranks of a data-parallel rank alike, as the
    step has them; no DDP buckets."""
    from ..symbols import t

    numbers = derivation.numbers
    named = {s.name: int(v) for s, v in numbers.items()}
    subs = {s: sympy.Integer(v) for s, v in numbers.items()}
    width = int(numbers[t])

    def count(e: Any) -> int:
        return int(sympy.sympify(e, strict=True).xreplace(subs))

    buffers = count(step.module_buffers())
    out: dict[int, dict[str, int]] = {}
    for group in step.groups(dict(numbers)):  # data-parallel ranks holding the same rows: worked out once
        parts = step.rank_parts(group[0], named)
        one = {"parameters": count(parts.parameters) + buffers, "gradients": count(parts.gradients), "buckets": 0,
               "optimizer_state": count(parts.optimizer_state)}
        one["total"] = sum(one[k] for k in KEYS[:-1])
        out.update({dp * width + tp: one for dp in group for tp in range(width)})
    return dict(sorted(out.items()))


def _traced_tensor_mesh(derivation: Any, step: Any) -> dict[int, dict[str, int]]:
    """Every rank of an N x t mesh of a traced module under FSDP2 x TP, rank ``r`` at ``(r // t, r % t)``: what each
    data-parallel rank's step (its tensor-parallel record rewritten with FSDP2's events for its rows,
    :class:`~symmem.importer.traced_fsdp_tensor.FsdpTensorStepPeak`) holds just before its optimizer step; the
    tensor-parallel ranks of a data-parallel rank alike, as the step records one for them all; no DDP buckets."""
    from ..symbols import t

    numbers = derivation.numbers
    width = int(numbers[t])
    out: dict[int, dict[str, int]] = {}
    for group in step.groups(numbers):  # data-parallel ranks holding the same rows: worked out once
        one = step.at_rank(group[0])
        side = held(one._at(numbers)[0].as_timeline("steady"), one._values(numbers))
        out.update({dp * width + tp: side for dp in group for tp in range(width)})
    return dict(sorted(out.items()))


def _engine_on_stages(step: Any) -> bool:
    """Whether ``step`` is a pipeline step under a data-parallel engine: a built graph's or a traced module's
    (:mod:`symmem.importer.traced_ddp_pipeline`, :mod:`symmem.importer.traced_fsdp_pipeline`: subclasses)."""
    # by name: importing the two steps here would close an import cycle through the derivation
    kinds = {f"{__package__}.ddp_pipeline.DdpPipelineStep", f"{__package__}.fsdp_pipeline.FsdpPipelineStep"}
    return any(f"{c.__module__}.{c.__qualname__}" in kinds for c in type(step).__mro__)


def _pipeline_mesh(derivation: Any, step: Any) -> dict[int, dict[str, int]]:
    """Every rank of a p x N mesh of pipeline stages under DDP, ZeRO-1 or FSDP2, rank ``s*N + r`` stage ``s``'s
    data-parallel rank ``r``: what each stage's replay holds at rest (:mod:`.ddp_pipeline`'s whole weights, gradients
    and buckets, ZeRO-1's state of the parameters the rank owns; :mod:`.fsdp_pipeline`'s padded shards and AdamW's
    state of the unpadded rows) with the stage's module buffers (:attr:`.model_parallel.StageMemory.module_buffers`,
    not its receive buffers)."""
    from .data_parallel import alike_ranks

    numbers = derivation.numbers
    named = {s.name: int(v) for s, v in numbers.items()}
    world = int(numbers[N])
    subs = {s: sympy.Integer(v) for s, v in numbers.items()}
    # data-parallel ranks whose stages hold the same: ZeRO-1's by the parameters owned, FSDP2's by the rows held
    groups = step._alike(named) if hasattr(step, "_alike") else alike_ranks(step._firsts(derivation), world)
    # first, middle, last (the replays' own choice of them); a traced module's stages: None, its replays' parts
    # carry the module's buffers every stage holds (Llama's rotary frequencies; importer/traced_pipeline.py)
    memories = step._stages()
    out: dict[int, dict[str, int]] = {}
    for group in groups:
        replays = step.at_rank(group[0])._replays(named)
        for s, replay in enumerate(replays):
            memory = None if memories is None else step._stage_memory(s, len(replays))
            at = replay.at
            own = at.get("module_buffers", 0) if memories is None else \
                int(sympy.sympify(memory.module_buffers, strict=True).xreplace(subs))
            one = {"parameters": at["parameters"] + own, "gradients": at["gradients"],
                   # under the bucket view the buckets are the gradients (each .grad views them): once
                   "buckets": 0 if getattr(step, "view", False) else at.get("ddp_buckets", 0),
                   "optimizer_state": at["optimizer_state"]}
            one["total"] = sum(one[k] for k in KEYS[:-1])
            out.update({s * world + r: one for r in group})
    return dict(sorted(out.items()))


def _buckets(tl: Any, apart: bool) -> set[int]:
    """The storages of ``tl`` that are DDP's buckets (a built graph's one, a traced step's one per parameter),
    where they are listed apart from the gradients."""
    return {i for i, s in enumerate(tl.storages) if s.name == _BUCKETS or s.name.startswith(_BUCKETS + "[")} \
        if apart else set()


def _traced(derivation: Any, step: Any, world: int, numbers: Mapping[sympy.Symbol, Any], apart: bool
            ) -> tuple[Any, list[int] | None]:
    """A traced module's parameter side (every rank's, a list, under FSDP2), and ZeRO-1's state per rank."""
    def side_of(one: Any) -> dict[str, int]:
        rec = one._at(numbers)[0]
        tl = rec.as_timeline("steady")
        buckets = {i for i, s in enumerate(rec.storages) if s.where.startswith(_BUCKETS + "[")} if apart else set()
        return held(tl, one._values(numbers), buckets)

    if step.engine.kind in SHARDED:  # each distinct set of rows a rank holds, its step followed once
        firsts = [p.shape[0] for p in step.module.parameters() if p.dim()]
        out: list[Any] = [None] * world
        for group in alike_ranks(firsts, world):
            side = side_of(step.at_rank(group[0]))
            for rank in group:
                out[rank] = side
        return out, None
    states = zero_redundancy.state_per_rank(derivation) if step.engine.kind == zero_redundancy.ENGINE else None
    return side_of(step), states


def _states(derivation: Any, step: Any, world: int, values: Mapping[sympy.Symbol, Any]) -> list[int] | None:
    """Each rank's optimizer state in bytes where ranks differ (None: every rank holds the written-out step's)."""
    regime = derivation.regime
    if regime.data_parallel == zero_redundancy.ENGINE:  # the whole parameters each rank owns
        return zero_redundancy.state_per_rank(derivation)
    if regime.data_parallel not in SHARDED:
        return None  # DDP: whole parameters; FSDP1: one flat shard per unit, padding included, alike on all ranks
    # FSDP2: AdamW's state follows the unpadded rows a rank holds of each parameter (held_shape), as the step's is
    subs = {s: sympy.Integer(v) if isinstance(v, int) else v for s, v in values.items()}
    counts = {name: int(sympy.sympify(b.count, strict=True).xreplace(subs)) for name, b in step.graph.blocks.items()}
    graph = unroll(step.graph, counts) if counts else step.graph
    stored = stored_shapes(graph, program_parameters(graph))
    out = [0] * world
    for group in alike_ranks([derivation.evaluate(shape[0]) for shape in stored.values() if shape], world):
        found = sympy.Add(*(e for name, shape in stored.items()
                            for _, _, e, _, _ in state_storages(regime, name, held_shape(shape, N, group[0]), False)))
        for rank in group:  # ranks holding the same rows of every parameter: worked out once, however large N is
            out[rank] = int(sympy.sympify(found, strict=True).xreplace(subs))
    return out


def held(tl: Any, values: Mapping[sympy.Symbol, Any], buckets: Collection[int] = ()) -> dict[str, int]:
    """The parameter side a :class:`~symmem.timeline.Timeline` holds just before its optimizer step, at
    ``values`` (``buckets``: the storages listed as DDP's buckets, apart from the gradients).

    >>> from symmem.timeline import Event, Live, Timeline
    >>> tl = Timeline((Live("w", "parameter", sympy.Integer(40)), Live("ddp.buckets", "gradient", sympy.Integer(40)),
    ...                Live("w.grad", "gradient", sympy.Integer(40)), Live("w.exp_avg", "optimizer_state",
    ...                sympy.Integer(40))), (0, 1, 3), (Event("backward", "fc", (2,), ()), Event("step", "w", (), ())))
    >>> held(tl, {}, buckets={1})
    {'parameters': 40, 'gradients': 40, 'buckets': 40, 'optimizer_state': 40, 'total': 160}
    """
    live = set(tl.start)
    for e in tl.events:
        if e.phase in ("step", "zero_grad"):
            break
        live |= set(e.born)
        live -= set(e.freed)
    subs = {s: sympy.Integer(v) if isinstance(v, int) else v for s, v in values.items()}
    out = dict.fromkeys(KEYS, 0)
    for i in live:
        s = tl.storages[i]
        key = {"parameter": "parameters", "gradient": "gradients", "optimizer_state": "optimizer_state"}.get(
            s.category)
        if key is None:
            continue
        key = "buckets" if i in buckets else key
        out[key] += int(sympy.sympify(s.nbytes, strict=True).xreplace(subs))
    out["total"] = sum(out[k] for k in KEYS[:-1])
    return out
