"""Which cases of a parametrized table the default suite keeps: a greedy cover of the table's line coverage.

A pytest plugin and a script (docs/testing.md, "Tables thinned by coverage").  First record each test's lines of
``symmem/`` and ``tests/`` (needs ``coverage``, not a test extra: ``pip install coverage``; and ``psutil``, as
``tests/cpu_times.py`` does)::

    SYMMEM_TABLE_COVER=/tmp/cov.json PYTHONPATH=. python -m pytest -p tests.table_cover -n 0 tests/test_x.py

then, for each test function of two or more cases, the cases a greedy cover keeps (most new lines per CPU-second
first, until the kept cases run every line the whole table runs) and the ones it could leave to ``-m deep``::

    python -m tests.table_cover /tmp/cov.json [--cpu /tmp/cpu.jsonl] [--file tests/test_x.py]

``--cpu`` takes costs from ``tests/cpu_times.py``'s lines (untraced) instead of the traced run's.  What the cover
cannot see, and why a person still decides: lines run in child processes (gloo ranks, CLI subprocesses; a case whose
children's CPU exceeds its own is flagged ``CHILD``); a module fixture's lines, counted to the first case that builds
it (so that case looks unique: conservative); and values -- two cases running the same lines check different numbers,
which matters where the numbers are the point (a published figure, a size that crosses a branch of sympy's).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cpu_times import tree_cpu

_state: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("SYMMEM_TABLE_COVER") or "cov" in _state:
        return
    import coverage

    root = os.getcwd()
    cov = coverage.Coverage(data_file=None, source=[os.path.join(root, "symmem"), os.path.join(root, "tests")],
                            config_file=False)
    cov.start()
    _state.update(cov=cov, cpu={})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if "cov" not in _state:
        yield
        return
    own, tree = time.process_time(), tree_cpu()
    yield
    _state["cpu"][item.nodeid] = (time.process_time() - own, tree_cpu() - tree, bool(item.get_closest_marker("deep")))


def _phase(item: pytest.Item, phase: str) -> Iterator[None]:
    # a phase of its own: a module fixture's lines are in the setup of the case that builds it, not in its call
    cov = _state.get("cov")
    if cov is not None:
        cov.switch_context(f"{item.nodeid}|{phase}")
    yield
    if cov is not None:
        cov.switch_context("")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    yield from _phase(item, "setup")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    yield from _phase(item, "call")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield from _phase(item, "teardown")


def pytest_unconfigure(config: pytest.Config) -> None:
    cov = _state.pop("cov", None)
    if cov is None:
        return
    cov.stop()
    data, cpu = cov.get_data(), _state.pop("cpu")
    root = os.getcwd() + os.sep
    lines: dict[str, set[str]] = {k: set() for k in cpu}
    call: dict[str, set[str]] = {k: set() for k in cpu}
    for path in data.measured_files():
        rel = path.removeprefix(root)
        for number, contexts in data.contexts_by_lineno(path).items():
            for context in contexts:
                test, _, phase = context.rpartition("|")
                if test in lines:
                    lines[test].add(f"{rel}:{number}")
                    if phase == "call":
                        call[test].add(f"{rel}:{number}")
    tests = {k: {"cpu": cpu[k][0], "tree": cpu[k][1], "deep": cpu[k][2], "lines": sorted(lines[k]),
                 "call": sorted(call[k])} for k in cpu}
    with open(os.environ["SYMMEM_TABLE_COVER"], "w") as f:
        json.dump({"tests": tests}, f)


def cover(lines: dict[str, set[str]], cost: dict[str, float]) -> list[str]:
    """The cases a greedy cover keeps, in the order it picks them.

    >>> cover({"a": {"1", "2"}, "b": {"2"}, "c": {"3"}}, {"a": 1.0, "b": 0.1, "c": 1.0})
    ['b', 'a', 'c']
    """
    need = set().union(*lines.values())
    kept: list[str] = []
    covered: set[str] = set()
    left = set(lines)
    while covered != need:
        best = max(sorted(left), key=lambda c: (len(lines[c] - covered) / max(cost[c], 0.01), -cost[c]))
        kept.append(best)
        covered |= lines[best]
        left.discard(best)
    return kept


def missing(default: dict[str, dict[str, Any]], moved: dict[str, dict[str, Any]], table: str) -> set[str]:
    """Lines a deep case of ``table`` runs that the default suite's run of the same file does not run at all.

    ``default`` is the file's default run, ``moved`` the same run with its tables' kept cases swapped for their deep
    ones.  The file, not the table: kept cases read derivations and models other tests of the file made first (a
    cache), and a table's cold first case runs lines a warm one does not, so per table the lines of two runs are not
    comparable (stop 42: the first check per table failed 8 tables on lines each run elsewhere in the file).

    >>> run = {"f::t[a]": {"deep": False, "lines": ["x:1", "x:2"], "call": ["x:2"]},
    ...        "f::u": {"deep": False, "lines": ["x:4"], "call": ["x:4"]}}
    >>> swapped = {"f::t[b]": {"deep": True, "lines": ["x:1", "x:3"], "call": ["x:3"]},
    ...            "f::t[c]": {"deep": True, "lines": ["x:4", "x:2"], "call": ["x:2"]}}
    >>> sorted(missing(run, swapped, "f::t"))
    ['x:3']
    """
    every = set().union(*(v["lines"] for v in default.values()))
    cases = [v for k, v in moved.items() if k.split("[")[0] == table and v["deep"]]
    return set().union(*(set(v["lines"]) - every for v in cases))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.table_cover", description=__doc__.split("\n")[0])
    parser.add_argument("coverage", help="the JSON the plugin wrote")
    parser.add_argument("--cpu", help="tests/cpu_times.py's JSON lines: untraced costs")
    parser.add_argument("--file", help="only the tables of this test file")
    args = parser.parse_args(argv)
    tests = json.load(open(args.coverage))["tests"]
    cost = {k: v["cpu"] for k, v in tests.items()}
    child = {k for k, v in tests.items() if v["tree"] > 2 * v["cpu"] + 0.3}
    if args.cpu:
        for row in map(json.loads, open(args.cpu)):
            if (k := row["id"].split("@")[0]) in cost:
                cost[k] = row["tree"]
    lines = {k: set(v["lines"]) for k, v in tests.items()}
    tables: dict[str, list[str]] = collections.defaultdict(list)
    for k in tests:
        if not args.file or k.startswith(args.file):
            tables[k.split("[")[0]].append(k)
    movable = 0.0
    for name, cases in sorted(tables.items()):
        if len(cases) < 2:
            continue
        kept = cover({c: lines[c] for c in cases}, cost)
        left = sorted(set(cases) - set(kept), key=lambda c: -cost[c])
        spare = sum(cost[c] for c in left)
        movable += spare
        print(f"\n{name}: {len(cases)} cases, {sum(cost[c] for c in cases):.1f} CPU-s; keeps {len(kept)}, "
              f"could leave {len(left)} ({spare:.1f} CPU-s)")
        for mark, group in (("keep", kept), ("deep", left)):
            for c in group:
                print(f"  {mark} {cost[c]:6.2f} {'CHILD ' if c in child else ''}{c[len(name):]}")
    print(f"\ncould leave in all: {movable:.1f} CPU-s")


if __name__ == "__main__":
    main()
