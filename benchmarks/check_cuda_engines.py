"""The data-parallel engines on real CUDA: run by hand on a machine with one NVIDIA GPU (results in docs/cuda.md).

    PYTHONPATH=$PWD python benchmarks/check_cuda_engines.py [--json OUT.json] [--world 2]
    PYTHONPATH=$PWD python benchmarks/check_cuda_engines.py --stop37 --json OUT.json [--dry-run]

``--stop37`` runs stops 33-36's engine work at N = 2 (two ranks on the one GPU over gloo): selective recomputation
under every data-parallel engine, FSDP1's gradient accumulation under ``no_sync()``, FSDP2's micro-batches with
selective recomputation, and two rows of ``--world 2`` again as a control (:data:`STOP37`); per rank and step
``max_memory_allocated`` and ``requested_bytes.all.peak`` less the rank's baseline, the host bytes of its optimizer
state, and (``--dry-run``, CPU ranks) the live bytes of the library's own recorded run of the same case
(tests/test_cuda_stop37_measured.py reads the JSON).

``--world 2`` runs each case as two ranks on the one GPU over gloo (CUDA tensors), so FSDP really shards and its
collectives run on their CUDA streams (docs/cuda.md, "Two ranks on one GPU").

The gloo runs of the suite prove each engine's per-rank peak in live bytes on the CPU.  On a GPU two things come
on top that the CPU cannot show, and this script measures both with NCCL on one GPU (world size 1: NCCL refuses
two ranks of one communicator on one device):

``engine``  ``torch.cuda.max_memory_allocated`` of three training steps of the project's reference module wrapped
            in each engine (DDP with and without the bucket view, DDP with ``ZeroRedundancyOptimizer``, FSDP2
            with and without resharding, FSDP1 FULL_SHARD and SHARD_GRAD_OP) against
            :meth:`Derivation.peak_allocated` at ``N = 1`` (every storage in the caching allocator's 512-byte
            blocks): the buckets, the all-gather and reduce-scatter buffers each take blocks of their own.
``nccl``    the device memory NCCL takes outside the caching allocator (``cudaMalloc`` of its own): free memory
            before and after the process group's eager init and the first all-reduce, all-gather and
            reduce-scatter, less what the caching allocator reserved meanwhile.  At world size 1 NCCL connects
            to no peer, so this is its per-communicator floor, not the per-peer channel buffers
            (``NCCL_BUFFSIZE``) of a real world.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_cuda import baseline, warm_cublas  # noqa: E402

from symmem import derive  # noqa: E402

TINY = {"S": 32, "L": 2, "H": 64, "h": 4, "V": 100}
#: the suite's gloo models (tests/test_data_parallel.py), one rank
MODELS = [
    ("mlp", {"B": 4, "N": 1}, {"widths": "64,128,128,10", "loss": "cross-entropy"}),
    ("mlp", {"B": 4, "N": 1}, {"widths": "64,127,10", "loss": "cross-entropy"}),
    ("gpt2", {**TINY, "B": 2, "N": 1}, {"attention": "sdpa", "dropout": 0.0, "loss": "cross-entropy"}),
    ("llama", {**TINY, "B": 2, "G": 2, "F": 128, "N": 1}, {"attention": "sdpa", "loss": "cross-entropy"}),
]
ENGINES = (None, "ddp", "ddp-bucket-view", "zero-redundancy", "fsdp", "fsdp-no-reshard", "fsdp1", "fsdp1-grad-op")
IMPLS = ("for-loop", "foreach")
ROWS: list[dict[str, Any]] = []
#: ``--dry-run``: the same steps on the CPU over gloo with no memory read (a check of the script itself)
DRY = False
#: ``--stop37``: (model, values, keywords, engine, checkpoint, micro-batches), each case two ranks on the one GPU.
#: Sizes as the suite's gloo runs measured them on CPU ranks: tests/test_selective_engines.py (selective, S = 128 >
#: H so the peak sits in backward, where what selective drops shows; V = 101 pads FSDP2's last shard) and
#: tests/test_fsdp1_accumulation.py (no_sync); the last two are ``--world 2`` rows (cuda_h200_world2.json) again
SELECTIVE = {"B": 2, "S": 128, "L": 2, "H": 32, "h": 4, "V": 64, "F": 64}
EAGER = {"gpt2": {"attention": "naive", "dropout": 0.0, "loss": "cross-entropy"},
         "llama": {"attention": "naive", "loss": "cross-entropy"}}
ACCUMULATE = {"B": 2, "S": 32, "L": 2, "H": 64, "h": 4, "V": 100, "F": 128}
SDPA = {"mlp": ({"B": 4}, {"widths": "64,127,10", "loss": "cross-entropy"}),
        "gpt2": (ACCUMULATE, {"attention": "sdpa", "dropout": 0.0, "loss": "cross-entropy"}),
        "llama": ({**ACCUMULATE, "G": 2}, {"attention": "sdpa", "loss": "cross-entropy"})}
STOP37: list[tuple[str, dict[str, int], dict[str, Any], str, str, int]] = [
    (model, {**SELECTIVE, **({"G": 2} if model == "llama" else {})}, EAGER[model], engine, "selective", 1)
    for model in ("gpt2", "llama")
    for engine in ("ddp", "ddp-bucket-view", "zero-redundancy", "fsdp", "fsdp-no-reshard", "fsdp1", "fsdp1-grad-op")]
STOP37 += [(model, SDPA[model][0], SDPA[model][1], engine, "none", 2)
           for model in ("mlp", "gpt2", "llama") for engine in ("fsdp1", "fsdp1-grad-op")]
STOP37 += [(model, {**SELECTIVE, **({"G": 2} if model == "llama" else {}), "V": 101}, EAGER[model], engine,
            "selective", 2) for model in ("gpt2", "llama") for engine in ("fsdp", "fsdp-no-reshard")]
STOP37 += [("gpt2", {**TINY, "B": 2}, {"attention": "sdpa", "dropout": 0.0, "loss": "cross-entropy"}, engine, "none", 1)
           for engine in ("ddp", "fsdp-no-reshard")]
#: seconds a ``--stop37`` rank may run (its peer's failure leaves it waiting in a collective until then)
RANK_TIMEOUT_S = 150
#: the step's optimizer in every ``--stop37`` case (CUDA's default, as the ``--world 2`` control rows ran it)
IMPL37 = "foreach"
#: ``--pause``: seconds to wait after each step (NCCL's watchdog thread lets go of finished collectives' tensors
#: on its own schedule)
PAUSE = 0.0


def nccl_band() -> dict[str, int]:
    """Device bytes NCCL holds outside the caching allocator after each stage of a world-1 group's life."""
    import torch
    import torch.distributed as dist

    torch.cuda.init()
    x = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()

    def outside() -> int:
        torch.cuda.synchronize()
        free, _ = torch.cuda.mem_get_info()
        return -free - int(torch.cuda.memory_reserved())

    start = outside()
    out = {}
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    out["init"] = outside() - start
    dist.all_reduce(x)
    out["all_reduce"] = outside() - start
    y = torch.empty_like(x)
    dist.all_gather_into_tensor(y, x)
    out["all_gather"] = outside() - start
    dist.reduce_scatter_tensor(y, x)
    out["reduce_scatter"] = outside() - start
    return out


