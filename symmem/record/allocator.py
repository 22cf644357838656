"""The CPU allocator's own view of a recorded step: the profiler's allocation events replayed per step and phase,
and the memory an op allocates and frees inside itself (which a dispatch mode cannot see)."""

from __future__ import annotations

from typing import Any

from ..categories import RECORDED_PHASES
from .steptrace import AllocatorPeaks


def _allocations(ev: Any) -> list[tuple[int, int]]:
    """(time, bytes) of every allocation (+) and free (-) event under profiler event ``ev``, in time order."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int]] = []
    todo = [ev]
    while todo:
        e = todo.pop()
        if e.tag == _EventType.Allocation:
            out.append((e.start_time_ns, int(e.extra_fields.alloc_size)))
        todo.extend(e.children)
    return sorted(out)


def allocator_peaks(prof: Any, live_at_start: int) -> AllocatorPeaks:
    """Replay the profiler's allocation events, attributing each to the ``symmem/STEP/PHASE`` range around it, and
    find the memory each op dispatched to the tracker's mode allocated and freed inside itself."""
    from torch._C._profiler import _EventType

    events: list[tuple[int, int, tuple[int, str] | None]] = []
    hidden: dict[str, tuple[int, int]] = {}
    todo: list[tuple[Any, tuple[int, str] | None, Any]] = [
        (root, None, None) for root in prof.profiler.kineto_results.experimental_event_tree()]
    while todo:
        ev, where, parent = todo.pop()
        if ev.name.startswith("symmem/"):
            _, step, phase = ev.name.split("/")
            where = (int(step), phase)
        if ev.tag == _EventType.Allocation:
            events.append((ev.start_time_ns, int(ev.extra_fields.alloc_size), where))
        if parent is not None and parent.name == "PythonDispatchMode" and ev.tag == _EventType.TorchOp:
            run = most = 0
            for _, delta in _allocations(ev):
                run += delta
                most = max(most, run)
            inside = most - max(run, 0)  # the op's peak above what it leaves allocated (its outputs)
            if inside > 0:
                count, top = hidden.get(ev.name, (0, 0))
                hidden[ev.name] = (count + 1, max(top, inside))
        todo.extend((c, where, ev) for c in ev.children)
    events.sort(key=lambda e: e[0])
    live = live_at_start
    peaks: dict[tuple[int, str], int] = {}
    for _, delta, where in events:
        live += delta
        if where is not None and delta > 0:
            peaks[where] = max(peaks.get(where, live), live)
    order = sorted(peaks.items(), key=lambda kv: (kv[0][0], RECORDED_PHASES.index(kv[0][1])))
    return AllocatorPeaks(live_at_start, tuple(order), len(events),
                          tuple(sorted(((k, c, m) for k, (c, m) in hidden.items()), key=lambda r: -r[2])))



def distinct_bytes(tensors: Any) -> int:
    """The bytes of the distinct storages of ``tensors`` (``None`` skipped)."""
    from .identity import storage_key

    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            seen[storage_key(t)] = int(t.untyped_storage().nbytes())
    return sum(seen.values())
