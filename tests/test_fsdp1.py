"""FSDP1 (``FullyShardedDataParallel``, FULL_SHARD and SHARD_GRAD_OP) and every rank of FSDP2 against real gloo
runs at N = 4: each rank's first and steady peak, derived, equals the live bytes measured inside that rank
(symmem.record.distributed with symmem.record.fsdp1_runs), to the byte.

One spawn of four processes runs every case once: each collective releases its tensors on the recording thread
(symmem.record.collectives), so no free lands late, by gloo's worker thread (each rank counts those: none); the
ranks meet through a file store.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover - a torch built without distributed
    pytest.skip("torch.distributed is not available", allow_module_level=True)

import gloo_store  # noqa: E402  (stored real runs, replayed)

from symmem import derive  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.passes.data_parallel import rank_peaks, rank_ranges  # noqa: E402
from symmem.record.distributed import compare_parameter_side, job_of  # noqa: E402

#: five linear units; the head's flat parameter (10 x 128 + 10 = 1,290 elements) is padded to 1,292 at N = 4,
#: so its reduce-scatter pads a copy of the gradient
DEEP = (64, 128, 128, 128, 128, 10)
#: FSDP2 pads dim 0: 127 rows are 32, 32, 32, 31 and 5 rows 2, 2, 1, 0 -- ranks 0-1, rank 2 and rank 3 differ
PADDED = "64,127,5"
GPT = ("gpt2", {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100, "B": 2}, {"attention": "sdpa", "dropout": 0.0})


def _derive(name, values, kw, engine):
    return derive(name, convention="pytorch", device="cpu", optimizer="adamw", loss="cross-entropy",
                  values={**values, "N": 4}, data_parallel=engine, **kw)


@pytest.mark.xdist_group("gloo")  # one test worker runs every gloo test: one forkserver for all (conftest.py)
def test_every_rank_of_fsdp1_and_fsdp2_equals_a_gloo_run():
    """The three cases replay their stored real runs (tests/gloo_store.py): FSDP2 at N = 4 runs live in
    tests/test_zero_redundancy.py's spawn (GPT-2 under selective, padded), FSDP1 and SHARD_GRAD_OP at N = 4 there too
    (with micro-batches), FSDP1 in tests/test_data_parallel.py's; the deep twin reruns these three."""
    _every_rank(every=False)


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_every_stored_run_against_a_fresh_gloo_run():
    """The three jobs of the test above run live, each rank compared with its stored run and checked the same way."""
    _every_rank(every=True)


