"""The options every front shares -- ``derive``, ``trace`` and the command line: one meaning and one default each.

=========== =========== ===================================================================================
option      default     meaning
=========== =========== ===================================================================================
device      None        whose kernels decide what is kept (``cuda``, ``cpu``): None is where the model runs --
                        a traced module's own device (its parameters', the CPU for a module just built, as every
                        SPEC the command line loads), a built-in model's cuda (it has no device; training runs there)
loss        ``sum``     what the step backpropagates from: ``sum`` (the output's sum: no loss tensor is kept),
                        ``cross-entropy`` (a built-in model's, appended as its own group; a causal LM's is the
                        shifted one), ``output`` (the module's own: it returns its loss, a transformers causal
                        LM given labels) or, traced only, a callable of the output
checkpoint  ``none``    activation checkpointing: ``full``; ``selective`` and ``every-K`` (built-in models);
                        a container's path or a list of child paths (traced modules)
precision   ``fp32``    the parameter side's copies (``mixed`` ...); a built-in model's activations follow it; a
                        traced module with FP32 weights refuses any other (its activations would stay FP32):
                        PyTorch's mixed precision is ``autocast`` over FP32 weights
autocast    None        a traced module's forward and loss under ``torch.autocast`` to this dtype
keep_logits False       whether the loop holds the model's output through backward (``keep_logits`` of the
                        regime, ``keep_output`` of ``track_step``): no, as Hugging Face's ``Trainer`` and
                        Lightning's ``training_step`` return the loss and let the output go
=========== =========== ===================================================================================

The device default in one sentence (:data:`DEVICE_DEFAULT`): the kernels that run decide what autograd keeps, so
a traced module is followed on its own device and a built-in model, which has none, on cuda, where training runs.

>>> resolve("derive", loss=None).loss, resolve("trace").device
('sum', None)
>>> resolve("derive", autocast="bfloat16")  # doctest: +ELLIPSIS
Traceback (most recent call last):
symmem.errors.SymmemError: autocast='bfloat16' runs a traced module's forward under torch.autocast; a built-in ...
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .errors import SymmemError

Front = Literal["derive", "trace"]

DEVICES = ("cuda", "cpu")
LOSSES = ("sum", "cross-entropy", "output")
AUTOCASTS = ("bfloat16", "float16")


@dataclass(frozen=True)
class Shared:
    """The shared options of one call, checked: what :func:`resolve` gives."""

    device: str | None = None
    loss: str | Callable[[Any], Any] = "sum"
    checkpoint: Any = "none"
    autocast: str | None = None


def resolve(front: Front, *, device: str | None = None, loss: Any = "sum", checkpoint: Any = "none",
            autocast: str | None = None) -> Shared:
    """The shared options as ``front`` takes them, each checked once: a clear :class:`SymmemError` names what a
    front cannot do (a callable loss for a built-in model, autocast without a module to run).  ``precision`` is a
    field of the training regime, which :class:`~symmem.training.Regime` checks for every front."""
    if device is not None and not (isinstance(device, str) and (device in DEVICES or device.startswith("cuda:"))):
        raise SymmemError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if loss is None:
        loss = "sum"  # no loss named: the step backpropagates from the output's sum
    if callable(loss) and not isinstance(loss, str):
        if front == "derive":
            raise SymmemError("a callable loss runs on a traced module's output; a built-in model takes "
                              f"loss={' or '.join(repr(x) for x in LOSSES[:2])}")
    elif front == "trace" and loss not in LOSSES:
        raise SymmemError(f"loss must be one of {', '.join(LOSSES)} or a callable, got {loss!r}")
    elif front == "derive" and loss == "output":
        raise SymmemError("loss='output' is the module's own loss (a traced module that returns it); a built-in "
                          f"model takes loss={' or '.join(repr(x) for x in LOSSES[:2])}")
    elif front == "derive" and loss not in LOSSES[:2]:
        raise SymmemError(f"unknown loss {loss!r}; known: {', '.join(LOSSES[:2])}")
    if checkpoint is None:
        checkpoint = "none"
    if autocast is not None:
        if front == "derive":
            raise SymmemError(f"autocast={autocast!r} runs a traced module's forward under torch.autocast; a "
                              "built-in model's activations follow precision= (mixed: 16-bit)")
        if autocast not in AUTOCASTS:
            raise SymmemError(f"autocast must be one of {', '.join(AUTOCASTS)}, got {autocast!r}")
    return Shared(device, loss, checkpoint, autocast)


#: The device default, said once (docs, ``--help``, ``symmem models -v``).
DEVICE_DEFAULT = ("the model's own: a traced module's device (the CPU for a module just built, as every SPEC "
                  "loaded here), a built-in model's cuda (it has no device; training runs there)")


def defaults() -> list[tuple[str, str]]:
    """(option, its default and why) for every option the fronts share, as ``symmem models -v`` says them.

    >>> print(dict(defaults())["loss"])
    sum: the step backpropagates from the output's sum (no loss tensor kept)
    """
    return [
        ("convention", "pytorch: what PyTorch's autograd keeps, with the peak of a training step"),
        ("device", DEVICE_DEFAULT),
        ("loss", "sum: the step backpropagates from the output's sum (no loss tensor kept)"),
        ("keep_logits", "off: the loop lets the model's output go once the loss is computed, as Hugging Face's "
                        "Trainer and Lightning do (track_step's keep_output=False)"),
        ("precision", "fp32 (a traced module with FP32 weights takes fp32 only: --autocast is PyTorch's mixed "
                      "precision)"),
        ("autocast", "none (traced modules: bfloat16 or float16 runs the forward and the loss under "
                     "torch.autocast)"),
        ("attention", "what the library a built-in model follows does by default: SDPA for gpt2, bert-*, llama "
                      "(transformers' attn_implementation) and vit-* (timm's fused attention)"),
    ]


def check_precision(precision: str, autocast: str | None, dtypes: set[Any]) -> None:
    """Refuse a 16-bit ``precision`` for a traced module whose floating weights (``dtypes``) are all FP32: its
    activations would stay FP32 while the header said "mixed" (PyTorch's mixed precision is ``torch.autocast``
    over FP32 weights: ``autocast=``).

    >>> torch = getattr(__import__("pytest"), "importorskip")("torch")
    >>> check_precision("mixed", None, {torch.float32})
    Traceback (most recent call last):
    symmem.errors.SymmemError: precision='mixed' counts 16-bit weight copies and runs 16-bit activations, but this ...
    >>> check_precision("mixed-megatron", None, {torch.bfloat16})   # a module cast to bfloat16: its own dtypes
    """
    import torch

    if precision == "fp32" or (dtypes and dtypes != {torch.float32}):
        return
    also = f" (autocast={autocast!r} is given: leave precision fp32)" if autocast is not None else ""
    raise SymmemError(f"precision={precision!r} counts 16-bit weight copies and runs 16-bit activations, but this "
                      "module's weights are FP32: for PyTorch's mixed precision (torch.autocast over FP32 weights) "
                      f"give autocast='bfloat16' or 'float16' (--autocast){also}, or cast the module to bfloat16")


#: The regime's fields that only the training step reads (its peak), with their defaults.
STEP_FIELDS = (("optimizer_impl", "auto"), ("keep_logits", False), ("micro_batches", 1))


def check_effect(convention: Any, regime: Any, *, model: str, repeated: bool, builder: Mapping[str, Any],
                 loss: Any = "sum", per_layer: bool = False) -> None:
    """Refuse an option a derivation would accept with no effect, naming why and the way out: an option of the
    step where no step is modelled (a convention that counts by role, one layer), checkpointing of a model with no
    repeated layer, and a builder option or a loss the convention does not see (``convention.blind_to``).

    >>> from symmem.conventions import convention
    >>> from symmem.training import Regime
    >>> check_effect(convention("paper"), Regime(keep_logits=True), model="gpt2", repeated=True, builder={})
    Traceback (most recent call last):
    symmem.errors.SymmemError: keep_logits=True shapes the training step's peak, which the paper convention ...
    """
    no_step, out = None, ""
    if per_layer:
        no_step = "one layer (per_layer)"
    elif not convention.models_step:
        no_step, out = f"the {convention.name} convention (an accounting with no step)", ", or use convention pytorch"
    elif regime.tensor_parallel or regime.pipeline_parallel:
        # the step is one device's, op by op (passes/schedule.Simulation refuses a model split over devices;
        # ZeRO alone is the papers' accounting of that step, shards divided by N)
        no_step = "the pytorch convention under tensor or pipeline parallelism (it follows one device)"
    given = _step_option(regime)
    if (regime.pipeline_parallel and not regime.zero and not per_layer
            and convention.models_step and given == f"micro_batches={regime.micro_batches!r}"):
        given = None  # the pipeline's micro-batches per step (passes/pipeline_step.py)
    if given is not None and no_step is not None:
        raise SymmemError(f"{given} shapes the training step's peak, which {no_step} does not model: leave it "
                          f"out{out}")
    if regime.checkpoint != "none" and not repeated:
        raise SymmemError(f"checkpoint={regime.checkpoint!r} recomputes repeated layers, and {model} has none: "
                          "leave it out")
    given = dict(builder)
    if loss != "sum":
        given["loss"] = loss
    for name, value in given.items():
        why = convention.blind_to.get(name)
        if why is not None:
            raise SymmemError(f"{name}={value!r} has no effect under the {convention.name} convention ({why}): "
                              "leave it out, or use convention pytorch")


def check_step(regime: Any, why: str | None) -> None:
    """Refuse the step's options (``optimizer_impl``, ``keep_logits``, ``micro_batches``) where a traced module has
    no step to follow (``why``: fitted at concrete sizes, under ZeRO, tensor or pipeline parallelism, a precision
    or an optimizer its step does not run): they would change nothing."""
    given = _step_option(regime)
    if regime.pipeline_parallel and given == f"micro_batches={regime.micro_batches!r}":
        given = None  # the pipeline's micro-batches per step, not the one device's step (importer/traced_pipeline.py)
    if given is not None and why is not None:
        raise SymmemError(f"{given} shapes the training step's peak, which is not modelled here ({why}): leave it out")


def _step_option(regime: Any) -> str | None:
    """The first option of the step (:data:`STEP_FIELDS`) ``regime`` sets away from its default, as ``name=value``."""
    for name, default in STEP_FIELDS:
        value = getattr(regime, name)
        if value != default:
            return f"{name}={value!r}"
    return None


HELP = {
    "device": f"the device whose kernels decide what is kept (default: {DEVICE_DEFAULT})",
    "loss": "what the step backpropagates from: sum of the output (no loss tensor kept), cross-entropy (a causal "
            "LM's shifted one; hf: causal LMs get labels), output (the module returns its loss) (default: sum)",
    "checkpoint": "activation checkpointing: none, full, selective, every-K (built-in models) or a container's "
                  "path (traced modules) (default: none)",
    "precision": "the parameter side's copies and, for a built-in model, the activations' dtype; a traced module "
                 "with FP32 weights takes fp32 only: use --autocast for PyTorch's mixed precision (default: fp32)",
    "autocast": "traced modules: run the forward and the loss under torch.autocast to this dtype, over FP32 "
                "weights (PyTorch's mixed precision); a built-in model follows --precision instead (default: none)",
}


def add_arguments(p: Any, front: Front, names: tuple[str, ...] = ("precision", "device", "loss")) -> None:
    """The command-line options for ``names``, with the meaning and default :func:`resolve` gives them (the
    choices a front takes)."""
    from .training import PRECISIONS

    for name in names:
        flag = f"--{name}"
        if name == "device":
            p.add_argument(flag, choices=list(DEVICES), default=None, help=HELP[name])
        elif name == "loss":
            # one set of choices for every command (a built-in model refuses 'output' in one line: resolve)
            p.add_argument(flag, choices=list(LOSSES), default="sum", help=HELP[name])
        elif name == "precision":
            p.add_argument(flag, choices=list(PRECISIONS), default="fp32", help=HELP[name])
        elif name == "checkpoint":
            p.add_argument(flag, default="none", metavar="none|full|selective|every-K", help=HELP[name])
        elif name == "autocast":
            p.add_argument(flag, choices=list(AUTOCASTS), default=None, help=HELP[name])
        else:
            raise argparse.ArgumentError(None, f"no shared option {name!r}")
