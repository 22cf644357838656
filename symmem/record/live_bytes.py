"""The live-bytes recorder: the exact live memory of a training step, op by op, on real or fake tensors.

:class:`LiveRecorder` is told every ATen op that runs (by a ``TorchDispatchMode``: :class:`LiveTracker`'s own on
real tensors, the saved-tensor recorder's on fake ones, :mod:`symmem.importer.recording`) -- the forward, the backward
(on CPU the autograd engine runs in the calling thread and carries the mode with it) and the optimizer step.
After each op it registers every output storage it has not seen (keyed by the storage's identity,
:func:`~symmem.record.identity.storage_key`, so views and in-place ops add nothing) and attaches a
``weakref.finalize`` to the storage's Python object; since PyTorch keeps a storage's Python object alive exactly
as long as the C++ storage (PyObject preservation, fake storages included), the finalizer fires when the memory
is released, whoever held it last (a view, autograd's saved variables, the engine's gradient buffers).
Storages that exist before recording (parameters, buffers, the batch) are registered explicitly as *live at
start*.  The byte reader is the only difference between real and fake tensors: an ``int``
(:func:`~symmem.record.identity.concrete_nbytes`) or a sympy size (:func:`~symmem.record.identity.symbolic_nbytes`).

Every storage gets one **category** for its whole life, the first of :data:`symmem.categories.RECORDED` that
applies:

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

The recorder keeps events (``start``, ``op``, ``free``, ``boundary``); :meth:`LiveTracker.trace` replays them into
a :class:`~symmem.record.steptrace.StepTrace` of ints, the importer into a ``StepRecord`` of sympy sizes.  What a
dispatch mode cannot see: memory a kernel allocates and frees inside one op (``aten::mm``'s contiguous copies,
convolution workspaces; :func:`symmem.record.steps.track_step` ``allocator=True`` measures it).  Needs ``torch``
(imported lazily; this module imports without it).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from ..categories import RECORDED
from ..errors import SymmemError
from .identity import concrete_nbytes, dtype_name, op_name, require_torch, storage_key, tensors
from .modules import MODULE_KEY, ModuleTracker, hook_backward
from .steptrace import AllocatorPeaks, Boundary, OpRecord, StepTrace, StorageInfo

_RANK = {c: i for i, c in enumerate(RECORDED)}
_BIRTH_OPS = ("aten.lift_fresh.default", "aten.lift.default")  # torch.tensor(...) data made before dispatch
_FORWARD = ("forward", "loss")
_OPTIMIZER = ("step", "zero_grad")


class SeenStorage:
    """One storage a live recorder saw (mutable while recording; the results are frozen values).

    ``first`` is its size when first seen, ``nbytes`` its size now (an op may grow it in place); ``born`` the
    index of the op that made it (``None``: live at start); ``where``/``module`` where that op ran; ``host``
    whether it is in CPU memory."""

    __slots__ = ("sid", "first", "nbytes", "labels", "dtype", "shape", "host", "born", "op", "where", "module",
                 "step", "phase", "finalizer")

    def __init__(self, sid: int, nbytes: Any, dtype: str, shape: tuple[Any, ...], host: bool, born: int | None,
                 op: str | None, where: str, module: str, step: int, phase: str) -> None:
        self.sid, self.first, self.nbytes = sid, nbytes, nbytes
        self.labels: set[str] = set()
        self.dtype, self.shape, self.host, self.born, self.op = dtype, shape, host, born, op
        self.where, self.module, self.step, self.phase = where, module, step, phase
        self.finalizer: Any = None

    def category(self) -> str:
        return min(self.labels, key=_RANK.__getitem__) if self.labels else "temporary"


class LiveRecorder:
    """Count live storages op by op: call :meth:`observe` after every op (a dispatch mode does).

    ``nbytes`` reads a storage's size (the only difference between real and fake tensors); ``modules`` is the
    :class:`~symmem.record.modules.ModuleTracker` of the running module (the forward's ops run in its innermost
    module).  In the optimizer step an op runs for the parameter whose tensors it reads (:meth:`name_parameters`;
    ``foreach`` for multi-tensor ops); ``unnamed_to_last`` attributes an op reading none of them (a step count
    made from a Python number) to the parameter served last, rather than to nothing.  ``pack`` gives what the
    pack hook of :meth:`saving` hands autograd (default: the tensor itself).

    Events: ``("start", sid)``, ``("free", sid)``, ``("boundary", step, phase)`` and
    ``("op", step, phase, op, where, module, born, resized)`` with ``resized`` the ``(sid, new bytes)`` of storages
    the op grew in place.
    """

    def __init__(self, nbytes: Callable[[Any], Any] = concrete_nbytes, modules: ModuleTracker | None = None, *,
                 unnamed_to_last: bool = False, phase: str = "forward",
                 pack: Callable[[Any], Any] | None = None) -> None:
        self.nbytes = nbytes
        self.pack = pack
        self.modules = modules
        self.unnamed_to_last = unnamed_to_last
        self.by_key: dict[int, int] = {}  # live storages by their key -> sid
        self.storages: list[SeenStorage] = []
        self.events: list[tuple[Any, ...]] = []
        self.ops = 0
        self.closed = False
        self.step, self.phase_name, self.where, self.module = 1, phase, "", ""
        self.param_names: dict[int, str] = {}  # storage key -> parameter name, for the optimizer step
        self.last_param = ""
        self.thread = threading.get_ident()  # the recording thread
        self.late: list[int] = []  # sids freed on another thread (see StepTrace.late)

    # registration and labels
    def _new(self, t: Any, st: Any, op: str | None, where: str, module: str) -> int:
        sid = len(self.storages)
        s = SeenStorage(sid, self.nbytes(st), dtype_name(t.dtype), tuple(t.shape), t.device.type == "cpu",
                        self.ops if op is not None else None, op, where, module, self.step,
                        self.phase_name if op is not None else "start")
        key = st._cdata
        s.finalizer = weakref.finalize(st, self._freed, key, sid)
        s.finalizer.atexit = False
        self.by_key[key] = sid
        self.storages.append(s)
        return sid

    def _freed(self, key: int, sid: int) -> None:
        if self.closed:
            return
        if self.by_key.get(key) == sid:
            del self.by_key[key]
            self.param_names.pop(key, None)  # the address may be reused by another storage
        if threading.get_ident() != self.thread:
            self.late.append(sid)
        self.events.append(("free", sid))

    def register(self, tensors: Iterable[Any], category: str) -> None:
        """Count the storages of ``tensors`` (existing before recording) as live from the start, in ``category``.

        Registering a storage twice (a tied weight, a view of the batch) counts it once; a storage already seen
        gets the label too.  An empty tensor with no bytes holds no memory and is left out.
        """
        if category not in _RANK:
            raise SymmemError(f"unknown category {category!r}; categories: {', '.join(RECORDED)}")
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            sid = self.by_key.get(st._cdata)
            if sid is None:
                if self.nbytes(st) == 0 and t.numel() == 0:  # a fake size is a sympy expression: never == 0
                    continue
                sid = self._new(t, st, None, "", "")
                self.events.append(("start", sid))
            self.storages[sid].labels.add(category)

    def label(self, tensors: Iterable[Any], category: str) -> None:
        """Give the storages of ``tensors`` a category label (the highest-priority label wins, for their whole life)."""
        for t in tensors:
            if t is None:
                continue
            try:
                sid = self.by_key.get(storage_key(t))
            except (RuntimeError, NotImplementedError):  # no storage (a sparse or nested tensor)
                continue
            if sid is not None:
                self.storages[sid].labels.add(category)

    def name_parameters(self, named: Iterable[tuple[str, Any]], reset: bool = False) -> None:
        """Name storages after parameters (``(name, tensor)`` pairs: the parameter, its gradient, its state):
        in the optimizer step and zero_grad an op is attributed to the first named storage among its inputs, and
        its outputs take that name.  ``reset`` forgets earlier names first."""
        if reset:
            self.param_names.clear()
            self.last_param = ""
        for name, p in named:
            self.param_names[storage_key(p)] = name

    # phases
    @contextmanager
    def phase(self, step: int, name: str) -> Iterator[None]:
        """Attribute the ops inside to ``name`` of ``step``; note live bytes when it ends."""
        self.step, self.phase_name, self.where, self.module = step, name, "", ""
        try:
            yield
        finally:
            self.events.append(("boundary", step, name))
            self.where = self.module = ""

    # every op
    def observe(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Register the storages op ``func`` made, note those it grew, and where it ran."""
        op = op_name(func)
        if op.startswith("profiler."):  # record_function markers (Optimizer.step has them): no tensors
            return
        phase = self.phase_name
        if phase in _FORWARD:  # the innermost module
            stack = self.modules.stack if self.modules is not None else ()
            where = module = stack[-1] if stack else ""
        else:  # the autograd node running and its module, or nothing
            where, module = self.where, self.module
        births: list[int] = []
        resized: list[tuple[int, Any]] = []
        inputs: set[int] | None = None
        outs = list(tensors(out))
        for t in outs:
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # no storage (a sparse or nested tensor)
                continue
            key = st._cdata
            sid = self.by_key.get(key)
            if sid is None:
                if inputs is None:
                    inputs = self._keys(args, kwargs)
                sid = self._new(t, st, op, where, module)
                if key in inputs and op not in _BIRTH_OPS:
                    self.storages[sid].labels.add("external")  # an alias of memory made before recording
                births.append(sid)
            else:
                n = self.nbytes(st)
                if n != self.storages[sid].nbytes:  # resized in place (out= arguments, resize_)
                    resized.append((sid, n))
                    self.storages[sid].nbytes = n
        if phase in _OPTIMIZER and self.param_names:
            where = self._parameter(op, args, kwargs, outs, where)
        self.events.append(("op", self.step, phase, op, where, module, tuple(births), tuple(resized)))
        self.ops += 1

    def transient(self, nbytes: Any, dtype: str, shape: tuple[Any, ...]) -> None:
        """Count a tensor the op just observed made and freed inside its kernel, below any dispatch mode (CUDA's
        softmax backward's ``tmp``: :mod:`symmem.importer.kernel_temporaries`): born with the op's outputs, freed
        right after it, a ``temporary``."""
        ev = self.events[-1]
        if ev[0] != "op":
            raise SymmemError("a kernel's temporary belongs to the op just observed")
        sid = len(self.storages)
        self.storages.append(SeenStorage(sid, nbytes, dtype, shape, False, self.ops - 1, ev[3], ev[4], ev[5],
                                         ev[1], ev[2]))
        self.events[-1] = (*ev[:6], (*ev[6], sid), ev[7])
        self.events.append(("free", sid))

    @staticmethod
    def _keys(args: Any, kwargs: Any) -> set[int]:
        keys: set[int] = set()
        for a in tensors([args, kwargs]):
            try:
                keys.add(storage_key(a))
            except (RuntimeError, NotImplementedError):
                pass
        return keys

    def _parameter(self, op: str, args: Any, kwargs: Any, outs: list[Any], where: str) -> str:
        """Where an op of the optimizer step runs: the parameter whose tensors it reads; what it makes belongs to
        that parameter too."""
        if op.startswith("aten._foreach") or op.startswith("aten._fused"):
            return "foreach"
        name = None
        for a in tensors([args, kwargs]):
            try:
                name = self.param_names.get(storage_key(a))
            except (RuntimeError, NotImplementedError):
                continue
            if name is not None:
                break
        if name is None and self.unnamed_to_last:
            name = self.last_param
        if name is None:
            return where
        self.last_param = name
        for t in outs:
            try:
                self.param_names.setdefault(storage_key(t), name)
            except (RuntimeError, NotImplementedError):
                pass
        return name

    # autograd hooks
    @contextmanager
    def saving(self) -> Iterator[None]:
        """Label every storage autograd packs for backward ``saved`` (``saved_tensors_hooks``)."""
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        keep = self.pack

        def pack(t: Any) -> Any:
            self.label([t], "saved")
            if keep is not None:
                return keep(t)
            if type(t) is not torch.Tensor:
                return t  # a subclass's detach is its own op (an AsyncCollectiveTensor waits): what autograd saves
            # Not the tensor itself: an op's saved output would then hold its own grad_fn, a cycle through C++ that
            # keeps a part of the graph the loss never reaches (BERT's pooler) alive, as an unhooked step does not.
            # A plain tensor's detached alias holds the same storage; made outside the mode, it is no op of the step.
            with _disable_current_modes():
                return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def watch_backward(self, root: Any) -> list[Any]:
        """Hooks on every node of the graph behind ``root``: name the running node (and the module whose output it
        made, tagged by a :class:`ModuleTracker` with ``tag``), label the gradients it receives and the gradients
        it produces ``activation_grad``.  Returns the hook handles (remove them after backward)."""
        def enter(name: str, node: Any, grad_outputs: Any) -> None:
            self.where = name
            self.module = node.metadata.get(MODULE_KEY, self.module)
            self.label(tensors(grad_outputs), "activation_grad")

        # post: before the engine sums the gradients at a fork
        return hook_backward(root, enter, lambda grad_inputs: self.label(tensors(grad_inputs), "activation_grad"))

    def watch_gradients(self, params: Iterable[Any]) -> list[Any]:
        """Label each parameter's ``.grad`` ``gradient`` when it is accumulated; returns the hook handles."""
        def hook(p: Any) -> None:
            self.label([p.grad], "gradient")

        return [p.register_post_accumulate_grad_hook(hook) for p in params if p.requires_grad]

    def close(self) -> None:
        """Stop counting: detach the finalizers of storages still alive (they stay alive; the record ends here)."""
        if not self.closed:
            for s in self.storages:
                if s.finalizer is not None:  # (a kernel's transient has none: it is freed already)
                    s.finalizer.detach()
            self.closed = True


