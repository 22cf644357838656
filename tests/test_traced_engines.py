"""Traced modules under the data-parallel engines and ZeRO's accounting (issue 19: "built-in models and traced modules
alike"): each rank's peak, derived from the module's step recorded on fake tensors and rewritten for the engine
(symmem.importer.traced_engines), equals the live bytes measured inside each rank of a real gloo run of the same
module (symmem.record.distributed with a module builder), to the byte.

The cases (a small file module with a repeated block, folded in L, and a tiny Hugging Face GPT-2 built from a
config): ddp-bucket-view, FSDP2, FSDP1 (each step's optimizer over flat shards) and ZeroRedundancyOptimizer (each
rank's step recorded with its own local optimizer; GPT-2's under ``-m deep``), on two ranks; FSDP2 on four, where a
middle rank holds part of a shard.  One job runs live in a spawn of two (:data:`LIVE`: the file module under FSDP2);
the others are replayed from their stored real runs (tests/gloo_store.py), each derivation checked against them the
same way; ``-m deep`` runs every job anew and compares each rank with its stored run.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("transformers")
if not dist.is_available():  # pragma: no cover - a torch built without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import gloo_store  # noqa: E402  (stored real runs, replayed)

from symmem.cli import main  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.importer import sources  # noqa: E402
from symmem.importer.spec_builder import SpecBuilder  # noqa: E402
from symmem.importer.traced_engines import Engine, traced_job  # noqa: E402
from symmem.passes.data_parallel import rank_peaks  # noqa: E402
from symmem.passes.zero_redundancy import state_per_rank  # noqa: E402
from symmem.record.distributed import compare, compare_parameter_side, measure_jobs  # noqa: E402
from symmem.symbols import L, N  # noqa: E402

#: the file module: 4 blocks (L = 4: the peak is the formula folded in L), a 5-row head FSDP2 pads at N = 2
BLOCK = f"{Path(__file__).parent / 'data' / 'traced_block.py'}:build"
GPT2 = ("hf:gpt2", (("n_layer", 2), ("n_embd", 64), ("n_head", 2), ("vocab_size", 100), ("n_positions", 64)))
#: (spec, config, loss, engines)
CASES = [(BLOCK, (), "cross-entropy", ("fsdp", "ddp-bucket-view", "fsdp-no-reshard", "zero-redundancy", "fsdp1",
                                       "fsdp1-grad-op")),
         (*GPT2, "sum", ("fsdp",))]
#: the one job of CASES run live, as (spec, engine): the traced module's path in a rank (its builder), which every
#: replayed job takes too; each engine's own path runs live with the reference models (test_data_parallel.py,
#: test_zero_redundancy.py, test_fsdp1.py)
LIVE = [(BLOCK, "fsdp")]
#: ``-m deep`` (docs/testing.md, "What is deep"), in a spawn of its own: GPT-2 under ZeroRedundancyOptimizer (each
#: rank's step recorded with its own local optimizer, ~3 CPU-s of the test's process) -- a traced module under
#: ZeRO-1 is the block's case above, a Hugging Face model traced under an engine GPT-2's FSDP2
DEEP_CASES = [(*GPT2, "sum", ("zero-redundancy",))]
#: jobs of CASES traced and checked under ``-m deep`` only (test_every_stored_run_against_a_fresh_gloo_run;
#: docs/testing.md, "Stop 42: gloo42"): the file module without resharding -- it runs no line the kept cases do not
#: (FSDP2 live, resharding; fsdp-no-reshard's real runs: Llama's in tests/test_data_parallel.py, live, and the traced
#: module's under FSDP2 x TP in tests/test_fsdp_tensor.py, live)
DEEP_CHECKS = [(BLOCK, "fsdp-no-reshard")]


@functools.cache
def _loaded(spec, config):
    return sources.load(spec, config=dict(config) or None)


#: (spec, config, loss, optimizer) -> the one-device step's records and fake worlds, shared by its engines' traces
_PLAIN: dict[tuple[Any, ...], tuple[dict[Any, Any], dict[Any, Any]]] = {}


@functools.cache
def _traced(spec, config, loss, engine, optimizer="adamw", world=2, **kw):
    """The module traced under ``engine``.  Every engine rewrites the same one-device step (``step.inner``: the same
    module, example inputs, loss and optimizer), recorded at the fold's layer counts: the engines of one module share
    those records (each is the step recorded on fake tensors, the same whichever engine asks first) instead of
    recording them again."""
    loaded = _loaded(spec, config)
    dims = sources.parse_dims("B,S" if spec.startswith("hf:") else "B", loaded)
    values = {"N": world} if engine or kw.get("zero") else None
    d = sources.trace(loaded, dims, optimizer=optimizer, data_parallel=engine, values=values, loss=loss, check=False,
                      **kw)
    inner = getattr(d.step, "inner", None) or (d.step if engine is None and not kw else None)  # or the plain step
    if inner is not None and SHARE_RECORDS:
        inner._records, inner._shared = _PLAIN.setdefault((spec, config, loss, optimizer),
                                                          (inner._records, inner._shared))
    return d


#: off: every engine records its own (how the sharing was checked byte for byte)
SHARE_RECORDS = True


@pytest.mark.xdist_group("gloo")  # one test worker runs every gloo test, its ranks forked from it (gloo_store)
def test_traced_modules_under_every_engine_equal_real_gloo_runs():
    cases = _against_gloo(CASES, live=LIVE, unchecked=DEEP_CHECKS)
    block = cases[0][2]
    assert block.step.holds_at(block.numbers) and block.numbers[L] == 4  # the peak is the formula in L
    # the padding: the head's 5 rows are 3 + 2 at N = 2, so the last rank keeps 2 x 4 x (24 + 1) bytes fewer of
    # AdamW's two moments, in the first step and the steady one
    ranks = rank_peaks(cases[0][2])
    assert ranks[0][0] - ranks[1][0] == ranks[0][1] - ranks[1][1] == 2 * 4 * 25
    # ZeRO-1: the ranks' AdamW states add up to one device's (two moments per element, a 4-byte step per whole
    # parameter), split unevenly by whole parameters (the ranks' peaks differ: measured above)
    zero = next(d for spec, engine, d, _ in cases if spec == BLOCK and engine == "zero-redundancy")
    params = list(_loaded(BLOCK, ()).module.parameters())
    state = state_per_rank(zero)
    assert sum(state) == 8 * sum(p.numel() for p in params) + 4 * len(params) and state[0] != state[1]


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_the_deep_cases_equal_real_gloo_runs():
    """:data:`DEEP_CASES` in a spawn of two ranks, checked as the test above checks its cases."""
    _against_gloo(DEEP_CASES)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_run_against_a_fresh_gloo_run():
    """Every job of :data:`CASES` run live in one spawn of two ranks, each rank compared with its stored run
    (tests/gloo_store.py; ``SYMMEM_GLOO_STORE=write`` stores them) and checked as the default test checks it."""
    _against_gloo(CASES, every=True)


def _against_gloo(table, live=None, every=False, unchecked=()):
    """Every case of ``table`` ((spec, config, loss, engines) rows): each rank's parameter side, and its first and
    steady peak, derived, against the real run, to the byte; the cases, derived.  ``live``: the (spec, engine) pairs
    run in a spawn of two ranks, the others replayed from their stored runs (None: every case live, not stored;
    ``every``: every case live, each compared with its stored run; ``unchecked``: (spec, engine) pairs left out, neither
    traced nor replayed)."""
    cases = [(spec, engine, _traced(spec, config, loss, engine), SpecBuilder(spec, config))
             for spec, config, loss, engines in table for engine in engines if (spec, engine) not in unchecked]
    sharded = [i for i, (_, engine, _, _) in enumerate(cases) if engine.startswith("fsdp")]
    jobs = [traced_job(d, builder) for _, _, d, builder in cases]
    # FSDP's jobs once, before DDP's: each collective releases its tensors on the recording thread
    # (symmem.record.collectives), so no free lands late, by gloo's worker thread (each rank counts those: none)
    plain = [i for i in range(len(cases)) if i not in sharded]
    order = [*sharded, *plain]
    if live is None and not every:
        runs = measure_jobs([jobs[i] for i in order], world=2, timeout=170, start_method=gloo_store.START)
    else:
        chosen = [k for k, i in enumerate(order) if (cases[i][0], cases[i][1]) in (live or ())]
        runs = gloo_store.runs([jobs[i] for i in order], 2, chosen, timeout=170, every=every)
    n = len(sharded)
    assert not [(i, r.rank, r.late) for i, ranks in zip(sharded, runs, strict=False) for r in ranks if r.late]
    found = dict(zip(sharded, runs[:n], strict=True))
    found.update(zip(plain, runs[n:], strict=True))
    measured = [found[i] for i in range(len(cases))]
    wrong = []
    for (spec, engine, d, _), ranks in zip(cases, measured, strict=True):
        name = f"{spec.rsplit('/', 1)[-1]} {engine}"
        # each rank's weights, .grads (and DDP's buckets) and optimizer state when backward ends
        wrong += [f"{name}: {w}" for w in compare_parameter_side(d, ranks)]
        if engine.startswith("ddp"):  # every rank alike
            wrong += [f"{name}: {w}" for w in compare(d, ranks)]
            continue
        # every rank's first and steady peak: rank_peaks where the padding (FSDP2) or the whole-parameter partition
        # (ZeRO-1) makes them differ, else the peak
        want = rank_peaks(d) or {r.rank: (d.value("peak_first_step"), d.value("peak")) for r in ranks}
        got = {r.rank: (r.first, min(r.per_step[1:])) for r in ranks}
        wrong += [f"{name}: derived {want}, measured {got}"] if want != got else []
    assert not wrong, "\n".join(wrong)
    return cases


def test_zero_and_ddp_as_hand_counts_of_the_traced_step():
    """Hand counts on the recorded step (SGD with momentum: no scalar state), moment by moment: --zero K divides
    what stage K shards by N and nothing else (at N = 1 it is one device's step); plain DDP adds its buckets, one
    more copy of every trainable parameter's bytes, live the whole step (the bucket view and FSDP2 are checked
    against real runs above).  Stage 3 through ``trace``; stages 1 and 2 and DDP rewrite the same record."""
    one = _traced(BLOCK, (), "sum", None, "sgd-momentum")
    at = dict(one.numbers)
    base = one.step.timeline("steady", at)
    zero = _traced(BLOCK, (), "sum", None, "sgd-momentum", world=4, zero=3)
    step = zero.step
    shards = {1: ("optimizer_state",), 2: ("optimizer_state", "gradient"), 3: ("optimizer_state", "gradient",
                                                                               "parameter")}
    psi = sum(p.numel() for p in _loaded(BLOCK, ()).module.parameters())
    assert psi == 12 * 24 + 24 + 4 * (2 * 24 + 24 * 72 + 72 + 72 * 24 + 24) + 24 * 5 + 5
    record = step.inner.record(at[L])
    for stage, shared in shards.items():
        rewritten = Engine("zero", stage).apply(record, step.module, step.repeat, False)
        for world in (4, 1):
            rows = (step.timeline("steady", {**at, N: world}) if stage == 3 else
                    rewritten.timeline("steady", {**at, N: world}))
            assert [r[:2] for r in rows] == [r[:2] for r in base]
            for (_, _, got), (_, _, live) in zip(rows, base, strict=True):
                assert got == {c: v // world if c in shared else v for c, v in live.items()}, (stage, got, live)
    ddp = Engine("ddp").apply(record, step.module, step.repeat, False).timeline("steady", at)
    assert [r[:2] for r in ddp] == [r[:2] for r in base]
    for (_, _, got), (_, _, live) in zip(ddp, base, strict=True):
        assert got == {**live, "gradient": live["gradient"] + 4 * psi}


def test_fit_solves_with_the_per_rank_peak(capsys):
    """The issue's `symmem fit hf:gpt2 ... --data-parallel fsdp --set N=8`: the largest batch whose rank's peak
    fits, and the next one does not."""
    spec, config = GPT2
    args = [f"--config={k}={v}" for k, v in config]
    assert main(["fit", spec, *args, "--dims", "B,S", "--data-parallel", "fsdp", "--set", "N=8", "--budget",
                 "4MiB", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quantity"] == "peak" and out["held"]["N"] == 8 and out["refused"] is None
    assert out["total_at_max"] <= out["budget"] < out["total_above"] and out["max"] == 24


@pytest.mark.parametrize("flags, words", [
    (["--pipeline-parallel"], "no peak: the 1F1B schedule needs at least as many micro-batches as stages"),
    (["--data-parallel", "fsdp", "--micro-batches", "2"], "modelled for one micro-batch"),
])
def test_what_is_not_modelled_is_said_in_one_line(capsys, flags, words):
    code = main(["trace", BLOCK, "--dims", "B", *flags])
    captured = capsys.readouterr()
    assert words in captured.out + captured.err
    assert "Traceback" not in captured.err and code in (0, 2)


def test_a_module_whose_output_is_its_own_code_is_refused_under_fsdp():
    """FSDP's root pre-backward waits for the output's gradient; where the root's own code makes the output the
    recorded backward cannot place it: one line, not a guess."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net

        def forward(self, x):
            return self.net(x) * 2

    from symmem import trace

    d = trace(Wrapped(), (torch.zeros(2, 4),), {"B": [(0, 0)]}, data_parallel="fsdp", values={"N": 2})
    with pytest.raises(SymmemError, match="made in its own forward"):
        d.value("peak")


