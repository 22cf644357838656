"""DDP x pipeline: ``DistributedDataParallel`` around every pipeline stage of a p x N mesh (with
``ZeroRedundancyOptimizer`` over the data-parallel group: ZeRO-1), per stage and rank.

The engine (:mod:`symmem.record.ddp_pipeline_runs`): ``init_device_mesh(device, (p, N), mesh_dim_names=("pp",
"dp"))``, each stage's module (the embedding on the first stage, the final norm and the head on the last, ``L/p``
layers each) wrapped in ``DistributedDataParallel`` over ``mesh["dp"]``, then ``PipelineStage`` and
``ScheduleGPipe`` / ``Schedule1F1B`` run ``M`` micro-batches.  What torch 2.13 does
(``PipelineStage.backward_maybe_with_nosync``): every micro-batch's backward but the last runs under
``no_sync()``, so the gradients accumulate in ``.grad`` as one device's do; the last one's reducer is prepared by
hand and all-reduces each bucket in place, copying the gradients in and the result back, allocating nothing.  So a
stage's step is the pipeline's replay (:class:`~symmem.passes.model_parallel._Replay`, the single-device step cut
by stage) with DDP's gradient buckets (:func:`symmem.passes.data_parallel.buckets`: the stage's gradients' bytes,
made when the stage is wrapped) alive the whole step -- measured to the byte on every rank of a 2 x 2 gloo mesh,
1F1B and GPipe (``tests/test_ddp_pipeline.py``).  The second step's rebuild of the buckets frees the old ones
before it makes the new (as DDP alone).  Every data-parallel rank of a stage holds the same bytes: rank ``s*N + r``
is stage ``s``'s.

With ``zero-redundancy`` each stage's optimizer is ``ZeroRedundancyOptimizer`` over ``mesh["dp"]``: the stage's
whole parameters partitioned as ZeRO-1 alone partitions a model's
(:func:`~symmem.passes.zero_redundancy.partition`), so a rank's AdamW state and its step's temporaries (for-loop on
the CPU, foreach on CUDA: its local AdamW is built with the defaults) are those of the parameters it owns, and the
ranks of a stage differ (the largest need not be data-parallel rank 0).

With ``gradient_as_bucket_view=True`` (``ddp-bucket-view``) the buckets are alive the whole step as above (made when
the stage was wrapped; ``zero_grad(set_to_none=True)`` drops the views, not the buckets), and the ``no_sync``
micro-batches accumulate into ``.grad``s of their own as one device's do, so every moment before the last
micro-batch's backward is DDP's.  In that backward the reducer copies each parameter's gradient, once accumulated,
into its bucket and makes the ``.grad`` a view of it, freeing the gradient (:class:`_ViewReplay`); in the optimizer
step the gradients *are* the buckets, so the step's moment is the pipeline alone's.  Measured to the byte on every
rank of the 2 x 2 gloo mesh (``tests/test_ddp_pipeline.py``; more rows by hand in docs/regimes.md).

>>> from symmem import derive
>>> d = derive("llama", data_parallel="ddp", pipeline_parallel=True, pipeline_schedule="gpipe", micro_batches=2,
...            loss="cross-entropy", attention="sdpa", device="cpu",
...            values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 63, "F": 64, "p": 2, "N": 2})
>>> d.value("peak"), d.value("peak_first_step")  # the engine's, tests/test_ddp_pipeline.py
(398428, 307760)
>>> d.peak_at().where(step=False)
'rank 2 (stage 1 of 2, data-parallel rank 0 of N = 2): pipeline layers.mlp.gate_up (layer 2), micro-batch 0'
>>> z = derive("llama", data_parallel="zero-redundancy", pipeline_parallel=True, pipeline_schedule="gpipe",
...            micro_batches=2, loss="cross-entropy", attention="sdpa", device="cpu",
...            values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 63, "F": 64, "p": 2, "N": 2})
>>> {r: steady for r, (first, steady) in z.step.rank_peaks(z).items()}  # the engine's, rank by rank
{0: 320052, 1: 319796, 2: 353092, 3: 353096}
>>> z.peak_at().where(step=False)
'rank 3 (stage 1 of 2, data-parallel rank 1 of N = 2): pipeline layers.mlp.gate_up (layer 2), micro-batch 0'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError
from ..training import Regime
from .fsdp_pipeline import MeshStageMoment
from .model_parallel import _integer, _Replay, memory_of
from .pipeline_step import PipelineStep


@dataclass(frozen=True)
class RankStageMoment(MeshStageMoment):
    """A moment of data-parallel rank ``dp`` of one stage (ZeroRedundancyOptimizer: a stage's ranks differ)."""

    dp: int = 0

    @property
    def rank(self) -> int:
        return self.stage * self.world + self.dp

    def where(self, step: bool = True) -> str:
        text = super().where(step)
        return text.replace(f"rank {self.stage * self.world} (stage", f"rank {self.rank} (stage", 1).replace(
            "data-parallel rank 0 of", f"data-parallel rank {self.dp} of", 1)


@dataclass(eq=False)
class DdpPipelineStep(PipelineStep):
    """:class:`~symmem.passes.pipeline_step.PipelineStep` with DDP on every stage (the module's note): each stage's
    replay with its gradient buckets alive from before the step to its end; with ``zero`` (ZeroRedundancyOptimizer)
    data-parallel rank ``rank``'s optimizer state and step, of the whole parameters it owns."""

    zero: bool = False
    rank: int = 0
    view: bool = False  # gradient_as_bucket_view

    def _make_replays(self, numbers: Mapping[str, int]) -> list[Any]:
        from .model_parallel import requires

        requires(numbers.get("p"), numbers.get("L"), self.schedule, self.micro_batches)
        world = self._world(numbers)
        cut, whole = self._cut(numbers)
        found = self._stages()
        return [(_ViewReplay if self.view else _Replay)(
            cut, s, self._at(memory_of(found, s, cut.p).at(numbers, _PARTS), whole[s] if self.zero else [], world),
            self.schedule, self.micro_batches) for s in range(cut.p)]

    def _formula_extra(self, named: Mapping[str, int]) -> Any:
        """DDP's buckets (the stage's gradients' bytes, alive the whole step; under the bucket view the step's
        gradients are the buckets) beside the stage's replay: its moments as formulas (:mod:`.pipeline_formula`).
        Under ZeRO-1 the rank's own state and step temporaries are the partition's at these numbers (whole
        parameters: the partition moves with the sizes), in place of the stage's."""
        if type(self) is not DdpPipelineStep:
            return None

        def buckets(memory: Any, s: int) -> Any:
            return memory.gradients

        if self.view:
            return {"extra": buckets, "replay": _ViewReplay}
        if not self.zero:
            return {"extra": buckets, "step_extra": buckets}
        import sympy

        mine: dict[int, dict[str, int]] = {}

        def owned(s: int) -> dict[str, int]:
            if s not in mine:  # a sympy sum per parameter: once a stage
                mine[s] = self._owned(self._cut(named)[1][s], self._world(named), self.rank)
            return mine[s]

        def rest(memory: Any, s: int) -> Any:
            return memory.gradients - memory.optimizer_state + sympy.Integer(owned(s)["optimizer_state"])

        def step(memory: Any, s: int) -> Any:
            mine = owned(s)
            return (memory.gradients - memory.optimizer_state - memory.step_temporaries
                    + sympy.Integer(mine["optimizer_state"] + mine["step_temporaries"]))

        def state(memory: Any, s: int) -> Any:
            return sympy.Integer(owned(s)["optimizer_state"])

        return {"extra": rest, "step_extra": step, "state": state,
                "said": "ZeroRedundancyOptimizer's partition at these sizes"}

    def _world(self, numbers: Mapping[str, int]) -> int:
        world = numbers.get("N")
        if not isinstance(world, int) or world < 1:
            raise SymmemError(f"DDP x pipeline needs N >= 1 data-parallel ranks a stage, got N={world}")
        return world

    def _at(self, parts: Mapping[str, int], params: list[tuple[int, ...]], world: int) -> dict[str, int]:
        """A stage's ``parts`` (:data:`_PARTS`) with DDP's buckets (and ZeRO-1's state of the stage's ``params`` it
        owns: :func:`_whole`) on this rank."""
        at = dict(parts)
        # DDP's buckets: every trainable parameter's gradient once, in FP32 the stage's gradients' bytes
        at["ddp_buckets"] = at["gradients"]
        if self.zero:
            at.update(self._owned(params, world, self.rank))
            at["at_rest"] = sum(at[k] for k in ("parameters", "optimizer_state", "buffers", "inputs", "outputs"))
            at["step_peak"] = at["at_rest"] + at["gradients"] + at["step_temporaries"]
        at["at_rest"] += at["ddp_buckets"]
        if not self.view:  # under the bucket view the step's gradients are the buckets
            at["step_peak"] += at["ddp_buckets"]
        return at

    def _batch_moments(self, named: Mapping[str, int], b: int) -> Any:
        """Every stage's moments and parts at ``B = b, b + 1, b + 2`` from one replay
        (:func:`~symmem.passes.model_parallel.batch_moments`: the parts with the buckets and ZeRO-1's state
        packed); None where a subclass replays otherwise."""
        if type(self)._make_replays is not DdpPipelineStep._make_replays:
            return None
        from .model_parallel import batch_moments, pack_parts, requires
        from .pipeline_step import BATCH

        requires(named.get("p"), named.get("L"), self.schedule, self.micro_batches)
        world = self._world(named)
        numbers = [{**named, BATCH: b + k} for k in range(3)]
        found = self._stages()

        kept: list[Any] = []

        def make(packed: Any, cuts: Any, s: int) -> Any:
            parts = self._parts_each(memory_of(found, s, packed.p), numbers)
            ats = [self._at(at, self._wholes(c, n)[s] if self.zero else [], world)
                   for at, c, n in zip(parts, cuts, numbers, strict=True)]
            replay = (_ViewReplay if self.view else _Replay)(packed, s, pack_parts(ats), self.schedule,
                                                              self.micro_batches)
            kept.append((packed, pack_parts(parts), replay._events))  # for the formulas (the stage alone's parts)
            return replay, ats

        from .pipeline_formula import plans_key

        plans = plans_key(named, b)  # pipeline_formula reads them (every rank's alike)
        if not self.zero:
            out = batch_moments(self.graph, self.conv, self.options, self.regime, numbers, found,
                                schedule=self.schedule, micro_batches=self.micro_batches, memo=self._memo(),
                                make=make)
            if out is not None:
                self._memo()[plans] = kept
            return out
        # ZeRO-1's data-parallel ranks differ only in the state (and the step's temporaries) of the parameters each
        # owns, which lives the whole step: a rank's replay is the first replayed rank's, every moment of the
        # pipeline phase moved by the difference at rest, the optimizer step's its own (one replay a stage for all)
        memo = self._memo()
        key = ("zero-1 moments", tuple(sorted(named.items())), b, self.schedule, self.micro_batches)
        if key not in memo:
            memo[key] = batch_moments(self.graph, self.conv, self.options, self.regime, numbers, found,
                                      schedule=self.schedule, micro_batches=self.micro_batches, memo=memo, make=make)
            if memo[key] is not None:
                memo[plans] = kept
        base = memo[key]
        if base is None:
            return None
        out = []
        for s, (rows, ats) in enumerate(base):
            mine = [self._at(at, self._cut(n)[1][s], world)
                    for at, n in zip(self._parts_each(memory_of(found, s, len(base)), numbers), numbers, strict=True)]
            out.append((_Moved(rows, ats, mine, key), mine))
        return out

    def _stage_uppers(self, s: int, rows: Any, parts: Any, b: int) -> Any:
        """:meth:`PipelineStep._stage_uppers`; a ZeRO-1 rank's stage (:class:`_Moved`) from the replayed rank's lines:
        every moment of the pipeline phase moved by the same line (the difference at rest at the three batches) is
        a line moved by it, and which bound the others does not change (each moment gains the same at every B), so
        the replayed rank's lines of the pipeline phase that no other bounds, worked out once, are moved, then
        bounded with the rank's own optimizer step (a line bounded among some is bounded among more)."""
        from .pipeline_step import _upper, lines_of

        if not isinstance(rows, _Moved):
            return super()._stage_uppers(s, rows, parts, b)
        moved = [m["at_rest"] - a["at_rest"] for m, a in zip(rows.mine, rows.ats, strict=True)]
        step = [m["step_peak"] for m in rows.mine]
        if moved[2] - moved[1] != moved[1] - moved[0] or step[2] - step[1] != step[1] - step[0]:
            return super()._stage_uppers(s, rows.rows(), parts, b)  # not moved by a line: read one by one
        memo = self._memo()
        key = ("zero-1 lines", rows.key, s)
        if key not in memo:
            # the replayed rank's pipeline phase: every moment but the last, the optimizer step's (none is unless
            # it is the step's: then each rank's moments are moved one by one)
            schedule = [row[:-1] for row in rows.base]
            alike = all(row and row[-1][1] is None and row[-1][2] is None for row in rows.base) and not any(
                node is None and mb is None for _, node, mb in schedule[0])
            memo[key] = None
            if alike:
                lines, firsts = lines_of(s, schedule, b, rows.ats[0]["optimizer_state"])
                memo[key] = (_upper(lines), _upper(firsts))
        if memo[key] is None:
            return super()._stage_uppers(s, rows.rows(), parts, b)  # the rank's moments, read one by one
        steady, first = memo[key]
        dc = moved[1] - moved[0]
        da = moved[0] - b * dc
        c = step[1] - step[0]
        at_step = (step[0] - b * c, c, True)
        # the first step's pipeline lines lack the rank's own state (the replayed rank's lacked its)
        df = da - parts[0]["optimizer_state"] + rows.ats[0]["optimizer_state"]
        out = []
        for upper, shift in ((steady, da), (first, df)):
            lines = {(a + shift, c + dc, False): where for (a, c, _), where in upper.items()}
            lines.setdefault(at_step, (None, None))
            out.append(_upper(lines))
        return out[0], out[1]

    def _cut(self, numbers: Mapping[str, int]) -> Any:
        """The single-device step cut by stage at ``numbers``, shared by every data-parallel rank's step."""
        from .model_parallel import _Cut

        cuts = self._cache.setdefault("cuts", {})
        key = tuple(sorted(numbers.items()))
        if key not in cuts:
            if len(cuts) > 8:
                cuts.clear()
            cut = _Cut(self.graph, self.conv, self.options, self.regime, numbers, self._memo())
            cuts[key] = (cut, self._wholes(cut, numbers) if self.zero else [])
        return cuts[key]

    def _wholes(self, cut: Any, numbers: Mapping[str, int]) -> list[list[tuple[int, ...]]]:
        """Every stage's :func:`_whole` at ``cut``, shared by the numbers that give the parameters' dimensions the
        same values (the peak's three batches: no parameter's shape is in ``B``): the stages' parameters are those
        of the graph at ``L`` layers cut into ``p`` stages, sized at the numbers (the dimensions the units sized,
        ``cut.dims``)."""
        memo = self._memo()
        names = memo.get(("whole symbols", cut.layers, cut.p))
        if names is not None:
            found = memo.get(("whole", cut.layers, cut.p, tuple((n, numbers.get(n)) for n in names)))
            if found is not None:
                return found
        found = _stage_wholes(cut)
        names = tuple(sorted({str(x) for d in cut.__dict__.get("dims", {}) for x in getattr(d, "free_symbols", ())}))
        memo[("whole symbols", cut.layers, cut.p)] = names
        memo[("whole", cut.layers, cut.p, tuple((n, numbers.get(n)) for n in names))] = found
        return found

    def _owned(self, params: list[tuple[int, ...]], world: int, rank: int) -> dict[str, int]:
        """:func:`_owned` of ``rank``, every rank's worked out at once for each stage's parameters and world (every
        rank group and batch asks; the partition is every rank's)."""
        from .schedule import optimizer_impl

        impl = optimizer_impl(self.regime, str(self.options.get("device", "cpu")))
        key = ("owned", tuple(params), world, impl)
        memo = self._memo()
        if key not in memo:
            # each shape's state once for every stage (their layers list the same few shapes)
            memo[key] = _owned_each(params, world, self.regime, impl, memo.setdefault(("zero-1 state",), {}))
        return dict(memo[key][rank])

    def _parts_each(self, stage: Any, numbers: list[dict[str, int]]) -> list[dict[str, int]]:
        """``stage.at_each(numbers, _PARTS)``, once for each stage memory and numbers (ZeRO-1's rank groups each
        ask for every stage's); a copy, for the caller to change."""
        key = ("parts each", stage.name, tuple(tuple(sorted(n.items())) for n in numbers))
        cache = self._cache.setdefault("parts each", {})
        if key not in cache or cache[key][0] is not stage:
            cache[key] = (stage, stage.at_each(numbers, _PARTS))
        return [dict(x) for x in cache[key][1]]

    def _peak(self, named: dict[str, int]) -> Any:
        from ..peak import Peak

        world = int(named["N"])
        moments: list[Any] = []
        for group in self._alike(named):
            found = (self if group[0] == self.rank else self.at_rank(group[0]))._rank_peak(named)
            moments += [RankStageMoment(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)}, world=world,
                                        dp=group[0]) for m in found.moments]
        return Peak(None, None, tuple(moments), self._rank_peak(named).domain)

    def _rank_peak(self, named: dict[str, int]) -> Any:
        key = ("rank peak", tuple(sorted(named.items())))
        if key not in self._cache:
            self._cache[key] = PipelineStep._peak(self, named)
        return self._cache[key]

    def _alike(self, named: Mapping[str, int]) -> list[list[int]]:
        """The data-parallel ranks grouped by what their stages hold (DDP: all alike; ZeRO-1: by the owned
        parameters' state and step temporaries, all a replay depends on)."""
        world = int(named["N"])
        if not self.zero:
            return [list(range(world))]
        _, whole = self._cut(named)
        groups: dict[Any, list[int]] = {}
        for r in range(world):
            held = tuple(tuple(sorted(self._owned(params, world, r).items())) for params in whole)
            groups.setdefault(held, []).append(r)
        return list(groups.values())

    def at_rank(self, rank: int) -> DdpPipelineStep:
        """The step of data-parallel rank ``rank`` of every stage (kept: the views ask for each rank again)."""
        if rank == self.rank:
            return self
        key = ("rank", rank)
        if key not in self._cache:
            self._cache[key] = dataclasses.replace(self, rank=rank, _cache={
                "stages": self._stages(), "cuts": self._cache.setdefault("cuts", {}), "memo": self._memo(),
                "parts each": self._cache.setdefault("parts each", {})})
        return self._cache[key]

    def per_stage(self, numbers: Any) -> dict[str, Any]:
        """:meth:`PipelineStep.per_stage` with each stage's largest data-parallel rank (ZeRO-1's ranks differ)."""
        named = self._named(numbers)
        each = [PipelineStep.per_stage(self.at_rank(g[0]), numbers) for g in self._alike(named)]
        out = dict(each[0])
        for key in ("peak_per_stage", "peak_first_step_per_stage"):
            out[key] = [max(e[key][s] for e in each) for s in range(len(out[key]))]
        top = max(each, key=lambda e: max(e["peak_per_stage"]))
        out.update(peak_stage=top["peak_stage"], peak_where=top["peak_where"])
        return out

    def rank_peaks(self, derivation: Any) -> dict[int, tuple[int, int]] | None:
        """``{rank: (first-step peak, steady peak)}`` of every rank of the p x N mesh (rank ``s*N + r``: stage
        ``s``, data-parallel rank ``r``); None where every rank is alike."""
        named = self._named(derivation.numbers)
        world = named["N"]
        out: dict[int, tuple[int, int]] = {}
        for group in self._alike(named):
            each = PipelineStep.per_stage(self.at_rank(group[0]), derivation.numbers)
            for s, pair in enumerate(zip(each["peak_first_step_per_stage"], each["peak_per_stage"], strict=True)):
                out.update({s * world + r: pair for r in group})
        out = dict(sorted(out.items()))
        return out if len(set(out.values())) > 1 else None


