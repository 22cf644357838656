"""``--checkpoint selective`` under the data-parallel engines against real gloo runs: each rank's first and steady
peak and its parameter side, derived, equal the live bytes measured inside that rank, to the byte.

The truth is the reference's core attention (transformers 5.23's ``eager_attention_forward``) under
``torch.utils.checkpoint(..., use_reentrant=False)``, as tests/test_selective_recompute.py checks it on one device
(:mod:`symmem.reference.sequence_models`: GPT-2's (B, 1, S, S) mask made once and passed to every core; Llama's
position ids passed along as HF passes them), wrapped in DDP, DDP with ``gradient_as_bucket_view`` or DDP with
``ZeroRedundancyOptimizer``.  No engine hook acts inside the forward, so the cores recompute in backward as on one
device; the engine adds its buckets (beside, or as, the gradients) and, under ZeRO-1, its partition of the optimizer.

The runs ride in tests/test_zero_redundancy.py's spawn of four processes (:func:`jobs`, :func:`check`): N = 4 on the
world, N = 2 on the group {0, 1} (once: the ranks 2 and 3 skip it; DDP's reducer may free late on gloo's thread, but
no such free landed at a peak in any run, docs/testing.md "The repeats").
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from symmem import derive

#: S = 128 > H: the peak sits in backward, where what selective drops (scores, softmax) shows
VALUES = {"B": 2, "S": 128, "L": 2, "H": 32, "h": 4, "V": 64, "F": 64}
#: the models' keywords: GPT-2 (q, k, v views of c_attn's output, kept whole; the cache's copies) and Llama with
#: G = 2 (repeat_kv inside the core; the rotary query, the cache's copies, the mask and position ids kept)
KEYWORDS = {"gpt2": {"attention": "naive", "dropout": 0.0, "loss": "cross-entropy"},
            "llama": {"attention": "naive", "loss": "cross-entropy"}}
DDP = ("ddp", "ddp-bucket-view", "zero-redundancy")
FSDP = ("fsdp", "fsdp-no-reshard", "fsdp1", "fsdp1-grad-op")
#: the FSDP tables' sizes: V = 101 pads the embedding's rows (FSDP2's last rank holds less); S = 32 with H = 64,
#: F = 128 makes the weights weigh more (FSDP2 without resharding peaks in the forward)
PADDED = {"V": 101}
WIDE = {"S": 32, "H": 64, "F": 128, "V": 101}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    engine: str
    world: int
    more: tuple[tuple[str, int], ...] = ()
    micro_batches: int = 1

    @property
    def label(self) -> str:
        more = "".join(f" {k}={v}" for k, v in self.more)
        return f"{self.model} {self.engine} N={self.world}{more}" + (
            f" M={self.micro_batches}" if self.micro_batches > 1 else "")

    def derive(self, checkpoint: str = "selective") -> Any:
        values = {**VALUES, **({"G": 2} if self.model == "llama" else {}), **dict(self.more), "N": self.world}
        return derive(self.model, convention="pytorch", device="cpu", optimizer="adamw", values=values,
                      data_parallel=self.engine, checkpoint=checkpoint, micro_batches=self.micro_batches,
                      **KEYWORDS[self.model])


#: Every rank's measured (first, steady) peak, gloo on the CPU, torch 2.13 (the steady one the lower of steps 2 and
#: 3; at N = 2 under DDP, stored from the lower of the two groups {0, 1}, {2, 3} run at once; now run once).  Rerun
#: live: :data:`LIVE` in every suite run (tests/test_zero_redundancy.py's spawn), all of them with ``python -m pytest
#: -m deep`` (:func:`measure`). Plain DDP's and ZeRO-1's first steps are equal (the same DDP;
#: ZeroRedundancyOptimizer's state is made in the step); rank 0 of ZeRO-1 owns the embedding; FSDP2's last rank holds
#: the padding at V = 101, FSDP1's flat shards are even.
MEASURED: dict[Case, tuple[tuple[int, int], ...]] = {
    Case("gpt2", "ddp", 4): ((3143688, 3559544),) * 4,
    Case("gpt2", "ddp-bucket-view", 4): ((3122184, 3538040),) * 4,
    Case("gpt2", "zero-redundancy", 4): ((3143688, 3405836),) + ((3143688, 3194924),) * 3,
    Case("llama", "ddp", 4): ((2790952, 2972540),) * 4,
    Case("llama", "ddp-bucket-view", 4): ((2753832, 2935420),) * 4,
    Case("llama", "zero-redundancy", 4): ((2790952, 2836544),) + ((2790952, 2836284),) * 3,
    Case("gpt2", "ddp", 2): ((3143688, 3559544),) * 2,
    Case("gpt2", "ddp-bucket-view", 2): ((3122184, 3538040),) * 2,
    Case("gpt2", "zero-redundancy", 2): ((3143688, 3405836), (3143688, 3297396)),
    Case("llama", "ddp", 2): ((2790952, 2972540),) * 2,
    Case("llama", "ddp-bucket-view", 2): ((2753832, 2935420),) * 2,
    Case("llama", "zero-redundancy", 2): ((2790952, 2881876), (2790952, 2881616)),
    Case("gpt2", "fsdp", 2): ((3039752, 3247736),) * 2,
    Case("gpt2", "fsdp-no-reshard", 2): ((3039752, 3247736),) * 2,
    Case("gpt2", "fsdp1", 2): ((3039752, 3247636),) * 2,
    Case("gpt2", "fsdp1-grad-op", 2): ((3039752, 3247636),) * 2,
    Case("llama", "fsdp", 2): ((2745576, 2836412),) * 2,
    Case("llama", "fsdp-no-reshard", 2): ((2745576, 2836412),) * 2,
    Case("llama", "fsdp1", 2): ((2745576, 2836340),) * 2,
    Case("llama", "fsdp1-grad-op", 2): ((2745576, 2836340),) * 2,
    Case("gpt2", "fsdp", 4, (("V", 101),)): ((2998920, 3105528),) * 3 + ((2998920, 3104760),),
    Case("gpt2", "fsdp-no-reshard", 4, (("V", 101),)): ((2998920, 3105528),) * 3 + ((2998920, 3104760),),
    Case("gpt2", "fsdp1", 4, (("V", 101),)): ((2998440, 3104756),) * 4,
    Case("gpt2", "fsdp1-grad-op", 4, (("V", 101),)): ((2998440, 3104756),) * 4,
    Case("llama", "fsdp", 4, (("V", 101),)): ((2740424, 2791004),) * 3 + ((2740424, 2789468),),
    Case("llama", "fsdp-no-reshard", 4, (("V", 101),)): ((2740424, 2791004),) * 3 + ((2740424, 2789468),),
    Case("llama", "fsdp1", 4, (("V", 101),)): ((2739464, 2789588),) * 4,
    Case("llama", "fsdp1-grad-op", 4, (("V", 101),)): ((2739464, 2789588),) * 4,
    Case("gpt2", "fsdp", 3, tuple(WIDE.items())): ((1559976, 1935976),) * 2 + ((1559976, 1920888),),
    Case("gpt2", "fsdp-no-reshard", 3, tuple(WIDE.items())): ((1641964, 2017964),) * 2 + ((1641964, 2002876),),
    Case("gpt2", "fsdp1", 3, tuple(WIDE.items())): ((1549944, 1920828),) * 3,
    Case("gpt2", "fsdp1-grad-op", 3, tuple(WIDE.items())): ((1549944, 1920828),) * 3,
    Case("llama", "fsdp", 3, tuple(WIDE.items())): ((1185320, 1421804),) * 2 + ((1185320, 1408412),),
    Case("llama", "fsdp-no-reshard", 3, tuple(WIDE.items())): ((1297736, 1534220),) * 2 + ((1297736, 1520828),),
    Case("llama", "fsdp1", 3, tuple(WIDE.items())): ((1176408, 1408364),) * 3,
    Case("llama", "fsdp1-grad-op", 3, tuple(WIDE.items())): ((1176408, 1408364),) * 3,
    Case("gpt2", "fsdp", 2, (("V", 101),), 2): ((3242888, 3455736), (3242888, 3455480)),
    Case("gpt2", "fsdp-no-reshard", 2, (("V", 101),), 2): ((3242888, 3455736), (3242888, 3455480)),
    Case("llama", "fsdp", 2, (("V", 101),), 2): ((2823272, 2923836), (2823272, 2923324)),
    Case("llama", "fsdp-no-reshard", 2, (("V", 101),), 2): ((2823272, 2923836), (2823272, 2923324)),
}
#: The cases in tests/test_zero_redundancy.py's spawn of 4, derived and checked there in every suite run: ZeRO-1 at
#: N = 2 (plain DDP's reducer with ZeroRedundancyOptimizer, on the group {0, 1}; replayed there from its stored run
#: since stop 39: ZeRO-1 runs live twice in that spawn) and FSDP2 with the padding at N = 4 (the whole world, live);
#: FSDP1 with selective rides there too (tests/test_fsdp1_accumulation.py's LIVE, with micro-batches).  The rest
#: under ``-m deep`` (each live job costs its ranks about 1-4 CPU-s)
LIVE = (Case("llama", "zero-redundancy", 2), Case("gpt2", "fsdp", 4, (("V", 101),)))
#: Replayed (derived against the stored measurement) in the default suite, beside :data:`LIVE` (derived and
#: compared in the spawn): the rest under ``-m deep`` (Llama's FSDP2 walks take ~6 CPU-s each)
REPLAYED = (Case("gpt2", "zero-redundancy", 4), Case("gpt2", "ddp-bucket-view", 4), Case("gpt2", "ddp", 2),
            Case("gpt2", "fsdp1-grad-op", 3, tuple(WIDE.items())))


def cases(chosen: tuple[Case, ...] | None = None) -> list[tuple[Case, Any]]:
    """(case, derivation) of the ``chosen`` cases (None: every measured one)."""
    return [(c, c.derive()) for c in (MEASURED if chosen is None else chosen)]


def _per_rank(d: Any, world: int) -> tuple[tuple[int, int], ...]:
    """Each rank's derived (first, steady) peak: per rank under ZeRO-1 and FSDP, DDP's the same on every rank."""
    from symmem.passes import data_parallel, zero_redundancy

    found = zero_redundancy.rank_peaks(d) or data_parallel.rank_peaks(d) or dict.fromkeys(
        range(world), (d.value("peak_first_step"), d.value("peak")))
    return tuple(found[r] for r in range(world))


@pytest.mark.parametrize("case", [pytest.param(c, id=c.label, marks=() if c in REPLAYED else pytest.mark.deep)
                                  for c in MEASURED])
def test_every_rank_equals_its_stored_gloo_measurement(case):
    """Derived per rank against :data:`MEASURED` (real runs; the :data:`LIVE` ones rerun in every suite run)."""
    assert _per_rank(case.derive(), case.world) == MEASURED[case]


def jobs(found: list[tuple[Case, Any]], world: int = 4) -> list[Any]:
    """The jobs of ``found`` (:func:`cases`) for a world of ``world``: DDP's smaller N in the first group, once."""
    from symmem.record.distributed import job_of

    return [dataclasses.replace(job_of(d), group=0 if c.world == world else c.world, once=c.world != world)
            for c, d in found]


