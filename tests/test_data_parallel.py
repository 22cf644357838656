"""Data-parallel engines against real ``torch.distributed`` runs: each rank's peak, derived per rank, equals the
live bytes measured inside that rank of a real gloo run on the CPU (symmem.record.distributed), to the byte.

One start of two processes runs the live cases (``LIVE``: one per engine and variant) in turn, inside one test, so
that pytest-xdist never splits it in two, and the others replay their stored real runs (tests/gloo_store.py; the deep
twin reruns them all);
the processes fork from the test process, which imports what they need once (``gloo_store.START``); the
ranks meet through a file store in a temporary directory, so parallel test workers cannot collide on a port.
"""

from __future__ import annotations

import functools
import json

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - a torch built without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import gloo_store  # noqa: E402  (stored real runs, replayed)
import test_fsdp_mixed as policy  # noqa: E402  (FSDP2's MixedPrecisionPolicy rides in this spawn)
import test_fsdp_mixed_checkpoint as policy_checkpointed  # noqa: E402  (and with checkpointing)

from symmem import derive  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.passes.data_parallel import rank_peaks  # noqa: E402
from symmem.passes.rank_side import parameter_side_per_rank  # noqa: E402
from symmem.record.distributed import compare, compare_parameter_side, job_of, measure_ranks  # noqa: E402

TINY_GPT = {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100}
GPT = {"attention": "sdpa", "dropout": 0.0, "loss": "cross-entropy"}
#: (model, values, keywords): the MLP peaks in the optimizer step, GPT-2 and Llama in backward under the bucket
#: view (the buckets hold every gradient from the start) and in the step under plain DDP
MODELS = [
    ("mlp", {"B": 4}, {"widths": "64,128,128,10", "loss": "cross-entropy"}),
    ("gpt2", {**TINY_GPT, "B": 2}, GPT),
    ("llama", {**TINY_GPT, "B": 2, "G": 2, "F": 128}, {"attention": "sdpa", "loss": "cross-entropy"}),
]
ENGINES = ("ddp", "ddp-bucket-view")
#: Derived minus measured steady peak where they differ: none since the cross-entropy's backward is two events
#: (NllLossBackward0 frees the target's copy and total weight before LogSoftmaxBackward0 allocates)
KNOWN_GAPS: dict[tuple[str, str], int] = {}


def _derive(name, values, kw, engine, **more):
    return _derived(name, tuple(values.items()), tuple(kw.items()), engine, tuple(more.items()))


@functools.cache
def _derived(name, values, kw, engine, more):
    """One derivation per case in the module (the gloo test's and the views' tests' alike)."""
    values, kw, more = dict(values), dict(kw), dict(more)
    return derive(name, convention="pytorch", device="cpu", optimizer="adamw", values=values, data_parallel=engine,
                  **kw, **more)


#: an MLP whose first layer has 127 rows, which fully_shard pads to 128 at N=2
FSDP_WIDTHS = (64, 127, 10)

#: FSDP2 cases derived at N=2 (the run's world): fully_shard per block and the root, and without resharding after
#: forward (Llama's no-reshard peak sits in the loss's forward: the padded labels live until the loss function
#: returns, the position ids until the forward does); FSDP1 (FULL_SHARD) on Llama
SHARDED_CASES = [(name, "fsdp") for name, _, _ in MODELS] + [("mlp", "fsdp-no-reshard"), ("llama", "fsdp-no-reshard"),
                                                               ("llama", "fsdp1")]
#: FSDP2 and FSDP1 with activation checkpointing (model, engine, checkpoint, values, micro-batches; docs/regimes.md):
#: each block checkpoint_wrapper'd inside fully_shard (torchtitan's order; its pre-backward unshards before the
#: recompute), with gradient accumulation over 2 micro-batches (the first under set_requires_gradient_sync(False)),
#: one checkpoint around 3 FSDP2 units (the recompute unshards the inner ones; V=101 pads the embedding's rows, so
#: rank 1 holds less) and around 2 FSDP1 units (FULL_SHARD unshards and reshards them in the recompute)
CHECKPOINTED = [("llama", "fsdp", "full", {"L": 2}, 2), ("gpt2", "fsdp", "every-3", {"L": 3, "V": 101}, 1),
                ("gpt2", "fsdp1", "every-2", {"L": 2}, 1)]


