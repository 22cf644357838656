"""A traced module under pipeline parallelism: every stage's peak, as ``torch.distributed.pipelining`` runs it.

The built-in graphs' pipeline peak (:mod:`symmem.passes.pipeline_step`, :func:`symmem.passes.model_parallel.replays`)
cuts the single-device step's timeline (two micro-batches: the first makes the gradients, the second adds into
them) by stage and replays each stage's part in the schedule's order, with what the engine keeps beside it
(``fwd_cache``, the send works, the receive buffers, the last stage's ``output_chunks`` and ``merge_chunks``).  A
traced module gets the same replay (the same class runs it) from its own recorded step: :class:`TracedCut` is the
recorded step at numbers, cut by stage, in the form the replay reads, and :class:`TracedPipelineStep` is
:class:`~symmem.passes.pipeline_step.PipelineStep` with its two graph-specific parts -- the cut and each stage's
memory at rest and in the optimizer step -- taken from the record instead.

The cut is the manual split (torchtitan's, ``torch.distributed.pipelining``'s examples): the blocks of the run
symmem folds into ``L`` (``p`` must divide them) go ``L/p`` to a stage in order; what runs before the first block
(the input layer) is stage 0's, what runs after the last (the head, the loss) the last stage's; in backward the
other way round. The module's forward must pass one tensor from block to block and nothing else across a stage
boundary: a tensor made before the blocks and read by them (a mask, rotary tables) would be made on every stage,
which a recorded single-device step does not show -- refused in one line, but for Hugging Face Llama, Mistral and
Qwen2 (:data:`PER_STAGE`), whose manual split runs ``LlamaModel.forward`` (``MistralModel``'s, ``Qwen2Model``'s) on
every stage: the forward ops before the first block outside a module with parameters (position ids, the causal or
sliding-window mask, ``rotary_emb``) run on every stage,
each stage with its own copy of what they make (:func:`_prelude`, :func:`_stage_copies`), its rotary buffers on
every stage. So is a parameter a forward op reads on
another stage than its module's (a head written ``x @ self.emb.weight.T`` in the module's own code): the real stage
runs it only if it keeps the other stage's module too, a copy whose bytes depend on what the split keeps (the
recorded step notes each forward op's parameter reads, ``StepOptions.reads``). Each stage's optimizer step is the
recorded steady ``optimizer.step()``'s ops for the stage's parameters (the for-loop AdamW's temporaries), beside its
weights, gradients, state, receive buffers (one per micro-batch each way, the boundary's bytes), its inputs (stage
0: the batch; the last: the labels) and the last stage's logits of every micro-batch.

A module's own loss cannot run inside the last stage: ``torch.distributed.pipelining`` gives it only the previous
stage's output, and the target to the schedule's ``loss_fn``.  A Hugging Face model given ``labels`` (``hf:`` with
``--loss cross-entropy``) runs as the schedule's ``loss_fn = model.loss_function`` on the last stage's logits
(:func:`own_loss`): the same ops after the head, the labels on the last stage, the logits kept in ``output_chunks``.

>>> import torch
>>> from symmem.api import trace
>>> class Block(torch.nn.Module):
...     def __init__(self) -> None:
...         super().__init__()
...         self.norm, self.up = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)
...     def forward(self, x):
...         return x + self.up(self.norm(x))
>>> class Net(torch.nn.Module):
...     def __init__(self) -> None:
...         super().__init__()
...         self.inp, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
...         self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
...     def forward(self, x):
...         x = self.inp(x)
...         for block in self.blocks:
...             x = block(x)
...         return self.head(x)
>>> d = trace(Net(), (torch.randn(4, 8),), {"B": (0, 0)}, optimizer="adamw", loss="cross-entropy",
...           pipeline_parallel=True, pipeline_schedule="gpipe", micro_batches=2, values={"p": 2})
>>> d.step.per_stage(d.numbers)["peak_per_stage"], d.peak_at().where(step=False)
([15784, 14260], 'stage 0 of 2: pipeline aten.sum.dim_IntList (AddmmBackward0) in blocks.1.up, micro-batch 1')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from ..categories import RECORDED_TO_STEP
from ..errors import SymmemError
from ..passes.model_parallel import _passes, _Replay, requires
from ..passes.pipeline_step import PipelineStep
from ..timeline import Event, Live, Timeline
from .recording import StepRecord
from .traced_step import StepPeak, _locate, _node

#: the names the replay keeps to the end of the phase on the last stage (``output_chunks`` and the losses)
KEEP = ("logits", "loss")
#: how a storage made by an op every stage runs (:func:`_prelude`) names stage 0's copy's maker
MADE = " [made on stage 0]"
#: the Hugging Face model types whose stages each make what runs before the blocks outside a module with
#: parameters (position ids, the causal or sliding-window mask, rotary tables): measured on their manual split
#: (record/traced_pipeline_runs.LlamaSplit: Llama; Mistral with a sliding window; Qwen2, its q/k/v biases)
PER_STAGE = ("llama", "mistral", "qwen2")


def _stage_of_ops(rec: StepRecord, p: int) -> dict[int, int]:
    """The stage of every forward, loss and backward op: a block's by its index (``L/p`` blocks a stage); outside
    the blocks, before the first block's op in a pass: stage 0 in forward, the last in backward; after the last
    block's op the other way round."""
    if not rec.layers or rec.count is None:
        raise SymmemError("pipeline stages split the run of repeated blocks symmem folds into L; this module has none")
    if rec.count % p:
        raise SymmemError(f"p={p} pipeline stages do not divide the module's {rec.count} blocks (an even split)")
    per = rec.count // p
    out: dict[int, int] = {}
    seen_block = False
    phase = None
    for o in rec.ops:
        if o.phase not in ("forward", "loss", "backward"):
            continue
        kind = "B" if o.phase == "backward" else "F"
        if kind != phase:  # a new forward or backward: what runs outside the blocks starts on its first side
            seen_block, phase = False, kind
        _, index = _locate(o, rec.layers)
        if index is None:
            start, end = (0, p - 1) if kind == "F" else (p - 1, 0)
            out[o.index] = end if seen_block else start
            continue
        seen_block = True
        out[o.index] = index // per
    return out


