"""``--data-parallel zero-redundancy``: ``DistributedDataParallel(model)`` with
``torch.distributed.optim.ZeroRedundancyOptimizer(params, optimizer_class=...)`` (ZeRO-1 as PyTorch runs it), one
rank's step as the schedule (:mod:`.schedule`) walks it.

What the engine does (torch 2.13, ``zero_redundancy_optimizer.py``; measured per rank on gloo runs,
``tests/test_zero_redundancy.py``, docs/regimes.md):

* ``_partition_parameters`` assigns **whole parameters** to ranks: ``model.parameters()`` sorted by ``numel``,
  largest first (a stable sort: equal sizes keep their order), each to the rank with the fewest elements so far
  (the lowest such rank on a tie).  So the optimizer state is not ``1/N`` of the whole: the rank that owns the
  largest tensor holds most (the MLP at ``N = 4``: 8.4 MB / 6.4 MB / 82 kB / 16 kB of AdamW state);
* each rank's local optimizer (``optimizer_class`` over its own parameters, in that sorted order) creates state
  for those only and steps only them (the for-loop AdamW's ``sqrt``/``denom`` temporaries follow that order);
* after the step every parameter is broadcast from its owner into ``param.data`` in place (gloo allocates
  nothing the recorder sees for it); ``zero_grad`` frees every gradient;
* DDP is unchanged: gradient buckets of 4 bytes per parameter for the whole step (:mod:`.data_parallel`), every
  rank computes every gradient;
* a rank that owns nothing (more ranks than parameters) runs an empty local optimizer: it works (measured).

The partition needs numbers while the formulas may keep symbols: the parameters' sizes (and how many there are:
the layer counts) and ``N`` are taken at the derivation's numbers, every rank's step is the forward and backward
every rank shares (walked once, as one device's: :func:`symmem.passes.graph_step.symbolic_peak`) with its own
optimizer state and step, and the peak is the ``Max`` over every rank's moments -- a formula in the sizes the
parameters do not depend on (``B``, ``S``), its domain those numbers (``N = 4``, ``H = 768``, ...: other numbers
partition again).

>>> partition([6, 10, 6, 1], 2)        # sizes in model.parameters() order -> indices per rank
[[1, 3], [0, 2]]
>>> from symmem import derive
>>> d = derive("mlp", convention="pytorch", device="cpu", values={"B": 4, "N": 4}, data_parallel="zero-redundancy",
...            loss="cross-entropy")
>>> {r: s for r, (f, s) in rank_peaks(d).items()}   # measured on 4 gloo ranks: the same, to the byte
{0: 39154076, 1: 35221916, 2: 22540700, 3: 22409724}
>>> d.value("peak"), d.peak_at().rank, d.peak_at().where()
(39154076, 0, 'rank 0 of 4: step fc2.weight, steady step')
"""

from __future__ import annotations

import dataclasses
import heapq
import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy

from ..errors import SymmemError
from ..peak import Moment, Peak
from ..shapes import numel as shape_numel
from ..symbols import N, equals
from ..training import RANK_OPTION, Regime
from .parameters import in_registration_order, node_parameters, program_parameters, state_storages

#: The engine's name (:data:`symmem.training.DATA_PARALLEL`).
ENGINE = "zero-redundancy"
#: The option (inside the step's options, not a user's) holding the numbers the partition is computed at.
NUMBERS_OPTION = "_zero_redundancy_numbers"
#: The option holding the walks of forward and backward the ranks share (:func:`symmem.passes.schedule.simulate`)
WALKS_OPTION = "_zero_redundancy_walks"


def partition(sizes: Sequence[int], world: int) -> list[list[int]]:
    """``ZeroRedundancyOptimizer._partition_parameters``: the indices of ``sizes`` (element counts, in
    ``model.parameters()`` order) each rank owns, in the order its local optimizer lists them.

    >>> partition([802816, 1024, 1048576, 1024, 10240, 10], 4)   # the MLP's (fc1.weight, fc1.bias, ...)
    [[2], [0], [4], [1, 3, 5]]
    """
    ranks: list[list[int]] = [[] for _ in range(world)]
    # (elements so far, rank): the heap's least is the rank with the fewest, the lowest of them on a tie
    held = [(0, rank) for rank in range(world)]
    for i in sorted(range(len(sizes)), key=[-size for size in sizes].__getitem__):
        least, rank = held[0]
        ranks[rank].append(i)
        heapq.heapreplace(held, (least + sizes[i], rank))
    return ranks


