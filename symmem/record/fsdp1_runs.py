"""One rank's training step under FSDP1 (``FullyShardedDataParallel``), recorded with the live-bytes recorder made
to see what FSDP does (used by :mod:`symmem.record.distributed` inside a worker process).

The module is wrapped as FSDP1's users wrap a transformer: ``FullyShardedDataParallel(model,
sharding_strategy=FULL_SHARD or SHARD_GRAD_OP, auto_wrap_policy=ModuleWrapPolicy({Block}),
device_id=torch.device("cpu"))`` -- one unit per repeated block (the class of a ``ModuleList``'s items; a
``Sequential``'s children with parameters, by class, for an MLP), the root holding every other parameter --
with every other option at its default (``use_orig_params=False``: each unit's parameters are one flat
``FlatParameter``; ``backward_prefetch=BACKWARD_PRE``; ``forward_prefetch=False``; ``limit_all_gathers=True``).
FSDP1 runs on the CPU with gloo in torch 2.13 (``device_id=torch.device("cpu")``).

The recorder is :class:`~symmem.record.sharded.ShardTracker` (it follows ``UntypedStorage.resize_``, with which
FSDP1 too frees and re-allocates each unit's padded unsharded flat parameter), whose mode here lets a
``FlatParameter`` (an ``nn.Parameter`` subclass without a dispatch of its own) through as a plain tensor.

Needs ``torch`` with ``torch.distributed`` (imported lazily).
"""

from __future__ import annotations

from typing import Any

from .sharded import ShardTracker, record_wrapped, units

#: The engine names and FSDP1's ``ShardingStrategy`` each runs.
STRATEGIES = {"fsdp1": "FULL_SHARD", "fsdp1-grad-op": "SHARD_GRAD_OP"}


class FlatTracker(ShardTracker):
    """:class:`ShardTracker` whose mode treats ``nn.Parameter`` subclasses (FSDP1's ``FlatParameter``) as plain
    tensors: they hold their data and have no ``__torch_dispatch__``."""

    @staticmethod
    def plain(kind: type) -> bool:
        import torch

        return kind is torch.Tensor or issubclass(kind, torch.nn.Parameter)


class NoSync:
    """FSDP1's gradient accumulation as its users write it: every micro-batch but the last inside
    ``with model.no_sync():`` -- ``sync(False)`` enters the context (once), ``sync(True)`` leaves it before the last
    micro-batch (the ``sync`` of :func:`symmem.record.sharded.train_steps`)."""

    def __init__(self, wrapped: Any) -> None:
        self.wrapped, self.context = wrapped, None

    def __call__(self, flag: bool) -> None:
        if not flag and self.context is None:
            self.context = self.wrapped.no_sync()
            self.context.__enter__()
        elif flag and self.context is not None:
            self.context.__exit__(None, None, None)
            self.context = None


def run_fsdp1(module: Any, inputs: tuple[Any, ...], target: Any, *, loss: bool, optimizer: str, impl: str,
              steps: int, strategy: str, checkpoint: str = "none", micro_batches: int = 1) -> Any:
    """Wrap ``module`` in FSDP1 with ``strategy`` (``FULL_SHARD`` or ``SHARD_GRAD_OP``) and record ``steps``
    steps; returns the :class:`StepTrace`.  ``checkpoint="full"``: then ``apply_activation_checkpointing`` wraps
    each block, inside its FSDP unit, in ``checkpoint_wrapper`` (non-reentrant), FSDP1's documented recipe.
    ``micro_batches``: gradient accumulation, every micro-batch but the last under ``no_sync()`` (:class:`NoSync`)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    kinds = {type(b) for b in units(module)}
    policy = ModuleWrapPolicy(kinds)
    wrapped = FullyShardedDataParallel(module, sharding_strategy=getattr(ShardingStrategy, strategy),
                                       auto_wrap_policy=policy, device_id=torch.device("cpu"))
    if checkpoint == "full":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(wrapped, check_fn=lambda m: type(m) in kinds)
    if checkpoint != "none":  # the reference's own (every-K: its checkpoint around each K units); no cache
        module.checkpoint = checkpoint
    return record_wrapped(wrapped, module, FlatTracker(), inputs, target, loss=loss, optimizer=optimizer, impl=impl,
                          steps=steps, micro_batches=micro_batches, sync=NoSync(wrapped))