def wrap(engine: str | None, module: Any) -> Any:
    import torch

    if engine in ("ddp", "ddp-bucket-view", "zero-redundancy"):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(module, device_ids=None if DRY else [0],
                                       gradient_as_bucket_view=engine == "ddp-bucket-view")
    if engine in ("fsdp", "fsdp-no-reshard"):
        from torch.distributed.fsdp import fully_shard

        from symmem.record.sharded import units

        for block in units(module):
            fully_shard(block, reshard_after_forward=engine == "fsdp")
        fully_shard(module, reshard_after_forward=engine == "fsdp")
        return module
    if engine in ("fsdp1", "fsdp1-grad-op"):
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from symmem.record.sharded import units

        strategy = ShardingStrategy.FULL_SHARD if engine == "fsdp1" else ShardingStrategy.SHARD_GRAD_OP
        return FullyShardedDataParallel(module, sharding_strategy=strategy,
                                        device_id=torch.device("cpu" if DRY else "cuda:0"),
                                        auto_wrap_policy=ModuleWrapPolicy({type(b) for b in units(module)}))
    return module


def steps(d: Any, engine: str | None, impl: str, n: int = 4) -> list[int]:
    """max_memory_allocated in each of ``n`` steps of the engine-wrapped reference, less the baseline."""
    return stepped(d, engine, impl, n)["allocated"]


