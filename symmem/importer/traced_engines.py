"""A traced module's training step under a data-parallel engine or ZeRO's accounting: the recorded step rewritten.

The step is recorded on fake tensors as on one device (:mod:`.recording`); every rank of a data-parallel engine runs
that same forward and backward on its own batch, and the engines differ in what they keep beside it -- what
:mod:`symmem.passes.data_parallel` models for built-in graphs, measured on real gloo runs.  :class:`Engine` rewrites a
:class:`~symmem.importer.recording.StepRecord` with the same rules, op by op, so the fold in ``L``, the peak algebra
and every view work on it unchanged:

* ``ddp`` -- the reducer's flat gradient buckets (every trainable parameter's bytes), live from the start;
* ``ddp-bucket-view`` -- the buckets are the gradients: each ``.grad`` a backward op makes is freed once made (the
  reducer copies it into its bucket), and the buckets are live from the start;
* ``zero-redundancy`` -- DDP's buckets, and ``ZeroRedundancyOptimizer``'s whole-parameter partition: each rank's step
  recorded with its own local optimizer over the parameters it owns (:mod:`.traced_zero`), at the numbers the
  partition needs (``N`` and the layer count); the peak is the largest rank's (:class:`ZeroRedundancyStepPeak`);
* ``fsdp`` / ``fsdp-no-reshard`` -- FSDP2 ``fully_shard`` on each block of the repeated run the fold in ``L`` finds
  (``transformer.h.*``, ``model.layers.*``), then the root (every other parameter): the events of
  :class:`symmem.passes.data_parallel.Fsdp` placed at the recorded ops of each block (:mod:`.traced_fsdp`); every
  rank's step, each distinct set of rows it holds followed once (:meth:`EngineStepPeak.rank_peaks`);
* ``fsdp1`` / ``fsdp1-grad-op`` -- FSDP1 ``FullyShardedDataParallel`` (FULL_SHARD, SHARD_GRAD_OP) with the same units:
  one flat parameter per unit padded to a multiple of ``N``, the optimizer stepping the flat shards
  (:mod:`.traced_fsdp1`); every rank alike;
* ``zero`` K -- the papers' accounting (:attr:`symmem.training.Regime.zero`): each component stage K shards divided by
  ``N`` at every moment (optimizer state from 1, gradients from 2, weights at 3; Adam's 4-byte step counts whole).

>>> from symmem.training import Regime
>>> engine_of(Regime(data_parallel="fsdp1")).kind, engine_of(Regime(zero=2)).kind, engine_of(Regime()) is None
('fsdp1', 'zero', True)
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import sympy

from ..errors import SymmemError
from ..passes.data_parallel import SHARDED, alike_ranks
from ..passes.fsdp1 import FSDP1
from ..passes.zero_redundancy import ENGINE as ZERO_REDUNDANCY
from ..passes.zero_redundancy import RanksPeak, over_ranks
from ..record.fsdp1_runs import STRATEGIES
from ..symbols import N
from ..training import Regime
from .recording import LiveStorage, StepRecord
from .traced_fsdp import FsdpRewrite, Param, grads_made, parameters_of, scaled, without_frees
from .traced_fsdp1 import Fsdp1Rewrite
from .traced_step import StepPeak, peak_of
from .traced_zero import owned_order


@dataclass(frozen=True)
class Engine:
    """What one rank runs beside the recorded step: ``kind`` is ``ddp``, ``ddp-bucket-view``, ``zero-redundancy``,
    ``fsdp``, ``fsdp-no-reshard``, ``fsdp1``, ``fsdp1-grad-op`` or ``zero`` (stage ``zero``); ``rank`` the FSDP rank
    whose shards the optimizer steps on; ``optimizer`` and ``impl`` the step's (FSDP1 steps its flat shards)."""

    kind: str
    zero: int = 0
    rank: int = 0
    optimizer: str = "adamw"
    impl: str = "for-loop"

    def apply(self, rec: StepRecord, module: Any, repeat: tuple[str, tuple[str, ...]] | None,
              loss_inside: bool) -> StepRecord:
        """``rec`` as one rank of the engine holds it."""
        if self.kind == ZERO_REDUNDANCY:
            raise SymmemError("ZeroRedundancyOptimizer's ranks each run their own optimizer: their steps are recorded "
                              "with it (ZeroRedundancyStepPeak.rank_record), not rewritten")
        params = parameters_of(rec, module, repeat)
        if self.kind in ("ddp", "ddp-bucket-view"):
            return _ddp(rec, params, self.kind == "ddp-bucket-view")
        if self.kind == "zero":
            return _zero(rec, params, self.zero)
        if self.kind in FSDP1:
            return Fsdp1Rewrite(rec, params, self.kind, self.rank, loss_inside, optimizer=self.optimizer,
                                impl=self.impl).rewrite()
        return FsdpRewrite(rec, params, self.kind, self.rank, loss_inside).rewrite()


