"""Real pipeline runs of a traced module: ``torch.distributed.pipelining`` on gloo (CPU, 127.0.0.1), per stage.

The truth for :mod:`symmem.importer.traced_pipeline`.  A module whose forward runs its children one after another
(``before`` children, a ``ModuleList`` of blocks, ``after`` children: what ``torch.distributed.pipelining``'s manual
split holds -- the input layer on stage 0, ``L/p`` blocks each, the head and the loss on the last) is split by
:class:`SequentialSplit` and trained two steps on ``world`` gloo ranks under ``ScheduleGPipe`` or ``Schedule1F1B``
(FP32 AdamW, for-loop), each rank under the live-bytes recorder -- the same measurement as
:func:`symmem.record.model_parallel_runs.runs` makes for the reference models (:class:`StageRun` per rank).
Needs ``torch`` (with ``torch.distributed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError
from .model_parallel_runs import StageRun, forked_ranks, stage_steps, static_shapes


@dataclass(frozen=True)
class SequentialSplit:
    """The manual split of a module that runs ``before`` children, then each block of ``container``, then ``after``
    children, each on the output of the one before: stage ``rank`` of ``world`` as a module of its own."""

    before: tuple[str, ...]
    container: str
    after: tuple[str, ...]

    def stage(self, full: Any, rank: int, world: int) -> Any:
        from torch import nn

        blocks = full.get_submodule(self.container)
        if len(blocks) % world:
            raise SymmemError(f"{world} pipeline stages do not divide the {len(blocks)} blocks")
        each = len(blocks) // world
        first, last = rank == 0, rank == world - 1
        mods = [full.get_submodule(n) for n in self.before] if first else []
        mods += list(blocks[rank * each:(rank + 1) * each])
        mods += [full.get_submodule(n) for n in self.after] if last else []
        return nn.Sequential(*mods).train()


@dataclass(frozen=True)
class GPT2Split:
    """The manual split of Hugging Face's ``GPT2LMHeadModel``: stage 0 runs what ``GPT2Model.forward`` runs
    before the blocks (the token and position embeddings, their sum, dropout), every stage ``L/p`` blocks as
    ``GPT2Model`` calls them (no mask: causal attention; no cache), the last the final norm and the head.  Tied
    (transformers' default), each rank's model holds the one weight as ``wte`` and ``lm_head``; stage 0 keeps the
    first, the last stage the second: two copies, each stepped on its own rank (nothing synchronizes them)."""

    def stage(self, full: Any, rank: int, world: int) -> Any:
        import torch
        from torch import nn

        blocks = full.transformer.h
        if len(blocks) % world:
            raise SymmemError(f"{world} pipeline stages do not divide the {len(blocks)} blocks")
        each = len(blocks) // world
        first, last = rank == 0, rank == world - 1

        class Stage(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                if first:
                    self.wte, self.wpe, self.drop = full.transformer.wte, full.transformer.wpe, full.transformer.drop
                self.h = nn.ModuleList(blocks[rank * each:(rank + 1) * each])
                if last:
                    self.ln_f, self.lm_head = full.transformer.ln_f, full.lm_head

            def forward(self, x: Any) -> Any:
                if first:
                    embeds = self.wte(x.view(-1, x.shape[-1]))
                    positions = (torch.arange(embeds.shape[1]) + 0).unsqueeze(0)
                    # held to the stage's end, as GPT2Model.forward's local position_embeds is (the trace's)
                    held = self.wpe(positions)
                    x = self.drop(embeds + held)
                for block in self.h:
                    x = block(x, None, None, None, use_cache=False)
                    x = x[0] if isinstance(x, tuple) else x
                return self.lm_head(self.ln_f(x)) if last else x

        return Stage().train()


@dataclass(frozen=True)
class LlamaSplit:
    """The manual split of Hugging Face's ``LlamaForCausalLM`` -- and of the causal LMs built like it,
    ``MistralForCausalLM`` (a sliding-window mask) and ``Qwen2ForCausalLM`` (q/k/v biases, per-layer attention
    types): every stage runs the model's own ``model.forward`` (``LlamaModel``'s, ``MistralModel``'s,
    ``Qwen2Model``'s) itself on its ``L/p`` decoder layers -- stage 0 from the token ids through ``embed_tokens``, a
    later stage from the hidden states it receives (``inputs_embeds``) -- so each stage makes its own position ids,
    its causal (or sliding-window) mask and its rotary tables (``rotary_emb``, its frequencies a buffer of every
    stage) for its layers: one tensor crosses a boundary, the hidden states.  The final norm runs on the last stage
    (an identity before it), then the head as ``LlamaForCausalLM.forward`` runs it.  Qwen2's ``Qwen2Model`` picks
    layer ``i``'s mask by ``config.layer_types[i]`` counting its own layers from 0: each stage's config lists its
    layers' types (the stage's slice), as a stage built on its own would."""

    container = "model.layers"

    def stage(self, full: Any, rank: int, world: int) -> Any:
        from torch import nn

        blocks = full.model.layers
        if len(blocks) % world:
            raise SymmemError(f"{world} pipeline stages do not divide the {len(blocks)} blocks")
        each = len(blocks) // world
        first, last = rank == 0, rank == world - 1
        model = full.model
        model.layers = nn.ModuleList(blocks[rank * each:(rank + 1) * each])
        types = getattr(model.config, "layer_types", None)
        if types is not None:  # the stage's own layers' attention types (each rank builds its own model)
            model.config.layer_types = list(types[rank * each:(rank + 1) * each])
        if not first:
            model.embed_tokens = None
        if not last:
            model.norm = nn.Identity()

        class HFLlamaStage(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model
                if last:
                    self.lm_head = full.lm_head

            def forward(self, x: Any) -> Any:
                given = {"input_ids": x} if first else {"inputs_embeds": x}
                hidden = self.model(**given, use_cache=False).last_hidden_state
                return self.lm_head(hidden[:, slice(0, None), :]) if last else hidden

        return HFLlamaStage().train()


@dataclass(frozen=True)
class TracedCase:
    """One case: ``builder()`` gives (module, (input,)) at one micro-batch; ``split`` cuts it; ``schedule`` and
    ``M``; the loss (``cross-entropy`` over the last dimension, ``sum``, or ``output``: a Hugging Face model's own,
    its ``loss_function`` on the logits against labels) and the output's shape per micro-batch
    (static shapes for ``PipelineStage``, as torchtitan gives them), and the boundary's (between stages)."""

    builder: Callable[[], tuple[Any, tuple[Any, ...]]]
    split: SequentialSplit | GPT2Split | LlamaSplit
    schedule: str
    micro_batches: int
    loss: str
    output: tuple[int, ...]
    boundary: tuple[int, ...]