def stepped(d: Any, engine: str | None, impl: str, n: int = 4, micro_batches: int = 1) -> dict[str, Any]:
    """Each of ``n`` steps of the engine-wrapped reference: ``allocated`` (``max_memory_allocated``) and
    ``requested`` (``requested_bytes.all.peak``: the bytes the tensors asked for, before the 512-byte rounding), each
    less what was there before the module was built; ``host_state``: the optimizer state's bytes on the host (the
    foreach and for-loop AdamW's ``step`` counts), after the last step.  ``micro_batches``: gradient accumulation,
    every pass but the last without the gradient sync (FSDP2's ``set_requires_gradient_sync(False)``, FSDP1's and
    DDP's ``no_sync()``), as symmem.record.sharded.train_steps runs them."""
    from contextlib import nullcontext

    import torch

    from symmem.record.distributed import zero_optimizer
    from symmem.record.optim import make_optimizer
    from symmem.record.steps import loss_value
    from symmem.record.verify import _reference

    def requested() -> int:
        return 0 if DRY else int(torch.cuda.memory_stats()["requested_bytes.all.current"])

    base = 0 if DRY else baseline()
    base_requested = requested()
    module, inputs, _, target = _reference(d)
    wrapped = wrap(engine, module)
    wrapped.train()
    takes_labels = bool(getattr(module, "takes_labels", False))
    params = [p for p in wrapped.parameters() if p.requires_grad]
    opt = (zero_optimizer(params, d.regime.optimizer, impl, 1e-3) if engine == "zero-redundancy"
           else make_optimizer(params, d.regime.optimizer, impl))
    out: dict[str, Any] = {"allocated": [], "requested": []}
    snapshot = os.environ.get("SYMMEM_CUDA_SNAPSHOT")  # a file: the allocator's history of these steps goes there
    if snapshot and not DRY:
        torch.cuda.memory._record_memory_history(max_entries=400_000)
    for _ in range(n):
        if not DRY:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            if snapshot:  # a step's start, as the history shows it: MARK bytes, freed at once
                mark = torch.empty(MARK, dtype=torch.uint8, device="cuda")
                del mark
        for k in range(micro_batches):
            last = k == micro_batches - 1
            held = nullcontext()
            if micro_batches > 1 and hasattr(wrapped, "set_requires_gradient_sync"):
                wrapped.set_requires_gradient_sync(last)
            elif not last:
                held = wrapped.no_sync()
            with held:
                y = wrapped(*inputs, target) if takes_labels else wrapped(*inputs)
                value = y if takes_labels else loss_value("cross-entropy", y, target)
                del y
                value.backward()
                del value
        opt.step()
        opt.zero_grad(set_to_none=True)
        if PAUSE:
            import time

            time.sleep(PAUSE)
        if not DRY:
            torch.cuda.synchronize()
            stats = torch.cuda.memory_stats()
            out["allocated"].append(int(torch.cuda.max_memory_allocated()) - base)
            out["requested"].append(int(stats["requested_bytes.all.peak"]) - base_requested)
        else:
            out["allocated"].append(0)
            out["requested"].append(0)
    if snapshot and not DRY:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer's local optimizer holds the rank's state
    out["host_state"] = sum(t.numel() * t.element_size() for st in state.values() for t in st.values()
                            if isinstance(t, torch.Tensor) and t.device.type == "cpu")
    del opt, wrapped, module, inputs, target, params, state
    return out


#: the size of the allocation that marks each step's start in a recorded history (no other tensor has it)
MARK = 7