def engine_of(regime: Regime) -> Engine | None:
    """The engine a regime runs a traced step under (None: one device's step)."""
    if regime.data_parallel:
        return Engine(regime.data_parallel)
    if regime.zero:
        return Engine("zero", regime.zero)
    return None


def refusal(regime: Regime, step: Any) -> str | None:
    """Why a traced step is not followed under ``regime``'s engine (None: it is)."""
    dp = regime.data_parallel  # every engine Regime accepts (training.DATA_PARALLEL) is followed
    sharded = dp in SHARDED or dp in FSDP1
    if sharded and step.options.micro_batches != 1:
        return (f"the peak under data_parallel={dp!r} is modelled for one micro-batch (FSDP's gradient accumulation "
                "is not)")
    if sharded and step.options.checkpoint:
        return (f"the peak of a traced module under data_parallel={dp!r} is modelled without checkpointing (the "
                "built-in models' is, full and every-K)")
    if (sharded or dp == ZERO_REDUNDANCY or regime.zero) and any(not p.requires_grad
                                                                        for p in step.module.parameters()):
        return (f"the peak under {'data_parallel=' + repr(dp) if dp else f'zero={regime.zero}'} is modelled for "
                "modules whose parameters all train (frozen ones are sharded without gradients: not followed)")
    return None


def policy(regime: Regime, repeat: Any) -> str:
    """The wrapping the FSDP peak of a traced module follows, in one line (``repeat``: the trace's folded run).

    >>> policy(Regime(data_parallel="fsdp"), None)
    'fsdp: FSDP2 fully_shard(reshard_after_forward=True) on the root only (the module has no repeated block)'
    >>> policy(Regime(data_parallel="fsdp1-grad-op"), None)[:78]
    'fsdp1-grad-op: FSDP1 FullyShardedDataParallel(sharding_strategy=SHARD_GRAD_OP)'
    """
    dp = regime.data_parallel
    if dp in FSDP1:
        head = f"{dp}: FSDP1 FullyShardedDataParallel(sharding_strategy={STRATEGIES[dp]})"
        tail = "; every rank holds the same flat shards (padded to a multiple of N)"
    else:
        head = f"{dp}: FSDP2 fully_shard(reshard_after_forward={SHARDED[dp]})"
        tail = "; the peak is rank 0's, which holds whole shards"
    if repeat is None:
        return f"{head} on the root only (the module has no repeated block)"
    where = f"{repeat.path}." if repeat.path else ""
    if regime.pipeline_parallel:  # importer/traced_fsdp_pipeline.py
        return (f"{head} on every pipeline stage of a p x N mesh: on each of the stage's blocks of {where}*, then "
                "on the stage module (its other parameters), over its N data-parallel ranks; the peak is the largest "
                "rank's")
    return (f"{head} on each block of {where}* (the run of {len(repeat.children)} identical children symmem folds "
            f"into L), then on the root (every other parameter){tail}")


