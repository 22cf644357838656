"""One tensor-parallel rank's step on fake tensors, as a real gloo rank holds it: a fake process group and the recorder.

A traced module's tensor-parallel step runs in this process: a **fake process group** (PyTorch's own ``FakeStore``
and ``"fake"`` backend from ``torch.testing._internal.distributed.fake_pg``: rank 0 of ``t``, collectives that do
nothing) and a one-dimensional CPU device mesh, ``parallelize_module`` on a copy of the module whose parameters are
fake tensors, then forward, backward and the optimizer step under a ``FakeTensorMode``.  DTensor runs its local ops
on the fake shards, and every collective's output is made as in a real run, so the live-bytes recorder that sees what
DTensor does (:class:`~symmem.record.sharded.ShardTracker`: a DTensor's local shard, DTensor's inner ops) sees what a
rank keeps.  Three things differ under a fake mode, and :class:`FakeShardTracker` with :func:`as_a_run` puts them back
as a real rank runs them (found op by op against real runs under the same fake group, where every op's live bytes
now match):

* funcol takes a ``FakeTensorMode`` for compilation (``_are_we_tracing``) and then waits on every collective at
  once instead of returning its ``AsyncCollectiveTensor``: :func:`as_a_run` wraps the output as a real run does;
* ``_c10d_functional._wrap_tensor_autograd``'s fake kernel makes a new tensor where the real one wraps its input in
  an ``AsyncCollectiveTensor`` (a data-less wrapper whose storage the recorder counts, the collective's output
  inside it), and ``wait_tensor``'s makes a new tensor where the real one returns its input: the recorder's mode runs
  them as the real kernels do;
* DTensor's sharding propagation runs the op on fake tensors of the global shape in the mode it finds
  (``detect_fake_mode``): ours, so its ops would be counted -- they are not memory of the step, and are not observed.

>>> import pytest, sys; torch = pytest.importorskip("torch")
>>> hook = sys.excepthook
>>> with fake_group(2) as mesh:
...     mesh.size()
2
>>> import torch.distributed as dist
>>> dist.is_initialized(), sys.excepthook is hook   # the group and its traceback prefix gone
(False, True)
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import SymmemError
from .sharded import ShardTracker


@contextmanager
def fake_group(world: int) -> Iterator[Any]:
    """A fake default process group of ``world`` ranks (this process is rank 0) and its CPU device mesh; destroyed on
    exit.  Refused in one line where a default group already exists (it cannot be replaced for the recording)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise SymmemError("the tensor-parallel step is recorded with torch.distributed, which this torch lacks")
    if dist.is_initialized():
        raise SymmemError("a default torch.distributed process group already exists in this process: the "
                          "tensor-parallel step is recorded in a fake group of its own; trace outside the run")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # init_process_group wraps sys.excepthook to prefix "[rank0]: " to every traceback line, and never unwraps it:
    # a user's later tracebacks would carry one prefix per step recorded
    hook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@contextmanager
def as_a_run() -> Iterator[list[bool]]:
    """While active, funcol wraps a collective's output in its ``AsyncCollectiveTensor`` as outside compilation
    (under a fake mode ``_maybe_wrap_tensor`` waits at once: ``_are_we_tracing``), while DTensor keeps its own answer
    to that question (its uncached sharding propagation, the path symbolic sizes need), and DTensor's sharding
    propagation sets the yielded flag ``[True]`` while it runs (its ops are not the step's)."""
    import torch
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    wrap = funcol._maybe_wrap_tensor
    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    sharding = ShardingPropagator.propagate_op_sharding_non_cached
    quiet = [False]
    known: dict[Any, Any] = {}

    def remembered(self: Any, schema: Any) -> Any:
        # under a fake mode DTensor never caches its sharding propagation (SymInts do not hash), so a repeated block
        # propagates each op anew; within one recording (one ShapeEnv, one mesh) the same op on the same specs and
        # arguments -- sizes as the ShapeEnv's expressions -- gives the same answer, as DTensor's own eager cache
        # assumes of equal schemas
        try:
            key = (id(self), schema.op, _key(schema.args_schema), _key(schema.kwargs_schema),
                   torch._C._get_dtensor_allow_implicit_replication())
        except _Unkeyed:
            return sharding(self, schema)
        if key not in known:
            known[key] = sharding(self, schema)
        return known[key]

    def propagating(self: Any, schema: Any) -> Any:
        quiet[0] = True
        try:
            return propagate(self, schema)
        finally:
            quiet[0] = False

    # funcol wraps a collective's output in its AsyncCollectiveTensor as outside compilation; DTensor keeps its own
    # answer (its uncached sharding propagation, the one symbolic sizes take)
    funcol._maybe_wrap_tensor = funcol._wrap_tensor_autograd  # type: ignore[assignment]
    ShardingPropagator._propagate_tensor_meta_non_cached = propagating  # type: ignore[method-assign]
    ShardingPropagator.propagate_op_sharding_non_cached = remembered  # type: ignore[method-assign]
    try:
        yield quiet
    finally:
        funcol._maybe_wrap_tensor = wrap
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate  # type: ignore[method-assign]
        ShardingPropagator.propagate_op_sharding_non_cached = sharding  # type: ignore[method-assign]


