"""A pytest plugin that writes each test's CPU time, its processes' included, to a JSON-lines file.

Load it by name with the file to write in ``SYMMEM_CPU_TIMES`` (docs/testing.md, "Measuring the suite's time")::

    SYMMEM_CPU_TIMES=/tmp/cpu.jsonl PYTHONPATH=. python -m pytest -p tests.cpu_times

One line per test and test process (``worker``: xdist's name, ``main`` without workers): ``id``, ``worker``,
``start`` and ``end`` (epoch seconds), ``cpu`` (the test process's own user + system time) and ``tree`` (``cpu`` with
every descendant process's: the children it reaped, and the live ones -- a forkserver with the gloo ranks it has
reaped, a Jupyter kernel -- counted by psutil).  ``tree`` is what a test costs the machine; wall time on shared cores
is not.  Without ``SYMMEM_CPU_TIMES`` the plugin does nothing.  Needs ``psutil`` (imported when a test starts).
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator

import pytest


def tree_cpu() -> float:
    """User + system seconds of this process, the children it reaped and every live descendant (with the children
    each of those reaped): a descendant that dies is reaped by its parent, so it moves from the live sum to that
    parent's, and is counted once."""
    import psutil

    total = time.process_time()
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    total += reaped.ru_utime + reaped.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # gone meanwhile: its parent reaps it
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    out = os.environ.get("SYMMEM_CPU_TIMES")
    if not out:
        yield
        return
    start, own, tree = time.time(), time.process_time(), tree_cpu()
    yield
    line = {"id": item.nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": start,
            "end": time.time(), "cpu": time.process_time() - own, "tree": tree_cpu() - tree}
    with open(out, "a") as f:  # one short append a test: the workers' lines do not interleave
        f.write(json.dumps(line) + "\n")
