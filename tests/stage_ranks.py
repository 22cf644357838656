"""What the pipeline-mesh tests check of every real rank (FSDP, DDP and FSDP x TP on stages), in one place."""

from __future__ import annotations

from typing import Any


def replays_are_the_ranks(d: Any, real: list[Any], label: Any) -> None:
    """Each real rank's weights and AdamW state, its first and steady peaks and the largest moments of its schedule
    and of its optimizer step equal, to the byte, the derivation's replay of that rank's stage (``label`` names the
    case in a failure)."""
    named = {s.name: int(v) for s, v in d.numbers.items()}
    for r in real:
        mine = d.step.at_rank(r.dp)._replays(named)[r.pp]
        assert (mine.at["parameters"], mine.at["optimizer_state"]) == (r.parameters, r.optimizer_state), (label, r)
        assert (mine.peak.first, mine.peak.bytes, mine.peak.pipeline, mine.peak.step) == (
            r.first_peak, r.steady_peak, r.pipeline_peak, r.step_peak), (label, r)


def sharded_side(real: list[Any]) -> dict[str, dict[str, int]]:
    """The parameter side per rank (passes/rank_side.py) of FSDP2 on a module without buffers: the real rank's
    padded shards, as many bytes of sharded gradients, AdamW's state of its rows."""
    return {str(r.rank): {"parameters": r.parameters, "gradients": r.parameters, "buckets": 0,
                          "optimizer_state": r.optimizer_state, "total": 2 * r.parameters + r.optimizer_state}
            for r in real}


def hf_stage_buffers(spec: str, config: dict[str, Any], stage: int, p: int = 2, split: str = "LlamaSplit") -> int:
    """Bytes of the buffers of a Hugging Face model's real stage module ``stage`` of ``p``, built as the gloo runs
    build it (:mod:`symmem.record.traced_pipeline_runs`: Llama's rotary frequencies are a buffer of every stage)."""
    from symmem.importer.spec_builder import SpecBuilder
    from symmem.record import traced_pipeline_runs

    full, _ = SpecBuilder(spec, tuple(sorted(config.items())))()
    module = getattr(traced_pipeline_runs, split)().stage(full, stage, p)
    return sum(b.numel() * b.element_size() for b in module.buffers())