def _ddp(rec: StepRecord, params: list[Param], view: bool) -> StepRecord:
    """DDP's buckets (the trainable parameters') from the start; under the bucket view each ``.grad`` freed once the
    node that made it has run."""
    storages = list(rec.storages)
    # one storage per parameter's bytes: how bucket_cap_mb groups them changes no moment's bytes, and a block's
    # share then repeats per layer (the fold in L counts storages per byte size)
    buckets = [LiveStorage(len(storages) + k, p.nbytes, "gradient", "float32", None, f"ddp.buckets[{p.name}]", "", 1,
                           "start") for k, p in enumerate(p for p in params if p.trains)]
    storages += buckets
    ops = list(rec.ops)
    if view:
        grads = set(grads_made(rec))
        ops = without_frees(ops, grads)
        # the reducer's hook copies a .grad into its bucket once the autograd node that made it has run: freed
        # after that node's last op (a node's ops run one after another, under its name and module)
        ends: dict[int, list[int]] = {}
        for k, o in enumerate(ops):
            mine = [i for i in o.born if i in grads]
            if mine:
                j = k
                while j + 1 < len(ops) and (ops[j + 1].phase, ops[j + 1].where, ops[j + 1].module) == (
                        o.phase, o.where, o.module):
                    j += 1
                ends.setdefault(j, []).extend(mine)
        ops = [dataclasses.replace(o, freed=o.freed + tuple(ends.get(k, ()))) for k, o in enumerate(ops)]
    return dataclasses.replace(rec, storages=tuple(storages), start=(*rec.start, *(b.sid for b in buckets)),
                               ops=tuple(ops))


def _zero(rec: StepRecord, params: list[Param], stage: int) -> StepRecord:
    """The papers' accounting: what stage ``stage`` shards, divided by N (Adam's step counts are scalars)."""
    weights = {p.sid for p in params}
    out = []
    for s in rec.storages:
        share = (s.sid in weights and stage >= 3) or (s.category == "gradient" and stage >= 2) or (
            s.category == "optimizer_state" and stage >= 1 and not _scalar(s))
        out.append(scaled(s, s.nbytes / N) if share else s)
    return dataclasses.replace(rec, storages=tuple(out))


def _scalar(s: LiveStorage) -> bool:
    """Adam's step count: one element (4 bytes in FP32)."""
    return sympy.sympify(s.nbytes, strict=True) == 4 and s.dtype == "float32"


@dataclass
class EngineStepPeak(StepPeak):
    """A traced module's :class:`~symmem.importer.traced_step.StepPeak` under an :class:`Engine`: each record the
    plain step makes (``inner``, shared by every rank's step), rewritten."""

    engine: Engine | None = None
    inner: StepPeak | None = None
    loss_inside: bool = False

    def record(self, count: int | None = None, ones: tuple[str, ...] = ()) -> StepRecord:
        assert self.inner is not None and self.engine is not None
        count = self.count if count is None else count
        key = (count, ones)
        if key not in self._records:
            self._records[key] = self.engine.apply(self.inner.record(count, ones), self.module, self.repeat,
                                                   self.loss_inside)
        return self._records[key]

    def _values(self, at: Any) -> dict[sympy.Symbol, int]:
        """The numbers a timeline is read at: the declared sizes' and the world size N (the shards' bytes)."""
        values = super()._values(at)
        given = {**self.numbers, **dict(at)}
        return {**values, N: given[N]} if N in given else values

    def at_rank(self, rank: int) -> EngineStepPeak:
        """The step of FSDP's rank ``rank`` (its optimizer steps on its unpadded rows)."""
        assert self.engine is not None
        if rank == self.engine.rank:
            return self
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, rank=rank), _records={}, _peaks={},
                                   notes=[])

    def rank_peaks(self, derivation: Any) -> dict[int, tuple[int, int]] | None:
        """Under FSDP2: ``{rank: (first-step peak, steady peak)}`` of every rank ``0 .. N-1`` of ``derivation``
        (this step's), where they differ; None where every rank's is the same.  A rank's step differs from
        another's only through the rows of each parameter's dim 0 it holds (the padding sits at the end: the last
        ranks hold fewer, a middle one may hold part of a shard), so each distinct set of rows is followed once,
        however large ``N`` is."""
        assert self.engine is not None
        if self.engine.kind not in SHARDED:
            return None
        found = {}
        firsts = [p.shape[0] for p in self.module.parameters() if p.dim()]
        for group in alike_ranks(firsts, int(derivation.numbers[N])):
            d = dataclasses.replace(derivation, step=self.at_rank(group[0]))
            found.update(dict.fromkeys(group, (int(d.value("peak_first_step")), int(d.value("peak")))))
        found = dict(sorted(found.items()))
        return found if len(set(found.values())) > 1 else None



