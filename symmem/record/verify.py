"""Measure what a real ``torch.nn.Module`` keeps for backward, and compare it with a derived formula.

:func:`measure` runs one training-mode forward pass under ``torch.autograd.graph.saved_tensors_hooks`` and
records every tensor autograd packs for backward.  Storages are counted once (``t.untyped_storage()``: a
saved view keeps its whole base storage alive, and a tensor saved by two ops is one storage).  Storages of
parameters and buffers are set aside, and so are the inputs given to the forward (the batch, a target):
those are reported as ``input``, the rest as ``activations``.  :func:`compare` puts a
:class:`~symmem.derivation.Derivation` next to a :class:`Measurement` and lists, per (dtype, size) of storage,
where the two disagree.  ``symmem verify MODEL`` does both for the project's own reference module of a
built-in model (:mod:`symmem.reference`).  Needs ``torch`` (the ``torch`` extra), imported lazily.

>>> import torch
>>> m = measure(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()), torch.zeros(2, 4))
>>> m.activations, m.input  # the ReLU's output (2*3 float32); the Linear keeps its input, the batch
(24, 32)
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import SymmemError

if TYPE_CHECKING:
    from ..derivation import Derivation

@dataclass(frozen=True)
class SavedInfo:
    """One tensor autograd packed: who saved it, its shape and dtype, and the storage behind it.

    ``op`` is the torch function being run when it was saved (``conv2d``, ``batch_norm`` ...), ``module``
    the qualified name of the innermost module running, ``producer`` the tensor's own ``grad_fn`` (None for a
    tensor that needs no gradient: a mask, indices, statistics, the batch).  ``storage`` identifies the
    storage (:func:`symmem.record.identity.storage_key`); ``nbytes`` is the whole storage's size; ``kind`` is
    ``activation``, ``input`` or ``parameter`` (parameters and buffers); ``device`` the storage's.
    """

    op: str
    module: str
    producer: str | None
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    storage: int
    kind: str
    device: str = ""

    @property
    def label(self) -> str:
        return f"{self.module or '<top>'}:{self.op}"


@dataclass(frozen=True)
class Measurement:
    """What one forward pass keeps: every saved tensor, and the bytes of distinct storages by kind."""

    saved: tuple[SavedInfo, ...]

    def storages(self, kind: str | None = None) -> list[SavedInfo]:
        """The first saved tensor of every distinct storage (optionally of one ``kind``)."""
        seen: dict[int, SavedInfo] = {}
        for s in self.saved:
            if s.nbytes > 0 and s.storage not in seen:
                seen[s.storage] = s
        return [s for s in seen.values() if kind is None or s.kind == kind]

    def bytes(self, kind: str) -> int:
        return sum(s.nbytes for s in self.storages(kind))

    @property
    def activations(self) -> int:
        """Bytes of saved storages that are not parameters, buffers or inputs."""
        return self.bytes("activation")

    @property
    def input(self) -> int:
        """Bytes of saved input storages (the batch, a loss target)."""
        return self.bytes("input")

    def by_op(self) -> dict[str, int]:
        """Activation bytes per saving op (a storage counted for the first op that saved it)."""
        out: dict[str, int] = {}
        for s in self.storages("activation"):
            out[s.op] = out.get(s.op, 0) + s.nbytes
        return out


def measure(module: Any, *inputs: Any, **keyword_inputs: Any) -> Measurement:
    """Run ``module(*inputs, **keyword_inputs)`` once in training mode and record every tensor autograd saves
    for backward.

    Parameters and buffers of ``module`` count as ``parameter``; the storages of the inputs (tensors, also
    inside lists/tuples; positional or keyword) as ``input``; everything else saved is ``activation``.  The
    module is left in training mode.  The recorder is the importer's
    (:class:`~symmem.record.saved_tensors.SavedRecorder`,
    without its dispatch mode), holding every packed tensor until the pass ends so that no storage is freed and
    its identity reused.
    """
    _require_torch()
    import torch

    from .identity import storage_key
    from .saved_tensors import SavedRecorder

    if not isinstance(module, torch.nn.Module):
        raise SymmemError(f"measure needs a torch.nn.Module, got {type(module).__name__}")
    module.train()
    params = {storage_key(t): "" for t in (*module.parameters(), *module.buffers())}
    flat: list[Any] = []
    for x in (*inputs, *keyword_inputs.values()):
        flat.extend(x if isinstance(x, list | tuple) else [x])
    given = {storage_key(x): "" for x in flat if isinstance(x, torch.Tensor)}
    rec = SavedRecorder(module, params=params, inputs=given, hold=True)
    with rec.recording(dispatch=False):
        out = module(*inputs, **keyword_inputs)
    del out
    return Measurement(tuple(SavedInfo(p.op, p.module, p.producer, p.shape, p.dtype, int(p.nbytes), p.key, p.kind,
                                       p.device) for _, p in rec.packed))


@dataclass(frozen=True)
class SizeRow:
    """Storages of one (dtype, bytes) size: how many the formula predicts and how many were measured."""

    dtype: str
    nbytes: int
    predicted: int
    measured: int
    predicted_names: tuple[str, ...]
    measured_names: tuple[str, ...]


@dataclass(frozen=True)
class Comparison:
    """Predicted vs measured bytes: activations (loss included) and inputs, and the rows that differ."""

    model: str
    predicted: int
    measured: int
    predicted_input: int
    measured_input: int
    rows: tuple[SizeRow, ...]
    #: measured activation bytes per saving torch function (``conv2d``, ``batch_norm`` ...)
    by_op: tuple[tuple[str, int], ...] = ()

    @property
    def difference(self) -> int:
        """Measured minus predicted activation bytes."""
        return self.measured - self.predicted

    @property
    def exact(self) -> bool:
        return self.predicted == self.measured and self.predicted_input == self.measured_input

    def differences(self) -> list[SizeRow]:
        return [r for r in self.rows if r.predicted != r.measured]

    def report(self, verbose: bool = False) -> str:
        """A text report; ``verbose`` adds the measured bytes per saving op."""
        lines = [f"{self.model}: saved for backward (bytes)",
                 f"  {'':<12}{'predicted':>16}{'measured':>16}{'difference':>14}",
                 f"  {'activations':<12}{self.predicted:>16,}{self.measured:>16,}{self.difference:>+14,}",
                 f"  {'input':<12}{self.predicted_input:>16,}{self.measured_input:>16,}"
                 f"{self.measured_input - self.predicted_input:>+14,}"]
        diff = self.differences()
        if diff:
            lines.append("  storages that differ (dtype, bytes each: predicted vs measured count):")
            for r in diff:
                who = ", ".join((r.measured_names or r.predicted_names)[:4])
                lines.append(f"    {r.dtype:<9}{r.nbytes:>14,} B  {r.predicted:>4} vs {r.measured:<4} e.g. {who}")
        if verbose and self.by_op:
            lines.append("  measured activation bytes by saving op:")
            lines += [f"    {op:<24}{n:>16,}" for op, n in self.by_op]
        lines.append("  exact" if self.exact else "  NOT EXACT")
        return "\n".join(lines)


def compare(derivation: Derivation, measurement: Measurement) -> Comparison:
    """Put the formula at its numbers next to a measurement: totals and per-size storage counts.

    Activations are compared with the loss included (a measurement of a model with a loss sees both).
    """
    from ..derivation import Derivation
    from ..tensor import dtype_bytes

    if not isinstance(derivation, Derivation):
        raise SymmemError(f"compare takes a Derivation (symmem.derive or symmem.trace) and a Measurement, not "
                          f"{type(derivation).__name__} as the derivation")
    if not isinstance(measurement, Measurement):
        raise SymmemError(f"compare takes a Derivation and a Measurement (symmem.record.verify.measure), not "
                          f"{type(measurement).__name__} as the measurement")
    act_dtype = derivation.regime.activation_dtype
    predicted: Counter[tuple[str, int]] = Counter()
    pnames: dict[tuple[str, int], list[str]] = {}
    for t in derivation.terms:
        if t.category not in ("activation", "loss") or t.elements is None:
            continue
        dtype = act_dtype if t.dtype in (None, "act") else t.dtype
        each = derivation.evaluate(t.elements) * dtype_bytes(dtype)
        n = derivation.evaluate(t.count)
        if n and each:
            predicted[(dtype, each)] += n
            pnames.setdefault((dtype, each), []).append(t.name)
    measured: Counter[tuple[str, int]] = Counter()
    mnames: dict[tuple[str, int], list[str]] = {}
    for s in measurement.storages("activation"):
        measured[(s.dtype, s.nbytes)] += 1
        mnames.setdefault((s.dtype, s.nbytes), []).append(s.label)
    rows = tuple(SizeRow(d, b, predicted[(d, b)], measured[(d, b)], tuple(pnames.get((d, b), ())),
                     tuple(mnames.get((d, b), ())))
                 for d, b in sorted(set(predicted) | set(measured), key=lambda k: (-k[1], k[0])))
    return Comparison(derivation.model, derivation.value("activations") + derivation.value("loss"),
                      measurement.activations, derivation.value("input"), measurement.input, rows,
                      tuple(sorted(measurement.by_op().items(), key=lambda kv: -kv[1])))


def with_loss(module: Any, loss: str) -> Any:
    """``module`` followed by ``loss`` (``cross-entropy``): a module taking ``(*inputs, target)``."""
    import torch
    import torch.nn.functional as F

    if loss != "cross-entropy":
        raise SymmemError(f"verify knows the loss 'cross-entropy', not {loss!r}")

    class WithLoss(torch.nn.Module):
        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, *args: Any) -> Any:
            *inputs, target = args
            logits = self.model(*inputs)
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

    return WithLoss(module)


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SymmemError("verification runs PyTorch, which is not installed: pip install torch==2.13.0 "
                          "(the CPU build), or pip install 'symmem[torch]'") from None


#: The share of the machine's memory (RAM for ``cpu``, the GPU's for ``cuda``) ``verify`` may use by default.
MEMORY_SHARE = 0.5


def machine_memory(device: str = "cpu") -> int | None:
    """Bytes of memory of ``device`` (physical RAM for ``cpu``), or None where it cannot be told."""
    if device != "cpu":
        import torch

        if not torch.cuda.is_available():
            return None
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    try:
        import os

        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        return None


def needed_memory(derivation: Derivation, step: bool = False) -> int:
    """Bytes the measurement holds, from the formula: for one forward pass the FP32 weights, the kept
    activations, the loss and the inputs (a lower bound: temporaries the forward frees are not counted); for a
    training step (``step``) the derived peak."""
    if step:
        return derivation.value("peak")
    return (4 * derivation.value("parameters") + derivation.value("activations") + derivation.value("loss")
            + derivation.value("input"))


def check_memory(derivation: Derivation, max_memory: int | None = None, step: bool = False) -> int:
    """The bytes :func:`verify` (``step``: :func:`verify_peak`) would allocate, refused with a
    :class:`SymmemError` beyond ``max_memory`` (default: :data:`MEMORY_SHARE` of the device's memory) before
    anything is allocated."""
    from ..units import format_bytes

    device = str(derivation.options.get("device", "cpu"))
    need = needed_memory(derivation, step)
    limit = max_memory
    if limit is None:
        total = machine_memory(device)
        limit = None if total is None else int(total * MEMORY_SHARE)
    if limit is not None and need > limit:
        raise SymmemError(f"verify would allocate at least {format_bytes(need)} ({need:,} B: "
                          f"{'the peak of a training step' if step else 'FP32 weights, kept activations and inputs'}"
                          f" of {derivation.model} at "
                          f"{', '.join(f'{s}={v}' for s, v in sorted(derivation.numbers.items(), key=str))}), "
                          f"more than the limit {format_bytes(limit)}; measure smaller sizes (e.g. --set B=2 "
                          f"--set L=2) or raise --max-memory")
    return need


def _reference(derivation: Derivation) -> tuple[Any, tuple[Any, ...], str, Any]:
    """The reference module at the derivation's numbers, its inputs (a loss target last when the derivation
    has a loss), the device, and the loss the step uses."""
    _require_torch()
    import torch

    from ..reference import reference

    numbers = {s.name: v for s, v in derivation.numbers.items()}
    options = dict(derivation.options)
    device = options.get("device", "cpu")
    if device != "cpu" and not torch.cuda.is_available():
        raise SymmemError(f"verify on {device} needs that device; this torch has no CUDA (use --device cpu)")
    module, inputs = reference(derivation.model, numbers, {**options, "checkpoint": derivation.regime.checkpoint})
    module = module.to(device)
    inputs = tuple(x.to(device) for x in inputs)
    loss = options.get("loss")
    target = None
    if loss:
        with torch.no_grad():
            logits = module(*inputs)
        target = torch.randint(0, logits.shape[-1], tuple(logits.shape[:-1]), device=device,
                               generator=torch.Generator(device).manual_seed(0))
        del logits
    return module, inputs, device, target


def verify(derivation: Derivation, max_memory: int | None = None) -> Comparison:
    """Build the reference module of ``derivation``'s model at its numbers, measure it on CPU, compare.

    The memory the measurement needs is derived first and refused beyond ``max_memory`` bytes (see
    :func:`check_memory`)."""
    _require_torch()

    if derivation.per_layer:
        raise SymmemError("verify measures whole models; drop --per-layer")
    if derivation.regime.activation_dtype != "float32":
        raise SymmemError("verify measures fp32 training; use --precision fp32")
    regime = derivation.regime
    if regime.checkpoint != "none" or regime.tensor_parallel or regime.sequence_parallel \
            or regime.pipeline_parallel:
        raise SymmemError("verify measures one plain forward pass: no checkpointing or model parallelism")
    check_memory(derivation, max_memory)
    module, inputs, device, target = _reference(derivation)
    loss = derivation.options.get("loss")
    if loss:
        if not getattr(module, "takes_labels", False):  # a language model computes its own loss from labels
            module = with_loss(module, str(loss))
        inputs = (*inputs, target)
    return compare(derivation, measure(module, *inputs))


@dataclass(frozen=True)
class PeakComparison:
    """The derived peak of a training step next to the live bytes a real step holds, first and steady step."""

    model: str
    predicted: int
    measured: int
    predicted_first: int
    measured_first: int
    predicted_where: str
    measured_where: str
    predicted_live: tuple[tuple[str, int], ...]
    measured_live: tuple[tuple[str, int], ...]

    @property
    def exact(self) -> bool:
        return self.predicted == self.measured and self.predicted_first == self.measured_first

    @property
    def error(self) -> float:
        """The larger relative error of the two steps' peaks."""
        return max(abs(self.predicted - self.measured) / self.measured,
                   abs(self.predicted_first - self.measured_first) / self.measured_first)

    def report(self) -> str:
        lines = [f"{self.model}: peak of a training step (live tensor bytes)",
                 f"  {'':<14}{'predicted':>16}{'measured':>16}{'difference':>14}",
                 f"  {'first step':<14}{self.predicted_first:>16,}{self.measured_first:>16,}"
                 f"{self.measured_first - self.predicted_first:>+14,}",
                 f"  {'steady step':<14}{self.predicted:>16,}{self.measured:>16,}"
                 f"{self.measured - self.predicted:>+14,}",
                 f"  where (steady): predicted {self.predicted_where}; measured {self.measured_where}",
                 f"  alive at the steady peak {'predicted':>18}{'measured':>16}"]
        measured = dict(self.measured_live)
        predicted = dict(self.predicted_live)
        for cat in dict.fromkeys([*predicted, *measured]):
            lines.append(f"    {cat:<22}{predicted.get(cat, 0):>16,}{measured.get(cat, 0):>16,}")
        lines.append("  exact" if self.exact else f"  NOT EXACT ({100 * self.error:.3f}%)")
        return "\n".join(lines)


