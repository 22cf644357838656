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
cache's copies).  With eager attention and the cache the zoo's step is HF's op by op through the attention of
every layer (after repeat_kv, the key's transpose, the scores matmul with the copies it makes, the softmax,
``attn @ v``, ``o_proj``); the reference's is HF's there with and without the cache.  (Under tensor and
sequence parallelism: ``tests/test_model_parallel.py``, ``test_hf_llama_under_the_standard_plan``.)
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from symmem import derive  # noqa: E402
from symmem.record.hf_llama import hf_llama, logits_of  # noqa: E402
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
          "backward norm.pow"),
         ({"B": 2, "S": 16, "H": 16, "h": 4, "G": 1, "L": 1, "V": 8, "F": 16}, "naive", "none", "backward norm.pow"),
         ({"B": 2, "S": 16, "H": 16, "h": 2, "G": 2, "L": 1, "V": 8, "F": 16}, "naive", "none", "backward norm.pow")]


def hf_attention(trace, layer: int) -> dict[str, int]:
    """The live bytes right after HF's eager attention ops of one layer in the steady step's forward: repeat_kv of
    the value (the reshape: a view for G = 1, a copy for 1 < G < h), the key's transpose, the scores matmul (its
    bmm, after the copies it makes), the softmax, ``attn @ v`` and ``o_proj``."""
    name = f"layers.{layer}.self_attn"  # module.model.layers.0.self_attn in HF's, layers.0.self_attn in ours
    here = [r for r in trace.records if r.step == 2 and r.phase == "forward"
            and (r.module.endswith(name) or f"{name}." in r.module)]
    attn = [r for r in here if r.module.endswith("self_attn")]
    bmm = [r for r in attn if r.op == "aten.bmm.default"]
    kt = max(i for i in range(attn.index(bmm[0])) if attn[i].op == "aten.transpose.int")  # key_states.transpose
    return {"v_repeat": attn[kt - 1].live, "k_t": attn[kt].live, "scores": bmm[0].live,
            "softmax": next(r.live for r in attn if r.op == "aten._softmax.default"), "attn_v": bmm[1].live,
            "o_proj": next(r.live for r in here if r.module.endswith("o_proj") and r.op == "aten.mm.default")}


def zoo_attention(rows, layer: int) -> dict[str, int]:
    """The same moments in derive's steady step (rows of ``timeline``: each op's live bytes after it)."""
    out = {}
    for name in ("v_repeat", "k_t", "scores", "softmax", "attn_v", "o_proj"):
        found = [sum(live.values()) for phase, op, live in rows
                 if phase == "forward" and op == f"layers.self_attn.{name}"]
        out[name] = found[layer]
    return out


def phases(trace) -> dict[str, int]:
    """The steady step's largest live bytes in each phase."""
    out: dict[str, int] = {}
    for r in trace.records:
        if r.step == 2:
            out[r.phase] = max(out.get(r.phase, 0), r.live)
    return out


#: deep since stop 42 (every line they run, the four kept run): G = h with the cache (kept without it, h = 2) and
#: G = 1 without the cache (kept with it, where the matmuls' copies stand beside the cache's)
DEEP = {"naive-G4-S16-dynamic", "naive-G1-S16-none"}


def _case_id(c: tuple) -> str:
    return f"{c[1]}-G{c[0]['G']}-S{c[0]['S']}-{c[2]}"


@pytest.mark.parametrize("values, attention, cache, where",
                         [pytest.param(*c, id=_case_id(c), marks=[pytest.mark.deep] if _case_id(c) in DEEP else [])
                          for c in CASES])
def test_llama_equals_transformers_own_on_one_device(values, attention, cache, where):
    torch.manual_seed(0)
    module, ids = hf_llama(values, attention=attention, cache=cache)
    hf = track_step(logits_of(module), ids, loss="sum", optimizer="adamw", impl="for-loop")
    d = derive("llama", values=values, attention=attention, cache=cache, device="cpu", loss="sum",
               optimizer_impl="for-loop")
    assert (d.value("peak_first_step"), d.value("peak")) == (hf.first.bytes, hf.steady.bytes)
    assert d.peak_at().where().removesuffix(", steady step") == where
    # and every phase's largest moment of the steady step (the forward's with the loss's sum, which derive counts
    # in the forward), not only the peak
    real = phases(hf)
    walked: dict[str, int] = {}
    rows = d.step.timeline("steady", dict(d.numbers))  # written out once: the phases here, the ops below
    for phase, _, live in rows:
        walked[phase] = max(walked.get(phase, 0), sum(live.values()))
    assert (walked["forward"], walked["backward"], walked["step"]) == (
        max(real["forward"], real["loss"]), real["backward"], real["step"])
    if attention == "naive":
        # and op by op through eager attention in every layer: the copies the matmuls make of the rotary query
        # (every G) and of the stride-0 repeated key and value (G = 1; without the cache also of the rotary key
        # and the projected value's view at G = h) born where HF's matmuls make them, the rotary query (without
        # the cache also the rotary key and the value's view) held until the attention returns
        for layer in range(values["L"]):
            ours, theirs = zoo_attention(rows, layer), hf_attention(hf, layer)
            if values["G"] == values["h"]:  # repeat_kv returns the cache's copy: no op of HF's to compare with
                del ours["v_repeat"], theirs["v_repeat"]
            assert ours == theirs
    # the reference mirrors HF op by op: every phase's largest moment is HF's, and eager attention's ops
    ref, inputs = reference("llama", values, attention=attention, cache=cache)
    mirrored = track_step(ref, inputs, loss="sum", optimizer="adamw", impl="for-loop")
    assert phases(mirrored) == phases(hf)
    if attention == "naive":
        assert [hf_attention(mirrored, i) for i in range(values["L"])] == [
            hf_attention(hf, i) for i in range(values["L"])]