@dataclass
class ZeroRedundancyStepPeak(EngineStepPeak):
    """A traced module's step under ``DistributedDataParallel`` with ``ZeroRedundancyOptimizer`` (ZeRO-1): every
    rank's step recorded with its own local optimizer (:mod:`.traced_zero`) and DDP's buckets, at the numbers the
    whole-parameter partition is computed at (``N`` and the layer count); the peak is the ``Max`` over every rank's
    moments (:class:`~symmem.passes.zero_redundancy.RanksPeak`, each moment saying its rank), as for built-in
    graphs."""

    def _fixed(self, at: Any) -> tuple[int, int | None]:
        """The world size and the layer count the partition is computed at."""
        given = {**self.numbers, **dict(at or {})}
        world = given.get(N)
        if world is None:
            raise SymmemError("ZeroRedundancyOptimizer partitions whole parameters by their sizes over the ranks: "
                              "give the world size N a number (--set N=...)")
        if isinstance(world, bool) or int(world) != world or int(world) < 1:
            raise SymmemError(f"the world size N is a positive integer, got {world!r}")
        count = given.get(self.symbol) if self.symbol is not None else None
        return int(world), int(count) if count is not None else self.count

    def _listed(self, count: int | None) -> list[tuple[str, tuple[int, ...]]]:
        """``module.parameters()`` with the repeated blocks written out ``count`` times: (name, shape)."""
        from .wrap import with_layers

        ctx = with_layers(self.module, self.repeat[0], self.repeat[1], count) \
            if self.repeat is not None and count else contextlib.nullcontext()
        with ctx:
            return [(n, tuple(int(d) for d in p.shape)) for n, p in self.module.named_parameters()]

    def domain(self) -> tuple[Any, ...]:
        return self._domain_at(*self._fixed({}))

    def _domain_at(self, world: int, count: int | None) -> tuple[Any, ...]:
        """Where the peak holds: at the world size and layer count its partition was computed at."""
        fixed = (sympy.Eq(N, world), *((sympy.Eq(self.symbol, count),) if self.symbol is not None else ()))
        return (*fixed, *self._domain())

    def holds_at(self, numbers: Any) -> bool:
        return all(bool(sympy.sympify(c, strict=True).xreplace(dict(numbers))) for c in self.domain())

    def rank_record(self, count: int | None, ones: tuple[str, ...], owned: tuple[int, ...]) -> StepRecord:
        """The step of a rank whose local optimizer steps the parameters ``owned`` (indices in
        ``module.parameters()`` order, in its order), with DDP's buckets."""
        key = (ZERO_REDUNDANCY, count, ones, owned)
        if key not in self._records:
            assert self.inner is not None
            # the same fake world, the rank's optimizer in place of the single device's
            alone = dataclasses.replace(self.inner, options=dataclasses.replace(self.inner.options, owned=owned),
                                        _records={}, _peaks={}, notes=[])
            rec = alone.record(count, ones)
            self._records[key] = _ddp(rec, parameters_of(rec, self.module, self.repeat), False)
        return self._records[key]

    def _key(self, at: Any) -> tuple[int, int | None, tuple[str, ...]]:
        """The world size, the layer count and the sizes at 1 that ``at`` asks for."""
        world, count = self._fixed(at)
        by_symbol = {s: n for n, s in self.symbols.items()}
        return world, count, tuple(sorted(by_symbol[s] for s, v in dict(at or {}).items() if s in by_symbol and v == 1))

    def _partition(self, world: int, count: int | None) -> tuple[list[tuple[int, ...]], list[Any]]:
        """Each rank's parameters (indices, in its optimizer's order) and the module's parameters, worked out once
        per world size and layer count."""
        key = (ZERO_REDUNDANCY, "partition", world, count)
        if key not in self._peaks:
            params = self._listed(count)
            self._peaks[key] = (owned_order([int(sympy.Mul(*shape)) for _, shape in params], world), params)
        return self._peaks[key]  # type: ignore[return-value]  # stored under its own key

    def ranks(self, at: Any = None) -> RanksPeak:
        """Every rank's peak and the largest over them (ranks whose local optimizers step the same shapes in the
        same order step alike: recorded once)."""
        world, count, ones = self._key(at)
        key = (ZERO_REDUNDANCY, world, count, ones)
        if key in self._peaks:
            return self._peaks[key]  # type: ignore[return-value]  # a RanksPeak, stored under its own key
        parts, params = self._partition(world, count)
        domain = self._domain_at(world, count)
        numbers = {**self.numbers, **dict(at or {}), N: world}
        state: dict[int, int] = {}

        def rank_peak(ranks: list[int]) -> Any:
            rec = self.rank_record(count, ones, parts[ranks[0]])
            state.update(dict.fromkeys(ranks, sum(int(sympy.sympify(rec.storages[i].nbytes, strict=True))
                                                  for i in rec.state())))
            return peak_of(rec, subs=self.subs, numbers=numbers, domain=domain,
                           layers=rec.layers if rec.layers is not None else self.layer_map())

        out = over_ranks(parts, lambda i: params[i][1], rank_peak, world, domain)
        out._state = [state[r] for r in range(world)]
        self._peaks[key] = out
        return out

    def peak(self, at: Any = None) -> RanksPeak:
        return self.ranks(at)

    def record(self, count: int | None = None, ones: tuple[str, ...] = ()) -> StepRecord:
        """The step of the rank whose steady step peaks highest, its blocks written out ``count`` times and the sizes
        in ``ones`` at 1."""
        at = {} if self.symbol is None or count is None else {self.symbol: count}
        return self._at({**at, **{self.symbols[n]: 1 for n in ones}})[0]

    def _at(self, at: Any) -> tuple[StepRecord, Any, tuple[str, ...]]:
        """The step of the rank whose steady step peaks highest at ``at``."""
        world, count, ones = self._key(at)
        parts, _ = self._partition(world, count)
        rank = getattr(self.ranks(at).at({**self.numbers, **dict(at)}, "steady"), "rank", 0)
        return self.rank_record(count, ones, parts[rank]), count, ones


