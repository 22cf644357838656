"""Every distinct data-parallel rank's peak as a formula (``symmem.passes.rank_formulas``: JSON's
``expressions.peak_per_rank``, the table's "peak per rank as formulas"), derived at one world size N and evaluated
at ANOTHER, against the per-rank peaks real gloo runs measured there.

Truths: each rank's first and steady peak measured inside that rank of a real ``torch.distributed`` gloo run.
The MLP 64-127-5 under FSDP2 at N = 4 and ZeroRedundancyOptimizer at N = 4 are read from their stored runs
(tests/data/gloo_runs.json via tests/gloo_store.py: ``tests/test_fsdp1.py``'s and ``tests/test_zero_redundancy.py``'s
jobs, whose deep twins rerun them and compare); FSDP2 at N = 3 (the MLP 64-127-10, GPT-2 and Llama tiny) are still
docs/regimes.md's numbers, typed (no stored run of a 3-rank world yet); FSDP x PP on the 2 x 2 mesh:
``tests/test_fsdp_pipeline.py``'s, whose spawn also checks these formulas against its live ranks:
``test_pipeline_formula_mesh.fsdp_against_the_engines``.  Nothing here runs a process of its own.
"""

from __future__ import annotations

import functools
import json

import pytest
import sympy

from symmem import derive
from symmem.cli import main
from symmem.passes.rank_formulas import rank_formulas

N = sympy.Symbol("N", positive=True, integer=True)
TINY = {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100}


@functools.cache
def _derive(model, values, engine, **kw):
    return derive(model, convention="pytorch", device="cpu", optimizer="adamw", loss="cross-entropy",
                  values=dict(values), data_parallel=engine, **kw)


#: FSDP2 on a built graph: (model, sizes, keywords, engine, the N each formula is derived at, the N measured at,
#: {group at the derived N: (first, steady) of every rank of it, measured at the measured N}).  The padding's rows
#: make the last rank smaller: "rank N-1" is rank N - 1's step, its rows a formula in N, so derived at N = 4 it
#: gives rank 2's peak at N = 3; "ranks 0..N-2" is rank 0's (whole shards).
FSDP = [
    # 127 rows: 32, 32, 32, 31 at N = 4 and 43, 43, 41 at N = 3; 10 rows: 3, 3, 3, 1 and 4, 4, 2
    # (gloo at N = 3, stored: rank 0's and rank 2's of :func:`_stored`)
    ("mlp", {"B": 4}, {"widths": "64,127,10"}, "fsdp", 4, 3, {"ranks 0..N-2": 0, "rank N-1": 2}),
    ("mlp", {"B": 4}, {"widths": "64,127,10"}, "fsdp", 5, 3, {"ranks 0..N-2": 0, "rank N-1": 2}),
    # 127 rows: 43, 43, 41 at N = 3 and 32, 32, 32, 31 at N = 4; 5 rows 2, 2, 1 and 2, 2, 1, 0 (rank 2 in the middle
    # holds part of a shard at N = 4: its own formula, at its own number, below)
    # (gloo at N = 4, stored: rank 0's and rank 3's of :func:`_stored`, tests/data/gloo_runs.json)
    ("mlp", {"B": 4}, {"widths": "64,127,5"}, "fsdp", 3, 4, {"ranks 0..N-2": 0, "rank N-1": 3}),
]


def _stored(widths: str, n: int, engine: str, b: int = 4) -> dict[int, tuple[int, int]]:
    """Every rank's (first, steady) peak of the MLP ``widths`` under ``engine`` at N = ``n``, B = ``b``: the real
    gloo run stored in tests/data/gloo_runs.json (tests/gloo_store.py; the N = 4 jobs' deep twins are
    tests/test_fsdp1.py's and tests/test_zero_redundancy.py's, the N = 3 ones this file's
    ``test_the_n3_runs_against_fresh_gloo_runs``), replayed -- no process started."""
    return _stored_ranks("mlp", (("B", b), ("N", n)), engine, widths=widths)


def _stored_ranks(model: str, values: tuple, engine: str, **kw) -> dict[int, tuple[int, int]]:
    import gloo_store

    from symmem.record.distributed import job_of

    (ranks,) = gloo_store.runs([job_of(_derive(model, values, engine, **kw))], dict(values)["N"], (), timeout=1)
    return {r.rank: (r.first, min(r.per_step[1:])) for r in ranks}