def c10d_excess(path: str) -> list[tuple[int, int, int]]:
    """Each step's peak in a recorded allocator history (``SYMMEM_CUDA_SNAPSHOT``), with and without the
    allocations made inside ``torch.distributed``'s collectives.  Over gloo with CUDA tensors,
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` allocate device temporaries of their own that NCCL
    does not allocate (docs/cuda.md).  The step boundaries are the MARK allocations.  Histories recorded before the
    marks were added are split where each optimizer step begins (a window then holds one step's forward and
    backward after the last optimizer step's own allocations; the last window holds the last optimizer step alone).
    A third peak leaves out FSDP2's copy-out kernel metadata too: on CUDA ``split_with_sizes_copy`` (the all-gather's
    copy-out into the unsharded parameters) packs its splits' pointers and sizes into a small device tensor of its
    own (tens to hundreds of bytes, one 512-byte block) for as long as the copy runs; on the CPU it is a loop."""
    import pickle

    with open(path, "rb") as f:
        trace = pickle.load(f)["device_traces"][0]

    def frames(e: dict) -> list[str]:
        return [x["filename"].rsplit("/", 1)[-1] + ":" + x["name"] for x in e.get("frames", ())
                if x["filename"].endswith(".py")]

    starts = [i for i, e in enumerate(trace) if e["action"] == "alloc" and e["size"] == MARK]
    if not starts:
        opt = [i for i, e in enumerate(trace) if e["action"] == "alloc"
               and any("adam" in x.lower() for x in frames(e)[:3])]
        starts = [0] + [b for a, b in zip([-10**9, *opt], opt, strict=False) if b - a > 50]
    out = []
    for leave_out in (0, 1, 2):
        live: dict[int, int] = {}
        now, peaks = 0, [0] * len(starts)
        for i, e in enumerate(trace):
            if e["action"] == "alloc":
                py = frames(e)
                if leave_out and py and py[0].startswith("distributed_c10d.py"):
                    continue
                if leave_out > 1 and py and py[0].endswith(":split_with_sizes_copy"):
                    continue
                live[e["addr"]] = -(-e["size"] // 512) * 512
                now += live[e["addr"]]
                k = sum(i >= s for s in starts) - 1
                peaks[max(k, 0)] = max(peaks[max(k, 0)], now)
            elif e["action"] == "free_requested" and e["addr"] in live:
                now -= live.pop(e["addr"])
        out.append(peaks)
    return list(zip(*out, strict=True))


def cases() -> list[tuple[str, dict[str, int], dict[str, Any], str | None, str]]:
    return [(model, values, kw, engine, impl) for model, values, kw in MODELS for engine in ENGINES for impl in IMPLS]


def one_case(index: int, world: int = 1, rank: int = 0) -> dict[str, Any]:
    """One case in this process (a process of its own: an engine torn down in the same process frees its
    buffers late, inside the next case's steps); ``world`` ranks, each a process of its own on the one GPU, each
    compared with its own rank's prediction (ZeRO-1's ranks own different parameters)."""
    model, values, kw, engine, impl = cases()[index]
    numbers = {**values, "N": world} if engine else {k: v for k, v in values.items() if k != "N"}
    d = derive(model, convention="pytorch", options={"device": "cpu" if DRY else "cuda"}, optimizer="adamw",
               optimizer_impl=impl, values=numbers, data_parallel=engine, **kw)
    got = steps(d, engine, impl)
    label = f"{model} {kw.get('widths', '')} {engine or 'one device'} {impl}".replace("  ", " ")
    # step 2 is DDP's rebuild of its buckets (a one-off); the last step is the steady one
    of = rank if world > 1 else None
    spec = {"model": model, "values": numbers, "options": kw, "engine": engine, "impl": impl}
    return {"case": label, "per_step": got, "first": [d.peak_allocated("first", of), got[0]],
            "steady": [d.peak_allocated("steady", of), got[-1]], "live": [d.value("peak_first_step"), d.value("peak")],
            "spec": spec if of is None else {**spec, "rank": rank}}


def stop37_case(index: int, world: int, rank: int, live: bool) -> dict[str, Any]:
    """One :data:`STOP37` case on this rank (a process of its own, the group joined): its steps measured, and with
    ``live`` the same case run again on CPU tensors under the library's live-bytes recorder
    (symmem.record.distributed's own rank job, its collectives released at fixed ops), its per-step live bytes."""
    import dataclasses

    model, values, kw, engine, checkpoint, m = STOP37[index]
    device = "cpu" if DRY else "cuda"
    d = derive(model, convention="pytorch", options={"device": device}, optimizer="adamw", optimizer_impl=IMPL37,
               values={**values, "N": world}, data_parallel=engine, checkpoint=checkpoint, micro_batches=m, **kw)
    got = stepped(d, engine, IMPL37, 4, m)
    row = {"model": model, "values": {**values, "N": world}, "options": kw, "engine": engine,
           "checkpoint": checkpoint, "micro_batches": m, "impl": IMPL37, "rank": rank,
           "steps": [{"allocated": a, "requested": r} for a, r in zip(got["allocated"], got["requested"],
                                                                      strict=True)],
           "host_state": got["host_state"]}
    if live:
        from symmem.record import distributed
        from symmem.record.collectives import released

        on_cpu = derive(model, convention="pytorch", options={"device": "cpu"}, optimizer="adamw",
                        optimizer_impl=IMPL37, values={**values, "N": world}, data_parallel=engine,
                        checkpoint=checkpoint, micro_batches=m, **kw)
        try:
            with released():
                ranked = distributed._run_job(dataclasses.replace(distributed.job_of(on_cpu), impl=IMPL37), rank)
            row["live"] = {"per_step": list(ranked.per_step), "where": ranked.where, "late": ranked.late}
        except Exception as exc:  # the recorder on this torch: its failure is a finding, the CUDA steps still stand
            row["live"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]}
    return row


