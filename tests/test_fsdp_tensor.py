"""FSDP x TP against the real 2-D engine: ``fully_shard`` over a ``parallelize_module``'d Llama on an N x t mesh.

The truth is four real processes (gloo, 127.0.0.1, bounded time) on ``init_device_mesh("cpu", (2, 2),
mesh_dim_names=("dp", "tp"))``: the standard Llama plan over ``mesh["tp"]``, ``fully_shard`` on each layer and the
root over ``mesh["dp"]``, FP32 AdamW, each rank under the DTensor- and FSDP-aware recorder
(``symmem.record.fsdp_tensor_runs``).  symmem's side is ``symmem.passes.fsdp_tensor``: formulas in N and t.
"""

from __future__ import annotations

import pytest

from symmem.errors import SymmemError

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
pytest.importorskip("torch.distributed.tensor.parallel")

#: V = 66: each tensor-parallel rank holds 33 rows of the embedding and the head, which FSDP pads to 34 and splits
#: 17 / 16 -- the data-parallel ranks' optimizer states differ (the padding row has no Adam state)
VALUES = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 2, "V": 66, "F": 64}
OPTIONS = {"attention": "sdpa"}


def test_every_rank_of_a_2x2_mesh_against_the_engine():
    """Every rank's parameters (padded 2-D shards), gradients, AdamW state (the unpadded rows) and saved
    activations equal the real run's to the byte; derive gives the regime's formulas and refuses the peak in one
    line in every view."""
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is needed")
    from symmem import derive
    from symmem.api import tensor_parallel_rank
    from symmem.passes.fsdp_tensor import PEAK_REFUSED
    from symmem.record.fsdp_tensor_runs import fsdp_tensor_runs

    real = [rank[0] for rank in fsdp_tensor_runs(2, 2, [(VALUES, OPTIONS)])]
    assert [(r.dp, r.tp) for r in real] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    numbers = {**VALUES, "N": 2, "t": 2}
    for r in real:
        want = tensor_parallel_rank("llama", values=VALUES, device="cpu", data_parallel="fsdp", rank=r.dp,
                                    **OPTIONS).at(numbers)
        got = {"saved": r.saved, "parameters": r.parameters, "gradients": r.gradients,
               "optimizer_state": r.optimizer_state}
        assert want == got, (r.rank, want, got)
    # the data-parallel rank 1 holds 16 of the 17 stored rows of the embedding and the head: 2 x 2 x 32 x 4 bytes
    # fewer of AdamW's moments
    assert real[0].optimizer_state - real[2].optimizer_state == 2 * 2 * 32 * 4
    d = derive("llama", data_parallel="fsdp", tensor_parallel=True, values=numbers, device="cpu", **OPTIONS)
    out = d.to_dict()
    assert out["values"]["peak"] is None and out["peak_refused"] == PEAK_REFUSED
    assert {"N", "t"} <= {s.name for s in d.total.free_symbols}


def test_the_mesh_ranks_cli(capsys):
    from symmem.cli import main

    sets = [a for k, v in {**VALUES, "N": 2, "t": 2}.items() for a in ("--set", f"{k}={v}")]
    assert main(["ranks", "llama", "--data-parallel", "fsdp", "--tensor-parallel", "--device", "cpu",
                 "--attention", "sdpa", *sets]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "rank 0 of an N=2 x t=2 mesh (fsdp over DTensor's standard plan): bytes"
    assert "  optimizer state by data-parallel rank: 0: 46,292, 1: 45,780" in lines
    assert lines[-1].startswith("no peak: FSDP x TP's step")


@pytest.mark.parametrize("args, message", [
    (["derive", "llama", "--data-parallel", "fsdp", "--tensor-parallel", "--sequence-parallel"],
     "symmem: error: data_parallel='fsdp' with sequence parallelism is not modelled: FSDP x TP was measured with "
     "the standard plan (no sequence parallelism); drop one of them\n"),
    (["derive", "llama", "--data-parallel", "ddp", "--tensor-parallel"],
     "symmem: error: data_parallel='ddp' with tensor or pipeline parallelism is not modelled: give one of them\n"),
])
def test_combinations_the_engine_refuses(capsys, args, message):
    from symmem.cli import main

    assert main(args) == 2
    assert capsys.readouterr().err == message


def test_rank_without_a_mesh_is_refused():
    from symmem.api import tensor_parallel_rank

    with pytest.raises(SymmemError, match="rank names a place in a data-parallel group"):
        tensor_parallel_rank("llama", values=VALUES, device="cpu", rank=1)
