"""What an engine around a pipeline stage holds, as formulas in the sizes: FSDP2 on stages (FSDP x PP,
:class:`FsdpFormulas`), DTensor's standard plan (TP x PP, :class:`TensorFormulas`) and both (the 3-D mesh,
:class:`MeshFormulas`).

:class:`~symmem.passes.pipeline_formula.StageFormulas` reads a moment's formula off the stage's replay run again up
to that moment.  Under FSDP2 (:mod:`.fsdp_pipeline`) that replay is :class:`~symmem.passes.fsdp_pipeline._FsdpReplay`,
which holds, beside the single-device step's storages, FSDP's own: per unit ``u`` (the stage root or a layer) the
all-gather output ``A_u`` and the reduce-scatter input ``R_u`` (``N`` padded shards of the unit), each unsharded
parameter (``N`` padded shards of it) and the sharded gradients ``G_u`` (one shard of the unit).  A parameter's
padded shard is ``ceiling(d0/N)`` rows of its stored shape ``(d0, ...)`` (FSDP2 pads dim 0 to a multiple of ``N``),
so each is a formula in ``N`` and the sizes; at rest the stage holds every shard, AdamW's two moments of the rows the
rank holds (rank 0: a whole shard; :func:`~symmem.passes.data_parallel.held_shape`) and a 4-byte ``step`` per
parameter, with ``L/p`` of the layers' (:func:`~symmem.passes.model_parallel._step_temporaries` for the optimizer
step's).  The moment's formula is then the stage's at rest plus what is alive there, each a formula -- in ``N`` as
well as the model's sizes; ``p`` and ``M`` at their numbers as for the stage alone.

>>> from symmem import derive
>>> d = derive("llama", data_parallel="fsdp-no-reshard", pipeline_parallel=True, pipeline_schedule="gpipe",
...            micro_batches=2, loss="cross-entropy", attention="sdpa", device="cpu",
...            values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 8, "V": 63, "F": 64, "p": 2, "N": 2})
>>> m = d.peak_at()
>>> m.where(step=False)
'rank 2 (stage 1 of 2, data-parallel rank 0 of N = 2): pipeline layers.mlp.gate_up (layer 8), micro-batch 0'
>>> m.pinned()
'at p = 2, M = 2, h/G != 1'
>>> sorted(s.name for s in m.total.free_symbols), d.evaluate(m.total) == d.value("peak")
(['B', 'F', 'G', 'H', 'L', 'N', 'S', 'V', 'h', 'p'], True)
>>> d.at(L=12, N=4).evaluate(m.total) == d.at(L=12, N=4).value("peak")  # the same moment peaks there
True
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy

from ..shapes import numel
from ..symbols import N
from .data_parallel import ceil_div, held_shape, rank_of
from .model_parallel import _step_temporaries, pack_alike, pack_parts
from .unroll import iteration, template

_REDUCED = re.compile(r"^the reduce-scatter of layer (\d+)$")


def _symbol(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, positive=True, integer=True)


@dataclass(frozen=True)
class Kit:
    """What an engine's step module hands its formulas (they import none of it: the step modules import this one):
    the stage's replay class, its parts at numbers, and where they are the engine's, FSDP's units, the packed
    tensor-parallel cut, the tensor-parallel cut at numbers and a parameter's tensor-parallel shape."""

    replay: type
    stage_at: Callable[..., dict[str, int]]
    units: type | None = None
    packed: type | None = None
    cut: Callable[[Mapping[str, int]], Any] | None = None
    tp_shape: Callable[..., tuple[Any, ...]] | None = None


def _cuts(step: Any, numbers: Sequence[Mapping[str, int]], packed: bool) -> tuple[Any, list[Any]]:
    """The single-device step cut by stage at each of ``numbers``, and the one the replay runs on (the three
    packed where ``packed``)."""
    from .model_parallel import _Cut, _PackedCut

    cuts = [_Cut(step.graph, step.conv, step.options, step.regime, n, step._memo()) for n in numbers]
    return (_PackedCut(cuts) if packed else cuts[0]), cuts