class TracedCut:
    """A recorded two-micro-batch step at ``numbers`` (symbol name -> value), cut into ``p`` stages: what
    :class:`symmem.passes.model_parallel._Replay` reads (``tl``, ``passes``, ``forwards``, ``frees``, ``keep``,
    ``size``, ``stage_of``, ``on``).  Each op's node is its name (``aten.mm.default (AddmmBackward0) in
    blocks.3.up``), made unique per stage where one name runs on two (the module's own code: ``[stage 0]``)."""

    def __init__(self, rec: StepRecord, p: int, numbers: Mapping[str, int], own: bool = False,
                 per_stage: bool = False) -> None:
        # own: the module computes its own loss (:func:`own_loss`), which the schedule's loss_fn runs instead;
        # per_stage: what runs before the blocks outside a module with parameters (Llama's position ids and rotary
        # tables) runs on every stage, as each stage of the manual split makes them for itself (LlamaSplit)
        self.rec, self.p, self.own = rec, p, own
        self.subs = {sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v) for k, v in numbers.items()}
        stages = _stage_of_ops(rec, p)
        prelude = _prelude(rec, stages) if per_stage else set()
        self.stage: dict[str, int] = {}
        names: dict[int, str] = {}
        for o in rec.ops:
            if o.index not in stages:
                continue
            name = _node(o, o.module if o.phase == "backward" else o.where)
            if self.stage.setdefault(name, stages[o.index]) != stages[o.index]:
                name = f"{name} [stage {stages[o.index]}]"
                self.stage[name] = stages[o.index]
            names[o.index] = name
        self.shared: set[str] = {names[i] for i in prelude}
        # the module's output (each micro-batch's logits: output_chunks) and the loss, kept to the end of the phase
        outputs = _outputs(rec, own)
        born_by = {i: names.get(o.index) for o in rec.ops for i in o.born}
        storages = []
        for s in rec.storages:
            name = "logits" if s.sid in outputs else "loss" if s.category == "output" else str(s.sid)
            # what a shared op makes is stage 0's; every other stage's copy is a storage of its own (below)
            node = f"{born_by[s.sid]}{MADE}" if born_by.get(s.sid) in self.shared else born_by.get(s.sid)
            storages.append(Live(name, RECORDED_TO_STEP[s.category], s.nbytes, node, s.host))
        freed = _seed_frees(rec, stages, p)
        born = {o.index: o.born for o in rec.ops}
        if prelude:
            _stage_copies(rec, stages, p, prelude, storages, born, freed)
            for k, st in enumerate(storages):
                if st.node is not None and (k >= len(rec.storages) or st.node.endswith(MADE)):
                    self.stage[st.node] = int(st.name.rsplit("@", 1)[1]) if k >= len(rec.storages) else 0
        events = tuple(Event("forward" if o.phase == "loss" else o.phase, names.get(o.index), born[o.index],
                             freed.get(o.index, o.freed), o.resized) for o in rec.ops)
        start = tuple(i for i in rec.start if i not in set(rec.freed_first))
        self.tl = Timeline(tuple(storages), start, events)
        self.cache: dict[Any, int] = {}
        self.keep = set(KEEP)
        self.passes = _passes(self.tl)
        if len(self.passes) != 2:
            raise SymmemError("the pipeline replay reads a step of two micro-batches; the recorded step has "
                              f"{len(self.passes)}")
        self.forwards = {k for pass_ in self.passes for k, _ in pass_["F"]}
        self.frees: dict[int, int] = {}
        for k, e in enumerate(self.tl.events):
            for sid in e.freed:
                self.frees.setdefault(sid, k)
        self.boundary = self._boundaries()
        self._one_stream(stages, prelude)
        _reads_on_one_stage(rec, self, stages)

    def _one_stream(self, stages: Mapping[int, int], prelude: set[int]) -> None:
        """Refuse a module whose blocks keep for backward more than the stream made before them: a tensor its own
        code makes once and every block reads (Llama's rotary tables), which each real stage makes for itself --
        unless made by the ``prelude`` every stage runs (Hugging Face Llama's, :class:`LlamaSplit`)."""
        found = _read_by_blocks(self.rec, stages, self.frees)
        made = {i for o in self.rec.ops if o.index in prelude for i in o.born}
        if len(found) > 1 and len([i for i in found if i not in made]) == 1:
            return
        if len(found) > 1:
            what = ", ".join(f"{self.tl.storages[i].nbytes} bytes at {self.tl.storages[i].node}" for i in found)
            raise SymmemError(f"the blocks keep for backward more than one tensor made before them ({what}): what "
                              "the layers read besides the stream every stage would make for itself (not modelled "
                              "for traced modules)")

    def size(self, sid: int) -> int:
        e = self.tl.storages[sid].nbytes
        if e not in self.cache:
            value = sympy.sympify(e, strict=True).xreplace(self.subs)
            if not value.is_number:
                missing = ", ".join(sorted(map(str, value.free_symbols)))
                raise SymmemError(f"the pipeline peak needs values for {missing}")
            self.cache[e] = int(value)
        return self.cache[e]

    def stage_of(self, node: str | None) -> int:
        return self.p - 1 if node is None else self.stage.get(node, self.p - 1)

    def on(self, node: str | None, s: int) -> bool:
        return node in self.shared or self.stage_of(node) == s

    def _boundaries(self) -> list[int]:
        """The bytes each stage sends on, per micro-batch (its receive buffers' and the next stage's): the one
        tensor of the first pass made on stage ``s`` and last read on a later stage; anything else crossing a
        boundary is refused (each stage would make its own)."""
        out = []
        for s in range(self.p - 1):
            crossing = []
            for _, e in self.passes[0]["F"]:
                if self.stage_of(e.node) != s:
                    continue
                for sid in e.born:
                    if self.stage_of(self.tl.storages[sid].node) != s:  # another stage's copy (a shared op's)
                        continue
                    end = self.frees.get(sid)
                    # kept for a later stage's backward: what it is sent (what a later stage's forward frees is
                    # gone with this stage's forward in the replay: the module's locals, freed as its forward returns)
                    if end is not None and end not in self.forwards and self.stage_of(self.tl.events[end].node) > s \
                            and self.tl.storages[sid].category != "gradient":
                        crossing.append(sid)
            if len(crossing) != 1:
                what = ", ".join(f"{self.tl.storages[i].nbytes} bytes made at {self.tl.storages[i].node}"
                                 for i in crossing) or "nothing"
                raise SymmemError(f"stage {s} passes on {what}: a traced module's stages pass one tensor from block "
                                  "to block (what its layers read besides, made before them, every stage would make "
                                  "for itself: not modelled for traced modules)")
            out.append(self.size(crossing[0]))
        return out


