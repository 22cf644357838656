"""What a tensor-parallel rank's step holds more, or less, under activation checkpointing (``--checkpoint full`` or
``every-K`` with ``--tensor-parallel``, torchtitan's order: ``parallelize_module``, then the checkpoint wrapper per
block, ``torch.utils.checkpoint`` non-reentrant).

Measured per rank on gloo (``symmem.record.model_parallel_runs``, the recorder that sees DTensor's local ops):

* the recomputed forward re-runs the collectives: a row-parallel linear's all-reduce (o_proj, down_proj) makes its
  output beside funcol's wrapper and the partial sum again, as in the forward, and both die with the residual sum
  that reads them (no op of the recomputation keeps them);
* the checkpoint frame holds the block's input -- the embedding's all-reduce output and its wrapper for the first
  layer, the residual sum of the layer before for the others -- until the block's backward is done;
* HF passes a checkpointed layer no ``DynamicCache``: no key/value copies are held to the forward's end;
* RMSNorm's ``hidden_states.to(torch.float32)`` of a float32 tensor is the tensor itself (no autograd node): the
  gradients of the norm's two paths are summed into the residual stream's buffer as each arrives, the residual's
  gradient (there first) let go at the first sum (:class:`CastsInPlace`);
* under sequence parallelism the recomputation all-gathers the column-parallel inputs again, kept once at B = 1
  (funcol's wrapper let go after the linear), and the last row-parallel linear's output gradient is all-gathered
  before the recomputation (:func:`gathered_ahead`, :func:`recompute_gathers`);
* under FSDP2 x TP (the checkpoint wrapper inside ``fully_shard``, torchtitan's order) a unit's pre-backward hook
  all-gathers its parameters before the recomputation (as on one axis:
  :meth:`~symmem.passes.schedule.Simulation.backward`).

>>> from symmem import derive
>>> v = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 64, "t": 2}
>>> d = derive("llama", tensor_parallel=True, attention="naive", device="cpu", checkpoint="full", values=v)
>>> d.value("peak"), d.value("peak_first_step")
(126552, 124624)
>>> v = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64, "N": 2, "t": 2}
>>> d = derive("llama", data_parallel="fsdp", tensor_parallel=True, attention="sdpa", device="cpu",
...            checkpoint="full", values=v)
>>> d.value("peak"), d.value("peak_first_step")  # every rank of the 2 x 2 mesh on gloo: the same
(166716, 120936)
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import sympy

from ..graph import Graph
from ..training import Regime
from .schedule import Simulation


class CastsInPlace(Simulation):
    """The single-device step as :class:`~symmem.passes.schedule.Simulation` walks it, except that a gradient
    handed to a ``cast`` that is a view of its input (``.to()`` of the dtype it has: PyTorch returns the tensor,
    records no autograd node) goes to its input's buffer, where it is summed with what is there as it arrives."""

    def _gather(self, n: str, handoff: list[tuple[str, int]], params_out: list[tuple[str, int]]) -> None:
        super()._gather(n, [(self._through(x), sid) for x, sid in handoff], params_out)

    def _through(self, x: str) -> str:
        """``x``, or the value under the no-op casts it is."""
        while self.graph.node(x).kind == "cast" and self.base.get(x, x) != x and self.graph.node(x).inputs:
            x = self.graph.node(x).inputs[0]
        return x


def gathered_ahead(events: Sequence[Any], row: Collection[str]) -> dict[int, str]:
    """Under sequence parallelism a checkpointed segment's backward begins with the last row-parallel linear's
    output gradient all-gathered over S (the reduce-scatter's backward saves nothing, so it runs before the
    recomputation that the first saved tensor's unpacking starts): each recomputation event -> that linear.

    >>> from types import SimpleNamespace as E
    >>> ev = [E(phase="backward", node="a#1:recompute"), E(phase="backward", node="add2#1"),
    ...       E(phase="backward", node="down#1")]
    >>> gathered_ahead(ev, {"down#1"})
    {0: 'down#1'}
    """
    found: dict[int, str] = {}
    waiting: list[int] = []
    for k, e in enumerate(events):
        if e.phase != "backward" or e.node is None:
            continue
        if str(e.node).endswith(":recompute"):
            waiting.append(k)
        elif e.node in row and waiting:
            found.update(dict.fromkeys(waiting, str(e.node)))
            waiting = []
    return found


