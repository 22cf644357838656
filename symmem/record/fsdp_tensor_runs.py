"""FSDP x TP measured per rank: FSDP2's ``fully_shard`` (or FSDP1) over a ``parallelize_module``'d Llama on an N x t
mesh.

The engine is PyTorch's 2-D recipe (the tutorial's, torchtitan's): ``init_device_mesh("cpu", (N, t),
mesh_dim_names=("dp", "tp"))``, ``parallelize_module(model, mesh["tp"], plan)`` with the standard Llama plan
(:func:`symmem.record.model_parallel_runs.llama_plan`: the embedding row-wise, q/k/v/gate/up column-wise, o/down
row-wise, the head column-wise with its output replicated), then ``fully_shard(layer, mesh=mesh["dp"])`` on each
layer and on the root.  Each parameter is then a DTensor on the 2-D mesh: the tensor-parallel shard of a rank,
itself split over the N ranks of its data-parallel group along dim 0 (padded to a multiple of N).  With
``sequence_parallel`` among a case's options the plan is torchtitan's sequence-parallel one
(:func:`~symmem.record.model_parallel_runs.llama_sequence_plan`); the reference's own forward sizes the rotary
tables and the mask from the ids, the whole sequence.

:func:`fsdp_tensor_runs` starts ``N*t`` forked processes in one gloo group on 127.0.0.1 (bounded waits), and in
each rank records training steps (the loss ``sum``, for-loop AdamW) with the DTensor- and FSDP-aware recorder
(:class:`~symmem.record.sharded.ShardTracker`, :func:`~symmem.record.sharded.train_steps`): the local bytes of
the parameters, gradients and optimizer state, what autograd keeps after the forward, and the first and steady
step's peaks (each moment at its fewest bytes over the recorded steps, as the tensor-parallel runs take them;
every rank's jobs under :func:`~symmem.record.collectives.released` for FSDP's collectives and the recorder's
:class:`~symmem.record.collectives.FuncolRelease` for DTensor's, so no free waits for gloo's worker thread:
:attr:`MeshRun.late` names any that did).  gloo's copy of the reduce-scatter input
made inside the collective (first seen as an aliased output, the recorder's ``external``) is left out, as for
FSDP2 alone.  With a case's ``checkpoint`` option (``"full"``) each layer is put under ``checkpoint_wrapper``
(non-reentrant) after ``parallelize_module`` and before ``fully_shard``, torchtitan's order.  With a case's
``fsdp1`` option the engine is PyTorch's original 2-D recipe instead:
``FullyShardedDataParallel(model, device_mesh=mesh["dp"], auto_wrap_policy=ModuleWrapPolicy({layer}),
use_orig_params=True)`` with that ``ShardingStrategy`` (``FULL_SHARD``, ``SHARD_GRAD_OP``), recorded with
:class:`~symmem.record.fsdp1_runs.FlatTracker` (FSDP1's ``FlatParameter`` let through).  Needs ``torch`` with
``torch.distributed`` (imported lazily).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError
from .fsdp1_runs import FlatTracker
from .model_parallel_runs import FIRST_STEPS, STEADY_STEPS, _fewest_at, _live, late_frees  # repeated_steps' steps


@dataclass(frozen=True)
class MeshRun:
    """One rank's FSDP x TP step: its coordinates on the mesh, the local bytes of its parameters (the padded 2-D
    shards), gradients after the first backward, AdamW's state after the first step, the bytes autograd keeps
    after the first forward (each storage once, a DTensor's local shard), and the first and steady step's peaks
    with where each is (phase, op)."""

    rank: int
    dp: int
    tp: int
    parameters: int
    gradients: int
    optimizer_state: int
    saved: int
    first_peak: int
    steady_peak: int
    first_at: tuple[str, str] = ("", "")
    steady_at: tuple[str, str] = ("", "")
    #: every step's raw live-bytes peak (first steps, then steady ones)
    peaks: tuple[int, ...] = ()
    #: the frees of recorded storages (gloo's own copies left out) that ran off the recording thread
    #: (``StepTrace.late``, named)
    late: tuple[str, ...] = ()




def fsdp_tensor_step(values: Mapping[str, int], rank: int, dp: int, tp: int, options: Mapping[str, Any],
                     reshard: bool = True) -> MeshRun:
    """This rank's measurement (inside an initialized gloo group of ``dp * tp`` ranks)."""
    import warnings

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from ..reference.sequence_models import reference
    from .model_parallel_runs import llama_plan, llama_sequence_plan, repeated_steps

    torch.manual_seed(0)
    options = dict(options)
    sequence = bool(options.pop("sequence_parallel", False))
    strategy = options.pop("fsdp1", None)  # FSDP1's ShardingStrategy, or None: FSDP2
    checkpoint = options.pop("checkpoint", "none")  # torchtitan's order: the wrapper inside fully_shard (below)
    # a traced module's own: (module, inputs, its plan's styles, its blocks[, the forward giving the output])
    given = options.pop("module", None)
    run = None
    if given is None:
        module, (ids,) = reference("llama", values, **options)
        styles, blocks = llama_sequence_plan if sequence else llama_plan, module.layers
    else:
        module, (ids,), styles, blocks, *made = given()
        run = made[0] if made else None
        module.train()
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(module, mesh["tp"], styles(module, tp))
    if checkpoint != "none" and strategy is None:
        _checkpointed_layers(module, blocks, checkpoint, given is None)
    if strategy is not None:
        block = type(blocks[0])
        module = _fsdp1(module, mesh["dp"], strategy, block)
        if checkpoint != "none":  # FSDP1's recipe: the wrappers applied inside the wrapped units
            _fsdp1_checkpointed(module, block, checkpoint, given is None)
    else:
        for layer in blocks:
            fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=reshard)
        if sequence or given is not None:  # the replicated output comes back as a view of the all-gathered one
            # (the reference's under sequence parallelism, a colwise_rep head's): the loss sums it out of place
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=reshard)
    if given is None:  # the data differ over dp (each group its own batch), not over tp (the plan replicates them)
        ids = torch.randint(0, int(values["V"]), tuple(ids.shape),
                            generator=torch.Generator().manual_seed(1 + mesh.get_local_rank("dp")))
    params = [p for p in module.parameters() if p.requires_grad]
    forward = run if run is not None else module
    saved, parts = _first_step(forward, module, ids, params)
    steps = FIRST_STEPS + STEADY_STEPS
    trace = repeated_steps(lambda: forward(ids), ids, params, module, resizes=True,
                           tracker=None if strategy is None else FlatTracker)
    gloo = {s.sid for s in trace.storages if s.category == "external"}
    first, first_at = _fewest_at(trace, range(1, FIRST_STEPS + 1), gloo)
    steady, steady_at = _fewest_at(trace, range(FIRST_STEPS + 1, steps + 1), gloo)
    late = late_frees(trace, gloo)
    return MeshRun(rank, mesh.get_local_rank("dp"), mesh.get_local_rank("tp"), *parts, saved, first, steady,
                   first_at, steady_at, _per_step(trace, gloo), late)


