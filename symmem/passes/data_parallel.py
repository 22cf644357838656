"""What a data-parallel engine adds to one rank's training step, as the schedule (:mod:`.schedule`) walks it.

Every rank runs the whole model on its own batch ``B``, so the forward and backward are one device's; the
engines differ in what they keep beside them (measured per rank on real ``torch.distributed`` runs, gloo on the
CPU: :mod:`symmem.record.distributed`, ``tests/test_data_parallel.py``, docs/regimes.md):

* ``ddp`` -- ``DistributedDataParallel(model)``: the reducer allocates flat gradient buckets of every trainable
  parameter when the module is wrapped (bucket_cap_mb=25 per bucket; their sum is the gradients' size, 4 bytes per
  parameter in FP32) and keeps them for good; backward copies each gradient into its bucket, all-reduces the
  bucket in place and copies it back, allocating nothing more.  The second step's rebuild of the buckets (in the
  order gradients arrived) frees the old ones before it allocates the new (measured: no overlap).
* ``ddp-bucket-view`` -- ``gradient_as_bucket_view=True``: the buckets are the gradients.  Each ``.grad`` a backward
  formula makes is copied into its bucket by the reducer's hook and freed at once (``param.grad`` becomes a view of
  the bucket); ``zero_grad(set_to_none=True)`` drops the views, not the buckets, so the gradients' bytes are live
  the whole step, forward included.

>>> from symmem.training import Regime
>>> ddp, view = Regime(data_parallel="ddp"), Regime(data_parallel="ddp-bucket-view")
>>> buckets(ddp, [("fc.weight", (4, 3))], {"fc.weight": 12}, 4), grads_in_buckets(view), grads_in_buckets(ddp)
([('ddp.buckets', 48)], True, False)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import sympy

from ..training import Regime

#: The engines whose reducer keeps gradient buckets.
_BUCKETED = ("ddp", "ddp-bucket-view")


def buckets(regime: Regime, params: Sequence[tuple[str, tuple[sympy.Expr, ...]]], numel: Mapping[str, sympy.Expr],
            grad_bytes: int) -> list[tuple[str, sympy.Expr]]:
    """DDP's gradient buckets, alive from before the first step to the end (one storage: every bucket lives as
    long as the others, so how the 25 MB cap splits them changes no moment's bytes)."""
    if regime.data_parallel not in _BUCKETED or not params:
        return []
    return [("ddp.buckets", sympy.Add(*(numel[name] for name, _ in params)) * grad_bytes)]


def grads_in_buckets(regime: Regime) -> bool:
    """Whether every ``.grad`` is a view of a bucket: the gradient a backward formula makes is freed once the
    reducer has copied it there (as a second micro-batch's gradient is, once added into ``.grad``)."""
    return regime.data_parallel == "ddp-bucket-view"