class _AtRest:
    """A stage's parts at rest and its optimizer step as formulas, from the engine's ``_side(memory, s)``: (the
    rank's weights, its gradients, AdamW's state, the for-loop step's temporaries), each cached on the object."""

    def _side(self, memory: Any, s: int) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, Callable[[], sympy.Expr]]:
        raise NotImplementedError

    def rest(self, memory: Any, s: int) -> sympy.Expr:
        """What the rank's stage holds between steps: its weights, their state, its buffers, inputs and the logits
        (expanded: the moments' formulas add their terms to it)."""
        key = ("rest", s)
        if key not in self.__dict__:
            weights, _, state, _ = self._side(memory, s)
            self.__dict__[key] = sympy.Add(weights, state,
                                           sympy.expand(memory.buffers + memory.inputs + memory.outputs))
        return self.__dict__[key]

    def outputs(self, memory: Any, s: int) -> sympy.Expr:
        """The last step's logits the stage holds at rest (the last stage's), dropped as the step begins."""
        return sympy.expand(memory.outputs)

    def step_peak(self, memory: Any, s: int) -> sympy.Expr:
        _, grads, _, temps = self._side(memory, s)
        return self.rest(memory, s) + grads + temps()  # every gradient, the step's temporaries

    def state(self, memory: Any, s: int) -> sympy.Expr:
        return self._side(memory, s)[2]