def listed(graph: Any) -> list[tuple[str, tuple[sympy.Expr, ...]]]:
    """The parameters of a (written out) graph as ``model.parameters()`` lists them, as the schedule names them
    (:func:`symmem.passes.parameters.in_registration_order`)."""
    return in_registration_order(graph, program_parameters(graph))


def listed_whole(graph: Any, counts: Mapping[str, int]) -> list[tuple[str, tuple[sympy.Expr, ...]]]:
    """:func:`listed` of ``graph`` with each block written out ``counts[block]`` times, without writing it out:
    :func:`symmem.passes.unroll.unroll` adds iteration ``k``'s members as ``<member>#k`` after iteration
    ``k - 1``'s, each block where its members stand, and the written-out graph runs in that order.

    >>> from symmem.models import build
    >>> from symmem.passes.unroll import unroll
    >>> g = build("gpt2").graph
    >>> listed_whole(g, {"h": 3}) == listed(unroll(g, {"h": 3}))
    True
    >>> g = build("llama").graph
    >>> listed_whole(g, {"layers": 3}) == listed(unroll(g, {"layers": 3}))
    True
    """
    return [(name, found[0]) for name, found in listed_members(graph, counts)]


def listed_members(graph: Any, counts: Mapping[str, int]) -> list[tuple[str, tuple[Any, str, int, str]]]:
    """:func:`listed_whole`, each parameter with what it was written from: ``(name, (shape, node, k, own))``,
    ``node`` the graph's node that holds it (a member of a block, or outside the blocks), ``k`` its iteration (0
    outside the blocks) and ``own`` the parameter's name on the node (``.weight``; empty for a parameter node):
    ``name`` is ``node#k`` (``node`` outside the blocks) followed by ``own``, as
    :func:`~symmem.passes.parameters.node_parameters` names it."""
    order = list(graph.program_order())
    params: list[tuple[str, tuple[Any, str, int, str]]] = []
    i = 0
    while i < len(order):
        node = graph.node(order[i])
        if node.block is None:
            params += [(name, (shape, order[i], 0, name[len(order[i]):]))
                       for name, shape in node_parameters(order[i], node)]
            i += 1
            continue
        members = [n for n in order if graph.node(n).block == node.block]
        # one iteration's parameters listed once, renamed for each: node_parameters of ``<member>#k`` names them
        # ``<member>#k`` and ``<member>#k.<param>`` (each member asked once, not once an iteration: a 32-layer
        # stack's listing asked 1,800 members)
        one = [(m, name[len(m):], shape) for m in members for name, shape in node_parameters(m, graph.node(m))]
        params += [(f"{m}#{k}{rest}", (shape, m, k, rest)) for k in range(1, counts[node.block] + 1)
                   for m, rest, shape in one]
        i += len(members)
    # in_registration_order reads the names only (each pair moved whole)
    return in_registration_order(graph, params)


def engaged(regime: Regime) -> bool:
    return getattr(regime, "data_parallel", None) == ENGINE


def owned(regime: Regime, params: Sequence[tuple[str, tuple[sympy.Expr, ...]]],
          options: Mapping[str, Any]) -> list[tuple[str, tuple[sympy.Expr, ...]]] | None:
    """The parameters this rank's local optimizer steps, in its order (None: not this engine): ``params`` in
    ``model.parameters()`` order, partitioned at the numbers in the step's options."""
    if not engaged(regime):
        return None
    env = options.get(NUMBERS_OPTION)
    if env is None:
        raise SymmemError("ZeroRedundancyOptimizer's partition needs the sizes as numbers")
    sizes = [int(shape_numel(shape).xreplace(env)) for _, shape in params]
    rank = int(options.get(RANK_OPTION, 0))
    return [params[i] for i in partition(sizes, int(env[N]))[rank]]


def every_rank(step: Any) -> bool:
    """Whether ``step`` (a :class:`~symmem.passes.graph_step.GraphStep`) is ZeRO-1's with no rank chosen: its
    peak is the largest rank's (:func:`ranks_peak`)."""
    return engaged(step.regime) and RANK_OPTION not in step.options


@dataclasses.dataclass(frozen=True)
class RankMoment(Moment):
    """A moment of one rank's step (the lowest of the ranks whose steps are alike)."""

    rank: int = 0
    ranks: int = 1

    def where(self, step: bool = True) -> str:
        return f"rank {self.rank} of {self.ranks}: " + Moment.where(self, step)


