"""The exact live memory of a real training step on CPU, op by op: the truth for symbolic peak formulas.

:class:`LiveTracker` is a ``TorchDispatchMode`` that sees every ATen op PyTorch runs while it is active --
the forward, the backward (on CPU the autograd engine runs in the calling thread and carries the mode with
it) and the optimizer step.  After each op it registers every output storage it has not seen (keyed by the
storage's identity, so views and in-place ops add nothing) and attaches a ``weakref.finalize`` to the
storage's Python object; since PyTorch keeps a storage's Python object alive exactly as long as the C++
storage (PyObject preservation), the finalizer fires when the memory is released, whoever held it last (a
view, autograd's saved variables, the engine's gradient buffers).  Storages that exist before tracking
(parameters, buffers, the batch) are registered explicitly as *live at start*.

Every storage gets one **category** for its whole life, the first that applies in this order:

``parameter``, ``buffer``, ``input``
    registered at start (the batch and a target are ``input``);
``optimizer_state``
    found in ``optimizer.state`` after the step (the momentum buffer SGD clones from the gradient in the first
    step is optimizer state from its birth);
``gradient``
    was ever some parameter's ``.grad`` (post-accumulate-grad hooks, and a scan after backward);
``saved``
    packed by autograd for backward (``saved_tensors_hooks``), whether saved by the op that made it or later;
``output``
    the module's output, held by the caller until the end of backward;
``activation_grad``
    a gradient flowing between autograd nodes (seen by a pre-hook and a hook on every node of the graph: what a
    node receives and what it produces, before the engine sums two gradients at a fork);
``temporary``
    anything else: intermediates of the forward and of backward formulas, optimizer temporaries;
``external``
    a storage made outside the mode and first seen as an op's aliased output (should not happen; reported).

The timeline is one :class:`OpRecord` per op, with the live bytes right after the op (its outputs counted;
its inputs are still referenced while it runs, so that is the most the op needs) and the bytes per category.
Frees between ops lower the next record.  :func:`track_step` runs whole training steps under the tracker and
returns a :class:`StepTrace`: the peak and where it occurs, the peak of the first and of the steady step,
and live bytes at phase boundaries.  What the mode cannot see: memory a kernel allocates and frees inside
one op (``aten::mm``'s contiguous copies, convolution workspaces); ``allocator=True`` also runs the step
under the PyTorch profiler's allocator events to measure that (:class:`AllocatorPeaks`).  Needs ``torch``
(imported lazily; this module imports without it).

>>> torch = getattr(__import__("pytest"), "importorskip")("torch")
>>> trace = track_step(torch.nn.Linear(4, 3), torch.zeros(2, 4), optimizer="sgd", steps=1)
>>> trace.start.live, trace.peak.bytes   # W 48 + b 12 + x 32; peak: + y 24 + loss 4 + seed 4 + dW 48 + db 12
(92, 184)
>>> trace.peak.phase, trace.peak.op, trace.peak.record.bytes("gradient")   # db is born last: sum over the batch
('backward', 'aten.sum.dim_IntList', 60)
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from .errors import SymmemError

#: storage categories, in priority order (a storage takes the first that applies)
CATEGORIES: tuple[str, ...] = ("parameter", "buffer", "input", "optimizer_state", "gradient", "saved", "output",
                               "activation_grad", "temporary", "external")
#: the phases of one training step, in order
PHASES: tuple[str, ...] = ("forward", "loss", "backward", "step", "zero_grad")
_RANK = {c: i for i, c in enumerate(CATEGORIES)}
_BIRTH_OPS = ("aten.lift_fresh.default", "aten.lift.default")  # torch.tensor(...) data made before dispatch
MODULE_KEY = "symmem.module"  # autograd node metadata: the module whose output the node made


@dataclass(frozen=True)
class StorageInfo:
    """One storage the tracker saw: its bytes, category, and the op that made it (``None`` if live at start).

    ``born`` and ``died`` are record indices: born in record ``born``, freed after record ``died - 1`` and
    before record ``died`` (``died`` is ``len(records)`` for a storage freed after the last op, ``None`` for
    one alive when tracking ended).  ``nbytes`` is the largest size the storage had.
    """

    sid: int
    nbytes: int
    category: str
    dtype: str
    shape: tuple[int, ...]
    born: int | None
    died: int | None
    op: str | None
    where: str
    step: int
    phase: str


@dataclass(frozen=True)
class OpRecord:
    """The state right after one op: live bytes, bytes per category, and what this op allocated.

    ``where`` is the innermost module in the forward (its qualified name, ``""`` for the top), the autograd
    node in backward (``ConvolutionBackward0``; accumulating two gradients at a fork runs under the node that
    produced the second), the parameter an op updates in the optimizer step (``foreach`` for multi-tensor ops).
    ``module`` is the innermost module running in the forward; in backward, the module whose output node was the
    last node entered that had one (``track_step`` tags them), so the nodes inside a module inherit its name.
    ``allocated`` counts storages born in this op (and storage growth), ``freed`` the bytes released since the
    previous record.
    """

    index: int
    step: int
    phase: str
    op: str
    where: str
    allocated: int
    freed: int
    live: int
    by_category: tuple[tuple[str, int], ...]
    born: tuple[int, ...] = ()
    module: str = ""

    def bytes(self, category: str) -> int:
        """Live bytes of one category at this record."""
        return dict(self.by_category).get(category, 0)


@dataclass(frozen=True)
class Boundary:
    """Live bytes when a phase of a step ends (``phase`` ``start`` for the state before tracking)."""

    step: int
    phase: str
    index: int
    live: int
    by_category: tuple[tuple[str, int], ...]

    def bytes(self, category: str) -> int:
        return dict(self.by_category).get(category, 0)


@dataclass(frozen=True)
class Peak:
    """The largest live bytes and where: the record, and every storage alive then."""

    bytes: int
    record: OpRecord
    alive: tuple[StorageInfo, ...]

    @property
    def phase(self) -> str:
        return self.record.phase

    @property
    def op(self) -> str:
        return self.record.op

    @property
    def step(self) -> int:
        return self.record.step

    @property
    def where(self) -> str:
        return self.record.where

    @property
    def index(self) -> int:
        return self.record.index

    @property
    def by_category(self) -> tuple[tuple[str, int], ...]:
        return self.record.by_category


@dataclass(frozen=True)
class AllocatorPeaks:
    """The CPU allocator's own view of the same run (profiler memory events), per step and phase.

    ``live_at_start`` plus the allocator's running total gives live bytes including memory allocated and freed
    inside one op, which the dispatch mode cannot see.  ``peaks`` maps ``(step, phase)`` to the largest live
    bytes right after an allocation during that phase (a phase that only frees has none); ``events`` counts the
    allocation and free events.
    """

    live_at_start: int
    peaks: tuple[tuple[tuple[int, str], int], ...]
    events: int
    #: ``(op, count, most bytes)``: ops that allocated memory and freed it before returning (profiler names,
    #: ``aten::convolution``), how often, and the most any one of them held above its outputs (only ops seen by
    #: a tracker's dispatch mode: empty for :func:`allocator_step`)
    hidden: tuple[tuple[str, int, int], ...] = ()

    def peak(self, step: int | None = None, phase: str | None = None) -> int:
        """The largest live bytes over the run, a step, or one phase of a step."""
        values = [v for (s, p), v in self.peaks if (step is None or s == step) and (phase is None or p == phase)]
        if not values:
            raise SymmemError(f"no allocator events for step {step}, phase {phase}")
        return max(values)


@dataclass(frozen=True)
class StepTrace:
    """The timeline of tracked training steps, with peaks and phase boundaries (steps numbered from 1)."""

    records: tuple[OpRecord, ...]
    storages: tuple[StorageInfo, ...]
    boundaries: tuple[Boundary, ...]
    steps: int
    allocator: AllocatorPeaks | None = None
    #: storages still alive when tracking ended that are not parameters, buffers, inputs, gradients or state
    leaked: tuple[StorageInfo, ...] = field(default=())

    @property
    def start(self) -> Boundary:
        """Live bytes before the first op: what was registered as live at start."""
        return self.boundaries[0]

    def boundary(self, step: int, phase: str) -> Boundary:
        """The state when ``phase`` of ``step`` ended (``loss`` equals ``forward`` when the model computes it)."""
        for b in self.boundaries:
            if b.step == step and b.phase == phase:
                return b
        raise SymmemError(f"no boundary for step {step}, phase {phase!r}; phases: {', '.join(PHASES)}")

    def live_at(self, step: int, phase: str) -> int:
        """Live bytes at the end of ``phase`` of ``step``."""
        return self.boundary(step, phase).live

    def peak_of(self, step: int | None = None, phase: str | None = None) -> Peak:
        """The peak over all records, or over one step, or one phase of one step (the first record if tied)."""
        chosen = [r for r in self.records if (step is None or r.step == step) and (phase is None or r.phase == phase)]
        if not chosen:
            raise SymmemError(f"no ops recorded for step {step}, phase {phase!r}")
        best = max(chosen, key=lambda r: (r.live, -r.index))
        return Peak(best.live, best, self.alive_at(best.index))

    @property
    def peak(self) -> Peak:
        """The peak of the whole run."""
        return self.peak_of()

    @property
    def first(self) -> Peak:
        """The peak of the first step (optimizer state is created inside it)."""
        return self.peak_of(1)

    @property
    def steady(self) -> Peak:
        """The peak of the last step (the steady state when ``steps >= 2``)."""
        return self.peak_of(self.steps)

    def alive_at(self, index: int) -> tuple[StorageInfo, ...]:
        """The storages alive right after record ``index``, largest first."""
        alive = [s for s in self.storages
                 if (s.born is None or s.born <= index) and (s.died is None or s.died > index)]
        return tuple(sorted(alive, key=lambda s: (-s.nbytes, s.sid)))

    def persistent(self, step: int) -> int:
        """The simple sum a formula would start from: activations saved for backward at the end of the forward
        (after the loss) + input + parameters and buffers + gradients at the end of backward + optimizer state
        after the step.  The module's output (held by the caller, not saved) is not in it."""
        loss = self.boundary(step, "loss")
        back = self.boundary(step, "backward")
        after = self.boundary(step, "step")
        return (loss.bytes("saved") + loss.bytes("input") + loss.bytes("parameter") + loss.bytes("buffer")
                + back.bytes("gradient") + after.bytes("optimizer_state"))

    def ratio(self, step: int) -> float:
        """Peak of ``step`` over :meth:`persistent` of ``step``."""
        return self.peak_of(step).bytes / self.persistent(step)

    def table(self, step: int | None = None, limit: int | None = None) -> str:
        """The timeline as text: index, step, phase, op, where, allocated, freed, live."""
        rows = [r for r in self.records if step is None or r.step == step][:limit]
        lines = [f"{'#':>5} {'step':>4} {'phase':<9} {'op':<38} {'where':<28} {'alloc':>10} {'freed':>10} "
                 f"{'live':>12}"]
        lines += [f"{r.index:>5} {r.step:>4} {r.phase:<9} {r.op:<38.38} {r.where:<28.28} {r.allocated:>10,} "
                  f"{r.freed:>10,} {r.live:>12,}" for r in rows]
        return "\n".join(lines)


