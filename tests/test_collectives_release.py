"""A collective's tensors released on the recording thread (symmem.record.collectives): the truth is the recorder's
own finalizers, which note the thread each free runs on; a free that gloo's worker thread runs lands at no fixed op
(docs/testing.md, "The repeats: gloo's late frees")."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from gloo_store import START  # noqa: E402  (how the suite's ranks start)

from symmem.errors import SymmemError  # noqa: E402
from symmem.record.collective_stress import STRESSED, stress  # noqa: E402
from symmem.record.live_bytes import LiveTracker  # noqa: E402


def test_a_free_another_thread_runs_is_late():
    """The recorder tells a free on another thread (the last reference dropped there) from one on its own."""
    tracker = LiveTracker()
    box = []
    with tracker, tracker.phase(1, "forward"):
        x = torch.ones(8)  # freed here
        y = torch.ones(16)  # freed by the other thread
        box.append(y)
        del x, y
        other = threading.Thread(target=box.clear)
        other.start()
        other.join()
    trace = tracker.trace()
    assert [(s.nbytes, s.died is not None) for s in trace.storages] == [(32, True), (64, True)]
    assert trace.late == (1,)


@pytest.mark.xdist_group("gloo")  # on the gloo tests' worker (its ranks forked from it: gloo_store.START)
def test_every_collective_frees_on_the_recording_thread():
    """100 of each collective the engines call, on two gloo ranks: under released() no free runs on gloo's thread
    (without it, 19-34 of 400 per collective did, measured; 0 of 6,000 per collective with it at 3,000 repeats)."""
    found = stress(2, 100, start_method=START)
    assert found == dict.fromkeys(STRESSED, (0, 2 * 100 * 3))


@pytest.mark.parametrize("world, repeats", [(1, 10), (2, 0), (True, 10), (2, 1.5)])
def test_bad_stress_arguments_are_one_line_errors(world, repeats):
    with pytest.raises(SymmemError, match="world of at least 2|positive integer"):
        stress(world, repeats)