class RanksPeak(Peak):
    """The peak over every rank (the ``Max`` of their moments), with each rank's own :class:`Peak`."""

    per_rank: dict[int, Peak]
    _state: Any  # how to work out :attr:`state`, on first use

    @property
    def state(self) -> list[int]:
        """Each rank's optimizer state in bytes (the whole parameters it owns; Adam's 4-byte step scalars
        included)."""
        if callable(self._state):
            self._state = self._state()
        return self._state


def _state(regime: Regime, shape: tuple[sympy.Expr, ...], env: Mapping[sympy.Symbol, sympy.Expr]) -> int:
    """The optimizer state of one parameter its owner holds, at ``env``: the schedule's storages of it
    (:func:`~symmem.passes.parameters.state_storages`, Adam's step count included)."""
    return int(sympy.Add(*(e for _, _, e, _, _ in state_storages(regime, "", shape, False))).xreplace(env))


def _at(shape: Sequence[Any], env: Mapping[sympy.Symbol, sympy.Expr]) -> tuple[int, ...]:
    return tuple(int(sympy.sympify(x, strict=True).xreplace(env)) for x in shape)


def _fixed(step: Any, numbers: Mapping[sympy.Symbol, int]) -> dict[sympy.Symbol, int]:
    """The numbers the partition depends on: ``N``, the layer counts and the parameters' sizes."""
    subs = dict(step.subs)
    needed: set[sympy.Symbol] = {N}
    for b in step.graph.blocks.values():
        needed |= sympy.sympify(b.count, strict=True).xreplace(subs).free_symbols
    for n in step.graph.program_order():
        for shape in step.graph.node(n).params.values():
            for x in shape:
                needed |= sympy.sympify(x, strict=True).xreplace(subs).free_symbols
    missing = sorted(s.name for s in needed if s not in numbers)
    if missing:
        raise SymmemError(f"ZeroRedundancyOptimizer partitions whole parameters by their sizes: give "
                          f"{', '.join(missing)} a number (--set {missing[0]}=...)")
    world = numbers[N]
    if isinstance(world, bool) or int(world) != world or int(world) < 1:
        raise SymmemError(f"the world size N is a positive integer, got {world!r}")
    return {s: int(numbers[s]) for s in sorted(needed, key=lambda s: s.name)}


def ranks_peak(step: Any, at: Mapping[sympy.Symbol, int] | None) -> RanksPeak:
    """The largest rank's peak: every rank's step walked at the numbers the partition needs (ranks that own
    parameters of the same sizes in the same order step alike: walked once), their moments tagged with the rank,
    a moment another rank's same moment provably exceeds dropped."""
    key = ("ranks", None if at is None else tuple(sorted((s.name, int(v)) for s, v in at.items())))
    if key in step._cache:
        return step._cache[key]
    refuse_precision(step)
    fixed = _fixed(step, {**step.numbers, **(at or {})})
    env = _env(step, fixed)
    world = fixed[N]
    counts = {name: int(sympy.sympify(b.count, strict=True).xreplace(env)) for name, b in step.graph.blocks.items()}
    walks: dict[Any, Any] = {}  # what every rank's walk shares (passes/graph_step.py): worked out once
    params = walks[("listed", tuple(sorted(counts.items())))] = listed_whole(step.graph, counts)
    # a stack's parameters are a few shapes: each one's size and dimensions at the numbers worked out once
    numel_at: dict[tuple[sympy.Expr, ...], int] = {}
    dims_at: dict[tuple[sympy.Expr, ...], tuple[int, ...]] = {}
    for _, shape in params:
        if shape not in numel_at:
            numel_at[shape], dims_at[shape] = int(shape_numel(shape).xreplace(env)), _at(shape, env)
    sizes = [numel_at[shape] for _, shape in params]
    parts = walks[("partition", ("listed", tuple(sorted(counts.items()))))] = partition(sizes, world)
    at_all = {**(at or {}), **{s: v for s, v in fixed.items() if s != N}}

    def rank_peak(ranks: list[int]) -> Peak:
        one = dataclasses.replace(step, options={**step.options, NUMBERS_OPTION: env, RANK_OPTION: ranks[0],
                                                 WALKS_OPTION: walks}, _cache={}, _written=None)
        return one.peak(at_all)

    domain = tuple(equals(s, v) for s, v in fixed.items())
    out = over_ranks(parts, lambda i: dims_at[params[i][1]], rank_peak, world, domain)
    out._state = lambda: [sum(_state(step.regime, params[i][1], env) for i in idx) for idx in parts]
    if len(step._cache) > 16:
        step._cache.clear()
    step._cache[key] = out
    return out