def _n3_jobs() -> list:
    """The FSDP2 runs at N = 3 (a world of three ranks) this file's formulas are checked against: the MLP
    64-127-10 (:data:`FSDP`) and :data:`LAYERED`'s GPT-2 and Llama tiny."""
    from symmem.record.distributed import job_of

    return [job_of(_derive("mlp", (("B", 4), ("N", 3)), "fsdp", widths="64,127,10")),
            *(job_of(_derive(model, tuple(sorted({**values, "N": 3}.items())), "fsdp", **kw))
              for model, values, kw in LAYERED)]


@pytest.mark.deep
@pytest.mark.xdist_group("gloo")
def test_the_n3_runs_against_fresh_gloo_runs():
    """The stored N = 3 runs (:func:`_n3_jobs`) rerun in one spawn of three ranks, each rank against its stored row
    (``SYMMEM_GLOO_STORE=write`` writes them: tests/gloo_store.py)."""
    import gloo_store
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    gloo_store.runs(_n3_jobs(), 3, (), timeout=600, every=True)


@pytest.mark.parametrize("model, values, kw, engine, at, measured_n, measured", FSDP)
def test_fsdp_rank_formulas_at_another_n_are_the_measured_ranks(model, values, kw, engine, at, measured_n,
                                                                   measured):
    d = _derive(model, tuple(sorted({**values, "N": at}.items())), engine, **kw)
    found = {f.label: f for f in rank_formulas(d)}
    assert set(found) == set(measured), found
    there = d.at(N=measured_n)
    real = _stored(kw["widths"], measured_n, engine)
    for name, (first, steady) in ((k, real[v]) for k, v in measured.items()):
        f = found[name]
        assert N in f.peak.free_symbols and f.held_at == "holds where N >= 2", (name, f)
        assert (there.evaluate(f.peak_first_step), there.evaluate(f.peak)) == (first, steady), (name, at)


def test_a_middle_rank_keeps_its_number():
    """The MLP 64-127-5 at N = 4 (gloo, every rank: tests/test_fsdp1.py): ranks 0-1 hold whole shards, rank 2 one
    of the 5 rows, rank 3 none: three formulas, the middle one rank 2's own."""
    d = _derive("mlp", (("B", 4), ("N", 4)), "fsdp", widths="64,127,5")
    found = rank_formulas(d)
    assert [(f.label, f.ranks) for f in found] == [("ranks 0..1", (0, 1)), ("rank 2", (2,)), ("rank N-1", (3,))]
    real = _stored("64,127,5", 4, "fsdp")
    assert [(d.evaluate(f.peak_first_step), d.evaluate(f.peak)) for f in found] == [real[0], real[2], real[3]]
    assert real[1] == real[0]


#: GPT-2 and Llama tiny at N = 3 (every dim padded: V = 100 is 34, 34, 32 rows; H = 64 is 22, 22, 20), measured on
#: gloo (stored: :func:`_n3_jobs`): rank 0's first / steady, the last rank's steady; derived at N = 5.  Their layers are
#: written out at L >= 4 (the Max's domain), so at L = 2 the formula is evaluated as the derivation does
#: (``values``: the step at those numbers)
LAYERED = [("gpt2", {**TINY, "B": 2}, {"attention": "sdpa", "dropout": 0.0}),
           ("llama", {**TINY, "B": 2, "G": 2, "F": 128}, {"attention": "sdpa"})]


@pytest.mark.deep
@pytest.mark.parametrize("model, values, kw", LAYERED)
def test_layered_models_rank_formulas_from_n_5(model, values, kw):
    from symmem.passes.data_parallel import rank_derivations

    d = _derive(model, tuple(sorted({**values, "N": 5}.items())), "fsdp", **kw)
    assert [f.label for f in rank_formulas(d)] == ["ranks 0..N-2", "rank N-1"]
    assert all(f.held_at == "holds where L >= 4, N >= 2" for f in rank_formulas(d))
    (_, first), (_, last) = rank_derivations(d)
    got = (int(first.values("peak_first_step", N=[3])[0]), int(first.values("peak", N=[3])[0]),
           int(last.values("peak", N=[3])[0]))
    real = _stored_ranks(model, tuple(sorted({**values, "N": 3}.items())), "fsdp", **kw)
    assert got == (*real[0], real[2][1])