def check(found: list[tuple[Case, Any]], runs: list[tuple[Any, ...]]) -> list[str]:
    """What differs between each case's derived ranks, its measured ones and :data:`MEASURED` (empty: every rank to
    the byte), and each rank's parameter side."""
    from symmem.record.distributed import compare_parameter_side

    wrong: list[str] = []
    for (case, d), ranks in zip(found, runs, strict=True):
        label = case.label
        assert len(ranks) == case.world  # a smaller N runs once, on the first group
        want = _per_rank(d, case.world)
        # ranks derived equal count by the lower of them (as two runs would: gloo's late frees only ever add)
        got = tuple(tuple(min(x for q in ranks if want[q.rank][i] == want[r.rank][i]
                              for x in (q.per_step[:1] if i == 0 else q.per_step[1:])) for i in (0, 1))
                    for r in ranks)
        wrong += [f"{label}: derived {want}, measured {got} (at {ranks[0].where})"] if want != got else []
        wrong += [f"{label}: stored {MEASURED[case]}, measured {got}"] if MEASURED.get(case, got) != got else []
        wrong += [f"{label} {w}" for w in compare_parameter_side(d, ranks)]
    return wrong


def test_cli_fit_and_plot(capsys, tmp_path):
    """The one-line refusal is gone from the CLI; ``fit`` solves the per-rank formula in B (its answer fits, one
    more does not); ``plot`` draws the largest rank's step."""
    from symmem.cli import main

    run = ["derive", "gpt2", "--attention", "naive", "--checkpoint", "selective", "--device", "cpu", "--dropout", "0",
           "--loss", "cross-entropy", "--optimizer", "adamw", "--data-parallel", "zero-redundancy",
           *(f"--set={k}={v}" for k, v in {**VALUES, "N": 2}.items())]
    assert main(run) == 0
    rank1 = MEASURED[Case("gpt2", "zero-redundancy", 2)][1]
    assert f"rank 1: {rank1[0]:,} / {rank1[1]:,} B" in capsys.readouterr().out.replace("\n", " ")
    for engine in ("ddp-bucket-view",):
        budget = ["fit", "gpt2", "--attention", "naive", "--checkpoint", "selective", "--budget", "8GiB", "--set",
                  "S=1024", "--set", "N=8", "--data-parallel", engine]
        assert main(budget) == 0
        b = int(capsys.readouterr().out.split("largest B = ")[1].split()[0])
        peaks = [derive("gpt2", convention="pytorch", attention="naive", checkpoint="selective", data_parallel=engine,
                        values={"S": 1024, "N": 8, "B": n}).value("peak") for n in (b, b + 1)]
        assert peaks[0] <= 8 * 2**30 < peaks[1], engine
    out = tmp_path / "sel.svg"
    assert main(["plot", "timeline", "gpt2", "--convention", "pytorch", "--attention", "naive", "--checkpoint",
                 "selective", "--data-parallel", "fsdp1", "--set", "L=2", "--set", "N=4", "--output", str(out)]) == 0
    assert "<svg" in out.read_text()