#: The jobs run live in every suite run (indices in the spawn's order: the six FSDP2 and FSDP1 cases, the padded MLP,
#: the three policies, the five checkpointed ones, the six DDP ones): one per engine and variant -- FSDP2 (the padded
#: MLP, its ranks apart), FSDP2 without resharding (Llama), FSDP2 with the bf16 policy, full checkpointing and 2
#: micro-batches (Llama), FSDP1 with every-2 (GPT-2), DDP (Llama), the bucket view (GPT-2).  FSDP1 on Llama (5) is
#: replayed since stop 39: FSDP1 stays live here (every-2) and under accumulation (tests/test_zero_redundancy.py's
#: spawn), Llama under three engines here.  The rest replay their stored real runs (tests/gloo_store.py) through the
#: same checks (:data:`DEEP`'s under ``-m deep``); the deep twin reruns them all
LIVE = (6, 4, 13, 12, 19, 18)
#: Replayed jobs whose checks run under ``-m deep`` only (the deep twin runs them live; docs/testing.md, "What is
#: deep"), each a path another case of the default test checks: GPT-2 FSDP2 (GPT-2 under FSDP2: the bf16 policy's
#: and every-3's replays), Llama FSDP2 (Llama without resharding, live; Llama FSDP2 resharding: the bf16 reduce's
#: replay and the policy's full checkpointing, live), Llama FSDP2 with full checkpointing over 2 micro-batches in FP32
#: (the same under the bf16 policy, live), GPT-2 DDP and Llama's bucket view (Llama DDP and GPT-2's bucket view, live;
#: the MLP under both, replayed).  Since stop 42 (docs/testing.md, "Stop 42: gloo42": each runs no line the kept
#: cases do not): the MLP under FSDP2 (the padded MLP, live), without resharding (Llama's, live) and under the
#: bucket view (GPT-2's live, the MLP under DDP replayed), Llama under FSDP1 (GPT-2's every-2, live)
DEEP = (0, 1, 2, 3, 5, 10, 16, 17, 20)


@pytest.mark.xdist_group("gloo")  # one test worker runs every gloo test, its ranks forked from it (gloo_store)
def test_every_rank_peak_equals_a_real_gloo_run():
    _every_rank_peak(every=False)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_run_against_a_fresh_gloo_run():
    """Every job of the test above run live, each rank compared with its stored run and checked the same way."""
    _every_rank_peak(every=True)


