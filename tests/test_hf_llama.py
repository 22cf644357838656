"""The zoo's Llama and the project's reference against transformers' own ``LlamaForCausalLM`` on one device.

Third-party truth: transformers 5.23's model built from a small ``LlamaConfig`` (no weights; ``symmem.record.hf_llama``)
trained for two steps under the live-bytes tracker (``symmem.record.steps.track_step``: FP32 for-loop AdamW, the
logits' sum).  HF's forward holds what the zoo's Llama now holds: the position ids and eager attention's whole
(B, 1, S, S) ``torch.where`` mask until ``LlamaModel.forward`` returns (after the final norm, before ``lm_head``),
the ``DynamicCache``'s key and value copies until ``LlamaForCausalLM.forward`` returns, RMSNorm's ``variance``
until the norm returns.  The first case peaks where those storages decide it, in the final norm's forward (eager
attention, a long sequence: the mask and the cache), and without the cache (``cache="none"``: HF's
``use_cache=False``) in the softmax's backward; the others check every phase with one key/value head (the matmuls
copy the stride-0 repeated views, the cache's copies held beside them) and with G = h (the matmuls keep the
cache's copies).  (Under tensor and sequence parallelism: ``tests/test_model_parallel.py``,
``test_hf_llama_under_the_standard_plan``.)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from symmem import derive  # noqa: E402
from symmem.record.hf_llama import hf_llama  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402
from symmem.reference.sequence_models import reference  # noqa: E402

#: (values, attention, cache, where derive's steady peak is); ``cache`` ``none`` is HF's ``use_cache=False``
CASES = [({"B": 2, "S": 32, "H": 16, "h": 4, "G": 2, "L": 2, "V": 8, "F": 32}, "naive", "dynamic",
          "forward norm.scale"),
         ({"B": 2, "S": 32, "H": 16, "h": 4, "G": 2, "L": 2, "V": 8, "F": 32}, "naive", "none",
          "backward layers.self_attn.softmax (layer 2)"),
         ({"B": 3, "S": 16, "H": 32, "h": 4, "G": 1, "L": 2, "V": 64, "F": 32}, "naive", "dynamic",
          "backward norm.pow"),
         ({"B": 2, "S": 16, "H": 32, "h": 4, "G": 4, "L": 1, "V": 64, "F": 32}, "naive", "dynamic",
          "backward norm.pow")]


class Logits(torch.nn.Module):
    """HF's model returning its logits: the output object (and the cache it holds) let go as the forward returns."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(ids).logits


def phases(trace) -> dict[str, int]:
    """The steady step's largest live bytes in each phase."""
    out: dict[str, int] = {}
    for r in trace.records:
        if r.step == 2:
            out[r.phase] = max(out.get(r.phase, 0), r.live)
    return out


@pytest.mark.parametrize("values, attention, cache, where", CASES,
                         ids=[f"{c[1]}-G{c[0]['G']}-S{c[0]['S']}-{c[2]}" for c in CASES])
def test_llama_equals_transformers_own_on_one_device(values, attention, cache, where):
    torch.manual_seed(0)
    module, ids = hf_llama(values, attention=attention, cache=cache)
    hf = track_step(Logits(module), ids, loss="sum", optimizer="adamw", impl="for-loop")
    d = derive("llama", values=values, attention=attention, cache=cache, device="cpu", loss="sum",
               optimizer_impl="for-loop")
    assert (d.value("peak_first_step"), d.value("peak")) == (hf.first.bytes, hf.steady.bytes)
    assert d.peak_at().where().removesuffix(", steady step") == where
    # and every phase's largest moment of the steady step (the forward's with the loss's sum, which derive counts
    # in the forward), not only the peak
    real = phases(hf)
    walked: dict[str, int] = {}
    for phase, _, live in d.step.timeline("steady", dict(d.numbers)):
        walked[phase] = max(walked.get(phase, 0), sum(live.values()))
    assert (walked["forward"], walked["backward"], walked["step"]) == (
        max(real["forward"], real["loss"]), real["backward"], real["step"])
    # the reference mirrors HF op by op: every phase's largest moment is HF's
    ref, inputs = reference("llama", values, attention=attention, cache=cache)
    assert phases(track_step(ref, inputs, loss="sum", optimizer="adamw", impl="for-loop")) == phases(hf)