# -- the tracker ---------------------------------------------------------------------------------------------
class _Storage:
    __slots__ = ("sid", "nbytes", "peak", "first", "labels", "dtype", "shape", "born", "died", "op", "where", "step",
                 "phase", "finalizer")

    def __init__(self, sid: int, nbytes: int, dtype: str, shape: tuple[int, ...], born: int | None, op: str | None,
                 where: str, step: int, phase: str) -> None:
        self.sid, self.nbytes, self.peak, self.first = sid, nbytes, nbytes, nbytes
        self.labels: set[str] = set()
        self.dtype, self.shape, self.born, self.died = dtype, shape, born, None
        self.op, self.where, self.step, self.phase = op, where, step, phase
        self.finalizer: Any = None

    def category(self) -> str:
        return min(self.labels, key=_RANK.__getitem__) if self.labels else "temporary"


def _require_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise SymmemError("tracking runs PyTorch, which is not installed: pip install torch==2.13.0 "
                          "(the CPU build), or pip install 'symmem[torch]'") from None
    return torch


def hook_backward(root: Any, enter: Callable[[str, Any, Any], None], leave: Callable[[Any], None]) -> list[Any]:
    """Hooks on every node of the autograd graph behind ``root``: ``enter(name, node, grad_outputs)`` before the
    node runs, ``leave(grad_inputs)`` after.  Returns the hook handles (remove them after backward).  The live-bytes
    tracker and the importer's fake step both name and label the backward this way."""
    handles: list[Any] = []
    seen: set[int] = set()
    todo = [root.grad_fn] if root.grad_fn is not None else []
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        name = node.name().removeprefix("torch::autograd::")

        def pre(grad_outputs: Any, name: str = name, node: Any = node) -> None:
            enter(name, node, grad_outputs)

        handles.append(node.register_prehook(pre))
        handles.append(node.register_hook(lambda grad_inputs, grad_outputs: leave(grad_inputs)))
        todo.extend(n for n, _ in node.next_functions)
    return handles


