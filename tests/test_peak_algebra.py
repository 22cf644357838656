"""The peak algebra's shortcuts against their definitions.

:func:`symmem.peak.survivors` keeps, of candidate moments in a given order, the first of each class of equal
totals that no other total provably exceeds (every coefficient at least as large); it finds them trying each kept
total's last witness monomial first.  The truth here is the definition itself, checked pair by pair.  An FSDP
engine's walk is freed as soon as it is dropped (no reference cycle left for the collector: 22,000 objects per walk
of Llama's step were).
"""

from __future__ import annotations

import gc
import random
import weakref

import pytest

from symmem import derive
from symmem.passes.schedule import Simulation
from symmem.peak import survivors


def _geq(a: dict[int, int], b: dict[int, int]) -> bool:
    return all(a.get(k, 0) >= v for k, v in b.items()) and all(v >= 0 for k, v in a.items() if k not in b)


def _by_definition(order: list[int], totals: dict[int, dict[int, int]]) -> list[int]:
    """Each total no other strictly exceeds, the first of its equals, in ``order``."""
    out = []
    for i, c in enumerate(order):
        beaten = any(_geq(totals[d], totals[c]) and not _geq(totals[c], totals[d]) for d in order)
        earlier = any(_geq(totals[d], totals[c]) and _geq(totals[c], totals[d]) for d in order[:i])
        if not beaten and not earlier:
            out.append(c)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_survivors_keep_what_the_definition_keeps(seed):
    rng = random.Random(seed)
    for _ in range(60):
        n, width = rng.randint(1, 14), rng.randint(1, 5)
        # non-negative coefficients (as the algebra's shifted sizes), small so that equal totals and dominance occur
        totals = {c: {k: v for k in range(width) if (v := rng.randint(0, 3))} for c in range(n)}
        order = rng.sample(range(n), n)
        assert survivors(order, totals) == _by_definition(order, totals)


@pytest.mark.parametrize("engine", ["fsdp", "fsdp1"])
def test_a_finished_fsdp_walk_is_freed_without_the_collector(engine):
    step = derive("mlp", optimizer="sgd", data_parallel=engine, values={"N": 2}).step
    was = gc.isenabled()
    gc.disable()
    try:
        sim = Simulation(step.graph, step.conv, step.options, step.regime, None, False)
        sim.micro_batch()
        assert sim.fsdp is not None and sim.fsdp.sim is sim
        walk = weakref.ref(sim)
        del sim
        assert walk() is None  # freed by reference counting alone
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("engine", [None, "fsdp"])
def test_storages_counted_together_hold_what_each_holds(engine):
    """The peak counts storages of one category alive at the same moments as one (an FSDP unit's unsharded
    parameters, a layer's weights and optimizer state): at every moment of both steps the bytes so counted are,
    category by category, what the timeline's own walk over each storage gives (``Timeline.rows``)."""
    from symmem.categories import STEP
    from symmem.passes.graph_step import _layer
    from symmem.timeline import Summed

    keywords = {"data_parallel": engine, "values": {"N": 2}} if engine else {}
    d = derive("llama", device="cpu", **keywords)
    numbers = {**d.numbers, **{s: 4 for s in d.numbers if s.name == "L"}}
    for step in ("steady", "first"):
        tl, values = d.step._written_out(step, numbers)
        ids: dict = {}
        counted = tl.counts(every=True, ids=ids, together=_layer)
        keys = list(ids)
        sizes = [int((size.expr() if isinstance(size, Summed) else size).xreplace(values)) for _, size in keys]
        rows = tl.rows(values)
        assert len(counted) == len(rows)
        for (_, live, _), (_, _, row) in zip(counted, rows, strict=True):
            per = dict.fromkeys(STEP, 0)
            for x, n in live.items():
                per[STEP[keys[x][0]]] += n * sizes[x]
            assert per == row
        together = [size for _, size in keys if isinstance(size, Summed)]
        assert together and max(sum(k for _, k in s.sizes) for s in together) >= 9  # a layer's nine weights
