"""One rank's training step under FSDP2 (``fully_shard``), recorded with the live-bytes recorder made to see what
FSDP and DTensor do (used by :mod:`symmem.record.distributed` inside a worker process).

What the plain recorder misses, and how this one sees it:

* a ``DTensor`` parameter, gradient or optimizer state is a wrapper whose storage reports the *global* size and
  holds no data: the local shard (``_local_tensor``) is what a rank holds, so that is what is registered and
  labelled;
* DTensor runs an op on its local tensors inside its own ``__torch_dispatch__``; a dispatch mode that handled the
  DTensor op would hide them, so this recorder's mode declines every op on a tensor subclass (returns
  ``NotImplemented``): the subclass runs it and its local ops come back through the mode, real storages and all
  (funcol's ``AsyncCollectiveTensor`` likewise);
* DTensor's sharding propagation runs factories (``empty_strided`` of the global shape) on fake tensors: not
  memory, so an op whose outputs are fake tensors is not recorded;
* FSDP frees and re-allocates the unsharded parameters with ``untyped_storage().resize_()``, which is no ATen op:
  ``UntypedStorage.resize_`` is wrapped while recording, and each call is an event that grows or shrinks a known
  storage (one made before recording is registered when first resized).

Needs ``torch`` with ``torch.distributed`` (imported lazily).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .live_bytes import LiveTracker, tensors


def local(t: Any) -> Any:
    """The tensor a rank holds: a DTensor's local shard, else the tensor.  The shard itself (its ``_local_tensor``),
    not ``to_local()``, which is an op of its own: a recorder would see it, and a saved-tensor hook would run it
    inside the hook; the storage is the same."""
    return getattr(t, "_local_tensor", t)


def saved_storages(forward: Callable[[], Any], held: Callable[[], set[int]], local: Callable[[Any], Any] = local
                   ) -> tuple[Any, dict[int, tuple[int, tuple[int, ...], str]]]:
    """``forward()``'s output and what autograd keeps for its backward while the output lives: each storage once
    (keyed by its ``_cdata``) as (bytes, the first saved tensor's shape, its type) -- of a DTensor, its ``local``
    shard's, which is what the rank holds -- less the storages ``held()`` names when each is saved (the parameters,
    which FSDP swaps for the all-gathered ones in forward; the inputs)."""
    import weakref

    import torch

    found: dict[int, tuple[int, tuple[int, ...], str]] = {}

    def pack(t: Any) -> Any:
        shard = local(t)
        st = shard.untyped_storage()
        key = st._cdata
        if key not in found and key not in held():
            found[key] = (st.nbytes(), tuple(shard.shape), type(t).__name__)
            weakref.finalize(st, found.pop, key, None)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, found


class ShardTracker(LiveTracker):
    """A :class:`LiveTracker` whose mode lets tensor subclasses run their own ops, and that follows
    ``UntypedStorage.resize_`` (see the module's docstring).

    ``settle`` (seconds): after each collective's wait, let go of the GIL that long, so that gloo's worker thread,
    which drops the collective's tensors once it is done (their release runs Python: it needs the GIL), does so
    before the next op rather than whenever the main thread next waits (0: not at all).  ``release``: funcol's
    collectives (``_c10d_functional``, DTensor's) run under :class:`~symmem.record.collectives.FuncolRelease`, which
    makes every free of their tensors land on the recording thread, at the wait (``settle`` is then not needed)."""

    def __init__(self, settle: float = 0.0, release: bool = False) -> None:
        super().__init__()
        self.settle = settle
        self.release = None
        if release:
            from .collectives import FuncolRelease

            self.release = FuncolRelease()

    def __enter__(self) -> ShardTracker:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        if not self._started:
            self.events.append(("boundary", 0, "start"))
            self._started = True
        from torch._subclasses.fake_tensor import FakeTensor

        observe = self.observe
        plain = self.plain
        settle = self.settle
        release = self.release

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if any(issubclass(t, FakeTensor) for t in types):
                    return func(*args, **(kwargs or {}))  # DTensor's sharding propagation: no memory
                if not all(plain(t) for t in types):
                    return NotImplemented  # the subclass runs it; its local ops come back here
                if release is not None and func.namespace == "_c10d_functional":
                    out = release.run(func, args, kwargs or {})
                else:
                    out = func(*args, **(kwargs or {}))
                if any(isinstance(t, FakeTensor) for t in tensors(out)):
                    return out  # a factory run for DTensor's sharding propagation (global shapes): no memory
                if settle and func is torch.ops._c10d_functional.wait_tensor.default:
                    import time

                    time.sleep(settle)  # gloo's worker thread lets go of the collective's tensors (see the class)
                observe(func, args, kwargs, out)
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    @staticmethod
    def plain(kind: type) -> bool:
        """Whether the mode records an op on a tensor of type ``kind`` itself (else the subclass runs it)."""
        import torch

        return kind is torch.Tensor or kind is torch.nn.Parameter

    @contextmanager
    def resizes(self) -> Iterator[None]:
        """Record every ``UntypedStorage.resize_`` inside as an event of the running phase."""
        import torch

        original = torch.UntypedStorage.resize_
        tracker = self

        def resize_(storage: Any, size: int) -> Any:
            out = original(storage, size)
            tracker.resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        try:
            yield
        finally:
            torch.UntypedStorage.resize_ = original  # type: ignore[method-assign]

    def resized(self, storage: Any) -> None:
        import torch

        sid = self.by_key.get(storage._cdata)
        n = int(storage.nbytes())
        born: tuple[int, ...] = ()
        if sid is None:
            if n == 0:
                return
            from torch.utils._python_dispatch import _disable_current_modes

            with _disable_current_modes():  # a handle to name the storage by, not an op of the step
                t = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            sid = self._new(t, storage, "storage.resize_", self.where, self.module)
            born = (sid,)
            changed: tuple[tuple[int, int], ...] = ()
        else:
            changed = ((sid, n),) if n != self.storages[sid].nbytes else ()
            self.storages[sid].nbytes = n
        self.events.append(("op", self.step, self.phase_name, "storage.resize_", self.where, self.module, born,
                            changed))
        self.ops += 1


def units(module: Any) -> list[Any]:
    """The modules FSDP shards as units (before the root): a ``ModuleList``'s items, else a ``Sequential``'s
    children that have parameters."""
    import torch

    blocks = [m for lst in module.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]
    if not blocks and isinstance(module, torch.nn.Sequential):
        blocks = [m for m in module if any(True for _ in m.parameters())]
    return blocks


def run_sharded(module: Any, inputs: tuple[Any, ...], target: Any, *, loss: bool, optimizer: str, impl: str,
                steps: int, reshard: bool, checkpoint: str = "none", micro_batches: int = 1,
                mp: tuple[str, str] | None = None) -> Any:
    """Shard ``module`` with FSDP2 (every block of a ``ModuleList``, or every child of a ``Sequential`` that has
    parameters, then the root; ``mp``: under ``MixedPrecisionPolicy(param_dtype, reduce_dtype)``, by name) and
    record ``steps`` steps; returns the :class:`StepTrace`.

    ``checkpoint``: ``full`` wraps each block in ``checkpoint_wrapper`` (non-reentrant) before ``fully_shard``
    shards the wrapper, torchtitan's order (FSDP's hooks are the wrapper's, outside the checkpoint: the recompute
    runs none of them); ``every-K`` is the reference's own ``torch.utils.checkpoint`` around each run of K sharded
    blocks (:func:`symmem.reference.sequence_models.run_layers`: FSDP's hooks run inside the checkpoint, and again
    in the recompute).  ``micro_batches``: gradient accumulation, every micro-batch but the last under
    ``set_requires_gradient_sync(False)`` (FSDP2's ``no_sync``: the unsharded gradients add up, one reduce-scatter
    at the last)."""
    from torch.distributed.fsdp import fully_shard

    policy = {} if mp is None else {"mp_policy": mixed_precision(*mp)}
    blocks = units(module)
    if checkpoint == "full":
        blocks = checkpoint_wrapped(module, blocks)
    if checkpoint != "none":  # the reference's own: its layers run as checkpointed ones (no cache passed to them)
        module.checkpoint = checkpoint
    for block in blocks:
        fully_shard(block, reshard_after_forward=reshard, **policy)
    fully_shard(module, reshard_after_forward=reshard, **policy)
    return record_wrapped(module, module, ShardTracker(), inputs, target, loss=loss, optimizer=optimizer, impl=impl,
                          steps=steps, micro_batches=micro_batches)


def checkpoint_wrapped(module: Any, blocks: list[Any]) -> list[Any]:
    """Each block replaced in its ``ModuleList`` by ``checkpoint_wrapper(block)`` (non-reentrant); the wrappers."""
    import torch
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    out = []
    for lst in [m for m in module.modules() if isinstance(m, torch.nn.ModuleList)]:
        for i, block in enumerate(lst):
            if any(block is b for b in blocks):
                lst[i] = checkpoint_wrapper(block)
                out.append(lst[i])
    return out


def mixed_precision(param_dtype: str, reduce_dtype: str) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for two dtype names (a fixed table: no name is looked up on torch)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtypes = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    return MixedPrecisionPolicy(param_dtype=dtypes[param_dtype], reduce_dtype=dtypes[reduce_dtype])


def record_wrapped(wrapped: Any, module: Any, tracker: ShardTracker, inputs: tuple[Any, ...], target: Any, *,
                   loss: bool, optimizer: str, impl: str, steps: int, micro_batches: int = 1,
                   sync: Callable[[bool], Any] | None = None) -> Any:
    """``steps`` training steps of ``wrapped`` (an FSDP engine around ``module``) under ``tracker``: a module
    that takes labels computes its own loss (made-up labels where none are given), else the output's
    cross-entropy (``loss``) or sum; returns the :class:`~symmem.record.steptrace.StepTrace`."""
    import torch

    from .optim import make_optimizer
    from .steps import loss_value

    wrapped.train()
    takes_labels = bool(getattr(module, "takes_labels", False)) and loss
    if takes_labels and target is None:
        classes = int(module.lm_head.out_features)
        target = torch.randint(0, classes, tuple(inputs[0].shape), generator=torch.Generator().manual_seed(0))
    params = [p for p in wrapped.parameters() if p.requires_grad]
    opt = make_optimizer(params, optimizer, impl)
    tracker.register([local(p) for p in params], "parameter")
    tracker.register([local(b) for b in wrapped.buffers()], "buffer")
    tracker.register([x for x in (*inputs, target) if isinstance(x, torch.Tensor)], "input")

    def forward() -> Any:
        return wrapped(*inputs, target) if takes_labels else wrapped(*inputs)

    def loss_of(out: Any) -> Any:
        return out if takes_labels else loss_value("cross-entropy" if loss else "sum", out, target)

    if sync is None:  # FSDP2's; FSDP1 passes its no_sync() context (fsdp1_runs.NoSync)
        sync = getattr(wrapped, "set_requires_gradient_sync", None)
    sync = sync if micro_batches > 1 else None
    return train_steps(tracker, forward, loss_of, params, lambda step: opt, steps, resizes=True,
                       micro_batches=micro_batches, sync=sync)


def train_steps(tracker: ShardTracker, forward: Callable[[], Any], loss: Callable[[Any], Any], params: list[Any],
                optimizer: Callable[[int], Any], steps: int, *, loss_phase: str = "loss", resizes: bool = False,
                micro_batches: int = 1, sync: Callable[[bool], Any] | None = None) -> Any:
    """``steps`` training steps under ``tracker`` (parameters, buffers and inputs registered): ``forward()``,
    ``loss(out)`` (in a phase of its own, ``loss_phase``, or in the forward's with ``loss_phase="forward"``; the
    output let go once the loss is made), ``backward``, the step of ``optimizer(step)`` (the optimizer of each
    step: a new one makes its state again, as a first step does), ``zero_grad``; gradients and optimizer state
    labelled as the local shards.  ``resizes``: follow ``UntypedStorage.resize_`` (FSDP).  Returns the
    :class:`~symmem.record.steptrace.StepTrace`.  ``micro_batches`` forward, loss and backward passes a step, with
    ``sync(False)`` before each but the last and ``sync(True)`` before the last (an engine's gradient sync)."""
    from contextlib import nullcontext

    from .optim import state_tensors

    with tracker.resizes() if resizes else nullcontext(), tracker:
        for step in range(1, steps + 1):
            opt = optimizer(step)
            for k in range(micro_batches):
                if sync is not None:
                    sync(k == micro_batches - 1)
                with tracker.phase(step, "forward"), tracker.saving():
                    out = forward()
                    if loss_phase == "forward":
                        value, out = loss(out), None
                if loss_phase != "forward":
                    with tracker.phase(step, loss_phase), tracker.saving():
                        value, out = loss(out), None
                with tracker.phase(step, "backward"):
                    value.backward()
                    tracker.label([local(p.grad) for p in params if p.grad is not None], "gradient")
                    del value
            with tracker.phase(step, "step"):
                opt.step()
                tracker.label([local(t) for t in state_tensors(opt)], "optimizer_state")
            with tracker.phase(step, "zero_grad"):
                opt.zero_grad(set_to_none=True)
            del opt
    return tracker.trace(steps)