def _every_rank_peak(every):
    cases = [(name, engine, _derive(name, values, kw, engine)) for name, values, kw in MODELS for engine in ENGINES]
    kws = {name: (values, kw) for name, values, kw in MODELS}
    sharded = [(name, engine, _derive(name, {**kws[name][0], "N": 2}, kws[name][1], engine))
               for name, engine in SHARDED_CASES]
    checkpointed = [(f"{name} {engine} {ck} M={m}", _derive(name, {**kws[name][0], "N": 2, **more}, kws[name][1],
                                                            engine, checkpoint=ck, micro_batches=m))
                    for name, engine, ck, more, m in CHECKPOINTED]
    # the FSDP2 runs first: a Llama first step run after DDP's in the same process allocates 49,664 bytes more
    padded = _derive("mlp", {"B": 4, "N": 2}, {"widths": ",".join(map(str, FSDP_WIDTHS)), "loss": "cross-entropy"},
                     "fsdp")
    # every FSDP2 job runs once, before DDP's: each collective releases its tensors on the recording thread
    # (symmem.record.collectives), so no free lands late, by gloo's worker thread; each rank counts those that
    # would (none, below)
    jobs = [job_of(d) for _, _, d in sharded] + [job_of(padded)]
    mixed = [*policy.mixed_jobs(), policy.bf16_reduce_job()]
    more = [job_of(d) for _, d in checkpointed] + policy_checkpointed.jobs()
    runs = gloo_store.runs([*jobs, *mixed, *more, *(job_of(d) for _, _, d in cases)], 2, LIVE, timeout=150,
                           every=every)
    skipped = set() if every else set(DEEP)  # spawn indices whose checks the deep twin makes
    # FSDP's; DDP's reducer runs its all-reduces from C++, which no wrapper reaches (a late free seen once there)
    fsdp_runs = runs[:len(jobs) + len(mixed) + len(more)]
    assert not [(i, r.rank, r.late) for i, ranks in enumerate(fsdp_runs) for r in ranks if r.late], "gloo's frees"
    *measured, fsdp = runs[:len(jobs)]
    at = len(jobs)
    wrong = policy.check_mixed(runs[at:at + len(mixed) - 1])
    wrong += policy.check_bf16_reduce(runs[at + len(mixed) - 1])
    at += len(mixed)
    wrong += _check_checkpointed(checkpointed, runs[at:at + len(checkpointed)],
                                 {k for k in range(len(checkpointed)) if at + k not in skipped})
    wrong += policy_checkpointed.check(runs[at + len(checkpointed):at + len(more)])
    measured += runs[at + len(more):]
    _check_fsdp_shards(fsdp)
    # per rank where the padding makes them differ: each rank's first and steady peak, derived, to the byte
    per_rank = rank_peaks(padded)
    assert per_rank == {r.rank: (r.first, min(r.per_step[1:])) for r in fsdp}, (per_rank, fsdp)
    # each rank's parameter side when backward ends (weights, .grads, optimizer state), padding and step counts
    # included: 127 rows stored as 64 + 64, rank 1's AdamW state over 63 of them
    wrong += [f"mlp 64-127-10 fsdp {w}" for w in compare_parameter_side(padded, fsdp)]
    side = parameter_side_per_rank(padded)  # the JSON's parameter_side_per_rank, without the rest of the JSON
    assert side[0]["optimizer_state"] - side[1]["optimizer_state"] == 8 * 64 + 8 == 520
    assert side[0]["total"] > padded.value("parameter_memory")  # the papers' 16 bytes x parameters / N
    for k, ((name, engine, d), ranks) in enumerate(zip(sharded, measured[:len(sharded)], strict=True)):
        if k in skipped:
            continue
        # the largest rank's peak (rank 0: the padding sits on the last rank), first and steady step, to the byte.
        # FSDP's collectives release on the recording thread (no late free, asserted above), so one steady step is
        # recorded (distributed.steps_of); GPT-2's and Llama's dims divide by 2, so both ranks hold the same
        same = ranks[:1] if name == "mlp" else ranks
        want = (d.value("peak_first_step"), d.value("peak"))
        got = (min(r.first for r in same), min(x for r in same for x in r.per_step[1:]))
        wrong += [f"{name} {engine}: derived {want}, measured {got} ({ranks[0].per_step})"] if want != got else []
        wrong += [f"{name} {engine}: ranks start apart" for r in ranks if r.start != ranks[0].start]
        wrong += [f"{name} {engine} {w}" for w in compare_parameter_side(d, ranks)]
    for k, ((name, engine, d), ranks) in enumerate(zip(cases, measured[len(sharded):], strict=True),
                                                  start=at + len(more)):
        assert len(ranks) == 2
        if k in skipped:
            continue
        gap = KNOWN_GAPS.get((name, engine), 0)
        wrong += [f"{name} {engine}: {w}" for w in compare(d, ranks, steady_gap=gap)]
        # the buckets exist before the first op: weights and buckets, 4 bytes per parameter each, beside the batch
        psi = d.evaluate(d.parameters)
        wrong += [f"{name} {engine} rank {r.rank}: start {r.start} < {8 * psi}" for r in ranks if r.start < 8 * psi]
        wrong += [f"{name} {engine}: ranks start apart" for r in ranks if r.start != ranks[0].start]
        wrong += [f"{name} {engine} {w}" for w in compare_parameter_side(d, ranks)]
    assert not wrong, "\n".join(wrong)


