"""Whole training steps of a real module under the live-bytes recorder: :func:`track_step` (op by op, and
optionally the allocator's view) and :func:`allocator_step` (the profiler alone).

:func:`track_step` runs whole training steps under a :class:`~symmem.record.live_bytes.LiveTracker` and returns a
:class:`~symmem.record.steptrace.StepTrace`: one record per op with the live bytes right after the op (its outputs
counted; its inputs are still referenced while it runs, so that is the most the op needs) and the bytes per
category; frees between ops lower the next record.  The trace gives the peak and where it occurs, the peak of the
first and of the steady step, and live bytes at phase boundaries.  What the mode cannot see: memory a kernel
allocates and frees inside one op (``aten::mm``'s contiguous copies, convolution workspaces); ``allocator=True``
also runs the step under the PyTorch profiler's allocator events to measure that
(:class:`~symmem.record.steptrace.AllocatorPeaks`).  Needs ``torch`` (imported lazily; this module imports without
it).

>>> torch = getattr(__import__("pytest"), "importorskip")("torch")
>>> trace = track_step(torch.nn.Linear(4, 3), torch.zeros(2, 4), optimizer="sgd", steps=1)
>>> trace.start.live, trace.peak.bytes   # W 48 + b 12 + x 32; peak: + loss 4 + seed 4 + dW 48 + db 12 (y let go)
(92, 160)
>>> trace.peak.phase, trace.peak.op, trace.peak.record.bytes("gradient")   # db is born last: sum over the batch
('backward', 'aten.sum.dim_IntList', 60)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from ..errors import SymmemError
from .allocator import allocator_peaks, distinct_bytes
from .identity import first_tensor, require_torch, tensors
from .live_bytes import LiveTracker
from .modules import ModuleTracker
from .optim import make_optimizer, state_tensors
from .steptrace import AllocatorPeaks, StepTrace

#: the losses :func:`track_step` computes from the module's output (or pass a callable)
LOSSES: tuple[str, ...] = ("sum", "cross-entropy")


def loss_value(loss: str | Callable[[Any], Any], out: Any, target: Any) -> Any:
    """The loss of one step, on real or fake tensors alike: ``loss(out)`` for a callable; ``output``: the module's
    own (the output, or its ``.loss``, a Hugging Face model given labels); else the ``sum`` of the output's first
    tensor (:func:`~symmem.record.identity.first_tensor`), or its ``cross-entropy`` against ``target`` over the last
    dimension."""
    import torch

    if callable(loss):
        return loss(out)
    if loss == "output":
        value = getattr(out, "loss", None)
        value = out if value is None else value
        if not isinstance(value, torch.Tensor):
            raise SymmemError("loss='output': the module's output is neither a tensor nor has a .loss tensor "
                              "(Hugging Face models compute it when given labels)")
        return value
    first = first_tensor(out)
    if loss == "sum":
        return first.sum()
    return torch.nn.functional.cross_entropy(first.reshape(-1, first.shape[-1]), target.reshape(-1))


def _prepare(module: Any, inputs: Any, loss: str | Callable[[Any], Any], optimizer: str, impl: str, lr: float,
             target: Any, steps: int) -> tuple[tuple[Any, ...], Any, bool, Callable[[Any], Any], Any, list[Any]]:
    torch = require_torch()
    if steps < 1:
        raise SymmemError(f"steps must be at least 1, not {steps}")
    if not isinstance(module, torch.nn.Module):
        raise SymmemError(f"track_step needs a torch.nn.Module, got {type(module).__name__}")
    if not callable(loss) and loss not in LOSSES:
        raise SymmemError(f"unknown loss {loss!r}; choose from {', '.join(LOSSES)} or pass a callable")
    inputs = tuple(inputs) if isinstance(inputs, list | tuple) else (inputs,)
    module.train()
    takes_labels = bool(getattr(module, "takes_labels", False)) and loss == "cross-entropy"
    if loss == "cross-entropy" and target is None:
        if takes_labels:
            shape = tuple(inputs[0].shape)
            classes = int(getattr(getattr(module, "lm_head", None), "out_features", 0)) or int(inputs[0].max()) + 1
        else:
            with torch.no_grad():
                probe = first_tensor(module(*inputs))
            shape, classes = tuple(probe.shape[:-1]), int(probe.shape[-1])
            del probe
        # drawn on the CPU (the same target on every device), then put where the module's output is
        target = torch.randint(0, classes, shape, generator=torch.Generator().manual_seed(0)).to(inputs[0].device)

    def compute_loss(out: Any) -> Any:
        return loss_value(loss, out, target)

    params = [p for p in module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    if impl == "auto":  # PyTorch's own choice, as derive and trace take it: foreach on CUDA, a for-loop on the CPU
        impl = "foreach" if any(p.device.type == "cuda" for p in params) else "for-loop"
    return inputs, target, takes_labels, compute_loss, make_optimizer(params, optimizer, impl, lr), params


def _autocast(module: Any, autocast: str | None) -> Callable[[], Any]:
    """A fresh ``torch.autocast`` context for each forward and loss (or none), on the parameters' device."""
    import torch

    if autocast is None:
        return ExitStack
    if autocast not in ("bfloat16", "float16"):
        raise SymmemError(f"unknown autocast {autocast!r}; choose from bfloat16, float16")
    device = next((p.device.type for p in module.parameters()), "cpu")
    dtype = getattr(torch, autocast)
    return lambda: torch.autocast(device, dtype=dtype)


