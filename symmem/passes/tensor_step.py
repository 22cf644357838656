"""The peak per rank under tensor (and sequence) parallelism as DTensor runs it, behind :class:`symmem.step.Step`.

``parallelize_module`` with the standard Llama plan (:func:`symmem.passes.model_parallel.tensor_rank`: the
embedding row-wise, q/k/v/gate/up column-wise, o/down row-wise, the head column-wise with its output replicated)
gives every rank the same shapes, so every rank has the same peak.  Measured per rank on gloo
(``symmem.record.model_parallel_runs``, torch 2.13, the loss ``sum``, for-loop AdamW), the steady step's largest
moment is one of two:

* **the forward's end**, at the head's all-gather: what lives between steps (the local parameter shards, Adam's
  state, the buffers, the batch), every activation autograd keeps on the rank (:class:`TensorRank.saved`), the
  collective outputs kept beside it -- the embedding's all-reduce output is two storages (the all-reduce's and
  funcol's autograd wrapper's), one of them saved; under sequence parallelism the reduce-scatter's pair, S split,
  and the final norm's S-split output, held until the forward ends -- the forward's constants (the position ids,
  eager attention's causal mask), the head's local logits (``V/t`` wide) and the replicated logits twice (the
  all-gather's output and its wrapper, then the concatenated logits beside the all-gather's);
* **the optimizer step** (for-loop Adam on the local shards): what lives between steps, every gradient (the
  embedding's whole: ``V x H``, replicated), and one parameter's ``sqrt`` and ``denom`` beside the previous
  parameter's ``denom`` (the embedding's replicated gradient is redistributed to its shard by a copy per use:
  two at once, as large as its two temporaries), in the order the module lists its parameters.

Nothing in the backward exceeds both in the runs (its largest moment, the head's and the last norm's backward,
stays below the optimizer step there); it is not modelled.  The first step: no optimizer state exists before
AdamW's first step makes it, so the forward's end is lower by the state; its optimizer step is taken as the
steady one's (an upper bound: the state is made parameter by parameter).  What gloo's worker thread holds past a
collective's wait (an input or output released when the thread gets to it, at no fixed op) is outside tensor
accounting; the measurement takes each moment's fewest bytes over three steady steps.

>>> from symmem import derive
>>> d = derive("llama", tensor_parallel=True, attention="naive", device="cpu",
...            values={"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 1, "V": 64, "F": 64, "t": 2})
>>> d.value("peak"), d.peak_at().where(step=False)
(126288, "rank 0 of 2 (every rank alike): forward's end (the head's all-gather)")
>>> d.step.per_rank(d.numbers)["peak_rank"]
0
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy

from ..errors import SymmemError
from ..graph import Graph
from ..peak import Moment, Peak
from ..shapes import numel
from ..timeline import Row, Which
from ..training import Regime


@dataclass(frozen=True)
class RankMoment(Moment):
    """A moment of one tensor-parallel rank's step (every rank has the same)."""

    ranks: int | sympy.Expr = 1
    what: str = ""

    def where(self, step: bool = True) -> str:
        return f"rank 0 of {self.ranks} (every rank alike): {self.what}" + (f", {self.step} step" if step else "")


@dataclass(frozen=True)
class RankMoments:
    """One rank's step as formulas: what lives between steps, the forward's end and the optimizer step's largest
    moment (steady), and the first step's forward end (no optimizer state yet)."""

    at_rest: sympy.Expr
    forward_end: sympy.Expr
    step: sympy.Expr
    first_forward_end: sympy.Expr

    @property
    def peak(self) -> sympy.Expr:
        return sympy.Max(self.forward_end, self.step)


def rank_peak(graph: Graph, rank: Any, sequence: bool) -> RankMoments:
    """The moments of one rank's step (see the module's note) from its :class:`TensorRank` ``rank``."""
    from ..symbols import t
    from .model_parallel import _bytes, _module_buffers

    act = "float32"
    nodes = list(graph.program_order())
    outside = [n for n in nodes if graph.node(n).block is None]
    ids = sum((_bytes(graph, n, act) for n in outside if graph.node(n).kind == "input"), sympy.Integer(0))
    buffers = sympy.Add(*_module_buffers(graph, act).values())
    constants = sum((_bytes(graph, n, act) for n in outside if graph.node(n).kind == "constant"), sympy.Integer(0))
    embedding = next(n for n in outside if graph.node(n).kind == "embedding")
    head = next(n for n in reversed(outside) if graph.node(n).kind == "linear")
    hidden, logits = _bytes(graph, embedding, act), _bytes(graph, head, act)
    at_rest = rank.parameters + rank.optimizer_state + buffers + ids
    # the embedding's all-reduce (sequence parallel: reduce-scatter) output beside its saved wrapper; with
    # sequence parallelism also the final norm's S-split output, held until the forward ends
    kept = 2 * hidden / t if sequence else hidden
    forward_end = at_rest + rank.saved + kept + constants + logits / t + 2 * logits
    step = at_rest + rank.gradients + _step_temporaries(graph)
    return RankMoments(at_rest, forward_end, step, forward_end - rank.optimizer_state)