def _prelude(rec: StepRecord, stages: Mapping[int, int]) -> set[int]:
    """The forward ops every stage runs for itself: in each forward, those before the first block's op run by the
    module's own code or a module without parameters of its own (Llama's position ids, its causal mask's checks,
    ``rotary_emb``'s tables), not by a module holding parameters (the embedding: stage 0's)."""
    holders = {name.rsplit(".", 1)[0] if "." in name else "" for name in _param_names(rec).values()}
    out: set[int] = set()
    before = True
    for o in rec.ops:
        if o.phase != "forward":
            before = True
            continue
        if _locate(o, rec.layers)[1] is not None:
            before = False
        elif before and o.index in stages and o.where not in holders:
            out.add(o.index)
    return out


def _stage_copies(rec: StepRecord, stages: Mapping[int, int], p: int, prelude: set[int], storages: list[Live],
                  born: dict[int, tuple[int, ...]], freed: dict[int, tuple[int, ...]]) -> None:
    """Every stage's own copy of what the ``prelude`` ops make (appended to ``storages``, added to ``born`` and
    ``freed``): freed by the op that frees stage 0's, or, freed in a backward of stage 0's block ``j`` (the rotary
    tables: the block's last use), by the same op of the stage's first blocks' backward (block ``j + s L/p``)."""
    assert rec.count is not None and rec.layers is not None
    per = rec.count // p
    ops = rec.ops
    frees = {}
    for o in ops:
        for sid in freed.get(o.index, o.freed):
            frees.setdefault(sid, o.index)
    # each backward run of a block: (block index, the pass's backward number) -> its first op
    runs: dict[tuple[int, int], int] = {}
    backward, previous = -1, None
    for o in ops:
        if o.phase == "backward" and previous != "backward":
            backward += 1
        previous = o.phase
        if o.phase == "backward":
            index = _locate(o, rec.layers)[1]
            if index is not None:
                runs.setdefault((index, backward), o.index)
    run_of = {}
    for (index, b), start in runs.items():
        run_of[start] = (index, b)
    for s in range(1, p):
        for i in sorted(prelude):
            copies = []
            for sid in ops[i].born:
                copy = len(storages)
                st = storages[sid]
                node = f"{st.node.removesuffix(MADE)} [stage {s}]"
                storages.append(Live(f"{st.name}@{s}", st.category, st.nbytes, node, st.host))
                copies.append(copy)
                k = frees.get(sid)
                if k is None:
                    continue
                o = ops[k]
                index = _locate(o, rec.layers)[1] if o.phase == "backward" else None
                if o.phase == "backward" and (index is None or stages.get(k) != 0):
                    raise SymmemError(f"what every stage makes before its blocks ({st.nbytes} bytes at {st.node}) is "
                                      "freed outside the first stage's blocks' backward: each stage's copy is not "
                                      "followed")
                if index is not None:
                    start = max(x for x in run_of if x <= k and run_of[x][0] == index)
                    _, b = run_of[start]
                    k2 = runs[(index + s * per, b)] + (k - start)
                    if (ops[k2].op, _locate(ops[k2], rec.layers)[0]) != (o.op, _locate(o, rec.layers)[0]):
                        raise SymmemError(f"stage {s}'s blocks' backward does not free its copy of {st.node}'s "
                                          "output where stage 0's does: each stage's copy is not followed")
                    k = k2
                freed[k] = (*freed.get(k, ops[k].freed), copy)
            born[i] = (*born[i], *copies)