def _loss(kind: str, full: Any) -> Callable[[Any, Any], Any]:
    def own(out: Any, target: Any) -> Any:  # what a Hugging Face model given labels computes after its head
        return full.loss_function(out, target, vocab_size=out.shape[-1])

    def cross_entropy(out: Any, target: Any) -> Any:
        import torch

        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

    def total(out: Any, target: Any) -> Any:
        return out.sum()

    return {"cross-entropy": cross_entropy, "output": own}.get(kind, total)


def _one(case: TracedCase, rank: int, world: int) -> StageRun:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    full, (example,) = case.builder()
    module = case.split.stage(full, rank, world)
    m = case.micro_batches
    first, last = rank == 0, rank == world - 1
    given = static_shapes(first, last, example, case.output, case.boundary)
    stage = PipelineStage(module, rank, world, torch.device("cpu"), **given)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[case.schedule]
    sched = kind(stage, m, loss_fn=_loss(case.loss, full))
    batch, labels = batch_of(case, example)
    return stage_steps(sched, stage, module, batch, labels, rank, world, case.schedule, m)


def batch_of(case: TracedCase, example: Any, seed: int = 1) -> tuple[Any, Any]:
    """The step's batch (``M`` micro-batches like ``example``) and its labels (empty for the loss ``sum``), drawn
    from ``seed`` (also :mod:`.fsdp_pipeline_runs`: each data-parallel group its own)."""
    import torch

    m = case.micro_batches
    gen = torch.Generator().manual_seed(seed)
    if example.dtype.is_floating_point:
        batch = torch.randn((example.shape[0] * m, *example.shape[1:]), generator=gen)
    else:  # token ids
        batch = torch.randint(0, case.output[-1], (example.shape[0] * m, *example.shape[1:]), generator=gen)
    labels = torch.randint(0, case.output[-1], (case.output[0] * m, *case.output[1:-1]), generator=gen) \
        if case.loss in ("cross-entropy", "output") else torch.empty(case.output[0] * m, 0)
    return batch, labels


def _cases(rank: int, world: int, cases: Sequence[TracedCase]) -> list[StageRun]:
    return [_one(case, rank, world) for case in cases]


def traced_pipeline_runs(world: int, cases: Sequence[TracedCase], start_method: str = "fork"
                         ) -> list[list[StageRun]]:
    """Per rank, one :class:`StageRun` per case, every case in one gloo process group of ``world`` ranks (a rank
    that fails or hangs is a :class:`SymmemError`).  ``start_method="forkserver"`` forks them from the server
    :func:`symmem.record.distributed.measure_jobs` uses (the cases must then be picklable: a
    :class:`~symmem.importer.spec_builder.SpecBuilder` as the builder)."""
    import functools
    import importlib
    import multiprocessing

    importlib.import_module("torch.distributed.pipelining")  # imported once: the forked ranks inherit it
    if start_method == "forkserver":
        from .distributed import PRELOAD

        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))  # pipelining among them
    return forked_ranks(world, functools.partial(_cases, cases=list(cases)), start_method=start_method)
