"""What the steps of a tensor-parallel rank share behind :class:`symmem.step.Step`, with or without FSDP.

The peak is worked out at numbers (the layers walked there, :mod:`symmem.passes.tensor_step`): refused where
DTensor's plan cannot split the sizes evenly (:func:`even`) or a number the walk needs is missing, and kept for the
last few numbers asked.  It is not drawn op by op and not counted in CUDA's blocks.
:class:`~symmem.passes.tensor_step.TensorStep` (a tensor-parallel group, every rank alike) and
:class:`~symmem.passes.fsdp_tensor.MeshStep` (a rank of an N x t mesh) are built on :class:`WalkedStep`.

>>> even({"t": 2, "h": 4, "G": 2, "F": 64, "V": 66})
>>> try:
...     even({"t": 4, "h": 4, "G": 2})
... except SymmemError as e:
...     print(str(e)[:32])
t=4 does not divide G=2: DTensor
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import sympy

from ..errors import SymmemError
from ..peak import Peak
from ..timeline import Row, Which

#: at most this many peaks (numbers, rank) are kept: a fit or a plot asks at many numbers
KEPT = 16


def even(numbers: Mapping[str, int]) -> None:
    """Refuse sizes the plan cannot split evenly: ``t`` must divide the heads (``h``, ``G``), the MLP width (``F``)
    and the vocabulary (``V``); DTensor would pad the last shard, which is not modelled."""
    size = numbers.get("t")
    if size is None:
        return
    if size < 1:
        raise SymmemError(f"the tensor-parallel size t must be at least 1, got t={size}")
    for name in ("h", "G", "F", "V"):
        if name in numbers and numbers[name] % size:
            raise SymmemError(f"t={size} does not divide {name}={numbers[name]}: DTensor's plan splits the heads (h, "
                              "G), the MLP width (F) and the vocabulary (V) evenly over the ranks (uneven shards are "
                              "padded: not modelled)")


class WalkedStep:
    """The shared part of a step whose peak is walked at numbers: a dataclass built on it has ``numbers`` (the
    derivation's) and ``_cache`` (a dict) fields, and says ``refused_as`` (its name in the refusals), ``needs`` (the
    numbers the walk needs) and ``not_drawn`` (why no timeline)."""

    refused_as: ClassVar[str]
    needs: ClassVar[tuple[str, ...]]
    not_drawn: ClassVar[str]
    numbers: Mapping[sympy.Symbol, int]
    _cache: dict[Any, Any]

    def _named(self, at: Mapping[sympy.Symbol, int] | None) -> dict[str, int]:
        return {s.name: int(v) for s, v in {**self.numbers, **(at or {})}.items()}

    def _walked_peak(self, at: Mapping[sympy.Symbol, int] | None, rank: int | None,
                     make: Callable[[dict[str, int]], Peak]) -> Peak:
        """``make(named)``: the peak at the step's numbers with ``at`` over them (of ``rank``, None: every rank
        alike), worked out once."""
        named = self._named(at)
        even(named)
        missing = [n for n in self.needs if n not in named]
        if missing:
            raise SymmemError(f"the {self.refused_as} peak walks the layers at numbers: give {', '.join(missing)}")
        key = (tuple(sorted(named.items())), rank)
        if key not in self._cache:
            if len(self._cache) > KEPT:
                self._cache.clear()
            self._cache[key] = make(named)
        return self._cache[key]

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        return self.peak().holds_at(numbers)  # type: ignore[attr-defined]  # each step's own peak()

    def domain(self) -> tuple[sympy.Basic, ...]:
        return tuple(self.peak().domain)  # type: ignore[attr-defined]

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        raise SymmemError(self.not_drawn)

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        raise SymmemError(f"the {self.refused_as} peak in CUDA's 512-byte blocks is not modelled: the peak per device "
                          "is in bytes of tensors")

