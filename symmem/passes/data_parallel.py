"""What a data-parallel engine adds to one rank's training step, as the schedule (:mod:`.schedule`) walks it.

Every rank runs the whole model on its own batch ``B``, so the forward and backward are one device's; the
engines differ in what they keep beside them (measured per rank on real ``torch.distributed`` runs, gloo on the
CPU: :mod:`symmem.record.distributed`, ``tests/test_data_parallel.py``, docs/regimes.md):

* ``ddp`` -- ``DistributedDataParallel(model)``: the reducer allocates flat gradient buckets of every trainable
  parameter when the module is wrapped (bucket_cap_mb=25 per bucket; their sum is the gradients' size, 4 bytes per
  parameter in FP32) and keeps them for good; backward copies each gradient into its bucket, all-reduces the
  bucket in place and copies it back, allocating nothing more.  The second step's rebuild of the buckets (in the
  order gradients arrived) frees the old ones before it allocates the new (measured: no overlap).
* ``ddp-bucket-view`` -- ``gradient_as_bucket_view=True``: the buckets are the gradients.  Each ``.grad`` a backward
  formula makes is copied into its bucket by the reducer's hook and freed at once (``param.grad`` becomes a view of
  the bucket); ``zero_grad(set_to_none=True)`` drops the views, not the buckets, so the gradients' bytes are live
  the whole step, forward included.

* ``zero-redundancy`` -- ``ZeroRedundancyOptimizer`` beside DDP: DDP's buckets as ``ddp``; the optimizer's whole-
  parameter partition and every rank's step are :mod:`.zero_redundancy`'s.

* ``fsdp`` / ``fsdp-no-reshard`` -- FSDP2 ``fully_shard`` per repeated block and the root: :class:`Fsdp` (padded
  shards, all-gather outputs, unsharded parameters, prefetch, reduce-scatter buffers); :func:`rank_peaks` gives
  every rank's peaks where the padding makes them differ.
* ``fsdp1`` / ``fsdp1-grad-op`` -- FSDP1 ``FullyShardedDataParallel`` (FULL_SHARD, SHARD_GRAD_OP): one flat
  parameter per unit, :class:`symmem.passes.fsdp1.Fsdp1`.

>>> from symmem.training import Regime
>>> ddp, view = Regime(data_parallel="ddp"), Regime(data_parallel="ddp-bucket-view")
>>> buckets(ddp, [("fc.weight", (4, 3))], {"fc.weight": 12}, 4), grads_in_buckets(view), grads_in_buckets(ddp)
([('ddp.buckets', 48)], True, False)
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import sympy

from ..symbols import N
from ..training import RANK_OPTION, Regime
from .parameters import program_parameters

#: The engines whose reducer keeps gradient buckets.
_BUCKETED = ("ddp", "ddp-bucket-view", "zero-redundancy")


def buckets(regime: Regime, params: Sequence[tuple[str, tuple[sympy.Expr, ...]]], numel: Mapping[str, sympy.Expr],
            grad_bytes: int) -> list[tuple[str, sympy.Expr]]:
    """DDP's gradient buckets, alive from before the first step to the end (one storage: every bucket lives as
    long as the others, so how the 25 MB cap splits them changes no moment's bytes)."""
    if regime.data_parallel not in _BUCKETED or not params:
        return []
    return [("ddp.buckets", _summed(tuple(Counter(numel[name] for name, _ in params).items())) * grad_bytes)]


@functools.lru_cache(maxsize=64)
def _summed(counted: tuple[tuple[sympy.Expr, int], ...]) -> sympy.Expr:
    """The sum of each size times its count: what ``Add`` of every parameter's size gives (a stack's layers repeat
    a few sizes: the Add collects them), from a few terms, once for both walks of the step."""
    return sympy.Add(*(k * size for size, k in counted))


def grads_in_buckets(regime: Regime) -> bool:
    """Whether every ``.grad`` is a view of a bucket: the gradient a backward formula makes is freed once the
    reducer has copied it there (as a second micro-batch's gradient is, once added into ``.grad``)."""
    return regime.data_parallel == "ddp-bucket-view"



#: FSDP2 (``fully_shard`` on every repeated block, or every child with parameters of a Sequential, then the
#: root), with ``reshard_after_forward`` True or False.
SHARDED = {"fsdp": True, "fsdp-no-reshard": False}


def shard_rows(shape: Sequence[sympy.Expr], world: sympy.Expr) -> sympy.Expr:
    """Rows of dim 0 each rank's shard storage has: dim 0 padded to a multiple of ``world``, split evenly.

    >>> shard_rows((127, 64), 2), shard_rows((10,), 4)
    (64, 3)
    """
    return ceil_div(shape[0], world) if shape else sympy.Integer(1)