def test_zero_redundancy_rank_formulas_in_the_batch():
    """ZeroRedundancyOptimizer's ranks at the partition's numbers (N = 4 and the MLP's sizes), each a formula in B:
    derived at B = 2, at B = 4 every rank's measured first and steady peak (gloo, 4 ranks: the issue's MLP
    784-1024-1024-10, tests/test_zero_redundancy.py)."""
    d = _derive("mlp", (("B", 2), ("N", 4)), "zero-redundancy")
    found = rank_formulas(d)
    assert [f.label for f in found] == ["rank 0", "rank 1", "rank 2", "rank 3"]
    assert all(f.held_at == "at N = 4" and f.peak.free_symbols == {sympy.Symbol("B", positive=True, integer=True)}
               for f in found), found
    there = d.at(B=4)
    real = _stored("784,1024,1024,10", 4, "zero-redundancy")
    assert [(there.evaluate(f.peak_first_step), there.evaluate(f.peak)) for f in found] == [real[r] for r in range(4)]


#: FSDP x PP on the 2 x 2 mesh (tests/test_fsdp_pipeline.py's CASES 0 and 1, docs/regimes.md's table): the
#: data-parallel rank 1 of each stage (ranks 1 and 3) holds one vocabulary row fewer of AdamW's state; other sizes
#: (N = 3 and 4 among them) each stage's last-rank formula is derived at, and which case of test_fsdp_pipeline.CASES
#: it is (its ranks' steady peaks: their stored real runs, tests/data/pipeline_meshes_gloo.json)
STAGES = [
    ("gpt2", {"B": 2, "S": 16, "H": 32, "h": 2, "L": 2, "V": 65, "F": 128}, "1f1b", 2, True,
     {"attention": "naive", "dropout": 0.0}, [{"N": 3}, {"N": 4, "B": 3}], 0),
    ("llama", {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 63, "F": 64}, "gpipe", 2, False,
     {"attention": "sdpa"}, [{"N": 3}, {"N": 4, "S": 8}], 1),
]


@functools.cache
def _stages(model, values, schedule, m, reshard, options):
    return derive(model, data_parallel="fsdp" if reshard else "fsdp-no-reshard", pipeline_parallel=True,
                  pipeline_schedule=schedule, micro_batches=m, loss="cross-entropy", device="cpu",
                  values={"p": 2, **dict(values)}, **dict(options))


@pytest.mark.deep  # tests/test_fsdp_pipeline.py's spawn checks the same against its live ranks
@pytest.mark.parametrize("model, values, schedule, m, reshard, options, others, measured", STAGES)
def test_each_stages_last_rank_formula_from_other_sizes(model, values, schedule, m, reshard, options, others,
                                                        measured):
    """Each stage's last data-parallel rank: its largest moment's formula (in N, the sizes, at p and M), derived at
    other sizes, at the measured ones is at most that rank's measured steady peak, and equal where the same moment
    peaks there (as each stage's rank 0: tests/test_pipeline_formula_mesh.py)."""
    import test_fsdp_pipeline
    from stage_ranks import stored

    real = {r.rank: r.steady_peak for r in (rank[0] for rank in stored([test_fsdp_pipeline.CASES[measured]]))}
    _last_ranks(model, values, schedule, m, reshard, options, others, (real[1], real[3]))


def last_ranks_against_the_engines(everything, cases):
    """``everything``: per rank (rank s*N + r), tests/test_fsdp_pipeline.py's live results of its ``cases`` on the
    2 x 2 mesh: STAGES' formulas for ranks 1 and 3 against those ranks' measured steady peaks (its spawn calls
    this)."""
    for k, (model, values, schedule, m, reshard, options, others, _) in enumerate(STAGES):
        assert (model, schedule, m, reshard) == (cases[k][0], cases[k][2], cases[k][3], cases[k][6])
        real = {r.rank: r.steady_peak for rank in everything for r in [rank[k]]}
        _last_ranks(model, values, schedule, m, reshard, options, others, (real[1], real[3]))


def _last_ranks(model, values, schedule, m, reshard, options, others, measured):
    found = []
    for other in others:
        d = _stages(model, tuple(sorted({**values, **other}.items())), schedule, m, reshard,
                    tuple(sorted(options.items())))
        last = [f for f in rank_formulas(d) if f.label.endswith("rank N-1")]
        assert [f.label for f in last] == ["stage 0, rank N-1", "stage 1, rank N-1"], rank_formulas(d)
        assert all(N in f.peak.free_symbols and f.held_at.startswith(f"at p = 2, M = {m}") for f in last)
        there = d.at(**{k: {**values, "N": 2}[k] for k in other})  # the measured sizes
        found.append([there.evaluate(f.peak) for f in last])
    assert all(f[s] <= measured[s] for f in found for s in (0, 1)), (found, measured)
    assert [max(f[s] for f in found) for s in (0, 1)] == list(measured), (found, measured)


