"""Real model-parallel training steps, measured per rank: ``torch.distributed.pipelining`` on gloo (CPU, 127.0.0.1).

:func:`runs` starts ``world`` processes (forked: no second import of torch), joins them in one gloo
process group on a free 127.0.0.1 port with a timeout, and in each rank runs every case asked for -- a schedule
(``gpipe``: ``ScheduleGPipe``, ``1f1b``: ``Schedule1F1B``) and a micro-batch count ``M`` -- as two training steps
(the pipeline's forward and backward of ``M`` micro-batches, AdamW's step, ``zero_grad``) of that rank's stage
of a reference model (:mod:`symmem.reference.sequence_models`), under the live-bytes recorder
(:class:`~symmem.record.live_bytes.LiveTracker`, every storage autograd packs labelled ``saved``).  A stage is
what real pipelines build (torchtitan's ``pipeline_llm``, Megatron-LM): the embedding on the first stage, the
final norm and the head on the last, ``L/p`` layers each; GPT-2's tied head is a copy of the embedding on the last
stage (Megatron-LM keeps the word embeddings on both ends and all-reduces their gradients).

Each rank reports, per case: its parameter bytes, the largest live bytes of each step and the bytes by category
there, and the largest bytes autograd keeps saved at once.  Needs ``torch`` (with ``torch.distributed``).
"""

from __future__ import annotations

import datetime
import socket
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError

#: How long a rank waits for the others (process group and every collective), and for all of them to finish.
TIMEOUT_S = 60


@dataclass(frozen=True)
class StageRun:
    """One rank's measurement of one case: parameter bytes, the peak of each step and what was live then, and
    the largest saved (autograd-packed) bytes alive at once over the steps."""

    rank: int
    schedule: str
    micro_batches: int
    parameters: int
    peak: int
    at_peak: tuple[tuple[str, int], ...]
    saved: int
    #: the saved storages alive when ``saved`` was reached: (bytes, op, category, shape)
    saved_storages: tuple[tuple[int, str, str, tuple[int, ...]], ...]
    #: where the step peaked: (phase, op, where)
    peak_at: tuple[str, str, str]
    #: live bytes by category when the step starts
    start: tuple[tuple[str, int], ...]
    #: every storage alive at the peak
    peak_storages: tuple[tuple[int, str, str, tuple[int, ...]], ...]
    #: the largest live bytes while the schedule runs (forwards and backwards), and in the optimizer step
    pipeline_peak: int = 0
    step_peak: int = 0
    #: the first step's: its peak, and the largest live bytes of its schedule and of its optimizer step (AdamW
    #: makes its state there; without static shapes the engine's shape inference runs there too)
    first_peak: int = 0
    first_pipeline_peak: int = 0
    first_step_peak: int = 0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _llama_stage(full: Any, rank: int, world: int, each: int, sequence: int | None = None) -> Any:
    """A Llama stage (torchtitan's split): every stage makes its own rotary tables (and eager attention's mask)
    for the whole sequence, as the reference's ``LlamaModel`` part does before its layers, and lets them go after
    its layers (the last stage: after the final norm, before the head); its layers' cache copies live until the
    stage's forward returns.  ``sequence``: the whole sequence's length where the hidden stream it is given is
    S-split (sequence parallelism: torchtitan's tables cover the model's sequence, not the shard's)."""
    import torch
    from torch import nn

    from ..reference.sequence_models import DynamicCache, eager_mask, run_layers

    first, last = rank == 0, rank == world - 1

    class LlamaStage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if first:
                self.embed_tokens = full.embed_tokens
            self.layers = nn.ModuleList(full.layers[rank * each:(rank + 1) * each])
            self.rotary_emb, self.sdpa = full.rotary_emb, full.sdpa
            if last:
                self.norm, self.lm_head = full.norm, full.lm_head

        def body(self, x: Any, cache: Any) -> Any:
            hidden = self.embed_tokens(x) if first else x
            batch, seq = hidden.shape[0], sequence or hidden.shape[1]
            position_ids = (torch.arange(seq, device=hidden.device) + 0).unsqueeze(0)
            mask = None if self.sdpa else eager_mask(batch, seq, hidden.dtype, hidden.device)
            embeddings = self.rotary_emb(hidden, position_ids)
            # the stage's layers checkpointed as the whole model's are (run_layers: each layer, or each K), the
            # model's DynamicCache off there as HF turns it off
            if full.checkpoint == "selective":  # each layer's core checkpointed, called with the position ids
                hidden = run_layers(self.layers, hidden, "none", embeddings, mask, cache, position_ids)
            else:
                hidden = run_layers(self.layers, hidden, full.checkpoint, embeddings, mask, cache)
            return self.norm(hidden) if last else hidden

        def forward(self, x: Any) -> Any:
            cache = DynamicCache() if full.cache and full.checkpoint in ("none", "selective") else None
            hidden = self.body(x, cache)
            return self.lm_head(hidden) if last else hidden

    return LlamaStage()