@dataclass(frozen=True, eq=False)
class _Moved:
    """A ZeRO-1 rank's moments of one stage at the three batches: the replayed rank's (``base``, its parts ``ats``)
    with every moment of the pipeline phase moved by the difference at rest, the optimizer step's the rank's own
    (``mine``: its parts); ``key``: the replay's, in the step's memo."""

    base: Any
    ats: Any
    mine: Any
    key: Any

    def rows(self) -> list[list[tuple[int, str | None, int | None]]]:
        """The rank's moments, one by one."""
        return [[(self.mine[k]["step_peak"] if node is None and mb is None else
                  v + self.mine[k]["at_rest"] - self.ats[k]["at_rest"], node, mb) for v, node, mb in row]
                for k, row in enumerate(self.base)]


class _ViewReplay(_Replay):
    """A stage's replay under ``gradient_as_bucket_view``: in the last micro-batch's backward the reducer copies
    each parameter's gradient, once accumulated, into its bucket and makes the ``.grad`` a view of it, so the
    gradients that op made or the earlier micro-batches accumulated go after its op (the buckets stay)."""

    last: bool = False

    def segment(self, kind: str, mb: int) -> list[tuple[int, int]]:
        # the hooks act in the synced (last) micro-batch's backward only, walked op by op with them; around every
        # other segment they do nothing: the stage alone's walk, each way a segment begins walked once and its
        # record moved after (_Replay._repeated; the moments watched as they come: every op walked)
        if kind == "B" and mb == self.m - 1:
            return super().segment(kind, mb)
        self.last = False
        if type(self.moments) is list:
            return self._repeated(kind, mb, self._walked, ())
        return self._walked(kind, mb)

    def _hook_state(self, kind: str, mb: int) -> Any:
        # the synced backward, once a replay: recorded as any segment is, so that a packed replay keeps only its
        # moments that can bound a line (model_parallel.bounding), never moved (no other segment begins so)
        return ("synced",)

    def begin(self, kind: str, mb: int) -> None:
        self.last = kind == "B" and mb == self.m - 1  # backward_maybe_with_nosync syncs the last one only
        if self.last:
            # the gradients alive as it begins (every micro-batch's: they accumulate) and those its ops make, by
            # the op that made each: what after() frees at that op, found once rather than by reading every
            # storage alive at every op (three quarters of the bucket view's peak was that)
            touched = self._touched(0 if mb == 0 else 1, kind)
            made = self._gradients([key[1] for key in self.alive] + list(touched))
            self._mine: dict[str, list[tuple[int, int]]] = {}
            for key in [*self.alive, *((mb, sid) for sid in touched)]:
                node = made[key[1]]
                if node is not None:
                    self._mine.setdefault(node, []).append(key)

    def after(self, kind: str, node: str | None, mb: int) -> None:
        if not self.last or node is None:
            return
        for key in self._mine.get(node, ()):
            if key in self.alive:  # (made later in the backward, or freed already: not now)
                self.free(key)

    def _gradients(self, sids: list[int]) -> dict[int, str | None]:
        """The op that made each storage of ``sids`` that is a gradient (None: not one), kept on the cut (its
        stages ask alike): a layer's storage is its template's renamed, so the template says which are gradients
        and only those are written out."""
        known: dict[int, str | None] = self.cut.__dict__.setdefault("_gradient_of", {})
        new = [sid for sid in dict.fromkeys(sids) if sid not in known]
        if new:
            if self._layout() is None:
                found = [self.cut.tl.storages[sid] for sid in new]
            else:
                layout, storage = self.cut.layout, self.cut.storage
                found = [layout.tl.storages[layout.origin[sid]] for sid in new]
                found = [storage(sid) if st.category == "gradient" else st
                         for sid, st in zip(new, found, strict=True)]
            known.update({sid: st.node if st.category == "gradient" else None
                          for sid, st in zip(new, found, strict=True)})
        return known


