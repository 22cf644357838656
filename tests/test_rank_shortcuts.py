"""The data-parallel engines' shortcuts held against the long way (passes/graph_step.py, passes/schedule.py).

A ZeRO-1 rank's prune (``_Shared.prune``) compares only the moment the backward ends at with the shared moments
(those :func:`symmem.peak.survivors` kept of every rank's forward and backward, to which a rank adds the same bytes):
it keeps what ``survivors`` keeps of every moment with the rank's bytes added, in the same order, for the ranks'
own bytes and for bytes that put the end's moment anywhere among the shared ones (above, below, tied).  The values
those shortcuts give are held against real gloo runs in tests/test_zero_redundancy.py.
"""

from __future__ import annotations

import pytest

from symmem import derive
from symmem.passes import graph_step
from symmem.peak import survivors

TINY = {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100}


def _long_way(shared, keys, extra, own):
    """What the rank's prune was: every shared total copied with ``extra`` added, ``survivors`` over them all."""
    totals = [shared._with(shared.totals[k], extra) for k in keys] + [shared._with(shared.end, own)]
    values = [shared.values[k] + extra for k in keys] + [shared.end_value + own]
    return survivors(sorted(range(len(totals)), key=lambda i: -values[i]), totals)


@pytest.mark.parametrize("model, values, kw", [
    ("gpt2", {"B": 2, "N": 4}, {}),
    ("gpt2", {**TINY, "L": 6, "B": 2, "N": 3}, {"attention": "sdpa", "loss": "cross-entropy"}),
    ("llama", {**TINY, "L": 5, "B": 2, "G": 2, "F": 128, "N": 8}, {"attention": "sdpa"}),
])
def test_a_ranks_prune_keeps_what_survivors_keeps(monkeypatch, model, values, kw):
    found = []
    original = graph_step._dominant

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        found.append(out)
        return out

    monkeypatch.setattr(graph_step, "_dominant", spy)
    d = derive(model, convention="pytorch", device="cpu", values=values, data_parallel="zero-redundancy", **kw)
    d.value("peak")
    shared = [s for s in found if s is not None]
    assert shared, "no rank took the shortcut"
    compared = 0
    for s in shared:
        keys = list(s.totals)
        top, bottom = max(s.values.values()), min(s.values.values())
        largest = sorted(s.values.values())[-4:]
        for extra in (0, 12_345_678):
            # the end's moment from below every shared one to above all of them, tied with each, and just
            # above and below the largest
            owns = {0, 1, max(0, top + extra - s.end_value + 1)}
            owns |= {max(0, v + extra - s.end_value) for v in s.values.values()}
            owns |= {max(0, v + extra - s.end_value + d) for v in largest for d in (-1, 1)}
            owns |= {max(0, bottom + extra - s.end_value + k * (top - bottom) // 8) for k in range(9)}
            for order in (keys, keys[::-1]):
                for own in sorted(owns):
                    assert s.prune(order, extra, own) == _long_way(s, order, extra, own), (extra, own)
                    compared += 1
    assert compared > 100


#: the MLPs whose ranks differ (FSDP2's padded rows: 127 rows over 3 ranks are 43, 43, 41; ZeRO-1's whole
#: parameters) or hold alike (DDP, FSDP1), M = 1 and 2, both devices
AT_NUMBERS = [(engine, {"B": 4, "N": n}, m, device)
              for engine, n in (("fsdp", 3), ("fsdp-no-reshard", 4), ("zero-redundancy", 4), ("ddp", 2), ("fsdp1", 3))
              for m in (1, 2) for device in ("cpu", "cuda")]
#: the rows the default suite checks, the rest under ``-m deep`` (stop 42, docs/testing.md): together they run every
#: line of symmem/ and tests/ the twenty run (line coverage, tests/table_cover.py) -- each engine at M = 1 and 2,
#: both devices among them; FSDP2 without resharding runs no line FSDP2's rows do not
AT_NUMBERS_KEPT = (("fsdp", 1, "cpu"), ("fsdp", 2, "cuda"), ("zero-redundancy", 1, "cpu"),
                   ("zero-redundancy", 1, "cuda"), ("ddp", 1, "cuda"), ("ddp", 2, "cuda"), ("fsdp1", 1, "cpu"),
                   ("fsdp1", 2, "cpu"))


@pytest.mark.parametrize("engine, values, m, device", [
    pytest.param(*row, marks=() if (row[0], row[2], row[3]) in AT_NUMBERS_KEPT else pytest.mark.deep)
    for row in AT_NUMBERS])
def test_each_rank_at_numbers_is_its_formula_there(engine, values, m, device):
    """``rank_numbers`` (each group of alike ranks' step written out at the numbers, no formula made) gives what
    the peak's formulas give there -- each rank's group's (FSDP2: ``rank_derivations``; ZeRO-1: the ranks' peak) --
    and what ``peak_allocated(step, rank)`` gives; ``rank_peaks`` the same from either path.  Over 442 engines x
    models x N x M x options (docs/testing.md, "Stop 38: ranks-numeric") the two paths gave the same bytes; the
    walks' bytes are held against real runs in tests/test_cuda_stop37_measured.py and the gloo files."""
    from symmem.passes import data_parallel, rank_numbers, zero_redundancy

    kw = dict(convention="pytorch", device=device, optimizer="adamw", values=values, data_parallel=engine,
              micro_batches=m, widths="64,127,10", loss="cross-entropy")
    d = derive("mlp", **kw)
    world = values["N"]
    if engine == "zero-redundancy":
        want = zero_redundancy.rank_peaks(d)
    elif engine in data_parallel.SHARDED:
        want = {r: (rd.value("peak_first_step"), rd.value("peak")) for group, rd in data_parallel.rank_derivations(d)
                for r in group}
    else:
        want = dict.fromkeys(range(world), (d.value("peak_first_step"), d.value("peak")))
    fresh = derive("mlp", **kw)  # the numeric path on a derivation no formula was made for
    assert rank_numbers.peaks_per_rank(fresh) == dict(sorted(want.items()))
    for rank in range(world):
        walked = rank_numbers.written(fresh, rank)
        assert [walked.allocated(s) for s in ("first", "steady")] == [d.peak_allocated(s, rank)
                                                                      for s in ("first", "steady")]
    assert data_parallel.rank_peaks(fresh) == data_parallel.rank_peaks(d) == (
        None if len(set(want.values())) == 1 else dict(sorted(want.items())))