@functools.lru_cache(maxsize=4096)
def ceil_div(size: sympy.Expr, world: sympy.Expr, expanded: bool = False) -> sympy.Expr:
    """``ceiling(size / world)``.  A symbolic ``size``, or a number above 1, over the symbol ``N`` (a positive
    integer, 1 included, with no bound) is neither provably a whole number nor provably at most 1, so the ceiling
    stays as written: built without sympy's search for either (most of an FSDP step's set-up otherwise); anything
    else is evaluated.

    >>> from symmem.symbols import H, N
    >>> ceil_div(3 * H, N) == sympy.ceiling(3 * H / N), ceil_div(768, N) == sympy.ceiling(768 / N)
    (True, True)
    >>> ceil_div(1, N), ceil_div(2 * N, N), ceil_div(10, 4)
    (1, 2, 3)

    ``expanded``: a sum's quotient multiplied out, as the peak's algebra expands every size (its expand then
    leaves the ceiling as it is, where rebuilding it would search again):

    >>> ceil_div(3 * H + 2, N, expanded=True) == sympy.ceiling(sympy.expand((3 * H + 2) / N))
    True

    Kept per size: every layer of a stack, and every walk of the step, asks for the same ones.
    """
    size = sympy.sympify(size, strict=True)
    if world is N and (size > 1 if size.is_Integer else not size.is_number and N not in size.free_symbols
                       and size.is_positive):
        return sympy.ceiling(sympy.expand(size / world) if expanded else size / world, evaluate=False)
    return sympy.ceiling(size / world)


@functools.lru_cache(maxsize=4096)
def _shard_numel(shape: tuple[sympy.Expr, ...], world: sympy.Expr) -> sympy.Expr:
    """Elements of one rank's shard storage of a parameter stored as ``shape``."""
    return shard_rows(shape, world) * sympy.Mul(*shape[1:])


@functools.lru_cache(maxsize=1024)
def _unit_sizes(shards: tuple[sympy.Expr, ...], world: sympy.Expr, wb: int
                ) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr]:
    """A unit's shard elements, its shards' bytes and its all-gather output's bytes (written multiplied out, as
    the peak's algebra takes every size: nothing left for it to expand)."""
    numel = sympy.Add(*shards)
    total = numel * wb
    return numel, total, sympy.Add(*(world * x for x in sympy.Add.make_args(total)))


@functools.lru_cache(maxsize=4096)
def _times(world: sympy.Expr, shard: sympy.Expr, wb: int) -> sympy.Expr:
    return world * shard * wb


@functools.lru_cache(maxsize=1024)
def _times_bytes(numel: sympy.Expr, nbytes: Any) -> sympy.Expr:
    """``numel * nbytes``, once per unit size (a stack's units repeat it, both walks of the step ask)."""
    return numel * nbytes


def held_shape(shape: Sequence[sympy.Expr], world: sympy.Expr, rank: int) -> tuple[sympy.Expr, ...]:
    """The unpadded part of ``rank``'s shard (what the optimizer's ``zeros_like`` state follows): the padding sits
    at the end, so the last ranks hold fewer rows (rank 0 holds a whole shard).

    >>> [held_shape((10, 128), 4, r)[0] for r in range(4)]
    [3, 3, 3, 1]

    Kept per (shape, world, rank), each with its type (an int and a sympy Integer stay apart): sympy's ``Min`` and
    ``Max`` search their arguments, and every rank's step asks again for every parameter, at every layer count.
    """
    key = (tuple((type(d), d) for d in shape), type(world), world, type(rank), rank)
    found = _HELD.get(key)
    if found is None:
        found = _HELD[key] = _held_shape(tuple(shape), world, rank)
        if len(_HELD) > 8192:  # bounded, as the other size caches here
            _HELD.pop(next(iter(_HELD)))
    return found


#: :func:`held_shape`'s answers, by its arguments and their types
_HELD: dict[tuple[Any, ...], tuple[sympy.Expr, ...]] = {}


def _held_shape(shape: tuple[sympy.Expr, ...], world: sympy.Expr, rank: int) -> tuple[sympy.Expr, ...]:
    if not shape:
        return ()
    k = shard_rows(shape, world)
    if isinstance(rank, sympy.Expr) and not rank.is_number and sympy.expand(rank - world) == -1:
        # the last rank (N - 1): d0 <= N*k, so its rows are at most k; built without sympy's search of the Max
        return (sympy.Max(0, shape[0] - rank * k, evaluate=False), *shape[1:])
    rows = k if rank == 0 else sympy.Max(0, sympy.Min(k, shape[0] - rank * k))
    return (rows, *shape[1:])


#: Built-in models whose linear layers are Hugging Face ``Conv1D`` modules: the weight is stored (in, out), so
#: FSDP's dim 0 -- the one it pads and splits -- is the input features.
_CONV1D = ("gpt2",)