def _stage_module(model: str, values: Mapping[str, int], rank: int, world: int, options: Mapping[str, Any],
                  sequence: int | None = None) -> Any:
    """Rank ``rank``'s stage of the reference ``model``: embedding on stage 0, norm and head on the last
    (``sequence``: :func:`_llama_stage`'s)."""
    import torch
    from torch import nn

    from ..reference.sequence_models import reference, run_layers

    torch.manual_seed(0)
    full, _ = reference(model, values, **options)
    layers = int(values["L"])
    if layers % world:
        raise SymmemError(f"{world} pipeline stages do not divide the L={layers} layers")
    each = layers // world
    first, last = rank == 0, rank == world - 1
    if model == "llama":
        stage = _llama_stage(full, rank, world, each, sequence)
        stage.train()
        return stage
    if model != "gpt2":
        raise SymmemError(f"no pipeline stages for {model!r} (gpt2 and llama)")

    # the stage holds the reference's parts, not the reference: its tied head would keep the embedding's first
    # tensor alive after FSDP2 shards the stage's (on a GPU, moved there after the baseline: docs/cuda.md)
    checkpoint = full.checkpoint

    class GPT2Stage(nn.Module):
        def __init__(self, full: Any) -> None:
            super().__init__()
            if first:
                self.wte, self.wpe, self.drop = full.wte, full.wpe, full.drop
            self.h = nn.ModuleList(full.h[rank * each:(rank + 1) * each])
            if last:
                self.ln_f = full.ln_f
                # untied: the last stage holds its own copy of the embedding as the head
                self.lm_head = nn.Linear(full.wte.weight.shape[1], full.wte.weight.shape[0], bias=False)
                with torch.no_grad():
                    self.lm_head.weight.copy_(full.wte.weight)

        def forward(self, x: Any) -> Any:
            if first:
                position_ids = torch.arange(x.size(-1), device=x.device).unsqueeze(0)
                x = self.drop(self.wte(x) + self.wpe(position_ids))
            x = run_layers(self.h, x, checkpoint)  # each layer checkpointed, or each K, as the model's
            if last:
                x = self.lm_head(self.ln_f(x))
            return x

    stage = GPT2Stage(full)
    del full
    stage.train()
    return stage


def _buffers(stage: Any) -> list[Any]:
    """The receive buffers a ``PipelineStage`` made: one per micro-batch and input (activations) or output
    (gradients), kept for the stage's life."""
    found = []
    for infos in [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]:
        found += [i.buffer for i in infos if getattr(i, "buffer", None) is not None]
    return found


def _sum_loss(out: Any, target: Any) -> Any:
    """The loss ``sum``: the output's sum (the target is not read)."""
    return out.sum()


def static_shapes(first: bool, last: bool, example: Any, output: tuple[int, ...], boundary: tuple[int, ...]
                  ) -> dict[str, Any]:
    """A ``PipelineStage``'s shapes given ahead (on meta, as torchtitan gives them): the first stage's input like
    ``example``, the last's output ``output``, every other tensor crossing a boundary ``boundary``."""
    import torch

    meta = torch.device("meta")

    def hidden() -> Any:
        return torch.empty(boundary, device=meta, requires_grad=True)

    given = {"input_args": torch.empty(example.shape, dtype=example.dtype, device=meta) if first else hidden(),
             "output_args": torch.empty(output, device=meta, requires_grad=True) if last else hidden()}
    if not last:
        given["output_grads"] = hidden()
    if not first:
        given["input_grads"] = hidden()
    return given


