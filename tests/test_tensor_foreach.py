"""Why the tensor-parallel peak names foreach AdamW as refused by PyTorch itself on the standard plan.

Oracle: PyTorch.  Under DTensor's standard Llama plan the norms stay plain tensors beside DTensor weights, and
``torch.optim.AdamW(foreach=True)`` (CUDA's default) raises on the mix; under the sequence-parallel plan every
parameter is a DTensor and it steps.  Run on PyTorch's fake process group (two ranks' shapes, one process).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torch.distributed.tensor.parallel")

VALUES = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 64}


def _step(plan_of):
    from torch.distributed.tensor.parallel import parallelize_module

    from symmem.record.fake_group import fake_group
    from symmem.record.optim import make_optimizer
    from symmem.reference.sequence_models import reference

    module, (ids,) = reference("llama", VALUES, attention="naive")
    with fake_group(2) as mesh:
        parallelize_module(module, mesh, plan_of(module, 2))
        module(ids).sum().backward()
        make_optimizer(list(module.parameters()), "adamw", "foreach").step()


def test_foreach_adamw_refused_by_pytorch_on_the_standard_plan():
    from symmem import derive
    from symmem.record.model_parallel_runs import llama_plan, llama_sequence_plan

    with pytest.raises(RuntimeError, match="got mixed torch.Tensor and DTensor"):
        _step(llama_plan)
    _step(llama_sequence_plan)  # every parameter a DTensor: it steps
    # CUDA's default AdamW is foreach
    why = derive("llama", tensor_parallel=True, device="cuda", values={**VALUES, "t": 2}).to_dict()["peak_refused"]
    assert "torch.optim's foreach AdamW itself raises on this plan" in why
    why = derive("llama", tensor_parallel=True, sequence_parallel=True, device="cuda",
                 values={**VALUES, "t": 2}).to_dict()["peak_refused"]
    assert "itself raises" not in why and "with the for-loop AdamW" in why