def _reads_on_one_stage(rec: StepRecord, cut: TracedCut, stages: Mapping[int, int]) -> None:
    """Refuse a parameter a forward op reads on another stage than its module's (a head written ``x @
    self.emb.weight.T`` in the module's own code, a module run before and after the blocks): the real stage runs
    that code only if it keeps the module too -- its own copy of the parameter, with its gradient and optimizer
    state, and the module's other parameters without (measured on gloo) -- which the cut does not model."""
    if not rec.reads:
        return
    names = _param_names(rec)
    owner = _owners(rec, cut)
    for index, sids in sorted(rec.reads.items()):
        at = stages.get(index)
        for sid in sids:
            if at is None or sid not in owner or owner[sid] == at:
                continue
            raise SymmemError(
                f"the parameter {names[sid]} is read on stage {at} of {cut.p} ({cut.tl.events[index].node}) but "
                f"held on stage {owner[sid]}, its module's: a real stage runs that read only if it keeps the module "
                "too (a copy of the parameter with its own gradient and optimizer state, not synchronized), which "
                "is not modelled for traced modules; give the read a module of its own holding the parameter, tied "
                "(as a head tied to the embedding: symmem counts each stage's copy)")


def _read_by_blocks(rec: StepRecord, stages: Mapping[int, int], frees: Mapping[int, int]) -> list[int]:
    """What the first forward makes before its blocks and keeps for a block's backward (freed by an op of a block):
    the stream the first block reads, and anything else the blocks read (rotary tables made once)."""
    found = []
    for o in rec.ops:
        if o.phase != "forward" or o.index not in stages:
            continue
        if _locate(o, rec.layers)[1] is not None:
            break
        for sid in o.born:
            end = frees.get(sid)
            if end is not None and rec.ops[end].phase == "backward" and _locate(rec.ops[end], rec.layers)[1] \
                    is not None:
                found.append(sid)
    return found


