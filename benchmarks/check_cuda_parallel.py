"""Tensor and pipeline parallelism on a real GPU: two ranks on one GPU over gloo, CUDA tensors, measured per rank.

    PYTHONPATH=$PWD python benchmarks/check_cuda_parallel.py --json OUT.json [--dry-run]

The suite proves the tensor-parallel (DTensor, Llama's standard plan) and pipeline (``torch.distributed.pipelining``,
1F1B and GPipe) peaks per rank on CPU ranks with the live-bytes recorder (tests/test_model_parallel.py).  This runs
the same cases (the suite's sizes) with every rank's module on the one GPU, and reads the caching allocator per
rank and per step: ``max_memory_allocated`` (512-byte blocks) and ``requested_bytes.all.peak`` (the bytes the
tensors asked for, before the allocator rounds them: what symmem's peak counts), each less what the rank had
allocated before its module was built (the cuBLAS workspaces made first).  NCCL refuses two ranks of one
communicator on one device, so the collectives run on gloo, which stages CUDA tensors through pinned host memory
(no device allocation of its own); the pipeline's point-to-point sends are staged through host memory here too
(gloo sends host pointers only): the device holds what the engine holds.

The comparison with ``derive(..., device="cuda")`` is made where the JSON is read (tests/test_cuda_parallel_
measured.py): this script needs no sympy work on the GPU machine.

``--mesh`` or ``--mesh-fsdp`` with ``SYMMEM_CUDA_SNAPSHOT=DIR`` also writes each rank's allocator history of each
case into DIR;
``--analyze DIR/*.json.gz [--figures OUT]`` reads them anywhere (no GPU): each step's peak split by who made the
bytes, and read again without gloo's collective temporaries and FSDP2's copy-out metadata (docs/cuda.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

#: the suite's cases (tests/test_model_parallel.py): tensor-parallel llama, t = 2
TENSOR = [({"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 64}, {"attention": "naive"}),
          ({"B": 2, "S": 8, "H": 32, "h": 4, "G": 4, "L": 2, "V": 64, "F": 96}, {"attention": "sdpa"}),
          ({"B": 2, "S": 64, "H": 32, "h": 4, "G": 2, "L": 2, "V": 16, "F": 64}, {"attention": "naive"}),
          ({"B": 2, "S": 32, "H": 32, "h": 4, "G": 4, "L": 2, "V": 16, "F": 512}, {"attention": "sdpa"}),
          ({"B": 4, "S": 128, "H": 256, "h": 8, "G": 4, "L": 2, "V": 512, "F": 1024}, {"attention": "naive"}),
          ({"B": 4, "S": 128, "H": 256, "h": 8, "G": 4, "L": 2, "V": 512, "F": 1024}, {"attention": "sdpa"})]
#: the same with sequence parallelism (torchtitan's plan: every parameter a DTensor, so foreach AdamW runs)
SEQUENCE = [(v, {**o, "sequence_parallel": True}) for v, o in (TENSOR[0], TENSOR[1], TENSOR[4], TENSOR[5])]
#: pipeline cases, p = 2: (model, sizes, schedule, M, loss, options)
GPT2 = {"B": 2, "S": 32, "H": 32, "h": 2, "L": 2, "V": 64}
LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64}
WIDE = {"B": 4, "S": 128, "H": 256, "h": 8, "G": 4, "L": 2, "V": 512, "F": 1024}
PIPELINE = [("gpt2", GPT2, "gpipe", 1, "cross-entropy", {"attention": "naive", "dropout": 0.0}),
            ("gpt2", GPT2, "gpipe", 4, "cross-entropy", {"attention": "naive", "dropout": 0.0}),
            ("gpt2", GPT2, "1f1b", 4, "cross-entropy", {"attention": "naive", "dropout": 0.0}),
            ("gpt2", GPT2, "gpipe", 2, "sum", {"attention": "naive", "dropout": 0.0}),
            ("llama", LLAMA, "gpipe", 2, "cross-entropy", {"attention": "sdpa"}),
            ("llama", LLAMA, "1f1b", 4, "sum", {"attention": "naive"}),
            ("llama", WIDE, "1f1b", 2, "cross-entropy", {"attention": "naive"}),
            ("llama", WIDE, "gpipe", 2, "cross-entropy", {"attention": "sdpa"})]
IMPLS = ("for-loop", "foreach")
#: DDP / its bucket view / ZeroRedundancyOptimizer around each stage of a 2 x 2 (pp, dp) mesh, four ranks on the GPU
#: (``--mesh``): (model, sizes, schedule, M, loss, options, engine)
MESH = [("llama", LLAMA, "gpipe", 2, "cross-entropy", {"attention": "sdpa"}, engine)
        for engine in ("ddp", "ddp-bucket-view", "zero-redundancy")]
MESH += [("llama", LLAMA, "1f1b", 2, "sum", {"attention": "naive"}, "ddp"),
         ("gpt2", GPT2, "1f1b", 2, "cross-entropy", {"attention": "naive", "dropout": 0.0}, "ddp"),
         ("gpt2", GPT2, "gpipe", 2, "cross-entropy", {"attention": "naive", "dropout": 0.0}, "zero-redundancy"),
         ("llama", WIDE, "1f1b", 2, "cross-entropy", {"attention": "naive"}, "ddp"),
         ("llama", WIDE, "1f1b", 2, "cross-entropy", {"attention": "naive"}, "zero-redundancy")]
#: FSDP2 (``fully_shard`` on each layer and the stage root, resharding or not) on each stage of the same mesh
#: (``--mesh-fsdp``): measured once on an H200 at stop 37, docs/cuda.md
MESH_FSDP = [("llama", LLAMA, "gpipe", 2, "cross-entropy", {"attention": "sdpa"}, "fsdp"),
             ("llama", LLAMA, "1f1b", 2, "cross-entropy", {"attention": "sdpa"}, "fsdp-no-reshard"),
             ("gpt2", GPT2, "1f1b", 2, "cross-entropy", {"attention": "naive", "dropout": 0.0}, "fsdp")]
FIRST, STEADY = 2, 3
DRY = False
#: ``--tensor``: the tensor-parallel rows too.  On an H200 with torch 2.11 gloo's all-gather of CUDA tensors (the
#: head's output gathered for its replicated logits, ``funcol.all_gather_tensor``) dies with a segmentation fault in
#: ``wait_tensor``: DTensor over gloo on CUDA cannot be measured this way, and NCCL refuses two ranks on one GPU
TENSOR_ROWS = False


def _device() -> Any:
    import torch

    return torch.device("cpu" if DRY else "cuda")


def _mark() -> dict[str, int]:
    """What the rank's allocator holds now (after a settle: gloo's worker thread lets go of its tensors)."""
    import gc

    import torch

    gc.collect()
    if DRY:
        return {"allocated": 0, "requested": 0}
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    return {"allocated": int(s["allocated_bytes.all.current"]), "requested": int(s["requested_bytes.all.current"])}


def _peaks(base: dict[str, int]) -> dict[str, int]:
    import torch

    if DRY:
        return {"allocated": 0, "requested": 0}
    torch.cuda.synchronize()
    s = torch.cuda.memory_stats()
    return {"allocated": int(s["allocated_bytes.all.peak"]) - base["allocated"],
            "requested": int(s["requested_bytes.all.peak"]) - base["requested"]}


def _reset() -> None:
    import torch

    if not DRY:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _warm() -> None:
    """The cuBLAS workspaces of the forward's and autograd's threads, kept for the process (check_cuda.warm_cublas)."""
    import torch

    w = torch.randn(64, 64, device=_device(), requires_grad=True)
    bias = torch.randn(64, device=_device(), requires_grad=True)
    torch.nn.functional.linear(torch.randn(64, 64, device=_device()), w, bias).sum().backward()


def _single(values: dict[str, int], options: dict[str, Any], impl: str, rank: int) -> dict[str, Any]:
    """The control: the whole model on one rank, no collective (requested bytes against symmem's one-device peak)."""
    import torch

    from symmem.record.optim import make_optimizer
    from symmem.reference.sequence_models import reference

    base = _mark()
    torch.manual_seed(0)
    module, (ids,) = reference("llama", values, **options)
    module.to(_device())
    ids = ids.to(_device())
    opt = make_optimizer(list(module.parameters()), "adamw", impl)
    steps = []
    for _ in range(1 + STEADY):
        _reset()
        module(ids).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(_peaks(base))
    del opt, module, ids
    return {"kind": "single", "values": values, "options": options, "impl": impl, "rank": rank, "steps": steps}


def _tensor(values: dict[str, int], options: dict[str, Any], impl: str, rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from symmem.record.model_parallel_runs import llama_plan, llama_sequence_plan
    from symmem.record.optim import make_optimizer
    from symmem.reference.sequence_models import reference

    base = _mark()
    torch.manual_seed(0)
    module, (ids,) = reference("llama", values, **{k: v for k, v in options.items() if k != "sequence_parallel"})
    module.to(_device())
    ids = ids.to(_device())
    plan = (llama_sequence_plan if options.get("sequence_parallel") else llama_plan)(module, world)
    parallelize_module(module, init_device_mesh(_device().type, (world,)), plan)
    params = list(module.parameters())
    steps = []
    opt = None
    for k in range(FIRST + STEADY):
        if k < FIRST:
            opt = None
            opt = make_optimizer(params, "adamw", impl)
        _reset()
        module(ids).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        steps.append(_peaks(base))
        time.sleep(0.05)
    del opt, module, params, ids
    return {"kind": "tensor", "values": values, "options": options, "impl": impl, "rank": rank, "steps": steps}


def _scheduled_step(sched: Any, opt: Any, data: Any, target: Any, first: bool, last: bool,
                    base: dict[str, int], marked: bool = False) -> dict[str, int]:
    """One training step of a pipeline stage (the schedule, AdamW, ``zero_grad``): its allocator peaks.  ``marked``:
    an allocator history is being recorded, and the step's start shows in it as a MARK-byte allocation."""
    _reset()
    if marked and not DRY:
        import torch

        mark = torch.empty(MARK, dtype=torch.uint8, device="cuda")
        del mark
    losses: list[Any] = []
    out = sched.step(data) if first else sched.step(target=target, losses=losses) if last else sched.step()
    del out, losses
    opt.step()
    opt.zero_grad(set_to_none=True)
    peaks = _peaks(base)
    time.sleep(0.05)
    return peaks


def _staged_p2p() -> None:
    """``batch_isend_irecv`` through host memory: gloo sends and receives host tensors only."""
    import torch
    import torch.distributed as dist

    class Staged:
        # a send keeps its device tensor for the work's life, as c10d's works (gloo's, NCCL's) hold theirs
        def __init__(self, works: list[tuple[Any, Any, Any]], sent: list[Any]) -> None:
            self.works, self.sent = works, sent

        def wait(self, timeout: Any = None) -> bool:
            for work, host, into in self.works:
                work.wait()
                if into is not None:
                    with torch.no_grad():
                        into.copy_(host)
            self.works = []
            return True

        def is_completed(self) -> bool:
            return not self.works

    def batch(ops: list[Any]) -> list[Any]:
        works, sent = [], []
        for op in ops:
            name = getattr(op.op, "__name__", "")
            if name == "isend":
                host = op.tensor.detach().to("cpu")
                works.append((dist.isend(host, op.peer, group=op.group, tag=op.tag), host, None))
                sent.append(op.tensor)
            else:
                host = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
                works.append((dist.irecv(host, op.peer, group=op.group, tag=op.tag), host, op.tensor))
        return [Staged(works, sent)]

    dist.batch_isend_irecv = batch  # the schedules look it up on ``dist`` at each call
    dist.distributed_c10d.batch_isend_irecv = batch


def _pipeline(model: str, values: dict[str, int], schedule: str, m: int, loss: str, options: dict[str, Any],
              impl: str, rank: int, world: int) -> dict[str, Any]:
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from symmem.record.model_parallel_runs import _stage_module, _sum_loss, static_shapes
    from symmem.record.optim import make_optimizer
    from symmem.reference.sequence_models import causal_lm_loss

    base = _mark()
    module = _stage_module(model, values, rank, world, options).to(_device())
    b, s, v, h = int(values["B"]), int(values["S"]), int(values["V"]), int(values["H"])
    given = static_shapes(rank == 0, rank == world - 1, torch.empty(b, s, dtype=torch.long, device="meta"),
                          (b, s, v), (b, s, h))
    import inspect

    # torch 2.11's PipelineStage takes no output_grads / input_grads (2.13's does): it derives them from the others
    known = inspect.signature(PipelineStage).parameters
    stage = PipelineStage(module, rank, world, _device(), **{k: v for k, v in given.items() if k in known})
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    sched = kind(stage, m, loss_fn=causal_lm_loss if loss == "cross-entropy" else _sum_loss)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, v, (b * m, s), generator=gen)
    labels = torch.randint(0, v, (b * m, s), generator=gen) if loss == "cross-entropy" else torch.empty(b * m, 0)
    first, last = rank == 0, rank == world - 1
    data = ids.to(_device()) if first else None
    target = labels.to(_device()) if last else None
    del ids, labels
    opt = make_optimizer(list(module.parameters()), "adamw", impl)
    steps = []
    history = os.environ.get("SYMMEM_HISTORY_DIR") if schedule == "1f1b" and m == 4 and impl == "foreach" else None
    if history and not DRY:
        stacks = "all" if os.environ.get("SYMMEM_HISTORY_CPP") else "python"
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks=stacks)
    for _ in range(1 + STEADY):
        steps.append(_scheduled_step(sched, opt, data, target, first, last, base))
    if history and not DRY:
        import pickle

        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        Path(history, f"history_{model}_{schedule}{m}_rank{rank}.pickle").write_bytes(pickle.dumps(
            {"snapshot": snapshot, "base": base}))
    del opt, sched, stage, module, data, target
    return {"kind": "pipeline", "model": model, "values": values, "schedule": schedule, "M": m, "loss": loss,
            "options": options, "impl": impl, "rank": rank, "steps": steps}