def policy_bytes(regime: Regime) -> tuple[int, int] | None:
    """FSDP2's ``MixedPrecisionPolicy`` as (bytes of param_dtype, bytes of reduce_dtype), or None without one.

    >>> policy_bytes(Regime(data_parallel="fsdp", param_dtype="bfloat16")), policy_bytes(Regime())
    ((2, 4), None)
    """
    from ..tensor import dtype_bytes

    reduce = regime.policy_reduce_dtype
    if regime.param_dtype is None or reduce is None:
        return None
    return dtype_bytes(regime.param_dtype), dtype_bytes(reduce)


def refuse_policy(regime: Regime, graph: Any = None) -> None:
    """Refuse (one line) FSDP2's MixedPrecisionPolicy on a model it was not measured on (the papers' 16-bit
    ``--precision`` presets are refused for every FSDP engine: ``Simulation._sharding``).

    >>> from symmem.models import build
    >>> refuse_policy(Regime(data_parallel="fsdp", param_dtype="bfloat16"), build("mlp").graph)
    Traceback (most recent call last):
    symmem.errors.SymmemError: the peak under FSDP2's MixedPrecisionPolicy is modelled for the causal LMs it was ...
    """
    from ..errors import SymmemError

    # with full or every-K checkpointing and gradient accumulation the policy is walked (measured: the
    # recompute's bf16 activations and the callers' holds inside a checkpointed layer are the forward's;
    # set_requires_gradient_sync(False)'s reduce_dtype copies of the unsharded gradients: Fsdp._accumulate)
    if regime.param_dtype is not None and graph is not None and not graph.graph.get("causal_lm"):
        # measured on an MLP: FSDP2 casts a floating input to param_dtype (cast_forward_inputs) and its
        # cross-entropy runs on bf16 logits (a bf16 loss and seed), which the step does not model
        raise SymmemError(f"the peak under FSDP2's MixedPrecisionPolicy is modelled for the causal LMs it was "
                          f"measured on (gpt2, llama): {graph.graph.get('name') or 'this model'}'s floating inputs, "
                          "which FSDP2 casts to param_dtype, and a loss on bf16 logits are not")


def caller_holds(graph: Any, order: Sequence[str]) -> dict[str, str]:
    """What the Python callers of a model hold past its last use (node -> the node until whose forward it lives),
    which an op keeps anyway in FP32 and which lives on its own where 16-bit activations make the casts copies
    (FSDP2's MixedPrecisionPolicy; measured on gloo runs): ``x = layer(x)`` holds each layer's input until the layer
    returns; a loss holds the logits it is given until it returns (``logits.float()`` is a copy); and what a builder
    declares: ``graph.graph["held_by_caller"]`` (Llama's ``inputs_embeds`` until ``LlamaModel.forward`` returns;
    RMSNorm's FP32 ``hidden_states`` until the norm returns: a layer's hold each layer's, as ``held_until``) and
    ``graph.graph["result_held_by_caller"]`` (a repeated block's result, its last layer's output, until a node).

    >>> from symmem.models import build
    >>> from symmem.passes.unroll import unroll
    >>> g = unroll(build("llama").graph, {"layers": 2})
    >>> held = caller_holds(g, list(g.program_order()))
    >>> held["embed_tokens"], held["layers.add2#1"]
    ('norm.scale', 'layers.add2#2')
    """
    pos = {n: i for i, n in enumerate(order)}
    iterations = graph.graph.get("iterations", {})
    last: dict[Any, str] = {}
    for n in order:
        if n in iterations:
            last[iterations[n]] = n
    found: dict[str, str] = {}

    def hold(s: str, until: str) -> None:
        if s in pos and until in pos and pos[until] > pos.get(found.get(s, s), -1):
            found[s] = until

    for n in order:
        it = iterations.get(n)
        if it is None:
            continue
        for x in graph.node(n).inputs:
            if iterations.get(x) != it and graph.node(x).kind not in ("input", "parameter", "buffer", "constant"):
                hold(x, last[it])
    for s, until in graph.graph.get("held_by_caller", {}).items():
        copies = [f"{s}#{j}" for j in range(1, len(last) + 2) if f"{s}#{j}" in pos] or [s]
        for j, c in enumerate(copies, start=1):  # a layer's hold is each layer's, until its own node
            hold(c, f"{until}#{j}" if c != s and f"{until}#{j}" in pos else until)
    for block, until in graph.graph.get("result_held_by_caller", {}).items():
        ends = [n for (b, _), n in last.items() if b == block]
        if ends:
            hold(max(ends, key=pos.__getitem__), until)
    out = graph.graph.get("model_output")
    if out is not None and "loss" in pos:
        hold(out, "loss")
    return found