def _seed_frees(rec: StepRecord, stages: Mapping[int, int], p: int) -> dict[int, tuple[int, ...]]:
    """The ops' frees with each backward's seed (the loss's gradient, made by its first op, which ``backward()``
    holds to its end) freed after the last stage's last op of that backward instead: the last stage's
    ``backward()`` ends there, and its seed is not a gradient sent to the stage before."""
    out: dict[int, tuple[int, ...]] = {}
    runs: list[list[Any]] = []
    for o in rec.ops:
        if o.phase == "backward":
            if not runs or runs[-1][-1].index != o.index - 1:
                runs.append([])
            runs[-1].append(o)
    for run in runs:
        seed = set(run[0].born)
        end = max((o.index for o in run if stages.get(o.index) == p - 1), default=run[-1].index)
        for o in run:
            if seed & set(o.freed):
                out[o.index] = tuple(i for i in out.get(o.index, o.freed) if i not in seed)
        out[end] = (*(i for i in out.get(end, rec.ops[end].freed)), *sorted(seed))
    return out


def _outputs(rec: StepRecord, own: bool = False) -> set[int]:
    """Each forward's output (the logits the last stage keeps in ``output_chunks``): the last storage its forward
    makes that the forward does not free; with the module's own loss (``own``), the last storage a submodule makes
    (the head's logits: the loss, made in the module's own code after it, is the schedule's ``loss_fn``'s)."""
    out: set[int] = set()
    run: list[Any] = []
    for o in [*rec.ops, None]:
        if o is not None and o.phase == "forward":
            run.append(o)
            continue
        if run:
            freed = {i for x in run for i in x.freed}
            found = [i for x in run for i in x.born if i not in freed]
            if own:  # the module's own loss: the stage returns what its last submodule made (the head's logits)
                found = [i for x in run if x.where for i in x.born]
            if not found:
                raise SymmemError("a forward of the recorded step makes no output it keeps: the last stage's "
                                  "logits (output_chunks) are not found")
            out.add(found[-1])
            run = []
    return out


def stage_memory(cut: TracedCut, m: int) -> list[dict[str, int]]:
    """Each stage's memory outside the replayed ops, as the replay reads it: ``at_rest`` (weights, optimizer state,
    receive buffers, inputs and the last step's logits: what the stage keeps between steps), ``outputs`` (those
    logits), ``optimizer_state``, ``parameters`` (the weights: a tied parameter once on each stage that holds it),
    ``module_buffers`` (the module's buffers, which every stage holds: the parameter side per rank's, beside the
    weights) and ``step_peak`` (the steady optimizer step's largest moment)."""
    rec, p = cut.rec, cut.p
    owner = _owners(rec, cut)
    state = set(rec.state())
    by_name = {n: sid for sid, n in _param_names(rec).items()}
    made_for = _state_owners(rec, state)
    forward_born = min((i for o in rec.ops if o.phase == "forward" for i in o.born), default=len(rec.storages))
    # a module's buffers (refused but for a per_stage model's: Llama's rotary frequencies, on every stage's
    # rotary_emb)
    kept = sum(cut.size(i) for i in rec.start if rec.storages[i].category == "buffer")
    out = []
    for s in range(p):
        first, last = s == 0, s == p - 1
        weights = sum(cut.size(i) for i, st in owner.items() if st == s)
        opt = sum(cut.size(i) for i in state if owner.get(by_name.get(made_for.get(i, ""), -1)) == s)
        grads = weights  # FP32 AdamW: each trainable parameter's gradient is its size
        buffers = (0 if first else m * cut.boundary[s - 1]) + (0 if last else m * cut.boundary[s])
        inputs = [i for i in rec.start if rec.storages[i].category == "input"]
        given = [i for i in inputs if i < forward_born]
        # the module's own loss (hf: labels given last, own_loss): the schedule's target, on the last stage
        target = [i for i in inputs if i >= forward_born] + (given[-1:] if cut.own else [])
        batch = sum(cut.size(i) for i in given if i not in target)
        labels = sum(cut.size(i) for i in target)
        logits = cut.size(next(i for i, x in enumerate(cut.tl.storages) if x.name == "logits"))
        held = m * ((batch if first else 0) + (labels if last else 0))
        outputs = m * logits if last else 0
        at_rest = weights + opt + buffers + held + outputs + kept
        out.append({"at_rest": at_rest, "outputs": outputs, "optimizer_state": opt, "parameters": weights,
                    "module_buffers": kept, "step_peak": _step_peak(rec, cut, s, owner, at_rest + grads)})
    return out