class LiveTracker(LiveRecorder):
    """A live recorder on real tensors with its own dispatch mode (a context manager), replayed into a
    :class:`~symmem.record.steptrace.StepTrace`.

    Use :func:`symmem.record.steps.track_step` for whole training steps; for a loop of your own::

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

    def __init__(self, modules: ModuleTracker | None = None) -> None:
        require_torch()
        super().__init__(concrete_nbytes, modules)
        self._mode: Any = None
        self._started = False

    def __enter__(self) -> LiveTracker:
        if self.closed:
            raise SymmemError("this tracker has finished; make a new one")
        if not self._started:  # what was registered so far is the state at start
            self.events.append(("boundary", 0, "start"))
            self._started = True
        from torch.utils._python_dispatch import TorchDispatchMode

        observe = self.observe

        class _LiveMode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                out = func(*args, **(kwargs or {}))
                observe(func, args, kwargs, out)
                return out

        self._mode = _LiveMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)
        self._mode = None

    def start_bytes(self) -> int:
        """Bytes registered as live at start."""
        return sum(self.storages[ev[1]].first for ev in self.events if ev[0] == "start")

    def trace(self, steps: int | None = None, allocator: AllocatorPeaks | None = None) -> StepTrace:
        """Close the tracker and replay its events into a :class:`~symmem.record.steptrace.StepTrace`."""
        self.close()
        live = 0
        by = [0] * len(RECORDED)
        cat = [_RANK[s.category()] for s in self.storages]
        size = [0] * len(self.storages)
        peak = [s.first for s in self.storages]
        records: list[OpRecord] = []
        boundaries: list[Boundary] = []
        freed = 0
        births: dict[int, int] = {}
        deaths: dict[int, int] = {}

        def snapshot() -> tuple[tuple[str, int], ...]:
            return tuple((c, b) for c, b in zip(RECORDED, by, strict=True) if b)

        for ev in self.events:
            kind = ev[0]
            if kind == "start":
                sid = ev[1]
                size[sid] = self.storages[sid].first
                live += size[sid]
                by[cat[sid]] += size[sid]
            elif kind == "op":
                _, step, phase, op, where, module, born, resized = ev
                pending = 0  # bytes this op allocated (growth and births)
                for sid, n in resized:
                    delta = n - size[sid]
                    size[sid], peak[sid] = n, max(peak[sid], n)
                    live += delta
                    by[cat[sid]] += delta
                    pending += delta
                for sid in born:
                    size[sid] = self.storages[sid].first
                    live += size[sid]
                    by[cat[sid]] += size[sid]
                    pending += size[sid]
                    births[sid] = len(records)
                records.append(OpRecord(len(records), step, phase, op, where, pending, freed, live, snapshot(),
                                        born, module))
                freed = 0
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
        storages = tuple(StorageInfo(s.sid, peak[s.sid], RECORDED[cat[s.sid]], s.dtype, s.shape, births.get(s.sid),
                                     deaths.get(s.sid), s.op, s.where, s.step if s.op is not None else 0, s.phase)
                         for s in self.storages)
        steps = steps if steps is not None else max((r.step for r in records), default=1)
        leaked = tuple(s for s in storages if s.died is None and s.category not in
                       ("parameter", "buffer", "input", "gradient", "optimizer_state"))
        return StepTrace(tuple(records), storages, tuple(boundaries), steps, allocator, leaked, tuple(self.late))