def _check_checkpointed(cases, measured, checked):
    """Each rank's first and steady peak and parameter side under FSDP with checkpointing, derived per rank (rank 0's
    is the derivation's; rank_peaks gives each where the padding makes them differ), against one gloo run: a late
    free by gloo's threads only ever adds, so ranks derived equal count by the lower of them (as two runs would).
    ``checked``: the indices of ``cases`` checked (the padded one, 1, always)."""
    wrong, gots = [], {}
    for k, ((label, d), ranks) in enumerate(zip(cases, measured, strict=True)):
        if k not in checked:
            continue
        want = rank_peaks(d) or dict.fromkeys(range(len(ranks)), (d.value("peak_first_step"), d.value("peak")))
        got = {r.rank: tuple(min(x for q in ranks if want[q.rank][i] == want[r.rank][i]
                                 for x in (q.per_step[:1] if i == 0 else q.per_step[1:])) for i in (0, 1))
               for r in ranks}
        gots[k] = got
        wrong += [f"{label}: derived {want}, measured {got}"] if want != got else []
        wrong += [f"{label} {w}" for w in compare_parameter_side(d, ranks)]
    assert rank_peaks(cases[1][1]) is not None  # the padded case: its ranks differ
    # its peak formula in N (derived with N free: ceiling(101/N)-row shards) at N = 2 is rank 0's measured peak
    d = cases[1][1]
    free = derive(d.model, convention="pytorch", device="cpu", optimizer="adamw", checkpoint="every-3",
                  values={s.name: int(v) for s, v in d.numbers.items() if s.name != "N"}, data_parallel="fsdp", **GPT)
    formula = tuple(int(free.values(k, N=[2])[0]) for k in ("peak_first_step", "peak"))
    wrong += [f"{cases[1][0]} formula in N at 2: {formula}"] if formula != gots[1][0] else []
    return wrong