def _state_owners(rec: StepRecord, state: set[int]) -> dict[int, str]:
    """The parameter each optimizer state storage is for: the op's (its ``where``), except what is made before the
    parameter's first read (AdamW's ``step``, ``torch.tensor(0.0)`` first in ``_init_group``): the next one's."""
    out: dict[int, str] = {}
    pending: list[int] = []
    for o in rec.ops:
        if o.phase != "step" or o.step != 1:
            continue
        for i in o.born:
            if i not in state:
                continue
            if o.op == "aten.lift_fresh.default":
                pending.append(i)
                continue
            out[i] = o.where
            for j in pending:
                out[j] = o.where
            pending = []
    if pending:
        raise SymmemError("the recorded optimizer step made state for no parameter after its step counts: the "
                          "stages' optimizer state is not followed")
    return out


def _owners(rec: StepRecord, cut: TracedCut) -> dict[int, int]:
    """Each trainable parameter's storage and its stage: a block's by its index, else the stage of the first forward
    op of the module that holds it."""
    names = _param_names(rec)
    first_at: dict[str, int] = {}
    for o in rec.ops:
        if o.phase == "forward" and o.module not in first_at:
            first_at[o.module] = cut.stage_of(cut.tl.events[o.index].node)
    out = {}
    for sid, name in names.items():
        module = name.rsplit(".", 1)[0] if "." in name else ""
        if module not in first_at:
            raise SymmemError(f"the parameter {name} is used by no forward op of its module: its stage is not known")
        out[sid] = first_at[module]
    return out


def _param_names(rec: StepRecord) -> dict[int, str]:
    """Each parameter's storage and name: the steady optimizer step's ops run per parameter, under its name,
    reading it (the for-loop step's first op for a parameter is its own update's)."""
    params = [i for i in rec.start if rec.storages[i].category == "parameter"]
    order = list(dict.fromkeys(o.where for o in rec.ops if o.phase == "step" and o.step == 2 and o.where))
    if len(order) != len(params):
        raise SymmemError(f"the recorded optimizer step ran for {len(order)} parameters of {len(params)} (frozen or "
                          "shared parameters): the stages' parameters are not followed")
    return dict(zip(params, order, strict=True))


def _step_peak(rec: StepRecord, cut: TracedCut, s: int, owner: Mapping[int, int], base: int) -> int:
    """The largest moment of the stage's steady optimizer step: ``base`` (at rest and every gradient) and the
    temporaries the recorded step makes for the stage's parameters, in order."""
    names = _param_names(rec)
    mine = {names[i] for i, st in owner.items() if st == s}
    live = best = base
    made: set[int] = set()
    for o in rec.ops:
        if o.phase != "step" or o.step != 2 or o.where not in mine:
            continue
        for i in o.born:
            made.add(i)
            live += cut.size(i)
        best = max(best, live)
        for i in o.freed:
            if i in made:
                live -= cut.size(i)
                made.discard(i)
    return best


@dataclass(eq=False)
class TracedPipelineStep(PipelineStep):
    """:class:`~symmem.passes.pipeline_step.PipelineStep` of a traced module: the replay of its recorded
    two-micro-batch step (``step``, a :class:`~symmem.importer.traced_step.StepPeak`) cut into ``p`` stages."""

    step: StepPeak | None = None

    def _stages(self) -> Any:
        return None

    def _record(self, named: Mapping[str, int]) -> StepRecord:
        assert self.step is not None
        count = named.get(self.step.symbol.name) if self.step.symbol is not None else None
        return self.step.record(int(count) if count is not None else None)

    def _formula_extra(self, named: Mapping[str, int]) -> Any:
        """The record's storages as formulas in the module's sizes (:mod:`.traced_formula`), the blocks at their
        number; None for a subclass (an engine around the stages: its moments stay lines in B)."""
        if type(self) is not TracedPipelineStep:
            return None
        from .traced_formula import TracedFormulas

        return {"engine": TracedFormulas(self, named, stage_memory, TracedCut._boundaries)}

    def _make_replays(self, numbers: Mapping[str, int]) -> list[Any]:
        """Every stage's replay of the step recorded at ``numbers``, cut into ``p`` stages."""
        p = numbers.get("p")
        rec = self._record(numbers)
        requires(p, rec.count, self.schedule, self.micro_batches)
        cut = TracedCut(rec, int(p), numbers, own_loss(self.step), per_stage(self.step))  # type: ignore[arg-type]
        assert self.step is not None
        untie = stage_copies(self.step.module, rec, cut, self.step.options.untie)
        if untie != self.step.options.untie:  # a tied parameter two modules of one stage share: one copy there
            self.step = dataclasses.replace(self.step, options=dataclasses.replace(self.step.options, untie=untie),
                                            _records={}, _peaks={}, _shared={})
            rec = self._record(numbers)
            cut = TracedCut(rec, int(p), numbers, own_loss(self.step), per_stage(self.step))  # type: ignore[arg-type]
        return [_Replay(cut, s, at, self.schedule, self.micro_batches)  # type: ignore[arg-type]
                for s, at in enumerate(stage_memory(cut, self.micro_batches))]