def test_ddp_buckets_hold_the_trainable_parameters_only():
    """A frozen weight has no gradient, so DDP makes no bucket for it: 4 bytes for each of the 4 + 12 + 3
    trainable elements beside one device's peak."""
    from symmem import trace

    net = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 3))
    net[0].weight.requires_grad_(False)
    one, ddp = (trace(net, (torch.zeros(2, 8),), {"B": [(0, 0)]}, data_parallel=e) for e in (None, "ddp"))
    assert ddp.value("peak") - one.value("peak") == 4 * (4 + 12 + 3)
    for engine in ("fsdp", "fsdp1", "zero-redundancy"):  # their shards and partitions cover every parameter
        with pytest.raises(SymmemError, match="parameters all train"):
            trace(net, (torch.zeros(2, 8),), {"B": [(0, 0)]}, data_parallel=engine, values={"N": 2}).value("peak")


@pytest.mark.xdist_group("gloo")
def test_every_rank_of_traced_fsdp_at_four_ranks_equals_a_real_run():
    _four_ranks(every=False)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_the_stored_four_rank_run_against_a_fresh_gloo_run():
    """The four-rank job of the test above run live, each rank compared with its stored run and checked the same
    way."""
    _four_ranks(every=True)


def _four_ranks(every):
    """FSDP2 at N = 4: the head's 5 rows are held 2, 2, 1, 0 by the ranks, so rank 2 -- a middle rank -- has a step
    of its own (one row of AdamW's two moments, 2 x 4 x (24 + 1) bytes, fewer than rank 0; rank 3 two fewer).  Every
    rank's first and steady peak equals the live bytes of that rank in a real 4-process gloo run."""
    d = _traced(BLOCK, (), "cross-entropy", "fsdp", world=4)
    ranks = rank_peaks(d)
    steady = [ranks[r][1] for r in range(4)]
    assert steady[0] == steady[1] and steady[0] - steady[2] == steady[2] - steady[3] == 2 * 4 * 25
    job = traced_job(d, SpecBuilder(BLOCK, ()))
    # replayed from its stored real run (tests/gloo_store.py): traced FSDP2 runs live at N = 2 above
    (one,) = gloo_store.runs([job], 4, (), timeout=170, every=every)
    assert not [r for r in one if r.late]  # no free by gloo's worker thread (symmem.record.collectives)
    got = {r.rank: (r.first, min(r.per_step[1:])) for r in one}
    assert got == ranks