def test_the_formula_in_n_gives_each_world():
    """FSDP2 with the padded embedding (V = 101), derived with N free (``ceiling(101/N)``-row shards): at N = 4 it is
    rank 0's measured peak, first and steady."""
    case = Case("gpt2", "fsdp", 4, (("V", 101),))
    values = {**VALUES, "V": 101}
    free = derive("gpt2", convention="pytorch", device="cpu", optimizer="adamw", values=values, data_parallel="fsdp",
                  checkpoint="selective", **KEYWORDS["gpt2"])
    assert "N" in {s.name for s in free.peak.free_symbols}
    got = tuple(int(free.values(k, N=[4])[0]) for k in ("peak_first_step", "peak"))
    assert got == MEASURED[case][0]


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_case_against_fresh_gloo_runs():
    """Every case of :data:`MEASURED` run again (three spawns: worlds of 4, 3 and 2) and compared with its derivation
    and its stored measurement; the parameter side of every rank too."""
    wrong = []
    for world in (4, 3, 2):
        found = cases(tuple(c for c in MEASURED if (4 if c.engine in DDP else c.world) == world))
        runs = measure(found, world)
        wrong += check(found, runs)
    assert not wrong, "\n".join(wrong)


def measure(found: list[tuple[Case, Any]], world: int) -> list[tuple[Any, ...]]:
    """``found``'s runs in one spawn of ``world`` processes (the ranks forked from the suite's forkserver)."""
    from symmem.record.distributed import measure_jobs

    return measure_jobs(jobs(found, world), world=world, timeout=600, start_method="forkserver")