def stored_shapes(graph: Any, params: Sequence[tuple[str, tuple[sympy.Expr, ...]]]
                  ) -> dict[str, tuple[sympy.Expr, ...]]:
    """Each parameter's shape as the module stores it (the dim FSDP shards first)."""
    conv1d = graph.graph.get("name") in _CONV1D
    out = {}
    for name, shape in params:
        node, _, part = name.rpartition(".")
        linear = bool(node) and node in graph and graph.node(node).kind == "linear"
        out[name] = tuple(reversed(shape)) if conv1d and linear and part == "weight" and len(shape) == 2 else shape
    return out


class Fsdp:
    """FSDP2's buffers in one rank's step, as the schedule walks it (measured on gloo runs; docs/regimes.md).

    Per unit ``u`` (the root holds every parameter outside a unit), with ``S_u`` the bytes of its padded shards:
    the all-gather output ``A_u`` (``N*S_u``) and the unsharded parameters ``P_u`` (each padded, ``N`` shards)
    appear at its pre-forward, ``A`` of the unit before is freed once ``u``'s copy-out is done, ``P_u`` goes at
    its post-forward when resharding (the root's post-forward then frees the last ``A``).  Backward: the unit's
    pre-backward all-gathers it again (unless prefetched) and prefetches the next unit in backward order; its
    post-backward frees ``P_u``, frees the previous reduce-scatter input and makes ``R_u`` (``N*S_u``), frees the
    unit's unsharded gradients (the last parameter's once the reduce-scatter ran) and makes the sharded
    gradients ``G_u`` (``S_u``), which ``zero_grad`` frees.  The root's post-backward runs at the end of the
    backward; the last ``R`` dies with it.  Under FSDP2's ``MixedPrecisionPolicy`` (``policy``) ``A_u``, ``P_u`` and
    the unsharded gradients are in param_dtype, a param_dtype copy of the shards precedes each ``A_u``, and ``R_u``
    is in reduce_dtype (:meth:`_policy_sizes`); under gradient accumulation the unsharded gradients accumulate in
    reduce_dtype copies (:meth:`_accumulate`).
    """

    def __init__(self, sim: Any, world: sympy.Expr, weight_bytes: int, reshard: bool,
                 policy: tuple[int, int] | None = None) -> None:
        # the walk holds its engine; the engine holds the walk weakly, so that a finished walk (its storages,
        # events and unrolled graph) is freed at once rather than left as a cycle for the collector to find
        self._sim, self.reshard = weakref.ref(sim), reshard
        #: MixedPrecisionPolicy: (bytes of param_dtype, of reduce_dtype), or None (:func:`policy_bytes`)
        self.policy = policy
        #: under a MixedPrecisionPolicy, each unit's param_dtype copy of its shards (the all-gather input), and
        #: where reduce_dtype is not the parameters' dtype, its reduce-scatter output before the cast
        self.cast_in: dict[Any, sympy.Expr] = {}
        self.reduce_out: dict[Any, sympy.Expr] = {}
        graph, order = sim.graph, sim.order
        iterations = graph.graph.get("iterations", {})
        #: node -> unit key (None: the root); the loss's nodes (their backward does not start the root's), from
        #: one look at each node (the walk's set-up reads every node of the unrolled graph)
        self.unit_of: dict[str, Any] = {}
        self.loss_nodes: set[str] = set()
        for n in order:
            node = graph.node(n)
            self.unit_of[n] = iterations.get(n) if iterations else (n if node.params else None)
            if node.group == "loss":
                self.loss_nodes.add(n)
        self.units: list[Any] = list(dict.fromkeys(u for u in self.unit_of.values() if u is not None))
        self.params: dict[Any, list[str]] = {u: [] for u in [None, *self.units]}
        for name, _ in sim.params:
            if name in self.unit_of and graph.node(name).kind == "parameter":
                # a free-standing parameter node (a layer's norm weight in a built transformer): its own layer's
                self.params[iterations.get(name)].append(name)
                continue
            node = name.rsplit(".", 1)[0]
            self.params[self.unit_of.get(node) if node in self.unit_of else None].append(name)
        self.world, self.wb = world, weight_bytes
        self._sizes()
        first: dict[Any, str] = {}
        last: dict[Any, str] = {}
        for n in order:
            u = self.unit_of[n]
            if u is not None:
                first.setdefault(u, n)
                last[u] = n
        self.first_node = {n: u for u, n in first.items()}
        self.last_node = {n: u for u, n in last.items()}
        # a causal LM's reference computes its loss inside forward (the root's post-forward follows the loss)
        self.loss_inside = bool(graph.graph.get("causal_lm"))
        model = [n for n in order if n not in self.loss_nodes]
        self.root_end = order[-1] if self.loss_inside or not model else model[-1]
        self.unsharded: dict[Any, list[int]] = {}   # unit -> its P storages while alive
        self.gathered: dict[Any, int] = {}          # unit -> its all-gather output while alive
        self.pending: int | None = None             # the all-gather output to free after the next copy-out
        self.reduce_in: int | None = None
        self.sharded_grads: list[int] = []
        #: under a policy and set_requires_gradient_sync(False): parameter -> its reduce_dtype unsharded gradient
        self.accumulated: dict[str, int] = {}
        #: whether this micro-batch's backward reduce-scatters (gradient accumulation: only the last one's does)
        self.sync = True
        self.done_backward: set[Any] = set()
        self.started_backward: set[Any] = set()
        # the node each event is named after: the op it comes before or after (a step's moments are matched across
        # layer counts by node, passes/graph_step.py)
        self.at: str | None = None

    def _sizes(self) -> None:
        """Each parameter's shard (``shard``, elements) and each unit's (``unit_numel``; ``total``, bytes); the
        bytes of each unit's all-gather output (and reduce-scatter input, ``gather_bytes``) and of each
        parameter's unsharded copy (``unsharded_bytes``).  Worked out once per shape and per unit's shards: the
        layers of a stack repeat them, and every walk of the step asks again."""
        shapes = stored_shapes(self.sim.graph, self.sim.params)
        world, wb = self.world, self.wb
        self.shard = {name: _shard_numel(shape, world) for name, shape in shapes.items()}
        unit = {u: _unit_sizes(tuple(self.shard[p] for p in ps), world, wb) for u, ps in self.params.items()}
        self.unit_numel = {u: found[0] for u, found in unit.items()}
        self.total = {u: found[1] for u, found in unit.items()}
        self.gather_bytes = {u: found[2] for u, found in unit.items()}
        self.shapes = shapes
        self.unsharded_bytes = {name: _times(world, k, wb) for name, k in self.shard.items()}
        #: the reduce-scatter input's bytes and the sharded gradients' bytes per element (FP32 without a policy:
        #: the gradients' own)
        self.reduce_bytes, self.sharded_grad_bytes = self.gather_bytes, self.sim.grad_bytes
        if self.policy is not None:
            self._policy_sizes(*self.policy)

    def _policy_sizes(self, pb: int, rb: int) -> None:
        """Under ``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (``pb``, ``rb`` bytes an element): the shards
        stay in the parameters' dtype (``wb``), the all-gather, its input copy (``_get_param_all_gather_inputs``'
        foreach copy) and the unsharded parameters are in param_dtype, the reduce-scatter's input in reduce_dtype,
        and the sharded gradients in the parameters' dtype; where reduce_dtype is not theirs, the reduce-scatter's
        output is in reduce_dtype and cast to them (measured on gloo runs: docs/regimes.md)."""
        world = self.world
        self.gather_bytes = {u: _unit_sizes(tuple(self.shard[p] for p in ps), world, pb)[2]
                             for u, ps in self.params.items()}
        self.cast_in = {u: _times_bytes(n, pb) for u, n in self.unit_numel.items()}
        self.reduce_bytes = {u: _unit_sizes(tuple(self.shard[p] for p in ps), world, rb)[2]
                             for u, ps in self.params.items()}
        self.unsharded_bytes = {name: _times(world, k, pb) for name, k in self.shard.items()}
        self.sharded_grad_bytes = self.wb
        if rb != self.wb:
            self.reduce_out = {u: _times_bytes(n, rb) for u, n in self.unit_numel.items()}

    @property
    def sim(self) -> Any:
        """The walk (:class:`~.schedule.Simulation`) this engine's events go to."""
        return self._sim()

    def _has(self, unit: Any) -> bool:
        return bool(self.params.get(unit))

    def _gather(self, unit: Any, phase: str, with_params: bool = True) -> None:
        sim = self.sim
        born = []
        if unit not in self.gathered:
            cast = self.cast_in.get(unit)
            if cast is not None:  # the param_dtype copy of the shards, freed once the all-gather is issued
                copy = sim.new(f"fsdp.all_gather_input[{unit}]", "temporary", cast)
                sim.event(phase, self.at, [copy], [])
            self.gathered[unit] = sim.new(f"fsdp.all_gather[{unit}]", "temporary", self.gather_bytes[unit])
            born.append(self.gathered[unit])
            if cast is not None:
                sim.event(phase, self.at, born, [])
                born = []
                sim.event(phase, self.at, [], [copy])
        if with_params and unit not in self.unsharded:
            self.unsharded[unit] = [sim.new(f"{p}.unsharded", "parameter", self.unsharded_bytes[p])
                                    for p in self.params[unit]]
            born += self.unsharded[unit]
        sim.event(phase, self.at, born, [])

    def _free_gather(self, unit: Any, phase: str) -> None:
        if unit in self.gathered:
            self.sim.event(phase, self.at, [], [self.gathered.pop(unit)])

    def _reshard(self, unit: Any, phase: str) -> None:
        if unit in self.unsharded:
            self.sim.event(phase, self.at, [], self.unsharded.pop(unit))

    # -- forward --------------------------------------------------------------------------------------------
    def start_forward(self) -> None:
        self.at = self.sim.order[0] if self.sim.order else None
        if self._has(None):
            self._gather(None, "forward")
            self.pending = None
            self._last_gather = None

    def before_forward(self, n: str) -> None:
        self.at = n
        unit = self.first_node.get(n)
        if unit is None or not self._has(unit):
            return
        before = [u for u in self.gathered]
        self._gather(unit, "forward")
        for u in before:
            self._free_gather(u, "forward")

    def after_forward(self, n: str) -> None:
        self.at = n
        unit = self.last_node.get(n)
        if unit is not None and self.reshard:
            self._reshard(unit, "forward")
        if n == self.root_end:
            self.end_forward()

    def end_forward(self) -> None:
        """The root's post-forward: reshard the root, free the last all-gather output."""
        if self.reshard:
            self._reshard(None, "forward")
        for u in list(self.gathered):
            self._free_gather(u, "forward")

    # -- backward -------------------------------------------------------------------------------------------
    def forward_hooks(self) -> tuple[set[str], set[str]]:
        """The ops :meth:`before_forward` and :meth:`after_forward` act at (a unit's first op; a unit's last op and
        the root's end): the walk calls them there only (elsewhere they would only note the op)."""
        return set(self.first_node), {*self.last_node, self.root_end}

    def acts_before_backward(self, n: str) -> bool:
        """Whether :meth:`before_backward` may act at ``n``: a unit not yet started there, or the root's (every
        event names the op it is made at, so skipping the others changes nothing)."""
        started = self.started_backward
        unit = self.unit_of.get(n)
        return (unit is not None and unit not in started) or (
            not self.loss_inside and None not in started and n not in self.loss_nodes)

    def _next_backward(self, unit: Any) -> Any:
        order = self.units[::-1]
        i = order.index(unit) + 1 if unit is not None else 0
        return order[i] if i < len(order) else None

    def pre_backward(self, unit: Any) -> None:
        if unit in self.started_backward or not self._has(unit):
            return
        self.started_backward.add(unit)
        if unit not in self.unsharded:
            self._gather(unit, "backward")
            self._free_gather(unit, "backward")
        nxt = self._next_backward(unit)
        if nxt is not None and nxt not in self.unsharded and nxt not in self.gathered:
            self._gather(nxt, "backward", with_params=False)

    def before_recompute(self, n: str) -> None:
        """A checkpoint around several units (``every-K`` as the references run it: each run of K sharded blocks
        under one ``torch.utils.checkpoint``) re-runs their forward hooks in the recompute, before their own
        pre-backward: a unit's pre-forward unshards it there (from the prefetched all-gather output, or a new one),
        and its post-forward keeps it unsharded inside backward (FSDP2 reshards only outside it), so its
        pre-backward later finds it unsharded (measured; docs/regimes.md)."""
        unit = self.first_node.get(n)
        if unit is None or not self._has(unit) or unit in self.started_backward:
            return
        self.at = f"{n}:recompute"
        self._gather(unit, "backward")
        self._free_gather(unit, "backward")

    def after_recompute(self, n: str) -> None:
        """FSDP2's post-forward in the recompute: nothing (it reshards only outside backward)."""

    def before_backward(self, n: str) -> None:
        self.at = n
        unit = self.unit_of.get(n)
        if not self.loss_inside and n not in self.loss_nodes:
            self.pre_backward(None)  # the root's output has its gradient
        if unit is not None:
            self.pre_backward(unit)

    def post_backward(self, unit: Any) -> None:
        if unit in self.done_backward or not self._has(unit):
            return
        self.done_backward.add(unit)
        sim = self.sim
        self._reshard(unit, "backward")
        accumulated = self._accumulate(unit)
        if not self.sync:
            # set_requires_gradient_sync(False): the unit reshards; its unsharded gradients stay the parameters'
            # .grad, the next micro-batch's add into them in place, and the last one's post-backward reduces them
            self.last_grad = []
            return
        if self.reduce_in is not None:
            sim.event("backward", self.at, [], [self.reduce_in])
        self.reduce_in = sim.new(f"fsdp.reduce_scatter_input[{unit}]", "temporary", self.reduce_bytes[unit])
        sim.event("backward", self.at, [self.reduce_in], [])
        grads = accumulated or [sim.param_grad.pop(p) for p in self.params[unit] if p in sim.param_grad]
        g = sim.new(f"fsdp.sharded_grads[{unit}]", "gradient",
                    _times_bytes(self.unit_numel[unit], self.sharded_grad_bytes))
        self.sharded_grads.append(g)
        sim.event("backward", self.at, [], grads[:-1])
        out = self.reduce_out.get(unit)
        if out is not None:  # reduce_dtype is not the parameters': the output in it, cast to theirs and let go
            out = sim.new(f"fsdp.reduce_scatter_output[{unit}]", "temporary", out)
            sim.event("backward", self.at, [out], [])
        sim.event("backward", self.at, [g], [] if out is None else [out])
        self.last_grad = grads[-1:]

    def _accumulate(self, unit: Any) -> list[int]:
        """Gradient accumulation under a policy whose reduce_dtype is not param_dtype (measured on gloo runs): a
        unit's post-backward adds its bf16 unsharded gradients into their reduce_dtype copies and frees them
        (``accumulate_unsharded_grad_if_needed``); without sync it then copies each one left to reduce_dtype,
        beside it, and frees it (``to_accumulated_grad_if_needed``).  The copies of the unit (what its reduce
        takes at the last micro-batch, which lets go of them: none are kept after it)."""
        if self.policy is None or self.policy[0] == self.policy[1]:
            return []
        sim, params = self.sim, self.params[unit]
        summed = [sim.param_grad.pop(p) for p in params if p in self.accumulated and p in sim.param_grad]
        if summed:
            sim.event("backward", self.at, [], summed)
        if self.sync:
            return [self.accumulated.pop(p) for p in params if p in self.accumulated]
        for p in params:
            if p in sim.param_grad:
                copy = sim.new(f"{p}.accumulated_grad", "gradient", _times_bytes(sim.numel[p], self.policy[1]))
                sim.event("backward", self.at, [copy], [sim.param_grad.pop(p)])
                self.accumulated[p] = copy
        return []

    def after_backward(self, n: str) -> None:
        self.at = n
        unit = self.unit_of.get(n)
        if unit is not None and unit in self.last_backward and self.last_backward[unit] == n:
            self.post_backward(unit)
            self.sim.event("backward", self.at, [], self.last_grad)

    def end_backward(self) -> list[int]:
        """The root's post-backward (the final callback); what the backward's end frees."""
        self.at = None
        self.pre_backward(None)
        self.post_backward(None)
        out = [self.reduce_in] if self.reduce_in is not None else []
        out += getattr(self, "last_grad", []) if self._has(None) else []
        self.reduce_in = None
        return out

    def plan_backward(self, needs: set[str]) -> None:
        """Each unit's last node to run backward: its first in program order that runs backward."""
        self.last_backward: dict[Any, str] = {}
        for n in self.sim.order:
            u = self.unit_of.get(n)
            if u is not None and n in needs:
                self.last_backward.setdefault(u, n)
        #: the ops :meth:`after_backward` acts at (the walk calls it there only)
        self.backward_ends = set(self.last_backward.values())
        self.started_backward, self.done_backward = set(), set()
        self.reduce_in = None


