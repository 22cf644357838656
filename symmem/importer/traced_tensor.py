"""A traced module's step under tensor (and sequence) parallelism: one rank's step recorded on fake DTensors.

``symmem trace SPEC --tensor-parallel [--sequence-parallel] --set t=2`` (Python: ``trace(..., tensor_parallel=True,
values={"t": 2})``): the module's own plan (:mod:`.tensor_plan`) is applied with ``parallelize_module`` to a copy of the
module whose parameters are fake tensors, in a fake process group of ``t`` ranks (:mod:`symmem.record.fake_group`),
and one training step -- forward, the loss, ``backward()``, two optimizer steps (the first makes the state, the second
is a steady one), ``zero_grad`` -- is recorded op by op with the recorder that sees what DTensor does (local shards,
DTensor's inner ops, funcol's wrappers) into the :class:`~symmem.importer.recording.StepRecord` the single-device
step gives, so the one peak algebra, ``peak_at`` and every view work on it unchanged.

The declared sizes stay symbolic: DTensor's uncached sharding propagation (the path compilation takes) keeps them
so, and the peak is a formula in them at the derivation's ``t``, where the guards the step took hold
(``Eq(Mod(B, 2), 0)`` for HF Llama at ``t = 2``) and every size is at least 2.  Repeated blocks fold to the layer
count as on one device (:func:`~symmem.importer.traced_step.folded_peak`): the rank's step recorded with the blocks
written out 4, 5 and 6 times, interpolated from the first two and checked at the third, the formula holding from
``L = 4``; below, the step is recorded at that layer count, the sizes still symbolic.  Where a guard pins a size,
where the symbolic step does not run, and at numbers outside that domain (``d.at(B=1)``, another ``t``), the step
is recorded at the numbers, its domain those numbers.  The plan splits every sharded dimension evenly (refused
otherwise), so every rank holds what rank 0 holds: the peak is every rank's (:meth:`TensorStepPeak.per_rank`).

>>> import pytest; torch = pytest.importorskip("torch")
>>> from symmem import trace
>>> net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
>>> net.tp_plan = {"0": "colwise", "2": "rowwise"}
>>> d = trace(net, (torch.zeros(4, 8),), {"B": [(0, 0)]}, optimizer="adamw", tensor_parallel=True, values={"t": 2})
>>> d.peak, d.value("peak")   # two real gloo ranks under this plan: 5,712 bytes each (record/traced_tensor_runs.py)
(Max(32*B + 5584, 224*B + 3928), 5712)

What the rank keeps after the forward is read from the same recorded step (:meth:`TensorStepPeak.kept`,
:func:`rank_storages`): the storages alive at the forward's end that autograd keeps, at the local shards' bytes --
here the ReLU's output, split over ``t`` (the real ranks' saved tensors: 256 bytes each) -- in the derivation's
ledger in place of one device's, at the ``t`` recorded:

>>> d.activations, d.value("activations"), d.domain
(64*B, 256, Eq(t, 2) & (B >= 2))

Checked against real gloo runs of the same modules under the same plans (``tests/test_traced_tensor.py``): every
rank's first and steady peak and the activations it keeps after the forward, to the byte.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from ..derivation import Storage
from ..errors import SymmemError
from ..peak import Peak
from ..record.identity import tensors as _leaves
from ..symbols import t as T
from ..timeline import Row, Which
from .recording import StepOptions, StepRecord
from .tensor_plan import TensorPlan, check_heads, plan_of
from .traced_step import COUNTS, FoldError, StepPeak, cannot_run, folded_peak, peak_of


def refusal(options: StepOptions, device: str, module: Any) -> str | None:
    """Why the tensor-parallel step of a traced module is not recorded (None: it is)."""
    if not str(device).startswith("cpu"):
        return ("the tensor-parallel step of a traced module is recorded on the CPU (gloo's collectives, as "
                "measured); on a GPU NCCL's buffers are a band like the CUDA workspaces")
    if options.impl != "for-loop":
        return (f"the tensor-parallel step of a traced module is measured with the for-loop optimizer, not "
                f"{options.impl!r} (--optimizer-impl for-loop)")
    if options.micro_batches != 1 or options.checkpoint or options.autocast:
        return ("the tensor-parallel step of a traced module is recorded for one micro-batch, without "
                "checkpointing or autocast")
    seen: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            return (f"tied parameters ({seen[id(p)]} is {name}) are split by two plans under tensor parallelism: "
                    "untie them (tie_word_embeddings=false)")
        seen[id(p)] = name
    return None


def _fake_copy(module: Any, device: str) -> Any:
    """A copy of ``module`` whose parameters and buffers are fresh fake tensors (call under the fake mode): tied
    ones stay tied, the module's own are untouched."""
    import torch

    memo: dict[int, Any] = {}
    for p in module.parameters():
        fake = torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=p.dtype, device=device)
        memo[id(p)] = torch.nn.Parameter(fake, requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_strided(tuple(b.shape), tuple(b.stride()), dtype=b.dtype, device=device)
    return copy.deepcopy(module, memo)


def _even(module: Any, world: int) -> list[tuple[str, int]]:
    """Refuse a split that pads: every sharded parameter's global size divided evenly over the ranks.  Returns the
    sharded (parameter, dimension) pairs."""
    from torch.distributed.tensor import DTensor, Shard

    sharded = []
    for name, p in module.named_parameters():
        if isinstance(p, DTensor):
            for placement in p.placements:
                if isinstance(placement, Shard) and p.shape[placement.dim] % world:
                    raise SymmemError(f"t={world} does not divide {name}'s dimension {placement.dim} "
                                      f"({p.shape[placement.dim]}): DTensor pads the last shard and the ranks "
                                      "differ (not followed)")
                if isinstance(placement, Shard):
                    sharded.append((name, placement.dim))
    return sharded


@dataclass(frozen=True)
class RankWorld:
    """One fake world a rank's steps are recorded in: the fake mode and its ShapeEnv (the declared sizes' symbols),
    the fake process group's mesh and DTensor's sharding answers (:func:`~symmem.record.fake_group.as_a_run`)."""

    fake: Any
    mesh: Any
    quiet: list[bool]
    #: the fake world's shape cache (record/shape_cache.py), its SymMemo the world's
    shapes: Any = None


@contextlib.contextmanager
def rank_world(values: dict[str, int], world: int, symbolic: bool, fast: bool = True, fake: Any = None,
               shapes: Any = None) -> Iterator[RankWorld]:
    """A fake world of ``world`` ranks at ``values`` (the declared sizes symbolic with ``symbolic``) for one or more
    recordings of a rank's step (:func:`record_tensor_step`'s ``shared``); its process group destroyed on exit.

    Steps of one module at the same sizes, recorded at several layer counts (the fold's 4, 5 and 6), make the same
    ops on the same shapes, block after block: in one world the second and third find the first's fake dispatch
    cache entries (kept on the ShapeEnv) and sharding answers, and take the guards it took (the same ones: the same
    ops on the same symbolic shapes), where each in a world of its own would make them all again -- the same records
    (tests/test_traced_tensor.py, deep: shared against fresh).  ``fake``: the fake world (mode and ShapeEnv) of an
    earlier :func:`rank_world` at the same ``values`` and ``symbolic`` to record in again (its cache entries and
    guards with it; the process group and DTensor's answers, which name its mesh, are made anew), and ``shapes``
    its shape cache (:attr:`RankWorld.shapes`, whose entries are that ShapeEnv's)."""
    from ..record.fake_group import as_a_run, fake_group
    from ..record.shape_cache import ShapeCache
    from ..record.sym_memo import unseen
    from .fake import make_world

    if fake is None:
        fake = make_world(values, symbolic=symbolic)
    # FakeTensorMode's dispatch cache, which make_world turns off for a one-device trace (mostly misses there): a
    # rank's step repeats its ops -- every block's, the optimizer's on each parameter of a few shapes, and DTensor's
    # sharding propagation runs ops on global shapes again -- so here it hits (~0.6x the CPU, the same records)
    fake.mode.cache_enabled = fast
    # and in front of it the one-device trace's shape cache (record/shape_cache.py: a repeated op's outputs remade
    # from its first outputs' metadata, an in-place op on the same key answered with its input) with PyTorch's
    # symbolic size arithmetic remembered for the world (record/sym_memo.py): the blocks, the optimizer on each
    # parameter and DTensor's sharding propagation ask the same ops and sizes again and again (~0.75x the CPU of
    # the test's traces, the same records; guards first asked through the table still name PyTorch's asker, unseen())
    shapes = (shapes or ShapeCache()) if fast else None
    with contextlib.ExitStack() as stack:
        mesh = stack.enter_context(fake_group(world))
        quiet = stack.enter_context(as_a_run())
        if shapes is not None:
            stack.enter_context(unseen())
            stack.enter_context(shapes.memo.active(fake.env))
        yield RankWorld(fake, mesh, quiet, shapes)


def record_tensor_step(module: Any, inputs: Any, values: dict[str, int], options: StepOptions, world: int,
                       plan: TensorPlan, layers: tuple[str, tuple[str, ...], int] | None = None,
                       symbols: dict[str, sympy.Symbol] | None = None, sharded: list[tuple[str, int]] | None = None,
                       fast: bool = True, shared: RankWorld | None = None) -> StepRecord:
    """One rank's training step of ``module`` split by ``plan`` over ``world`` ranks, on fake tensors at ``values``
    (every declared size a number; ``layers`` writes the repeated blocks out that many times); with ``symbols``
    (name -> symbol) the declared sizes are symbolic, and the record's sizes are formulas in them.  ``sharded``, a
    list, gets the (parameter, dimension) pairs the plan shards.  ``fast=False`` records as before stop 40 (no fake
    dispatch cache, the optimizer on the DTensors): the same record, slower (tests/test_traced_tensor.py, deep).
    ``shared``: the :func:`rank_world` to record in (made at the same ``values``, ``world`` and symbolic or not),
    else one of its own."""
    if shared is None:
        with rank_world(values, world, symbols is not None, fast) as own:
            return record_tensor_step(module, inputs, values, options, world, plan, layers, symbols, sharded, fast,
                                      own)
    from types import SimpleNamespace

    import torch
    from torch.distributed.tensor.parallel import parallelize_module

    from ..record.fake_group import FakeShardTracker
    from ..record.modules import ModuleTracker
    from ..record.optim import make_optimizer, state_tensors
    from ..record.sharded import local
    from ..record.steps import loss_value
    from .fake import fake_inputs
    from .recording import _StepRecorder
    from .runs import resized
    from .wrap import with_layers

    fake, mesh, quiet = shared.fake, shared.mesh, shared.quiet
    at = resized(inputs, values)
    index: dict[str, int] | None = None
    with contextlib.ExitStack() as stack:
        if layers is not None:  # the copy below is made with the run written out (child path -> its index)
            index = stack.enter_context(with_layers(module, *layers))
        with fake.mode:
            split = _fake_copy(module, "cpu")
            parallelize_module(split, mesh, plan.make(split, world))
            if plan.positions:  # the whole sequence's position ids, made and let go by LlamaModel (hf_llama's runs)
                from ..record.hf_llama import whole_sequence_positions

                whole_sequence_positions(split)
            fin = fake_inputs(fake, at, "cpu")
            args, kwargs = at.rebuild(fin)
        (sharded if sharded is not None else []).extend(_even(split, world))
        split.train()
        tracker = FakeShardTracker(fake.mode, quiet, shared.shapes)
        tracker.unnamed_to_last = True  # a state's step count made from no tensor: the parameter it is made for
        if symbols is not None:
            from ..record.identity import symbolic_nbytes

            tracker.nbytes = symbolic_nbytes
        tracker.modules = ModuleTracker(split, tag=True)
        params = [p for p in split.parameters() if p.requires_grad]
        names = {id(p): n for n, p in split.named_parameters()}
        tracker.register([local(p) for p in split.parameters()], "parameter")
        tracker.register([local(b) for b in split.buffers()], "buffer")
        tracker.register(list(_leaves([args, kwargs])), "input")
        target = None
        stack.enter_context(fake.mode)
        if options.loss == "cross-entropy":
            with torch.no_grad():
                probe = split(*args, **kwargs)  # the output's shape, outside the recording
            from ..record.identity import first_tensor

            target = torch.empty(tuple(first_tensor(probe).shape[:-1]), dtype=torch.long)
            del probe
            tracker.register([target], "input")
        opt = make_optimizer(params, options.optimizer, options.impl)
        stack.enter_context(tracker.modules)
        stack.enter_context(tracker)
        with tracker.phase(1, "forward"), tracker.saving():
            out = split(*args, **kwargs)
        with tracker.phase(1, "loss"), tracker.saving():
            value = loss_value(options.loss, out, target)
            if not options.keep_output:
                out = None
        with tracker.phase(1, "backward"):
            tracker.label([local(x) for x in (*(_leaves(out) if out is not None else []), value)], "output")
            handles = tracker.watch_backward(value)
            value.backward()
            for h in handles:
                h.remove()
            tracker.label([local(p.grad) for p in params], "gradient")
            del out, value, handles
        # the optimizer steps a DTensor parameter's local shard where that is all DTensor would run (shards())
        shards = _shards(params) if fast else list(params)
        opt.param_groups[0]["params"] = shards
        for step in (1, 2):
            with tracker.phase(step, "step"):
                tracker.name_parameters(((names[id(p)], local(x)) for p, s in zip(params, shards, strict=True)
                                         for x in (p, p.grad, *opt.state.get(s, {}).values())
                                         if isinstance(x, torch.Tensor)), reset=True)
                opt.step()
                tracker.label([local(x) for x in state_tensors(opt)], "optimizer_state")
        with tracker.phase(2, "zero_grad"):
            for p, s in zip(params, shards, strict=True):  # optimizer.zero_grad(set_to_none=True), the shard's too
                s.grad = None
                p.grad = None
        del opt, params, split, args, kwargs, fin, target
    # the events as the single-device recorder's: sizes are numbers, or with symbols the ShapeEnv's in the declared ones
    shim = SimpleNamespace(live=tracker, on_gpu=False)
    convert, guards = (lambda x: sympy.Integer(int(x))), []
    if symbols is not None:
        from .guards import collect
        from .runs import converter, tidy

        mapping = fake.mapping(symbols)
        convert, guards = converter(fake.env, mapping), collect(fake.env, mapping, tidy)
    return _StepRecorder.record(shim, convert, index, layers[2] if layers is not None else None,  # type: ignore
                                [], guards)


def _shards(params: list[Any]) -> list[Any]:
    """What the optimizer steps for each of ``params`` (after backward): a DTensor parameter's local shard, its
    gradient the gradient's local shard, where the gradient has the parameter's mesh, placements and shape -- there
    DTensor runs each of the for-loop optimizer's ops (pointwise, on its state made ``zeros_like`` the parameter) as
    that op on the local shards, and nothing else, so the rank's ops and storages are the same, without DTensor's
    sharding propagation per op (a third of a step's CPU on fake tensors); else the parameter itself (a gradient
    DTensor redistributes first: a Partial one's all-reduce)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    out = []
    for p in params:
        g = p.grad
        shard, grad = getattr(p, "_local_tensor", None), getattr(g, "_local_tensor", None)
        if (isinstance(p, DTensor) and isinstance(g, DTensor) and g.device_mesh is p.device_mesh
                and g.placements == p.placements and g.shape == p.shape and g.stride() == p.stride()
                and type(shard) in (torch.Tensor, FakeTensor) and type(grad) is type(shard)):
            shard.grad = grad
            out.append(shard)
        else:
            out.append(p)
    return out


#: how far each size is moved, in multiples of t, to tell a guard that pins a size (``Eq(B, 2)``: the formula would
#: hold at one value) from one that states a rule of the plan (``Eq(Mod(B, 2), 0)``, ``S >= 2``)
_SHIFTS = (2, 4)


@dataclass
class TensorStepPeak(StepPeak):
    """The :class:`~symmem.step.Step` of a traced module under tensor parallelism: one rank's step recorded on fake
    DTensors (:func:`record_tensor_step`), every rank alike.  The declared sizes are symbolic where DTensor keeps
    them so (the formulas hold where the guards the step took hold, sizes from 2, at the ``t`` they were recorded
    at), and the layer count where the repeated blocks fold (from 4; below, at the count asked for); else, and at
    numbers outside that domain, the step is recorded at the numbers."""

    plan: TensorPlan | None = None
    sequence: bool = False
    #: the (parameter, dimension) pairs the plan shards, as the last record found them
    sharded: list[tuple[str, int]] = dataclasses.field(default_factory=list, repr=False)
    #: the fake world (:func:`rank_world`'s mode and ShapeEnv) each (symbolic, sizes, t) is recorded in, every
    #: record of those in the same one (the own layer count's and the fold's: their ops hit its dispatch cache),
    #: with its shape cache
    _fakes: dict[tuple[Any, ...], Any] = dataclasses.field(default_factory=dict, repr=False)

    def _fixed(self, at: Mapping[sympy.Symbol, int] | None) -> tuple[tuple[tuple[str, int], ...], int | None, int]:
        """The declared sizes, the layer count and ``t`` the step is recorded at."""
        given = {**self.numbers, **dict(at or {})}
        world = given.get(T)
        if world is None:
            raise SymmemError("the tensor-parallel step is recorded at a number of ranks: give t a number "
                              "(--set t=2)")
        if int(world) < 1:
            raise SymmemError(f"the tensor-parallel size t must be at least 1, got t={world}")
        sizes = tuple((n, int(given.get(s, self.values[n]))) for n, s in sorted(self.symbols.items()))
        count = given.get(self.symbol) if self.symbol is not None else None
        return sizes, int(count) if count is not None else self.count, int(world)

    def _together(self, sizes: tuple[tuple[str, int], ...], counts: tuple[int, ...], world: int, symbolic: bool
                  ) -> None:
        """The steps at ``counts`` layers not recorded yet, recorded in one fake world (:func:`rank_world`: the
        later ones find the first's fake dispatch and sharding answers; the same records)."""
        missing = [n for n in counts if ("tensor", symbolic, sizes, n, world) not in self._records]
        if len(missing) > 1 and self.repeat is not None:
            with self._world(sizes, world, symbolic) as shared:
                for n in missing:
                    TensorStepPeak._recorded(self, sizes, n, world, symbolic, shared)

    @contextlib.contextmanager
    def _world(self, sizes: tuple[tuple[str, int], ...], world: int, symbolic: bool) -> Iterator[RankWorld]:
        """A :func:`rank_world` at ``sizes`` and ``world`` ranks in the fake world of this step's earlier records
        of those sizes (the first makes it)."""
        key = (symbolic, sizes, world)
        fake, shapes = self._fakes.get(key, (None, None))
        with rank_world(dict(sizes), world, symbolic, fake=fake, shapes=shapes) as shared:
            self._fakes[key] = (shared.fake, shared.shapes)
            yield shared

    def _recorded(self, sizes: tuple[tuple[str, int], ...], count: int | None, world: int, symbolic: bool,
                  shared: RankWorld | None = None) -> StepRecord:
        """The step at ``sizes`` (with ``symbolic``, those numbers are the fake sizes' hints), ``count`` layers and
        ``world`` ranks (in ``shared``, a :func:`rank_world` at those, else in one of its own)."""
        key = ("tensor", symbolic, sizes, count, world)
        if key not in self._records:
            assert self.plan is not None
            if self.plan.config is not None:
                check_heads(self.plan.config, world)
            layers = None  # written out at every count, its own too: the fold names each op's layer from it
            if self.repeat is not None and count is not None:
                layers = (self.repeat[0], self.repeat[1], count)
            try:
                self.sharded.clear()
                with contextlib.ExitStack() as stack:
                    if shared is None:
                        shared = stack.enter_context(self._world(sizes, world, symbolic))
                    rec = record_tensor_step(self.module, self.inputs, dict(sizes), self.options, world, self.plan,
                                             layers, self.symbols if symbolic else None, self.sharded,
                                             shared=shared)
            except SymmemError:
                raise
            except Exception as exc:  # the module's own code on fake DTensors: say what failed, not a traceback
                raise cannot_run("the tensor-parallel step of this module", exc) from exc
            self._records[key] = rec
        return self._records[key]

    def _fixed_domain(self, count: int | None, world: int) -> tuple[Any, ...]:
        fixed = [sympy.Eq(self.symbol, count)] if self.symbol is not None and count is not None else []
        return (*fixed, sympy.Eq(T, world))

    def _formula(self, count: int | None, world: int) -> Peak | None:
        """The peak in the declared sizes at ``count`` layers and ``world`` ranks (None: DTensor pinned a size, or
        the step did not run with symbolic sizes; the step is then recorded at the numbers)."""
        key = ("tensor", "formula", count, world)
        if key not in self._peaks:
            sizes = self._fixed({})[0]
            found = None
            try:
                rec = self._recorded(sizes, count, world, symbolic=True)
            except SymmemError:
                rec = None
            if rec is not None and not self._pinned(rec, dict(sizes), world):
                domain = (*(g.expr for g in rec.guards), *self._domain(), *self._fixed_domain(count, world))
                found = peak_of(rec, subs=self.subs, numbers=self.numbers, domain=domain,
                                layers=rec.layers if rec.layers is not None else self.layer_map())
            self._peaks[key] = found  # type: ignore[assignment]  # None: no formula
        return self._peaks[key]

    def _folded(self, world: int) -> Peak | None:
        """The peak in the declared sizes and the layer count at ``world`` ranks: the rank's step recorded with the
        repeated blocks written out :data:`~symmem.importer.traced_step.COUNTS` times, interpolated in the layer
        count from the first two and checked at the third, as the one-device step folds (None: no repeated blocks,
        a size pinned, a step that does not run with symbolic sizes, or records that do not fold; a note says
        which)."""
        key = ("tensor", "folded", world)
        if key not in self._peaks:
            found = None
            if self.repeat is not None and self.symbol is not None:
                sizes = self._fixed({})[0]
                try:
                    self._together(sizes, COUNTS, world, symbolic=True)
                    records = [self._recorded(sizes, n, world, symbolic=True) for n in COUNTS]
                except SymmemError:
                    records = []
                if records and not any(self._pinned(r, dict(sizes), world) for r in records):
                    guards = tuple(dict.fromkeys(g.expr for r in records for g in r.guards))
                    domain = (*guards, sympy.Ge(self.symbol, COUNTS[0]), *self._domain(), sympy.Eq(T, world))
                    try:
                        found = folded_peak(dict(zip(COUNTS, records, strict=True)), self.symbol, subs=self.subs,
                                            numbers=self.numbers, domain=domain)
                    except FoldError as e:
                        self.notes.append(f"peak: not folded to {self.symbol} ({e}); given at the layer count "
                                          "asked for")
                    else:
                        self.notes.append(f"peak: the rank's step recorded at {', '.join(map(str, COUNTS))} layers "
                                          f"of {self.repeat[0] or 'the module'}, interpolated in {self.symbol} from "
                                          f"the first two and checked at the third (holds for {self.symbol} >= "
                                          f"{COUNTS[0]}; below, the step is recorded at that count)")
            self._peaks[key] = found  # type: ignore[assignment]  # None: no fold
        return self._peaks[key]

    def _pinned(self, rec: StepRecord, sizes: dict[str, int], world: int) -> bool:
        """Whether a guard of ``rec`` pins a size: false with that size moved by a few multiples of ``t``."""
        for g in rec.guards:
            for name, value in sizes.items():
                sym = self.symbols[name]
                if sym not in g.expr.free_symbols:
                    continue
                at = {self.symbols[n]: v for n, v in sizes.items()}
                for k in _SHIFTS:
                    if not bool(g.expr.xreplace({**at, sym: value + k * world})):
                        return True
        return False

    def _at_numbers(self, at: Mapping[sympy.Symbol, int] | None) -> Peak:
        """The peak recorded at the numbers (every size a number), its domain those numbers."""
        sizes, count, world = self._fixed(at)
        key = ("tensor", "numbers", sizes, count, world)
        if key not in self._peaks:
            rec = self._recorded(sizes, count, world, symbolic=False)
            domain = (*(sympy.Eq(self.symbols[n], v) for n, v in sizes), *self._fixed_domain(count, world))
            numbers = {**self.numbers, **dict(at or {})}
            self._peaks[key] = peak_of(rec, subs=self.subs, numbers=numbers, domain=domain,
                                       layers=rec.layers if rec.layers is not None else self.layer_map())
        return self._peaks[key]

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None) -> Peak:
        """The peak as formulas in the declared sizes where DTensor keeps them symbolic and in the layer count where
        the blocks fold, else at the layer count, else at the numbers; with ``at`` (numbers for some symbols) the
        most general of those formulas that holds there, else the step recorded at them."""
        _, count, world = self._fixed(at)
        merged = {**self.numbers, **dict(at or {})}
        for found in self._formulas(count, world, merged if at is not None else None):
            if found is not None and (at is None or found.holds_at(merged)):
                return found
        return self._at_numbers(at)

    def _formulas(self, count: int | None, world: int, at: Mapping[sympy.Symbol, int] | None) -> Iterator[Peak | None]:
        """The formulas :meth:`peak` tries, most general first: folded in the layer count (not worked out where
        ``at``'s layer count lies below the fold's), then at ``count`` layers."""
        if at is None or not self._folds() or int(at.get(self.symbol, COUNTS[0])) >= COUNTS[0]:  # type: ignore
            yield self._folded(world)
        yield self._formula(count, world)

    def record(self, count: int | None = None, ones: tuple[str, ...] = ()) -> StepRecord:
        at: dict[sympy.Symbol, int] = {self.symbols[n]: 1 for n in ones}
        if count is not None and self.symbol is not None:
            at[self.symbol] = count
        return self._recorded(*self._fixed(at), symbolic=False)

    def _folds(self) -> bool:
        return self.repeat is not None and self.symbol is not None

    def domain(self) -> tuple[Any, ...]:
        """Where the symbolic peak holds: once worked out, its own; before, what is known of it (the layer count
        from the fold's least, the sizes from 2, ``t``), so that a layer count below does not work the fold out."""
        world = self._fixed({})[2]
        if not self._folds() or ("tensor", "folded", world) in self._peaks:
            return tuple(self.peak().domain)
        assert self.symbol is not None
        return (sympy.Ge(self.symbol, COUNTS[0]), *self._domain(), sympy.Eq(T, world))

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        if self._folds() and int(numbers.get(self.symbol, COUNTS[0])) < COUNTS[0]:  # type: ignore[arg-type]
            return False  # below the fold: peak(numbers) gives the formula at that count, not worked out here
        return self.peak().holds_at(numbers)

    def _at(self, at: Mapping[sympy.Symbol, int]) -> tuple[StepRecord, Any, tuple[str, ...]]:
        return self._recorded(*self._fixed(at), symbolic=False), None, ()

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        return self._at(at)[0].timeline(which, {})

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        return self._at(at)[0].allocated(which, {})

    def kept(self) -> tuple[list[tuple[str, Any, str, int | None]], tuple[Any, ...], int | None]:
        """What the rank's autograd keeps at the forward's end: ``(module, bytes, op, block)`` per storage
        (``block``: which repeated block made it, None outside them), as formulas in the declared sizes where the
        step records them so, else at the numbers; where those hold (the step's guards, the sizes where recorded
        at numbers, ``t``); and the layer count recorded.  Above the fold's least layer count, the fold's first record
        is read where its blocks keep alike (one formula in the layer count then; the step at ``L = 32`` is not
        recorded)."""
        sizes, count, world = self._fixed({})
        if self._folds() and count is not None and count > COUNTS[0]:
            found = self._kept_at(sizes, COUNTS[0], world)
            if _alike(found[0]):
                return found
        return self._kept_at(sizes, count, world)

    def _kept_at(self, sizes: tuple[tuple[str, int], ...], count: int | None, world: int
                 ) -> tuple[list[tuple[str, Any, str, int | None]], tuple[Any, ...], int | None]:
        rec = None
        with contextlib.suppress(SymmemError):
            rec = self._recorded(sizes, count, world, symbolic=True)
        domain: tuple[Any, ...] = (sympy.Eq(T, world),)
        if rec is None or self._pinned(rec, dict(sizes), world):
            rec = self._recorded(sizes, count, world, symbolic=False)
            domain = (*domain, *(sympy.Eq(self.symbols[n], v) for n, v in sizes))
        return self.kept_in(rec), (*domain, *(g.expr for g in rec.guards)), count

    def kept_in(self, rec: StepRecord) -> list[tuple[str, Any, str, int | None]]:
        """What autograd keeps at the forward's end of ``rec``, a step of this module: ``(module, bytes, op, block)``
        per storage (:meth:`kept`)."""
        # the blocks as recorded: written out to another count (with_layers) or the module's own
        children = dict(rec.layers) if rec.layers is not None else \
            {c: i for i, c in enumerate(self.repeat[1] if self.repeat is not None else ())}
        return [(s.module, s.nbytes, s.op or "", _block(s.module, children)) for s in _kept_at_forward_end(rec)]

    def like(self, module: Any, inputs: Any, symbols: dict[str, sympy.Symbol], values: dict[str, int]
             ) -> TensorStepPeak:
        """This step for ``module`` (the same kind of module built at other sizes) at the same ``t``: its own plan,
        no layer count symbol (records are made at the counts asked for)."""
        world = self._fixed({})[2]
        plan = plan_of(module, self.sequence)
        return TensorStepPeak(module, inputs, symbols, values, self.options, self.device, None, None, self.repeat,
                              None, numbers={T: world}, plan=plan, sequence=self.sequence)

    def symbolic_record(self, count: int | None) -> StepRecord:
        """The rank's step with ``count`` layers (None: the module's own), the declared sizes symbolic; refused in
        one line where a guard pins a size."""
        sizes, own, world = self._fixed({})
        rec = self._recorded(sizes, count if count is not None else own, world, symbolic=True)
        if self._pinned(rec, dict(sizes), world):
            raise SymmemError(f"the tensor-parallel step at {dict(sizes)} pins a declared size (its guards: "
                              f"{', '.join(str(g.expr) for g in rec.guards)}): no formula in the sizes")
        return rec

    def per_rank(self, numbers: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Every rank's steady-step peak at ``numbers`` (all alike: the plan splits evenly), and the rank named."""
        merged = {**self.numbers, **dict(numbers)}
        value = int(self.peak(merged).value(merged))
        return {"peak_per_rank": [value] * self._fixed(merged)[2], "peak_rank": 0}


#: what a step holds at the forward's end that is not what autograd keeps for backward
_NOT_KEPT = frozenset({"parameter", "buffer", "input", "output", "gradient", "optimizer_state"})


def _kept_at_forward_end(rec: StepRecord) -> list[Any]:
    """The storages the forward of ``rec`` (the module's call) made that are alive after the loss, when the loop
    has let go of the module's output: those autograd keeps (what the loss itself keeps is not counted: a traced
    module's ledger has no loss), not the parameters or the inputs (a storage DTensor's wrapper saves is a
    temporary in the tracker's words: alive there, it is kept), nor funcol's ``AsyncCollectiveTensor`` wrapper,
    which holds no data of its own (the collective's output inside it is counted: what autograd keeps is one
    storage, as the real ranks' saved tensors show)."""
    last = max((o.index for o in rec.ops if o.phase in ("forward", "loss")), default=-1)
    alive = set(rec.start) - set(rec.freed_first)
    for o in rec.ops[:last + 1]:
        alive |= set(o.born)
        alive -= set(o.freed)
    return [rec.storages[i] for i in sorted(alive) if rec.storages[i].category not in _NOT_KEPT
            and rec.storages[i].phase != "loss" and "_wrap_tensor_autograd" not in (rec.storages[i].op or "")]


def _block(module: str, children: Mapping[str, int]) -> int | None:
    """Which of the repeated blocks ``children`` (path -> index) ``module`` is in (None: none)."""
    for child, i in children.items():
        if module == child or module.startswith(child + "."):
            return i
    return None


def _alike(found: list[tuple[str, Any, str, int | None]]) -> bool:
    """Whether every repeated block of ``found`` (:meth:`TensorStepPeak.kept`) keeps the same bytes (and there are
    blocks)."""
    blocks: dict[int, list[Any]] = {}
    for _, nbytes, _, i in found:
        if i is not None:
            blocks.setdefault(i, []).append(nbytes)
    return bool(blocks) and all(b == blocks.get(0) for b in blocks.values())


def rank_storages(step: Any, layers: sympy.Symbol | None, per_layer: bool) -> tuple[list[Storage], tuple[Any, ...]]:
    """The rank's kept storages of ``step`` (a :class:`TensorStepPeak`, or the step in every size under tensor
    parallelism: its ``kept()``) as a traced ledger's (a repeated block's folded to block 0, counted ``layers``
    times, where every block keeps the same bytes; else the blocks written out at the layer count the step was
    recorded at), and where they hold."""
    found, domain, count = step.kept()
    fold = layers is not None and _alike(found)
    if layers is not None and not fold and step.symbol is not None and count is not None:
        if per_layer:
            raise SymmemError("the repeated blocks keep different bytes on a rank, so there is no per-layer formula")
        domain = (*domain, sympy.Eq(step.symbol, count))
    storages: list[Storage] = []
    seen: dict[str, int] = {}
    for module, nbytes, op, i in found:
        in_block = fold and i == 0
        if (fold and i not in (None, 0)) or (per_layer and not in_block):
            continue
        # named as the ledger names a folded block's storages: blocks.0.norm -> blocks.L.norm
        where = f"{step.repeat[0]}.L{module[len(step.repeat[1][0]):]}" if in_block and step.repeat else \
            (module or "model")
        base = f"{where}:{op.split('.')[1] if op.count('.') >= 2 else op or 'kept'}"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        times = layers if in_block and not per_layer else sympy.Integer(1)
        expr = sympy.sympify(nbytes, strict=True)  # a recorded size: an int or a sympy expression
        group = "layer" if in_block else ".".join(module.split(".")[:2]) or "model"
        storages.append(Storage(name, group, "activation",
                                expr if times == 1 else times * expr, None, name, None, None, times, (name,),
                                "forward", "backward"))
    return storages, domain


def tensor_step(step: StepPeak, regime: Any) -> Any:
    """``step`` (the single-device one) as one tensor-parallel rank's, or a :class:`~symmem.step.Refused`."""
    from ..step import Refused

    why = refusal(step.options, step.device, step.module)
    if why is not None:
        return Refused(why)
    try:
        plan = plan_of(step.module, regime.sequence_parallel)
    except SymmemError as exc:
        return Refused(str(exc))
    fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(StepPeak) if not f.name.startswith("_")}
    fields["notes"] = [*step.notes, f"tensor parallel: {plan.source}, one rank's step recorded on fake DTensors "
                                    "(every rank alike), folded in the layer count where the blocks repeat, at the "
                                    "t of the derivation"]
    return TensorStepPeak(**fields, plan=plan, sequence=regime.sequence_parallel)
