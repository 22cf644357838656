"""The stress check of :func:`symmem.record.collectives.released`: each collective the engines call, many times on
real gloo ranks, each rank under a live-bytes recorder that notes the thread every free runs on
(``StepTrace.late``).  Needs ``torch`` with ``torch.distributed`` (imported lazily)."""

from __future__ import annotations

from ..errors import SymmemError
from .collectives import released

#: the collectives :func:`stress` runs (each as the engines call it: asynchronous, then waited for; ``all_gather``
#: also synchronous, as FSDP1 calls it; ``isend`` from rank 0 to rank 1's ``irecv``)
STRESSED = ("all_gather_single", "all_gather_sync", "reduce_scatter_single", "all_reduce", "broadcast", "isend")
#: funcol's collectives as DTensor calls them (``torch.distributed._functional_collectives``: the
#: ``_c10d_functional`` op, then ``wait_tensor``), run by :func:`stress_funcol` under the recorder's
#: :class:`~symmem.record.collectives.FuncolRelease`
FUNCOL_STRESSED = ("funcol_all_gather", "funcol_reduce_scatter", "funcol_all_reduce")
#: what a stress rank imports (``start_method="fork"``: imported in the calling process first, once)
STRESS_IMPORTS = ("torch.distributed", "torch.distributed.tensor", "symmem.record.sharded",
                  "symmem.record.collectives")


def stress(world: int = 2, repeats: int = 200, *, release: bool = True, timeout: float = 120.0,
           start_method: str = "spawn", funcol: bool = False) -> dict[str, tuple[int, int]]:
    """Run each collective of :data:`STRESSED` ``repeats`` times on ``world`` gloo ranks, each rank under a
    live-bytes recorder, on tensors made and dropped at once (a 16 KiB input, its output, a sum of the output);
    ``release``: inside :func:`released`.  Per collective, over the ranks: (frees that ran on another thread than
    the recording one, frees), of the storages the recorder counts (gloo's own copies inside a reduce-scatter, which
    a rank's peak leaves out, excluded).  ``funcol``: :data:`FUNCOL_STRESSED` instead (see :func:`stress_funcol`)."""
    import json
    import os
    import tempfile

    from .distributed import spawn_ranks

    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise SymmemError(f"the stress check needs a world of at least 2 ranks, got {world!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise SymmemError(f"the repeats are a positive integer, got {repeats!r}")
    with tempfile.TemporaryDirectory(prefix="symmem-stress-") as tmp:
        spawn_ranks(_stress_rank, (world, tmp, repeats, release, timeout, funcol), world, timeout=timeout,
                    start_method=start_method, what=f"the {world}-process stress check", imports=STRESS_IMPORTS)
        out: dict[str, tuple[int, int]] = {}
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                for kind, (late, frees) in json.load(f).items():
                    before = out.get(kind, (0, 0))
                    out[kind] = (before[0] + late, before[1] + frees)
    return out


def stress_funcol(world: int = 2, repeats: int = 200, *, release: bool = True, timeout: float = 120.0,
                  start_method: str = "spawn") -> dict[str, tuple[int, int]]:
    """:func:`stress` for funcol's collectives (:data:`FUNCOL_STRESSED`, DTensor's), each rank under the recorder
    that sees DTensor's local ops (:class:`~symmem.record.sharded.ShardTracker`), ``release``: with its
    :class:`~symmem.record.collectives.FuncolRelease`."""
    return stress(world, repeats, release=release, timeout=timeout, start_method=start_method, funcol=True)


def _stress_rank(rank: int, world: int, tmp: str, repeats: int, release: bool, timeout: float,
                 funcol: bool = False) -> None:
    import json
    import os
    from contextlib import nullcontext
    from datetime import timedelta

    from .distributed import rank_starts

    rank_starts()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # 127.0.0.1 only
    import torch
    import torch.distributed as dist

    from .sharded import ShardTracker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout))
    n = 4096
    found = {}
    try:
        if funcol:
            found = _funcol_kinds(world, repeats, release)
        with released() if release and not funcol else nullcontext():
            for kind in () if funcol else STRESSED:
                tracker = ShardTracker()
                with tracker, tracker.phase(1, "forward"):
                    for _ in range(repeats):
                        x = torch.ones(n * world if kind == "reduce_scatter_single" else n)
                        out = torch.empty(n * world if kind.startswith("all_gather") else n)
                        if kind == "all_gather_sync":
                            dist.all_gather_single(out, x)
                            work = None
                        elif kind == "all_gather_single":
                            work = dist.all_gather_single(out, x, async_op=True)
                        elif kind == "reduce_scatter_single":
                            work = dist.reduce_scatter_single(out, x, async_op=True)
                        elif kind == "all_reduce":
                            work = dist.all_reduce(x, async_op=True)
                        elif kind == "broadcast":
                            work = dist.broadcast(x, src=0, async_op=True)
                        else:  # rank 0 sends, rank 1 receives, the others wait
                            work = (dist.isend(x, 1) if rank == 0 else dist.irecv(out, 0) if rank == 1 else None)
                        if work is not None:
                            work.wait()
                        del work, x
                        total = out.sum()
                        del out, total
                trace = tracker.trace()
                gloo = {s.sid for s in trace.storages if s.category == "external"}
                frees = sum(1 for s in trace.storages if s.died is not None and s.sid not in gloo)
                found[kind] = (sum(1 for sid in trace.late if sid not in gloo), frees)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(tmp, f"rank{rank}.json.part"), "w") as f:
        json.dump(found, f)
    os.replace(os.path.join(tmp, f"rank{rank}.json.part"), os.path.join(tmp, f"rank{rank}.json"))


def _funcol_kinds(world: int, repeats: int, release: bool) -> dict[str, tuple[int, int]]:
    """This rank's part of :func:`stress_funcol`: per kind, (late frees, frees) of the recorded storages."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from .sharded import ShardTracker

    group = dist.group.WORLD
    n = 4096
    found = {}
    for kind in FUNCOL_STRESSED:
        tracker = ShardTracker(release=release)
        with tracker, tracker.phase(1, "forward"):
            for _ in range(repeats):
                x = torch.ones(n * world if kind == "funcol_reduce_scatter" else n)
                if kind == "funcol_all_gather":
                    out = funcol.all_gather_tensor(x, 0, group)
                elif kind == "funcol_reduce_scatter":
                    out = funcol.reduce_scatter_tensor(x, "sum", 0, group)
                else:
                    out = funcol.all_reduce(x, "sum", group)
                del x
                total = out.sum()  # waits (an AsyncCollectiveTensor waits at its first use)
                del out, total
        trace = tracker.trace()
        gloo = {s.sid for s in trace.storages if s.category == "external"}
        frees = sum(1 for s in trace.storages if s.died is not None and s.sid not in gloo)
        found[kind] = (sum(1 for sid in trace.late if sid not in gloo), frees)
    return found