def stop37_rows(jobs: int, world: int = 2, live: bool = False, only: list[int] | None = None,
                save: Any = None) -> list[dict[str, Any]]:
    """Every :data:`STOP37` case in ``world`` processes of its own (one per rank, all on the one GPU, gloo),
    ``jobs`` processes at a time, each case on its own port; every rank's row (or the case's error).  ``save(rows)``
    after each case (the JSON written as it grows: a run cut short keeps what it measured)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor, as_completed

    def rank(i: int, r: int) -> dict[str, Any]:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29700 + i)}
        if "SYMMEM_CUDA_SNAPSHOT" in env:  # a folder: rank 0's history of each case (the ranks ran alike so far)
            if r:
                del env["SYMMEM_CUDA_SNAPSHOT"]
            else:
                os.makedirs(env["SYMMEM_CUDA_SNAPSHOT"], exist_ok=True)
                env["SYMMEM_CUDA_SNAPSHOT"] = os.path.join(env["SYMMEM_CUDA_SNAPSHOT"], f"stop37-case{i}-r0.pickle")
        argv = [sys.executable, __file__, "--case37", str(i), "--pause", str(PAUSE), "--world", str(world),
                "--rank-timeout", str(RANK_TIMEOUT_S),
                "--rank", str(r), *(["--dry-run"] if DRY else []), *(["--live"] if live else [])]
        try:
            done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=RANK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"case": i, "rank": r, "error": f"timed out after {RANK_TIMEOUT_S} s"}
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        if done.returncode or not lines:
            return {"case": i, "rank": r, "error": done.stderr[-600:]}
        return {"case": i, **json.loads(lines[-1])}

    def run(i: int) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(world) as ranks:
            return list(ranks.map(lambda r: rank(i, r), range(world)))

    rows: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max(1, jobs // world)) as pool:
        done = as_completed([pool.submit(run, i) for i in (range(len(STOP37)) if only is None else only)])
        for row in (r for case in done for r in case.result()):
            rows.append(row)
            model, _, kw, engine, checkpoint, m = STOP37[row["case"]]
            label = f"{row['case']:>2} {model} {kw.get('widths', '')} {engine} {checkpoint} M={m} rank {row['rank']}"
            if "error" in row:
                print(f"  {label:<58} ERROR {row['error'][-300:]}", flush=True)
            if save is not None and len(rows) % world == 0:
                save(rows)
            if "error" in row:
                continue
            live = row.get("live", {})
            print(f"  {label:<58} allocated {[s['allocated'] for s in row['steps']]} requested "
                  f"{[s['requested'] for s in row['steps']]} host {row['host_state']}"
                  + (f" live {live.get('per_step', live.get('error'))}" if live else ""), flush=True)
    return rows


def standin(dry: dict[str, Any]) -> dict[str, Any]:
    """A ``--stop37 --dry-run`` JSON with each CPU rank's live bytes standing in for the device's measurement (the
    oracle's own check without a GPU: tests/test_cuda_stop37_measured.py reads it as it reads the GPU's): each step's
    ``requested`` the live peak of that step (the last the lowest steady one), no allocator blocks, nothing on a
    host apart from the tensors counted."""
    rows = []
    for row in dry["rows"]:
        if "error" in row or "per_step" not in row.get("live", {}):
            rows.append(row)
            continue
        first, *steady = row["live"]["per_step"]
        live = [first, *steady, min(steady)]
        rows.append({**row, "steps": [{"allocated": 0, "requested": x} for x in live], "host_state": 0})
    return {**dry, "device": "cpu (dry run, live bytes standing in)", "rows": rows}


def engine_rows(jobs: int, only: tuple[str, ...] = (), world: int = 1) -> None:
    """Every case in a process of its own (``world`` processes, one per rank), ``jobs`` processes at a time, each
    case on its own port."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    def rank(i: int, r: int) -> dict[str, Any]:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29600 + i)}
        if "SYMMEM_CUDA_SNAPSHOT" in env:  # a folder: one history per case and rank
            model, _, kw, engine, impl = cases()[i]
            name = f"{model}{kw.get('widths', '').replace(',', '-')}-{engine}-{impl}-r{r}.pickle"
            env["SYMMEM_CUDA_SNAPSHOT"] = os.path.join(env["SYMMEM_CUDA_SNAPSHOT"], name)
        argv = [sys.executable, __file__, "--case", str(i), "--pause", str(PAUSE), "--world", str(world),
                "--rank", str(r), *(["--dry-run"] if DRY else [])]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
        lines = [x for x in done.stdout.splitlines() if x.startswith("{")]
        if done.returncode or not lines:
            return {"case": " ".join(map(str, cases()[i][:2] + cases()[i][3:])), "error": done.stderr[-600:]}
        out = json.loads(lines[-1])
        if world > 1:
            out["case"] += f" N={world} rank {r}"
        return out

    def run(i: int) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(world) as ranks:
            return list(ranks.map(lambda r: rank(i, r), range(world)))

    with ThreadPoolExecutor(max(1, jobs // world)) as pool:
        picked = [i for i, c in enumerate(cases()) if (not only or str(c[3]) in only) and (world == 1 or c[3])]
        for r in (r for rs in pool.map(run, picked) for r in rs):
            if "error" in r:
                ROWS.append({"section": "engine", "case": r["case"], "ok": False, "error": r["error"]})
                print(f"  {r['case']:<58} ERROR {r['error'][-300:]}", flush=True)
                continue
            for which in ("first", "steady"):
                want, meas = r[which]
                ok = want == meas
                ROWS.append({"section": "engine", "case": f"{r['case']} {which}", "predicted": want, "measured": meas,
                             "ok": ok, "per_step": r["per_step"], "live": r["live"],
                             "spec": {**r["spec"], "quantity": f"allocated_{which}"}})
                print(f"  {r['case'] + ' ' + which:<58} {want:>12,} {meas:>12,} "
                      f"{'ok' if ok else f'DIFFERS {meas - want:+,}'}  steps {r['per_step']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    global DRY, PAUSE, RANK_TIMEOUT_S
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--dry-run", action="store_true", help="run the steps on the CPU over gloo, measure nothing")
    ap.add_argument("--jobs", type=int, default=8, help="cases run at once, each in a process of its own")
    ap.add_argument("--case", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds to wait after each step")
    ap.add_argument("--only", nargs="*", default=(), help="engines to run (None: one device)")
    ap.add_argument("--world", type=int, default=1,
                    help="ranks per case, all on the one GPU: above 1 over gloo (NCCL refuses two ranks of one "
                         "communicator on one device), so FSDP's collectives and streams run as at N ranks")
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--stop37", action="store_true",
                    help="stops 33-36's engine work at two ranks on the one GPU (STOP37), over gloo")
    ap.add_argument("--case37", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--standin", nargs=2, default=None, metavar=("DRY_JSON", "OUT_JSON"),
                    help="write a --stop37 --dry-run JSON with the CPU ranks' live bytes as the measurement")
    ap.add_argument("--rank-timeout", type=int, default=RANK_TIMEOUT_S,
                    help="with --stop37: seconds a rank may run (a loaded CPU machine's dry run needs more)")
    ap.add_argument("--cases37", type=int, nargs="*", default=None, help="with --stop37: only these indices of STOP37")
    ap.add_argument("--live", action="store_true",
                    help="with --stop37: each case also run on CPU tensors under the live-bytes recorder "
                         "(always with --dry-run)")
    ap.add_argument("--analyze", nargs="*", default=None, metavar="HISTORY",
                    help="read allocator histories recorded with SYMMEM_CUDA_SNAPSHOT=DIR: each step's peak with and "
                         "without the collectives' own temporaries (no GPU needed)")
    args = ap.parse_args(argv)
    if args.analyze is not None:
        for path in args.analyze:
            steps_ = c10d_excess(path)
            print(f"{Path(path).name}: " + "; ".join(
                f"step {k + 1} {a:,} ({a - b:+,} in collectives, {b - c:+,} copy-out metadata)"
                for k, (a, b, c) in enumerate(steps_)))
        return 0
    if args.standin:
        Path(args.standin[1]).write_text(json.dumps(standin(json.loads(Path(args.standin[0]).read_text())),
                                                    indent=1) + "\n")
        return 0
    DRY, PAUSE, RANK_TIMEOUT_S = args.dry_run, args.pause, args.rank_timeout
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if args.case37 is not None:  # one --stop37 case on one rank, in a process the main run started
        from datetime import timedelta

        torch.set_num_threads(1)  # up to 16 ranks at once on 16 cores; the suite's ranks run with one thread
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world,
                                timeout=timedelta(seconds=RANK_TIMEOUT_S))
        if not DRY:
            torch.cuda.set_device(0)
            warm_cublas()
        print(json.dumps(stop37_case(args.case37, args.world, args.rank, args.live or DRY)), flush=True)
        dist.destroy_process_group()
        return 0
    if args.stop37:
        t0 = time.time()
        world = max(2, args.world)
        device = "cpu (dry run)" if DRY else torch.cuda.get_device_name()

        def save(rows: list[dict[str, Any]]) -> None:
            if args.json:
                Path(args.json).write_text(json.dumps(
                    {"device": device, "versions": {"torch": torch.__version__}, "world": world, "steps": 4,
                     "how": "benchmarks/check_cuda_engines.py --stop37: each case two processes on the one GPU over "
                            "gloo (CUDA tensors), each rank's peaks less its baseline (after cuBLAS's workspaces)",
                     "rows": sorted(rows, key=lambda r: (r["case"], r["rank"]))}, indent=1) + "\n")

        rows = stop37_rows(args.jobs, world, args.live or DRY, args.cases37, save)
        save(rows)
        failed = sum("error" in r for r in rows)
        print(f"{len(rows)} rank rows of {len(STOP37)} cases, {failed} failed, in {time.time() - t0:.0f} s on "
              f"{device}", flush=True)
        return 1 if failed else 0
    if args.case is not None:  # one case, in a process the main run started
        nccl = not DRY and args.world == 1
        dist.init_process_group("nccl" if nccl else "gloo", rank=args.rank, world_size=args.world,
                                **({"device_id": torch.device("cuda:0")} if nccl else {}))
        if not DRY:
            warm_cublas()
        print(json.dumps(one_case(args.case, args.world, args.rank)), flush=True)
        dist.destroy_process_group()
        return 0
    if DRY or args.world > 1:
        dist.init_process_group("gloo", rank=0, world_size=1)
        band: dict[str, int] = {}
    else:
        try:
            band = nccl_band()
            print("NCCL outside the caching allocator (bytes):", band, flush=True)
        except Exception as exc:  # no NCCL here: the engines still run over gloo, with CUDA tensors
            print(f"NCCL failed ({type(exc).__name__}: {exc}); gloo instead", flush=True)
            band = {"error": str(exc)}
            if not dist.is_initialized():
                dist.init_process_group("gloo", rank=0, world_size=1)
    engine_rows(args.jobs, tuple(args.only), args.world)
    device = "cpu" if DRY else torch.cuda.get_device_name()
    versions = {"torch": torch.__version__,
                "nccl": "" if DRY else ".".join(map(str, torch.cuda.nccl.version()))}
    dist.destroy_process_group()
    ok = sum(r["ok"] for r in ROWS)
    print(f"{ok} of {len(ROWS)} rows agree; {device} {versions}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "versions": versions, "nccl": band,
                                               "rows": ROWS}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