def _step_temporaries(graph: Graph) -> sympy.Expr:
    """For-loop Adam's largest temporaries on the local shards: ``Max`` over the parameters, in the order the
    Llama reference lists them (the embedding; each layer's linears, then its norms; the final norm; the head),
    of two of a parameter's size beside the previous parameter's ``denom``."""
    from ..symbols import t

    first: list[sympy.Expr] = []
    layer: list[sympy.Expr] = []
    norms: list[sympy.Expr] = []
    last: list[sympy.Expr] = []
    count: sympy.Expr = sympy.Integer(1)
    for n in graph.program_order():
        node = graph.node(n)
        shapes = [tuple(node.params["value"])] if node.kind == "parameter" else [tuple(s) for s in
                                                                                  node.params.values()]
        for shape in shapes:
            local = numel(shape) * 4 / (t if len(shape) >= 2 else 1)
            if node.block is not None:
                count = node.count
                (layer if len(shape) >= 2 else norms).append(local)
            else:
                (first if node.kind == "embedding" else last).append(local)
    if len(first) != 1 or not layer or not last:
        raise SymmemError("the tensor-parallel step follows the Llama reference's parameters (an embedding, "
                          "repeated layers, a head)")
    order = first + layer + norms + last
    candidates = [2 * order[0]] + [a + 2 * b for a, b in zip(order, order[1:], strict=False)]
    # with two or more layers a layer's first parameter follows the last of the layer before
    again = (norms or layer)[-1] + 2 * layer[0]
    candidates.append(sympy.Piecewise((again, sympy.Ge(count, 2)), (0, True)))
    return sympy.Max(*candidates)


@dataclass(eq=False)
class TensorStep:
    """The step of one tensor-parallel rank (DTensor's standard plan; ``numbers`` the derivation's, ``t``
    included): the peak per device is every rank's, ``Max`` of the forward's end and the optimizer step."""

    moments: RankMoments
    numbers: Mapping[sympy.Symbol, int]
    domain_: tuple[sympy.Basic, ...] = ()
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def _ranks(self) -> int | sympy.Expr:
        found = {s.name: v for s, v in self.numbers.items()}
        return int(found["t"]) if "t" in found else sympy.Symbol("t", positive=True, integer=True)

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None) -> Peak:
        even({s.name: int(v) for s, v in {**self.numbers, **(at or {})}.items()})
        if "peak" not in self._cache:
            r, ranks = self.moments, self._ranks()
            made = []
            for step, forward in (("steady", r.forward_end), ("first", r.first_forward_end)):
                made.append(RankMoment("forward", "lm_head", "", step, {"live": forward}, ranks=ranks,
                                       what="forward's end (the head's all-gather)"))
                made.append(RankMoment("step", None, "", step, {"live": r.step}, ranks=ranks,
                                       what="the optimizer step"))
            self._cache["peak"] = Peak(None, None, tuple(made), self.domain_)
        return self._cache["peak"]

    def per_rank(self, numbers: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Every rank's steady-step peak at ``numbers`` (all alike), and the rank named as the largest."""
        merged = {**self.numbers, **numbers}
        value = self.peak().value(merged)
        ranks = {s.name: int(v) for s, v in merged.items()}.get("t", 1)
        return {"peak_per_rank": [value] * ranks, "peak_rank": 0}

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        return self.peak().holds_at(numbers)

    def domain(self) -> tuple[sympy.Basic, ...]:
        return tuple(self.domain_)

    def timeline(self, which: Which, at: Mapping[sympy.Symbol, int]) -> list[Row]:
        raise SymmemError("a tensor-parallel rank's timeline is not modelled op by op: its peak is the larger of "
                          "the forward's end and the optimizer step (symmem ranks gives each part)")

    def allocated(self, which: Which, at: Mapping[sympy.Symbol, int]) -> int:
        raise SymmemError("the tensor-parallel peak in CUDA's 512-byte blocks is not modelled: the peak per device "
                          "is in bytes of tensors")


def even(numbers: Mapping[str, int]) -> None:
    """Refuse sizes the plan cannot split evenly: ``t`` must divide the heads (``h``, ``G``), the MLP width (``F``)
    and the vocabulary (``V``); DTensor would pad the last shard, which is not modelled."""
    size = numbers.get("t")
    if size is None:
        return
    if size < 1:
        raise SymmemError(f"the tensor-parallel size t must be at least 1, got t={size}")
    for name in ("h", "G", "F", "V"):
        if name in numbers and numbers[name] % size:
            raise SymmemError(f"t={size} does not divide {name}={numbers[name]}: DTensor's plan splits the heads (h, "
                              "G), the MLP width (F) and the vocabulary (V) evenly over the ranks (uneven shards are "
                              "padded: not modelled)")


def refusal(model_name: str, regime: Regime, loss: str | None, device: str = "cpu") -> str | None:
    """Why the tensor-parallel peak is not modelled for this derivation (None: it is)."""
    from .schedule import optimizer_impl

    if model_name != "llama":
        return f"the tensor-parallel peak follows DTensor's standard plan, which is Llama's; not {model_name}"
    if regime.precision != "fp32" or regime.optimizer not in ("adam", "adamw") or regime.checkpoint != "none":
        return "the tensor-parallel peak is modelled for FP32 Adam/AdamW without checkpointing (what was measured)"
    if regime.zero or regime.pipeline_parallel or regime.micro_batches != 1:
        return "the tensor-parallel peak is modelled alone: no ZeRO, pipeline stages or micro-batches with it"
    if loss not in (None, "sum"):
        return f"the tensor-parallel peak is modelled for the loss 'sum' (what was measured), not {loss!r}"
    if device != "cpu" or optimizer_impl(regime, device) != "for-loop":
        return ("the tensor-parallel peak is measured on CPU ranks (gloo) with the for-loop AdamW: give --device "
                f"cpu (here {device}, {optimizer_impl(regime, device)} AdamW); NCCL's buffers are not modelled")
    return None


def storages_rank(graph: Graph, storages: Sequence[Any], regime: Regime, sequence: bool) -> RankMoments:
    """:func:`rank_peak` from the single-device ``storages`` (the pytorch convention)."""
    from .model_parallel import tensor_rank

    return rank_peak(graph, tensor_rank(graph, storages, regime, sequence), sequence)