def _tensors(obj: Any) -> list[Any]:
    """Every tensor in a (nested) op output or argument."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor)]


class LiveTracker:
    """Count live storage bytes op by op while active (a context manager entering a ``TorchDispatchMode``).

    Use :func:`track_step` for whole training steps; for a loop of your own::

        tracker = LiveTracker()
        tracker.register(model.parameters(), "parameter")
        tracker.register([x], "input")
        with tracker, tracker.phase(1, "forward"), tracker.saving():
            loss = model(x).sum()
        ...
        trace = tracker.trace()

    >>> torch = getattr(__import__("pytest"), "importorskip")("torch")
    >>> x = torch.ones(8)                     # 32 bytes, live at start
    >>> tracker = LiveTracker()
    >>> tracker.register([x], "input")
    >>> with tracker, tracker.phase(1, "forward"):
    ...     y = x * 2                         # +32
    ...     z = y.view(2, 4)                  # a view: +0
    ...     del y, z                          # -32 once the view dies
    ...     w = x + 1                         # +32
    >>> [(r.op, r.allocated, r.live) for r in tracker.trace().records]
    [('aten.mul.Tensor', 32, 64), ('aten.view.default', 0, 64), ('aten.add.Tensor', 32, 64)]
    """

    def __init__(self) -> None:
        _require_torch()
        self._by_key: dict[int, _Storage] = {}  # live storages by the C++ storage address
        self._all: list[_Storage] = []
        self._events: list[tuple[Any, ...]] = []  # ("op", ...), ("free", sid), ("boundary", step, phase)
        self._ops = 0
        self._closed = False
        self.step, self.phase_name, self.where, self.module = 1, "forward", "", ""
        self._param_names: dict[int, str] = {}  # storage key -> parameter name, for the optimizer step
        self._mode: Any = None
        self._started = False

    # registration and labels
    def _key(self, t: Any) -> int:
        return int(t.untyped_storage()._cdata)

    def _new(self, t: Any, op: str | None) -> _Storage:
        st = t.untyped_storage()
        s = _Storage(len(self._all), int(st.nbytes()), str(t.dtype).removeprefix("torch."), tuple(t.shape),
                     self._ops if op is not None else None, op, self.where if op is not None else "",
                     self.step if op is not None else 0, self.phase_name if op is not None else "start")
        key = int(st._cdata)
        s.finalizer = weakref.finalize(st, self._freed, key, s)
        s.finalizer.atexit = False
        self._by_key[key] = s
        self._all.append(s)
        return s

    def _freed(self, key: int, s: _Storage) -> None:
        if self._closed:
            return
        if self._by_key.get(key) is s:
            del self._by_key[key]
        self._events.append(("free", s.sid))

    def register(self, tensors: Iterable[Any], category: str) -> None:
        """Count the storages of ``tensors`` (existing before tracking) as live from the start, in ``category``.

        Registering a storage twice (a tied weight, a view of the batch) counts it once; a storage already seen
        gets the label too.
        """
        if category not in _RANK:
            raise SymmemError(f"unknown category {category!r}; categories: {', '.join(CATEGORIES)}")
        for t in tensors:
            if t is None or t.untyped_storage().nbytes() == 0 and t.numel() == 0:
                continue
            key = self._key(t)
            s = self._by_key.get(key)
            if s is None:
                s = self._new(t, None)
                self._events.append(("start", s.sid))
            s.labels.add(category)

    def label(self, tensors: Iterable[Any], category: str) -> None:
        """Give the storages of ``tensors`` a category label (the highest-priority label wins, for their whole life)."""
        for t in tensors:
            if t is None:
                continue
            s = self._by_key.get(self._key(t))
            if s is not None:
                s.labels.add(category)

    def name_parameters(self, named: Iterable[tuple[str, Any]], reset: bool = False) -> None:
        """Name storages after parameters (``(name, tensor)`` pairs: the parameter, its gradient, its state):
        in the optimizer step and zero_grad an op is attributed to the first named storage among its inputs, and
        its outputs take that name.  ``reset`` forgets earlier names first (storage addresses are reused)."""
        if reset:
            self._param_names.clear()
        for name, p in named:
            self._param_names[self._key(p)] = name

    # phases
    def _boundary(self, step: int, phase: str) -> None:
        self._events.append(("boundary", step, phase))

    @contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        """Attribute the ops inside to ``name`` of ``step``; record live bytes when it ends."""
        self.step, self.phase_name, self.where, self.module = step, name, "", ""
        try:
            yield
        finally:
            self._boundary(step, name)
            self.where = self.module = ""

    # the dispatch mode
    def _after(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        op = str(func)
        if op.startswith("profiler."):  # record_function markers (Optimizer.step has them): no tensors
            return
        births: list[int] = []
        inputs: set[int] | None = None
        outs = _tensors(out)
        for t in outs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage (a sparse or nested tensor)
                continue
            key = int(st._cdata)
            s = self._by_key.get(key)
            if s is None:
                if inputs is None:
                    inputs = {self._key(a) for a in _tensors((args, kwargs)) if a.layout == t.layout}
                s = self._new(t, op)
                if key in inputs and op not in _BIRTH_OPS:
                    s.labels.add("external")  # an alias of memory made before tracking and never registered
                births.append(s.sid)
            else:
                n = int(st.nbytes())
                if n != s.nbytes:  # resized in place (out= arguments, resize_)
                    self._events.append(("resize", s.sid, n - s.nbytes))
                    s.nbytes = n
                    s.peak = max(s.peak, n)
        where = self.where
        if self.phase_name in ("step", "zero_grad") and self._param_names:
            if op.startswith("aten._foreach") or op.startswith("aten._fused"):
                where = "foreach"
            else:
                for a in _tensors((args, kwargs)):
                    name = self._param_names.get(self._key(a))
                    if name is not None:
                        where = name
                        for t in outs:  # what an op on a parameter's tensors makes belongs to that parameter
                            self._param_names[self._key(t)] = name
                        break
        self._events.append(("op", self.step, self.phase_name, op, where, self.module, tuple(births)))
        self._ops += 1

    def _make_mode(self) -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _LiveMode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                tracker._after(func, args, kwargs, out)
                return out

        return _LiveMode()

    def __enter__(self) -> LiveTracker:
        if self._closed:
            raise SymmemError("this tracker has finished; make a new one")
        if not self._started:  # what was registered so far is the state at start
            self._boundary(0, "start")
            self._started = True
        self._mode = self._make_mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._mode = None

    # autograd hooks
    @contextmanager
    def saving(self) -> Iterator[None]:
        """Label every storage autograd packs for backward ``saved`` (``saved_tensors_hooks``)."""
        import torch

        def pack(t: Any) -> Any:
            self.label([t], "saved")
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def watch_backward(self, root: Any) -> list[Any]:
        """Hooks on every node of the graph behind ``root``: name the running node, label the gradients it receives
        and the gradients it produces ``activation_grad``.  Returns the hook handles (remove them after backward)."""
        def enter(name: str, node: Any, grad_outputs: Any) -> None:
            self.where = name
            self.module = node.metadata.get(MODULE_KEY, self.module)
            self.label(_tensors(grad_outputs), "activation_grad")

        # post: before the engine sums the gradients at a fork
        return hook_backward(root, enter, lambda grad_inputs: self.label(_tensors(grad_inputs), "activation_grad"))

    def watch_gradients(self, params: Iterable[Any]) -> list[Any]:
        """Label each parameter's ``.grad`` ``gradient`` when it is accumulated; returns the hook handles."""
        def hook(p: Any) -> None:
            self.label([p.grad], "gradient")

        return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]

    def _start_bytes(self) -> int:
        return sum(self._all[ev[1]].first for ev in self._events if ev[0] == "start")

    # the result
    def close(self) -> None:
        """Stop counting: detach the finalizers of storages still alive (they stay alive; the trace ends here)."""
        if not self._closed:
            for s in self._by_key.values():
                s.finalizer.detach()
            self._closed = True

    def trace(self, steps: int | None = None, allocator: AllocatorPeaks | None = None) -> StepTrace:
        """Close the tracker and replay its events into a :class:`StepTrace`."""
        self.close()
        live = 0
        by = [0] * len(CATEGORIES)
        cat = [_RANK[s.category()] for s in self._all]
        size = [0] * len(self._all)
        records: list[OpRecord] = []
        boundaries: list[Boundary] = []
        freed = 0
        births: dict[int, int] = {}
        deaths: dict[int, int] = {}

        def snapshot() -> tuple[tuple[str, int], ...]:
            return tuple((c, b) for c, b in zip(CATEGORIES, by, strict=True) if b)

        pending = 0  # bytes allocated by the op being replayed (births and growth)
        for ev in self._events:
            kind = ev[0]
            if kind == "start":
                sid = ev[1]
                size[sid] = self._all[sid].first
                live += size[sid]
                by[cat[sid]] += size[sid]
            elif kind == "resize":
                _, sid, delta = ev
                size[sid] += delta
                live += delta
                by[cat[sid]] += delta
                pending += delta
            elif kind == "op":
                _, step, phase, op, where, module, born = ev
                for sid in born:
                    size[sid] = self._all[sid].first
                    live += size[sid]
                    by[cat[sid]] += size[sid]
                    pending += size[sid]
                    births[sid] = len(records)
                records.append(OpRecord(len(records), step, phase, op, where, pending, freed, live, snapshot(),
                                        born, module))
                pending = freed = 0
            elif kind == "free":
                sid = ev[1]
                live -= size[sid]
                by[cat[sid]] -= size[sid]
                freed += size[sid]
                deaths[sid] = len(records)
                size[sid] = 0
            else:  # boundary
                _, step, phase = ev
                boundaries.append(Boundary(step, phase, len(records), live, snapshot()))
        storages = tuple(StorageInfo(s.sid, s.peak, CATEGORIES[cat[s.sid]], s.dtype, s.shape, births.get(s.sid),
                                     deaths.get(s.sid), s.op, s.where, s.step, s.phase) for s in self._all)
        steps = steps if steps is not None else max((r.step for r in records), default=1)
        leaked = tuple(s for s in storages if s.died is None and s.category not in
                       ("parameter", "buffer", "input", "gradient", "optimizer_state"))
        return StepTrace(tuple(records), storages, tuple(boundaries), steps, allocator, leaked)