class FsdpFormulas(_AtRest):
    """:class:`~symmem.passes.pipeline_formula.StageFormulas`' ``engine`` for FSDP2 on every stage (``step``: an
    :class:`~symmem.passes.fsdp_pipeline.FsdpPipelineStep`, its data-parallel rank ``step.rank``)."""

    def __init__(self, step: Any, named: Mapping[str, int], kit: Kit) -> None:
        self.step, self.named, self.kit = step, dict(named), kit
        self.world = N  # the symbol ceil_div writes a ceiling of without sympy's search
        self._units: dict[int, Any] = {}        # stage -> its units at the derivation's numbers
        self._shapes: dict[int, dict[str, tuple[sympy.Expr, ...]]] = {}

    # the stage's replay, as FsdpPipelineStep makes it (packed at the three batches where the formulas are)
    def replay(self, s: int, numbers: Sequence[Mapping[str, int]], packed: bool) -> Any:
        from .model_parallel import memory_of

        step, kit = self.step, self.kit
        cut, cuts = _cuts(step, numbers, packed)
        world = step._world(self.named)
        memory = memory_of(step._stages(), s, cut.p)
        units = [kit.units(c, s, world, step.rank) for c in cuts]  # type: ignore[misc]
        ats = [kit.stage_at(memory, n, u, step.regime, c.per) for n, u, c in zip(numbers, units, cuts, strict=True)]
        if cut is cuts[0]:
            return kit.replay(cut, s, ats[0], step.schedule, step.micro_batches, units[0], step.reshard)
        alike = copy.copy(units[0])  # the same units, their shards' elements packed alike (as _batch_moments)
        alike.params = [dataclasses.replace(p, shard=pack_alike(p.shard)) for p in units[0].params]
        return kit.replay(cut, s, pack_parts(ats), step.schedule, step.micro_batches, alike, step.reshard)

    def again(self, made: tuple[Any, ...], s: int) -> Any:
        """Stage ``s``'s replay again from what :meth:`~symmem.passes.fsdp_pipeline.FsdpPipelineStep._batch_moments`
        kept of the one that read the lines (its packed cut, parts, units, plans and the ops' facts)."""
        cut, at, units, events, known = made
        step = self.step
        replay = self.kit.replay(cut, s, at, step.schedule, step.micro_batches, units, step.reshard)
        replay._events, replay._known = events, known
        return replay

    def snapshot(self, replay: Any) -> list[tuple[str, Any]]:
        """FSDP's storages alive at a moment of ``replay`` (their keys)."""
        return list(replay.held)

    def layer(self, node: str | None) -> int:
        """The layer a moment is in (its op's, or the unit's a reduce-scatter is of), 0 outside the layers."""
        if not node:
            return 0
        found = _REDUCED.match(node)
        return int(found.group(1)) if found else iteration(node)

    # FSDP's parameters as formulas
    def _shapes_of(self, cut: Any, s: int) -> dict[str, tuple[sympy.Expr, ...]]:
        """Stage ``s``'s parameters' stored shapes (dim 0 the one FSDP pads), as the units list them."""
        if s not in self._shapes:
            g = cut.g
            stored = cut.memo.get(("stored", cut.per * cut.p))  # the units' own (fsdp_pipeline._Units)
            if stored is None:
                from .data_parallel import stored_shapes
                from .parameters import in_registration_order, program_parameters

                stored = stored_shapes(g, in_registration_order(g, program_parameters(g)))
            stored = dict(stored)
            heads = [n for n in g.program_order() if g.node(n).kind == "linear" and g.node(n).attrs.get("tied")]
            if heads and s == cut.p - 1:  # the last stage's own copy of a tied embedding (nn.Linear: (V, H))
                node = g.node(heads[0])
                stored[f"{heads[0]}.weight"] = (node.attrs["out_features"], g.node(node.inputs[0]).out.shape[-1])
            self._shapes[s] = stored
        return self._shapes[s]

    def _shard(self, shape: tuple[sympy.Expr, ...]) -> sympy.Expr:
        """A parameter's padded shard, in elements."""
        return ceil_div(shape[0], self.world) * numel(shape[1:]) if shape else sympy.Integer(1)

    def size(self, cut: Any, sid: int) -> sympy.Expr:
        """A storage of the single-device step on this rank: its own size (FSDP's ranks run the whole step)."""
        return cut.tl.storages[sid].nbytes

    def terms(self, held: Sequence[tuple[str, Any]] | None, cut: Any, s: int
              ) -> list[tuple[int, sympy.Expr, int]]:
        """(the layer, or 0: the stage root; its bytes; how many) of each of FSDP's storages alive at stage ``s``'s
        moment."""
        shapes = self._shapes_of(cut, s)
        units = self._units_of(cut, s)
        made = self.__dict__.setdefault("made", {})  # every layer's alike: each kind of storage's formula once
        out = []
        for kind, key in held or ():
            if kind == "P" and isinstance(key, tuple):  # an unsharded parameter: N padded shards
                unit, name = key
                found = made.get(("P", template(name)))
                if found is None:
                    found = made[("P", template(name))] = 4 * self.world * self._shard(shapes[name])
                out.append((unit or 0, found, 1))
            elif kind in ("A", "R", "G"):  # N shards of the unit (all-gather, reduce-scatter), or one
                index = (kind, s if key is None else None)
                found = made.get(index)
                if found is None:
                    times = 4 if kind == "G" else 4 * self.world
                    found = made[index] = sympy.Add(*(times * self._shard(shapes[p.name]) for p in units.of(key)))
                out.append((key or 0, found, 1))
        return out

    def _units_of(self, cut: Any, s: int) -> Any:
        if s not in self._units:
            self._units[s] = self.kit.units(cut, s, self.step._world(self.named), self.step.rank)  # type: ignore
        return self._units[s]

    def _cut(self) -> Any:
        """The single-device step cut by stage at the derivation's numbers (the units read their parameters; the
        3-D mesh's at a tensor-parallel rank's sizes)."""
        from .model_parallel import _Cut

        step = self.step
        if self.kit.cut is not None:
            return self.kit.cut(self.named)
        return _Cut(step.graph, step.conv, step.options, step.regime, self.named, step._memo())

    # what the stage holds at rest and in the optimizer step
    def _side(self, memory: Any, s: int) -> tuple[sympy.Expr, sympy.Expr, sympy.Expr, Callable[[], sympy.Expr]]:
        """(the shards, their sharded gradients (as large), AdamW's state of the held rows, the for-loop step's
        temporaries) of stage ``s``, the layers' ``L/p`` times."""
        key = ("side", s)
        if key not in self.__dict__:
            step = self.step
            cut = self._cut()
            shapes, units = self._shapes_of(cut, s), self._units_of(cut, s)
            per = _symbol("L") / _symbol("p")
            first = units.layers[0] if units.layers else None
            index = [k for k, p in enumerate(units.params) if p.unit is not None]
            start = index[0] if index else len(units.params)
            # the last data-parallel rank's rows in N (rank_of: N - 1), so its formula is the last rank's at any N
            rank = rank_of([step.rank], step._world(self.named))
            held = {p.name: held_shape(shapes[p.name], self.world, rank) for p in units.params}
            before = [held[p.name] for k, p in enumerate(units.params) if p.unit is None and k < start]
            after = [held[p.name] for k, p in enumerate(units.params) if p.unit is None and k > start]
            layer = [held[p.name] for p in units.of(first)] if first is not None else []
            root = [p for p in units.params if p.unit is None]
            one = units.of(first) if first is not None else []
            # each a sum of monomials (a ceiling a factor), built at once: nothing for sympy to expand
            weights = sympy.Add(*(4 * self._shard(shapes[p.name]) for p in root),
                                *(per * 4 * self._shard(shapes[p.name]) for p in one))
            state = sympy.Add(*(8 * numel(held[p.name]) for p in root), 4 * len(root),
                              *(per * 8 * numel(held[p.name]) for p in one), per * 4 * len(one))
            # the for-loop step's temporaries, made when the optimizer step's formula is asked for
            self.__dict__[key] = (weights, weights, state,
                                  lambda: _step_temporaries(step.regime, before, layer, after, per, "for-loop"))
        return self.__dict__[key]


