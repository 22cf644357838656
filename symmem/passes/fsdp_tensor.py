"""FSDP x TP: one rank of an N x t mesh, FSDP2's ``fully_shard`` over a ``parallelize_module``'d Llama.

PyTorch's 2-D recipe (``init_device_mesh(device, (N, t), mesh_dim_names=("dp", "tp"))``, the standard Llama plan
over ``mesh["tp"]``, then ``fully_shard`` on every layer and the root over ``mesh["dp"]``) stores every parameter
as a DTensor on both mesh dimensions: first the tensor-parallel shard DTensor's plan gives the rank (the embedding
and the column-parallel weights -- q, k, v, gate, up, the head -- split along their first dimension, the
row-parallel o and down along their second, the norms whole), then FSDP2's padded shard of it: its first
dimension padded to a multiple of N and split evenly, so every rank stores ``ceiling(d0/N)`` rows of its
tensor-parallel shard (:func:`~symmem.passes.data_parallel.shard_rows`).  Measured per rank on gloo
(:mod:`symmem.record.fsdp_tensor_runs`, N = 2, t = 2, every rank), to the byte:

* the parameters and their sharded gradients: those padded 2-D shards, 4 bytes an element each (the embedding's
  gradient, whole on a tensor-parallel rank, is reduce-scattered to its shard like every other);
* AdamW's state: two moments of the *unpadded* rows a rank holds (``held_shape``: the last ranks of a
  data-parallel group hold fewer where N does not divide the tensor-parallel shard's first dimension) and a 4-byte
  ``step`` per parameter;
* what autograd keeps after the forward: the tensor-parallel rank's (:func:`~symmem.passes.model_parallel.
  tensor_rank`): FSDP changes which storage a saved weight lives in, not what activations are kept.

**The step's peak per rank** (:class:`MeshStep`): the single-device step under FSDP2 -- the schedule's Simulation
with :class:`~symmem.passes.data_parallel.Fsdp`'s unit buffers: all-gather outputs, unsharded parameters, the
prefetch, reduce-scatter inputs, sharded gradients -- written out at the numbers (:class:`_MeshWalk`), each
storage at one rank's size: FSDP's buffers at the 2-D shards', an activation at the tensor-parallel rank's, with
what DTensor's collectives hold (:class:`~symmem.passes.tensor_step._LayerWalk`: a row-parallel output's all-reduce
beside its wrapper, a column-parallel input gradient's, the head's replicated logits twice), plus what the
measured step showed beyond the single-device walk: the RMS norms' backward makes a product as large as the norm's
output before each weight's and rsqrt's gradient sum, and a layer norm's input gradient is added into the residual
stream's at once (one gradient fewer than the walk keeps); eager attention's mask lives, as the position ids, to the
forward's end; the embedding's backward makes its gradient whole (V x H) and clones the rank's rows from it before
letting it go (:meth:`_MeshWalk._embedding`), and the backward's end -- the root's post-backward, no op of the
model's -- is a candidate (:func:`_named_end`): where V is large they are the peak (measured at V = 2,048).  The
candidates are every op of the first, the last and the last but one layer (in its backward the
last layer's reduce-scatter input and sharded gradients are alive) and outside the layers; beside them the
optimizer step (for-loop AdamW on the 2-D shards: every sharded gradient, one parameter's ``sqrt`` and ``denom``
beside the previous one's).  Rank 0 of each data-parallel group holds whole shards: its peak is the peak per
device; every rank's is :meth:`MeshStep.ranks`.  Equal to the engine's to the byte on every rank of a 2 x 2 mesh,
first and steady step, ``fsdp`` and ``fsdp-no-reshard``, SDPA and eager attention, L = 2 to 4 (docs/regimes.md).

**With sequence parallelism** (torchtitan's plan, :func:`symmem.record.model_parallel_runs.llama_sequence_plan`,
under the same ``fully_shard``): the same parameter side, the sequence-parallel rank's saved activations, and the
walk :class:`_MeshSequenceWalk`: FSDP's buffers beside :class:`~symmem.passes.tensor_step._SequenceWalk`'s
collectives (the stream split over S, the column-parallel inputs all-gathered whole, the row-parallel outputs
reduce-scattered), the head's input all-gather not held beside its logits' (measured).  Equal to the engine's to
the byte on every rank of a 2 x 2 and a 2 x 4 mesh, B = 1 to 3, L = 1 to 4.

>>> from symmem.api import tensor_parallel_rank
>>> values = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 2, "V": 66, "F": 64}
>>> r = tensor_parallel_rank("llama", values=values, attention="sdpa", device="cpu", data_parallel="fsdp")
>>> r.at({**values, "N": 2, "t": 2})
{'saved': 54336, 'parameters': 23104, 'gradients': 23104, 'optimizer_state': 46292}
>>> tensor_parallel_rank("llama", values=values, attention="sdpa", device="cpu", data_parallel="fsdp",
...                      rank=1).at({**values, "N": 2, "t": 2})["optimizer_state"]
45780
>>> from symmem import derive
>>> d = derive("llama", data_parallel="fsdp", tensor_parallel=True, sequence_parallel=True, attention="sdpa",
...            device="cpu", values={**values, "N": 2, "t": 2})
>>> d.value("peak"), d.peak_at().where(step=False)
(174268, 'rank 0 of N x t = 2 x 2: backward layers.mlp.down_proj (layer 2)')
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import sympy

from ..errors import SymmemError
from ..graph import Graph
from ..peak import Peak
from ..shapes import numel
from ..symbols import N, equals, t
from ..training import Regime, refuse_one_rank
from .parameters import node_parameters
from .rank_step import WalkedStep
from .tensor_step import TensorRankMoment, _LayerWalk, _SequenceWalk, on_probes
from .unroll import iteration, template


def refusal(model_name: str, regime: Regime, loss: str | None, device: str = "cpu") -> str | None:
    """Why the FSDP x TP peak is not modelled for this derivation (None: it is): what the tensor-parallel peak
    refuses (:func:`symmem.passes.tensor_step.refusal`: Llama's plan, FP32 Adam/AdamW, the loss ``sum``, CPU ranks,
    the for-loop AdamW, no checkpointing or micro-batches)."""
    from .tensor_step import refusal as tensor_refusal

    why = tensor_refusal(model_name, regime, loss, device)
    return why.replace("tensor-parallel peak", "FSDP x TP peak") if why else None


def tp_shape(graph: Graph, node: str, shape: tuple[sympy.Expr, ...]) -> tuple[sympy.Expr, ...]:
    """The shape of a parameter of ``node`` on one tensor-parallel rank under the standard Llama plan.

    >>> from symmem.models import build
    >>> g = build("llama").graph
    >>> tp_shape(g, "layers.self_attn.q_proj", g.node("layers.self_attn.q_proj").params["weight"])
    (H/t, H)
    >>> tp_shape(g, "layers.mlp.down_proj", g.node("layers.mlp.down_proj").params["weight"])
    (H, F/t)
    >>> tp_shape(g, "norm.weight", g.node("norm.weight").params["value"])
    (H,)
    """
    n = graph.node(node)
    if len(shape) < 2:
        return tuple(shape)  # the norms: replicated
    column = n.kind == "embedding" or n.role in ("qkv", "mlp_hidden") or (n.kind == "linear" and n.block is None)
    if column:  # RowwiseParallel's embedding and ColwiseParallel's weights: Shard(0)
        return (shape[0] / t, *shape[1:])
    return (shape[0], shape[1] / t, *shape[2:])  # RowwiseParallel's linears: Shard(1)


def parameters(graph: Graph) -> Iterator[tuple[str, sympy.Expr, tuple[sympy.Expr, ...]]]:
    """Every parameter as (node, count, its tensor-parallel rank's shape), in program order."""
    for n in graph.program_order():
        node = graph.node(n)
        for _, shape in node_parameters(n, node):
            yield n, node.count, tp_shape(graph, n, shape)


def mesh_rank(graph: Graph, storages: Sequence[Any], regime: Regime, rank: int = 0, sequence: bool = False) -> Any:
    """One rank of the N x t mesh as a :class:`~symmem.passes.model_parallel.TensorRank` (formulas in N and t),
    from the single-device ``storages`` (the pytorch convention); ``rank`` is its place in its data-parallel group
    (the rows of the optimizer state it holds; rank 0 holds whole shards, the most)."""
    from .data_parallel import held_shape, shard_rows
    from .model_parallel import TensorRank, tensor_rank

    if regime.precision != "fp32" or regime.optimizer not in ("adam", "adamw"):
        raise SymmemError("FSDP x TP's ranks are modelled for FP32 Adam/AdamW, as measured")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise SymmemError(f"a rank is a non-negative integer, got {rank!r}")
    stored = state = sympy.Integer(0)
    for _, count, shape in parameters(graph):
        stored += count * shard_rows(shape, N) * numel(shape[1:]) * 4
        state += count * (2 * numel(held_shape(shape, N, rank)) * 4 + 4)  # exp_avg, exp_avg_sq, step
    saved = tensor_rank(graph, storages, regime, sequence).saved
    return TensorRank(saved, stored, stored, state)


# -- the step, op by op -----------------------------------------------------------------------------------------


#: what the walk calls the backward's end: FSDP's final callback, the root's post-backward (no op of the model's)
END = "the root's post-backward"


def _named_end(tl: Any) -> Any:
    """``tl`` with the backward's end named :data:`END`, so that its moments are candidates of the walk (they are
    the peak where the root's flat parameter is large: a vocabulary of 2,048 against H = 32, measured)."""
    import dataclasses

    events, started = list(tl.events), False
    for k, e in enumerate(events):
        started = started or (e.phase == "backward" and bool(e.node))
        if e.phase == "backward" and started and not e.node:
            events[k] = dataclasses.replace(e, node=END)
    return dataclasses.replace(tl, events=tuple(events))


class _MeshWalk(_LayerWalk):
    """The single-device step under FSDP2 (:class:`~symmem.passes.data_parallel.Fsdp`'s buffers, walked by the
    schedule's Simulation) written out at the numbers, each storage at one rank's size: an activation as on a
    tensor-parallel rank (:class:`~symmem.passes.tensor_step._LayerWalk`), FSDP's all-gather outputs, unsharded
    parameters, reduce-scatter inputs and sharded gradients at the sizes of the 2-D shards; with what DTensor's
    collectives and the RMS norms' backward hold (measured op by op, :meth:`_collectives`)."""

    #: whether the stream is split over S (:class:`_MeshSequenceWalk`)
    sequence = False
    #: the norms' gradients merged by :meth:`_merges` (measured before checkpointing was)
    casts_in_place = False

    def __init__(self, graph: Graph, conv: Any, options: Any, regime: Regime, numbers: Any) -> None:
        from .data_parallel import shard_rows

        super().__init__(graph, conv, options, regime, numbers)
        self.tl = _named_end(self.tl)
        self.stored: dict[str, sympy.Expr] = {}   # parameter -> elements of its 2-D shard (padded rows)
        for n, _, shape in parameters(self.g):
            node = self.g.node(n)
            for name in ([n] if node.kind == "parameter" else [f"{n}.{p}" for p in node.params]):
                self.stored[name] = shard_rows(shape, N) * numel(shape[1:])
        # the RMS norms: (prefix, iteration) -> their nodes by template suffix
        self.norms: dict[str, dict[str, str]] = {}
        for n in self.g.program_order():
            head, _, part = template(n).rpartition(".")
            if head.endswith("norm"):
                self.norms.setdefault(f"{head}#{iteration(n)}", {})[part] = n
        self.norm_of = {n: key for key, parts in self.norms.items() for n in parts.values()}
        self.merge = self._merges()
        # the forward's constants are storages of this walk, not a sum beside it: the position ids and eager
        # attention's mask held until the final norm returns (graph.graph["held_until"]: LlamaModel.forward's locals)
        self.constants = sympy.Integer(0)
        tl = self.tl
        heads = [k for k, e in enumerate(tl.events) if e.phase == "forward" and e.node == self.head]
        self.forward_end = heads[0] if heads else -1
        self.early: dict[int, int] = {}  # none now: each constant goes where the timeline lets it go

    def _merges(self) -> dict[int, sympy.Expr]:
        """A layer's norm backward: autograd adds the normalize path's gradient of the norm's input into the
        gradient already there (the residual stream's) at once, where the single-device walk keeps both to the
        input's gradient sum -- one gradient fewer, event by event, from the normalize's backward on."""
        tl = self.tl
        out: dict[int, sympy.Expr] = {}
        for key, parts in self.norms.items():
            if key.endswith("#0") or "normalize" not in parts or "to_float32" not in parts:
                continue  # the final norm: no other gradient of its input
            started = None
            for k, e in enumerate(tl.events):
                if e.phase != "backward":
                    continue
                if e.node == parts["normalize"]:
                    started = k
                elif started is not None and e.node not in self.norm_of:
                    break
                elif started is not None and k > started:
                    out[k] = self._stream_bytes(parts["to_float32"])
        return out

    def _stream_bytes(self, node: str) -> sympy.Expr:
        """Bytes of ``node``'s output, a (B, S, H) tensor of the stream, on one rank: whole, or split over S under
        sequence parallelism."""
        size = self.g.node(node).out.numel * 4
        return size / t if self.sequence else size

    def _unit(self, name: str) -> sympy.Expr:
        """Elements of a unit's 2-D shards: the unit named inside ``fsdp.X[unit]`` (FSDP's unit of a parameter is
        its layer's iteration, or the root: ``None``)."""
        unit = name[name.index("[") + 1:-1]
        found = self._units.get(unit)
        if found is None:
            found = self._units[unit] = sympy.Add(*(self.stored[p] for p in self._members.get(unit, ())))
        return found

    @cached_property
    def _members(self) -> dict[str, list[str]]:
        """The parameters of each FSDP unit (:meth:`_unit`), in the order :attr:`stored` lists them: sorted out in
        one pass (each unit's buffers asked for them again)."""
        iterations = self.g.graph.get("iterations", {})
        members: dict[str, list[str]] = {}
        for p in self.stored:
            members.setdefault(str(iterations.get(p, iterations.get(p.rsplit(".", 1)[0]))), []).append(p)
        return members

    @cached_property
    def _units(self) -> dict[str, sympy.Expr]:
        """:meth:`_unit`'s answers by unit."""
        return {}

    def _local(self, i: int) -> sympy.Expr:
        """A storage's bytes on one rank of the mesh (:meth:`local` keeps each once): FSDP's buffers at the 2-D
        shards' sizes, the rest as on a tensor-parallel rank."""
        s = self.tl.storages[i]
        if s.category == "gradient" and s.node == self.embedding:
            return s.nbytes / t  # the rank's rows (the whole one: _embedding)
        if s.name.startswith(("fsdp.all_gather[", "fsdp.reduce_scatter_input[")):
            return N * self._unit(s.name) * 4
        if s.name.startswith("fsdp.sharded_grads["):
            return self._unit(s.name) * 4
        if s.name.endswith(".unsharded"):
            return N * self.stored[s.name[:-len(".unsharded")]] * 4
        if (not self.sequence and s.name.endswith(".grad_sum")
                and self.norm_of.get(s.node or "", "").startswith("layers")):
            return s.nbytes  # a norm's output gradient: the column-parallel input gradients all-reduced, whole
        return super()._local(i)

    def label(self, phase: str, node: str, layers: int | None = None) -> str:
        """Where a moment is, in words: an op outside the layers by its name; the walk's last two layers called
        ``layers - 1`` and ``layers`` where given (a walk folded to that many)."""
        layer = iteration(node)
        if not layer:
            return f"{phase} {node}"
        if layers and layer >= self.layers - 1:
            layer += layers - self.layers
        return f"{phase} {template(node)} (layer {layer})"

    def _candidate(self, e: Any, layers: int) -> bool:
        """An op of the first, the last or the last but one layer (in its backward the last layer's reduce-scatter
        input and sharded gradients are alive beside one layer's kept tensors fewer), or outside the layers (the
        embedding, the final norm, the head)."""
        return iteration(e.node) in (0, 1, layers - 1, layers)

    # (the rules below in both modes, formulas or values at the probes: tensor_step.on_probes)
    @on_probes
    def _collectives(self, e: Any, alive: set[int], k: int) -> Any:
        extra = super()._collectives(e, alive, k) - self._n(self.merge.get(k, 0))
        for i in e.born:
            s = self.tl.storages[i]
            if s.category == "gradient" and s.node == self.embedding:
                extra += self._embedding(e, self._bytes(i), self.local(i), alive, k)
        node = self.g.node(e.node) if e.node in self.g else None
        if e.phase == "forward":
            extra += self._sum([self.local(i) for i, freed in self.early.items() if freed < k <= self.forward_end])
        if e.phase == "forward" and e.node == self.head:
            # the replicated logits: the all-gather's output and the concatenation
            extra += self._whole(self.head) + self._before_logits(e, alive, k)
        if e.phase == "backward" and node is not None and e.node in self.norm_of and (
                e.node.split("#")[0].endswith((".scale", ".normalize"))):
            # a product as large as the norm's output before its sum (the weight's or the rsqrt's gradient)
            extra += self._n(self._stream_bytes(e.node))
        return extra

    def _embedding(self, e: Any, whole: Any, rows: Any, alive: set[int], k: int) -> Any:
        """What the embedding's backward holds beyond its rows' gradient: the whole one (``whole``), made beside
        what the op frees (the stream's gradient), then beside its rows' clone once that is freed (measured)."""
        freed = self._sum([self.local(j) for j in e.freed if j in alive])
        return whole - rows + self._max(0, rows - freed)

    def _whole(self, node: str) -> Any:
        return self._n(self.g.node(node).out.numel * 4)

    def _before_logits(self, e: Any, alive: set[int], k: int) -> Any:
        """What the head's forward holds before its logits' all-gather beyond what it holds at it (0: nothing
        more; :class:`_MeshSequenceWalk`: its input's all-gather)."""
        return self._sum([])


class _MeshSequenceWalk(_MeshWalk, _SequenceWalk):
    """:class:`_MeshWalk` under sequence parallelism (torchtitan's plan): the collectives of
    :class:`~symmem.passes.tensor_step._SequenceWalk` (the stream split over S, the column-parallel inputs'
    all-gathers, the row-parallel outputs' reduce-scatters) beside FSDP's unit buffers."""

    sequence = True

    def __init__(self, graph: Graph, conv: Any, options: Any, regime: Regime, numbers: Any) -> None:
        super().__init__(graph, conv, options, regime, numbers)
        # the forward's constants are this walk's storages (:class:`_MeshWalk`), not a sum beside it
        self.constant_storages = set()
        self._locals.clear()

    @on_probes
    def _collectives(self, e: Any, alive: set[int], k: int) -> Any:
        """:class:`_MeshWalk`'s, less at a norm's scale backward what the walk holds of the attention's q, k, v
        input gradients' sum beyond its reduce-scatter's S-split output: the sum is let go at the scatter, before
        the norm's backward (measured)."""
        extra = super()._collectives(e, alive, k)
        if e.phase == "backward" and e.node in self.norm_of and template(e.node).endswith(".scale"):
            whole = [self._bytes(i) for i in e.freed if i in self.gathered_grads and i in alive]
            extra -= self._sum([size - size / self.tv for size in whole])
        return extra

    def _merges(self) -> dict[int, sympy.Expr]:
        """None: with the stream split over S, a layer's norm's input gradient is a new tensor beside the residual
        stream's, both kept to their sum, as the single-device walk has them (measured op by op)."""
        return {}

    def _embedding(self, e: Any, whole: Any, rows: Any, alive: set[int], k: int) -> Any:
        """In place of what the sequence-parallel walk holds at the embedding's backward (its whole gradient kept,
        :class:`~symmem.passes.tensor_step._SequenceWalk`): the stream's gradient all-gathered (the output beside
        funcol's wrapper) while its S-split one lives; the whole embedding gradient made beside the two gathered
        copies once the S-split one is freed; then its rows' clone beside it, the gathered copies freed
        (measured on every rank, 2 x 2, V = 2,048)."""
        stream = self._whole(self.embedding)
        born = self._sum([self.local(j) for j in e.born])
        released = self._sum([])  # as _SequenceWalk counts what its gathered copies let go here
        for i, (_, spans) in self.copies.items():
            if i in alive:
                released += self._sum([self._n(n) for _, r, n in spans if r == k and i not in e.freed]) * self._bytes(i)
        freed = self._sum([self.local(j) for j in e.freed]) + released
        theirs = self._max(2 * stream - born, stream - freed)
        gathered = 2 * stream - rows
        return -theirs + self._max(gathered, whole - freed + self._max(0, gathered))

    def _before_logits(self, e: Any, alive: set[int], k: int) -> Any:
        """The head's input all-gather (its output beside funcol's wrapper, :class:`_SequenceWalk` counts it
        beside what the head's op makes) comes before the logits' all-gather and concatenation: the larger of the
        two moments, not the extra copy beside both (measured)."""
        whole = self._whole(self.head)
        born = self._sum([self.local(j) for j in e.born])
        out = self._sum([])
        for i, (_, spans) in self.copies.items():
            if i in alive:
                size = self._bytes(i)
                out += self._sum([(2 - self._n(n)) * (self._max(0, size - born - whole) - self._max(0, size - born))
                                  for f, _, n in spans if f == k])
        return out


@dataclass(frozen=True)
class MeshMoment(TensorRankMoment):
    """A moment of one rank's step on the N x t mesh."""

    ranks: str = ""  # the mesh in words
    #: the rank on the mesh (0: FSDP2's largest; FSDP1's ranks differ otherwise, passes/fsdp1_tensor.py)
    rank: int = 0

    def where(self, step: bool = True) -> str:
        return f"rank {self.rank} of {self.ranks}: {self.what}" + (f", {self.step} step" if step else "")


@dataclass(eq=False)
class MeshStep(WalkedStep):
    """The step of one rank of the N x t mesh (FSDP2 over DTensor's standard plan; ``numbers`` the derivation's,
    N and t included): the ``Max`` of the layers' walk (:class:`_MeshWalk` of the single-device step of ``graph``
    under ``regime``'s FSDP) beside what lives between steps, and the optimizer step (for-loop AdamW on the 2-D
    shards).  Rank 0 of each data-parallel group holds the most (whole shards): its peak is the peak per device."""

    numbers: Mapping[sympy.Symbol, int]
    graph: Graph
    conv: Any
    options: Mapping[str, Any]
    regime: Regime
    storages: Sequence[Any]
    #: torchtitan's sequence-parallel plan (the stream split over S; :class:`_MeshSequenceWalk`)
    sequence: bool = False
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)
    refused_as = "FSDP x TP"
    needs = ("L", "t", "N")
    not_drawn = ("an FSDP x TP rank's timeline is not drawn op by op: its peak is the largest of the layers' moments "
                 "and the optimizer step")

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None, rank: int = 0) -> Peak:
        return self._walked_peak(at, rank, lambda named: self._peak(named, rank))

    def _walked(self, named: Mapping[str, int]) -> list[tuple[sympy.Expr, str, str]]:
        """The layers' largest moments at ``named`` (every rank's alike: ranks differ in what lives between steps);
        from :data:`~symmem.passes.tensor_step.FOLD_FROM` layers on folded from walks of 3 and 4 layers
        (:func:`~symmem.passes.tensor_step.layer_moments`: at every candidate -- an op of the first, the last but one
        or the last layer, or outside them -- the layers between are all in one state, so each moment is linear
        in L)."""
        from .tensor_step import layer_moments

        key = ("walk", tuple(sorted(named.items())))
        if key not in self._cache:
            self._cache[key] = layer_moments(self.walk_class(), self.graph, self.conv, self.options, self.regime, named,
                                             base=3)
        return self._cache[key]

    def walk_class(self) -> type[_MeshWalk]:
        """The layers' walk (FSDP2's buffers; FSDP1's: :mod:`symmem.passes.fsdp1_tensor`)."""
        return _MeshSequenceWalk if self.sequence else _MeshWalk

    def rank_parts(self, rank: int, named: Mapping[str, int] | None = None) -> Any:
        """Data-parallel rank ``rank``'s parameter side (:func:`mesh_rank`; ``named``: the numbers walked at)."""
        return mesh_rank(self.graph, self.storages, self.regime, rank, self.sequence)

    def module_buffers(self) -> sympy.Expr:
        """The modules' buffers in bytes, whole on every rank (Llama's rotary frequencies): held at rest."""
        from .model_parallel import _module_buffers

        return sympy.Add(*_module_buffers(self.graph, "float32").values())

    def temporaries(self, rank: int, named: Mapping[str, int]) -> sympy.Expr:
        """The optimizer step's largest temporaries on ``rank`` (:func:`_step_temporaries`)."""
        return _step_temporaries(self.graph, rank)

    def groups(self, merged: Mapping[sympy.Symbol, int]) -> list[list[int]]:
        """The data-parallel ranks whose steps are alike (:func:`mesh_groups`)."""
        return mesh_groups(self.graph, merged)

    def _peak(self, named: Mapping[str, int], rank: int) -> Peak:
        from .model_parallel import _bytes

        parts = self.rank_parts(rank, named)
        outside = [n for n in self.graph.program_order() if self.graph.node(n).block is None]
        ids = sum((_bytes(self.graph, n, "float32") for n in outside if self.graph.node(n).kind == "input"),
                  sympy.Integer(0))
        at_rest = parts.parameters + parts.optimizer_state + self.module_buffers() + ids
        ranks = f"N x t = {named['N']} x {named['t']}"
        temporaries = self.temporaries(rank, named)  # the same in both steps: worked out once
        made = []
        for step, less in (("steady", sympy.Integer(0)), ("first", parts.optimizer_state)):
            for live, phase, what in self._walked(named):
                made.append(MeshMoment(phase, what, "", step, {"live": at_rest + live - less}, ranks=ranks,
                                       what=what, rank=rank * named["t"]))
            made.append(MeshMoment("step", None, "", step, {"live": at_rest + parts.gradients + temporaries},
                                   ranks=ranks, what="the optimizer step", rank=rank * named["t"]))
        others = tuple(equals(sympy.Symbol(n, positive=True, integer=True), v) for n, v in sorted(named.items())
                       if n in ("L", "N"))
        return Peak(None, None, tuple(made), others)

    def per_rank(self, numbers: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Every rank's steady-step peak at ``numbers`` (rank ``r`` at mesh coordinates ``(r // t, r % t)``), and
        the rank named as the largest (0: whole shards)."""
        found = self.ranks(numbers)
        return {"peak_per_rank": [found[r][1] for r in sorted(found)], "peak_rank": 0}

    def ranks(self, numbers: Mapping[sympy.Symbol, int]) -> dict[int, tuple[int, int]]:
        """``{rank: (first-step peak, steady peak)}`` of every rank of the mesh, ``r`` at ``(r // t, r % t)``: a
        data-parallel rank holds the rows :func:`~symmem.passes.data_parallel.held_shape` gives of each
        tensor-parallel shard, so each distinct set of rows is worked out once, however large N is."""
        merged = {**self.numbers, **numbers}
        out: dict[int, tuple[int, int]] = {}
        for group in self.groups(merged):
            p = self.peak(numbers, group[0])
            found = (int(p.value(merged, "first")), int(p.value(merged)))
            for dp in group:
                for tp in range(int(merged[t])):
                    out[dp * int(merged[t]) + tp] = found
        return dict(sorted(out.items()))

    def rank_peaks(self, derivation: Any) -> dict[int, tuple[int, int]] | None:
        """:meth:`ranks` at ``derivation``'s numbers where they differ (None: every rank alike)."""
        found = self.ranks(derivation.numbers)
        return found if len(set(found.values())) > 1 else None

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        refuse_one_rank(self.regime.data_parallel, numbers)
        return super().holds_at(numbers)


def mesh_groups(graph: Graph, numbers: Mapping[sympy.Symbol, int]) -> list[list[int]]:
    """The data-parallel ranks of an N x t mesh grouped by the rows of each tensor-parallel shard they hold
    (:func:`~symmem.passes.data_parallel.alike_ranks`)."""
    from .data_parallel import alike_ranks

    env = {s: sympy.Integer(v) for s, v in numbers.items()}
    return alike_ranks([shape[0].xreplace(env) for _, _, shape in parameters(graph) if shape], int(numbers[N]))


def _step_temporaries(graph: Graph, rank: int) -> sympy.Expr:
    """For-loop AdamW's largest temporaries on the 2-D shards (the rows ``rank`` holds of each tensor-parallel
    shard): :func:`symmem.passes.tensor_step._step_temporaries` with each parameter at those bytes."""
    from .data_parallel import held_shape
    from .tensor_step import _step_temporaries as temporaries

    return temporaries(graph, lambda n, shape: numel(held_shape(tp_shape(graph, n, shape), N, rank)) * 4)