def refuse_precision(step: Any) -> None:
    """ZeRO-1's peak is torch.optim's, in fp32: refuse the papers' mixed precision (every rank's step refuses it)."""
    if step.regime.precision != "fp32":
        raise SymmemError(f"the peak under data_parallel={ENGINE!r} is modelled in fp32 (torch.optim keeps no "
                          f"master weights to partition; precision={step.regime.precision!r} is the papers' "
                          "accounting: --zero 1)")


def rank_groups(step: Any, numbers: Mapping[sympy.Symbol, int]) -> list[list[int]]:
    """The ranks ``0 .. N-1`` at ``numbers`` grouped as :func:`over_ranks` groups them: those that own parameters of
    the same shapes in the same order step alike (:func:`symmem.passes.rank_numbers.rank_groups`)."""
    refuse_precision(step)
    fixed = _fixed(step, {**step.numbers, **numbers})
    env = _env(step, fixed)
    counts = {name: int(sympy.sympify(b.count, strict=True).xreplace(env)) for name, b in step.graph.blocks.items()}
    params = listed_whole(step.graph, counts)
    parts = partition([int(shape_numel(shape).xreplace(env)) for _, shape in params], fixed[N])
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank, idx in enumerate(parts):
        groups.setdefault(tuple(_at(params[i][1], env) for i in idx), []).append(rank)
    return list(groups.values())


