"""FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` (torchtitan's default):
the per-rank peak under ``fsdp`` / ``fsdp-no-reshard`` with ``param_dtype="bfloat16"``, against real gloo runs.

The truth: ``fully_shard(..., mp_policy=...)`` on every layer and the root of the GPT-2 and Llama references, two CPU
ranks, the live-bytes recorder inside each (symmem.record.sharded); gloo all-gathers bf16 and reduce-scatters fp32 on
the CPU.  Those runs ride in tests/test_data_parallel.py's FSDP2 spawn (:func:`mixed_jobs`, :func:`check_mixed`):
each rank's first and steady peak, from the formula in ``N`` derived at the default N = 8 and evaluated at N = 2,
equals the measured bytes, and so does each rank's parameter side (FP32 shards, FP32 sharded gradients, AdamW).
The rest here is cheap: the options, their one-line refusals, the views.
"""

from __future__ import annotations

import pytest

from symmem import derive
from symmem.cli import main
from symmem.errors import SymmemError
from symmem.training import Regime

TINY = {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100, "B": 2}
#: (model, engine, loss): Llama without resharding under the loss ``sum`` peaks in the forward at the final norm,
#: where what HF's callers hold (inputs_embeds, each layer's input, RMSNorm's FP32 hidden_states) decides it, the
#: sum a bf16 scalar; GPT-2 resharding under cross-entropy peaks in the backward, where the bf16 unsharded
#: gradients, the bf16 all-gathers and the fp32 reduce-scatter input decide it
CASES = (("llama", "fsdp-no-reshard", "sum"), ("gpt2", "fsdp", "cross-entropy"))
#: reduce_dtype=bfloat16 (FSDP2 then reduce-scatters the bf16 gradients and casts the bf16 output to FP32): Llama
#: resharding under cross-entropy peaks at a reduce-scatter, 15,616 bytes below reduce_dtype=float32's; run once
BF16_REDUCE = ("llama", "fsdp", "cross-entropy")


def _derive(model, engine, loss, values=None, **kw):
    sizes = {**TINY, "G": 2, "F": 128} if model == "llama" else dict(TINY)
    options = {"attention": "sdpa"} if model == "llama" else {"attention": "sdpa", "dropout": 0.0}
    return derive(model, convention="pytorch", device="cpu", optimizer="adamw", values={**sizes, **(values or {})},
                  data_parallel=engine, loss=loss, param_dtype="bfloat16", **options, **kw)


def mixed_jobs():
    """The gloo jobs (each run once by the spawn: its collectives release on the recording thread)."""
    from symmem.record.distributed import job_of

    return [job_of(_derive(*case, values={"N": 2})) for case in CASES]


def bf16_reduce_job():
    """The reduce_dtype=bfloat16 job (run once)."""
    from symmem.record.distributed import job_of

    return job_of(_derive(*BF16_REDUCE, values={"N": 2}, reduce_dtype="bfloat16"))


def check_bf16_reduce(ranks):
    """What differs between the derived steady peak under reduce_dtype=bfloat16 and the measured ``ranks``."""
    d = _derive(*BF16_REDUCE, reduce_dtype="bfloat16").at(N=2)
    fp32_reduce = _derive(*BF16_REDUCE).at(N=2).value("peak")
    wrong = [f"bf16 reduce rank {r.rank}: derived {d.value('peak')}, measured {min(r.per_step[1:])} ({r.per_step})"
             for r in ranks if min(r.per_step[1:]) != d.value("peak")]
    if fp32_reduce - d.value("peak") != 15616:  # the case tells the two reduce dtypes apart
        wrong.append(f"bf16 reduce: {d.value('peak')}, float32 reduce: {fp32_reduce}")
    return wrong


def check_mixed(runs):
    """What differs between the derived per-rank peaks and parameter sides and the measured ``runs`` (one run of
    :func:`mixed_jobs`): empty when every rank is exact (the parameter side where backward ends: weights, every
    ``.grad``, AdamW's state)."""
    from symmem.record.distributed import compare_parameter_side

    wrong = []
    for case, ranks in zip(CASES, runs, strict=True):
        at_two = _derive(*case).at(N=2)  # derived at N = 8: its formulas in N, evaluated at the run's N = 2
        want = (at_two.value("peak_first_step"), at_two.value("peak"))
        for r in ranks:
            got = (r.first, min(r.per_step[1:]))
            if got != want:
                wrong.append(f"{case} rank {r.rank}: derived {want}, measured {got} ({r.per_step})")
        wrong += [f"{case} {w}" for w in compare_parameter_side(at_two, ranks)]
    return wrong