def tied(module: Any) -> list[tuple[str, ...]]:
    """Each parameter ``module`` holds under several names (a tied head's and the embedding's): its names, in the
    order ``named_parameters(remove_duplicate=False)`` lists them."""
    names: dict[int, list[str]] = {}
    for name, q in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(q), []).append(name)
    return [tuple(n) for n in names.values() if len(n) > 1]


def split_ties(module: Any) -> tuple[tuple[str, ...], ...]:
    """Every name of a tied parameter but its first given a parameter of its own (``StepOptions.untie``): what the
    stages hold where each name is on another stage (:func:`stage_copies` merges what one stage shares)."""
    return tuple((n,) for names in tied(module) for n in names[1:])


def stage_copies(module: Any, rec: StepRecord, cut: TracedCut, untie: tuple[tuple[str, ...], ...]
                 ) -> tuple[tuple[str, ...], ...]:
    """``untie`` as the stages hold ``module``'s tied parameters: a stage holds one copy of one, whichever of its
    modules read it (the first name's stage the original, every other stage its own, with its gradient and
    optimizer state: ``torch.distributed.pipelining`` does not synchronize them).  ``rec`` was recorded with
    ``untie``."""
    if not untie:
        return untie
    names = _param_names(rec)
    stage = {names[sid]: s for sid, s in _owners(rec, cut).items()}
    group_of = {name: group[0] for group in untie for name in group}
    out: dict[tuple[str, int], list[str]] = {}
    for tie in tied(module):
        home = stage[tie[0]]
        for name in tie[1:]:
            at = stage[group_of.get(name, tie[0])]
            if at != home:
                out.setdefault((tie[0], at), []).append(name)
    return tuple(tuple(n) for n in out.values())


def engine_refusal(step: StepPeak, regime: Any, layout: str, measured: Mapping[str, str]) -> str | None:
    """Why a traced module's pipeline peak with a data-parallel engine on every stage (``layout``: ``FSDP x
    pipeline``) is not followed, beyond the engine's name: what the pipeline alone refuses, a Hugging Face model whose
    manual split was not measured (``measured``: model type -> its name), non-FP32 parameters."""
    why = refusal(step, dataclasses.replace(regime, data_parallel=None))
    if why is not None:
        return why
    config = getattr(step.module, "config", None)
    if config is not None and getattr(config, "model_type", None) not in measured:
        # measured on the manual splits of record/traced_pipeline_runs.py only
        listed = [f"{n}'s" for n in measured.values()]
        names = " and ".join([", ".join(listed[:-1]), listed[-1]] if len(listed) > 1 else listed)
        return (f"the {layout} peak of a Hugging Face model is measured for {names} stages, not "
                f"{getattr(config, 'model_type', None)!r}'s")
    import torch

    if any(q.dtype != torch.float32 for q in step.module.parameters()):
        return f"the {layout} peak of a traced module is measured for FP32 parameters"
    return None