def over_ranks(parts: Sequence[Sequence[int]], shape: Callable[[int], Any], rank_peak: Callable[[list[int]], Peak],
               world: int, domain: tuple[sympy.Basic, ...]) -> RanksPeak:
    """The peak over every rank of ``parts`` (each rank's parameters, indices in its local optimizer's order):
    ``rank_peak(ranks)`` is the peak of ranks that step alike -- the same shapes (``shape(i)``) in the same order (a
    factored optimizer's state follows the shape, not the size) -- worked out once for them; each moment tagged
    with the lowest of them, a moment another rank's same moment exceeds by a number dropped.  A built graph's
    ranks (:func:`ranks_peak`) and a traced module's (:mod:`symmem.importer.traced_engines`) alike."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for rank, idx in enumerate(parts):
        groups.setdefault(tuple(shape(i) for i in idx), []).append(rank)
    per_rank: dict[int, Peak] = {}
    moments: list[RankMoment] = []
    for ranks in groups.values():
        found = rank_peak(ranks)
        per_rank.update({r: found for r in ranks})
        moments += [_tagged(m, ranks[0], world) for m in found.moments]
    out = RanksPeak(None, None, tuple(_undominated(moments)), domain, per_rank[0].guards)
    out.per_rank = dict(sorted(per_rank.items()))
    return out


#: a moment's fields, copied into each rank's
MOMENT_FIELDS = tuple(f.name for f in dataclasses.fields(Moment))
_fields_of = operator.attrgetter(*MOMENT_FIELDS)


def _tagged(m: Moment, rank: int, world: int) -> RankMoment:
    """``RankMoment(**fields of m, rank=rank, ranks=world)`` without the frozen dataclass's ``__init__`` setting each
    field through ``object.__setattr__`` (as :func:`symmem.timeline.make_live` makes a storage): the same value,
    made for every moment of every rank group."""
    made = object.__new__(RankMoment)
    made.__dict__.update(zip(MOMENT_FIELDS, _fields_of(m), strict=True), rank=rank, ranks=world)
    return made


def _undominated(moments: list[RankMoment]) -> list[RankMoment]:
    """Each moment unless another rank's same moment (phase, op, layer, step, branch) is larger by a number
    (ranks differ in their optimizer state, numbers at these sizes; their forward and backward are the same)."""
    by: dict[tuple[Any, ...], list[RankMoment]] = {}
    for m in moments:
        by.setdefault((m.phase, m.node, m.layer, m.step, m.branch), []).append(m)
    out = []
    for same in by.values():
        kept: list[RankMoment] = []
        for m in same:
            if any(_exceeds(k, m) for k in kept):
                continue
            kept = [k for k in kept if not _exceeds(m, k)] + [m]
        out += kept
    return out


def _exceeds(a: Moment, b: Moment) -> bool:
    if a.offset is not None and b.offset is not None and a.offset[0] == b.offset[0]:
        return a.offset[1] >= b.offset[1]  # the same shared moment, each with its own bytes
    if a.poly is not None and b.poly is not None:  # exact coefficients by monomial: no sympy sum to build
        pa, pb = _poly(a), _poly(b)
        one = sympy.S.One
        if any(pa.get(m, 0) != k for m, k in pb.items() if m is not one) or any(
                k and m is not one and m not in pb for m, k in pa.items()):
            return False
        return pa.get(one, 0) >= pb.get(one, 0)
    d = a.total - b.total  # like terms cancel as the Add is built: expand only where that leaves symbols
    if not d.is_number:
        d = sympy.expand(d)
    return bool(d.is_number and d >= 0)


def _poly(m: Moment) -> Any:
    found = m.__dict__.get("_poly")
    if found is None:
        found = m.poly()  # type: ignore[misc]
        object.__setattr__(m, "_poly", found)  # a cache on a frozen value, as Moment.total keeps its sum
    return found


def rank_peaks(derivation: Any) -> dict[int, tuple[int, int]] | None:
    """Under ZeRO-1: ``{rank: (first-step peak, steady peak)}`` of every rank at the derivation's numbers; None
    under another engine."""
    if not engaged(derivation.regime) or getattr(derivation, "step", None) is None:
        return None
    found = derivation._peak(exact=True)
    per_rank = getattr(found, "per_rank", None)
    if per_rank is None:
        return None
    numbers = derivation.numbers
    return {r: (_value(p, numbers, "first"), _value(p, numbers, "steady")) for r, p in per_rank.items()}


def state_per_rank(derivation: Any) -> list[int] | None:
    """Under ZeRO-1: each rank's optimizer state in bytes at the derivation's numbers (None under another engine).

    >>> from symmem import derive
    >>> state_per_rank(derive("mlp", convention="pytorch", values={"N": 4}, data_parallel="zero-redundancy"))
    [8388612, 6422532, 81924, 16476]
    """
    if not engaged(derivation.regime) or getattr(derivation, "step", None) is None:
        return None
    return list(getattr(derivation._peak(exact=True), "state", None) or []) or None


def partition_at(derivation: Any) -> dict[str, int] | None:
    """Under ZeRO-1: the numbers the partition (and so the peak's formula) is computed at, by name (None under
    another engine).

    >>> from symmem import derive
    >>> partition_at(derive("gpt2", convention="pytorch", values={"N": 4}, data_parallel="zero-redundancy"))
    {'F': 3072, 'H': 768, 'L': 12, 'N': 4, 'V': 50257}
    """
    if not engaged(derivation.regime) or getattr(derivation, "step", None) is None:
        return None
    found = derivation._peak(exact=True)
    return {c.lhs.name: int(c.rhs) for c in found.domain if isinstance(c, sympy.Eq)} or None


def _value(peak: Peak, numbers: Mapping[sympy.Symbol, int], step: str) -> int:
    v = peak.value(numbers, step)
    if v is None:
        v = sympy.ceiling(peak.formula(step).xreplace({s: sympy.Integer(x) for s, x in numbers.items()}))
    return int(v)


def written_options(step: Any, at: Mapping[sympy.Symbol, int], rank: int | None = None) -> Mapping[str, Any]:
    """The options a step written out at ``at`` runs with: under ZeRO-1 with no rank chosen, the partition's
    numbers and ``rank``'s step (None: the rank whose steady step peaks highest there; its first step is that
    rank's too); under another engine ``rank``'s step (FSDP2's last shard is smaller)."""
    if not every_rank(step):
        return step.options if rank is None else {**step.options, RANK_OPTION: rank}
    fixed = _fixed(step, {**step.numbers, **at})
    if rank is None:
        rank = ranks_peak(step, {s: v for s, v in at.items() if s in fixed}).at(at, "steady").rank
    return {**step.options, NUMBERS_OPTION: _env(step, fixed), RANK_OPTION: rank}


def _env(step: Any, fixed: Mapping[sympy.Symbol, int]) -> dict[sympy.Symbol, sympy.Expr]:
    """Every graph symbol the parameters' sizes use, at ``fixed`` (the kept symbols' numbers)."""
    nums = {s: sympy.Integer(v) for s, v in fixed.items()}
    return {**{s: sympy.sympify(e, strict=True).xreplace(nums) for s, e in step.subs.items()}, **nums}