def _run(module: Any, inputs: tuple[Any, ...], target: Any, takes_labels: bool, compute_loss: Callable[[Any], Any],
         opt: Any, params: list[Any], steps: int, set_to_none: bool, tracker: LiveTracker | None,
         allocator: bool, keep_output: bool = False, micro_batches: int = 1,
         autocast: Callable[[], Any] = ExitStack) -> Any:
    """The training loop, under ``tracker`` (if any) and the profiler (if ``allocator``); returns the profiler.
    ``autocast`` makes the context forward and loss run under (``torch.autocast``, or nothing)."""
    import torch

    with ExitStack() as stack:
        prof = None
        if allocator:
            from torch.profiler import ProfilerActivity, profile, record_function

            prof = stack.enter_context(profile(activities=[ProfilerActivity.CPU], profile_memory=True))

        @contextmanager
        def phase(step: int, name: str) -> Iterator[None]:
            with tracker.phase(step, name) if tracker is not None else ExitStack():
                if prof is None:
                    yield
                    return
                # Entered with the dispatch mode off: inside the mode the profiler would close the range at once.
                from torch.utils._python_dispatch import _disable_current_modes

                marker = record_function(f"symmem/{step}/{name}")
                with _disable_current_modes():
                    marker.__enter__()
                try:
                    yield
                finally:
                    with _disable_current_modes():
                        marker.__exit__(None, None, None)

        def saving() -> Any:
            return tracker.saving() if tracker is not None else ExitStack()

        if tracker is not None:
            grad_hooks = tracker.watch_gradients(params)
            stack.callback(lambda: [h.remove() for h in grad_hooks])
            if tracker.modules is not None:
                stack.enter_context(tracker.modules)
            stack.enter_context(tracker)
        for step in range(1, steps + 1):
            for _ in range(micro_batches):  # gradient accumulation: the gradients add up over the passes
                with phase(step, "forward"), saving(), autocast():
                    out = module(*inputs, target) if takes_labels else module(*inputs)
                with phase(step, "loss"), saving(), autocast():
                    value = out if takes_labels else compute_loss(out)
                    if not keep_output:
                        out = None  # the loop does not hold the model's output: loss = f(model(x), y)
                with phase(step, "backward"):
                    handles = []
                    if tracker is not None:
                        tracker.label([*tensors(out), value] if out is not None else [value], "output")
                        handles = tracker.watch_backward(value)
                    value.backward()
                    for h in handles:
                        h.remove()
                    if tracker is not None:
                        tracker.label([p.grad for p in params], "gradient")
                    del out, value, handles
            with phase(step, "step"):
                if tracker is not None:  # ops on these storages serve that parameter
                    tracker.name_parameters([(name, t) for name, p in module.named_parameters()
                                             for t in (p, p.grad, *opt.state.get(p, {}).values())
                                             if isinstance(t, torch.Tensor)], reset=True)
                opt.step()
                if tracker is not None:
                    tracker.label(state_tensors(opt), "optimizer_state")
            with phase(step, "zero_grad"):
                opt.zero_grad(set_to_none=set_to_none)
    return prof



