"""FSDP x TP x pipeline: torchtitan's 3-D mesh, per stage and rank.

The engine is torchtitan's 3-D recipe (:mod:`symmem.record.tensor_pipeline_runs` with a case's ``data_parallel``):
``init_device_mesh(device, (p, N, t), mesh_dim_names=("pp", "dp", "tp"))`` (torchtitan's order: ``pp`` outermost,
``tp`` innermost), each stage's module (the embedding on the first stage, the final norm and the head on the last,
``L/p`` layers each) ``parallelize_module``'d over ``mesh["tp"]`` with the standard Llama plan, then
``fully_shard`` on each of its layers and on the stage root over ``mesh["dp"]``, then ``PipelineStage`` and
``ScheduleGPipe`` / ``Schedule1F1B`` run ``M`` micro-batches.  It composes the two 2-D meshes already modelled:

* the stage's replay at one tensor-parallel rank's sizes, with what DTensor's collectives add around their ops
  (:class:`~symmem.passes.tensor_pipeline._TensorReplay`);
* FSDP2's events of the stage's units over the data-parallel group (:class:`~symmem.passes.fsdp_pipeline.
  _FsdpReplay`: the all-gathers, the prefetch, the unsharded parameters, the reduce-scatters after the last
  backward), each unit's buffers at the 2-D shards' sizes: the tensor-parallel shard of a parameter
  (:func:`~symmem.passes.fsdp_tensor.tp_shape`), its first dimension padded to a multiple of ``N`` and split;
* between steps the 2-D shards, AdamW's state of the *unpadded* rows a rank holds and a 4-byte ``step`` each.

Rank ``s*N*t + d*t + r`` is stage ``s``'s data-parallel rank ``d`` and tensor-parallel rank ``r`` (the mesh's
row-major order, as the real run's); the tensor-parallel ranks of a stage and data-parallel rank are alike, and
data-parallel rank 0 holds whole shards (the largest).

>>> from symmem import derive
>>> d = derive("llama", data_parallel="fsdp", tensor_parallel=True, pipeline_parallel=True, micro_batches=2,
...            loss="cross-entropy", attention="sdpa", device="cpu",
...            values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64, "p": 2, "N": 2, "t": 2})
>>> d.value("peak")  # gloo's on a 2 x 2 x 2 mesh, docs/regimes.md
206408
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..shapes import numel
from ..training import Regime
from .fsdp_pipeline import FsdpPipelineStep, _FsdpReplay, _Param, _Units, owners, stage_at
from .model_parallel import _integer, memory_of
from .pipeline_step import StageMoment
from .tensor_pipeline import TensorPipelineStep, _TensorCut, _TensorReplay
from .unroll import iteration


def refusal(model_name: str, regime: Regime, loss: str | None, device: str = "cpu") -> str | None:
    """Why the FSDP x TP x pipeline peak is not modelled for this derivation (None: it is): what either 2-D mesh
    refuses (:func:`symmem.passes.tensor_pipeline.refusal`, :func:`symmem.passes.fsdp_pipeline.refusal`)."""
    from .fsdp_pipeline import refusal as fsdp_refusal
    from .tensor_pipeline import refusal as tensor_refusal

    flat = dataclasses.replace(regime, data_parallel=None)
    why = tensor_refusal(model_name, flat, loss, device) or fsdp_refusal(model_name, regime, device)
    return why.replace("tensor x pipeline peak", "FSDP x TP x pipeline peak") if why else None


class _MeshUnits(_Units):
    """FSDP2's units of one stage (:class:`~symmem.passes.fsdp_pipeline._Units`), each parameter at its
    tensor-parallel rank's shape before FSDP pads and splits its first dimension."""

    def __init__(self, cut: _TensorCut, s: int, world: int, rank: int) -> None:
        from .data_parallel import held_shape, shard_rows, stored_shapes
        from .parameters import in_registration_order, program_parameters

        g = cut.g
        key = ("stored", cut.per * cut.p)
        if key not in cut.memo:
            cut.memo[key] = stored_shapes(g, in_registration_order(g, program_parameters(g)))
        self.params: list[_Param] = []
        # each dimension at the cut's numbers once, and told to the cut (``dims``: the batches that give them the
        # same values share the units, FsdpPipelineStep._batch_moments)
        sized: dict[Any, int] = cut.__dict__.setdefault("dims", {})
        # each parameter's shape on the rank, by its stored shape and split, once for every stage, batch and rank
        shapes = cut.memo.setdefault(("tp shapes", key), {})
        for name, shape, owner, at in owners(cut, key):
            if at != s:
                continue
            split = (id(shape), owner in cut.sizes.row)
            local = shapes.get(split)
            if local is None:
                local = shapes[split] = (_tp_shape(cut, owner, shape), shape)  # (the shape kept: its id its own)
            dims = tuple([sized[d] if d in sized else sized.setdefault(d, _integer(d, cut.subs, name))
                          for d in local[0]])
            rows = shard_rows(dims, world) if dims else 1
            shard = int(rows) * int(numel(dims[1:])) if dims else 1
            held = tuple(int(x) for x in held_shape(dims, world, rank))
            self.params.append(_Param(name, iteration(owner) or None, shard, held, f"{name}.grad"))
        self._arrange(world)


