"""FSDP1's flat parameters placed in a traced module's recorded step (``--data-parallel fsdp1|fsdp1-grad-op``).

``FullyShardedDataParallel(module, sharding_strategy=FULL_SHARD or SHARD_GRAD_OP,
auto_wrap_policy=ModuleWrapPolicy({Block}))`` with every other option at its default, as
:mod:`symmem.record.fsdp1_runs` runs it: one unit per block of the repeated run the fold in ``L`` finds, the root
holding every other parameter.  What differs from FSDP2 (:class:`~symmem.importer.traced_fsdp.FsdpRewrite`, whose
placement of the hooks at each unit's first and last recorded op this reuses) is :class:`symmem.passes.fsdp1.Fsdp1`'s,
measured on gloo runs; per unit ``u`` with ``n_u`` the elements of its parameters and ``k_u = ceil(n_u / N)``:

* each rank stores one flat shard of ``k_u`` elements (the padding at the flat parameter's end included), and the
  optimizer steps on those flat shards, the root's first: its state and its temporaries are a flat shard's size
  (:func:`symmem.passes.schedule.walk_step`, the events the built-in graphs' step runs), the same on every rank;
* the unsharded flat parameter (``N * k_u``, no separate all-gather output) appears at the unit's pre-forward and
  goes at its post-forward under ``FULL_SHARD`` (never the root's, which stays until its post-backward;
  ``SHARD_GRAD_OP`` keeps every unit's); the pre-backward gathers it again where it went and prefetches the next
  unit in backward order;
* at a unit's post-backward its gradients are concatenated into a flat gradient (``n_u``) and freed, the unsharded
  parameter goes, the flat gradient is padded into a copy where ``N`` does not divide ``n_u``, and the sharded
  gradient (``k_u``) is made; ``zero_grad`` frees it.

>>> from symmem.symbols import N
>>> flat_shard(14837, N).subs(N, 2), flat_shard(14837, 4)
(7419, 3710)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import sympy

from ..passes.data_parallel import ceil_div
from ..passes.fsdp1 import _at_most_one
from ..passes.schedule import state_storages, walk_step
from ..symbols import N
from ..training import Regime
from .recording import StepOp, StepRecord
from .traced_fsdp import FsdpRewrite


def flat_shard(numel: Any, world: Any) -> sympy.Expr:
    """Elements of one rank's shard of a flat parameter of ``numel`` elements (padded to a multiple of ``world``)."""
    return ceil_div(sympy.Integer(numel), world)


