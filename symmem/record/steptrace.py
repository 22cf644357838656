"""What a recorded training step on real tensors gives: the timeline of :func:`~symmem.record.steps.track_step`
(one :class:`OpRecord` per op, :class:`Boundary` at phase ends, every :class:`StorageInfo`), its peaks, and the
CPU allocator's own view of the same run (:class:`AllocatorPeaks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..categories import RECORDED_PHASES
from ..errors import SymmemError


@dataclass(frozen=True)
class StorageInfo:
    """One storage the tracker saw: its bytes, category, and the op that made it (``None`` if live at start).

    ``born`` and ``died`` are record indices: born in record ``born``, freed after record ``died - 1`` and
    before record ``died`` (``died`` is ``len(records)`` for a storage freed after the last op, ``None`` for
    one alive when tracking ended).  ``nbytes`` is the largest size the storage had.
    """

    sid: int
    nbytes: int
    category: str
    dtype: str
    shape: tuple[int, ...]
    born: int | None
    died: int | None
    op: str | None
    where: str
    step: int
    phase: str


@dataclass(frozen=True)
class OpRecord:
    """The state right after one op: live bytes, bytes per category, and what this op allocated.

    ``where`` is the innermost module in the forward (its qualified name, ``""`` for the top), the autograd
    node in backward (``ConvolutionBackward0``; accumulating two gradients at a fork runs under the node that
    produced the second), the parameter an op updates in the optimizer step (``foreach`` for multi-tensor ops).
    ``module`` is the innermost module running in the forward; in backward, the module whose output node was the
    last node entered that had one (``track_step`` tags them), so the nodes inside a module inherit its name.
    ``allocated`` counts storages born in this op (and storage growth), ``freed`` the bytes released since the
    previous record.
    """

    index: int
    step: int
    phase: str
    op: str
    where: str
    allocated: int
    freed: int
    live: int
    by_category: tuple[tuple[str, int], ...]
    born: tuple[int, ...] = ()
    module: str = ""

    def bytes(self, category: str) -> int:
        """Live bytes of one category at this record."""
        return dict(self.by_category).get(category, 0)


@dataclass(frozen=True)
class Boundary:
    """Live bytes when a phase of a step ends (``phase`` ``start`` for the state before tracking)."""

    step: int
    phase: str
    index: int
    live: int
    by_category: tuple[tuple[str, int], ...]

    def bytes(self, category: str) -> int:
        return dict(self.by_category).get(category, 0)


@dataclass(frozen=True)
class MeasuredPeak:
    """The largest live bytes and where: the record, and every storage alive then."""

    bytes: int
    record: OpRecord
    alive: tuple[StorageInfo, ...]

    @property
    def phase(self) -> str:
        return self.record.phase

    @property
    def op(self) -> str:
        return self.record.op

    @property
    def step(self) -> int:
        return self.record.step

    @property
    def where(self) -> str:
        return self.record.where

    @property
    def index(self) -> int:
        return self.record.index

    @property
    def by_category(self) -> tuple[tuple[str, int], ...]:
        return self.record.by_category


@dataclass(frozen=True)
class AllocatorPeaks:
    """The CPU allocator's own view of the same run (profiler memory events), per step and phase.

    ``live_at_start`` plus the allocator's running total gives live bytes including memory allocated and freed
    inside one op, which the dispatch mode cannot see.  ``peaks`` maps ``(step, phase)`` to the largest live
    bytes right after an allocation during that phase (a phase that only frees has none); ``events`` counts the
    allocation and free events.
    """

    live_at_start: int
    peaks: tuple[tuple[tuple[int, str], int], ...]
    events: int
    #: ``(op, count, most bytes)``: ops that allocated memory and freed it before returning (profiler names,
    #: ``aten::convolution``), how often, and the most any one of them held above its outputs (only ops seen by
    #: a tracker's dispatch mode: empty for :func:`allocator_step`)
    hidden: tuple[tuple[str, int, int], ...] = ()

    def peak(self, step: int | None = None, phase: str | None = None) -> int:
        """The largest live bytes over the run, a step, or one phase of a step."""
        values = [v for (s, p), v in self.peaks if (step is None or s == step) and (phase is None or p == phase)]
        if not values:
            raise SymmemError(f"no allocator events for step {step}, phase {phase}")
        return max(values)


@dataclass(frozen=True)
class StepTrace:
    """The timeline of tracked training steps, with peaks and phase boundaries (steps numbered from 1)."""

    records: tuple[OpRecord, ...]
    storages: tuple[StorageInfo, ...]
    boundaries: tuple[Boundary, ...]
    steps: int
    allocator: AllocatorPeaks | None = None
    #: storages still alive when tracking ended that are not parameters, buffers, inputs, gradients or state
    leaked: tuple[StorageInfo, ...] = field(default=())
    #: the sids of storages whose free ran on another thread than the recording one (a collective's worker thread
    #: dropping the last reference): their frees land at no fixed op (:mod:`symmem.record.collectives`)
    late: tuple[int, ...] = field(default=())

    @property
    def start(self) -> Boundary:
        """Live bytes before the first op: what was registered as live at start."""
        return self.boundaries[0]

    def boundary(self, step: int, phase: str) -> Boundary:
        """The state when ``phase`` of ``step`` ended (``loss`` equals ``forward`` when the model computes it)."""
        for b in self.boundaries:
            if b.step == step and b.phase == phase:
                return b
        raise SymmemError(f"no boundary for step {step}, phase {phase!r}; phases: {', '.join(RECORDED_PHASES)}")

    def live_at(self, step: int, phase: str) -> int:
        """Live bytes at the end of ``phase`` of ``step``."""
        return self.boundary(step, phase).live

    def peak_of(self, step: int | None = None, phase: str | None = None) -> MeasuredPeak:
        """The peak over all records, or over one step, or one phase of one step (the first record if tied)."""
        chosen = [r for r in self.records if (step is None or r.step == step) and (phase is None or r.phase == phase)]
        if not chosen:
            raise SymmemError(f"no ops recorded for step {step}, phase {phase!r}")
        best = max(chosen, key=lambda r: (r.live, -r.index))
        return MeasuredPeak(best.live, best, self.alive_at(best.index))

    @property
    def peak(self) -> MeasuredPeak:
        """The peak of the whole run."""
        return self.peak_of()

    @property
    def first(self) -> MeasuredPeak:
        """The peak of the first step (optimizer state is created inside it)."""
        return self.peak_of(1)

    @property
    def steady(self) -> MeasuredPeak:
        """The peak of the last step (the steady state when ``steps >= 2``)."""
        return self.peak_of(self.steps)

    def alive_at(self, index: int) -> tuple[StorageInfo, ...]:
        """The storages alive right after record ``index``, largest first."""
        alive = [s for s in self.storages
                 if (s.born is None or s.born <= index) and (s.died is None or s.died > index)]
        return tuple(sorted(alive, key=lambda s: (-s.nbytes, s.sid)))

    def persistent(self, step: int) -> int:
        """The simple sum a formula would start from: activations saved for backward at the end of the forward
        (after the loss) + input + parameters and buffers + gradients at the end of backward + optimizer state
        after the step.  The module's output (held by the caller, not saved) is not in it."""
        loss = self.boundary(step, "loss")
        back = self.boundary(step, "backward")
        after = self.boundary(step, "step")
        return (loss.bytes("saved") + loss.bytes("input") + loss.bytes("parameter") + loss.bytes("buffer")
                + back.bytes("gradient") + after.bytes("optimizer_state"))

    def ratio(self, step: int) -> float:
        """Peak of ``step`` over :meth:`persistent` of ``step``."""
        return self.peak_of(step).bytes / self.persistent(step)

    def table(self, step: int | None = None, limit: int | None = None) -> str:
        """The timeline as text: index, step, phase, op, where, allocated, freed, live."""
        rows = [r for r in self.records if step is None or r.step == step][:limit]
        lines = [f"{'#':>5} {'step':>4} {'phase':<9} {'op':<38} {'where':<28} {'alloc':>10} {'freed':>10} "
                 f"{'live':>12}"]
        lines += [f"{r.index:>5} {r.step:>4} {r.phase:<9} {r.op:<38.38} {r.where:<28.28} {r.allocated:>10,} "
                  f"{r.freed:>10,} {r.live:>12,}" for r in rows]
        return "\n".join(lines)