def _whole(cut: Any, s: int) -> list[tuple[int, ...]]:
    """Stage ``s``'s parameters whole, as ``parameters()`` lists them (their shapes at the cut's numbers)."""
    return _stage_wholes(cut)[s]


def _stage_wholes(cut: Any) -> list[list[tuple[int, ...]]]:
    """Every stage's parameters whole, as its ``parameters()`` lists them (shapes at the cut's numbers): FSDP2's
    units' listing at one rank of one (:class:`~symmem.passes.fsdp_pipeline._Units`: the model's ``parameters()``
    at ``L`` layers, each on the stage that runs its owner, the last stage's own copy of a tied embedding after
    them), read without writing the graph out to ``L`` layers
    (:func:`~symmem.passes.zero_redundancy.listed_members`): the unrolled graph and the units' walk of every
    parameter for every stage were four fifths of ZeRO-1's cost above the pipeline's.  What a parameter's layers
    share (its owner's kind, its stored shape, its dimensions at the numbers) is worked out once for all of them."""
    from .data_parallel import stored_shapes
    from .zero_redundancy import listed_members

    graph = cut.graph
    # as _unrolled writes the graph at L layers: its first block, L times
    params = listed_members(graph, {next(iter(graph.blocks)): cut.layers})
    sized: dict[Any, int] = cut.__dict__.setdefault("dims", {})  # each dimension at the numbers once (as _Units)
    alike: dict[tuple[str, str, bool], tuple[bool, tuple[int, ...]]] = {}
    last = cut.p - 1

    def held(shape: tuple[Any, ...], name: str) -> tuple[int, ...]:
        for d in shape:
            if d not in sized:
                sized[d] = _integer(d, cut.subs, name)
        return tuple(sized[d] for d in shape)

    out: list[list[tuple[int, ...]]] = [[] for _ in range(cut.p)]
    tied, copied = None, False
    heads = [n for n in graph.program_order() if graph.node(n).kind == "linear" and graph.node(n).attrs.get("tied")]
    if heads:  # the last stage's own copy of a tied embedding (nn.Linear: (V, H)), as _Units adds it
        node = graph.node(heads[0])
        tied = (f"{heads[0]}.weight", (node.attrs["out_features"], graph.node(node.inputs[0]).out.shape[-1]))
    for name, (shape, m, k, rest) in params:
        key = (m, rest, k == 0)
        if key not in alike:
            # the unrolled graph's node ``m#k`` is ``m``'s kind: a parameter node's own name is the parameter's, an
            # op's parameter is ``<op>.<param>``; the stored shape as data_parallel.stored_shapes reads it there
            # (a parameter node's own name in a layer ends in ``#k``, never in ``.weight``: not transposed)
            own = name in graph and graph.node(name).kind == "parameter" if not k else (
                not rest and graph.node(m).kind == "parameter")
            kept = stored_shapes(graph, [(name, shape)])[name] if not k else (
                stored_shapes(graph, [(m + rest, shape)])[m + rest] if rest else shape)
            alike[key] = (own, held(kept, name))
        own, dims = alike[key]
        s = cut.stage_of(name if own else name.rsplit(".", 1)[0])
        if tied is not None and name == tied[0]:
            copied = True  # in the listing: the last stage's copy stands in its place
            if s == last:
                dims = held(tied[1], name)
        out[s].append(dims)
    if tied is not None and not copied:  # after every other parameter, where it is the last stage's
        name = tied[0]
        if cut.stage_of(name if name in graph and graph.node(name).kind == "parameter" else heads[0]) == last:
            out[last].append(held(tied[1], name))
    return out


