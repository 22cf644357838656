"""DDP x pipeline: ``DistributedDataParallel`` around every pipeline stage of a p x N mesh, per stage and rank.

The engine (:mod:`symmem.record.ddp_pipeline_runs`): ``init_device_mesh(device, (p, N), mesh_dim_names=("pp",
"dp"))``, each stage's module (the embedding on the first stage, the final norm and the head on the last, ``L/p``
layers each) wrapped in ``DistributedDataParallel`` over ``mesh["dp"]``, then ``PipelineStage`` and
``ScheduleGPipe`` / ``Schedule1F1B`` run ``M`` micro-batches.  What torch 2.13 does
(``PipelineStage.backward_maybe_with_nosync``): every micro-batch's backward but the last runs under
``no_sync()``, so the gradients accumulate in ``.grad`` as one device's do; the last one's reducer is prepared by
hand and all-reduces each bucket in place, copying the gradients in and the result back, allocating nothing.  So a
stage's step is the pipeline's replay (:class:`~symmem.passes.model_parallel._Replay`, the single-device step cut
by stage) with DDP's gradient buckets (:func:`symmem.passes.data_parallel.buckets`: the stage's gradients' bytes,
made when the stage is wrapped) alive the whole step -- measured to the byte on every rank of a 2 x 2 gloo mesh,
1F1B and GPipe (``tests/test_ddp_pipeline.py``).  The second step's rebuild of the buckets frees the old ones
before it makes the new (as DDP alone).  Every data-parallel rank of a stage holds the same bytes: rank ``s*N + r``
is stage ``s``'s.

``gradient_as_bucket_view=True`` (``ddp-bucket-view``) stays refused: tried on stages, its steady peaks fit this
rule with the gradients as the buckets' views, its first step's did not (docs/regimes.md).

>>> from symmem import derive
>>> d = derive("llama", data_parallel="ddp", pipeline_parallel=True, pipeline_schedule="gpipe", micro_batches=2,
...            loss="cross-entropy", attention="sdpa", device="cpu",
...            values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 63, "F": 64, "p": 2, "N": 2})
>>> d.value("peak"), d.value("peak_first_step")  # the engine's, tests/test_ddp_pipeline.py
(398428, 307760)
>>> d.peak_at().where(step=False)
'rank 2 (stage 1 of 2, data-parallel rank 0 of N = 2): pipeline layers.mlp.gate_up (layer 2), micro-batch 0'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError
from ..training import Regime
from .pipeline_step import PipelineStep


def refusal(model_name: str, regime: Regime, device: str) -> str | None:
    """Why the DDP x pipeline peak is not modelled for this derivation (None: it is): what was measured."""
    if device != "cpu":
        return "the DDP x pipeline peak is measured on CPU ranks (gloo)"
    if regime.precision != "fp32" or regime.optimizer not in ("adam", "adamw") or regime.optimizer_impl not in (
            "auto", "for-loop"):
        return "the DDP x pipeline peak is modelled for FP32 Adam/AdamW's for-loop step, as measured"
    if model_name not in ("gpt2", "llama"):
        return f"the DDP x pipeline peak is measured for the gpt2 and llama references, not {model_name!r}"
    return None


@dataclass(eq=False)
class DdpPipelineStep(PipelineStep):
    """:class:`~symmem.passes.pipeline_step.PipelineStep` with DDP on every stage (the module's note): each stage's
    replay with its gradient buckets alive from before the step to its end."""

    def _make_replays(self, numbers: Mapping[str, int]) -> list[Any]:
        from .model_parallel import _Cut, _Replay, requires

        requires(numbers.get("p"), numbers.get("L"), self.schedule, self.micro_batches)
        world = numbers.get("N")
        if not isinstance(world, int) or world < 1:
            raise SymmemError(f"DDP x pipeline needs N >= 1 data-parallel ranks a stage, got N={world}")
        cut = _Cut(self.graph, self.conv, self.options, self.regime, numbers)
        found = self._stages()
        out = []
        for s in range(cut.p):
            memory = found[0] if s == 0 else found[-1] if s == cut.p - 1 else found[1]
            at = dict(memory.at(numbers))
            # DDP's buckets: every trainable parameter's gradient once, in FP32 the stage's gradients' bytes
            at["ddp_buckets"] = at["gradients"]
            at["at_rest"] += at["ddp_buckets"]
            at["step_peak"] += at["ddp_buckets"]
            out.append(_Replay(cut, s, at, self.schedule, self.micro_batches))
        return out

    def _peak(self, named: dict[str, int]) -> Any:
        from ..peak import Peak
        from .fsdp_pipeline import MeshStageMoment

        found = super()._peak(named)
        world = int(named["N"])
        moments = tuple(MeshStageMoment(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)}, world=world)
                        for m in found.moments)
        return Peak(None, None, moments, found.domain)

    def rank_peaks(self, derivation: Any) -> dict[int, tuple[int, int]] | None:
        """``{rank: (first-step peak, steady peak)}`` of every rank of the p x N mesh (rank ``s*N + r``: stage
        ``s``; DDP replicates, so a stage's ranks are alike); None where every rank is alike."""
        from ..symbols import N

        numbers = derivation.numbers
        world = int(numbers[N])
        each = self.per_stage(numbers)
        out = {s * world + r: (first, steady)
               for s, (first, steady) in enumerate(zip(each["peak_first_step_per_stage"], each["peak_per_stage"],
                                                       strict=True))
               for r in range(world)}
        return out if len(set(out.values())) > 1 else None