def rank_peaks(derivation: Any) -> dict[int, tuple[int, int]] | None:
    """Under FSDP2 with a number for ``N``: ``{rank: (first-step peak, steady peak)}`` of every rank ``0 .. N-1``,
    where they differ (the padding's rows are missing from the last ranks' optimizer state); None otherwise
    (another engine, ``N`` a symbol -- the peak formula is then rank 0's, the largest -- or every rank alike).

    A rank's step differs from another's only through the rows it holds of each parameter (:func:`held_shape`),
    so each distinct set of rows is walked once, however large ``N`` is: where every size has a number, no formula
    of the step was made and the layers are few (:func:`.rank_numbers.short`), at the numbers (:mod:`.rank_numbers`:
    a replayed measurement); else as each group's peak formula (:func:`rank_derivations`, rank 0's the
    derivation's own) at the derivation's numbers -- the views make the peak's formulas first and show each
    group's after (``rank_formulas``)."""

    from ..symbols import N
    from .zero_redundancy import engaged
    from .zero_redundancy import rank_peaks as zero_rank_peaks

    step = getattr(derivation, "step", None)
    if derivation.regime.pipeline_parallel and hasattr(step, "rank_peaks"):  # DDP, ZeRO-1 or FSDP2 on every stage
        return step.rank_peaks(derivation)                                     # of a p x N mesh (*_pipeline.py)
    if engaged(derivation.regime):  # ZeroRedundancyOptimizer: every rank (passes/zero_redundancy.py)
        return zero_rank_peaks(derivation)
    if derivation.regime.tensor_parallel and hasattr(step, "rank_peaks"):  # FSDP x TP: every rank of the mesh
        return step.rank_peaks(derivation)  # (passes/fsdp_tensor.py)
    world = derivation.numbers.get(N)
    if derivation.regime.data_parallel not in SHARDED or step is None or world is None or int(world) < 2:
        return None
    if hasattr(step, "rank_peaks"):  # a traced module's step: every rank (importer/traced_engines.py)
        return step.rank_peaks(derivation)
    # the step walks itself at the numbers (passes/rank_numbers.py, above this module: it simulates the step)
    at_numbers = getattr(type(step), "ranks_at_numbers", None)
    if at_numbers is not None:
        answered, found = at_numbers(step, derivation)
        if answered:
            return found
    found = {}
    for group, d in rank_derivations(derivation):
        found.update(dict.fromkeys(group, (int(d.value("peak_first_step")), int(d.value("peak")))))
    found = dict(sorted(found.items()))
    return found if len(set(found.values())) > 1 else None


