"""FSDP x TP against the real 2-D engine: ``fully_shard`` over a ``parallelize_module``'d Llama on an N x t mesh.

The truth is four real processes (gloo, 127.0.0.1, bounded time) on ``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("dp", "tp"))``: the standard Llama plan over ``mesh["tp"]``, ``fully_shard`` on each layer and the
root over ``mesh["dp"]``, FP32 AdamW, the loss ``sum``, each rank under the DTensor- and FSDP-aware recorder
(``symmem.record.fsdp_tensor_runs``: each moment's fewest bytes over repeated steps).  symmem's side is
``symmem.passes.fsdp_tensor``: formulas in N, t and the model's sizes.
"""

from __future__ import annotations

import pytest

from symmem.errors import SymmemError

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.tensor.parallel")

#: V = 66: each tensor-parallel rank holds 33 rows of the embedding and the head, which FSDP pads to 34 and splits
#: 17 / 16 -- the data-parallel ranks' optimizer states and steady peaks differ (the padding row has no Adam state)
VALUES = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 2, "V": 66, "F": 64}
#: (engine, sizes, options, where rank 0's steady peak is): FSDP2 resharding after forward, SDPA -- the last
#: layer's MLP backward (a column-parallel input gradient's all-reduce); without resharding, eager attention over
#: three layers -- the head's all-gather at the forward's end (every unit's unsharded parameters, the mask)
#: With sequence parallelism (torchtitan's plan, ``--sequence-parallel``): FSDP2 resharding, SDPA -- the last layer's
#: down projection's backward (its output gradient all-gathered over S); without resharding, eager attention, V = 18
#: (9 rows a tensor-parallel rank, padded to 10, split 5 / 4) -- the head's forward, where its input's all-gather
#: (B x S x H, larger than the logits here) comes before the logits' and is not held beside them
SEQUENCE = [("fsdp", VALUES, {"attention": "sdpa", "sequence_parallel": True},
             "backward layers.mlp.down_proj (layer 2)"),
            ("fsdp-no-reshard", {**VALUES, "V": 18}, {"attention": "naive", "sequence_parallel": True},
             "forward lm_head")]
#: At B = 1, eager attention with one key/value head a tensor-parallel rank (G = t < h) keeps the cache's key and
#: value, not the repeated copies (bmm folds the batch of 1 with the stride-0 repeat): the saved activations, with
#: and without sequence parallelism
BATCH_OF_ONE = [("fsdp", {**VALUES, "B": 1, "L": 1, "V": 18}, {"attention": "naive", "sequence_parallel": True},
                 "forward layers.mlp.down_proj (layer 1)"),
                ("fsdp-no-reshard", {**VALUES, "B": 1, "L": 1, "V": 18}, {"attention": "naive"}, "forward lm_head")]
#: FSDP1 (``FullyShardedDataParallel(device_mesh=mesh["dp"], use_orig_params=True)``, PyTorch's original 2-D
#: recipe): FULL_SHARD with F = 128 -- each layer's flat shard is 3,872 elements, rank 0's holds q, k, v, o, gate and
#: part of up, rank 1's the rest of up, down and the two norms: AdamW has 2 parameters (2 steps) fewer a layer on
#: data-parallel rank 1 -- and V = 2,048, B = 1: the peak at the backward's end, the root's flat gradient
#: concatenated beside the embedding's and the head's gradients (the embedding's whole V x H gradient let go once
#: its rows are cloned); SHARD_GRAD_OP over three layers with sequence parallelism, B = 3: every unit's flat
#: parameter unsharded at the head's forward
SHARD1 = [("fsdp1", {**VALUES, "B": 1, "F": 128, "V": 2048}, {"attention": "sdpa"},
           "backward the root's post-backward"),
          ("fsdp1-grad-op", {**VALUES, "B": 3, "L": 3}, {"attention": "sdpa", "sequence_parallel": True},
           "forward lm_head")]
#: each FSDP1 engine's ShardingStrategy (symmem.record.fsdp1_runs.STRATEGIES)
STRATEGY = {"fsdp1": "FULL_SHARD", "fsdp1-grad-op": "SHARD_GRAD_OP"}
CASES = [("fsdp", VALUES, {"attention": "sdpa"}, "backward layers.mlp.up_proj (layer 2)"),
         ("fsdp-no-reshard", {**VALUES, "L": 3}, {"attention": "naive"}, "forward lm_head"), SEQUENCE[0],
         BATCH_OF_ONE[0], *SHARD1]
