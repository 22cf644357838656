"""transformers' own LlamaForCausalLM (a LlamaConfig, no weights) under the standard tensor-parallel plans
(symmem.record.hf_llama) on two real gloo ranks: tests/test_model_parallel.py holds every case to
``derive("llama", tensor_parallel=True)``, :data:`LIVE` run live, the others replayed from their stored real ranks
(tests/tensor_stored.py); tests/test_traced_tensor.py holds the sequence-parallel one's stored ranks to the traced
``hf:llama``."""

from __future__ import annotations

from typing import Any

#: two ranks, grouped-query attention: SDPA (the final norm's backward), the same with sequence parallelism (the
#: forward's end: HF's position ids gone with LlamaModel.forward), eager attention at the forward's end (the
#: DynamicCache's copies held there) and on a longer sequence at the final norm's forward (eager attention's whole
#: (B, 1, S, S) mask and the cache's copies still held)
HF = [({"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 32}, {"attention": "sdpa"}),
      ({"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 32},
       {"attention": "sdpa", "sequence_parallel": True}),
      ({"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 64}, {"attention": "naive"}),
      ({"B": 2, "S": 32, "H": 16, "h": 4, "G": 2, "L": 2, "V": 8, "F": 32}, {"attention": "naive"})]
#: HF[SEQUENCE]: B = 2, S = 8, H = 32, h = 4, G = 2, L = 1, V = 64, F = 32, SDPA, sequence parallel
SEQUENCE = 1
#: HF[LIVE], run live in every suite run: the standard plan, SDPA
LIVE = 0


def job(case: int) -> tuple[dict[str, int], dict[str, Any]]:
    """HF[case]'s values and job options."""
    values, options = HF[case]
    return values, {**options, "peaks": True, "hf": True}


def hf_llama_ranks() -> list[Any]:
    """Per rank, the :class:`~symmem.record.model_parallel_runs.TensorRun` of HF[LIVE] (two real ranks)."""
    import transformers.models.llama.modeling_llama  # noqa: F401 - imported once: the forked ranks inherit it

    from symmem.record.model_parallel_runs import runs

    return [rank[0] for rank in runs(2, [("tensor", "llama", *job(LIVE))])]