# -- whole training steps ------------------------------------------------------------------------------------
OPTIMIZERS: tuple[str, ...] = ("sgd", "sgd-momentum", "adam", "adamw")
IMPLS: tuple[str, ...] = ("for-loop", "foreach", "fused")
LOSSES: tuple[str, ...] = ("sum", "cross-entropy")


def make_optimizer(params: Sequence[Any], optimizer: str, impl: str = "for-loop", lr: float = 1e-3) -> Any:
    """The ``torch.optim`` optimizer ``optimizer`` with implementation ``impl`` (``foreach=False``,
    ``foreach=True`` or ``fused=True``); SGD with momentum 0.9, AdamW with weight decay 0.01, else defaults."""
    torch = _require_torch()
    if impl not in IMPLS:
        raise SymmemError(f"unknown optimizer implementation {impl!r}; choose from {', '.join(IMPLS)}")
    flags: dict[str, Any] = {"foreach": impl == "foreach"}
    if impl == "fused":
        flags = {"fused": True}
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, **flags)
    if optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **flags)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, **flags)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **flags)
    raise SymmemError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")


def _state_tensors(opt: Any) -> list[Any]:
    import torch

    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


@contextmanager
def _module_names(tracker: LiveTracker, module: Any) -> Iterator[None]:
    """Set ``tracker.where`` and ``tracker.module`` to the innermost running module during the forward, and tag the
    autograd node of each module's output with the module's name (``node.metadata``), for the backward."""
    stack: list[str] = []
    handles = []

    def pre(name: str) -> Callable[..., None]:
        def hook(mod: Any, args: Any) -> None:
            stack.append(name)
            tracker.where = tracker.module = name

        return hook

    def post(mod: Any, args: Any, out: Any) -> None:
        if stack:
            name = stack.pop()
            for t in _tensors(out):  # the innermost module whose output this node makes
                if t.grad_fn is not None:
                    t.grad_fn.metadata.setdefault(MODULE_KEY, name)
        tracker.where = tracker.module = stack[-1] if stack else ""

    for name, sub in module.named_modules():
        handles.append(sub.register_forward_pre_hook(pre(name)))
        handles.append(sub.register_forward_hook(post))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _allocations(ev: Any) -> list[tuple[int, int]]:
    """(time, bytes) of every allocation (+) and free (-) event under profiler event ``ev``, in time order."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int]] = []
    todo = [ev]
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            out.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
        todo.extend(e.children)
    return sorted(out)


def _allocator_peaks(prof: Any, live_at_start: int) -> AllocatorPeaks:
    """Replay the profiler's allocation events, attributing each to the ``symmem/STEP/PHASE`` range around it, and
    find the memory each op dispatched to the tracker's mode allocated and freed inside itself."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, tuple[int, str] | None]] = []
    hidden: dict[str, tuple[int, int]] = {}
    todo: list[tuple[Any, tuple[int, str] | None, Any]] = [
        (root, None, None) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while todo:
        ev, where, parent = todo.pop()
        if ev.name.startswith("symmem/"):
            _, step, phase = ev.name.split("/")
            where = (int(step), phase)
        if ev.tag == _EventType.Allocation:
            events.append((ev.start_time_ns, int(ev.extra_fields.alloc_size), where))
        if parent is not None and parent.name == "PythonDispatchMode" and ev.tag == _EventType.TorchOp:
            run = most = 0
            for _, delta in _allocations(ev):
                run += delta
                most = max(most, run)
            inside = most - max(run, 0)  # the op's peak above what it leaves allocated (its outputs)
            if inside > 0:
                count, top = hidden.get(ev.name, (0, 0))
                hidden[ev.name] = (count + 1, max(top, inside))
        todo.extend((c, where, ev) for c in ev.children)
    events.sort(key=lambda e: e[0])
    live = live_at_start
    peaks: dict[tuple[int, str], int] = {}
    for _, delta, where in events:
        live += delta
        if where is not None and delta > 0:
            peaks[where] = max(peaks.get(where, live), live)
    order = sorted(peaks.items(), key=lambda kv: (kv[0][0], PHASES.index(kv[0][1])))
    return AllocatorPeaks(live_at_start, tuple(order), len(events),
                          tuple(sorted(((k, c, m) for k, (c, m) in hidden.items()), key=lambda r: -r[2])))


def _prepare(module: Any, inputs: Any, loss: str | Callable[[Any], Any], optimizer: str, impl: str, lr: float,
             target: Any, steps: int) -> tuple[tuple[Any, ...], Any, bool, Callable[[Any], Any], Any, list[Any]]:
    torch = _require_torch()
    if steps < 1:
        raise SymmemError(f"steps must be at least 1, not {steps}")
    if not isinstance(module, torch.nn.Module):
        raise SymmemError(f"track_step needs a torch.nn.Module, got {type(module).__name__}")
    if not callable(loss) and loss not in LOSSES:
        raise SymmemError(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)} or pass a callable")
    inputs = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    module.train()
    takes_labels = bool(getattr(module, "takes_labels", False)) and loss == "cross-entropy"
    if loss == "cross-entropy" and target is None:
        if takes_labels:
            shape = tuple(inputs[0].shape)
            classes = int(getattr(getattr(module, "lm_head", None), "out_features", 0)) or int(inputs[0].max()) + 1
        else:
            with torch.no_grad():
                probe = module(*inputs)
            shape, classes = tuple(probe.shape[:-1]), int(probe.shape[-1])
            del probe
        # drawn on the CPU (the same target on every device), then put where the module's output is
        target = torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(0)).to(inputs[0].device)

    def compute_loss(out: Any) -> Any:
        if callable(loss):
            return loss(out)
        if loss == "sum":
            return out.sum()
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    return inputs, target, takes_labels, compute_loss, make_optimizer(params, optimizer, impl, lr), params