def _tp_shape(cut: _TensorCut, owner: str, shape: tuple[Any, ...]) -> tuple[Any, ...]:
    """A parameter's shape on one tensor-parallel rank (:func:`~symmem.passes.fsdp_tensor.tp_shape`'s rule, the
    unrolled graph's linears told apart by the cut's row-parallel set: its layers have no block)."""
    from ..symbols import t

    if len(shape) < 2:
        return tuple(shape)  # the norms: replicated
    if owner in cut.sizes.row:  # RowwiseParallel's linears: Shard(1)
        return (shape[0], shape[1] / t, *shape[2:])
    return (shape[0] / t, *shape[1:])  # the embedding, ColwiseParallel's weights: Shard(0)


def mesh_acting(replay: Any, hooks: type, moments: type, pass_: int, kind: str) -> Any:
    """The ops where a 3-D mesh's replay calls its hooks: FSDP's hooks' ops and the collectives' (each acts at its own,
    the other's are no-ops there) -- where its ``before`` and ``after`` are ``hooks``'s, its ``moment`` is
    ``moments``'s and it is pure; None (every op hooked) where a subclass or a traced module's replay says otherwise."""
    cls = type(replay)
    if cls.before is not hooks.before or cls.moment is not moments.moment or cls.after is not hooks.after \
            or not replay._pure:
        return None
    return replay._fsdp_acting(pass_, kind) | replay._tensor_acting(pass_, kind)


class _MeshReplay(_TensorReplay, _FsdpReplay):
    """One stage's replay on one rank of the 3-D mesh: FSDP2's units around the ops (their hooks first: a unit's
    pre-forward all-gathers before its first op runs), DTensor's collectives inside them."""

    def __init__(self, cut: _TensorCut, s: int, at: Mapping[str, int], schedule: str, m: int, units: _Units,
                 reshard: bool) -> None:
        _FsdpReplay.__init__(self, cut, s, at, schedule, m, units, reshard)
        # what _TensorReplay.__init__ sets (its super().__init__ is _FsdpReplay's here, with more arguments)
        self.tcut, self.extra, self.pass_ = cut, 0, 0
        self._extras = cut.collectives()
        self.head_backward, self.mode, self.accumulated = False, "", 0
        self.fix = None

    # FSDP's units carry from one segment to the next, DTensor's collectives do not
    _hook_state = _FsdpReplay._hook_state
    _hook_mark = _FsdpReplay._hook_mark
    _hook_effect = _FsdpReplay._hook_effect
    _hook_redo = _FsdpReplay._hook_redo

    def begin(self, kind: str, mb: int) -> None:
        _FsdpReplay.begin(self, kind, mb)
        _TensorReplay.begin(self, kind, mb)

    def _acting(self, pass_: int, kind: str) -> Any:
        return mesh_acting(self, _MeshReplay, _TensorReplay, pass_, kind)

    def before(self, kind: str, node: str | None, mb: int) -> None:
        _FsdpReplay.before(self, kind, node, mb)
        _TensorReplay.before(self, kind, node, mb)

    def after(self, kind: str, node: str | None, mb: int) -> None:
        _TensorReplay.after(self, kind, node, mb)
        _FsdpReplay.after(self, kind, node, mb)

    def finish(self) -> None:
        _FsdpReplay.finish(self)