def rank_derivations(derivation: Any) -> list[tuple[list[int], Any]]:
    """A built graph's FSDP2 ranks at the derivation's number of ``N``, grouped by the rows they hold
    (:func:`alike_ranks`), each group with the derivation of its step (:func:`rank_of`: the last rank's in ``N - 1``,
    so its peak formula is the last rank's at any ``N``); kept on the step, as the views ask again."""
    import dataclasses

    step = derivation.step
    world = int(derivation.numbers[N])
    key = ("rank derivations", tuple(sorted((s.name, int(v)) for s, v in derivation.numbers.items())))
    if key not in step._cache:
        firsts = [derivation.evaluate(shape[0]) for shape in _stored(step.graph).values() if shape]
        out = []
        for group in alike_ranks(firsts, world):
            rank = rank_of(group, world)
            if rank == 0 and RANK_OPTION not in step.options:
                # rank 0's step is the derivation's own (the schedule's rank when none is chosen): its peak,
                # worked out once for the views that show it too
                out.append((group, derivation))
                continue
            options = {**step.options, RANK_OPTION: rank}
            out.append((group, dataclasses.replace(derivation, step=dataclasses.replace(
                step, options=options, _cache={}, _all=None, _written=None))))
        step._cache[key] = out
    return step._cache[key]