#: ``-m deep`` (docs/testing.md): FSDP2 without resharding under sequence parallelism, and at B = 1 without it --
#: fsdp-no-reshard is CASES[1], FSDP2 x SP SEQUENCE[0], B = 1 on the mesh BATCH_OF_ONE[0] (with SP) and tensor
#: parallelism alone at B = 1 without SP tests/test_model_parallel.py's BATCH_OF_ONE
DEEP_CASES = [SEQUENCE[1], BATCH_OF_ONE[1]]
#: Run live in every suite run (one spawn of four ranks, with the traced file module's FSDP2 without resharding):
#: FSDP1's SHARD_GRAD_OP under sequence parallelism (FSDP1 x TP and FSDP x SP in one job); each also held to its
#: stored row (tests/tensor_stored.py).  FSDP2 x TP runs live in the same spawn (the traced module, without
#: resharding) and on the 3-D mesh (tests/test_fsdp_tensor_pipeline.py: the built-in Llama, resharding).  The other
#: CASES are REPLAYED: derive against their stored real ranks in the same checks, FSDP2 resharding under SP
#: (SEQUENCE[0]) and FSDP1's FULL_SHARD (SHARD1[0]) -- live to stop 38 -- in every view too; ``-m deep`` measures
#: every stored case anew (each live case costs its four ranks ~1 CPU-s each)
LIVE = [SHARD1[1]]
REPLAYED = [case for case in CASES if case not in LIVE]
#: replayed cases checked under ``-m deep`` only (test_more_ranks_of_a_2x2_mesh_against_the_engine; docs/testing.md,
#: "Stop 42: gloo42"): FSDP2 with and without resharding, no sequence parallelism -- each runs no line the kept cases
#: do not (FSDP2 resharding under SP replayed, FSDP2 x TP live on the 3-D mesh; without resharding the traced
#: module's, live here)
DEEP_REPLAYED = CASES[:2]
#: the replayed cases checked in every view too (the JSON, the table): the ranks differ in both (FSDP2's padded
#: rows, FSDP1's flat shards), which the live case's do not
VIEWED = [SEQUENCE[0], SHARD1[0]]


#: A traced module under FSDP2 x TP (symmem.importer.traced_fsdp_tensor), the real 2-D recipe given the module:
#: tests/data/traced_tp.py's file module under its own tp_plan (B = 4, two blocks, F = 66), FSDP2 without resharding --
#: each rank's up projection holds 33 rows, padded to 34 and split 17 / 16, so the data-parallel rank 1 holds 16 rows
#: fewer of AdamW's moments (2 x 16 x (24 + 1) x 4 bytes a block, 2 blocks: 400 bytes less at its steady peak).
#: HF Llama (traced from a config, TP and SP, fsdp and fsdp-no-reshard) was checked the same way by hand
#: (docs/regimes.md): its real ranks cost ~15 s of CPU, over this suite's budget.


def _file_module(f: int):
    """The file module of tests/data/traced_tp.py (B = 4, two blocks, width ``f``) and its inputs."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("traced_tp", Path(__file__).parent / "data" / "traced_tp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.build(4, 2, f)


def _file_job() -> dict:
    """The file module's real run: parallelize_module with its own plan, fully_shard on each block and the root."""
    from symmem.importer.tensor_plan import plan_of

    def given():
        module, inputs = _file_module(66)
        return module, inputs, plan_of(module, False).make, module.blocks

    return {"module": given, "reshard_after_forward": False}


def _job(engine: str, options: dict) -> dict:
    """The run's options for ``engine``: FSDP2's ``reshard_after_forward``, or FSDP1's strategy."""
    if engine in STRATEGY:
        return {**options, "fsdp1": STRATEGY[engine]}
    return {**options, "reshard_after_forward": engine == "fsdp"}