def _args(engine):
    return [BLOCK, "--dims", "B", "--data-parallel", engine, "--set", "N=2", "--loss", "cross-entropy", "--optimizer",
            "adamw"]


@pytest.mark.xdist_group("gloo")  # after the gloo runs, on their worker: their traced derivations are cached
def test_the_command_line_gives_each_rank_and_plots(capsys, tmp_path):
    """``symmem trace SPEC --data-parallel zero-redundancy --set N=2 --format json`` gives the peaks the gloo runs
    above measure, every rank's (they differ) and which rank peaks; ``plot`` draws the largest rank's step (``fit``
    under an engine: test_fit_solves_with_the_per_rank_peak; under FSDP1, ``-m deep``)."""
    assert main(["trace", *_args("zero-redundancy"), "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = _traced(BLOCK, (), "cross-entropy", "zero-redundancy")
    ranks = rank_peaks(d)
    per_rank = out["values"]["peak_per_rank"]
    assert {int(r): (v["peak_first_step"], v["peak"]) for r, v in per_rank.items()} == ranks
    assert out["values"]["peak"] == ranks[0][1] > ranks[1][1] and out["peak_at"]["rank"] == 0
    assert main(["plot", "timeline", *_args("zero-redundancy"), "--output", str(tmp_path / "step.png")]) == 0
    assert (tmp_path / "step.png").stat().st_size > 0


@pytest.mark.deep
def test_fit_under_fsdp1(capsys):
    """``fit`` solves the peak for B under FSDP1 (whose ranks hold the same flat shards).  ``-m deep`` (docs/testing.md,
    "What is deep"): ``fit`` of a traced module under an engine is test_fit_solves_with_the_per_rank_peak's (FSDP2),
    FSDP1's traced peaks are checked against the gloo runs above."""
    assert main(["fit", *_args("fsdp1"), "--budget", "300KiB", "--format", "json"]) == 0
    fit = json.loads(capsys.readouterr().out)
    assert fit["quantity"] == "peak" and fit["total_at_max"] <= fit["budget"] < fit["total_above"]