def _checkpointed_layers(module: Any, blocks: Any, checkpoint: str, supported: bool) -> None:
    """Each of ``blocks`` (a ``ModuleList``) put under ``checkpoint_wrapper`` (non-reentrant) in place
    (:func:`~symmem.record.sharded.checkpoint_wrapped`), after ``parallelize_module`` and before ``fully_shard``, as
    torchtitan applies activation checkpointing; the reference's own layers then run unwrapped, and with no
    ``DynamicCache`` (HF passes checkpointed layers none).  Full checkpointing of the Llama reference under FSDP2
    only."""
    from .sharded import checkpoint_wrapped

    if checkpoint != "full" or not supported:
        raise SymmemError("the FSDP x TP runs checkpoint the Llama reference's layers under FSDP2 ('full'), "
                          f"not {checkpoint!r} there")
    module.cache = False
    checkpoint_wrapped(module, list(blocks))


def _fsdp1_checkpointed(module: Any, block: type, checkpoint: str, supported: bool) -> None:
    """FSDP1's activation checkpointing as its recipe applies it, after wrapping: ``apply_activation_checkpointing``
    puts each ``block`` inside its unit under a non-reentrant ``checkpoint_wrapper``; no ``DynamicCache``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    if checkpoint != "full" or not supported:
        raise SymmemError(f"the FSDP1 x TP runs checkpoint the Llama reference's layers ('full'), not {checkpoint!r}")
    inner = module.module  # the root unit's module: the reference
    inner.cache = False
    apply_activation_checkpointing(module, check_fn=lambda m: isinstance(m, block))


def _fsdp1(module: Any, mesh: Any, strategy: str, block: type) -> Any:
    """FSDP1 over the data-parallel mesh dimension, as PyTorch's original 2-D recipe wraps a
    ``parallelize_module``'d model: one unit per layer, the root holding the rest, ``use_orig_params=True``
    (FSDP1 flattens each DTensor's local shard through its DTensor extension)."""
    import torch
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(module, device_mesh=mesh, auto_wrap_policy=ModuleWrapPolicy({block}),
                                    use_orig_params=True, sharding_strategy=getattr(ShardingStrategy, strategy),
                                    device_id=torch.device("cpu"))


def _first_step(forward: Any, module: Any, ids: Any, params: list[Any]) -> tuple[int, tuple[int, int, int]]:
    """One step before the recorded ones (FSDP's lazy initialization runs in it): the bytes autograd keeps after
    the forward (each storage once, a DTensor's local shard; not the parameters, sharded or all-gathered, nor the
    ids), and the local bytes of the parameters, the gradients and AdamW's state after it."""
    from .optim import make_optimizer, state_tensors
    from .sharded import local, saved_storages

    def held() -> set[int]:
        # FSDP swaps the module's parameters for the all-gathered ones in forward: whichever are there now
        return {local(p).untyped_storage()._cdata for p in module.parameters()} | {ids.untyped_storage()._cdata}

    out, found = saved_storages(lambda: forward(ids), held)
    saved = sum(v[0] for v in found.values())
    out.sum().backward()
    del out
    opt = make_optimizer(params, "adamw", "for-loop")
    opt.step()

    def nbytes(ts: Any) -> int:
        # each storage once: FSDP's sharded gradients of a unit view one flat buffer
        return sum({id(s): s.nbytes() for s in (local(t).untyped_storage() for t in ts)}.values())

    parts = (nbytes(params), nbytes(p.grad for p in params if p.grad is not None), nbytes(state_tensors(opt)))
    opt.zero_grad(set_to_none=True)
    return saved, parts


def _per_step(trace: Any, left_out: set[int]) -> tuple[int, ...]:
    live = _live(trace, left_out)
    best: dict[int, int] = {}
    for r, v in zip(trace.records, live, strict=True):
        best[r.step] = max(best.get(r.step, 0), v)
    return tuple(best[k] for k in sorted(best))


def fsdp_tensor_runs(dp: int, tp: int, cases: Sequence[tuple[Mapping[str, int], Mapping[str, Any]]],
                     reshard: bool = True) -> list[list[MeshRun]]:
    """Per rank (``dp * tp`` of them, rank ``r`` at mesh coordinates ``(r // tp, r % tp)``), one :class:`MeshRun`
    per case ``(values, builder options)`` of the Llama reference (``reshard_after_forward`` among the options:
    that case's FSDP setting, else ``reshard``; ``fsdp1``: FSDP1's ``ShardingStrategy`` name, PyTorch's original
    2-D recipe in place of ``fully_shard``; ``module``: a callable giving a traced module's own ``(module, inputs,
    styles(module, t), blocks[, forward])`` in place of the Llama reference, ``fully_shard`` on each of ``blocks``
    and the root).  A rank that fails or hangs is a :class:`SymmemError`."""

    import torch.distributed.fsdp  # noqa: F401 - imported once here, inherited by the forked ranks
    import torch.distributed.tensor.parallel  # noqa: F401

    from .model_parallel_runs import forked_ranks

    for n, what in ((dp, "data-parallel size N"), (tp, "tensor-parallel size t")):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SymmemError(f"the {what} is a positive integer, got {n!r}")
    world = dp * tp
    jobs = [(dict(values), dp, {k: v for k, v in options.items() if k != "reshard_after_forward"},
             bool(options.get("reshard_after_forward", reshard))) for values, options in cases]

    def work(rank: int, world: int) -> list[MeshRun]:
        from .collectives import released

        with released():  # FSDP's own collectives (torch.distributed's) released on this thread, as DTensor's are
            return [fsdp_tensor_step(values, rank, dp, world // dp, options, reshard)
                    for values, dp, options, reshard in jobs]

    return forked_ranks(world, work, "the FSDP x TP run")