def stage_steps(sched: Any, stage: Any, module: Any, data: Any, labels: Any, rank: int, world: int, schedule: str,
                m: int) -> StageRun:
    """Two training steps of one pipeline stage under the live-bytes recorder (the schedule's step, AdamW's
    for-loop step, ``zero_grad``): the first stage is given ``data``, the last ``labels``; the
    :class:`StageRun`."""
    from .identity import tensors
    from .live_bytes import LiveTracker
    from .optim import make_optimizer, state_tensors

    first, last = rank == 0, rank == world - 1
    params = list(module.parameters())
    opt = make_optimizer(params, "adamw", "for-loop")
    tracker = LiveTracker()
    tracker.register(params, "parameter")
    tracker.register(list(module.buffers()), "buffer")  # Llama's rotary frequencies, on every stage
    # each stage holds the data it is given: the first the batch, the last the labels
    tracker.register([data] if first else [labels] if last else [], "input")
    hooks = tracker.watch_gradients(params)
    with tracker:
        for step in (1, 2):
            with tracker.phase(step, "forward"), tracker.saving():
                losses: list[Any] = []
                merged = sched.step(data) if first else sched.step(target=labels, losses=losses) if last else \
                    sched.step()
                # what the stage keeps between steps: its receive buffers (activations from the stage before,
                # gradients from the stage after), the last stage's logits of every micro-batch
                tracker.label(_buffers(stage), "buffer")
                tracker.label([t for out in stage.output_chunks for t in tensors(out)], "output")
                del merged, losses
            with tracker.phase(step, "step"):
                opt.step()
                tracker.label(state_tensors(opt), "optimizer_state")
            with tracker.phase(step, "zero_grad"):
                opt.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    return _summary(tracker.trace(), rank, schedule, m, sum(p.numel() * p.element_size() for p in params))


def _one_case(model: str, values: Mapping[str, int], rank: int, world: int, schedule: str, m: int,
              loss: str = "cross-entropy", options: Mapping[str, Any] | None = None, static: bool = True) -> StageRun:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ..reference.sequence_models import causal_lm_loss

    module = _stage_module(model, values, rank, world, options or {})
    b, s, v, h = int(values["B"]), int(values["S"]), int(values["V"]), int(values["H"])
    # static shapes, as torchtitan gives them (``static=False``: the dynamic mode's shape inference runs one
    # micro-batch more in the first step, freed before the schedule; measured, no stage's peak moves)
    given = static_shapes(rank == 0, rank == world - 1, torch.empty(b, s, dtype=torch.long, device="meta"),
                          (b, s, v), (b, s, h)) if static else {}
    stage = PipelineStage(module, rank, world, torch.device("cpu"), **given)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, m, loss_fn=causal_lm_loss if loss == "cross-entropy" else _sum_loss)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v, (b * m, s), generator=gen)
    # the loss sum reads no labels: an empty target (the schedule splits one per micro-batch all the same)
    labels = torch.randint(0, v, (b * m, s), generator=gen) if loss == "cross-entropy" else torch.empty(b * m, 0)
    return stage_steps(sched, stage, module, ids, labels, rank, world, schedule, m)


def _summary(trace: Any, rank: int, schedule: str, m: int, parameters: int) -> StageRun:
    """The steady step (the second), and the first step's peaks (it makes the receive buffers and the optimizer
    state; the last step's logits do not exist yet)."""
    records = [r for r in trace.records if r.step == 2]
    firsts = [r for r in trace.records if r.step == 1]
    top = max(records, key=lambda r: r.live)
    top_saved = max(records, key=lambda r: r.bytes("saved"))
    start = next(b for b in trace.boundaries if b.step == 1 and b.phase == "zero_grad")

    def alive(index: int, category: str | None) -> tuple[tuple[int, str, str, tuple[int, ...]], ...]:
        return tuple((s.nbytes, s.op or "", s.category, tuple(s.shape)) for s in trace.storages
                     if (category is None or s.category == category) and (s.born or 0) <= index
                     and (s.died is None or s.died > index))

    return StageRun(rank, schedule, m, parameters, top.live, top.by_category, top_saved.bytes("saved"),
                    alive(top_saved.index, "saved"), (top.phase, top.op, top.where), start.by_category,
                    alive(top.index, None), max(r.live for r in records if r.phase == "forward"),
                    max(r.live for r in records if r.phase == "step"), max(r.live for r in firsts),
                    max(r.live for r in firsts if r.phase == "forward"),
                    max(r.live for r in firsts if r.phase == "step"))