def verify_peak(derivation: Derivation, max_memory: int | None = None) -> PeakComparison:
    """Run two real training steps of the reference module at the derivation's numbers under the live-bytes
    tracker (:mod:`symmem.record.steps`) and compare their peaks with the derived ``peak_first_step`` and ``peak``.

    The step is forward, the loss (the derivation's, else ``output.sum()``), backward, ``optimizer.step()`` with
    the regime's optimizer and implementation, ``zero_grad(set_to_none=True)``.
    """
    from ..passes.schedule import optimizer_impl
    from .steps import track_step

    regime = derivation.regime
    if derivation.per_layer:
        raise SymmemError("verify measures whole models; drop --per-layer")
    if regime.activation_dtype != "float32" or regime.optimizer not in ("sgd", "sgd-momentum", "adam", "adamw"):
        raise SymmemError("verify --peak runs fp32 training with sgd, sgd-momentum, adam or adamw")
    if regime.checkpoint == "selective" or regime.tensor_parallel or regime.pipeline_parallel or regime.zero:
        raise SymmemError("verify --peak runs one device's training step: full or every-K checkpointing, no "
                          "selective recomputation, no parallelism")
    check_memory(derivation, max_memory, step=True)
    module, inputs, device, target = _reference(derivation)
    impl = optimizer_impl(regime, device)
    loss = "cross-entropy" if derivation.options.get("loss") else "sum"
    trace = track_step(module, inputs, loss=loss, target=target, optimizer=regime.optimizer, impl=impl, steps=2,
                       keep_output=regime.keep_logits, micro_batches=regime.micro_batches)
    return peak_comparison(derivation, trace)


def peak_comparison(derivation: Derivation, trace: Any) -> PeakComparison:
    """The derived peaks of ``derivation`` (first and steady step) next to those of real steps (``trace``: a
    :class:`~symmem.record.steptrace.StepTrace` of two steps from :func:`~symmem.record.steps.track_step`)."""
    at = derivation.peak_at()
    live = tuple((c, n) for c, n in derivation.live_at_peak().items())
    return PeakComparison(derivation.model, derivation.value("peak"), trace.steady.bytes,
                          derivation.value("peak_first_step"), trace.first.bytes, at.where(), trace.steady.where,
                          live, tuple(trace.steady.by_category))
