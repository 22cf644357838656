"""The training step behind a derivation's peak: one typed interface, :class:`Step`, with no string modes.

Two fronts implement it: a built graph under a convention (:class:`symmem.passes.graph_step.GraphStep`: the schedule
simulated) and a traced module (:class:`symmem.importer.traced_step.StepPeak`: the step recorded on fake tensors).  Both
give a :class:`~symmem.peak.Peak` from the one peak algebra (:mod:`symmem.peak`) and a
:class:`~symmem.timeline.Timeline` at numbers; :class:`~symmem.derivation.Derivation` asks only this interface.

>>> from symmem import derive, symbol
>>> step = derive("mlp", device="cpu", optimizer="sgd").step
>>> type(step).__name__, step.peak() is step.peak(), step.allocated("steady", {symbol("B"): 1})
('GraphStep', True, 14919168)
>>> step = Refused("not modelled here")
>>> step.peak()
Traceback (most recent call last):
  ...
symmem.errors.SymmemError: not modelled here
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from .errors import SymmemError
from .graph import paused_gc

if TYPE_CHECKING:
    import sympy

    from .peak import Peak
    from .timeline import Row, Which


class Step(Protocol):
    """The training step of one derivation."""

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None) -> Peak:
        """The peak (steady and first step) as formulas; ``at``: numbers for some symbols (the layer counts, where
        they lie below the formulas' domain), the step then written out with them."""
        ...

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        """Whether :meth:`peak`'s formulas hold at ``numbers`` (answered without computing them where the
        domain is known before)."""
        ...

    def domain(self) -> tuple[sympy.Basic, ...]:
        """Where :meth:`peak`'s formulas hold, beyond every size being a positive integer."""
        ...

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        """The ``which`` step at ``at`` (every symbol a number), op by op: (phase, op, live bytes per category)
        after each op's allocations.  It refuses what :meth:`peak` refuses, with the same words."""
        ...

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        """The ``which`` step's peak at ``at`` with every storage rounded up to CUDA's 512-byte blocks, host
        storages left out (what ``torch.cuda.max_memory_allocated`` reports before library workspaces)."""
        ...


def exact_peak(step: Step, at: Mapping[sympy.Symbol, int]) -> Peak:
    """The peak that holds at ``at`` (every size a number): the step's formulas where ``at`` lies in their domain,
    else the step written out with the layer counts ``at`` gives (below the domain: L = 2 where the formulas hold
    from 4).  What ``value("peak")`` reports, and what a view at ``at`` refuses first, in the same words; the step
    keeps each peak it works out."""
    # the step's walks and the peak's algebra are many small objects that stay alive: the cycle collector is
    # paused as while the derivation is worked out (graph.paused_gc)
    with paused_gc():
        if step.holds_at(at):
            return step.peak()
        domain = step.domain()
        return step.peak({s: v for s, v in at.items() if any(s in c.free_symbols for c in domain)})


@dataclass(frozen=True)
class Refused:
    """A step that cannot be followed (a regime the step does not model): every question is answered with the
    refusal ``why``."""

    why: str

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise SymmemError(self.why)

    peak = holds_at = domain = timeline = allocated = _refuse