@dataclass(frozen=True)
class TensorRun:
    """One rank's measurement of a tensor-parallel step (DTensor, the standard Llama plan): the bytes autograd
    keeps after the forward (each storage once, a DTensor's local shard), the parameters' local bytes, the
    gradients' after backward, the optimizer state's after AdamW's first step; and the saved storages as
    (bytes, shape, the tensor's type)."""

    rank: int
    saved: int
    parameters: int
    gradients: int
    optimizer_state: int
    saved_storages: tuple[tuple[int, tuple[int, ...], str], ...]
    #: the live-bytes peak of each later step (forward, backward, AdamW, zero_grad; a DTensor's local shard), and
    #: where the last one is: (phase, op)
    peaks: tuple[int, ...] = ()
    peak_at: tuple[str, str] = ("", "")
    #: the first step's peak (a new AdamW makes its state) and the steady step's, each moment at its fewest bytes
    #: over the repeats (:func:`_fewest`)
    first_peak: int = 0
    steady_peak: int = 0
    #: the frees of recorded storages that ran off the recording thread (gloo's worker thread: ``StepTrace.late``),
    #: each as :func:`late_frees` names it
    late: tuple[str, ...] = ()


def llama_plan(module: Any, world: int) -> dict[str, Any]:
    """The standard tensor-parallel plan of a Llama (torchtitan's, the PyTorch tutorial's): the embedding
    row-wise, q/k/v/gate/up column-wise, o/down row-wise, the head column-wise with its output replicated; the
    attention's head counts divided by the group size."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {"embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i, layer in enumerate(module.layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "gate_proj", "up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
        layer.self_attn.num_heads //= world
        layer.self_attn.num_key_value_heads //= world
    return plan


def llama_sequence_plan(module: Any, world: int) -> dict[str, Any]:
    """The standard plan with sequence parallelism (torchtitan's): the norms ``SequenceParallel``, the layer input
    split over S between the row-parallel output's reduce-scatter and the column-parallel inputs' all-gather."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    plan: dict[str, Any] = {"embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                            "norm": SequenceParallel(),
                            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i, layer in enumerate(module.layers):
        plan[f"layers.{i}.input_layernorm"] = SequenceParallel()
        plan[f"layers.{i}.post_attention_layernorm"] = SequenceParallel()
        # (hidden_states, position_embeddings, attention_mask, cache): only the first gathered
        plan[f"layers.{i}.self_attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                                           desired_input_layouts=(Replicate(), None, None, None))
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        # the reference's MLP is no module of its own: gate and up each all-gather the normed input
        for name in ("gate_proj", "up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel(input_layouts=Shard(1))
        for name in ("self_attn.o_proj", "down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel(output_layouts=Shard(1))
        layer.self_attn.num_heads //= world
        layer.self_attn.num_key_value_heads //= world
    return plan


def _tensor_case(model: str, values: Mapping[str, int], rank: int, world: int, options: Mapping[str, Any]
                 ) -> TensorRun:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from ..reference.sequence_models import reference
    from .optim import make_optimizer, state_tensors
    from .sharded import local, saved_storages

    if model != "llama":
        raise SymmemError(f"the tensor-parallel plan is Llama's, not {model!r}")
    torch.manual_seed(0)
    options = dict(options)
    sequence = bool(options.pop("sequence_parallel", False))
    record = bool(options.pop("peaks", False))
    if options.pop("hf", False):  # transformers' own LlamaForCausalLM, the same plan on its module names
        from .hf_llama import hf_llama, hf_llama_forward, hf_llama_plan

        module, ids = hf_llama(values, sequence=sequence, **options)
        parallelize_module(module, init_device_mesh("cpu", (world,)), hf_llama_plan(module, world, sequence))
        run = hf_llama_forward(module, sequence)
    else:
        module, (ids,) = reference(model, values, **options)
        plan = (llama_sequence_plan if sequence else llama_plan)(module, world)
        parallelize_module(module, init_device_mesh("cpu", (world,)), plan)
        run = module  # its sequence is the ids' (whole under sequence parallelism): the tables and mask cover it

    params = list(module.parameters())
    held = {local(p).untyped_storage()._cdata for p in params} | {ids.untyped_storage()._cdata}
    out, saved = saved_storages(lambda: run(ids), lambda: held)
    kept = tuple(sorted(saved.values(), key=lambda v: (-v[0], v[1])))
    total = sum(v[0] for v in kept)
    out.sum().backward()
    opt = make_optimizer(params, "adamw", "for-loop")
    opt.step()

    def nbytes(ts: Any) -> int:
        return sum(local(t).numel() * local(t).element_size() for t in ts)

    grads = nbytes(p.grad for p in params if p.grad is not None)
    state = nbytes(state_tensors(opt))
    if not record:
        return TensorRun(rank, total, nbytes(params), grads, state, kept)
    # more steps under the recorder that sees DTensor's local ops, where asked (``peaks=True``)
    opt.zero_grad(set_to_none=True)
    del opt, out
    peaks, where, (first, steady), late = _tensor_peaks(run, ids, params, module)
    return TensorRun(rank, total, nbytes(params), grads, state, kept, peaks, where, first, steady, late)


#: Recorded steps of a tensor-parallel case: first steps (each with a new AdamW, which makes its state), then steady
#: ones; each moment's fewest bytes over the repeats is the engine's (see :func:`_fewest`).  One of each: funcol's
#: collectives release their tensors on the recording thread (:class:`~symmem.record.collectives.FuncolRelease`,
#: FSDP's under :func:`~symmem.record.collectives.released`), so a step's moments no longer move between repeats
#: (was 2 + 2; every run asserts no late free)
FIRST_STEPS, STEADY_STEPS = 1, 1
#: The same on a pipeline mesh (fsdp_pipeline_runs, ddp_pipeline_runs: p x N, p x t, p x N x t): one first step and
#: one steady step (was 3 + 3: four ranks sending and receiving micro-batches once left gloo's worker thread holding a
#: buffer past the same op in both of two repeats).  Every rank runs its jobs under :func:`released_collectives`
#: (:func:`_rank_main`), so every collective such a mesh calls through ``torch.distributed`` (FSDP2's all-gathers and
#: reduce-scatters, ZeroRedundancyOptimizer's broadcasts) frees its tensors on the recording thread at a fixed op,
#: DTensor's functional collectives run under :class:`~symmem.record.collectives.FuncolRelease`, and pipelining's
#: send works are dropped there: no repeat is left to take the fewest of (each rank reports ``late``, the frees that
#: ran on another thread; the tests assert none)
RELEASED_FIRST_STEPS, RELEASED_STEADY_STEPS = 1, 1
#: How long the recorder lets gloo's worker thread release a collective's tensors after each wait (ShardTracker)
SETTLE_S = 0.001


def repeated_steps(forward: Callable[[], Any], ids: Any, params: list[Any], module: Any, *,
                   resizes: bool = False, tracker: type | None = None) -> Any:
    """:data:`FIRST_STEPS` steps, each with a new for-loop AdamW (each a first step), then :data:`STEADY_STEPS`
    with the last one, the loss the output's sum, under the recorder that sees DTensor's local ops
    (:class:`~symmem.record.sharded.ShardTracker`, or the subclass ``tracker``; ``resizes``: FSDP's storage
    resizes too); the StepTrace."""
    from .optim import make_optimizer
    from .sharded import ShardTracker, local, train_steps

    # funcol's collectives released on this thread, inside each op (symmem.record.collectives.FuncolRelease): no
    # free of theirs waits for gloo's worker thread, so no settling pause either
    tracker = (tracker or ShardTracker)(release=True)
    tracker.register([local(p) for p in params], "parameter")
    tracker.register([local(b) for b in module.buffers()], "buffer")
    tracker.register([ids], "input")
    held: dict[str, Any] = {}

    def optimizer(step: int) -> Any:
        if step <= FIRST_STEPS:
            held.pop("opt", None)  # the last one's state goes before this step begins
            held["opt"] = make_optimizer(params, "adamw", "for-loop")
        return held["opt"]

    return train_steps(tracker, forward, lambda out: out.sum(), params, optimizer, FIRST_STEPS + STEADY_STEPS,
                       loss_phase="forward", resizes=resizes)


def _tensor_peaks(run: Any, ids: Any, params: list[Any], module: Any) -> tuple[tuple[int, ...], tuple[str, str],
                                                                              tuple[int, int], tuple[str, ...]]:
    """Training steps after the measured one, under the recorder that sees DTensor's local ops
    (:class:`~symmem.record.sharded.ShardTracker`, :func:`~symmem.record.sharded.train_steps`): each step's raw
    live-bytes peak, where the last one is, the first and steady step's peaks (:func:`_fewest`) and the late frees."""
    trace = repeated_steps(lambda: run(ids), ids, params, module)
    best: dict[int, tuple[int, str, str]] = {}
    for r in trace.records:
        if r.live > best.get(r.step, (-1, "", ""))[0]:
            best[r.step] = (r.live, r.phase, r.where)
    first = _fewest(trace, range(1, FIRST_STEPS + 1))
    steady = _fewest(trace, range(FIRST_STEPS + 1, FIRST_STEPS + STEADY_STEPS + 1))
    return tuple(best[k][0] for k in sorted(best)), best[max(best)][1:], (first, steady), late_frees(trace)


def late_frees(trace: Any, left_out: Collection[int] = ()) -> tuple[str, ...]:
    """Each storage of ``trace`` (less ``left_out``) freed off the recording thread, named: bytes, the op that made
    it, where, step and phase (none once every collective runs under :mod:`symmem.record.collectives`)."""
    return tuple(f"{s.nbytes} B of {s.op or 'the start'} at {s.where or '-'} (step {s.step} {s.phase})"
                 for s in (trace.storages[sid] for sid in trace.late) if s.sid not in left_out)


def _fewest(trace: Any, steps: range) -> int:
    """The largest moment of a step repeated ``steps``, each moment (the same op of every repeat) at its fewest
    bytes: gloo's worker thread releases a collective's tensors when it gets to them, after the wait or as late as
    the next collective, at no fixed op -- memory outside the step's tensor accounting, as the CUDA caching
    allocator's is; the step's own is what every repeat holds."""
    return _fewest_at(trace, steps)[0]


def _fewest_at(trace: Any, steps: range, left_out: Collection[int] = ()) -> tuple[int, tuple[str, str]]:
    """:func:`_fewest` less the storages ``left_out`` (:func:`_live`), and where that moment is (phase, op)."""
    live = _live(trace, left_out)
    rows = [[(v, r) for r, v in zip(trace.records, live, strict=True) if r.step == s] for s in steps]
    if len({len(r) for r in rows}) != 1:
        raise SymmemError(f"the repeated steps ran different ops ({', '.join(str(len(r)) for r in rows)})")
    columns = [min(column, key=lambda x: x[0]) for column in zip(*rows, strict=True)]
    v, r = max(columns, key=lambda x: x[0])
    return v, (r.phase, r.op)


def _live(trace: Any, left_out: Collection[int]) -> list[int]:
    """Each record's live bytes less the storages ``left_out`` alive there."""
    out = [(s.born, len(trace.records) if s.died is None else s.died, s.nbytes) for s in trace.storages
           if s.sid in left_out and s.born is not None]
    return [r.live - sum(n for born, died, n in out if born <= r.index < died) for r in trace.records]


#: the point-to-point calls :func:`released_collectives` leaves to c10d (pipelining's ``batch_isend_irecv``)
POINT_TO_POINT = ("isend", "irecv")


@contextmanager
def released_collectives() -> Iterator[None]:
    """:func:`~symmem.record.collectives.released` for the collectives (FSDP2's all-gathers and reduce-scatters,
    ZeroRedundancyOptimizer's broadcasts, all-reduces), not for pipelining's sends and receives: a released call's
    work lets go of its tensors at ``wait()``, while c10d's gloo work holds a send's tensor until the work itself is
    dropped (the schedule keeps its send works past their wait) -- the real engine's memory, measured: released, a
    stage's send buffer went early (Llama 1F1B M = 3 under FSDP, stage 0: 4,096 B below the real first and steady
    peak).  That work is dropped on the recording thread, so the free is at a fixed op all the same."""
    from .collectives import released

    with released(leave=POINT_TO_POINT):
        yield


def _rank_main(rank: int, world: int, port: int, work: Callable[[int, int], Any], out: Any) -> None:
    """One rank: join the gloo group on 127.0.0.1, put ``(rank, work(rank, world))`` (or the traceback), ``work``
    run under :func:`released_collectives`."""
    from .distributed import rank_starts

    rank_starts()
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=TIMEOUT_S))
        try:
            with released_collectives():  # their tensors released on this thread, at a fixed op (not gloo's)
                found = work(rank, world)
        finally:
            dist.destroy_process_group()
        out.put((rank, found))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises
        out.put((rank, traceback.format_exc()))


def forked_ranks(world: int, work: Callable[[int, int], Any], what: str = "the distributed run",
                 start_method: str = "fork") -> list[Any]:
    """``work(rank, world)`` on ``world`` processes in one gloo group (127.0.0.1, bounded waits); per rank, its
    result.  ``start_method`` ``fork``, or ``forkserver`` (``work`` then picklable: a module-level function or a
    ``functools.partial`` of one).  A rank that fails, dies or hangs is a :class:`SymmemError`."""
    import multiprocessing
    import queue
    import time

    if start_method not in ("fork", "forkserver"):
        raise SymmemError(f"the ranks start by 'fork' or 'forkserver', not {start_method!r}")
    ctx = multiprocessing.get_context(start_method)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, work, out)) for r in range(world)]
    for proc in procs:
        proc.start()
    found: dict[int, Any] = {}
    deadline = time.monotonic() + TIMEOUT_S * 2
    try:
        while len(found) < world:
            try:
                rank, result = out.get(timeout=1)
            except queue.Empty:
                dead = [(k, p.exitcode) for k, p in enumerate(procs) if p.exitcode not in (None, 0) and k not in found]
                if dead:  # a rank that died before it could report (killed, or its start failed)
                    raise SymmemError(f"rank {dead[0][0]} exited with code {dead[0][1]} before reporting") from None
                if time.monotonic() > deadline:
                    raise SymmemError(f"{what} did not finish in {TIMEOUT_S * 2} s") from None
                continue
            found[rank] = result
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    for rank in sorted(found):
        if isinstance(found[rank], str):
            raise SymmemError(f"rank {rank} failed:\n{found[rank]}")
    return [found[r] for r in range(world)]


_IMPORTS = {"tensor": ("torch.distributed.tensor.parallel", "torch.distributed.device_mesh"),
            "pipeline": ("torch.distributed.pipelining",)}


def runs(world: int, jobs: Sequence[tuple[str, str, Mapping[str, int], Any]]) -> list[list[Any]]:
    """Per rank, the result of every job in one process group: ``("pipeline", model, values, (schedule, M[,
    loss]))`` gives a :class:`StageRun`, ``("tensor", model, values, builder options)`` a :class:`TensorRun`."""
    import importlib

    # what the ranks import, imported once here: the forked ranks inherit it rather than each importing it
    for name in sorted({name for job in jobs for name in _IMPORTS.get(job[0], ())}):
        importlib.import_module(name)
    listed = [(k, m, dict(v), c) for k, m, v, c in jobs]

    def work(rank: int, world: int) -> list[Any]:
        return [_one_case(model, values, rank, world, *case) if kind == "pipeline"
                else _tensor_case(model, values, rank, world, case) for kind, model, values, case in listed]

    return forked_ranks(world, work)