def test_json_and_table_give_every_group(capsys):
    """JSON: ``expressions.peak_per_rank`` lists each group (its name in N, its ranks, its formulas, where they
    hold); the table: one line a group; a derivation whose ranks are alike has none."""
    assert main(["derive", "mlp", "--widths", "64,127,10", "--data-parallel", "fsdp", "--set", "N=3", "--set", "B=4",
                 "--loss", "cross-entropy", "--device", "cpu", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    groups = out["expressions"]["peak_per_rank"]
    assert [(g["ranks"], g["rank_numbers"]) for g in groups] == [("ranks 0..N-2", [0, 1]), ("rank N-1", [2])]
    assert "Max(0, 10 - N*ceiling(10/N) + ceiling(10/N))" in groups[1]["peak"]  # the last rank's rows, in N
    values = out["values"]["peak_per_rank"]
    d = _derive("mlp", (("B", 4), ("N", 3)), "fsdp", widths="64,127,10")
    for g in groups:
        e = sympy.sympify(g["peak"], locals={s.name: s for s in d.free})
        assert all(d.evaluate(e) == values[str(r)]["peak"] for r in g["rank_numbers"])
    assert main(["derive", "mlp", "--widths", "64,127,10", "--data-parallel", "fsdp", "--set", "N=3", "--set", "B=4",
                 "--loss", "cross-entropy", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    assert "peak per rank as formulas (each group's largest moment at these sizes; the groups are those at N = 3)" \
        in " ".join(text.split())
    assert "  ranks 0..N-2: " in text and "  rank N-1: " in text
    assert main(["derive", "mlp", "--widths", "64,128,10", "--data-parallel", "fsdp", "--set", "N=2", "--loss",
                 "cross-entropy", "--device", "cpu", "--format", "json"]) == 0
    assert "peak_per_rank" not in json.loads(capsys.readouterr().out)["expressions"]  # every rank alike


#: A traced module's stages under an engine (tests/data/traced_block.py: a 12 -> 24 input layer, 4 blocks, a 5-row
#: head), p = 2, measured on real gloo meshes (docs/regimes.md, "Traced modules under DDP and ZeRO-1 x pipeline" and
#: "... FSDP x pipeline"; tests/test_ddp_pipeline.py and tests/test_fsdp_pipeline.py run rows of them): (engine,
#: schedule, M, the sizes measured at, other sizes each formula is derived at, {rank: (first, steady)} measured, or
#: "stored": the rows of tests/data/pipeline_meshes_gloo.json, read by :func:`_mesh_stored` -- the mesh files'
#: and tests/test_mesh_cli_ranks.py's TRACED; "stored-2x3": the 2 x 3 mesh's six ranks stored there,
#: tests/test_mesh_cli_ranks.py's WIDE).
#: Each stage's formulas are in the module's traced size B (and N under FSDP2), the blocks at their number.  Every
#: row is under ``-m deep`` (each ~5-15 CPU-s here): the pipeline meshes' spawns check the bucket view, ZeRO-1 and
#: FSDP2 1F1B rows against their live ranks in the default suite (ranks_from_other_sizes, below).
BLOCK = f"{__import__('pathlib').Path(__file__).parent / 'data' / 'traced_block.py'}:build"
TRACED = [
    pytest.param("ddp", "1f1b", 2, {"B": 4, "N": 2}, [{"B": 2}, {"B": 6}], "stored",
                 marks=pytest.mark.deep),
    pytest.param("ddp-bucket-view", "1f1b", 2, {"B": 4, "N": 2}, [{"B": 2}, {"B": 6}], "stored",
                 marks=pytest.mark.deep),
    pytest.param("zero-redundancy", "gpipe", 3, {"B": 4, "N": 2}, [{"B": 2}, {"B": 6}], "stored",
                 marks=pytest.mark.deep),
    # FSDP2: the head's 5 rows padded to 6, so rank 3 (stage 1's last data-parallel rank) holds 2 of its 3
    pytest.param("fsdp", "1f1b", 2, {"B": 4, "N": 2}, [{"N": 3}, {"N": 4, "B": 3}], "stored",
                 marks=pytest.mark.deep),
    pytest.param("fsdp-no-reshard", "gpipe", 3, {"B": 4, "N": 2}, [{"N": 3}, {"N": 4, "B": 2}], "stored",
                 marks=pytest.mark.deep),
    # a 2 x 3 mesh (the head's 6 padded rows 2 / 2 / 1), derived at N = 2 and N = 4: its stored six ranks
    # (tests/test_mesh_cli_ranks.py's WIDE, rerun by its deep test_the_2x3_mesh_against_a_fresh_gloo_run)
    pytest.param("fsdp", "1f1b", 4, {"B": 4, "N": 3}, [{"N": 2}, {"N": 4}], "stored-2x3", marks=pytest.mark.deep),
]


@functools.cache
def _traced(engine, schedule, m, values):
    from symmem.importer import sources

    loaded = sources.load(BLOCK)
    return sources.trace(loaded, sources.parse_dims("B", loaded), optimizer="adamw", loss="cross-entropy",
                         check=False, pipeline_parallel=True, pipeline_schedule=schedule, data_parallel=engine,
                         micro_batches=m, values={"p": 2, **dict(values)})


def _mesh_stored(engine, schedule, m):
    """{rank: (first, steady)} of the file module's stored real ranks on the 2 x 2 mesh under ``engine`` (the case as
    tests/test_ddp_pipeline.py's, tests/test_fsdp_pipeline.py's and tests/test_mesh_cli_ranks.py's cases give it;
    their deep tests rerun it)."""
    from stage_ranks import stored
    from test_mesh_cli_ranks import traced_case

    case = traced_case({"fsdp": True, "fsdp-no-reshard": False}.get(engine, engine), schedule, m)
    return {r.rank: (r.first_peak, r.steady_peak) for r in (rank[0] for rank in stored([case]))}


@pytest.mark.parametrize("engine, schedule, m, sizes, others, measured", TRACED,
                         ids=[f"{c[0]}-{c[1]}-M{c[2]}-N{c[3]['N']}"
                              for c in (x.values if hasattr(x, "values") else x for x in TRACED)])
def test_engines_on_traced_stages_are_formulas_from_other_sizes(engine, schedule, m, sizes, others, measured):
    """Every rank's formula (its stage's, its group's) derived at other sizes (B; N under FSDP2), at the measured
    sizes, is at most that rank's measured peak and, over the other sizes, equal to it (the same moment peaks);
    none is a line in B any more."""
    if measured == "stored":  # the pipeline meshes' stored real ranks (tests/data/pipeline_meshes_gloo.json)
        measured = _mesh_stored(engine, schedule, m)
    elif measured == "stored-2x3":  # the 2 x 3 mesh's, stored there too
        from test_mesh_cli_ranks import wide_ranks

        measured = {r.rank: (r.first_peak, r.steady_peak) for r in wide_ranks()}
    derived = [_traced(engine, schedule, m, tuple(sorted({**sizes, **other}.items()))) for other in others]
    ranks_from_other_sizes(derived, sizes, others, measured, engine == "zero-redundancy")


def ranks_from_other_sizes(derived, sizes, others, measured, zero=False):
    """Every rank's formula of each derivation of ``derived`` (made at ``sizes`` with each of ``others`` over them)
    at ``sizes``: the leading group's is rank 0's, "rank N-1" the last rank's, ZeRO-1's by number (its partition at
    its own N); each is at most the rank's ``measured`` ``{rank: (first or None, steady)}`` and, over the other
    sizes, equal to it (where the same moment peaks).  Also called by the pipeline meshes' spawns with their live
    ranks (tests/test_ddp_pipeline.py, tests/test_fsdp_pipeline.py)."""
    world = sizes["N"]
    found: dict[int, list[tuple[int, int]]] = {}
    for d, other in zip(derived, others, strict=True):
        formulas = rank_formulas(d) or []
        assert formulas and all("a line in B" not in f.held_at for f in formulas), formulas
        if not zero:
            assert all(N in f.peak.free_symbols for f in formulas if f.label.endswith("rank N-1")), formulas
        there = d.at(**{k: sizes[k] for k in other})
        n = d.numbers[N]
        for f in formulas:  # the leading group's formula is rank 0's, "rank N-1" the last rank's, at any N
            stage, name = f.ranks[0] // n, f.label.split(", ", 1)[1]
            mine = range(world) if name == "ranks 0..N-1" else [world - 1] if name == "rank N-1" else \
                [r % n for r in f.ranks] if zero else \
                [0] if f.ranks[0] % n == 0 else []  # a middle rank's number is its own N's; ZeRO-1's at its N
            for r in mine:
                found.setdefault(stage * world + r, []).append(
                    (there.evaluate(f.peak_first_step), there.evaluate(f.peak)))
    assert {0, world - 1, world, 2 * world - 1} <= set(found) <= set(measured), (found, measured)
    for rank in found:
        first, steady = measured[rank]
        assert all(s <= steady for _, s in found[rank]) and max(s for _, s in found[rank]) == steady, (rank, found)
        if first is not None:
            assert all(f <= first for f, _ in found[rank]) and max(f for f, _ in found[rank]) == first, (rank, found)