@pytest.mark.parametrize("kw, message", [
    ({"param_dtype": "bfloat16"}, "param_dtype='bfloat16' is FSDP2's MixedPrecisionPolicy: give data_parallel='fsdp'"),
    ({"param_dtype": "bfloat16", "data_parallel": "fsdp1"}, "give data_parallel='fsdp' or 'fsdp-no-reshard'"),
    ({"param_dtype": "bfloat16", "data_parallel": "ddp"}, "give data_parallel='fsdp' or 'fsdp-no-reshard'"),
    ({"param_dtype": "bf16", "data_parallel": "fsdp"}, "param_dtype must be one of bfloat16 (measured), got 'bf16'"),
    ({"param_dtype": "bfloat16", "reduce_dtype": "float16", "data_parallel": "fsdp"},
     "reduce_dtype must be one of float32, bfloat16 (measured), got 'float16'"),
    ({"reduce_dtype": "float32", "data_parallel": "fsdp"}, "give param_dtype='bfloat16' with it"),
    ({"param_dtype": "bfloat16", "data_parallel": "fsdp", "precision": "mixed"},
     "precision='mixed' counts the papers' 16-bit copies instead: leave precision fp32"),
    ({"param_dtype": "bfloat16", "data_parallel": "fsdp", "tensor_parallel": True},
     "modelled for FSDP2 alone (measured), not with tensor or pipeline parallelism"),
])
def test_the_policy_is_refused_in_one_line_where_it_is_not_modelled(kw, message):
    with pytest.raises(SymmemError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        Regime(**kw)
    assert "\n" not in str(e.value)


def test_autocast_checkpointing_and_traced_modules_are_refused_with_the_reason():
    with pytest.raises(SymmemError, match="autocast='bfloat16' is torch.autocast over FP32 weights and param_dtype="):
        derive("llama", data_parallel="fsdp", param_dtype="bfloat16", autocast="bfloat16")
    torch = pytest.importorskip("torch")
    with pytest.raises(SymmemError, match="param_dtype='bfloat16' \\(FSDP2's MixedPrecisionPolicy\\) is modelled for "
                                          "the built-in models"):
        from symmem import trace

        trace(torch.nn.Linear(4, 4), (torch.zeros(2, 4),), {"B": [(0, 0)]}, data_parallel="fsdp",
              param_dtype="bfloat16")
    # checkpointing and gradient accumulation under the policy are modelled: tests/test_fsdp_mixed_checkpoint.py
    # a model with floating inputs (FSDP2 casts them to bf16) and a loss on bf16 logits: measured, not modelled
    d = derive("mlp", data_parallel="fsdp", param_dtype="bfloat16", values={"N": 2})
    with pytest.raises(SymmemError, match="modelled for the causal LMs it was measured on \\(gpt2, llama\\): mlp's"):
        d.value("peak")
    # the papers' 16-bit presets under FSDP2: the engine's own policy is named
    d = derive("llama", data_parallel="fsdp", precision="mixed", values={"L": 2})
    with pytest.raises(SymmemError, match="FSDP2's own MixedPrecisionPolicy is param_dtype='bfloat16' \\(--param-dt"):
        d.value("peak")


def test_cli_options_say_the_policy_and_bad_values_exit_2(capsys):
    run = ["derive", "llama", "--data-parallel", "fsdp", "--param-dtype", "bfloat16", "--reduce-dtype", "float32",
           "--set", "N=8", "--set", "L=2"]
    assert main(run) == 0
    out = capsys.readouterr().out
    assert "per device: fsdp N=8 param_dtype=bfloat16 reduce_dtype=float32" in " ".join(out.split())
    d = derive("llama", data_parallel="fsdp", param_dtype="bfloat16", reduce_dtype="float32", values={"N": 8, "L": 2})
    assert d.regime.param_dtype == "bfloat16" and d.layout_label() in " ".join(out.split())
    assert d.value("peak") < derive("llama", data_parallel="fsdp", values={"N": 8, "L": 2}).value("peak")
    # fit solves the policy's peak: the largest B under 8 GiB, and B + 1 over it
    sizes = ["--set", "N=8", "--set", "L=2", "--set", "S=512", "--budget", "8GiB"]
    assert main(["fit", "llama", "--data-parallel", "fsdp", "--param-dtype", "bfloat16", *sizes]) == 0
    assert "largest B = 26 " in capsys.readouterr().out
    d = derive("llama", data_parallel="fsdp", param_dtype="bfloat16", values={"N": 8, "L": 2, "S": 512})
    assert d.at(B=26).value("peak") <= 8 * 2**30 < d.at(B=27).value("peak")
    for bad in (["--param-dtype", "bf16"], ["--reduce-dtype", "float32"]):
        assert main(["derive", "llama", "--data-parallel", "fsdp", *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("symmem: error: ") and "Traceback" not in "".join(err)


def test_the_parameter_side_stays_fp32_and_the_activations_are_bf16():
    """By hand: FSDP2's policy leaves the shards, the sharded gradients and AdamW in FP32 (16 bytes a parameter
    over N; each rank's, padding and step counts included, is checked against the gloo runs: :func:`check_mixed`),
    and the activations are bf16 where the model computes in its parameters' dtype: the final norm's output
    (B, S, H) at 2 bytes an element, the loss's FP32 log-probabilities (B S, V) at 4."""
    mixed = _derive("llama", "fsdp", "cross-entropy", values={"N": 2})
    assert mixed.value("parameter_memory") == 16 * mixed.value("parameters") // 2
    b, s, h, v = TINY["B"], TINY["S"], TINY["H"], TINY["V"]
    kept = {st.name: mixed.evaluate(st.expr) for st in mixed.storages}
    assert (kept["norm.scale"], kept["loss.log_probs"]) == (2 * b * s * h, 4 * b * s * v)