class TensorFormulas(_AtRest):
    """:class:`~symmem.passes.pipeline_formula.StageFormulas`' ``engine`` for DTensor's standard plan on every stage
    (TP x PP, :mod:`.tensor_pipeline`): each storage at one tensor-parallel rank's size (the walk's formula in
    ``t``: :class:`~symmem.passes.tensor_pipeline._Sizes`), the rank's local shards at rest, and what the
    collectives add for a moment (:meth:`terms`), each a formula."""

    def __init__(self, step: Any, named: Mapping[str, int], kit: Kit) -> None:
        self.step, self.named, self.kit = step, dict(named), kit
        self.t = _symbol("t")

    def replay(self, s: int, numbers: Sequence[Mapping[str, int]], packed: bool) -> Any:
        """Stage ``s``'s replay as :class:`~symmem.passes.tensor_pipeline.TensorPipelineStep` makes it (packed at
        the three batches where ``packed``), watched (:class:`_Watched`)."""
        from .model_parallel import memory_of

        step, kit = self.step, self.kit
        cut, cuts = _cuts(step, numbers, packed)
        memory = memory_of(step._stages(), s, cut.p)
        tcuts = [kit.cut(n) for n in numbers]  # type: ignore[misc]
        ats = [kit.stage_at(c, s, memory, n) for c, n in zip(tcuts, numbers, strict=True)]
        if cut is cuts[0]:
            return _watched(kit.replay)(tcuts[0], s, ats[0], step.schedule, step.micro_batches)
        return _watched(kit.replay)(kit.packed(cut, tcuts), s, pack_parts(ats), step.schedule,  # type: ignore[misc]
                                    step.micro_batches)

    def again(self, made: tuple[Any, ...], s: int) -> Any:
        """Stage ``s``'s replay again, watched, from what
        :meth:`~symmem.passes.tensor_pipeline.TensorPipelineStep._batch_moments` kept of the one that read the
        lines (its packed cut, parts and plans)."""
        cut, at, events = made
        replay = _watched(self.kit.replay)(cut, s, at, self.step.schedule, self.step.micro_batches)
        replay._events = events
        return replay

    def snapshot(self, replay: Any) -> tuple[Any, ...]:
        """What the op adds for this moment (the replay's note: :class:`_Watched`), which of the appends of its
        ``moment`` call this is, and the storages alive."""
        return (*replay.note, replay.fix_first, replay.call - 1, frozenset(replay.alive))

    def tick(self, replay: Any) -> None:
        """One more append of the replay's ``moment`` call."""
        replay.call += 1

    def layer(self, node: str | None) -> int:
        return iteration(node) if node else 0

    def size(self, cut: Any, sid: int) -> sympy.Expr:
        return cut.sizes.local(sid)

    def _collective(self, cut: Any, key: tuple[int, str, str | None]) -> sympy.Expr:
        """What the collective op ``key`` (pass, kind, op) adds for its moment, as
        :meth:`~symmem.passes.tensor_pipeline._TensorCut.collectives` counts it, as a formula."""
        found = self.__dict__.setdefault("collectives", {})
        if key not in found:
            p, kind, node = key
            sizes, tl, t = cut.sizes, cut.tl, self.t
            e = next(e for _, e in cut.passes[p][kind] if e.node == node)
            if kind == "F" and node in sizes.row:  # the all-reduce's partial sum beside its output and wrapper
                expr = sympy.Add(*(tl.storages[i].nbytes for i in e.born if tl.storages[i].name == node))
            elif kind == "F":  # the head: the local logits and the all-gather's output beside its wrapper
                whole = sympy.Add(*(tl.storages[i].nbytes for i in e.born if tl.storages[i].name == node))
                expr = whole + whole / t
            else:  # a column-parallel linear's input gradient's all-reduce, less what the op frees
                grads = [tl.storages[i].nbytes for i in e.born if tl.storages[i].name.endswith(".grad_input0")]
                expr = 2 * grads[0] - sympy.Add(*(sizes.local(i) for i in e.freed))
            found[key] = sympy.expand(expr)
        return found[key]

    def _logits_grad(self, cut: Any) -> sympy.Expr:
        """The rank's copy of the logits' gradient: the model's output over ``t``."""
        whole = [st.nbytes for st in cut.tl.storages
                 if st.name == cut.sizes.head and st.category not in ("parameter", "gradient")]
        return whole[0] / self.t if whole else sympy.Integer(0)

    def terms(self, held: Any, cut: Any, s: int) -> list[tuple[int, sympy.Expr, int]]:
        """The moment's bytes beyond the rank's storages alive (:meth:`snapshot`), as
        :meth:`~symmem.passes.tensor_pipeline._TensorReplay.moment` makes each of its appends: (the layer, the
        bytes, how many)."""
        key, mode, head, fix, accumulated, fix_first, call, alive = held
        layer = iteration(key[2]) if key and key[2] else 0
        extra = self._collective(cut, key) if key else None
        out = [(layer, extra, 1)] if extra is not None else []  # the collective's transient (live holds it)

        def storages(sids: Any, count: int) -> list[tuple[int, sympy.Expr, int]]:
            return [(iteration(cut.tl.storages[sid].name), cut.sizes.local(sid), count) for _, sid in sids]

        if fix is not None:  # the head's backward: the rank's copy of the logits' gradient
            before, gone = fix
            out.append((0, self._logits_grad(cut), 1))
            if fix_first and call == 0:  # beside the whole gradient, before the op's gradients are made
                return out + storages(alive - before, -1)
            out += storages(gone, -1)  # the whole gradient let go
            call -= 1 if fix_first else 0
        if mode.startswith("op") and call == 0:  # the weight gradient's mm: the all-reduce not yet made
            if extra is not None:
                out.append((layer, extra, -1))
            if head:
                out.append((0, self._logits_grad(cut), 1))
        elif mode == "accumulate":
            out += storages(accumulated, -1)
        return out

    # what the stage holds at rest and in the optimizer step: the local shards (passes/tensor_pipeline.stage_at)
    def _side(self, memory: Any, s: int) -> tuple[sympy.Expr, ...]:
        key = ("side", s)
        if key not in self.__dict__:
            from .model_parallel import _Cut

            step = self.step
            cut = _Cut(step.graph, step.conv, step.options, step.regime, self.named, step._memo())
            g, stored = cut.g, cut.memo.get(("stored", cut.per * cut.p))
            if stored is None:
                from .data_parallel import stored_shapes
                from .parameters import in_registration_order, program_parameters

                stored = stored_shapes(g, in_registration_order(g, program_parameters(g)))
            per = _symbol("L") / _symbol("p")
            first = s * cut.per + 1  # the stage's first layer: its parameters stand for every layer's
            before: list[tuple[sympy.Expr, ...]] = []
            layer: list[tuple[sympy.Expr, ...]] = []
            after: list[tuple[sympy.Expr, ...]] = []
            weights, grads, state = [], [], []
            for name, shape in stored.items():
                owner = name if name in g and g.node(name).kind == "parameter" else name.rsplit(".", 1)[0]
                k = iteration(owner)
                if cut.stage_of(owner) != s or (k and k != first):
                    continue
                whole = numel(shape) * 4
                local = whole / self.t if len(shape) >= 2 else whole
                count = per if k else 1
                (layer if k else after if layer else before).append((local / 4,))
                weights.append(count * local)
                grads.append(count * (whole if owner in g and g.node(owner).kind == "embedding" else local))
                state += [count * 2 * local, count * 4]
            self.__dict__[key] = (sympy.Add(*weights), sympy.Add(*grads), sympy.Add(*state),
                                  lambda: _step_temporaries(step.regime, before, layer, after, per, "for-loop"))
        return self.__dict__[key]