def _mesh_pipeline(model: str, values: dict[str, int], schedule: str, m: int, loss: str, options: dict[str, Any],
                   engine: str, rank: int, world: int) -> dict[str, Any]:
    """One rank of DDP (or ZeRO-1) around the stages of a (2, N) mesh: two unmeasured steps (the receive buffers;
    DDP's first synced backward and its buckets rebuilt), a first step with a new AdamW, then steady ones."""
    import inspect

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    from torch.nn.parallel import DistributedDataParallel

    from symmem.record.distributed import zero_optimizer
    from symmem.record.fsdp_pipeline_runs import _built_stage
    from symmem.record.optim import make_optimizer

    stages = 2
    base = _mark()
    # SYMMEM_CUDA_SNAPSHOT=DIR: each rank's allocator history of the case, from its baseline on (the module's
    # parameters, DDP's buckets and FSDP2's shards included, so that every byte live at a step's peak is in the
    # trace, and the optimizer step's own peak can be read where the schedule's hides it)
    snapshots = os.environ.get("SYMMEM_CUDA_SNAPSHOT")
    recording = bool(snapshots) and not DRY
    if recording:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    mesh = init_device_mesh(_device().type, (stages, world // stages), mesh_dim_names=("pp", "dp"))
    s, dp = mesh.get_local_rank("pp"), mesh.get_local_rank("dp")
    first, last = s == 0, s == stages - 1
    module, given, loss_fn, ids, labels = _built_stage(model, values, m, loss, options, s, stages, dp)
    module.to(_device())
    data = ids.to(_device()) if first else None
    target = labels.to(_device()) if last else None
    del ids, labels
    if engine.startswith("fsdp"):  # FSDP2 as fsdp_pipeline_runs builds it: each layer, then the stage root
        from torch.distributed.fsdp import fully_shard

        from symmem.record.sharded import units

        for block in units(module):
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=engine == "fsdp")
        wrapped = fully_shard(module, mesh=mesh["dp"], reshard_after_forward=engine == "fsdp")
    else:
        wrapped = DistributedDataParallel(module, process_group=mesh["dp"].get_group(),
                                          gradient_as_bucket_view=engine == "ddp-bucket-view")
    known = inspect.signature(PipelineStage).parameters
    stage = PipelineStage(wrapped, s, stages, _device(), group=mesh["pp"].get_group(),
                          **{k: v for k, v in given.items() if k in known})
    sched = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stage, m, loss_fn=loss_fn)
    params = [p for p in module.parameters() if p.requires_grad]
    impl = "foreach"

    def optimizer() -> Any:
        if engine == "zero-redundancy":
            return zero_optimizer(params, "adamw", impl, 1e-3, group=mesh["dp"].get_group())
        return make_optimizer(params, "adamw", impl)

    steps = []
    opt = None
    for k in range(2 + 1 + STEADY):
        if k <= 2:
            opt = None
            opt = optimizer()
        peaks = _scheduled_step(sched, opt, data, target, first, last, base, marked=recording)
        if k >= 2:
            steps.append(peaks)
    host = sum(t.numel() * t.element_size() for st in getattr(opt, "optim", opt).state.values()
               for t in st.values() if isinstance(t, torch.Tensor) and t.device.type == "cpu")
    row = {"kind": "mesh", "model": model, "values": values, "schedule": schedule, "M": m, "loss": loss,
           "options": options, "engine": engine, "impl": impl, "rank": rank, "pp": s, "dp": dp, "N": world // stages,
           "host_state": host, "steps": steps}
    if snapshots:
        _save_history(snapshots, row, base)
    del opt, sched, stage, wrapped, module, data, target
    return row