def _run(module: Any, inputs: tuple[Any, ...], target: Any, takes_labels: bool, compute_loss: Callable[[Any], Any],
         opt: Any, params: list[Any], steps: int, set_to_none: bool, tracker: LiveTracker | None,
         allocator: bool, keep_output: bool = True, micro_batches: int = 1) -> Any:
    """The training loop, under ``tracker`` (if any) and the profiler (if ``allocator``); returns the profiler."""
    import torch

    with ExitStack() as stack:
        prof = None
        if allocator:
            from torch.profiler import ProfilerActivity, profile, record_function

            prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU], profile_memory=True))

        @contextmanager
        def phase(step: int, name: str) -> Iterator[None]:
            with tracker.phase(step, name) if tracker is not None else ExitStack():
                if prof is None:
                    yield
                    return
                # Entered with the dispatch mode off: inside the mode the profiler would close the range at once.
                from torch.utils._python_dispatch import _disable_current_modes

                marker = record_function(f"symmem/{step}/{name}")
                with _disable_current_modes():
                    marker.__enter__()
                try:
                    yield
                finally:
                    with _disable_current_modes():
                        marker.__exit__(None, None, None)

        def saving() -> Any:
            return tracker.saving() if tracker is not None else ExitStack()

        if tracker is not None:
            grad_hooks = tracker.watch_gradients(params)
            stack.callback(lambda: [h.remove() for h in grad_hooks])
            stack.enter_context(_module_names(tracker, module))
            stack.enter_context(tracker)
        for step in range(1, steps + 1):
            for _ in range(micro_batches):  # gradient accumulation: the gradients add up over the passes
                with phase(step, "forward"), saving():
                    out = module(*inputs, target) if takes_labels else module(*inputs)
                with phase(step, "loss"), saving():
                    value = out if takes_labels else compute_loss(out)
                    if not keep_output:
                        out = None  # the loop does not hold the model's output: loss = f(model(x), y)
                with phase(step, "backward"):
                    handles = []
                    if tracker is not None:
                        tracker.label(_tensors(out) + [value] if out is not None else [value], "output")
                        handles = tracker.watch_backward(value)
                    value.backward()
                    for h in handles:
                        h.remove()
                    if tracker is not None:
                        tracker.label([p.grad for p in params], "gradient")
                    del out, value, handles
            with phase(step, "step"):
                if tracker is not None:  # ops on these storages serve that parameter
                    tracker.name_parameters([(name, t) for name, p in module.named_parameters()
                                             for t in (p, p.grad, *opt.state.get(p, {}).values())
                                             if isinstance(t, torch.Tensor)], reset=True)
                opt.step()
                if tracker is not None:
                    tracker.label(_state_tensors(opt), "optimizer_state")
            with phase(step, "zero_grad"):
                opt.zero_grad(set_to_none=set_to_none)
    return prof