def track_step(module: Any, inputs: Any, *, loss: str | Callable[[Any], Any] = "sum", optimizer: str = "adamw",
               impl: str = "auto", steps: int = 2, zero_grad_set_to_none: bool = True, lr: float = 1e-3,
               target: Any = None, allocator: bool = False, keep_output: bool = False,
               micro_batches: int = 1, autocast: str | None = None) -> StepTrace:
    """Run ``steps`` training steps of ``module`` on ``inputs`` (a tensor or a tuple) under a :class:`LiveTracker`.

    Each step is: ``forward`` (``out = module(*inputs)``), ``loss`` (``out.sum()``, cross-entropy against
    ``target`` over the last dimension, or ``loss(out)``), ``backward`` (``loss.backward()``; the output is
    dropped as soon as the loss is computed, as in ``loss = f(module(x), y)``, the default of every front
    (:mod:`symmem.options`: Hugging Face's ``Trainer.compute_loss`` and Lightning's ``training_step`` return the
    loss and let the output go before ``backward``); ``keep_output=True`` holds it through backward, as a loop
    with ``out = module(x)`` in scope does (``keep_logits=True`` in :func:`symmem.trace`); ``micro_batches``
    forward/loss/backward passes accumulate gradients before each step), ``step`` (``optimizer.step()``; by
    default AdamW as PyTorch picks its implementation, ``impl="auto"``: the defaults of :func:`symmem.derive`
    and :func:`symmem.trace`), ``zero_grad``
    (``optimizer.zero_grad(set_to_none=zero_grad_set_to_none)``).  A module with ``takes_labels`` (the GPT-2
    and Llama references) computes its own loss as ``module(*inputs, target)`` in the forward (its ``loss``
    phase is empty).  Without ``target``, cross-entropy draws class indices (seeded) shaped like the output
    without its last dimension, from one ``no_grad`` forward before tracking.  The optimizer is built by
    :func:`make_optimizer`.  The module is put in training mode; its parameters are updated.  ``allocator=True``
    also records the CPU allocator's events with the profiler into :attr:`StepTrace.allocator`.  ``autocast``
    (``"bfloat16"`` or ``"float16"``) runs forward and loss under ``torch.autocast`` on the parameters' device, as a
    mixed-precision loop does (``backward`` and ``step`` outside it, as PyTorch's recipe says).

    >>> torch = getattr(__import__("pytest"), "importorskip")("torch")
    >>> net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    >>> t = track_step(net, torch.randn(2, 4), loss="cross-entropy", optimizer="adam")
    >>> params = t.start.bytes("parameter")                   # (4*8 + 8 + 8*3 + 3) * 4 bytes
    >>> t.live_at(2, "step") - t.start.live == 3 * params + 4 * 4   # grads, exp_avg, exp_avg_sq; 4 float steps
    True
    """
    inputs, target, takes_labels, compute_loss, opt, params = _prepare(module, inputs, loss, optimizer, impl, lr,
                                                                       target, steps)
    torch = require_torch()
    tracker = LiveTracker(ModuleTracker(module, tag=True))
    tracker.register(module.parameters(), "parameter")
    tracker.register(module.buffers(), "buffer")
    tracker.register([x for x in (*inputs, target) if isinstance(x, torch.Tensor)], "input")
    tracker.name_parameters(module.named_parameters())
    prof = _run(module, inputs, target, takes_labels, compute_loss, opt, params, steps, zero_grad_set_to_none,
                tracker, allocator, keep_output, micro_batches, _autocast(module, autocast))
    peaks = allocator_peaks(prof, tracker.start_bytes()) if prof is not None else None
    return tracker.trace(steps, peaks)


def allocator_step(module: Any, inputs: Any, *, loss: str | Callable[[Any], Any] = "sum", optimizer: str = "adamw",
                   impl: str = "auto", steps: int = 2, zero_grad_set_to_none: bool = True, lr: float = 1e-3,
                   target: Any = None, keep_output: bool = False) -> AllocatorPeaks:
    """The same steps as :func:`track_step` under the profiler alone: no dispatch mode, no hooks.

    Its peaks show what the tracker's instrumentation changes (nothing, in every case measured) and what the
    mode cannot see (allocations inside one op, and Python numbers wrapped as tensors before dispatch).
    """
    inputs, target, takes_labels, compute_loss, opt, params = _prepare(module, inputs, loss, optimizer, impl, lr,
                                                                       target, steps)
    torch = require_torch()
    start = distinct_bytes([*module.parameters(), *module.buffers(),
                             *(x for x in (*inputs, target) if isinstance(x, torch.Tensor))])
    prof = _run(module, inputs, target, takes_labels, compute_loss, opt, params, steps, zero_grad_set_to_none, None,
                True, keep_output)
    return allocator_peaks(prof, start)