#: the size of the allocation that marks each step's start in a recorded history (no other tensor has it; as
#: check_cuda_engines.MARK)
MARK = 7
#: python frames kept per history entry, innermost first (enough to tell the collective, FSDP2, the schedule, the
#: model's op and the optimizer apart)
FRAMES = 12


def _history_name(row: dict[str, Any]) -> str:
    return f"mesh-{row['model']}-{row['schedule']}{row['M']}-{row['loss']}-{row['engine']}-r{row['rank']}.json.gz"


def _save_history(folder: str, row: dict[str, Any], base: dict[str, int]) -> None:
    """The rank's allocator history, compacted (action, address, size, stream, the innermost python frames as
    ``file:line:function``), with its row and baseline, gzipped JSON in ``folder``.  A dry run writes an empty
    trace (no allocator on CPU ranks), so that ``--analyze`` runs on its files too."""
    import gzip

    import torch

    trace: list[list[Any]] = []
    if not DRY:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        for e in snapshot["device_traces"][0]:
            frames = [f"{x['filename'].rsplit('/', 2)[-2]}/{x['filename'].rsplit('/', 1)[-1]}:{x['line']}:{x['name']}"
                      for x in e.get("frames", ()) if x["filename"].endswith(".py")][:FRAMES]
            trace.append([e["action"], int(e.get("addr", 0)), int(e.get("size", 0)), int(e.get("stream", 0)),
                          frames])
    os.makedirs(folder, exist_ok=True)
    with gzip.open(Path(folder, _history_name(row)), "wt") as f:
        json.dump({"row": row, "base": base, "mark": MARK, "trace": trace}, f)