def rank_of(group: Sequence[int], world: int) -> Any:
    """The rank whose step stands for ``group`` (ranks holding the same rows at ``world`` ranks): its first, or
    where the group is the last rank alone, ``N - 1`` -- the rows it holds are then a formula in ``N``
    (:func:`held_shape`: ``d0 - (N-1)*ceiling(d0/N)``), the last rank's at any ``N``.

    >>> rank_of([0, 1, 2], 4), rank_of([3], 4), rank_of([2], 4)
    (0, N - 1, 2)
    """
    return N - 1 if len(group) == 1 and group[0] == world - 1 and world > 1 else group[0]


def alike_ranks(firsts: Sequence[Any], world: int) -> list[list[int]]:
    """The ranks ``0 .. world-1`` grouped by the rows they hold of tensors whose dim 0 is each of ``firsts``
    (:func:`held_shape`): the ranks of a group hold the same bytes, so each group is worked out once, however
    large ``world`` is.

    >>> alike_ranks([10, 4], 4)   # rows 3, 3, 3, 1 of 10; 1 each of 4
    [[0, 1, 2], [3]]
    """
    sizes = sorted({int(d) for d in firsts})
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in range(world):
        groups.setdefault(tuple(int(held_shape((d,), world, rank)[0]) for d in sizes), []).append(rank)
    return list(groups.values())


def _stored(graph: Any) -> dict[str, tuple[sympy.Expr, ...]]:
    """Every parameter of ``graph`` as its module stores it (as the step's Simulation lists them)."""
    return stored_shapes(graph, program_parameters(graph, ((n, graph.node(n)) for n in graph.nodes)))


#: a rank's value in :func:`rank_ranges`
T = TypeVar("T")


def rank_ranges(ranks: Mapping[int, T]) -> list[tuple[int, int, T]]:
    """Consecutive ranks with the same value (peaks, a parameter side) as ``(first rank, last rank, value)``, for a
    view to print N ranks in a few lines.

    >>> rank_ranges({0: (5, 9), 1: (5, 9), 2: (4, 8), 3: (4, 7)})
    [(0, 1, (5, 9)), (2, 2, (4, 8)), (3, 3, (4, 7))]
    """
    out: list[tuple[int, int, T]] = []
    for rank in sorted(ranks):
        if out and out[-1][2] == ranks[rank] and out[-1][1] == rank - 1:
            out[-1] = (out[-1][0], rank, ranks[rank])
        else:
            out.append((rank, rank, ranks[rank]))
    return out