@dataclass(frozen=True)
class Mesh3dStageMoment(StageMoment):
    """A moment of one stage's step on the p x N x t mesh: its data-parallel rank 0 (whole shards), every
    tensor-parallel rank alike; the first is rank ``s*N*t``."""

    world: int = 1
    ranks: int = 1

    @property
    def rank(self) -> int:
        return self.stage * self.world * self.ranks

    def where(self, step: bool = True) -> str:
        head = f"stage {self.stage} of {self.stages}"
        return super().where(step).replace(head, f"rank {self.rank} (stage {self.stage} of {self.stages}, "
                                                 f"data-parallel rank 0 of N = {self.world}, the t = {self.ranks} "
                                                 "tensor-parallel ranks alike)", 1)


@dataclass(eq=False)
class FsdpTensorPipelineStep(FsdpPipelineStep):
    """:class:`~symmem.passes.fsdp_pipeline.FsdpPipelineStep` on the p x N x t mesh (the module's note): each
    stage's replay is :class:`_MeshReplay` of data-parallel rank ``rank`` at one tensor-parallel rank's sizes (with
    sequence parallelism: :class:`~symmem.passes.sequence_pipeline.FsdpSequencePipelineStep`, its hooks' own)."""

    # the replay, the packed cut, the cut and the stage's parts: a subclass's (sequence parallelism) may differ
    def _replay_class(self) -> type[_MeshReplay]:
        return _MeshReplay

    _packing = TensorPipelineStep._packing
    _make_cut = TensorPipelineStep._make_cut

    # FsdpPipelineStep's replays (one loop, packed or not) on the tensor-parallel rank's cut
    def _checked_cut(self, numbers: Mapping[str, int]) -> tuple[int, Any]:
        world = self._world(numbers)
        return world, TensorPipelineStep._cut(self, numbers)  # type: ignore[arg-type]  # the same checks and sizes

    def _batch_cuts(self, numbers: list[dict[str, int]]) -> tuple[int, list[Any] | None]:
        world = self._world(numbers[0])
        return world, [TensorPipelineStep._cut(self, n) for n in numbers]  # type: ignore[arg-type]

    def _units(self, cut: Any, s: int, world: int) -> _Units:
        return _MeshUnits(cut, s, world, self.rank)

    def _replay(self, cut: Any, s: int, at: Mapping[str, int], units: _Units) -> Any:
        return self._replay_class()(cut, s, at, self.schedule, self.micro_batches, units, self.reshard)

    def _packed(self, packed: Any, cuts: list[Any]) -> Any:
        """The rank's sizes and the collectives' bytes packed
        (:class:`~symmem.passes.tensor_pipeline._TensorPackedCut`, or the subclass's :meth:`_packing`): one for
        every stage of the packed cut, as the tensor x pipeline step's (its sizes and collectives packed once, not
        once a stage: a sixth of the stages' making)."""
        found = packed.__dict__.get("_mesh_packed")
        if found is None or found[0] is not cuts:
            found = packed.__dict__["_mesh_packed"] = (cuts, self._packing()(packed, cuts))
        return found[1]

    def _formula_extra(self, named: Mapping[str, int]) -> Any:
        """FSDP's storages at the 2-D shards' sizes around the tensor-parallel rank's, as formulas in ``N``, ``t``
        and the sizes (:class:`~symmem.passes.mesh_formula.MeshFormulas`)."""
        if type(self) is not FsdpTensorPipelineStep or getattr(self.regime, "sequence_parallel", False):
            return None  # sequence parallelism on stages: its formulas not checked at other sizes (lines in B)
        from .mesh_formula import Kit, MeshFormulas
        from .tensor_pipeline import _TensorPackedCut

        def cut(numbers: Mapping[str, int]) -> Any:
            return TensorPipelineStep._cut(self, numbers)  # type: ignore[arg-type]  # the same checks and sizes

        return {"engine": MeshFormulas(self, named, Kit(_MeshReplay, stage_at, units=_MeshUnits,
                                                        packed=_TensorPackedCut, cut=cut, tp_shape=_tp_shape))}

    def _peak(self, named: dict[str, int]) -> Any:
        return self._meshed(super()._peak(named), named)

    def _meshed(self, found: Any, named: Mapping[str, int]) -> Any:
        """The stages' peak ``found`` with each moment a rank's of the p x N x t mesh."""
        from ..peak import Peak

        world, t = int(named["N"]), int(named["t"])
        moments = tuple(Mesh3dStageMoment(**{f.name: getattr(m, f.name) for f in dataclasses.fields(StageMoment)},
                                          world=world, ranks=t) for m in found.moments)
        return Peak(None, None, moments, found.domain)

    def _firsts(self, derivation: Any) -> list[Any]:
        """Every parameter's first dimension on a tensor-parallel rank (which rows each data-parallel rank holds)."""
        from .data_parallel import _stored
        from .fsdp_tensor import tp_shape

        g = self.graph
        out = []
        for name, shape in _stored(g).items():
            owner = name if name in g and g.node(name).kind == "parameter" else name.rsplit(".", 1)[0]
            if shape:
                out.append(derivation.evaluate(tp_shape(g, owner, shape)[0]))
        return out

    def rank_peaks(self, derivation: Any) -> dict[int, tuple[int, int]]:
        """``{rank: (first-step peak, steady peak)}`` of every rank of the p x N x t mesh (rank ``s*N*t + d*t +
        r``: stage ``s``, data-parallel rank ``d``, tensor-parallel rank ``r``)."""
        from ..symbols import N, t
        from .data_parallel import alike_ranks

        numbers = derivation.numbers
        world, ranks = int(numbers[N]), int(numbers[t])
        out: dict[int, tuple[int, int]] = {}
        for group in alike_ranks(self._firsts(derivation), world):
            each = self.at_rank(group[0]).per_stage(numbers)
            for s, pair in enumerate(zip(each["peak_first_step_per_stage"], each["peak_per_stage"], strict=True)):
                out.update({(s * world + d) * ranks + r: pair for d in group for r in range(ranks)})
        return dict(sorted(out.items()))

    def rank_sides(self, derivation: Any) -> dict[int, dict[str, int]]:
        """Every rank's parameter side (:func:`symmem.passes.rank_side.parameter_side_per_rank`'s keys): the 2-D
        shards and the stage module's own buffers, the sharded gradients, no buckets, AdamW's state of the
        unpadded rows with a 4-byte ``step`` each; rank ``s*N*t + d*t + r``."""
        from ..symbols import N, t
        from .data_parallel import alike_ranks

        named = {s.name: int(v) for s, v in derivation.numbers.items()}
        world, ranks = int(derivation.numbers[N]), int(derivation.numbers[t])
        found = self._stages()
        out: dict[int, dict[str, int]] = {}
        for group in alike_ranks(self._firsts(derivation), world):
            replays = self.at_rank(group[0])._replays(named)
            for s, replay in enumerate(replays):
                own = memory_of(found, s, len(replays)).at(named, ("module_buffers",))["module_buffers"]
                one = {"parameters": replay.at["parameters"] + own, "gradients": replay.at["gradients"],
                       "buckets": 0, "optimizer_state": replay.at["optimizer_state"]}
                one["total"] = sum(one.values())
                out.update({(s * world + d) * ranks + r: one for d in group for r in range(ranks)})
        return dict(sorted(out.items()))