@dataclasses.dataclass
class Fsdp1Rewrite(FsdpRewrite):
    """FSDP1's flat parameters and buffers in a recorded step; ``optimizer`` and ``impl`` are the step's (its
    optimizer step is written anew over the flat shards)."""

    optimizer: str = "adamw"
    impl: str = "for-loop"

    def __post_init__(self) -> None:
        super().__post_init__()
        numel = {u: sympy.Add(*(sympy.Mul(*p.shape) for p in ps)) for u, ps in self.unit_params.items()}
        self.flat = numel
        self.flat_k = {u: flat_shard(n, N) for u, n in numel.items()}
        self.bytes_per = {u: ps[0].itemsize if ps else 4 for u, ps in self.unit_params.items()}

    def _name(self, unit: str | None) -> str:
        return unit or "root"

    # -- the unsharded flat parameter ----------------------------------------------------------------------------
    def gather(self, unit: str | None, phase: str, with_params: bool = True) -> None:
        """Allocate the unsharded flat parameter (the all-gather writes into it)."""
        if unit in self.unsharded or not self.unit_params[unit]:
            return
        sid = self.new(f"fsdp1.unsharded[{self._name(unit)}]", "parameter",
                       N * self.flat_k[unit] * self.bytes_per[unit], phase)
        self.unsharded[unit] = [sid]
        self.event(phase, unit, "fsdp1.all_gather", [sid])

    def free_gather(self, unit: str | None, phase: str, at: str | None) -> None:
        """FSDP1 has no all-gather output beside the unsharded flat parameter."""

    def reshard_unit(self, unit: str | None, phase: str) -> None:
        if unit is None and phase == "forward":
            return  # FSDP1's root keeps its flat parameter unsharded from its pre-forward to its post-backward
        super().reshard_unit(unit, phase)

    def pre_backward(self, unit: str | None) -> None:
        if unit in self.started or not self.unit_params[unit]:
            return
        self.started.add(unit)
        self.gather(unit, "backward")
        order = self.units[::-1]
        i = order.index(unit) + 1 if unit is not None else 0
        if i < len(order):
            self.gather(order[i], "backward")  # BACKWARD_PRE: the next unit's flat parameter, whole

    def post_backward(self, unit: str | None) -> list[int]:
        """The flat gradient, the unit's gradients freed, reshard, the padded copy and the sharded gradient."""
        if not self.unit_params[unit]:
            return []
        name, size = self._name(unit), self.bytes_per[unit]
        flat = self.new(f"fsdp1.flat_grad[{name}]", "temporary", self.flat[unit] * size, "backward")
        self.event("backward", unit, "fsdp1.flat_grad", born=[flat])
        self.event("backward", unit, "fsdp1.free_grads",
                   freed=[g for g, u in self.grad_unit.items() if u == unit])
        self.reshard_unit(unit, "backward")
        padded = N * self.flat_k[unit]
        # F.pad copies the flat gradient only where N does not divide it: Min(1, padding) is 0 or 1
        pad = self.new(f"fsdp1.padded_grad[{name}]", "temporary",
                       _at_most_one(padded - self.flat[unit]) * padded * size, "backward")
        shard = self.new(f"fsdp1.sharded_grad[{name}]", "gradient", self.flat_k[unit] * size, "backward")
        self.sharded_grads.append(shard)
        self.event("backward", unit, "fsdp1.pad", born=[pad])
        self.event("backward", unit, "fsdp1.reduce_scatter", born=[shard])
        self.event("backward", unit, "fsdp1.post_backward_done", freed=[flat, pad])
        return []

    def _stepped(self) -> list[Any]:
        return self.storages  # the weights and the optimizer step are written in rewrite()

    # -- the whole record ------------------------------------------------------------------------------------------
    def rewrite(self) -> StepRecord:
        """FSDP's events placed (:meth:`FsdpRewrite.rewrite`), then the weights as the flat shards and the optimizer
        step over them."""
        rec = super().rewrite()
        # each flat shard's step is named after its unit, as the unit's ops are: a block's then folds in L
        flats = [(u if u is not None else "[root]", u) for u in [None, *self.units] if self.unit_params[u]]
        shards = [self.new(f"fsdp1.flat_shard[{self._name(u)}]", "parameter", self.flat_k[u] * self.bytes_per[u],
                           "start") for _, u in flats]
        weights = {p.sid for p in self.params}
        regime = Regime(optimizer=self.optimizer)
        numel = {name: self.flat_k[u] for name, u in flats}
        state_ids: dict[str, list[int]] = {}
        for name, u in flats:
            state_ids[name] = [self.new(label, category, size, "step") for label, category, size, _, _ in
                               state_storages(regime, f"flat[{self._name(u)}]", (self.flat_k[u],), False)]
        step_born = {i for o in rec.ops if o.phase == "step" for i in o.born}
        ops: list[StepOp] = []
        for o in rec.ops:
            if o.phase != "step":
                ops.append(o)
                continue
            if not ops or ops[-1].phase != "step" or ops[-1].step != o.step:
                ops += self._step_ops(o.step, regime, [(n, (numel[n],)) for n, _ in flats], numel, state_ids)
            # what a recorded step op freed that the step did not make goes as well (the gradients, and what the
            # record's end lets go, attached to its last op); the parameters' own storages were never live here
            carried = tuple(i for i in o.freed if i not in step_born and i not in weights)
            if carried:
                ops[-1] = dataclasses.replace(ops[-1], freed=ops[-1].freed + carried)
        ops = [dataclasses.replace(o, index=i) for i, o in enumerate(ops)]
        start = (*(i for i in rec.start if i not in weights), *shards)
        return dataclasses.replace(rec, storages=tuple(self.storages), start=start, ops=tuple(ops))

    def _step_ops(self, step: int, regime: Regime, flats: list[tuple[str, tuple[Any, ...]]], numel: dict[str, Any],
                  state_ids: dict[str, list[int]]) -> list[StepOp]:
        """``optimizer.step()`` over the flat shards: the state made in the first, the temporaries of each (the
        built-in graphs' walk, :func:`~symmem.passes.schedule.walk_step`, as ops of this record)."""
        walk = _StepOps(self, step)
        walk_step(walk, regime, self.impl, flats, numel, state_ids, step == 1)
        return walk.ops


@dataclasses.dataclass
class _StepOps:
    """What :func:`~symmem.passes.schedule.walk_step` writes (its ``new`` and ``event``) as a record's storages
    and ops of optimizer step ``step``."""

    rewrite: Fsdp1Rewrite
    step: int
    ops: list[StepOp] = dataclasses.field(default_factory=list)

    def new(self, name: str, category: str, nbytes: Any) -> int:
        return self.rewrite.new(name, category, nbytes, "step")

    def event(self, phase: str, label: str | None, born: list[int], freed: list[int]) -> None:
        self.ops.append(StepOp(0, self.step, phase, "optimizer.step", label or "", "", tuple(born), tuple(freed)))