def _category(frames: list[str]) -> str:
    """Who made an allocation: the innermost frame that belongs to the collectives (``distributed_c10d.py``: what
    gloo's C++ makes inside one), FSDP2 (its copy-out's kernel metadata, ``split_with_sizes_copy``, apart), the
    pipeline schedule, the optimizer, ``Module.to``'s copies (``moved``: the module's tensors as built, moved to the
    GPU after the baseline) or the model's code (its modules, the loss) decides; none (autograd's backward, which
    has no python frames) is the model's."""
    for f in frames:
        name = f.split(":")[0]
        if name.endswith(("distributed_c10d.py", "_functional_collectives.py")):
            return "c10d"
        if name.startswith("optim/") or "adam" in name.lower():
            return "optimizer"
        if name.startswith(("_fully_shard/", "fsdp/")):
            return "copy-out" if f.endswith(":split_with_sizes_copy") else "fsdp"
        if name.startswith("pipelining/"):
            return "pipeline"
        if name.endswith("modules/module.py") and f.endswith((":convert", ":_apply")):
            return "moved"
        if name.startswith(("nn/", "modules/", "reference/", "record/", "symmem/")):
            return "model"
    return "model"


#: the bands a ``--mesh-fsdp`` history's peak is read without, one after the other (docs/cuda.md): gloo's device
#: temporaries inside the collectives (NCCL makes none in the caching allocator), then FSDP2's copy-out metadata
BANDS = ("c10d", "copy-out")