@functools.cache
def _watched(base: type) -> type:
    """:class:`~symmem.passes.tensor_pipeline._TensorReplay` that notes, before each op, what its moments add
    beyond the storages alive (:meth:`TensorFormulas.terms` reads the note); ``base``: it or a subclass of it (the
    3-D mesh's :class:`~symmem.passes.fsdp_tensor_pipeline._MeshReplay`)."""

    class _Watched(base):  # type: ignore[misc,valid-type]
        note: tuple[Any, ...] = (None, "", False, None, frozenset())
        fix_first, call = False, 0

        def before(self, kind: str, node: str | None, mb: int) -> None:
            # what is alive before the op's births, where the head's backward makes its moment of them
            alive = frozenset(self.alive) if kind == "B" and node == self.tcut.sizes.head else frozenset()
            super().before(kind, node, mb)
            key = (self.pass_, kind, node) if self.extra else None
            _, born, dying = self._ops[self._at]
            accumulated: frozenset[Any] = frozenset()
            if self.mode == "accumulate":
                grads = {sid for sid, _, _ in self._ops[self._at - 1][1]}
                accumulated = frozenset((mb, sid) for sid in dying if sid in grads and (mb, sid) in self.alive)
            fix = None
            if self.fix is not None:
                gone = frozenset((mb, sid) for sid in dying if (mb, sid) in self.alive
                                 and self.cut.tl.storages[sid].category == "activation_grad")
                fix = (alive, gone)
            self.note = (key, self.mode, self.head_backward, fix, accumulated)

        def moment(self, live: int, node: str | None, mb: int | None) -> None:
            self.fix_first, self.call = self.fix is not None and self.fix[0] is not None, 0
            super().moment(live, node, mb)

        def after(self, kind: str, node: str | None, mb: int) -> None:
            super().after(kind, node, mb)
            self.note = (None, "", False, None, frozenset())

    return _Watched