def recompute_gathers(walk: Any, e: Any, k: int) -> Any:
    """What a checkpointed sequence-parallel rank holds more at event ``k`` of ``walk`` (a
    :class:`~symmem.passes.tensor_step._SequenceWalk`): through a recomputation, the output gradient all-gathered
    ahead of it (:func:`gathered_ahead`: whole, twice at B = 1: the view of funcol's output and its wrapper); at
    every row-parallel linear's backward at B = 1, that gather's second copy (measured)."""
    if k in walk.ahead:
        return (1 + walk._n(walk.once)) * walk._whole(walk.ahead[k])
    if e.phase == "backward" and e.node in walk.row:
        return walk._n(walk.once) * walk._whole(e.node)
    return walk._sum([])  # (in the walk's mode: formulas or values at its probes)


def checkpoint_refusal(regime: Regime) -> str | None:
    """Why a tensor-parallel rank's peak under ``regime.checkpoint`` is not modelled (None: it is): full and
    every-K checkpointing of the layers under the standard plan, with or without sequence parallelism, and full
    checkpointing under FSDP x TP (``fsdp``, ``fsdp-no-reshard``: the checkpoint wrapper inside ``fully_shard``, as
    torchtitan applies them; ``fsdp1``, ``fsdp1-grad-op``: ``apply_activation_checkpointing`` after wrapping, as
    FSDP1's recipe does) are (measured); selective recomputation, every-K under FSDP x TP and pipeline stages with
    checkpointing are not.

    >>> from symmem.training import Regime
    >>> checkpoint_refusal(Regime(checkpoint="full", tensor_parallel=True, data_parallel="fsdp")) is None
    True
    >>> checkpoint_refusal(Regime(checkpoint="selective", tensor_parallel=True)).endswith("not 'selective'")
    True
    >>> checkpoint_refusal(Regime(checkpoint="every-2", tensor_parallel=True, data_parallel="fsdp"))[-42:]
    '(measured on gloo): not every-2 under fsdp'
    """
    if regime.checkpoint not in ("none", "full") and not regime.checkpoint.startswith("every-"):
        return ("the tensor-parallel peak with checkpointing is modelled for 'full' and 'every-K' (what was "
                f"measured), not {regime.checkpoint!r}")
    fsdp = regime.data_parallel in ("fsdp", "fsdp-no-reshard", "fsdp1", "fsdp1-grad-op")
    if (regime.data_parallel and not (fsdp and regime.checkpoint == "full")) or regime.zero or (
            regime.pipeline_parallel):
        where = ("on pipeline stages" if regime.pipeline_parallel else f"under {regime.data_parallel}"
                 if regime.data_parallel else "under ZeRO")
        return ("the tensor-parallel peak with checkpointing is modelled alone (full or every-K), with sequence "
                "parallelism, and under FSDP x TP with full checkpointing (measured on gloo): not "
                f"{regime.checkpoint} {where}")
    return None


def simulation(regime: Regime, casts: bool = True) -> type[Any]:
    """The walk a tensor-parallel rank's step follows: under checkpointing :class:`CastsInPlace` (measured there;
    ``casts`` False: a walk that sums the norms' gradients its own way), the single-device
    :class:`~symmem.passes.schedule.Simulation` otherwise (its values unchanged)."""
    return CastsInPlace if regime.checkpoint != "none" and casts else Simulation


def frame_held(graph: Graph, sequence: bool) -> sympy.Expr:
    """What a checkpointed rank holds at the forward's end and in the final norm's backward beside its saved
    activations (:func:`~symmem.passes.model_parallel.tensor_rank` of the checkpointed ledger): the last layer's
    output, which the final norm keeps (whole; S-split under sequence parallelism), and the constants the frames
    were called with (eager attention's mask: whole, held until the first layer's backward is done).

    >>> from symmem.models import build
    >>> from symmem.symbols import B, H, S, t
    >>> frame_held(build("llama", attention="sdpa").graph, False) == 4 * B * S * H
    True
    >>> frame_held(build("llama", attention="naive").graph, True) == 4 * B * S * H / t + 4 * B * S * S
    True
    """
    from ..symbols import t
    from .model_parallel import _bytes

    blocks = list(graph.blocks.values())
    last = _bytes(graph, blocks[-1].output, "float32")
    read = {i for n in graph.program_order() if graph.node(n).block is not None for i in graph.node(n).inputs}
    constants = sum((_bytes(graph, n, "float32") for n in graph.program_order()
                     if graph.node(n).kind == "constant" and graph.node(n).block is None and n in read),
                    sympy.Integer(0))
    return (last / t if sequence else last) + constants
