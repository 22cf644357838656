"""FSDP2's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)`` with activation
checkpointing (torchtitan's recipe) and gradient accumulation: the per-rank peak under ``fsdp`` / ``fsdp-no-reshard``
with ``param_dtype="bfloat16"``, ``checkpoint="full"`` or ``"every-K"`` and ``micro_batches``, against real gloo runs.

The truth: the GPT-2 and Llama references sharded by ``fully_shard(..., mp_policy=...)`` on every layer and the root,
checkpointed as symmem.record.sharded's ``run_sharded`` does (``full``: each layer ``checkpoint_wrapper``'d inside
``fully_shard``; ``every-K``: the reference's own checkpoint around K sharded layers; every micro-batch but the last
under ``set_requires_gradient_sync(False)``), two CPU ranks, the live-bytes recorder inside each.  The runs ride in
tests/test_data_parallel.py's FSDP2 spawn (:func:`jobs`, :func:`check`): each rank's first and steady peak, from the
formula in ``N`` derived at N = 8 and evaluated at N = 2, and its parameter side equal the measured ones.  Also
measured exact, not run here (docs/regimes.md): V = 101 (padded rows: the ranks differ, each exact by
``rank_peaks``), 4 x 64 tokens, every-2 on Llama, fsdp-no-reshard with full on both, 3 micro-batches, micro-batches
without checkpointing and under ``reduce_dtype=bfloat16``.  Both steady peaks sit in a checkpointed layer's backward,
after its recompute (the bf16 recomputed activations, the callers' holds inside the layer, the bf16 all-gathers and
unsharded gradients, the FP32 reduce-scatter input; Llama's, the FP32 accumulated unsharded gradients).
"""

from __future__ import annotations

import functools

from symmem import derive

#: (model, engine, loss, checkpoint, values, micro-batches): Llama resharding under cross-entropy with each layer
#: checkpointed (FSDP's hooks outside the checkpoint, its pre-backward unshard before the recompute) over 2
#: micro-batches (the first under set_requires_gradient_sync(False): FP32 copies of the bf16 unsharded gradients);
#: GPT-2 without resharding under the loss ``sum`` with a checkpoint around 2 of 3 layers (FSDP's hooks inside it;
#: L not a multiple of K)
CASES = (("llama", "fsdp", "cross-entropy", "full", (("L", 2),), 2),
         ("gpt2", "fsdp-no-reshard", "sum", "every-2", (("L", 3),), 1))
SIZES = {"S": 32, "H": 64, "h": 4, "B": 2, "V": 100}


@functools.cache
def _derive(model, engine, loss, checkpoint, values, micro_batches):
    """Derived at the default N = 8 and evaluated at N = 2 (the run's world): the formula in N is what is checked."""
    sizes = {**SIZES, "G": 2, "F": 128} if model == "llama" else dict(SIZES)
    options = {"attention": "sdpa"} if model == "llama" else {"attention": "sdpa", "dropout": 0.0}
    return derive(model, convention="pytorch", device="cpu", optimizer="adamw", values={**sizes, **dict(values)},
                  data_parallel=engine, loss=loss, param_dtype="bfloat16", checkpoint=checkpoint,
                  micro_batches=micro_batches, **options).at(N=2)


def jobs():
    """The gloo jobs, each run once: gloo's worker threads can free late, which only ever adds, so each peak
    counts as the lower of the two ranks' (their shards are equal: no dim 0 is padded at N = 2)."""
    from symmem.record.distributed import job_of

    return [job_of(_derive(*case)) for case in CASES]


def check(runs):
    """What differs between the derived peaks and parameter sides and the measured ``runs`` (one run of
    :func:`jobs`): empty when every rank is exact."""
    from symmem.record.distributed import compare_parameter_side

    wrong = []
    for case, ranks in zip(CASES, runs, strict=True):
        d = _derive(*case)
        assert d.peak_at().phase == "backward"  # the steady peak: in a checkpointed layer's backward
        want = (d.value("peak_first_step"), d.value("peak"))
        got = (min(r.first for r in ranks), min(x for r in ranks for x in r.per_step[1:]))
        wrong += [f"{case}: derived {want}, measured {got} ({[r.per_step for r in ranks]})"] if want != got else []
        wrong += [f"{case} {w}" for w in compare_parameter_side(d, ranks)]
    return wrong