def _window_peaks(trace: list[list[Any]], starts: list[int], leave_out: tuple[str, ...]) -> list[dict[str, Any]]:
    """Each window's peak over the allocations not made by ``leave_out``'s categories, a block counted until the
    allocator's ``free_completed`` (as its statistics count it: gloo's CUDA work records its streams on its
    tensors, so a block can outlive the caller's free): the bytes, the event, the live set then, and the optimizer
    step's own peak (from the window's first AdamW allocation on)."""
    live: dict[int, tuple[int, str, list[str], int]] = {}
    now = 0
    out = [{"peak": -1, "at": -1, "held": {}, "step": 0} for _ in starts]
    stepping = [False] * len(starts)
    k = -1
    for i, e in enumerate(trace):
        action, addr, size = e[0], e[1], e[2]
        while k + 1 < len(starts) and i >= starts[k + 1]:
            k += 1
        if action == "alloc":
            c = _category(e[4])
            if c in leave_out:
                continue
            live[addr] = (size, c, e[4], i)
            now += size
            if k < 0:
                continue
            if now > out[k]["peak"]:
                out[k].update(peak=now, at=i, held=dict(live))
            stepping[k] = stepping[k] or c == "optimizer"
            if stepping[k]:
                out[k]["step"] = max(out[k]["step"], now)
        elif action == "free_completed" and addr in live:
            now -= live.pop(addr)[0]
    return out