def under_engine(step: StepPeak, regime: Regime) -> Any:
    """``step`` under ``regime``'s engine (itself where there is none), or a :class:`~symmem.step.Refused`."""
    engine = engine_of(regime)
    if engine is None:
        return step
    why = refusal(regime, step)
    if why is not None:
        from ..step import Refused

        return Refused(why)
    fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(StepPeak) if not f.name.startswith("_")}
    fields["notes"] = step.notes
    engine = dataclasses.replace(engine, optimizer=step.options.optimizer, impl=step.options.impl)
    kind = ZeroRedundancyStepPeak if engine.kind == ZERO_REDUNDANCY else EngineStepPeak
    return kind(**fields, engine=engine, inner=step, loss_inside=step.options.loss == "output")


def traced_job(derivation: Any, builder: Any, steps: int | None = None) -> Any:
    """The real run of a traced ``derivation``'s engine (:class:`symmem.record.distributed.Job`): ``builder`` makes
    the module and the inputs the derivation was traced at (its numbers are the example's sizes), picklable
    (:class:`symmem.importer.spec_builder.SpecBuilder`)."""
    from ..passes.schedule import optimizer_impl
    from ..record.distributed import ENGINES, Job, steps_of

    regime = derivation.regime
    step = derivation.step
    if regime.data_parallel not in ENGINES or not isinstance(step, EngineStepPeak):
        raise SymmemError(f"traced_job runs a traced module's step under {', '.join(ENGINES)}; got "
                          f"data_parallel={regime.data_parallel!r}")
    if step.options.loss not in ("sum", "cross-entropy") or step.options.micro_batches != 1:
        raise SymmemError("traced_job runs the loss 'sum' or 'cross-entropy', one micro-batch")
    return Job(derivation.model, tuple(sorted((s.name, int(v)) for s, v in derivation.numbers.items())), (),
               regime.data_parallel, regime.optimizer, optimizer_impl(regime, "cpu"),
               step.options.loss == "cross-entropy", regime.keep_logits,
               steps_of(regime.data_parallel) if steps is None else steps, builder=builder)
