"""A whole training step of a real module on fake tensors: the live bytes after every op, as sympy sums.

:func:`record_step` runs what :func:`symmem.record.steps.track_step` runs on real tensors -- the forward, the loss
(``sum``, ``cross-entropy`` against a target, or the module's own: ``output``), ``backward()``,
``optimizer.step()`` (sgd, sgd-momentum, adam, adamw; for-loop, foreach or fused) and
``zero_grad(set_to_none=True)`` -- on fake tensors whose declared sizes are symbols (:mod:`.fake`), with the
parameters, buffers and optimizer state fake too.  The tracker's live-bytes recorder
(:class:`~symmem.record.live_bytes.LiveRecorder`, reading symbolic sizes) sees every aten op (through the
:class:`~symmem.record.saved_tensors.SavedRecorder`'s dispatch mode, which also numbers ops, answers value reads and
routes ``constant_pad_nd`` to its decomposition): each new storage is registered once with its symbolic
``nbytes()`` and freed through ``weakref.finalize`` on its ``UntypedStorage``.  Fake storages are real
``StorageImpl`` objects (on the meta device, with symbolic sizes) that PyTorch keeps paired with their Python
objects as for real ones, so the finalizers fire when the last reference goes -- the same moments as on real
tensors (``test_fake_storages_are_freed_like_real_ones``).

Categories follow the tracker (a storage keeps the first that applies over its whole life: parameter, buffer,
input, optimizer_state, gradient, saved, output, activation_grad, temporary) and are reported in the step's
(:data:`symmem.categories.RECORDED_TO_STEP`: buffer counts as parameter, saved as activation, output -- the
module's output and the loss, held by the loop -- as loss).

One recorded run gives both steps: the forward and backward are run once (``micro_batches`` times), then
``optimizer.step()`` twice on the same gradients -- the first creates the state, the second is a steady step --
then ``zero_grad``.  A steady step's forward and backward hold what the first's did plus the optimizer state.
:meth:`StepRecord.as_timeline` gives either step as a :class:`~symmem.timeline.Timeline`, the one model of time.

:func:`symmem.importer.traced_step.peak_of` turns one or more records into a :class:`symmem.peak.Peak`: every op after
which something is freed (and the last) is a candidate moment; those another provably exceeds are dropped with
the one peak algebra (:mod:`symmem.peak`: coefficients after shifting every symbol to ``x' + 1``), and the peak is
the ``Max`` of the rest.  Records at 4 and 5 layers of the repeated blocks (:func:`symmem.importer.wrap.with_layers`)
are interpolated moment by moment into formulas in ``L`` and checked against a record at 6 layers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import sympy

from ..categories import RECORDED_TO_STEP
from ..errors import SymmemError
from ..options import LOSSES
from ..record.identity import first_tensor, op_name, symbolic_nbytes
from ..record.identity import tensors as _leaves
from ..record.live_bytes import LiveRecorder
from ..record.optim import IMPLS, OPTIMIZERS, make_optimizer, state_tensors
from ..record.saved_tensors import SavedRecorder
from ..record.steps import loss_value
from ..timeline import CUDA_BLOCK, Event, Live, Row, Timeline, Which
from . import kernel_temporaries
from .inputs import Inputs
from .traced_zero import RankOptimizer

#: the optimizer step's fake ops go through PyTorch's fake-op cache (False: every op computed, for comparisons)
CACHE_STEP = True


@dataclass(frozen=True)
class LiveStorage:
    """One storage of the step: bytes (sympy, in the declared symbols), category (the tracker's), and where it
    was made (None: live at the start); ``host``: a CPU tensor of a step that runs on CUDA (Adam's step counts,
    the memory-efficient attention's Philox scalars), outside what CUDA's allocator counts."""

    sid: int
    nbytes: Any
    category: str
    dtype: str
    op: str | None
    where: str
    module: str
    step: int
    phase: str
    host: bool = False


@dataclass(frozen=True)
class StepOp:
    """One aten op of the step: where it ran, the storages it made, and those freed after it (before the next)."""

    index: int
    step: int
    phase: str
    op: str
    where: str
    module: str
    born: tuple[int, ...]
    freed: tuple[int, ...]
    resized: tuple[tuple[int, Any], ...] = ()  # (sid, new bytes): storages an op grew in place


@dataclass(frozen=True)
class StepRecord:
    """What one recorded step did: its storages, what was live at the start, and every op in order.

    Ops of phase ``forward``, ``loss`` and ``backward`` are one forward and backward (step 1); ``step`` ops of
    step 1 are the first ``optimizer.step()`` (which creates the state), of step 2 a steady one.
    ``layers`` maps a child of the repeated blocks (its path) to its index in the run, when the run was
    written out (``count`` children).
    """

    storages: tuple[LiveStorage, ...]
    start: tuple[int, ...]
    ops: tuple[StepOp, ...]
    freed_first: tuple[int, ...] = ()  # freed before the first op
    layers: Mapping[str, int] | None = None
    count: int | None = None
    notes: tuple[str, ...] = ()
    guards: tuple[Any, ...] = ()
    #: op index -> the parameters' storages a forward or loss op read (recorded with ``StepOptions.reads``; None
    #: without): which stage reads a parameter, against the stage of its module (:mod:`.traced_pipeline`)
    reads: Mapping[int, tuple[int, ...]] | None = None

    def category(self, sid: int) -> str:
        """Storage ``sid``'s category in the step's vocabulary (:data:`symmem.categories.STEP`)."""
        return RECORDED_TO_STEP[self.storages[sid].category]

    def in_step(self, o: StepOp, step: Which) -> bool:
        """Whether op ``o`` belongs to the ``first`` or the ``steady`` step (the forward and backward to both)."""
        if o.phase != "step":
            return True
        return o.step == (1 if step == "first" else 2)

    def state(self) -> list[int]:
        """The optimizer state alive after the first ``optimizer.step()``."""
        alive = set(self.start) - set(self.freed_first)
        last = max((o.index for o in self.ops if o.phase == "step" and o.step == 1), default=-1)
        for o in self.ops[:last + 1]:
            alive |= set(o.born)
            alive -= set(o.freed)
        return sorted(i for i in alive if self.storages[i].category == "optimizer_state")

    def as_timeline(self, step: Which) -> Timeline:
        """The ``first`` or ``steady`` step as a :class:`~symmem.timeline.Timeline`, one event per op (cached).

        The run holds one forward and backward and two optimizer steps: the first step's timeline runs the second
        optimizer step without showing it; a steady one starts with the optimizer state the first step made (so
        its forward and backward hold it) and runs the first optimizer step without showing it.
        """
        cache = self.__dict__.setdefault("_timelines", {})
        if step not in cache:
            state = set(self.state()) if step == "steady" else set()
            gone = set(self.freed_first)
            storages = tuple(Live(str(s.sid), self.category(s.sid), s.nbytes, s.where or None, s.host)
                             for s in self.storages)
            start = tuple(dict.fromkeys([*(i for i in self.start if i not in gone), *sorted(state)]))
            events = tuple(Event(o.phase, o.where or None, tuple(i for i in o.born if i not in state), o.freed,
                                 o.resized, self.in_step(o, step)) for o in self.ops)
            cache[step] = Timeline(storages, start, events)
        return cache[step]

    def allocated(self, step: Which, values: Mapping[sympy.Symbol, int], block: int = CUDA_BLOCK) -> int:
        """The peak of ``step`` at ``values`` with every storage rounded up to ``block`` bytes, as CUDA's caching
        allocator rounds its blocks (what ``torch.cuda.max_memory_allocated`` reports before workspaces)."""
        return self.as_timeline(step).allocated(values, block)

    def timeline(self, step: Which, values: Mapping[sympy.Symbol, int]) -> list[Row]:
        """(phase, where, live bytes per category) after every op of ``step``, at ``values``."""
        return self.as_timeline(step).rows(values)


class _StepRecorder(SavedRecorder):
    """One training step on fake tensors: the saved-tensor recorder runs the step (numbers ops, answers value reads,
    routes overrides) and a live-bytes recorder with symbolic sizes observes every op."""

    def __init__(self, *args: Any, on_gpu: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.modules.tag = True  # the backward's ops are named after the module whose output a node made
        live = LiveRecorder(symbolic_nbytes, self.modules, unnamed_to_last=True, phase="start", pack=self._pack)
        self.live = live
        self.on_gpu = on_gpu  # the step runs on a GPU: its CPU tensors are host memory
        # a kernel's own temporaries, where the step's device has any (no cost per op elsewhere)
        self.observe = _with_kernel_temporaries(live) if ("cuda" if on_gpu else "cpu") in kernel_temporaries.DEVICES \
            else live.observe
        # what record_step drives is the live recorder's
        self.register, self.label, self.in_phase = live.register, live.label, live.phase
        self.saving, self.watch_backward, self.events = live.saving, live.watch_backward, live.events

    def record(self, convert: Callable[[Any], Any], layers: Mapping[str, int] | None, count: int | None,
               notes: list[str], guards: list[Any]) -> StepRecord:
        self.live.close()
        memo: dict[Any, Any] = {}

        def conv(raw: Any) -> Any:
            if raw not in memo:
                memo[raw] = convert(raw)
            return memo[raw]

        storages = [LiveStorage(s.sid, conv(s.first), s.category(), s.dtype, s.op, s.where, s.module, s.step,
                                s.phase, s.host and self.on_gpu) for s in self.live.storages]
        start: list[int] = []
        freed_first: list[int] = []
        ops: list[StepOp] = []
        pending: list[int] = []
        for ev in self.live.events:
            if ev[0] == "start":
                start.append(ev[1])
            elif ev[0] == "free":
                if ops:
                    pending.append(ev[1])
                else:
                    freed_first.append(ev[1])
            elif ev[0] == "op":
                if ops and pending:
                    ops[-1] = _with_freed(ops[-1], pending)
                pending = []
                _, step, phase, op, where, module, born, resized = ev
                ops.append(StepOp(len(ops), step, phase, op, where, module, born, (),
                                  tuple((s, conv(r)) for s, r in resized)))
        if ops and pending:
            ops[-1] = _with_freed(ops[-1], pending)
        return StepRecord(tuple(storages), tuple(start), tuple(ops), tuple(freed_first), layers, count,
                          tuple(notes), tuple(guards))


def _with_kernel_temporaries(live: LiveRecorder) -> Callable[[Any, Any, Any, Any], None]:
    """``live.observe``, then the tensors the op's CUDA kernel makes and frees inside it (:mod:`.kernel_temporaries`:
    softmax backward's ``tmp``), which no dispatch mode sees, counted as the built-in graphs count them."""
    cuda_temporaries = kernel_temporaries.cuda_temporaries

    def observe(func: Any, args: Any, kwargs: Any, out: Any) -> None:
        live.observe(func, args, kwargs, out)
        for t in cuda_temporaries(op_name(func), args):
            live.transient(t.nbytes, t.dtype, t.shape)

    return observe


def _with_freed(o: StepOp, freed: list[int]) -> StepOp:
    return StepOp(o.index, o.step, o.phase, o.op, o.where, o.module, o.born, o.freed + tuple(freed), o.resized)


@dataclass(frozen=True)
class StepOptions:
    """How the step runs: the loss, the optimizer, what the loop holds, and how the module is wrapped."""

    loss: str | Callable[[Any], Any] = "sum"
    optimizer: str = "sgd"
    impl: str = "for-loop"
    keep_output: bool = True
    micro_batches: int = 1
    autocast: str | None = None
    checkpoint: tuple[str, ...] = ()
    #: ``ZeroRedundancyOptimizer``'s rank: the trainable parameters its local optimizer steps (indices, in its
    #: order; :class:`~symmem.importer.traced_zero.RankOptimizer`); None: one optimizer over every one
    owned: tuple[int, ...] | None = None
    #: groups of a tied parameter's names that get a parameter of their own, one a group (a pipeline stage's copy
    #: of a tied head: :mod:`symmem.importer.traced_pipeline`); () keeps every tie
    untie: tuple[tuple[str, ...], ...] = ()
    #: note which parameters each forward and loss op reads (:attr:`StepRecord.reads`; off: no cost per op)
    reads: bool = False

    def __post_init__(self) -> None:
        if not callable(self.loss) and self.loss not in LOSSES:
            raise SymmemError(f"loss must be one of {', '.join(LOSSES)} or a callable, got {self.loss!r}")
        if self.optimizer not in OPTIMIZERS:
            raise SymmemError(f"the step of a traced module runs torch.optim: optimizer must be one of "
                              f"{', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.impl not in IMPLS:
            raise SymmemError(f"optimizer implementation must be one of {', '.join(IMPLS)}, got {self.impl!r}")


@dataclass
class SharedWorld:
    """A fake world (ShapeEnv and mode) and shape cache that records of one set of sizes share: ``world`` is made by
    the first record (:func:`record_step`'s ``shared``).  Its ShapeEnv then holds every record's guards, which are the
    same ops' guards on the same symbols; each record reports them all."""

    world: Any = None
    shapes: Any = None
    #: the records made or answered in this world (:class:`symmem.importer.step_cache.Chain`; None before the first)
    chain: Any = None
    #: the world is a fit's, other traces ran in it too (:class:`symmem.importer.fit_world.Lease`; None: its own)
    lease: Any = None


def record_step(module: Any, inputs: Inputs, values: dict[str, int], symbols: dict[str, sympy.Symbol],
                options: StepOptions, *, device: str = "cpu", replay: list[tuple[str, Any]] | None = None,
                multiple_of: dict[str, int] | None = None, concrete: tuple[str, ...] = (),
                layers: tuple[str, tuple[str, ...], int] | None = None, shared: SharedWorld | None = None
                ) -> StepRecord:
    """One training step (forward, loss, backward, two optimizer steps, zero_grad) of ``module`` on fake tensors
    whose declared sizes are symbolic (those in ``concrete`` at their ``values``).  ``layers`` =
    (container, children, count) writes the run of repeated children out ``count`` times; ``replay`` answers
    the forward's value reads (from a real forward at the example sizes).  ``shared`` (:class:`SharedWorld`) runs the
    step in the fake world and shape cache of earlier records of the same sizes: the same ops on the same symbolic
    shapes (the records at 4, 5 and 6 layers of the fold) are then computed once for all of them."""
    import torch
    from torch.nn.utils.stateless import _reparametrize_module

    from .fake import every_parameter, fake_inputs, fake_state, make_world, opaque_ops, overrides, quiet_meta_errors
    from .guards import GuardLog, collect
    from .hf import eager_predicates
    from .runs import _input_names, _keys, converter, resized, tidy
    from .wrap import autocasting, checkpointed, with_layers

    notes: list[str] = []
    if shared is not None and shared.world is None:
        shared.world = make_world(values, multiple_of=multiple_of, concrete=concrete)
    world = shared.world if shared is not None else make_world(values, multiple_of=multiple_of, concrete=concrete)
    mapping = world.mapping(symbols)
    at = resized(inputs, values) if concrete else inputs
    with ExitStack() as stack:
        index: dict[str, int] | None = None
        if layers is not None:
            container, children, count = layers
            index = stack.enter_context(with_layers(module, container, children, count))
            if count > len(children):
                replay = None  # copies of a layer may read values the real forward never read
        with world.mode:
            fin = fake_inputs(world, at, device)
            params, buffers = fake_state(module, device, options.untie)
        pkeys = _keys([*params.items(), *buffers.items()])
        rec = _StepRecorder(module, params=pkeys, inputs=_keys(_input_names(at, fin)), overrides=overrides(),
                            replay=replay if replay is not None else [],
                            default_read=True if replay is None else None, shape_env=world.env,
                            opaque=opaque_ops(), on_gpu=not str(device).startswith("cpu"))
        reads = _watch_reads(rec, _keys(params.items())) if options.reads else None
        if shared is not None and rec.shapes is not None:
            if shared.shapes is None:
                shared.shapes = rec.shapes
            rec.shapes = shared.shapes
        if rec.shapes is not None:  # the remembered size arithmetic installed once for the step: each hit switches it
            stack.enter_context(rec.shapes.memo.installed())  # on (off elsewhere: PyTorch's own methods answer)
        world.mode.cache_enabled = False  # PyTorch's fake-op cache: the optimizer step's only (below)
        site = lambda: (rec.current, f"{rec.fn} ({rec.aten})")  # noqa: E731
        if isinstance(world.env.guards, GuardLog):  # a shared world: its log holds the earlier records' guards
            world.env.guards.site = site
        else:
            world.env.guards = GuardLog(site)
        args, kwargs = at.rebuild(fin)
        trainable = [p for p in params.values() if p.requires_grad]
        opt = make_optimizer(trainable, options.optimizer, options.impl) if options.owned is None else \
            RankOptimizer(trainable, options.owned, options.optimizer, options.impl)
        names = {id(p): n for n, p in params.items()}
        rec.register(params.values(), "parameter")
        rec.register(buffers.values(), "buffer")
        rec.register([t for t in _leaves([args, kwargs])], "input")
        grad_hooks = [p.register_post_accumulate_grad_hook(lambda p: rec.label([p.grad], "gradient"))
                      for p in trainable]
        stack.callback(lambda: [h.remove() for h in grad_hooks])
        if options.checkpoint:
            stack.enter_context(checkpointed(module, options.checkpoint if layers is None else
                                             _checkpointed_children(options.checkpoint, layers, index)))
        # untied groups: every name given its own or its first name's fake, as the stages' modules hold them
        named = every_parameter(module, params, options.untie) if options.untie else params
        stack.enter_context(_reparametrize_module(module, {**named, **buffers}, tie_weights=not options.untie))
        stack.enter_context(rec.modules)
        functions, ops = rec._modes()
        rec._peek = torch.autograd._get_sequence_nr
        stack.enter_context(functions)
        stack.enter_context(ops)
        stack.enter_context(world.mode)
        stack.enter_context(eager_predicates())
        stack.enter_context(quiet_meta_errors())
        target = None
        for _ in range(options.micro_batches):
            rec.reads = []
            with rec.in_phase(1, "forward"), rec.saving(), autocasting(options.autocast, device):
                out = rec._guarded(functools.partial(module, *args, **kwargs))
            with rec.in_phase(1, "loss"), rec.saving(), autocasting(options.autocast, device):
                if options.loss == "cross-entropy" and target is None:
                    rec.quiet = True
                    try:
                        target = torch.empty(tuple(first_tensor(out).shape[:-1]), dtype=torch.long, device=device)
                    finally:
                        rec.quiet = False
                    rec.register([target], "input")
                    rec.events.insert(0, rec.events.pop())  # the target exists from the start, as the batch
                value = loss_value(options.loss, out, target)
                if not options.keep_output:
                    out = None
            with rec.in_phase(1, "backward"):
                rec.label([*(_leaves(out) if out is not None else []), value], "output")
                handles = rec.watch_backward(value)
                rec._guarded(value.backward)
                for h in handles:
                    h.remove()
                rec.label([p.grad for p in trainable], "gradient")
                del out, value, handles
        # The optimizer step repeats one elementwise update per parameter: where parameters share a shape (a
        # block's), PyTorch's fake-op cache answers the repeats (make_world turns it off for the forward, whose
        # symbolic shapes mostly miss it); it remakes the same metadata, so the step's storages are the same.
        world.mode.cache_enabled = CACHE_STEP
        for step in (1, 2):
            with rec.in_phase(step, "step"):
                rec.live.name_parameters(((names[id(p)], t) for p in trainable
                                          for t in (p, p.grad, *opt.state.get(p, {}).values())
                                          if isinstance(t, torch.Tensor)), reset=True)
                rec._guarded(opt.step)
                rec.label(state_tensors(opt), "optimizer_state")
        with rec.in_phase(2, "zero_grad"):
            opt.zero_grad(set_to_none=True)
        del opt, trainable, params, buffers, fin, args, kwargs, target
    guards = collect(world.env, mapping, tidy)
    convert = converter(world.env, mapping)
    notes += rec.assumed
    out = rec.record(convert, index, layers[2] if layers is not None else None, notes, guards)
    return out if reads is None else dataclasses.replace(out, reads=reads)


def _watch_reads(rec: _StepRecorder, params: Mapping[int, str]) -> dict[int, tuple[int, ...]]:
    """Op index -> the parameters' storages (sids) it reads, for every forward and loss op from now on: the
    recorder's ``observe`` wrapped (an op's index is the live recorder's count before it)."""
    live, inner = rec.live, rec.observe
    reads: dict[int, tuple[int, ...]] = {}

    def observe(func: Any, args: Any, kwargs: Any, out: Any) -> None:
        if live.phase_name in ("forward", "loss"):
            found = [live.by_key[k] for k in live._keys(args, kwargs) if k in params and k in live.by_key]
            if found:
                reads[live.ops] = tuple(sorted(found))
        inner(func, args, kwargs, out)  # type: ignore[misc]

    rec.observe = observe
    return reads


def _checkpointed_children(children: Sequence[str], layers: tuple[str, tuple[str, ...], int],
                           index: Mapping[str, int] | None) -> tuple[str, ...]:
    """The children to checkpoint once the repeat is written out: every child of the run if the original run's
    children were checkpointed, plus any other child named."""
    run = set(layers[1])
    others = tuple(c for c in children if c not in run)
    return (*others, *(index or {} if run & set(children) else ()))