def _check_fsdp_shards(ranks):
    """FSDP2's shards by hand: each parameter's dim 0 padded to a multiple of N and split evenly, every rank's
    storage the padded shard; the optimizer state (two FP32 moments) follows the unpadded rows, so the last rank,
    whose shard holds the padding, keeps less."""
    n = len(ranks)
    shapes = [s for a, b in zip(FSDP_WIDTHS, FSDP_WIDTHS[1:], strict=False) for s in ((b, a), (b,))]
    rows = [-(-s[0] // n) for s in shapes]  # rows per rank, padded
    rest = [s[1] if len(s) > 1 else 1 for s in shapes]
    batch = 4 * FSDP_WIDTHS[0] * 4 + 4 * 8  # the batch and its int64 targets
    assert [r.start for r in ranks] == [4 * sum(k * m for k, m in zip(rows, rest, strict=True)) + batch] * n
    held = [sum(max(0, min(k, s[0] - r * k)) * m for k, m, s in zip(rows, rest, shapes, strict=True)) for r in range(n)]
    assert ranks[0].steady - ranks[-1].steady == 2 * 4 * (held[0] - held[-1]) == 520


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_ranks_forked_from_a_busy_process_measure_what_fresh_ones_do():
    """The suite forks its ranks from the test process (``gloo_store.START``): here from one whose intra-op pool ran
    on two OpenMP threads (matmuls, a backward) and that recorded a step, ranks forked from it measure every byte as
    ranks in fresh interpreters (``spawn``) do -- FSDP2 with padding, DDP's bucket view, ZeRO-1 -- within the same
    bounded time; the parent's pool still works afterwards.  (Gloo's late frees under DDP's reducer vary by run:
    not compared, as tests/gloo_store.py's ``compared``.)"""
    from symmem.record.distributed import measure_jobs

    padded = _derive("mlp", {"B": 4, "N": 2}, {"widths": ",".join(map(str, FSDP_WIDTHS)), "loss": "cross-entropy"},
                     "fsdp")
    jobs = [job_of(padded), *(job_of(_derive(*MODELS[0], engine)) for engine in ("ddp-bucket-view",
                                                                                  "zero-redundancy"))]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(256, 256, requires_grad=True)
        for _ in range(5):
            (x @ x).relu().sum().backward()
        forked = measure_jobs(jobs, 2, timeout=150, start_method="fork")
        (x @ x).sum().backward()
    finally:
        torch.set_num_threads(threads)
    fresh = measure_jobs(jobs, 2, timeout=300, start_method="spawn")

    def kept(runs):  # what a fresh run must repeat of a stored one (tests/gloo_store.py)
        return [gloo_store.compared([gloo_store.row(r) for r in ranks], job.engine)
                for ranks, job in zip(runs, jobs, strict=True)]

    assert kept(forked) == kept(fresh)


def test_what_each_engine_adds_to_one_device():
    """A hand count: DDP's buckets are one more copy of the gradients, live the whole step; under the bucket view
    the gradients are the buckets, so the optimizer step (where every gradient is alive anyway) is one device's."""
    name, values, kw = MODELS[0]
    one, ddp, view = (_derive(name, values, kw, e) for e in (None, *ENGINES))
    psi = one.evaluate(one.parameters)
    assert ddp.value("total") - one.value("total") == 4 * psi
    assert view.value("total") == one.value("total")
    assert ddp.value("peak") - one.value("peak") == 4 * psi
    assert one.peak_at().phase == view.peak_at().phase == "step" and view.value("peak") == one.value("peak")
    # GPT-2's bucket-view peak is in backward: every gradient's bytes are live there, not only those made so far
    name, values, kw = MODELS[1]
    one, view = _derive(name, values, kw, None), _derive(name, values, kw, "ddp-bucket-view")
    assert view.peak_at().phase == "backward" and view.value("peak") > one.value("peak")


@pytest.mark.parametrize("kw, message", [
    ({"data_parallel": "horovod"}, "unknown data-parallel engine 'horovod'; known: ddp, ddp-bucket-view, "),
    ({"data_parallel": "ddp", "zero": 2}, "data_parallel='ddp' is an engine and zero=2 the papers' accounting"),
    ({"data_parallel": "ddp", "tensor_parallel": True}, "with tensor parallelism is not modelled: PyTorch composes"),
    ({"data_parallel": ["ddp"]}, "unknown data-parallel engine ['ddp']"),
])
def test_bad_engines_are_one_line_errors(kw, message):
    with pytest.raises(SymmemError) as e:
        derive("mlp", convention="pytorch", device="cpu", **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("kw", [{"precision": "mixed"}])
def test_fsdp_peak_refuses_what_it_does_not_model(kw):
    d = derive("gpt2", convention="pytorch", data_parallel="fsdp", **kw)
    with pytest.raises(SymmemError, match="is modelled in fp32") as e:
        d.value("peak")
    assert "\n" not in str(e.value)


def test_fsdp_shards_every_component_and_pads_dim_0():
    """A hand count at N=4: FSDP's rank holds ceil(rows/4) rows of every parameter (weights 4 bytes, AdamW's two
    moments 8, a 4-byte step each) before the step; the total is the papers' 16 bytes per parameter over N."""
    widths = (64, 127, 10)
    kw = {"widths": ",".join(map(str, widths)), "loss": "cross-entropy"}
    d = derive("mlp", convention="pytorch", device="cpu", optimizer="adamw", values={"B": 4, "N": 4},
               data_parallel="fsdp", **kw)
    shapes = [s for a, b in zip(widths, widths[1:], strict=False) for s in ((b, a), (b,))]
    held = sum(-(-s[0] // 4) * (s[1] if len(s) > 1 else 1) for s in shapes)
    psi = d.evaluate(d.parameters)
    assert d.value("total") == derive("mlp", convention="pytorch", device="cpu", optimizer="adamw",
                                      values={"B": 4, "N": 4}, zero=3, **kw).value("total")
    assert held * 4 > psi  # padding: 127 rows -> 128
    assert d.value("peak") > 16 * held + 4 * len(shapes)


def test_world_size_and_engine_checked_before_spawning():
    d = derive("mlp", convention="pytorch", device="cpu", values={"B": 2})
    with pytest.raises(SymmemError, match="measure_ranks runs the data-parallel engines"):
        measure_ranks([d])
    d = _derive(*MODELS[0], "ddp")
    for world in (0, -1, True, 1.5):
        with pytest.raises(SymmemError, match="the world size is a positive integer"):
            measure_ranks([d], world=world)


def test_cli_engine_option(capsys):
    run = ["derive", "mlp", "--convention", "pytorch", "--device", "cpu", "--set", "B=4", "--set", "N=8"]
    assert main([*run, "--data-parallel", "ddp", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["regime"]["data_parallel"] == "ddp" and out["values"]["peak"] == derive(
        "mlp", convention="pytorch", device="cpu", values={"B": 4, "N": 8}, data_parallel="ddp").value("peak")
    assert main([*run, "--data-parallel", "ddp", "--zero", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("symmem: error: data_parallel='ddp' is an engine and zero=3") and err.count("\n") == 1


def test_fit_under_an_engine(capsys):
    """The largest per-rank batch that fits: DDP's buckets (4 bytes per parameter) leave less room than one
    device has, and the answer is the largest B whose derived per-rank peak fits."""
    run = ["fit", "gpt2", "--convention", "pytorch", "--budget", "4GiB", "--set", "S=256", "--set", "N=8"]
    assert main([*run, "--data-parallel", "ddp"]) == 0
    text = capsys.readouterr().out
    b = int(text.split("largest B = ")[1].split()[0])
    peak = [derive("gpt2", convention="pytorch", values={"S": 256, "N": 8, "B": n}, data_parallel="ddp").value("peak")
            for n in (b, b + 1)]
    assert peak[0] <= 4 * 2**30 < peak[1]
    # under FSDP (N=8) the largest B whose rank-0 peak fits
    assert main([*run, "--data-parallel", "fsdp"]) == 0
    b = int(capsys.readouterr().out.split("largest B = ")[1].split()[0])
    peak = [derive("gpt2", convention="pytorch", values={"S": 256, "N": 8, "B": n}, data_parallel="fsdp").value("peak")
            for n in (b, b + 1)]
    assert peak[0] <= 4 * 2**30 < peak[1]


def test_traced_module_has_the_peak_too():
    """A traced module under DDP: its buckets (4 bytes per parameter, 8 x 4 + 4 here) beside every moment of one
    device's step (tests/test_traced_engines.py checks traced modules against real gloo runs)."""
    from symmem import trace

    net = torch.nn.Sequential(torch.nn.Linear(8, 4))
    one, ddp = (trace(net, (torch.zeros(2, 8),), {"B": [(0, 0)]}, data_parallel=e) for e in (None, "ddp"))
    assert ddp.value("peak") == one.value("peak") + 4 * (8 * 4 + 4)


def test_fsdp_per_rank_in_json_and_table(capsys):
    """Where FSDP's ranks differ (127 rows padded to 128 at N=2: the last rank's AdamW state lacks a row) the
    JSON's peak is rank 0's and ``values.peak_per_rank`` gives each (rank_peaks, checked against the gloo run
    above); the table says both."""
    run = ["derive", "mlp", "--convention", "pytorch", "--device", "cpu", "--optimizer", "adamw", "--set", "B=4",
           "--set", "N=2", "--widths", ",".join(map(str, FSDP_WIDTHS)), "--loss", "cross-entropy",
           "--data-parallel", "fsdp"]
    assert main([*run, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = _derive("mlp", {"B": 4, "N": 2}, {"widths": ",".join(map(str, FSDP_WIDTHS)), "loss": "cross-entropy"}, "fsdp")
    ranks = rank_peaks(d)
    assert out["values"]["peak_per_rank"] == {str(r): {"peak": s, "peak_first_step": f} for r, (f, s) in ranks.items()}
    assert out["values"]["peak"] == ranks[0][1] > ranks[1][1] and out["peak_at"]["rank"] == 0
    assert main(run) == 0
    assert f"rank 1: {ranks[1][0]:,} / {ranks[1][1]:,} B" in capsys.readouterr().out.replace("\n", " ")
    # where every rank holds the same (64 and 10 rows split evenly) there is no per-rank line
    assert rank_peaks(_derive("mlp", {"B": 4, "N": 2}, {"widths": "64,128,10"}, "fsdp")) is None


def test_parameter_side_per_rank_by_hand(capsys):
    """The issue's example, counted by hand: the MLP 784-1024-1024-10 under FSDP2 at N = 3 stores each dim 0 padded
    to a multiple of 3 (1,026 rows: 342 a rank; 12 for the head: 4), weights and sharded gradients alike; AdamW's
    two moments follow the rows a rank holds (rank 2: 340 of 1,024) plus a 4-byte step per parameter tensor.  The
    papers' accounting beside it stays 16 bytes x parameters / N (the gloo runs above check the same per rank)."""
    run = ["derive", "mlp", "--convention", "pytorch", "--device", "cpu", "--optimizer", "adamw",
           "--data-parallel", "fsdp", "--set", "N=3"]
    assert main([*run, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    stored = 342 * 784 + 342 + 342 * 1024 + 342 + 4 * 1024 + 4
    held = {0: stored, 1: stored, 2: 340 * 784 + 340 + 340 * 1024 + 340 + 2 * 1024 + 2}
    want = {str(r): {"parameters": 4 * stored, "gradients": 4 * stored, "buckets": 0,
                     "optimizer_state": 8 * n + 6 * 4, "total": 8 * stored + 8 * n + 24} for r, n in held.items()}
    assert out["values"]["parameter_side_per_rank"] == want
    assert out["values"]["parameter_memory"] == 16 * 1863690 // 3 == 9939680
    assert main(run) == 0
    text = capsys.readouterr().out.replace("\n", " ")
    assert "with FSDP's padding and Adam's step counts): ranks 0-1: 9,969,944 B; rank 2: 9,924,584 B" in text
    # DDP: whole weights, whole gradients, the buckets beside them; no engine, no line
    run[run.index("fsdp")] = "ddp"
    assert main([*run, "--format", "json"]) == 0
    side = json.loads(capsys.readouterr().out)["values"]["parameter_side_per_rank"]
    assert side["0"] == side["2"] == {"parameters": 4 * 1863690, "gradients": 4 * 1863690, "buckets": 4 * 1863690,
                                      "optimizer_state": 8 * 1863690 + 6 * 4, "total": 20 * 1863690 + 24}
    assert main(run[:-4]) == 0 and "parameter side per rank" not in capsys.readouterr().out


def test_shard_ceilings_are_sympys():
    """FSDP's shard sizes ``ceiling(size / N)`` (and FSDP1's ``Min(1, padding)``) are built without sympy's
    search for a simplification; sympy's own evaluation is the truth: every built-in model's dim 0 and flat
    parameter sizes give the same expression."""
    import sympy

    from symmem.models import available, build
    from symmem.passes.data_parallel import ceil_div
    from symmem.passes.fsdp1 import _at_most_one
    from symmem.shapes import numel
    from symmem.symbols import N

    sizes = set()
    for name in available():
        graph = build(name).graph
        for n in graph.program_order():
            node = graph.node(n)
            shapes = [node.params["value"]] if node.kind == "parameter" else list(node.params.values())
            sizes.update(s[0] for s in shapes if s)
            if shapes:
                sizes.add(sympy.Add(*(numel(s) for s in shapes)))  # a unit's flat parameter
    assert len(sizes) > 20
    for size in sizes:
        assert ceil_div(size, N) == sympy.ceiling(size / N), size
        # FSDP1's flat shards: the quotient multiplied out, as the peak's algebra expands it
        assert ceil_div(size, N, expanded=True) == sympy.ceiling(sympy.expand(size / N)), size
    for size in [s for s in sizes if not sympy.sympify(s).is_number][:8]:
        padding = N * sympy.ceiling(size / N) - size
        assert _at_most_one(padding) == sympy.Min(1, sympy.expand(padding)), size


#: ZeroRedundancyOptimizer with selective recomputation, 4 layers: each rank's step from the walk every rank shares
#: (passes/graph_step._rank_peak, not a whole walk per rank), the ranks apart (each owns other whole parameters)
ZERO_SELECTIVE = [("gpt2", {**TINY_GPT, "L": 4, "B": 2, "N": 2}, {**GPT, "attention": "naive"}),
                  ("llama", {**TINY_GPT, "L": 4, "B": 2, "G": 2, "F": 128, "N": 2},
                   {"attention": "naive", "loss": "cross-entropy"})]


@pytest.mark.xdist_group("gloo")
def test_zero_redundancy_with_selective_recomputation_equals_a_real_gloo_run():
    _zero_selective(every=False)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_zero_redundancy_with_selective_recomputation_against_a_fresh_gloo_run():
    _zero_selective(every=True)


def _zero_selective(every):
    """Each rank's first and steady peak and parameter side, derived, against its stored real run (the deep twin runs
    them live): to the byte."""
    cases = [_derive(name, values, kw, "zero-redundancy", checkpoint="selective")
             for name, values, kw in ZERO_SELECTIVE]
    runs = gloo_store.runs([job_of(d) for d in cases], 2, (), timeout=150, every=every)
    wrong = []
    for (name, _, _), d, ranks in zip(ZERO_SELECTIVE, cases, runs, strict=True):
        want = rank_peaks(d)
        got = {r.rank: (r.per_step[0], min(r.per_step[1:])) for r in ranks}
        wrong += [f"{name}: derived {want}, measured {got}"] if want != got else []
        wrong += [f"{name} {w}" for w in compare_parameter_side(d, ranks)]
        assert want[0] != want[1]  # the ranks own different parameters: each its own peak
    assert not wrong, "\n".join(wrong)