def _distinct_bytes(tensors: Iterable[Any]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            st = t.untyped_storage()
            seen[int(st._cdata)] = int(st.nbytes())
    return sum(seen.values())


def track_step(module: Any, inputs: Any, *, loss: str | Callable[[Any], Any] = "sum", optimizer: str = "sgd",
               impl: str = "for-loop", steps: int = 2, zero_grad_set_to_none: bool = True, lr: float = 1e-3,
               target: Any = None, allocator: bool = False, keep_output: bool = True,
               micro_batches: int = 1) -> StepTrace:
    """Run ``steps`` training steps of ``module`` on ``inputs`` (a tensor or a tuple) under a :class:`LiveTracker`.

    Each step is: ``forward`` (``out = module(*inputs)``), ``loss`` (``out.sum()``, cross-entropy against
    ``target`` over the last dimension, or ``loss(out)``), ``backward`` (``loss.backward()``, after which the
    output and the loss are dropped; with ``keep_output=False`` the output is dropped as soon as the loss is
    computed, as in ``loss = f(module(x), y)``; ``micro_batches`` forward/loss/backward passes accumulate
    gradients before each step), ``step`` (``optimizer.step()``), ``zero_grad``
    (``optimizer.zero_grad(set_to_none=zero_grad_set_to_none)``).  A module with ``takes_labels`` (the GPT-2
    and Llama references) computes its own loss as ``module(*inputs, target)`` in the forward (its ``loss``
    phase is empty).  Without ``target``, cross-entropy draws class indices (seeded) shaped like the output
    without its last dimension, from one ``no_grad`` forward before tracking.  The optimizer is built by
    :func:`make_optimizer`.  The module is put in training mode; its parameters are updated.  ``allocator=True``
    also records the CPU allocator's events with the profiler into :attr:`StepTrace.allocator`.

    >>> torch = getattr(__import__("pytest"), "importorskip")("torch")
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> t = track_step(net, torch.randn(2, 4), loss="cross-entropy", optimizer="adam")
    >>> params = t.start.bytes("parameter")                   # (4*8 + 8 + 8*3 + 3) * 4 bytes
    >>> t.live_at(2, "step") - t.start.live == 3 * params + 4 * 4   # grads, exp_avg, exp_avg_sq; 4 float steps
    True
    """
    inputs, target, takes_labels, compute_loss, opt, params = _prepare(module, inputs, loss, optimizer, impl, lr,
                                                                       target, steps)
    torch = _require_torch()
    tracker = LiveTracker()
    tracker.register(module.parameters(), "parameter")
    tracker.register(module.buffers(), "buffer")
    tracker.register([x for x in (*inputs, target) if isinstance(x, torch.Tensor)], "input")
    tracker.name_parameters(module.named_parameters())
    prof = _run(module, inputs, target, takes_labels, compute_loss, opt, params, steps, zero_grad_set_to_none,
                tracker, allocator, keep_output, micro_batches)
    peaks = _allocator_peaks(prof, tracker._start_bytes()) if prof is not None else None
    return tracker.trace(steps, peaks)


def allocator_step(module: Any, inputs: Any, *, loss: str | Callable[[Any], Any] = "sum", optimizer: str = "sgd",
                   impl: str = "for-loop", steps: int = 2, zero_grad_set_to_none: bool = True, lr: float = 1e-3,
                   target: Any = None) -> AllocatorPeaks:
    """The same steps as :func:`track_step` under the profiler alone: no dispatch mode, no hooks.

    Its peaks show what the tracker's instrumentation changes (nothing, in every case measured) and what the
    mode cannot see (allocations inside one op, and Python numbers wrapped as tensors before dispatch).
    """
    inputs, target, takes_labels, compute_loss, opt, params = _prepare(module, inputs, loss, optimizer, impl, lr,
                                                                       target, steps)
    torch = _require_torch()
    start = _distinct_bytes([*module.parameters(), *module.buffers(),
                             *(x for x in (*inputs, target) if isinstance(x, torch.Tensor))])
    prof = _run(module, inputs, target, takes_labels, compute_loss, opt, params, steps, zero_grad_set_to_none, None,
                True)
    return _allocator_peaks(prof, start)
