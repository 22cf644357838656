"""``--data-parallel zero-redundancy`` (DDP + ``ZeroRedundancyOptimizer``, ZeRO-1) against real ``torch.distributed``
runs: every rank's first and steady peak, derived per rank, equals the live bytes measured inside that rank of a
real gloo run on the CPU (symmem.record.distributed), to the byte; each rank's optimizer state equals what the
run's first step leaves alive; the partition is torch's own.

One spawn of four processes, in one test, runs the live cases (``LIVE``): the world of 4 (N = 4), then each N = 2
case once, on the group {0, 1} (ranks 2 and 3 skip it); the others replay their stored real runs (tests/gloo_store.py;
the deep twin reruns them all).  DDP's reducer, under ZeroRedundancyOptimizer, still frees late on gloo's thread
now and then, but no such free landed at a peak in any run: every run of both groups gave the same steps, each the
derived one (docs/testing.md, "The repeats").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - a torch built without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import gloo_store  # noqa: E402  (stored real runs, replayed)
import test_fsdp1_accumulation as accumulation  # noqa: E402  (FSDP1's gradient accumulation rides here)
import test_selective_engines as selective  # noqa: E402  (selective recomputation under the engines rides here)

from symmem import derive  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.passes import data_parallel, zero_redundancy  # noqa: E402
from symmem.passes.zero_redundancy import partition, rank_peaks, state_per_rank  # noqa: E402
from symmem.record.distributed import compare_parameter_side, job_of, measure_jobs  # noqa: E402

TINY = {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100}
#: (model, values, keywords): the issue's MLP (784-1024-1024-10), GPT-2 and Llama (tied and untied embeddings)
MODELS = [
    ("mlp", {"B": 4}, {"loss": "cross-entropy"}),
    ("gpt2", {**TINY, "B": 2}, {"attention": "sdpa", "dropout": 0.0, "loss": "cross-entropy"}),
    ("llama", {**TINY, "B": 2, "G": 2, "F": 128}, {"attention": "sdpa", "loss": "cross-entropy"}),
]
#: two parameters over four ranks: ranks 2 and 3 own nothing, and ZeroRedundancyOptimizer runs them (an empty
#: local optimizer)
TWO_PARAMETERS = ("mlp", {"B": 4}, {"widths": "8,4", "loss": "cross-entropy"})
#: Llama with 5 layers: every rank's forward and backward walked once with the layers written out 4 and 5 times,
#: interpolated (passes/graph_step.py; 2 layers write them out whole)
FIVE_LAYERS = ("llama", {**TINY, "L": 5, "B": 2, "G": 2, "F": 128}, {"attention": "sdpa", "loss": "cross-entropy"})
#: widths 6,8,8,6 at N = 2: rank 0 owns the 64-element weight and three biases (86 elements), rank 1 the two
#: 48-element weights (96): the largest rank is rank 1
RANK_1_LARGEST = ("mlp", {"B": 4}, {"widths": "6,8,8,6", "loss": "cross-entropy"})


def _derive(name, values, kw, world, **more):
    return _derived(name, tuple(values.items()), tuple(kw.items()), world, tuple(more.items()))


@functools.cache
def _derived(name, values, kw, world, more):
    """One derivation per case in the module (the gloo test's and the table's MLP at N = 4 alike)."""
    values, kw, more = dict(values), dict(kw), dict(more)
    return derive(name, convention="pytorch", device="cpu", optimizer="adamw", values={**values, "N": world},
                  data_parallel="zero-redundancy", **kw, **more)


#: The jobs run live in every suite run (indices in the spawn's order: the four N = 4 cases, the five N = 2 ones, the
#: selective cases, FSDP1's accumulation): ZeRO-1 on the world (the two-parameter MLP: ranks 2 and 3 own nothing), on
#: the group {0, 1} (rank 1 the largest), FSDP2 under selective (N = 4, padded), FSDP1's accumulation under
#: SHARD_GRAD_OP (the MLP, M = 3).  Replayed since stop 39 (one live run per engine and variant): ZeRO-1 under
#: selective (Llama at N = 2, 9; ZeRO-1 live twice here, selective under FSDP2) and FSDP1 FULL_SHARD's accumulation
#: (11; the accumulation live under SHARD_GRAD_OP, FULL_SHARD in tests/test_data_parallel.py's spawn).  The rest
#: replay their stored real runs (tests/gloo_store.py) through the same checks (:data:`DEEP`'s under ``-m deep``),
#: FSDP1 with selective over 2 micro-batches (GPT-2) among them; the deep twin reruns them all
LIVE = (3, 8, 10, 12)
#: Replayed jobs whose checks run under ``-m deep`` only (the deep twin runs them live; docs/testing.md, "What is
#: deep"): the MLP, GPT-2 and Llama at N = 2 on the group {0, 1} -- each model at N = 4 (replayed), the group's
#: path live (widths 6,8,8,6), Llama at N = 2 with 5 layers (replayed) and under selective (live); since stop 42
#: GPT-2 at N = 4 (docs/testing.md, "Stop 42: gloo42": it runs no line the kept cases do not; GPT-2 under ZeRO-1
#: replayed in tests/test_selective_engines.py)
DEEP = (1, 4, 5, 6)


def _measured(every=False):
    """(derivation, each rank's measurement) for every case: N = 4 on the world, N = 2 once on the group {0, 1} (and,
    checked here, tests/test_selective_engines.py's and tests/test_fsdp1_accumulation.py's live cases: selective
    recomputation under the engines, FSDP1's gradient accumulation)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the two-parameter MLP keeps no activation (NothingCounted)
        fours = [_derive(*case, 4) for case in [*MODELS, TWO_PARAMETERS]]
    twos = [_derive(*case, 2) for case in [*MODELS, FIVE_LAYERS, RANK_1_LARGEST]]
    jobs = [job_of(d) for d in fours] + [dataclasses.replace(job_of(d), group=2, once=True) for d in twos]
    live, acc = selective.cases(selective.LIVE), accumulation.cases(accumulation.LIVE)
    runs = gloo_store.runs([*jobs, *selective.jobs(live), *accumulation.jobs(acc)], 4, LIVE, timeout=240,
                           every=every)
    at = len(jobs) + len(live)
    wrong = selective.check(live, runs[len(jobs):at]) + accumulation.check(acc, runs[at:])
    assert not wrong, "\n".join(wrong)
    return [case for k, case in enumerate(zip([*fours, *twos], runs[:len(jobs)], strict=True))
            if every or k not in DEEP]


@pytest.mark.xdist_group("gloo")  # one test worker runs every gloo test, its ranks forked from it (gloo_store)
def test_every_rank_equals_a_real_gloo_run():
    """One test (pytest-xdist never splits it into two spawns): every rank's peaks, the optimizer state each rank
    keeps, and the largest rank (not always rank 0), each derived and measured."""
    _every_rank(every=False)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_run_against_a_fresh_gloo_run():
    """Every job of the test above run live, each rank compared with its stored run and checked the same way."""
    _every_rank(every=True)


def _every_rank(every):
    measured = _measured(every)
    _check_peaks(measured)
    _check_state(measured)
    _check_largest_rank(measured[-1])


def _check_peaks(measured):
    wrong = []
    for d, ranks in measured:
        name = f"{d.model} N={d.numbers[zero_redundancy.N]}"
        derived = rank_peaks(d)
        got = {r.rank: (r.first, min(r.per_step[1:])) for r in ranks}
        wrong += [f"{name}: derived {derived}, measured {got}"] if derived != got else []
        # the peak is the largest rank's, first step and steady
        wrong += [f"{name}: peak {d.value('peak')}"] if d.value("peak") != max(s for _, s in got.values()) else []
        wrong += [f"{name}: first {d.value('peak_first_step')}"] if d.value("peak_first_step") != max(
            f for f, _ in got.values()) else []
        top = d.peak_at().rank
        wrong += [f"{name}: peak at rank {top}"] if got[top][1] != max(s for _, s in got.values()) else []
        wrong += [f"{name}: ranks start apart" for r in ranks if r.start != ranks[0].start]
    assert not wrong, "\n".join(wrong)


def _check_state(measured):
    """AdamW's two moments and step count of the whole parameters a rank owns: the issue's MLP at N = 4 holds
    8.4 MB / 6.4 MB / 82 kB / 16 kB, not 16 bytes x 1,863,690 / 4 = 3.7 MB each; a rank that owns nothing, 0."""
    for d, ranks in measured:
        assert state_per_rank(d) == [r.kept for r in ranks], (d.model, [r.kept for r in ranks])
        # each rank's parameter side when backward ends: whole weights, whole .grads, DDP's buckets, its state
        assert not compare_parameter_side(d, ranks), (d.model, compare_parameter_side(d, ranks))
    mlp = measured[0]
    assert [r.kept for r in mlp[1]] == [8 * 1024 * 1024 + 4, 8 * 784 * 1024 + 4, 8 * 10 * 1024 + 4,
                                        8 * (1024 + 1024 + 10) + 3 * 4]
    two = next(ranks for d, ranks in measured if d.options.get("widths") == TWO_PARAMETERS[2]["widths"])
    assert [r.kept for r in two] == [8 * 32 + 4, 8 * 4 + 4, 0, 0]


def _check_largest_rank(case):
    """Widths 6,8,8,6 at N = 2 (checked against its gloo run above): rank 1's optimizer state is the larger (two
    48-element weights against a 64-element weight and three biases), and so is its peak."""
    d, _ = case
    assert d.options["widths"] == "6,8,8,6" and d.numbers[zero_redundancy.N] == 2
    assert state_per_rank(d) == [8 * (64 + 8 + 8 + 6) + 4 * 4, 8 * (48 + 48) + 2 * 4]
    found = rank_peaks(d)
    assert d.peak_at().rank == 1 and d.value("peak") == found[1][1] > found[0][1]
    assert d.peak_at().where() == "rank 1 of 2: step fc3.weight, steady step"
    # the step written out (plot timeline) is the largest rank's: its moments reach that rank's peak
    assert max(sum(live.values()) for _, _, live in d.timeline()) == found[1][1]
    assert d.timeline()[0][2]["optimizer_state"] == state_per_rank(d)[1]


def _torch_partition(sizes, world):
    """torch's own ``ZeroRedundancyOptimizer._partition_parameters`` on tensors of ``sizes`` (no process group:
    the method reads only these attributes)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer as Zero

    params = [torch.empty(n) for n in sizes]
    stub = types.SimpleNamespace(_partition_parameters_cache=[], world_size=world, param_groups=[{"params": params}])
    stub._get_min_index = functools.partial(Zero._get_min_index, stub)
    stub._partition_param_group = functools.partial(Zero._partition_param_group, stub)
    found = Zero._partition_parameters(stub)
    index = {id(p): i for i, p in enumerate(params)}
    return [[index[id(p)] for g in groups for p in g["params"]] for groups in found]


@pytest.mark.parametrize("sizes, world", [
    ([802816, 1024, 1048576, 1024, 10240, 10], 4),  # the MLP
    ([6, 10, 6, 1], 2),                             # rank 1 ends larger than rank 0
    ([5, 5, 5, 5, 3, 3], 3),                        # ties keep model.parameters() order
    ([4, 1], 4),                                    # ranks that own nothing
])
def test_partition_is_torchs(sizes, world):
    assert partition(sizes, world) == _torch_partition(sizes, world)


def test_json_and_table_name_every_rank(capsys):
    run = ["derive", "mlp", "--convention", "pytorch", "--device", "cpu", "--loss", "cross-entropy", "--set", "B=4",
           "--set", "N=4", "--data-parallel", "zero-redundancy"]
    assert main([*run, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = _derive(*MODELS[0], 4)
    ranks = rank_peaks(d)
    assert out["values"]["peak_per_rank"] == {str(r): {"peak": s, "peak_first_step": f} for r, (f, s) in ranks.items()}
    assert out["values"]["optimizer_state_per_rank"] == {str(r): v for r, v in enumerate(state_per_rank(d))}
    assert out["values"]["peak"] == max(s for _, s in ranks.values()) and out["peak_at"]["rank"] == 0
    assert out["regime"]["data_parallel"] == "zero-redundancy" and out["peak_at"]["partition_at"] == {"N": 4}
    assert main(run) == 0
    text = capsys.readouterr().out.replace("\n", " ")
    assert f"rank 3: {ranks[3][0]:,} / {ranks[3][1]:,} B" in text and "at rank 0 of 4: step fc2.weight" in text
    assert "ZeroRedundancyOptimizer's partition, and these formulas, at N = 4" in text
    # six parameters over 100 ranks: ranks 6-99 own nothing and peak alike, one entry in the table
    assert main([*run[:-3], "N=100", "--data-parallel", "zero-redundancy"]) == 0
    text = capsys.readouterr().out.replace("\n", " ")
    empty = rank_peaks(_derive(*MODELS[0], 100))[99]
    assert f"ranks 6-99: {empty[0]:,} / {empty[1]:,} B" in text and "rank 7:" not in text


def test_the_formula_is_in_the_batch_at_the_partitions_numbers():
    """The partition is computed at the numbers (N, the layer count, the parameters' sizes): the formula is in B
    and S, its domain those numbers; another H partitions again, and equals a derivation made at that H."""
    values = {**TINY, "N": 4, "F": 256}
    d = derive("gpt2", convention="pytorch", data_parallel="zero-redundancy", values=values)
    names = {s.name for s in d.peak.free_symbols}
    assert names <= {"B", "S", "h"} and "B" in names
    assert zero_redundancy.partition_at(d) == {"F": 256, "H": 64, "L": 2, "N": 4, "V": 100}
    assert {str(c) for c in d.step.domain()} == {"Eq(F, 256)", "Eq(H, 64)", "Eq(L, 2)", "Eq(N, 4)", "Eq(V, 100)"}
    other = {**values, "H": 32, "F": 128, "h": 2, "B": 3}
    assert d.at(H=32, F=128, h=2, B=3).value("peak") == derive(
        "gpt2", convention="pytorch", data_parallel="zero-redundancy", values=other).value("peak")


def test_fit_under_zero_redundancy(capsys):
    """``fit`` solves the largest rank's formula in B: the answer's peak fits, one more does not."""
    run = ["fit", "gpt2", "--convention", "pytorch", "--budget", "80GiB", "--set", "N=8",
           "--data-parallel", "zero-redundancy"]
    assert main(run) == 0
    b = int(capsys.readouterr().out.split("largest B = ")[1].split()[0])
    d = derive("gpt2", convention="pytorch", values={"N": 8}, data_parallel="zero-redundancy")
    assert d.at(B=b).value("peak") <= 80 * 2**30 < d.at(B=b + 1).value("peak")


@pytest.mark.parametrize("kw, message", [
    ({"data_parallel": "zero-redundancy", "tensor_parallel": True},
     "data_parallel='zero-redundancy' with tensor parallelism is not modelled: ZeroRedundancyOptimizer over DTensor "
     "parameters was not measured"),
    ({"data_parallel": "zero-redundancy", "zero": 1},
     "data_parallel='zero-redundancy' is an engine and zero=1 the papers' accounting"),
    ({"data_parallel": "zero-redundancy", "values": {"N": 0}}, "N"),
])
def test_bad_input_is_one_line(kw, message):
    with pytest.raises(SymmemError) as e:
        derive("gpt2", convention="pytorch", **kw).value("peak")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_refusals_of_the_peak(capsys):
    d = derive("gpt2", convention="pytorch", data_parallel="zero-redundancy", precision="mixed")
    with pytest.raises(SymmemError, match="modelled in fp32") as e:
        d.value("peak")
    assert "\n" not in str(e.value)
    # a size the partition needs without a number
    d = derive("gpt2", convention="pytorch", data_parallel="zero-redundancy")
    step = dataclasses.replace(d.step, numbers={s: v for s, v in d.numbers.items() if s.name != "V"}, _cache={})
    with pytest.raises(SymmemError, match=r"partitions whole parameters by their sizes: give V a number \(--set V="):
        step.peak()
    assert main(["derive", "gpt2", "--data-parallel", "zero-redundancy", "--set", "N=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("symmem: error: ") and err.count("\n") == 1
    assert zero_redundancy.RANK_OPTION == data_parallel.RANK_OPTION
    # a run's groups must divide its world (checked before any process starts)
    job = dataclasses.replace(job_of(_derive(*MODELS[0], 2)), group=3)
    with pytest.raises(SymmemError, match="in groups of 3 ranks cannot run in a world of 4"):
        measure_jobs([job], world=4)
    with pytest.raises(SymmemError, match="runs once on its first group: give it a group smaller than the world"):
        measure_jobs([dataclasses.replace(job, group=0, once=True)], world=4)
    # the ranks start by spawn (the default), from a forkserver or forked from this process (the suite's), nothing else
    with pytest.raises(SymmemError, match="the ranks start by 'spawn', 'forkserver', 'fork', not 'thread'") as e:
        measure_jobs([job_of(_derive(*MODELS[0], 2))], world=2, start_method="thread")
    assert "\n" not in str(e.value)
