"""Training regimes as data: bytes per parameter for each precision and optimizer, checkpointing, parallelism.

A :class:`Regime` is a precision (what the weights and gradients cost, and the activation dtype), an optimizer
(what state it keeps per parameter), an activation-checkpointing mode and a parallel layout (ZeRO stage,
tensor / sequence / pipeline parallelism).  Every number lives in the tables below; ``docs/regimes.md`` gives
each source.

>>> r = Regime("fp32", "adamw")
>>> r.bytes_per_parameter
16
>>> [c for c, _ in r.components()]
['weights', 'gradients', 'exp_avg', 'exp_avg_sq']
>>> Regime("fp32", "sgd-momentum").bytes_per_parameter
12
>>> Regime("mixed", "adam").bytes_per_parameter, Regime("mixed-megatron", "adam").bytes_per_parameter
(16, 18)
>>> Regime("mixed-full-copies", "adamw").bytes_per_parameter
20
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from .errors import SymmemError
from .shapes import numel

#: What ZeRO shards each component class by: stage 1 the optimizer side (states and FP32 master weights),
#: stage 2 also the gradients, stage 3 also the weights (Rajbhandari et al. 2020, section 5).
ZERO_STAGE_OF_CLASS = {"optimizer": 1, "gradients": 2, "weights": 3}


@dataclass(frozen=True)
class Component:
    """One per-parameter tensor: its name, bytes per element, and its class for ZeRO (weights, gradients,
    optimizer; FP32 master weights belong to the optimizer side as in the ZeRO paper)."""

    name: str
    bytes: int
    kind: str
    description: str = ""


@dataclass(frozen=True)
class Precision:
    """Per-parameter bytes of the weight and gradient copies, and the dtype activations are kept in."""

    name: str
    activation_dtype: str
    parts: tuple[Component, ...]
    description: str

    @property
    def components(self) -> tuple[tuple[str, int], ...]:
        return tuple((c.name, c.bytes) for c in self.parts)


@dataclass(frozen=True)
class Optimizer:
    """Per-parameter bytes of each optimizer state tensor (FP32 unless the optimizer says otherwise).

    ``states`` are elementwise (one value per parameter element).  ``factored`` states are Adafactor's row
    and column statistics of a matrix; ``block`` > 0 adds one FP32 scale per ``block`` elements to each state
    (block-wise quantization, bitsandbytes' 8-bit optimizers); ``min_quantized`` is the size below which a
    quantizing optimizer keeps FP32 states instead.
    """

    name: str
    states: tuple[tuple[str, int], ...]
    description: str
    factored: bool = False
    block: int = 0
    min_quantized: int = 0

    def state_bytes(self, shape: tuple[sympy.Expr, ...]) -> list[tuple[str, sympy.Expr]]:
        """Bytes of each state tensor for one parameter of ``shape``.

        >>> OPTIMIZERS["adafactor"].state_bytes((1024, 512))
        [('exp_avg_sq_row', 4096), ('exp_avg_sq_col', 2048)]
        >>> OPTIMIZERS["adam-8bit"].state_bytes((4096, 4096))
        [('exp_avg', 16777216), ('exp_avg.absmax', 32768), ('exp_avg_sq', 16777216), ('exp_avg_sq.absmax', 32768)]
        """
        n = numel(shape)
        if self.factored:
            # Adafactor (Shazeer & Stern 2018; HF transformers' Adafactor, beta1=None): a matrix keeps the
            # row means (shape[:-1]) and column means (shape[:-2] + shape[-1:]) of the squared gradient;
            # a vector keeps the full second moment.
            if len(shape) >= 2:
                rows = sympy.Mul(*shape[:-1])
                cols = sympy.Mul(*shape[:-2]) * shape[-1]
                return [("exp_avg_sq_row", rows * 4), ("exp_avg_sq_col", cols * 4)]
            return [("exp_avg_sq", n * 4)]
        if self.block and n.is_number and n < self.min_quantized:
            return [(name, n * 4) for name, _ in self.states]
        out: list[tuple[str, sympy.Expr]] = []
        for name, b in self.states:
            out.append((name, n * b))
            if self.block:
                out.append((f"{name}.absmax", sympy.ceiling(n / self.block) * 4))
        return out


def _c(name: str, b: int, kind: str, description: str) -> Component:
    return Component(name, b, kind, description)


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", "float32", (
        _c("weights", 4, "weights", "FP32 weights"),
        _c("gradients", 4, "gradients", "FP32 gradients")),
        "FP32 weights and gradients, FP32 activations"),
    "mixed": Precision("mixed", "float16", (
        _c("weights", 2, "weights", "FP16/BF16 weights used in forward and backward"),
        _c("gradients", 2, "gradients", "FP16/BF16 gradients"),
        _c("master_weights", 4, "optimizer", "FP32 master copy of the weights (the optimizer updates it)")),
        "mixed precision as the ZeRO paper counts it (Rajbhandari et al. 2020, section 3.1): 2 + 2 bytes of "
        "16-bit weights and gradients plus K bytes of optimizer state, K = 12 for Adam (4 master + 4 + 4); "
        "16-bit activations"),
    "mixed-megatron": Precision("mixed-megatron", "bfloat16", (
        _c("weights", 2, "weights", "BF16 weights"),
        _c("main_weights", 4, "optimizer", "FP32 main weights held by the optimizer"),
        _c("main_gradients", 4, "gradients", "FP32 main gradients (gradient accumulation/reduction buffer)")),
        "Megatron-LM's mixed precision (docs of its distributed optimizer: 18 bytes per parameter with Adam, "
        "BF16 parameters and FP32 main gradients; 6 + 12/N with the distributed optimizer); 16-bit "
        "activations"),
    "mixed-full-copies": Precision("mixed-full-copies", "float16", (
        _c("weights", 2, "weights", "FP16 weights"),
        _c("master_weights", 4, "optimizer", "FP32 master copy of the weights"),
        _c("gradients", 2, "gradients", "FP16 gradients"),
        # The FP32 gradient copy feeds the optimizer step: Megatron's distributed optimizer shards it with the
        # optimizer state (4 + 16/d bytes for FP16 params and grads), so it is on the optimizer side.
        _c("gradients_fp32", 4, "optimizer", "FP32 copy of the gradients (optimizer side)")),
        "mixed precision with FP16 and FP32 copies of both weights and gradients (as a transformer activation "
        "breakdown counts it: 20 bytes per parameter with AdamW); 16-bit activations"),
}

OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": Optimizer("sgd", (), "plain SGD: no state"),
    "sgd-momentum": Optimizer("sgd-momentum", (("momentum", 4),), "SGD with a momentum buffer"),
    "adam": Optimizer("adam", (("exp_avg", 4), ("exp_avg_sq", 4)), "Adam: first and second moments"),
    "adamw": Optimizer("adamw", (("exp_avg", 4), ("exp_avg_sq", 4)),
                       "AdamW: first and second moments (decoupled weight decay costs no memory)"),
    "adafactor": Optimizer("adafactor", (("exp_avg_sq", 4),),
                           "Adafactor without momentum (beta1=None): a matrix keeps a row and a column vector "
                           "of second-moment statistics, a vector its full second moment", factored=True),
    "adam-8bit": Optimizer("adam-8bit", (("exp_avg", 1), ("exp_avg_sq", 1)),
                           "8-bit Adam (bitsandbytes, Dettmers et al. 2022): 1 byte per moment plus one FP32 "
                           "absmax per block of 2048 elements; tensors under 4096 elements keep FP32 moments",
                           block=2048, min_quantized=4096),
    "lion": Optimizer("lion", (("exp_avg", 4),), "Lion (Chen et al. 2023): one momentum buffer"),
}

CHECKPOINTS = ("none", "full", "selective", "every-K")
#: The data-parallel engines over N ranks, named after the PyTorch API a user calls (docs/regimes.md):
#: ``DistributedDataParallel`` (``ddp``; ``ddp-bucket-view``: ``gradient_as_bucket_view=True``),
#: ``ZeroRedundancyOptimizer``, FSDP2's ``fully_shard`` (``fsdp``; ``fsdp-no-reshard``:
#: ``reshard_after_forward=False``) and FSDP1 (``FULL_SHARD``, ``SHARD_GRAD_OP``).
DATA_PARALLEL = ("ddp", "ddp-bucket-view", "zero-redundancy", "fsdp", "fsdp-no-reshard", "fsdp1", "fsdp1-grad-op")
#: The option (inside a step's options, not a user's) naming the rank whose step is walked (FSDP's padded shards,
#: ZeRO-1's partition); 0 by default.
RANK_OPTION = "_data_parallel_rank"
_GATHERLESS = "FSDP2 on one rank copies the shards into the unsharded parameters without an all-gather buffer"
#: Engines whose step on one rank is not their step on N (measured on gloo and on an H200: docs/cuda.md).
ONE_RANK_DIFFERS = {"fsdp": _GATHERLESS, "fsdp-no-reshard": _GATHERLESS,
                    "fsdp1": "FSDP1 on one rank switches FULL_SHARD to NO_SHARD",
                    "fsdp1-grad-op": "FSDP1 on one rank switches SHARD_GRAD_OP to NO_SHARD"}


def refuse_one_rank(data_parallel: str | None, numbers: Mapping[sympy.Symbol, Any]) -> None:
    """Refuse (one line) a peak asked of an engine that runs differently on one rank, at ``N = 1``."""
    why = ONE_RANK_DIFFERS.get(data_parallel or "")
    if why and any(s.name == "N" and v == 1 for s, v in numbers.items()):
        raise SymmemError(f"data_parallel={data_parallel!r} at N = 1: {why}, which is not modelled; the peak holds "
                          "for N >= 2 (one device: leave the engine out)")
#: Why an engine on every pipeline stage is not modelled (FSDP2's is: passes/fsdp_pipeline.py; DDP's:
#: passes/ddp_pipeline.py)
_NOT_STAGED = {
    "fsdp1": "PipelineStage handles DDP and FSDP2 only (backward_maybe_with_nosync), so FSDP1 would reduce-scatter "
             "after every micro-batch, which was not measured",
    "fsdp1-grad-op": "PipelineStage handles DDP and FSDP2 only (backward_maybe_with_nosync), so FSDP1 would "
                     "reduce-scatter after every micro-batch, which was not measured"}
#: why each engine not modelled with tensor parallelism is not (``_check_data_parallel``)
_NOT_MESHED = {
    "ddp": "PyTorch composes DDP with DTensor parameters only through the private "
           "torch.distributed.tensor.parallel.ddp._pre_dp_module_transform, which was not measured",
    "ddp-bucket-view": "PyTorch composes DDP with DTensor parameters only through the private "
                       "torch.distributed.tensor.parallel.ddp._pre_dp_module_transform, which was not measured",
    "zero-redundancy": "ZeroRedundancyOptimizer over DTensor parameters was not measured"}
#: Pipeline schedules (``torch.distributed.pipelining``): ``1f1b`` (``Schedule1F1B``, the default) and ``gpipe``
#: (``ScheduleGPipe``).
SCHEDULES = ("1f1b", "gpipe")
#: FSDP2 ``MixedPrecisionPolicy`` dtypes modelled (measured on gloo runs: docs/regimes.md)
PARAM_DTYPES = ("bfloat16",)
REDUCE_DTYPES = ("float32", "bfloat16")
#: How ``optimizer.step()`` runs (``auto``: PyTorch's default for the device).
IMPLS = ("auto", "for-loop", "foreach", "fused")
_EVERY = re.compile(r"^every-([1-9][0-9]*)$")


def _lookup(table: dict, name: str, what: str):  # type: ignore[no-untyped-def]
    try:
        return table[name]
    except (KeyError, TypeError):  # TypeError: an unhashable value (a list) is no name either
        raise SymmemError(f"unknown {what} {name!r}; known: {', '.join(table)}") from None


def checkpoint_every(mode: str) -> int | None:
    """The k of ``every-k`` (None for the other modes); a :class:`SymmemError` for unknown modes.

    >>> checkpoint_every("every-4"), checkpoint_every("full")
    (4, None)
    """
    if not isinstance(mode, str):
        raise SymmemError(f"checkpointing is a name (none, full, selective or every-K), got {mode!r}")
    m = _EVERY.match(mode)
    if m:
        if len(m.group(1)) > 18:  # more layers than any model has, and more digits than int() may parse
            raise SymmemError(f"checkpointing {mode[:40]!r}: K is too large")
        return int(m.group(1))
    if mode not in ("none", "full", "selective"):
        raise SymmemError(f"unknown checkpointing {mode!r}; use none, full, selective or every-K (e.g. every-4)")
    return None


@dataclass(frozen=True)
class Regime:
    """A precision, an optimizer, activation checkpointing and a parallel layout.

    ``zero`` is the ZeRO stage (0-3; FSDP's full sharding is 3) over ``N`` data-parallel ranks;
    ``tensor_parallel`` splits over ``t`` ranks (``sequence_parallel`` adds Megatron's sequence split);
    ``pipeline_parallel`` splits the layers over ``p`` stages.  Sizes stay symbols (see :mod:`symmem.regimes`).
    """

    precision: str = "fp32"
    optimizer: str = "adamw"
    checkpoint: str = "none"
    zero: int = 0
    tensor_parallel: bool = False
    sequence_parallel: bool = False
    pipeline_parallel: bool = False
    #: how ``optimizer.step()`` runs: PyTorch's choice for the device (``auto``: for-loop on CPU, foreach on
    #: CUDA), ``for-loop``, ``foreach`` or ``fused``
    optimizer_impl: str = "auto"
    #: whether the training loop holds the model's output (logits) through backward, as Hugging Face's output
    #: objects and ``out = model(x); loss = f(out, y)`` do
    keep_logits: bool = False
    #: micro-batches whose gradients are accumulated before each optimizer step
    micro_batches: int = 1
    #: the data-parallel engine each of N ranks runs (:data:`DATA_PARALLEL`; None: one device); B stays the batch
    #: one rank processes.  ``zero`` is the papers' accounting of the same idea, not an engine.
    data_parallel: str | None = None
    #: with ``pipeline_parallel``: the schedule the stages run (:data:`SCHEDULES`)
    pipeline_schedule: str = "1f1b"
    #: FSDP2's ``MixedPrecisionPolicy(param_dtype=...)``: the dtype of the all-gathers, the unsharded parameters,
    #: the forward and backward and the unsharded gradients (None: no policy); the shards, the sharded gradients
    #: and the optimizer stay FP32 (:data:`PARAM_DTYPES`)
    param_dtype: str | None = None
    #: with ``param_dtype``: the policy's ``reduce_dtype``, the reduce-scatter's dtype (None: float32, as
    #: torchtitan sets it; :data:`REDUCE_DTYPES`)
    reduce_dtype: str | None = None

    def __post_init__(self) -> None:
        _lookup(PRECISIONS, self.precision, "precision")
        _lookup(OPTIMIZERS, self.optimizer, "optimizer")
        checkpoint_every(self.checkpoint)
        if isinstance(self.zero, bool) or self.zero not in (0, 1, 2, 3):
            raise SymmemError(f"ZeRO stage must be 0, 1, 2 or 3, got {self.zero!r}")
        for flag in ("tensor_parallel", "sequence_parallel", "pipeline_parallel"):
            if not isinstance(getattr(self, flag), bool):
                raise SymmemError(f"{flag} is True or False, got {getattr(self, flag)!r}")
        if self.sequence_parallel and not self.tensor_parallel:
            raise SymmemError("sequence parallelism splits over the tensor-parallel group: add tensor parallelism")
        if not isinstance(self.pipeline_schedule, str) or self.pipeline_schedule not in SCHEDULES:
            raise SymmemError(f"unknown pipeline schedule {self.pipeline_schedule!r}; known: {', '.join(SCHEDULES)}")
        if self.pipeline_schedule != "1f1b" and not self.pipeline_parallel:
            raise SymmemError(f"pipeline schedule {self.pipeline_schedule!r} needs pipeline parallelism")
        if self.optimizer_impl not in IMPLS:
            raise SymmemError(f"unknown optimizer implementation {self.optimizer_impl!r}; known: {', '.join(IMPLS)}")
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise SymmemError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        self._check_data_parallel()
        self._check_policy()

    def _check_policy(self) -> None:
        """FSDP2's ``MixedPrecisionPolicy``: a dtype it was measured with, on an FSDP2 engine over FP32 parameters."""
        if self.param_dtype is None:
            if self.reduce_dtype is not None:
                raise SymmemError(f"reduce_dtype={self.reduce_dtype!r} is part of FSDP2's MixedPrecisionPolicy: give "
                                  "param_dtype='bfloat16' with it")
            return
        if self.param_dtype not in PARAM_DTYPES:
            raise SymmemError(f"param_dtype must be one of {', '.join(PARAM_DTYPES)} (measured), got "
                              f"{self.param_dtype!r}")
        if self.reduce_dtype is not None and self.reduce_dtype not in REDUCE_DTYPES:
            raise SymmemError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)} (measured), got "
                              f"{self.reduce_dtype!r}")
        if self.data_parallel not in ("fsdp", "fsdp-no-reshard"):
            raise SymmemError(f"param_dtype={self.param_dtype!r} is FSDP2's MixedPrecisionPolicy: give "
                              "data_parallel='fsdp' or 'fsdp-no-reshard' (fully_shard(..., mp_policy=...))")
        if self.precision != "fp32":
            raise SymmemError(f"param_dtype={self.param_dtype!r} keeps FSDP2's shards, gradients and optimizer in "
                              f"FP32, and precision={self.precision!r} counts the papers' 16-bit copies instead: "
                              "leave precision fp32")
        if self.tensor_parallel or self.pipeline_parallel:
            raise SymmemError(f"param_dtype={self.param_dtype!r} is modelled for FSDP2 alone (measured), not with "
                              "tensor or pipeline parallelism")

    @property
    def policy_reduce_dtype(self) -> str | None:
        """The reduce-scatter's dtype under FSDP2's policy (float32 where ``reduce_dtype`` is not given), or None
        without one."""
        return None if self.param_dtype is None else (self.reduce_dtype or "float32")

    def _check_data_parallel(self) -> None:
        """A known, modelled engine, alone: ``zero`` is the papers' accounting of sharding, not an engine."""
        dp = self.data_parallel
        if dp is None:
            return
        if not isinstance(dp, str) or dp not in DATA_PARALLEL:
            raise SymmemError(f"unknown data-parallel engine {dp!r}; known: {', '.join(DATA_PARALLEL)}")
        if self.zero:
            raise SymmemError(f"data_parallel={dp!r} is an engine and zero={self.zero} the papers' accounting of "
                              "sharding: give one of them")
        if self.tensor_parallel and dp in ("fsdp", "fsdp-no-reshard", "fsdp1", "fsdp1-grad-op") and not (
                self.pipeline_parallel):
            # FSDP x TP (fully_shard over a parallelize_module'd model on an N x t mesh, passes/fsdp_tensor.py;
            # FSDP1's FullyShardedDataParallel(device_mesh=mesh["dp"]), passes/fsdp1_tensor.py), with or without
            # sequence parallelism
            return
        if self.pipeline_parallel and dp in ("fsdp", "fsdp-no-reshard", "ddp", "zero-redundancy",
                                             "ddp-bucket-view") and not self.tensor_parallel:
            # DDP (with ZeroRedundancyOptimizer; or the bucket view) on every stage (passes/ddp_pipeline.py)
            # FSDP2 on every stage of a p x N mesh, torchtitan's recipe (passes/fsdp_pipeline.py)
            return
        if self.pipeline_parallel and not self.tensor_parallel:
            raise SymmemError(f"data_parallel={dp!r} with pipeline parallelism is not modelled: {_NOT_STAGED[dp]}; "
                              "DDP, ZeRO-1 and FSDP2 on every stage are (ddp, ddp-bucket-view, zero-redundancy, "
                              "fsdp, fsdp-no-reshard)")
        if self.pipeline_parallel and dp in ("fsdp", "fsdp-no-reshard"):
            # FSDP2 x TP x pipeline, torchtitan's 3-D mesh (passes/fsdp_tensor_pipeline.py)
            return
        if self.pipeline_parallel:
            raise SymmemError(f"data_parallel={dp!r} with tensor and pipeline parallelism (a 3-D mesh) is not "
                              "modelled: FSDP2 on torchtitan's p x N x t mesh is (fsdp, fsdp-no-reshard)")
        if self.tensor_parallel:
            raise SymmemError(f"data_parallel={dp!r} with tensor parallelism is not modelled: {_NOT_MESHED[dp]}; "
                              "FSDP on an N x t mesh is (fsdp, fsdp-no-reshard, fsdp1 or fsdp1-grad-op)")

    @property
    def precision_spec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def optimizer_spec(self) -> Optimizer:
        return OPTIMIZERS[self.optimizer]

    @property
    def activation_dtype(self) -> str:
        # FSDP2's policy runs forward and backward in param_dtype over FP32 parameters (no autocast)
        return self.param_dtype or self.precision_spec.activation_dtype

    def components(self) -> list[tuple[str, int]]:
        """(name, bytes per parameter) for every per-parameter component, for elementwise optimizers.

        Adafactor's factored statistics and 8-bit block scales are not per parameter element: they are
        left out here (see :meth:`parameter_terms` for the exact bytes).
        """
        opt = self.optimizer_spec
        states = [] if opt.factored else list(opt.states)
        return list(self.precision_spec.components) + states

    def kind_of(self, component: str) -> str:
        """weights, gradients or optimizer: which ZeRO stage shards ``component``."""
        for c in self.precision_spec.parts:
            if c.name == component:
                return c.kind
        if component == "ddp_buckets":  # DDP's copy of the gradients (passes/data_parallel.py)
            return "gradients"
        return "optimizer"

    def shard(self, component: str) -> bool:
        """Whether this regime's ZeRO stage partitions ``component`` over the N data-parallel ranks (FSDP shards
        every component)."""
        if getattr(self, "data_parallel", None) in ("fsdp", "fsdp-no-reshard"):
            return True
        if getattr(self, "data_parallel", None) == "zero-redundancy":  # ZeRO-1: the optimizer side, as the papers
            return self.kind_of(component) == "optimizer"                # count it (the peak: whole parameters)
        if getattr(self, "data_parallel", None) in ("fsdp1", "fsdp1-grad-op"):  # flat parameters, all sharded
            return True
        return self.zero >= ZERO_STAGE_OF_CLASS[self.kind_of(component)]

    @property
    def bytes_per_parameter(self) -> int:
        return sum(b for _, b in self.components())

    def parameter_terms(self, shapes: list[tuple[sympy.Expr, tuple[sympy.Expr, ...]]]
                        ) -> list[tuple[str, sympy.Expr]]:
        """Bytes per component, summed over parameters given as (count, shape) pairs (before ZeRO)."""
        totals: dict[str, list[sympy.Expr]] = {}
        for count, shape in shapes:
            n = numel(shape)
            for name, b in self.precision_spec.components:
                totals.setdefault(name, []).append(count * n * b)
            for name, e in self.optimizer_spec.state_bytes(shape):
                totals.setdefault(name, []).append(count * e)
        return [(name, sympy.Add(*parts)) for name, parts in totals.items()]
