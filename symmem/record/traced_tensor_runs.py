"""The truth for :mod:`symmem.importer.traced_tensor`: a module split by its tensor-parallel plan on real gloo ranks.

:func:`split_run` is one rank's part (inside :func:`symmem.record.model_parallel_runs.forked_ranks`): the module as
its builder makes it, ``parallelize_module`` with the plan's styles on the ranks' CPU mesh, then
:func:`~symmem.record.model_parallel_runs.repeated_steps` -- training steps, each a new for-loop AdamW for the first
ones, the loss the output's sum, under the recorder that sees DTensor's local ops and releases funcol's collectives on
the recording thread -- and each step's peak at its fewest bytes over the recorded steps.  Hugging
Face's Llama under the standard plan is :func:`symmem.record.model_parallel_runs.runs`' ``hf`` case.  Needs ``torch``
with ``torch.distributed``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SplitRun:
    """One rank's measured step of a split module: the first and steady step's peaks, the parameters' local
    bytes, and the bytes autograd keeps after the forward (each storage once, a DTensor's local shard; not the
    parameters or the inputs)."""

    rank: int
    first_peak: int
    steady_peak: int
    parameters: int
    saved: int = 0
    #: the frees of recorded storages that ran off the recording thread (``StepTrace.late``, named)
    late: tuple[str, ...] = ()


def saved_after_forward(forward: Callable[[], Any], held: list[Any]) -> int:
    """The bytes of the storages autograd packs during ``forward()`` and still holds when it returns (a DTensor's
    local shard; not those of ``held``), the output dropped after: the graph and what it keeps go with it."""
    from .identity import storage_key
    from .sharded import local, saved_storages

    skip = {storage_key(local(t)) for t in held}
    out, found = saved_storages(forward, lambda: skip, local)
    kept = sum(nbytes for nbytes, _, _ in found.values())
    del out
    return kept


def split_run(build: Callable[[], tuple[Any, tuple[Any, ...]]], styles: Callable[[Any, int], dict[str, Any]],
              rank: int, world: int) -> SplitRun:
    """Rank ``rank``'s step of the module ``build()`` makes, split by ``styles(module, world)`` (name -> style)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from .model_parallel_runs import FIRST_STEPS, STEADY_STEPS, _fewest, late_frees, repeated_steps
    from .sharded import local

    torch.manual_seed(0)
    module, inputs = build()
    module.train()
    parallelize_module(module, init_device_mesh("cpu", (world,)), styles(module, world))
    params = list(module.parameters())
    saved = saved_after_forward(lambda: module(*inputs), [*params, *module.buffers(), *inputs])
    trace = repeated_steps(lambda: module(*inputs), inputs[0], params, module)
    first = _fewest(trace, range(1, FIRST_STEPS + 1))
    steady = _fewest(trace, range(FIRST_STEPS + 1, FIRST_STEPS + STEADY_STEPS + 1))
    held = sum(local(p).numel() * local(p).element_size() for p in params)
    return SplitRun(rank, first, steady, held, saved, late_frees(trace))
