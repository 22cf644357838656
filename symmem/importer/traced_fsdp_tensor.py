"""A traced module under FSDP2 x tensor parallelism (``trace ... --data-parallel fsdp|fsdp-no-reshard
--tensor-parallel --set N=2 --set t=2``): the tensor-parallel rank's step rewritten with FSDP2's events.

PyTorch's 2-D recipe: ``parallelize_module(module, mesh["tp"], plan)``, then ``fully_shard(block, mesh=mesh["dp"])``
on each repeated block and on the root.  Each parameter is then the rank's tensor-parallel local shard, itself padded
along dim 0 to a multiple of ``N`` and split over the data-parallel group.  Both halves are reused as they are: the
rank's step recorded on fake DTensors (:class:`~symmem.importer.traced_tensor.TensorStepPeak`, whose local shards are
what FSDP's hooks see) and rewritten by :class:`~symmem.importer.traced_fsdp.FsdpRewrite` with each parameter at its
local shape -- the same events a one-device traced step gets under ``fully_shard``; where DTensor hands back a
sharded parameter's gradient whole (the embedding's), FSDP2 clones the rank's rows from it, which then goes
(``FsdpRewrite(larger_grads=True)``).  The peak is a formula in the declared sizes and ``N`` at the ``t`` it was
recorded at; the data-parallel ranks differ only through the rows of each local shard they hold
(:func:`~symmem.passes.data_parallel.alike_ranks`).

Checked against a real gloo 2 x 2 mesh: in ``tests/test_fsdp_tensor.py`` the file module of
``tests/data/traced_tp.py`` under its own ``tp_plan`` with a padded shard (every rank's first and steady peak, kept
activations, to the byte); by hand HF Llama with TP and SP, both FSDP2 settings, V = 64 and 2,048 (docs/regimes.md).

>>> local_shape((64, 24), [("blocks.0.up.weight", 0)], "blocks.0.up.weight", 2)
(32, 24)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy

from ..errors import SymmemError
from ..passes.data_parallel import SHARDED, alike_ranks
from ..symbols import N
from ..symbols import t as T
from ..timeline import Row, Which
from .recording import StepRecord
from .traced_fsdp import FsdpRewrite, parameters_of
from .traced_tensor import TensorStepPeak


def local_shape(shape: tuple[int, ...], sharded: Sequence[tuple[str, int]], name: str, world: int
                ) -> tuple[int, ...]:
    """``name``'s shape on a tensor-parallel rank: each dimension the plan shards divided by ``world`` (the plan
    splits evenly: :func:`~symmem.importer.traced_tensor._even` refuses otherwise)."""
    out = list(shape)
    for n, dim in sharded:
        if n == name:
            out[dim] //= world
    return tuple(out)


@dataclass
class FsdpTensorStepPeak(TensorStepPeak):
    """One rank of an ``N x t`` mesh: the tensor-parallel rank's recorded step under FSDP2 (``kind`` ``fsdp`` or
    ``fsdp-no-reshard``), the data-parallel rank ``rank``'s (whose optimizer state follows its unpadded rows)."""

    kind: str = "fsdp"
    rank: int = 0

    def _recorded(self, sizes: tuple[tuple[str, int], ...], count: int | None, world: int, symbolic: bool
                  ) -> StepRecord:
        key = ("fsdp x tensor", self.kind, self.rank, symbolic, sizes, count, world)
        if key not in self._records:
            rec = super()._recorded(sizes, count, world, symbolic)
            params = [dataclasses.replace(p, shape=local_shape(p.shape, self.sharded, p.name, world))
                      for p in parameters_of(rec, self.module, self.repeat)]
            self._records[key] = FsdpRewrite(rec, params, self.kind, self.rank, self.options.loss == "output",
                                             larger_grads=True).rewrite()
        return self._records[key]

    def _values(self, at: Mapping[sympy.Symbol, int]) -> dict[sympy.Symbol, int]:
        """The numbers a timeline is read at: the world size N (the shards' bytes) besides the recorded sizes."""
        given = {**self.numbers, **dict(at)}
        return {N: given[N]} if N in given else {}

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        return self._at(at)[0].timeline(which, self._values(at))

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        return self._at(at)[0].allocated(which, self._values(at))

    def at_rank(self, rank: int) -> FsdpTensorStepPeak:
        """The step of data-parallel rank ``rank`` (the tensor-parallel records shared: every rank records alike)."""
        if rank == self.rank:
            return self
        return dataclasses.replace(self, rank=rank, _records=self._records, _peaks={}, notes=[])

    def ranks(self, numbers: Mapping[sympy.Symbol, int]) -> dict[int, tuple[int, int]]:
        """``{rank: (first-step peak, steady peak)}`` of every rank of the mesh, ``r`` at ``(r // t, r % t)``: the
        data-parallel ranks grouped by the rows they hold of each local shard, each group worked out once."""
        merged = {**self.numbers, **dict(numbers)}
        world = int(merged[T])
        out: dict[int, tuple[int, int]] = {}
        for group in self.groups(numbers):
            p = self.at_rank(group[0]).peak(merged)
            found = (int(p.value(merged, "first")), int(p.value(merged)))
            for r in group:
                out.update(dict.fromkeys(range(r * world, (r + 1) * world), found))
        return dict(sorted(out.items()))

    def groups(self, numbers: Mapping[sympy.Symbol, int]) -> list[list[int]]:
        """The data-parallel ranks grouped by the rows they hold of each local shard (a group's steps alike)."""
        merged = {**self.numbers, **dict(numbers)}
        if N not in merged:
            raise SymmemError("the peak of every rank of an N x t mesh needs the world size N a number (--set N=2)")
        world, dp = int(merged[T]), int(merged[N])
        sizes, count, _ = self._fixed(merged)
        rec = self._recorded(sizes, count, world, symbolic=False)
        firsts = [local_shape(p.shape, self.sharded, p.name, world)[0]
                  for p in parameters_of(rec, self.module, self.repeat) if p.shape]
        return alike_ranks(firsts, dp)

    def per_rank(self, numbers: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Every rank's steady-step peak, the largest named (rank 0: whole shards)."""
        found = self.ranks(numbers)
        return {"peak_per_rank": [found[r][1] for r in sorted(found)], "peak_rank": 0}

    def rank_peaks(self, derivation: Any) -> dict[int, tuple[int, int]] | None:
        """:meth:`ranks` at ``derivation``'s numbers where they differ (None: every rank alike)."""
        found = self.ranks(derivation.numbers)
        return found if len(set(found.values())) > 1 else None


def fsdp_tensor_step(step: TensorStepPeak, kind: str) -> FsdpTensorStepPeak:
    """``step`` (one tensor-parallel rank's) under FSDP2 ``kind`` on the data-parallel dimension of the mesh."""
    if kind not in SHARDED:
        raise SymmemError(f"a traced module's tensor-parallel step is followed under FSDP2 (fsdp, fsdp-no-reshard), "
                          f"not {kind!r}")
    fields = {f.name: getattr(step, f.name) for f in dataclasses.fields(TensorStepPeak) if not f.name.startswith("_")}
    fields["notes"] = [*step.notes, f"{kind} x tensor parallel: FSDP2 fully_shard on each repeated block and the root "
                                    "over the data-parallel ranks, each parameter the tensor-parallel rank's local "
                                    "shard padded along dim 0 to a multiple of N"]
    return FsdpTensorStepPeak(**fields, kind=kind)
