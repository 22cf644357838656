"""FSDP1's gradient accumulation (``--data-parallel fsdp1 | fsdp1-grad-op --micro-batches M``) against real gloo runs:
every micro-batch but the last inside ``with model.no_sync():`` (symmem.record.fsdp1_runs.NoSync), as DDP's measured
loop runs them; each rank's first and steady peak, derived, equal the live bytes measured inside that rank.

What FSDP1 keeps under ``no_sync()`` (torch 2.13's ``_post_backward_hook``, ``_should_free_in_backward``,
``prepare_gradient_for_backward``; passes/fsdp1.py): a unit's flat gradient stays its flat parameter's unsharded
``.grad`` between micro-batches (a later one's is added into it in place), ``FULL_SHARD`` frees the unsharded flat
parameter after each backward as with sync, ``SHARD_GRAD_OP`` keeps it until the last micro-batch's post-backward.
The MLP 64-127-10 shows the two apart (its weights weigh more than its activations); at its sizes a walk that
reduced every micro-batch would be 11,000 B low on both peaks.

The runs: :data:`LIVE` rides in tests/test_zero_redundancy.py's spawn of four; :data:`MEASURED` holds every case
measured (``python -m pytest -m deep`` reruns them in three spawns).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from symmem import derive

TRANSFORMER = {"B": 2, "S": 32, "L": 2, "H": 64, "h": 4, "V": 100, "F": 128}
MODELS = {"mlp": ({"B": 4}, {"widths": "64,127,10", "loss": "cross-entropy"}),
          "gpt2": (TRANSFORMER, {"attention": "sdpa", "dropout": 0.0, "loss": "cross-entropy"}),
          "llama": ({**TRANSFORMER, "G": 2}, {"attention": "sdpa", "loss": "cross-entropy"})}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    engine: str
    world: int
    micro_batches: int
    checkpoint: str = "none"

    @property
    def label(self) -> str:
        return f"{self.model} {self.engine} N={self.world} M={self.micro_batches} {self.checkpoint}"

    def derive(self) -> Any:
        values, kw = MODELS[self.model]
        if self.checkpoint == "selective":
            kw = {**kw, "attention": "naive"}  # selective is modelled for eager attention
        return derive(self.model, convention="pytorch", device="cpu", optimizer="adamw",
                      values={**values, "N": self.world}, data_parallel=self.engine,
                      micro_batches=self.micro_batches, checkpoint=self.checkpoint, **kw)


def _both(model: str, world: int, m: int, checkpoint: str = "none") -> list[Case]:
    return [Case(model, e, world, m, checkpoint) for e in ("fsdp1", "fsdp1-grad-op")]


#: Every rank's measured (first, steady) peak -- the same on every rank (FSDP1's flat shards are even), gloo on the
#: CPU, torch 2.13, AdamW, cross-entropy; the steady one the lower of steps 2 and 3.
MEASURED: dict[Case, tuple[int, int]] = dict(zip(
    [*_both("mlp", 2, 2), *_both("gpt2", 2, 2), *_both("llama", 2, 2),
     *_both("mlp", 3, 3), *_both("gpt2", 3, 3), *_both("llama", 3, 3),
     *_both("gpt2", 2, 2, "full"), *_both("llama", 2, 2, "full"),
     *_both("gpt2", 2, 3, "selective"), *_both("llama", 2, 3, "selective"),
     *_both("gpt2", 2, 2, "every-2"), *_both("llama", 2, 2, "every-2")],
    [(154780, 192932), (154780, 192932), (2191880, 2747924), (2191880, 2747924), (1574344, 1921748),
     (1574344, 1921748),
     (150984, 176424), (156108, 181548), (2099240, 2469956), (2099240, 2469956), (1516456, 1748068),
     (1516456, 1748068),
     (1878536, 2434580), (1878536, 2434580), (1310664, 1658068), (1310664, 1658068),
     (2198024, 2754068), (2198024, 2754068), (1580744, 1928148), (1580744, 1928148),
     (2057992, 2614036), (2191880, 2747924), (1426376, 1773780), (1574344, 1921748)], strict=True))
#: Run in every suite run (tests/test_zero_redundancy.py's spawn of four, N = 4): both strategies over three
#: micro-batches (the second one adds into the held .grad) with the 127 rows padded, SHARD_GRAD_OP live, FULL_SHARD
#: replayed from its stored real run since stop 39 (FULL_SHARD live in tests/test_data_parallel.py's spawn); GPT-2
#: with selective recomputation (FSDP1's selective run in the suite: tests/test_selective_engines.py) replayed from
#: its stored real run there (tests/gloo_store.py; that test's deep twin reruns it)
LIVE = (*_both("mlp", 4, 3), Case("gpt2", "fsdp1", 4, 2, "selective"))
#: Replayed against the stored measurement in the default suite (the rest under ``-m deep``)
REPLAYED = (*_both("mlp", 3, 3), Case("gpt2", "fsdp1", 2, 3, "selective"),
            Case("gpt2", "fsdp1-grad-op", 2, 2, "every-2"))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.label, marks=() if c in REPLAYED else pytest.mark.deep)
                                  for c in MEASURED])
def test_every_rank_equals_its_stored_gloo_measurement(case):
    d = case.derive()
    assert (d.value("peak_first_step"), d.value("peak")) == MEASURED[case]


def cases(chosen: tuple[Case, ...] | None = None) -> list[tuple[Case, Any]]:
    return [(c, c.derive()) for c in (MEASURED if chosen is None else chosen)]


def jobs(found: list[tuple[Case, Any]]) -> list[Any]:
    from symmem.record.distributed import job_of

    return [job_of(d) for _, d in found]


def check(found: list[tuple[Case, Any]], runs: list[tuple[Any, ...]]) -> list[str]:
    """Where a case's ranks differ from its derivation or its stored measurement; every rank's parameter side (read
    at the last micro-batch's end of backward).  Every rank derives the same: the lower of them counts (gloo's late
    frees only ever add)."""
    from symmem.record.distributed import compare_parameter_side

    wrong: list[str] = []
    for (case, d), ranks in zip(found, runs, strict=True):
        want = (d.value("peak_first_step"), d.value("peak"))
        got = (min(r.first for r in ranks), min(x for r in ranks for x in r.per_step[1:]))
        wrong += [f"{case.label}: derived {want}, measured {got} (at {ranks[0].where})"] if want != got else []
        wrong += [f"{case.label}: stored {MEASURED[case]}, measured {got}"] if MEASURED.get(case, got) != got else []
        wrong += [f"{case.label} {w}" for w in compare_parameter_side(d, ranks)]
    return wrong


def test_the_strategies_differ_where_measured():
    """SHARD_GRAD_OP keeps every unit's unsharded flat parameter across micro-batches under no_sync(): at the MLP's
    peak (fc1's backward, N = 3) FULL_SHARD has freed fc2's, which SHARD_GRAD_OP holds -- its 1,280 elements
    padded to 3 x 427, 5,124 B -- on both peaks, measured."""
    full, grad_op = (MEASURED[c] for c in _both("mlp", 3, 3))
    assert grad_op[0] - full[0] == grad_op[1] - full[1] == 3 * -(-(127 * 10 + 10) // 3) * 4 == 5124
    d = _both("mlp", 3, 3)[1].derive()
    assert d.peak_at().where().startswith("backward fc1")


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_case_against_fresh_gloo_runs():
    from symmem.record.distributed import measure_jobs

    wrong = []
    for world in (2, 3):
        found = cases(tuple(c for c in MEASURED if c.world == world))
        wrong += check(found, measure_jobs(jobs(found), world=world, timeout=600, start_method="forkserver"))
    assert not wrong, "\n".join(wrong)
