"""A table's cases as ``pytest.param``s: those its ``kept`` ids name run in the default suite, the rest under
``-m deep`` (docs/testing.md, "Stop 42: thinpeak42": which a greedy cover of the table's line coverage keeps and
which are kept by hand).

The ids are made unique as pytest makes them (a repeated id gets 0, 1, ... after it; ``_`` first where it ends in a
digit), so ``kept`` names the ids a run shows.  A kept id that names no case is an error: a renamed case must not
leave the default suite unnoticed.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import Any

import pytest


def unique(ids: Sequence[str]) -> list[str]:
    """The ids as pytest shows them.

    >>> unique(["a", "b", "a", "c1", "c1"])
    ['a0', 'b', 'a1', 'c1_0', 'c1_1']
    """
    counts = collections.Counter(ids)
    taken = set(ids)
    suffixes: dict[str, int] = collections.defaultdict(int)
    out = []
    for i in ids:
        if counts[i] > 1:
            sep = "_" if i[-1:].isdigit() else ""
            new = f"{i}{sep}{suffixes[i]}"
            while new in taken:
                suffixes[i] += 1
                new = f"{i}{sep}{suffixes[i]}"
            suffixes[i] += 1
            i = new
        out.append(i)
    return out


def kept(cases: Iterable[Any], ids: Iterable[str], keep: set[str], *, unpack: bool = False) -> list[Any]:
    """``cases`` as ``pytest.param``s with ``ids``, those not in ``keep`` marked ``deep``; ``unpack``: each case is a
    tuple of several arguments."""
    cases, names = list(cases), unique(list(ids))
    unknown = keep - set(names)
    if unknown:
        raise ValueError(f"kept ids that name no case: {sorted(unknown)}")
    return [pytest.param(*(c if unpack else (c,)), id=n, marks=() if n in keep else pytest.mark.deep)
            for c, n in zip(cases, names, strict=True)]
