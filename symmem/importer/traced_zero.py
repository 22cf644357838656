"""``--data-parallel zero-redundancy`` for a traced module: each rank's step recorded with the optimizer that rank runs.

``DistributedDataParallel(module)`` with ``ZeroRedundancyOptimizer(module.parameters(), optimizer_class=...)``:
every rank runs the whole forward and backward and keeps DDP's buckets (:mod:`.traced_engines`), and its local
optimizer is ``optimizer_class`` over the **whole parameters** the greedy partition gives it
(:func:`symmem.passes.zero_redundancy.partition`: ``module.parameters()`` sorted by size, largest first, each to the
rank with the fewest elements so far), in that order.  The optimizer's state and its step's temporaries are that
optimizer's, so the step is recorded on fake tensors as for one device with :class:`RankOptimizer` in place of the
optimizer (``StepOptions(owned=...)``): its local optimizer creates and steps the rank's parameters only, in the
partition's order (the for-loop AdamW's ``denom`` of one parameter lives into the next one's update: the order
counts), and ``zero_grad`` frees every gradient (``ZeroRedundancyOptimizer``'s parameter groups hold every
parameter).  The broadcast of each updated parameter from its owner writes into ``param.data`` in place: nothing
new.

The partition needs numbers: the parameters' sizes (the layer count writes the blocks out) and ``N``; the peak is
the ``Max`` over every rank's moments at them, a formula in the sizes the parameters do not depend on (``B``,
``S``), as for built-in graphs (:mod:`symmem.passes.zero_redundancy`).

>>> owned_order([6, 10, 6, 1], 2)
[(1, 3), (0, 2)]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..passes.zero_redundancy import partition
from ..record.optim import make_optimizer


def owned_order(sizes: Sequence[int], world: int) -> list[tuple[int, ...]]:
    """Per rank, the indices (in ``module.parameters()`` order) of the parameters its local optimizer steps, in its
    order."""
    return [tuple(p) for p in partition(list(sizes), world)]


class RankOptimizer:
    """What one rank's ``ZeroRedundancyOptimizer`` does to memory: ``step()`` runs the local optimizer over the
    owned parameters (none: an empty step, as a rank that owns nothing runs), ``zero_grad`` frees every gradient,
    ``state`` is the local optimizer's.  The recorded step (:func:`symmem.importer.recording.record_step`) runs it
    in place of the single device's optimizer where its :class:`~symmem.importer.recording.StepOptions` name the
    rank's parameters (``owned``)."""

    def __init__(self, params: Sequence[Any], owned: Sequence[int], optimizer: str, impl: str) -> None:
        self.params = list(params)
        self.local = make_optimizer([self.params[i] for i in owned], optimizer, impl) if owned else None
        self.state: Any = self.local.state if self.local is not None else {}

    def step(self) -> None:
        if self.local is not None:
            self.local.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:  # ZeroRedundancyOptimizer.zero_grad: every parameter of its groups, in their order
            p.grad = None