def analyze_history(path: str, live: bool = False) -> dict[str, Any]:
    """Each step's peak in one rank's recorded history (``_save_history``): the bytes live at it (``peak``: the
    measured ``requested_bytes`` peak), split by who made them (``_category``); the peak read again without each of
    ``BANDS`` in turn (``less_c10d``, ``less_copy-out``), the ``moved`` bytes alive at the last of those and the
    optimizer step's own peak then (``step``); ``live``: the allocations alive at the peak with their frames.
    Windows are the MARK allocations: 0 and 1 unmeasured, 2 the first measured step, 3.. the steady ones
    (``_mesh_pipeline``)."""
    import gzip

    with gzip.open(path, "rt") as f:
        h = json.load(f)
    trace = h["trace"]
    starts = [i for i, e in enumerate(trace) if e[0] == "alloc" and e[2] == h["mark"]]
    every = [_window_peaks(trace, starts, BANDS[:n]) for n in range(len(BANDS) + 1)]
    windows: list[dict[str, Any]] = []
    for k, found in enumerate(zip(*every, strict=True)):
        whole, last = found[0], found[-1]
        by: dict[str, int] = {}
        for size, c, _, _ in whole["held"].values():
            by[c] = by.get(c, 0) + size
        w = {"step": k, "peak": whole["peak"], "by": by,
             "rounded": sum(-(-size // 512) * 512 for size, _, _, _ in whole["held"].values()),
             "at_frames": trace[whole["at"]][4][:6] if whole["at"] >= 0 else [],
             **{f"less_{band}": x["peak"] for band, x in zip(BANDS, found[1:], strict=True)},
             "moved": sum(size for size, c, _, _ in last["held"].values() if c == "moved"),
             "optimizer_step": last["step"]}
        if live:
            w["live"] = [[size, i, c, frames[:6]] for size, c, frames, i in
                         sorted(whole["held"].values(), key=lambda x: x[3])]
        windows.append(w)
    return {"row": h["row"], "base": h["base"], "events": len(trace), "windows": windows}


def _rank_setup() -> None:
    """A rank's process: a crash's Python stack shown, the one GPU, its cuBLAS workspaces made before any baseline,
    the sends and receives staged through host memory."""
    import faulthandler

    import torch

    faulthandler.enable()
    if not DRY:
        torch.cuda.set_device(0)
    _warm()
    _staged_p2p()


def mesh_work(case: int, rank: int, world: int) -> list[dict[str, Any]]:
    """One case in processes of its own: DDP's buckets of an earlier case in the same process were let go during
    the next one (measured), which a baseline taken before it cannot see."""
    _rank_setup()
    return [_mesh_pipeline(*(MESH_FSDP if os.environ.get("SYMMEM_MESH_FSDP") else MESH)[case], rank, world)]


def work(rank: int, world: int) -> list[dict[str, Any]]:
    global TENSOR_ROWS
    TENSOR_ROWS = bool(os.environ.get("SYMMEM_CHECK_TENSOR"))
    _rank_setup()
    rows = []
    if rank == 0 and not os.environ.get("SYMMEM_ONLY_PIPELINE"):
        for values, options in (TENSOR[4], TENSOR[5]):
            for impl in IMPLS:
                rows.append(_single(values, options, impl, rank))
    for values, options in (TENSOR + SEQUENCE) if TENSOR_ROWS else ():
        for impl in IMPLS:
            try:
                rows.append(_tensor(values, options, impl, rank, world))
            except RuntimeError as e:  # the engine's own refusal (foreach AdamW over DTensors and plain tensors)
                rows.append({"kind": "tensor", "values": values, "options": options, "impl": impl, "rank": rank,
                             "error": str(e).splitlines()[0]})
    for model, values, schedule, m, loss, options in PIPELINE:
        for impl in IMPLS:
            rows.append(_pipeline(model, values, schedule, m, loss, options, impl, rank, world))
    return rows


def figures(found: list[dict[str, Any]]) -> dict[str, Any]:
    """The test data of ``--analyze --figures``: each history's row (its case, rank, measured steps, host state) and
    its measured steps' figures (windows 2..: ``analyze_history``'s, without the live sets)."""
    rows = []
    for a in sorted(found, key=lambda a: a["path"]):
        keep = ("model", "values", "schedule", "M", "loss", "options", "engine", "rank", "pp", "dp", "host_state",
                "steps")
        rows.append({**{k: a["row"][k] for k in keep}, "events": a["events"], "history": [
            {k: v for k, v in w.items() if k not in ("live", "step")} for w in a["windows"][2:]]})
    flag = "--mesh-fsdp" if all(r["engine"].startswith("fsdp") for r in rows) else "--mesh"
    return {"how": f"SYMMEM_CUDA_SNAPSHOT=DIR benchmarks/check_cuda_parallel.py {flag} on the GPU, then "
                   "--analyze DIR/*.json.gz --figures THIS (docs/cuda.md)", "bands": list(BANDS), "rows": rows}


def _print_analysis(paths: list[str], out: str | None, compact: str | None = None) -> int:
    """``--analyze``: per history, each step's peak, split by who made the bytes, and read again without the bands
    (``analyze_history``); ``out``: the figures as JSON (the live sets too)."""
    found = []
    for path in paths:
        a = analyze_history(path, live=bool(out))
        found.append({"path": Path(path).name, **a})
        r = a["row"]
        print(f"{Path(path).name}: {a['events']} events, measured requested {[x['requested'] for x in r['steps']]}, "
              f"allocated {[x['allocated'] for x in r['steps']]}, host {r['host_state']}")
        for w in a["windows"]:
            print(f"  step {w['step']}: peak {w['peak']:,} (rounded {w['rounded']:,}; "
                  f"{', '.join(f'{k} {v:,}' for k, v in sorted(w['by'].items()))}); "
                  + ", ".join(f"less {band} {w['less_' + band]:,}" for band in BANDS)
                  + f", moved {w['moved']:,}, optimizer step {w['optimizer_step']:,}; at {w['at_frames'][:2]}")
    if out:
        Path(out).write_text(json.dumps(found) + "\n")
    if compact:
        Path(compact).write_text(json.dumps(figures(found), indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    global DRY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--tensor", action="store_true", help="the tensor-parallel rows too (see TENSOR_ROWS)")
    ap.add_argument("--history", default=None, metavar="DIR",
                    help="the allocator's history of the 1F1B M=4 rows (foreach), one pickle per rank, into DIR")
    ap.add_argument("--mesh", action="store_true", help="only the DDP / ZeRO-1 x pipeline rows (four ranks)")
    ap.add_argument("--mesh-fsdp", action="store_true", help="only the FSDP2 x pipeline rows (four ranks)")
    ap.add_argument("--cpp", action="store_true", help="the histories with C++ frames")
    ap.add_argument("--only-pipeline", action="store_true", help="no one-device control rows")
    ap.add_argument("--dry-run", action="store_true", help="the same steps on CPU ranks, no memory read")
    ap.add_argument("--analyze", nargs="*", default=None, metavar="HISTORY",
                    help="read --mesh-fsdp histories recorded with SYMMEM_CUDA_SNAPSHOT=DIR: each step's peak split "
                         "into the model's bytes and the collectives' temporaries (no GPU needed; --json: all of it)")
    ap.add_argument("--figures", default=None, metavar="OUT",
                    help="with --analyze: each history's measured steps' figures as the test data (no live sets)")
    args = ap.parse_args(argv)
    if args.analyze is not None:
        return _print_analysis(args.analyze, args.json, args.figures)
    DRY = args.dry_run
    os.environ["SYMMEM_CHECK_TENSOR"] = "1" if args.tensor else ""
    os.environ["SYMMEM_HISTORY_DIR"] = args.history or ""
    os.environ["SYMMEM_HISTORY_CPP"] = "1" if args.cpp else ""
    os.environ["SYMMEM_ONLY_PIPELINE"] = "1" if args.only_pipeline else ""
    import torch

    from symmem.record import model_parallel_runs as runs_of

    runs_of.TIMEOUT_S = 300
    t0 = time.time()
    # forkserver on the GPU: a CUDA context does not survive fork
    how = "fork" if DRY else "forkserver"
    os.environ["SYMMEM_MESH_FSDP"] = "1" if args.mesh_fsdp else ""
    if args.mesh or args.mesh_fsdp:
        each = []
        for k in range(len(MESH_FSDP if args.mesh_fsdp else MESH)):
            each.append(runs_of.forked_ranks(4, functools.partial(mesh_work, k), "the CUDA mesh check", how))
            if args.json:  # each case as it ends: a run cut by its time limit keeps the cases it finished
                Path(args.json).write_text(json.dumps({
                    "device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(0),
                    "versions": {"torch": torch.__version__}, "first_steps": FIRST, "steady_steps": STEADY,
                    "rows": [row for r in range(4) for case in each for row in case[r]]}, indent=1) + "\n")
        ranks = [[row for case in each for row in case[r]] for r in range(4)]
    else:
        ranks = runs_of.forked_ranks(2, work, "the CUDA parallel check", how)
    out = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(0),
           "versions": {"torch": torch.__version__}, "first_steps": FIRST, "steady_steps": STEADY,
           "rows": [row for rank in ranks for row in rank]}
    print(f"{len(out['rows'])} rows in {time.time() - t0:.1f} s on {out['device']}")
    for r in out["rows"]:
        if "error" in r:
            print(f"  rank {r['rank']} {r['kind']} {r['options']} {r['impl']}: {r['error'][:100]}")
            continue
        label = r["kind"] + (f" {r['model']} {r['schedule']} M={r['M']} {r['loss']} {r.get('engine', '')}"
                             if r["kind"] in ("pipeline", "mesh") else "")
        print(f"  rank {r['rank']} {label} {r['options']} {r['impl']} {r['values']}: "
              f"{[s['requested'] for s in r['steps']]} / {[s['allocated'] for s in r['steps']]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