class MeshFormulas(FsdpFormulas):
    """:class:`~symmem.passes.pipeline_formula.StageFormulas`' ``engine`` for torchtitan's 3-D mesh (FSDP x TP x
    PP, :mod:`.fsdp_tensor_pipeline`): FSDP2's storages (:class:`FsdpFormulas`) at the 2-D shards' sizes (a
    parameter's tensor-parallel shape, its first dimension padded to a multiple of ``N``: ``ceiling(V/(N*t))``-like)
    around the tensor-parallel rank's storages and collectives (:class:`TensorFormulas`)."""

    def __init__(self, step: Any, named: Mapping[str, int], kit: Kit) -> None:
        super().__init__(step, named, kit)
        self.tensor = TensorFormulas(step, named, kit)

    def replay(self, s: int, numbers: Sequence[Mapping[str, int]], packed: bool) -> Any:
        from .model_parallel import memory_of

        step, kit = self.step, self.kit
        cut, cuts = _cuts(step, numbers, packed)
        world = step._world(self.named)
        memory = memory_of(step._stages(), s, cut.p)
        tcuts = [kit.cut(n) for n in numbers]  # type: ignore[misc]
        units = [kit.units(c, s, world, step.rank) for c in tcuts]  # type: ignore[misc]
        ats = [kit.stage_at(memory, n, u, step.regime, c.per) for n, u, c in zip(numbers, units, tcuts, strict=True)]
        watched = _watched(kit.replay)
        if cut is cuts[0]:
            return watched(tcuts[0], s, ats[0], step.schedule, step.micro_batches, units[0], step.reshard)
        alike = copy.copy(units[0])
        alike.params = [dataclasses.replace(p, shard=pack_alike(p.shard)) for p in units[0].params]
        return watched(kit.packed(cut, tcuts), s, pack_parts(ats), step.schedule,  # type: ignore[misc]
                       step.micro_batches, alike, step.reshard)

    def again(self, made: tuple[Any, ...], s: int) -> Any:
        cut, at, units, events, known = made
        step = self.step
        replay = _watched(self.kit.replay)(cut, s, at, step.schedule, step.micro_batches, units, step.reshard)
        replay._events, replay._known = events, known
        return replay

    def snapshot(self, replay: Any) -> tuple[Any, ...]:
        return (super().snapshot(replay), self.tensor.snapshot(replay))

    def tick(self, replay: Any) -> None:
        self.tensor.tick(replay)

    def size(self, cut: Any, sid: int) -> sympy.Expr:
        return cut.sizes.local(sid)

    def terms(self, held: Any, cut: Any, s: int) -> list[tuple[int, sympy.Expr, int]]:
        fsdp, tensor = held
        return super().terms(fsdp, cut, s) + self.tensor.terms(tensor, cut, s)

    def _shapes_of(self, cut: Any, s: int) -> dict[str, tuple[sympy.Expr, ...]]:
        """Each parameter at its tensor-parallel rank's shape (:func:`~symmem.passes.fsdp_tensor_pipeline._tp_shape`),
        the one FSDP pads and splits."""
        if s not in self._shapes:
            g, tp_shape = cut.g, self.kit.tp_shape
            whole = super()._shapes_of(cut, s)
            owner = {name: name if name in g and g.node(name).kind == "parameter" else name.rsplit(".", 1)[0]
                     for name in whole}
            self._shapes[s] = {name: tp_shape(cut, owner[name], shape)  # type: ignore[misc]
                               for name, shape in whole.items()}
        return self._shapes[s]