def refusal(step: StepPeak, regime: Any) -> str | None:
    """Why a traced module's pipeline peak is not followed (None: it is)."""
    if regime.tensor_parallel or regime.zero or regime.data_parallel:
        return ("the pipeline peak of a traced module is modelled alone (no tensor parallelism, ZeRO or data-parallel "
                "engine with it)")
    if step.repeat is None:
        return "pipeline stages split the run of repeated blocks symmem folds into L; this module has none"
    if getattr(getattr(step.module, "config", None), "is_encoder_decoder", False):
        # measured on the recorded step (hf:bart): every decoder block keeps the encoder's output for backward
        return ("the pipeline peak of a traced encoder-decoder is not modelled: every decoder block reads the "
                "encoder's output (cross-attention), so its stages pass two tensors across each boundary (the "
                "decoder's stream and the encoder's output, both gradients back) where a traced module's stages "
                "pass one (the labels are not the obstacle: the schedule's loss_fn would be the model's "
                "cross-entropy on the last stage's logits, as for a decoder-only model)")
    buffers = [n for n, _ in step.module.named_buffers()]
    if buffers and not per_stage(step):  # Llama's rotary frequencies: held by every stage (stage_memory)
        return (f"the pipeline peak of a traced module is modelled for modules without buffers ({buffers[0]}: its "
                "stage is not followed) and Hugging Face Llama, Mistral and Qwen2 (each stage of their manual split "
                "makes its own rotary tables, their frequencies a buffer of every stage)")
    kinds = sorted(set(getattr(getattr(step.module, "config", None), "layer_types", None) or ()))
    if per_stage(step) and len(kinds) > 1:
        # Qwen2 with use_sliding_window below max_window_layers: two kinds of decoder layer, not one run of alike
        # blocks (the fold in L takes the longest run; the split's stages would hold different kinds)
        return (f"the pipeline peak of a traced Hugging Face model is modelled when its decoder layers are of one "
                f"attention type (measured: all {kinds[0]!r} or all 'sliding_attention'); config.layer_types mixes "
                f"{' and '.join(map(repr, kinds))}")
    if step.options.loss == "output" and not own_loss(step):
        return ("the pipeline peak of a traced module computing its own loss is modelled for Hugging Face models "
                "given labels (the schedule's loss_fn is then the model's loss_function on the last stage's "
                "logits); torch.distributed.pipelining gives the last stage no target: return the output and give "
                "the loss 'sum' or 'cross-entropy' (--loss), which the schedule's loss_fn computes")
    if step.options.loss not in ("sum", "cross-entropy", "output") or step.options.checkpoint or step.options.autocast:
        return ("the pipeline peak of a traced module is modelled for the loss 'sum' or 'cross-entropy' computed by "
                "the schedule, in FP32 without checkpointing (what was measured)")
    if regime.optimizer != "adamw" or step.options.impl != "for-loop":
        return "the pipeline peak of a traced module is modelled for AdamW's for-loop step (what was measured)"
    return None


def per_stage(step: StepPeak | None) -> bool:
    """Whether each stage of ``step``'s module makes for itself what runs before its blocks outside a module
    with parameters (a Hugging Face model type in :data:`PER_STAGE`: its manual split runs the model's own forward
    on every stage)."""
    return getattr(getattr(getattr(step, "module", None), "config", None), "model_type", None) in PER_STAGE


def own_loss(step: StepPeak) -> bool:
    """Whether ``step``'s module computes its own loss as a Hugging Face language model (not an encoder-decoder)
    given ``labels`` does: its ``loss_function`` on the head's logits, from the labels given last (each input a
    tensor).  Under ``torch.distributed.pipelining`` that is the schedule's ``loss_fn`` --
    ``model.loss_function(logits, target, vocab_size=V)`` on the last stage's output, the labels the schedule's
    target there -- which the replay follows (:class:`TracedCut`: the head's logits kept in ``output_chunks``, the
    labels on the last stage)."""
    import torch

    items = step.inputs.items()
    config = getattr(step.module, "config", None)
    return (step.options.loss == "output" and callable(getattr(step.module, "loss_function", None))
            and not getattr(config, "is_encoder_decoder", False)
            and bool(items) and items[-1][0] == "labels" and all(isinstance(v, torch.Tensor) for _, v in items))


def pipeline_step(step: StepPeak, regime: Any, numbers: Mapping[sympy.Symbol, int]) -> Any:
    """``step`` (one device's) as the largest stage's under ``regime``'s pipeline, or a
    :class:`~symmem.step.Refused` saying why not."""
    from ..step import Refused

    why = refusal(step, regime)
    if why is not None:
        return Refused(why)
    # a tied parameter is a copy on each stage that holds one of its modules (split_ties, then stage_copies)
    # reads: which parameters each forward op reads (one read on another stage than its module's is refused)
    two = dataclasses.replace(step, options=dataclasses.replace(step.options, micro_batches=2, reads=True,
                                                                untie=split_ties(step.module)), _records={},
                              _peaks={}, _shared={}, notes=[])
    one = dataclasses.replace(regime, pipeline_parallel=False, pipeline_schedule="1f1b", micro_batches=1)
    return TracedPipelineStep(None, None, {}, one, (), dict(numbers), regime.pipeline_schedule,  # type: ignore[arg-type]
                              regime.micro_batches, step=two)