class _Unkeyed(Exception):
    """A sharding schema holding something :func:`_key` does not name by value (a tensor): not remembered."""


def _key(x: Any) -> Any:
    """A hashable name of a DTensor sharding schema's argument by value: a spec by its mesh (the object: one
    recording's), placements, order and global shape, stride and dtype; a symbolic size by its expression in the
    ShapeEnv; containers element by element; plain values with their type (``1``, ``1.0`` and ``True`` differ)."""
    import torch
    from torch.distributed.tensor._dtensor_spec import DTensorSpec

    if isinstance(x, DTensorSpec):
        meta = x.tensor_meta
        shape = None if meta is None else (_key(tuple(meta.shape)), _key(tuple(meta.stride)), meta.dtype)
        return ("spec", id(x.mesh), x.placements, x.shard_order, shape)
    if isinstance(x, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("sym", type(x).__name__, x.node.expr)
    if isinstance(x, list | tuple):
        return (type(x).__name__, tuple(_key(v) for v in x))
    if isinstance(x, dict):
        return ("dict", tuple((k, _key(v)) for k, v in x.items()))
    if x is None or isinstance(x, int | float | bool | str | torch.dtype | torch.device | torch.memory_format
                               | torch.layout):
        return (type(x).__name__, x)
    raise _Unkeyed(type(x).__name__)


class FakeShardTracker(ShardTracker):
    """:class:`~symmem.record.sharded.ShardTracker` for a step on fake tensors of ``mode`` (concrete sizes): a fake
    tensor's storage is memory of the step; ops while ``quiet[0]`` (DTensor's sharding propagation) and ops whose
    outputs belong to another fake mode are not; funcol's wrapper and wait run as their real kernels do (module
    docstring)."""

    def __init__(self, mode: Any, quiet: list[bool], shapes: Any = None) -> None:
        super().__init__()
        self.fake_mode, self.quiet = mode, quiet
        #: the fake world's :class:`~symmem.record.shape_cache.ShapeCache` (None: every op runs the fake mode)
        self.shapes = shapes

    def __enter__(self) -> FakeShardTracker:
        import torch
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.utils._python_dispatch import TorchDispatchMode

        from .identity import tensors

        if not self._started:
            self.events.append(("boundary", 0, "start"))
            self._started = True
        observe, quiet, mode, shapes = self.observe, self.quiet, self.fake_mode, self.shapes
        plain = (torch.Tensor, torch.nn.Parameter, FakeTensor)
        functional = torch.ops._c10d_functional
        wrap, wait = functional._wrap_tensor_autograd.default, functional.wait_tensor.default

        def run(func: Any, args: Any, kwargs: Any) -> Any:
            """The op's outputs: a repeat of an op on the same shapes remade from its first outputs (the shape
            cache's, record/shape_cache.py), else the fake mode's."""
            if shapes is None or func.namespace == "prim":
                return func(*args, **kwargs)
            key = shapes.key(func, args, kwargs)
            same = shapes.same_key(func, args, kwargs) if key is None else None
            out = shapes.get(key, args, kwargs) if key is not None else \
                shapes.same(same, args) if same is not None else None
            if out is None:
                out = func(*args, **kwargs)
                if key is not None:
                    shapes.store(func, key, args, kwargs, out)
                elif same is not None:
                    shapes.store_same(same, args, out)
            return out

        class _FakeShardMode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if any(t not in plain for t in types):
                    return NotImplemented  # a DTensor or funcol's wrapper runs it; its local ops come back here
                kwargs = kwargs or {}
                if quiet[0]:
                    return run(func, args, kwargs)  # DTensor's sharding propagation: global shapes, no memory
                if func is wrap:
                    out = AsyncCollectiveTensor(args[0])  # the real kernel: the output wrapped, not copied
                elif func is wait:
                    out = args[0]  # the real kernel returns its input (the collective's output)
                else:
                    out = run(func, args, kwargs)
                if func.namespace == "prim" or any(isinstance(t, FakeTensor) and t.fake_mode is not mode
                                                   for t in tensors(out)):
                    return out  # the fake mode's metadata queries (prim.device), another mode's tensors: no memory
                observe(func, args, kwargs, out)
                return out

        self._mode = _FakeShardMode()
        self._mode.__enter__()
        return self