def _every_rank(every):
    deep = {"widths": ",".join(map(str, DEEP))}
    cases = [
        ("fsdp2 padded", _derive("mlp", {"B": 4}, {"widths": PADDED}, "fsdp")),
        ("fsdp1", _derive("mlp", {"B": 4}, deep, "fsdp1")),
        ("fsdp1-grad-op", _derive("mlp", {"B": 4}, deep, "fsdp1-grad-op")),
    ]
    jobs = [job_of(d) for _, d in cases]
    runs = gloo_store.runs(jobs, 4, (), timeout=240, every=every)
    assert not [(i, r.rank, r.late) for i, ranks in enumerate(runs) for r in ranks if r.late], "gloo's frees"
    measured = {name: ranks for (name, _), ranks in zip(cases, runs, strict=True)}
    derived = dict(cases)
    got = {name: {r.rank: (r.first, min(r.per_step[1:])) for r in ranks} for name, ranks in measured.items()}
    # FSDP2: every rank, the middle ones included, each distinct set of held rows walked once
    per_rank = rank_peaks(derived["fsdp2 padded"])
    assert per_rank == got["fsdp2 padded"], (per_rank, got["fsdp2 padded"])
    assert [(a, b) for a, b, _ in rank_ranges(per_rank)] == [(0, 1), (2, 2), (3, 3)]
    # FSDP1: every rank holds the same; each one's first and steady peak, to the byte
    for name in ("fsdp1", "fsdp1-grad-op"):
        d = derived[name]
        assert set(got[name].values()) == {(d.value("peak_first_step"), d.value("peak"))}, (name, got[name])
        assert rank_peaks(d) is None
    # FSDP1's flat parameters by hand: each unit's parameters flattened (out*in + out elements), padded to a
    # multiple of N and split evenly, so every rank stores ceil(n/N) elements (padding included); beside them
    # the batch and its int64 targets
    shards = sum(-(-(b * a + b) // 4) for a, b in zip(DEEP, DEEP[1:], strict=False))
    for name in ("fsdp1", "fsdp1-grad-op"):
        assert [r.start for r in measured[name]] == [4 * shards + 4 * DEEP[0] * 4 + 4 * 8] * 4
    # SHARD_GRAD_OP keeps every unit's unsharded flat parameter from its forward to its backward: more than
    # FULL_SHARD, which holds two units' at a time in backward (the one running and the prefetched one)
    assert got["fsdp1-grad-op"][0][1] > got["fsdp1"][0][1]
    # every rank's parameter side when backward ends: weights, .grads and AdamW state (ranks 0-1, 2 and 3 of the
    # padded FSDP2 MLP hold different rows; FSDP1's flat shards hold the padding in all three alike)
    for name, d in cases:
        assert not compare_parameter_side(d, measured[name]), (name, compare_parameter_side(d, measured[name]))
    assert [r.held["gradient"] for r in measured["fsdp1"]] == [4 * shards] * 4


@pytest.mark.parametrize("name, values, kw", [
    (GPT[0], {**GPT[1], "L": 3}, GPT[2]),
    ("llama", {**GPT[1], "L": 3, "G": 2, "F": 128}, {"attention": "sdpa"}),
])
def test_each_units_flat_parameter_is_the_modules(name, values, kw):
    """The units FSDP1 (and FSDP2) shard are the reference's blocks, the root every other parameter: each unit's
    flat parameter has as many elements as its module (a tied head counted once, as ``parameters()`` does), and a
    layer's norm weights (free-standing parameter nodes in symmem's graph) are its own, not the root's."""
    from symmem.passes.schedule import Simulation
    from symmem.passes.unroll import unroll
    from symmem.reference import reference

    d = _derive(name, values, kw, "fsdp1")
    step = d.step
    graph = unroll(step.graph, {b: values["L"] for b in step.graph.blocks})
    sim = Simulation(graph, step.conv, step.options, step.regime, None, step.regime.keep_logits)
    flat = {u: d.evaluate(n) for u, n in sim.fsdp.flat.items()}
    module, _ = reference(name, {k: v for k, v in values.items() if k != "N"}, kw)
    blocks = [m for lst in module.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst]
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
    assert [flat[u] for u in sim.fsdp.units] == per_block
    assert flat[None] == sum(p.numel() for p in module.parameters()) - sum(per_block)


def test_every_rank_at_a_large_n_walks_each_distinct_shard_once():
    """N = 64: 127 rows are 2 a rank (rank 63: 1), 5 rows 1 a rank on ranks 0-4 (none after): three distinct
    sets of rows, so three peaks, rank 0's the largest; the table names each range of ranks."""
    kw = {"widths": PADDED, "loss": "cross-entropy"}
    d = derive("mlp", convention="pytorch", device="cpu", optimizer="adamw", values={"B": 4, "N": 64},
               data_parallel="fsdp", **kw)
    ranks = rank_peaks(d)
    assert sorted(ranks) == list(range(64))
    assert [(a, b) for a, b, _ in rank_ranges(ranks)] == [(0, 4), (5, 62), (63, 63)]
    assert ranks[0] == (d.value("peak_first_step"), d.value("peak")) == max(ranks.values())
    run = ["derive", "mlp", "--convention", "pytorch", "--device", "cpu", "--optimizer", "adamw", "--set", "B=4",
           "--set", "N=64", "--widths", PADDED, "--loss", "cross-entropy", "--data-parallel", "fsdp"]
    out = _cli(run + ["--format", "json"])
    assert len(json.loads(out)["values"]["peak_per_rank"]) == 64


def _cli(args):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(args) == 0
    return buf.getvalue()


def test_fsdp1_in_the_cli_and_its_refusals(capsys):
    run = ["derive", "mlp", "--convention", "pytorch", "--device", "cpu", "--optimizer", "adamw", "--set", "B=4",
           "--set", "N=4", "--widths", "64,127,10", "--loss", "cross-entropy", "--data-parallel", "fsdp1-grad-op"]
    assert main([*run, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    d = derive("mlp", convention="pytorch", device="cpu", optimizer="adamw", values={"B": 4, "N": 4},
               widths="64,127,10", loss="cross-entropy", data_parallel="fsdp1-grad-op")
    assert out["regime"]["data_parallel"] == "fsdp1-grad-op" and out["values"]["peak"] == d.value("peak")
    assert "peak_per_rank" not in out["values"]  # every rank holds the same flat shards
    for kw, message in [({"precision": "mixed"}, "is modelled in fp32")]:  # micro-batches: test_fsdp1_accumulation
        with pytest.raises(SymmemError, match=message) as e:
            derive("gpt2", convention="pytorch", data_parallel="fsdp1", **kw).value("peak")
        assert "\n" not in str(e.value)
    with pytest.raises(SymmemError, match="data_parallel='fsdp1' is an engine and zero=3"):
        derive("gpt2", convention="pytorch", data_parallel="fsdp1", zero=3)
