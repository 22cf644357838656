"""FSDP1 x TP: one rank of an N x t mesh, FSDP1's ``FullyShardedDataParallel`` over a ``parallelize_module``'d Llama.

PyTorch's original 2-D recipe: ``init_device_mesh(device, (N, t), mesh_dim_names=("dp", "tp"))``, the standard
Llama plan over ``mesh["tp"]``, then ``FullyShardedDataParallel(model, device_mesh=mesh["dp"],
auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)`` with ``FULL_SHARD`` (``fsdp1``) or
``SHARD_GRAD_OP`` (``fsdp1-grad-op``).  FSDP1 flattens each DTensor parameter's *local* shard (its DTensor
extension) into one ``FlatParameter`` per unit -- a layer, and the root holding the embedding, the final norm and
the head -- and splits it over the N ranks of the data-parallel group.  Measured per rank on gloo
(:mod:`symmem.record.fsdp_tensor_runs`, N = 2, t = 2, every rank), to the byte:

* **the flat layout** (``use_orig_params=True``): a unit's tensor-parallel shards in the order the module
  registers them (a layer: its linears, then its two norms -- the Llama reference's, transformers' own; the root:
  the embedding, the final norm, the head), each starting at a multiple of 4 elements (16 bytes: FSDP1 pads
  between them), the whole padded to a multiple of N; rank ``r`` stores ``k = ceiling(n / N)`` elements,
  ``[r k, (r + 1) k)``, and so does its sharded gradient (:func:`flat_units`);
* **AdamW's state**: the optimizer steps on the original parameters, each a view of the part of the flat shard
  that is its own (padding excluded, empty on the ranks that hold none of it: no state, no ``step``): two moments
  of each part and a 4-byte ``step`` per parameter with a part on the rank (:func:`mesh1_rank`) -- ranks differ;
* **the step**: FSDP1's flat buffers (:class:`symmem.passes.fsdp1.Fsdp1`, the unsharded flat parameter and the
  flat gradient, here the padded size already: no padded copy) at the 2-D shards' sizes, beside the
  tensor-parallel rank's activations and collectives (:class:`~symmem.passes.fsdp_tensor._MeshWalk`'s walk, with
  or without sequence parallelism), and what was measured op by op beyond them (:class:`_Mesh1Walk`): the
  padding's zeros at the flat gradient's concatenation, the embedding's whole gradient beside its rows' clone,
  the root's post-backward a candidate; the optimizer step's for-loop temporaries on each rank's parts.  Every
  rank's moments make one peak (:meth:`Mesh1Step.peak`): the largest rank's, named.  Equal to the engine's on
  every rank of 2 x 2 meshes (16 configurations), a 2 x 3 and a 3 x 2 mesh (docs/regimes.md).

>>> from symmem import derive
>>> values = {"B": 2, "S": 8, "H": 32, "h": 4, "G": 2, "L": 2, "V": 66, "F": 64, "N": 2, "t": 2}
>>> d = derive("llama", data_parallel="fsdp1", tensor_parallel=True, attention="sdpa", device="cpu",
...            values=values)
>>> d.value("peak"), d.value("peak_first_step")  # every rank of a gloo run measures the same
(185240, 139240)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy

from ..graph import Graph
from ..peak import Peak
from ..shapes import numel
from ..training import Regime
from .fsdp_tensor import MeshStep, _MeshSequenceWalk, _MeshWalk, parameters

#: FSDP1 starts each original parameter of a flat parameter at a multiple of this many elements (16 bytes of
#: FP32: ``_get_aligned_numel``) with ``use_orig_params=True``
ALIGN = 4


@dataclass(frozen=True)
class FlatUnit:
    """One unit's flat parameter: its parameters (node, count -- how many such units --, elements of the
    tensor-parallel shard) in the flat order, where each starts, and the elements a rank stores (``k``)."""

    members: tuple[tuple[str, sympy.Expr, sympy.Expr], ...]
    starts: tuple[sympy.Expr, ...]
    shard: sympy.Expr
    #: at the numbers :func:`flat_units` was given: each parameter's (start, end) and ``k`` (empty: none given)
    at: tuple[tuple[int, int], ...] = ()
    shard_at: int = 0

    def part(self, j: int, rank: int, env: Mapping[sympy.Symbol, sympy.Integer] | None = None) -> sympy.Expr:
        """Elements of parameter ``j`` on data-parallel rank ``rank`` (0 where it holds none): with ``env`` (the
        numbers) the piece that holds there -- none, all, or the part before or after a shard's edge --, else
        ``Max(0, Min(end, (r + 1) k) - Max(start, r k))`` as written (sympy's proofs on it take seconds)."""
        start, size = self.starts[j], self.members[j][2]
        end, lo, hi = start + size, rank * self.shard, (rank + 1) * self.shard
        if env is None:
            return sympy.Max(0, sympy.Min(end, hi, evaluate=False) - sympy.Max(start, lo, evaluate=False),
                             evaluate=False)
        first, last = self.at[j] if self.at else (int(start.xreplace(env)), int(end.xreplace(env)))
        k = self.shard_at if self.at else int(self.shard.xreplace(env))
        if last <= rank * k or first >= (rank + 1) * k:
            return sympy.Integer(0)
        return (end if last <= (rank + 1) * k else hi) - (start if first >= rank * k else lo)


def flat_units(graph: Graph, env: Mapping[sympy.Symbol, sympy.Integer] | None = None) -> tuple[FlatUnit, FlatUnit]:
    """The root's flat parameter and a layer's (every layer alike), in FSDP1's order with its alignment padding
    (with ``env``, the numbers: the padding there, a number; else ``Mod(-end, 4)``).

    >>> from symmem.models import build
    >>> root, layer = flat_units(build("llama").graph)
    >>> [m[0] for m in root.members]
    ['embed_tokens', 'norm.weight', 'lm_head']
    >>> [m[0] for m in layer.members][-3:]
    ['layers.mlp.down_proj', 'layers.input_layernorm.weight', 'layers.post_attention_layernorm.weight']
    >>> layer.starts[1]  # k starts after q (H/t x H), at a multiple of 4 elements
    H**2/t + Mod(-H**2/t, 4)
    """
    from ..symbols import N
    from .data_parallel import ceil_div

    root: list[tuple[str, sympy.Expr, sympy.Expr]] = []
    linears: list[tuple[str, sympy.Expr, sympy.Expr]] = []
    norms: list[tuple[str, sympy.Expr, sympy.Expr]] = []
    for n, count, shape in parameters(graph):
        member = (n, count, numel(shape))
        if graph.node(n).block is None:
            root.append(member)
        else:
            (linears if len(shape) >= 2 else norms).append(member)
    out = []
    for members in (root, linears + norms):
        starts, end = [], sympy.Integer(0)
        at, last = [], 0  # at the numbers
        for _, _, size in members:
            if env is None:
                start = end + sympy.Mod(-end, ALIGN) if starts else end
            else:
                start = end + (-last % ALIGN)
                at.append((last + (-last % ALIGN), last + (-last % ALIGN) + int(size.xreplace(env))))
                last = at[-1][1]
            starts.append(start)
            end = start + size
        shard = ceil_div(end, N)
        out.append(FlatUnit(tuple(members), tuple(starts), shard, tuple(at), -(-last // int(env[N])) if env else 0))
    return out[0], out[1]


def mesh1_rank(graph: Graph, storages: Sequence[Any], regime: Regime, rank: int = 0, sequence: bool = False,
               env: Mapping[sympy.Symbol, sympy.Integer] | None = None, saved: sympy.Expr | None = None) -> Any:
    """One rank of the N x t mesh under FSDP1 as a :class:`~symmem.passes.model_parallel.TensorRank` (formulas in
    N and t): the flat shards and sharded gradients, AdamW's state on ``rank``'s parts of the original parameters,
    the tensor-parallel rank's saved activations (``saved``: worked out already); with ``env``, the pieces that
    hold at those numbers (:meth:`FlatUnit.part`)."""
    from ..errors import SymmemError
    from .model_parallel import TensorRank, tensor_rank

    if regime.precision != "fp32" or regime.optimizer not in ("adam", "adamw"):
        raise SymmemError("FSDP1 x TP's ranks are modelled for FP32 Adam/AdamW, as measured")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise SymmemError(f"a rank is a non-negative integer, got {rank!r}")
    stored = state = sympy.Integer(0)
    for unit in flat_units(graph, env):
        count = unit.members[0][1]
        stored += count * unit.shard * 4
        for j, (_, each, _) in enumerate(unit.members):
            part = unit.part(j, rank, env)
            # exp_avg, exp_avg_sq; a step where it has a part
            held = (part != 0) if env is not None else sympy.Min(1, part, evaluate=False)
            state += each * (2 * part * 4 + 4 * held)
    if saved is None:
        saved = tensor_rank(graph, storages, regime, sequence).saved
    return TensorRank(saved, stored, stored, state)


def _env(named: Mapping[str, int] | None) -> dict[sympy.Symbol, sympy.Integer] | None:
    return None if named is None else {sympy.Symbol(k, positive=True, integer=True): sympy.Integer(v)
                                       for k, v in named.items()}


class _Mesh1Walk(_MeshWalk):
    """:class:`~symmem.passes.fsdp_tensor._MeshWalk` with FSDP1's flat buffers (:class:`~symmem.passes.fsdp1.
    Fsdp1`) at the sizes of a rank's flat shards, with the zeros of its padding while the flat gradient is
    concatenated (measured)."""

    def __init__(self, graph: Graph, conv: Any, options: Any, regime: Regime, numbers: Any) -> None:
        from ..symbols import N

        super().__init__(graph, conv, options, regime, numbers)
        root, layer = flat_units(self.original, self.subs)
        self.flat = {"root": root.shard, "layer": layer.shard}
        # the flat parameter's padding (between parameters and at its end): autograd's split backward makes zeros
        # for it beside the parameters' gradients while it concatenates them into the flat gradient (measured)
        self.padding = {name: (N * u.shard - sympy.Add(*(m[2] for m in u.members))) * 4
                        for name, u in (("root", root), ("layer", layer))}

    def _local(self, i: int) -> sympy.Expr:
        from ..symbols import N

        s = self.tl.storages[i]
        if s.name.startswith("fsdp1."):
            k = self.flat["root" if s.name.endswith("[root]") else "layer"]
            if s.name.startswith(("fsdp1.unsharded[", "fsdp1.flat_grad[")):
                return N * k * 4  # the flat parameter is padded already: its gradient too
            if s.name.startswith("fsdp1.padded_grad["):
                return sympy.Integer(0)  # no copy to pad
            return k * 4  # the sharded gradient
        return super()._local(i)

    def _collectives(self, e: Any, alive: set[int], k: int) -> sympy.Expr:
        """What the walk adds at this op, and the padding's zeros at a flat gradient's concatenation."""
        extra = super()._collectives(e, alive, k)
        for i in e.born:
            name = self.tl.storages[i].name
            if name.startswith("fsdp1.flat_grad["):
                extra += self.padding["root" if name.endswith("[root]") else "layer"]
        return extra


class _Mesh1SequenceWalk(_Mesh1Walk, _MeshSequenceWalk):
    """:class:`_Mesh1Walk` under sequence parallelism."""


@dataclass(eq=False)
class Mesh1Step(MeshStep):
    """The step of one rank of the N x t mesh under FSDP1 (see the module's docstring)."""

    refused_as = "FSDP1 x TP"
    not_drawn = ("an FSDP1 x TP rank's timeline is not drawn op by op: its peak is the largest of the layers' moments "
                 "and the optimizer step")

    def walk_class(self) -> type:
        return _Mesh1SequenceWalk if self.sequence else _Mesh1Walk

    def rank_parts(self, rank: int, named: Mapping[str, int] | None = None) -> Any:
        from .model_parallel import tensor_rank

        if "saved" not in self._cache:  # every rank's, worked out once
            self._cache["saved"] = tensor_rank(self.graph, self.storages, self.regime, self.sequence).saved
        return mesh1_rank(self.graph, self.storages, self.regime, rank, self.sequence, _env(named),
                          self._cache["saved"])

    def temporaries(self, rank: int, named: Mapping[str, int]) -> sympy.Expr:
        """For-loop AdamW's largest temporaries on ``rank``'s parts: two of a part's size beside the previous
        part's ``denom``, over the parts the rank holds (a parameter without one has no gradient: skipped)."""
        key = ("temporaries", rank, tuple(sorted(named.items())))
        if key not in self._cache:
            self._cache[key] = self._temporaries(rank, named)
        return self._cache[key]

    def _temporaries(self, rank: int, named: Mapping[str, int]) -> sympy.Expr:
        from .tensor_step import largest_of

        env = _env(named)
        root, layer = flat_units(self.graph, env)
        layers = int(named["L"])
        embed, tail = [root.part(0, rank, env)], [root.part(j, rank, env) for j in range(1, len(root.members))]
        order = embed + [layer.part(j, rank, env) for j in range(len(layer.members))] * layers + tail
        held = [4 * p for p in order if p != 0]
        if not held:
            return sympy.Integer(0)
        candidates = list(dict.fromkeys([2 * held[0]] + [a + 2 * b for a, b in zip(held, held[1:], strict=False)]))
        if all(c.free_symbols <= set(env) for c in candidates):
            # every size a number here (the peak is walked at these numbers): the largest, found without sympy
            return max(candidates, key=lambda c: int(c.xreplace(env)))
        return largest_of(candidates)

    def groups(self, merged: Mapping[sympy.Symbol, int]) -> list[list[int]]:
        """The data-parallel ranks grouped by the parts they hold (each group's step is walked once)."""
        from ..symbols import N

        env = {s: sympy.Integer(v) for s, v in merged.items()}
        units = flat_units(self.graph, env)
        found: dict[tuple[int, ...], list[int]] = {}
        for r in range(int(merged[N])):
            key = tuple(int(u.part(j, r, env).xreplace(env)) for u in units for j in range(len(u.members)))
            found.setdefault(key, []).append(r)
        return list(found.values())

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None, rank: int | None = None) -> Peak:
        """Data-parallel rank ``rank``'s peak; None: every rank's moments in one peak, each named by its rank (the
        ranks' parts differ: the largest is whichever holds the most at the numbers asked, B and S included)."""
        if rank is not None:
            return super().peak(at, rank)
        return self._walked_peak(at, -1, self._every_rank)

    def _every_rank(self, named: Mapping[str, int]) -> Peak:
        merged = {sympy.Symbol(k, positive=True, integer=True): v for k, v in named.items()}
        peaks = [self._peak(named, group[0]) for group in self.groups(merged)]
        return Peak(None, None, tuple(m for p in peaks for m in p.moments), peaks[0].domain)

    def per_rank(self, numbers: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Every rank's steady-step peak at ``numbers`` and the largest's rank (the first of the largest)."""
        found = self.ranks(numbers)
        steady = [found[r][1] for r in sorted(found)]
        return {"peak_per_rank": steady, "peak_rank": steady.index(max(steady))}