def test_every_rank_of_a_2x2_mesh_against_the_engine():
    """Every rank's parameters (padded 2-D shards), gradients, AdamW state (the unpadded rows), saved activations
    and first and steady step peaks equal the real run's to the byte, with and without sequence parallelism (one
    spawn of four ranks runs every case, FSDP2 and FSDP1); every view gives the largest rank's peak, where it is,
    and every rank's."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.record.fsdp_tensor_runs import fsdp_tensor_runs
    from tests.tensor_stored import differences, stored

    jobs = [(values, _job(engine, options)) for engine, values, options, _ in LIVE]
    everything = fsdp_tensor_runs(2, 2, [*jobs, ({}, _file_job())])
    _traced_against([rank[len(LIVE)] for rank in everything])
    for case, (engine, values, options, _) in enumerate(LIVE):  # the live ranks are the stored ones, to the byte
        assert differences("mesh", f"2x2 {engine}", values, options, [rank[case] for rank in everything]) == []
    _against_the_engine(LIVE, everything, views=True)
    for cases, views in (([c for c in REPLAYED if c not in VIEWED and c not in DEEP_REPLAYED], False), (VIEWED, True)):
        replayed = [stored("mesh", f"2x2 {engine}", values, options) for engine, values, options, _ in cases]
        _against_the_engine(cases, [list(rank) for rank in zip(*replayed, strict=True)], views=views)


@pytest.mark.deep
def test_more_ranks_of_a_2x2_mesh_against_the_engine():
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem.record.fsdp_tensor_runs import fsdp_tensor_runs
    from tests.tensor_stored import differences

    cases = [*REPLAYED, *DEEP_CASES]  # every stored case not run live, measured anew
    everything = fsdp_tensor_runs(2, 2, [(values, _job(engine, options)) for engine, values, options, _ in cases])
    _against_the_engine(cases, everything, views=True)
    for case, (engine, values, options, _) in enumerate(cases):
        assert differences("mesh", f"2x2 {engine}", values, options, [rank[case] for rank in everything]) == []


def _against_the_engine(cases: list, everything: list, views: bool = False) -> None:
    """Each case's four real ranks (``everything``: per rank, one run a case) against derive: its values per rank
    (the parameter side, the peaks, where), and with ``views`` in the JSON and the table too (the live cases: the
    views print every formula, most of a derive's CPU, and show the same values)."""
    from symmem import derive
    from symmem.api import tensor_parallel_rank
    from symmem.passes.data_parallel import rank_peaks
    from symmem.passes.rank_side import parameter_side_per_rank
    from symmem.reference.sequence_models import reference

    for case, (engine, values, options, where) in enumerate(cases):
        real = [rank[case] for rank in everything]
        assert [(r.dp, r.tp) for r in real] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert [r.late for r in real] == [()] * 4, engine  # every recorded free on the recording thread
        numbers = {**values, "N": 2, "t": 2}
        parts = {dp: tensor_parallel_rank("llama", values=values, device="cpu", data_parallel=engine, rank=dp,
                                          **options).at(numbers) for dp in (0, 1)}
        for r in real:
            want = parts[r.dp]
            got = {"saved": r.saved, "parameters": r.parameters, "gradients": r.gradients,
                   "optimizer_state": r.optimizer_state}
            assert want == got, (engine, r.rank, want, got)
        # FSDP2: the data-parallel rank 1 holds 16 of the 17 stored rows of the embedding and the head: 2 x 2 x H x 4
        # bytes fewer of AdamW's moments, and as much less at its peak; FSDP1 (F = 128, see SHARD1): 2 step scalars
        # fewer a layer; SHARD_GRAD_OP's case: every rank alike
        fewer = {"fsdp1": 2 * 2 * 4, "fsdp1-grad-op": 0}.get(engine, 2 * 2 * 32 * 4)
        assert real[0].optimizer_state - real[2].optimizer_state == fewer, engine
        d = derive("llama", data_parallel=engine, tensor_parallel=True, values=numbers, device="cpu", **options)
        assert (d.value("peak"), d.value("peak_first_step")) == (real[0].steady_peak, real[0].first_peak), (
            engine, options)
        # the parameter side per rank (passes/rank_side.py): the real rank's shards, gradients and AdamW state, and
        # the real module's buffers (whole on every rank: the rotary frequencies), no DDP buckets
        module, _ = reference("llama", values, **{k: v for k, v in options.items() if k != "sequence_parallel"})
        buffers = sum(b.numel() * b.element_size() for b in module.buffers())
        side = {r.rank: {"parameters": r.parameters + buffers, "gradients": r.gradients, "buckets": 0,
                         "optimizer_state": r.optimizer_state,
                         "total": r.parameters + buffers + r.gradients + r.optimizer_state} for r in real}
        assert buffers > 0 and parameter_side_per_rank(d) == side, (engine, options)
        each = {r.rank: (r.first_peak, r.steady_peak) for r in real}
        if fewer:
            assert rank_peaks(d) == each, (engine, options)
        else:  # every rank alike: no per-rank values
            assert not rank_peaks(d) and len(set(each.values())) == 1, engine
        assert getattr(d.peak_at(), "rank", 0) == 0, engine
        assert d.peak_at().where(step=False) == f"rank 0 of N x t = 2 x 2: {where}"
        assert {"B", "S", "N", "t"} <= {s.name for s in d.peak.free_symbols}
        if not views:
            continue
        out = d.to_dict()  # the same values in the JSON and the table
        assert out["values"]["parameter_side_per_rank"] == {str(r): v for r, v in side.items()}, (engine, options)
        text = str(d)  # the table, made once for both of its lines below
        assert "parameter side per rank" in text, engine
        if fewer:
            assert out["values"]["peak_per_rank"] == {str(r): {"peak": s, "peak_first_step": f}
                                                      for r, (f, s) in each.items()}, (engine, options)
        else:
            assert "peak_per_rank" not in out["values"], engine
        assert out["peak_at"]["rank"] == 0
        assert ("peak per rank (first step / steady): ranks 0-1: " in text) == bool(fewer), engine


def _traced_against(file: list) -> None:
    """A traced module under FSDP2 x TP (``trace(..., data_parallel="fsdp-no-reshard", tensor_parallel=True)``)
    against the real ranks of the same spawn, to the byte: every rank's first and steady peak, the largest named,
    the activations it keeps after the forward."""
    from symmem import trace
    from symmem.passes.data_parallel import rank_peaks
    from symmem.passes.rank_side import parameter_side_per_rank

    module, inputs = _file_module(66)
    d = trace(module, inputs, {"B": [(0, 0)]}, optimizer="adamw", loss="sum", check=False, tensor_parallel=True,
              data_parallel="fsdp-no-reshard", values={"t": 2, "N": 2})
    each = {r.rank: (r.first_peak, r.steady_peak) for r in file}
    assert [r.late for r in file] == [()] * 4  # every recorded free on the recording thread
    assert rank_peaks(d) == d.step.ranks(d.numbers) == each  # what every view shows: the ranks differ
    assert (d.value("peak_first_step"), d.value("peak")) == each[0] and d.peak_at().where() == (
        "forward fsdp.all_gather_done in blocks.# (layer 2), steady step")
    assert {d.value("activations")} == {r.saved for r in file}
    assert [file[0].optimizer_state - file[2].optimizer_state, each[0][1] - each[2][1]] == [400, 400]
    assert each[0] == (38_656, 54_080)
    # the parameter side per rank (passes/rank_side.py), read off each data-parallel rank's own step: the real
    # rank's padded shards, their gradients and AdamW's state of its rows (the module has no buffers)
    side = {r.rank: {"parameters": r.parameters, "gradients": r.gradients, "buckets": 0,
                     "optimizer_state": r.optimizer_state,
                     "total": r.parameters + r.gradients + r.optimizer_state} for r in file}
    # (what the JSON's values.parameter_side_per_rank shows; its other views would fold the step in L, recording
    # it at 4, 5 and 6 layers on fake DTensors: ~8 CPU-s this check does not need)
    assert parameter_side_per_rank(d) == side


def test_the_mesh_ranks_cli(capsys):
    from symmem.cli import main

    sets = [a for k, v in {**VALUES, "N": 2, "t": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["ranks", "llama", "--data-parallel", "fsdp", "--tensor-parallel", "--device", "cpu",
                 "--attention", "sdpa", *sets]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rank 0 of an N=2 x t=2 mesh (fsdp over DTensor's standard plan): bytes"
    assert "  optimizer state by data-parallel rank: 0: 46,292, 1: 45,780" in lines
    # the peak the test above checks against the engine
    assert lines[-1] == ("peak per rank: 182,588 bytes at rank 0 of N x t = 2 x 2: backward layers.mlp.up_proj "
                         "(layer 2); first step 136,296")
    # with sequence parallelism: the peak and saved bytes the test above checks against the engine (SEQUENCE[0])
    assert main(["ranks", "llama", "--data-parallel", "fsdp", "--tensor-parallel", "--sequence-parallel",
                 "--device", "cpu", "--attention", "sdpa", *sets]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rank 0 of an N=2 x t=2 mesh (fsdp over DTensor's sequence-parallel plan): bytes"
    assert lines[1].split() == ["saved", "48,032"]
    assert lines[-1] == ("peak per rank: 174,268 bytes at rank 0 of N x t = 2 x 2: backward layers.mlp.down_proj "
                         "(layer 2); first step 127,976")
    # FSDP1: the optimizer state of each data-parallel rank and the peak the test above checks against the engine
    # (SHARD1[0])
    sets = [a for k, v in {**SHARD1[0][1], "N": 2, "t": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["ranks", "llama", "--data-parallel", "fsdp1", "--tensor-parallel", "--device", "cpu",
                 "--attention", "sdpa", *sets]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rank 0 of an N=2 x t=2 mesh (fsdp1 over DTensor's standard plan): bytes"
    assert lines[-2:] == ["  optimizer state by data-parallel rank: 0: 324,280, 1: 324,264",
                          "peak per rank: 1,304,288 bytes at rank 0 of N x t = 2 x 2: backward the root's "
                          "post-backward; first step 980,008"]


@pytest.mark.parametrize("engine, sequence", [
    ("fsdp", False),
    # ``-m deep`` since stop 42: its lines are the two others' (FSDP2, sequence parallelism under FSDP1)
    pytest.param("fsdp", True, marks=pytest.mark.deep),
    ("fsdp1-grad-op", True)])
def test_fit_under_fsdp_x_tp(engine, sequence):
    """``fit``: the largest B whose largest rank's peak fits, the step walked anew at that B and at B + 1 (fresh
    derives) on each side of the budget, with and without sequence parallelism, FSDP2 and FSDP1."""
    from symmem import derive
    from symmem.apps.budget import largest

    values = {**VALUES, "N": 2, "t": 2}
    kw = {"data_parallel": engine, "tensor_parallel": True, "sequence_parallel": sequence, "device": "cpu",
          "attention": "sdpa"}
    d = derive("llama", values=values, **kw)
    budget = 2**20
    fit = largest(d, "B", budget)
    at = [derive("llama", values={**values, "B": b}, **kw).value("peak") for b in (fit.max, fit.max + 1)]
    assert at[0] <= budget < at[1] and (fit.total_at_max, fit.total_above) == tuple(at)


@pytest.mark.parametrize("engine", ["fsdp", "fsdp1"])
def test_the_peak_refuses_what_was_not_measured(engine):
    from symmem import derive

    values = {**VALUES, "N": 2, "t": 2}
    for kwargs, why in [({"device": "cuda"}, "no peak: the FSDP x TP peak is measured on CPU ranks (gloo)"),
                        ({"device": "cpu", "loss": "cross-entropy"},
                         "no peak: the FSDP x TP peak is modelled for the loss 'sum'")]:
        out = derive("llama", data_parallel=engine, tensor_parallel=True, values=values, **kwargs).to_dict()
        assert out["values"]["peak"] is None and out["peak_refused"].startswith(why), kwargs


@pytest.mark.parametrize("args, message", [
    (["derive", "llama", "--data-parallel", "ddp", "--tensor-parallel", "--sequence-parallel"],
     "symmem: error: data_parallel='ddp' with tensor parallelism is not modelled: PyTorch composes DDP with DTensor "
     "parameters only through the private torch.distributed.tensor.parallel.ddp._pre_dp_module_transform, which was "
     "not measured; FSDP on an N x t mesh is (fsdp, fsdp-no-reshard, fsdp1 or fsdp1-grad-op)\n"),
    (["derive", "llama", "--data-parallel", "ddp", "--tensor-parallel"],
     "symmem: error: data_parallel='ddp' with tensor parallelism is not modelled: PyTorch composes DDP with DTensor "
     "parameters only through the private torch.distributed.tensor.parallel.ddp._pre_dp_module_transform, which was "
     "not measured; FSDP on an N x t mesh is (fsdp, fsdp-no-reshard, fsdp1 or fsdp1-grad-op)\n"),
    (["derive", "llama", "--data-parallel", "fsdp1", "--tensor-parallel", "--pipeline-parallel"],
     "symmem: error: data_parallel='fsdp1' with tensor and pipeline parallelism (a 3-D mesh) is not modelled: FSDP2 "
     "on torchtitan's p x N x t mesh is (fsdp, fsdp-no-reshard)\n"),
])
def test_combinations_the_engine_refuses(capsys, args, message):
    from symmem.cli import main

    assert main(args) == 2
    assert capsys.readouterr().err == message


def test_rank_without_a_mesh_is_refused():
    from symmem.api import tensor_parallel_rank

    with pytest.raises(SymmemError, match="rank names a place in a data-parallel group"):
        tensor_parallel_rank("llama", values=VALUES, device="cpu", rank=1)
    with pytest.raises(SymmemError, match=r"rank 2 is no place in a data-parallel group of N=2 \(0 to 1\)"):
        tensor_parallel_rank("llama", values={**VALUES, "N": 2}, device="cpu", data_parallel="fsdp", rank=2)