#: the stage's parts a replay on DDP's stages reads, and the parameter side per rank (passes/rank_side.py)
_PARTS = ("parameters", "gradients", "optimizer_state", "buffers", "inputs", "outputs", "step_temporaries", "at_rest",
          "step_peak")


def _owned(params: list[tuple[int, ...]], world: int, rank: int, regime: Regime, impl: str) -> dict[str, int]:
    """ZeroRedundancyOptimizer on a stage whose parameters are ``params`` (:func:`_whole`): data-parallel rank
    ``rank``'s optimizer state (its whole parameters, :func:`~symmem.passes.zero_redundancy.partition` of the
    stage's ``parameters()``) and its local AdamW's temporaries over them (``impl``: PyTorch's pick by device,
    :func:`~symmem.passes.schedule.optimizer_impl`, as the local optimizer is built with AdamW's defaults), in its
    local optimizer's order."""
    return _owned_each(params, world, regime, impl)[rank]


def _owned_each(params: list[tuple[int, ...]], world: int, regime: Regime, impl: str,
                states: dict[tuple[int, ...], int] | None = None) -> list[dict[str, int]]:
    """:func:`_owned` of every rank ``0 .. world - 1``: the partition made once, each shape's state summed once (a
    stage's layers repeat a few shapes; ``states``: kept by the caller for this regime), the step's temporaries
    added up in integers (the shapes are numbers: :func:`~symmem.passes.model_parallel._step_temporaries`' sympy
    sums and ``Max`` were most of the ranks' cost)."""
    import math

    from .zero_redundancy import _state, partition

    sizes = [math.prod(p) for p in params]  # numel
    states = {} if states is None else states
    out = []
    for idx in partition(sizes, world):
        state = 0
        for i in idx:
            if params[i] not in states:
                states[params[i]] = _state(regime, params[i], {})
            state += states[params[i]]
        out.append({"optimizer_state": state,
                    "step_temporaries": _temporaries(regime, [sizes[i] * 4 for i in idx], impl) if idx else 0})
    return out


def _temporaries(regime: Regime, size: list[int], impl: str) -> int:
    """:func:`~symmem.passes.model_parallel._step_temporaries` of parameters listed one after another, at numbers:
    ``size`` their FP32 bytes in the step's order.  For-loop AdamW: the largest of one parameter's ``sqrt`` and
    ``denom`` beside the previous one's ``denom``; foreach: one copy of every parameter; fused: none."""
    if regime.optimizer not in ("adam", "adamw"):
        raise SymmemError(f"pipeline stages model the Adam/AdamW step; got {regime.optimizer}")
    if not size or impl == "fused":
        return 0
    if impl == "foreach":
        return sum(size)
    return max([2 * size[0], *(prev + 2 * cur for prev, cur in zip(size, size[1:], strict=False))])
