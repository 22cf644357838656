"""FSDP2's buffers placed in a traced module's recorded step (``--data-parallel fsdp|fsdp-no-reshard``), and the
parameters of a recorded step as the engines see them.

:class:`FsdpRewrite` places the events of :class:`symmem.passes.data_parallel.Fsdp` at the recorded ops of each unit
(its first and last op in forward and backward): each parameter stored as its padded dim-0 shard (``ceil(d0/N)``
rows), the all-gather outputs and unsharded parameters of the root and the running block, the prefetch in backward,
the unsharded gradients until the block's post-backward, the reduce-scatter input and the sharded gradients, and
AdamW's state following the rank's unpadded rows.  :mod:`.traced_fsdp1` changes what FSDP1 does differently.

>>> within("blocks.1.up", "blocks.1"), within("blocks.10", "blocks.1")
(True, False)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy

from ..errors import SymmemError
from ..passes.data_parallel import SHARDED, held_shape, shard_rows
from ..passes.fsdp1 import FSDP1
from ..symbols import N
from .recording import LiveStorage, StepOp, StepRecord


@dataclass(frozen=True)
class Param:
    """One parameter of the recorded module: its storage, name, shape and bytes per element."""

    sid: int
    name: str
    shape: tuple[int, ...]
    itemsize: int
    trains: bool = True

    @property
    def nbytes(self) -> sympy.Expr:
        return sympy.Integer(int(sympy.Mul(*self.shape)) * self.itemsize)


def parameters_of(rec: StepRecord, module: Any, repeat: tuple[str, tuple[str, ...]] | None,
                  untie: tuple[tuple[str, ...], ...] = ()) -> list[Param]:
    """The parameters in the order the step registered them (``named_parameters()`` of the module as recorded, its
    repeated blocks written out as many times), each with its storage; with ``untie`` (``StepOptions.untie``), each
    untied group's first name a parameter of its own (as :func:`~.fake.fake_state` registers them)."""
    import contextlib

    from .wrap import with_layers

    ctx = with_layers(module, repeat[0], repeat[1], rec.count) if repeat is not None and rec.count else \
        contextlib.nullcontext()
    own = {group[0] for group in untie}
    with ctx:
        seen: set[int] = set()
        named = []
        for n, p in module.named_parameters(remove_duplicate=False):
            if id(p) in seen and n not in own:
                continue
            seen.add(id(p))
            named.append((n, tuple(int(d) for d in p.shape), p.element_size(), p.requires_grad))
    sids = [i for i in rec.start if rec.storages[i].category == "parameter"]
    if len(sids) != len(named):
        raise SymmemError(f"the recorded step holds {len(sids)} parameter storages for {len(named)} parameters "
                          "(parameters sharing a storage): the engine's shards cannot be followed")
    return [Param(sid, *about) for sid, about in zip(sids, named, strict=True)]


def scaled(s: LiveStorage, nbytes: Any) -> LiveStorage:
    return dataclasses.replace(s, nbytes=nbytes)


def grads_made(rec: StepRecord) -> list[int]:
    return [s.sid for s in rec.storages if s.category == "gradient" and s.phase != "start"]


def without_frees(ops: Sequence[StepOp], gone: set[int]) -> list[StepOp]:
    """The ops with the storages in ``gone`` no longer freed."""
    return [dataclasses.replace(o, freed=tuple(i for i in o.freed if i not in gone)) for o in ops]


def within(path: str, unit: str) -> bool:
    return path == unit or path.startswith(unit + ".")


@dataclass
class FsdpRewrite:
    """FSDP2's buffers placed in a recorded step (the events of :class:`symmem.passes.data_parallel.Fsdp`)."""

    rec: StepRecord
    params: list[Param]
    kind: str
    rank: int
    loss_inside: bool
    storages: list[LiveStorage] = field(default_factory=list)
    #: under tensor parallelism a sharded parameter's gradient may come back whole (DTensor replicates the
    #: embedding's): a unit's gradients then hold more bytes than its parameters' local shards, and FSDP
    #: reduce-scatters the local chunk, a view of it (importer/traced_fsdp_tensor.py)
    larger_grads: bool = False
    ops: list[StepOp] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reshard = {**SHARDED, **FSDP1}[self.kind]  # whether a unit's parameters go after its forward
        self.units: list[str | None] = [*(self.rec.layers or {})]
        self.unit_params: dict[str | None, list[Param]] = {u: [] for u in [None, *self.units]}
        for p in self.params:
            self.unit_params[next((u for u in self.units if within(p.name, u)), None)].append(p)
        self.units = [u for u in self.units if self.unit_params[u]]
        self.shard = {p.name: shard_rows(p.shape, N) * sympy.Mul(*p.shape[1:]) * p.itemsize for p in self.params}
        self.total = {u: sympy.Add(*(self.shard[p.name] for p in ps)) for u, ps in self.unit_params.items()}
        self.storages = list(self.rec.storages)
        self.gathered: dict[str | None, int] = {}
        self.unsharded: dict[str | None, list[int]] = {}
        self.started: set[str | None] = set()
        self.reduce_in: int | None = None
        self.sharded_grads: list[int] = []

    def unit_of(self, module: str) -> str | None:
        return next((u for u in self.units if within(module, u)), None)

    # -- building blocks ---------------------------------------------------------------------------------------
    def new(self, name: str, category: str, nbytes: Any, phase: str) -> int:
        sid = len(self.storages)
        self.storages.append(LiveStorage(sid, nbytes, category, "float32", "fsdp", name, name, 1, phase))
        return sid

    def event(self, phase: str, unit: str | None, op: str, born: Sequence[int] = (), freed: Sequence[int] = ()
              ) -> None:
        place = unit or ""
        self.ops.append(StepOp(0, 1, phase, op, place, place, tuple(born), tuple(freed)))

    def gather(self, unit: str | None, phase: str, with_params: bool = True) -> None:
        born = []
        if unit not in self.gathered:
            self.gathered[unit] = self.new(f"fsdp.all_gather[{unit or 'root'}]", "temporary",
                                           N * self.total[unit], phase)
            born.append(self.gathered[unit])
        if with_params and unit not in self.unsharded:
            self.unsharded[unit] = [self.new(f"{p.name}.unsharded", "parameter", N * self.shard[p.name], phase)
                                    for p in self.unit_params[unit]]
            born += self.unsharded[unit]
        self.event(phase, unit, "fsdp.all_gather", born)

    def free_gather(self, unit: str | None, phase: str, at: str | None) -> None:
        if unit in self.gathered:
            self.event(phase, at, "fsdp.all_gather_done", freed=[self.gathered.pop(unit)])

    def reshard_unit(self, unit: str | None, phase: str) -> None:
        if unit in self.unsharded:
            self.event(phase, unit, "fsdp.reshard", freed=self.unsharded.pop(unit))

    # -- the phases ----------------------------------------------------------------------------------------------
    def rewrite(self) -> StepRecord:
        """The record with FSDP's events around each unit's first and last op in forward and backward (the order
        :class:`symmem.passes.data_parallel.Fsdp` walks a built graph in), its weights sharded and its optimizer
        state the rank's."""
        rec = self.rec
        grads = set(grads_made(rec))
        ops = without_frees(rec.ops, grads)
        forward = [k for k, o in enumerate(ops) if o.phase == "forward"]
        backward = [k for k, o in enumerate(ops) if o.phase == "backward"]
        if not forward or not backward:
            raise SymmemError("the recorded step has no forward or no backward op: FSDP's hooks cannot be placed")
        first_fwd = {u: next(k for k in forward if within(ops[k].module, u)) for u in self.units
                     if any(within(ops[k].module, u) for k in forward)}
        last_fwd = {next(k for k in reversed(forward) if within(ops[k].module, u)): u for u in first_fwd}
        first_fwd_at = {k: u for u, k in first_fwd.items()}
        self.grad_unit = self._grad_units(grads)
        first_bwd, last_bwd = self._backward_marks(ops, backward)
        root_pre = self._root_pre_backward(ops, forward, backward)
        moved = self._after_backward(ops, backward)
        zero_at = next((k for k, o in enumerate(rec.ops) if grads & set(o.freed)), len(rec.ops) - 1)
        for k, o in enumerate(ops):
            if k == forward[0] and self.unit_params[None]:
                self.gather(None, "forward")
            if k in first_fwd_at:
                before = list(self.gathered)
                self.gather(first_fwd_at[k], "forward")
                for u in before:
                    self.free_gather(u, "forward", first_fwd_at[k])
            if k == root_pre:
                self.pre_backward(None)
            if k in first_bwd:
                self.pre_backward(first_bwd[k])
            if k == backward[-1]:
                o = dataclasses.replace(o, freed=tuple(i for i in o.freed if i not in moved))
            if k == zero_at:
                o = dataclasses.replace(o, freed=o.freed + tuple(self.sharded_grads))
            self.ops.append(o)
            for g in (g for g in o.born if g in self.wholes):  # DTensor's whole gradient: the rank's rows cloned
                at = self.rec.storages[g].module or "root"
                rows = self.new(f"{at}.grad_rows", "gradient", self.wholes[g], "backward")
                self.event("backward", o.module, "fsdp.gradient_rows", born=[rows], freed=[g])
                self.grad_unit[rows] = self.grad_unit.pop(g)
            if k in last_fwd and self.reshard:
                self.reshard_unit(last_fwd[k], "forward")
            if k == forward[-1]:
                if self.reshard:
                    self.reshard_unit(None, "forward")
                for u in list(self.gathered):
                    self.free_gather(u, "forward", None)
            if k in last_bwd:
                last = self.post_backward(last_bwd[k])
                self.event("backward", last_bwd[k], "fsdp.post_backward_done", freed=last)
            if k == backward[-1]:
                self.pre_backward(None)
                last = self.post_backward(None)
                ended = ([self.reduce_in] if self.reduce_in is not None else []) + last
                self.event("backward", None, "fsdp.root_post_backward_done", freed=[*ended, *moved])
        self._check()
        ops = tuple(dataclasses.replace(o, index=i) for i, o in enumerate(self.ops))
        return dataclasses.replace(rec, storages=tuple(self._stepped()), ops=ops)

    def _grad_units(self, grads: set[int]) -> dict[int, str | None]:
        """Each ``.grad`` storage's unit: the block whose backward made it (else the root); checked against the
        bytes of the unit's parameters."""
        found = {g: self.unit_of(self.rec.storages[g].module) for g in sorted(grads)}
        self.wholes: dict[int, Any] = {}
        for u, ps in self.unit_params.items():
            have = sympy.Add(*(self.rec.storages[g].nbytes for g, x in found.items() if x == u))
            want = sympy.Add(*(p.nbytes for p in ps))
            over = sympy.expand(have - want)
            if over != 0 and self.larger_grads:
                self._pair_wholes([g for g, x in found.items() if x == u], ps)
                continue
            if over != 0:
                raise SymmemError(f"FSDP's unit {u or 'root'}: the gradients its backward made ({have} bytes) are "
                                  f"not its parameters' ({want}): the recorded backward cannot be split by unit")
        return found

    def _pair_wholes(self, mine: list[int], params: list[Param]) -> None:
        """The gradients of ``mine`` that come back whole (no parameter of theirs has their bytes), each paired with
        the one parameter left without a gradient of its bytes: FSDP clones its rows from the whole gradient, which
        then goes (measured: the embedding's under tensor parallelism)."""
        left = [p.nbytes for p in params]
        extra = []
        for g in mine:
            size = sympy.sympify(self.rec.storages[g].nbytes, strict=True)
            if size in left:
                left.remove(size)
            else:
                extra.append(g)
        if len(extra) != len(left) or any(not (sympy.sympify(self.rec.storages[g].nbytes, strict=True) > rows)
                                          for g, rows in zip(extra, left, strict=True)):
            raise SymmemError(f"FSDP's unit: {len(extra)} gradients whose bytes are no parameter's local shard's "
                              f"for {len(left)} parameters: the recorded backward cannot be split by unit")
        self.wholes.update(zip(extra, left, strict=True))

    def _backward_marks(self, ops: list[StepOp], backward: list[int]) -> tuple[dict[int, Any], dict[int, Any]]:
        """Each block's first and last backward op (its pre- and post-backward hooks around them)."""
        first: dict[int, Any] = {}
        last: dict[int, Any] = {}
        for u in self.units:
            mine = [k for k in backward if within(ops[k].module, u)]
            if not mine:
                raise SymmemError(f"FSDP's unit {u}: no recorded backward op ran in it")
            first[mine[0]] = u
            last[mine[-1]] = u
        return first, last

    def _root_pre_backward(self, ops: list[StepOp], forward: list[int], backward: list[int]) -> int:
        """The op before which the root's pre-backward runs: when the module's output has its gradient -- the first
        backward op (the module returns its loss), else the first made inside a submodule.  Where the module's
        output is made by the root's own code, the loss's backward and the root's look alike: refused."""
        if self.loss_inside:
            return backward[0]
        if not ops[forward[-1]].module:
            raise SymmemError("FSDP's root pre-backward follows the module's output gradient, and this module's output "
                              "is made in its own forward (not a submodule's): the recorded backward cannot tell the "
                              "loss's ops from the module's")
        return next(k for k in backward if ops[k].module)

    def _after_backward(self, ops: list[StepOp], backward: list[int]) -> set[int]:
        """What ``backward()`` still holds when FSDP's final callback runs: the loss and the output the loop holds,
        and the engine's seed gradient (made by its first op); freed after the root's post-backward."""
        seed = set(ops[backward[0]].born)
        return {i for i in ops[backward[-1]].freed if self.rec.storages[i].category == "output" or i in seed}

    def pre_backward(self, unit: str | None) -> None:
        if unit in self.started or not self.unit_params[unit]:
            return
        self.started.add(unit)
        if unit not in self.unsharded:
            self.gather(unit, "backward")
            self.free_gather(unit, "backward", unit)
        order = self.units[::-1]
        i = order.index(unit) + 1 if unit is not None else 0
        nxt = order[i] if i < len(order) else None
        if nxt is not None and nxt not in self.unsharded and nxt not in self.gathered:
            self.gather(nxt, "backward", with_params=False)

    def post_backward(self, unit: str | None) -> list[int]:
        """Reshard, reduce-scatter and the sharded gradients; gives the last parameter's gradient, freed after."""
        if not self.unit_params[unit]:
            return []
        self.reshard_unit(unit, "backward")
        if self.reduce_in is not None:
            self.event("backward", unit, "fsdp.reduce_scatter_done", freed=[self.reduce_in])
        self.reduce_in = self.new(f"fsdp.reduce_scatter_input[{unit or 'root'}]", "temporary",
                                  N * self.total[unit], "backward")
        self.event("backward", unit, "fsdp.reduce_scatter", born=[self.reduce_in])
        mine = [g for g, u in self.grad_unit.items() if u == unit]
        last = self._last_grad(unit, mine)
        self.event("backward", unit, "fsdp.free_unsharded_grads", freed=[g for g in mine if g != last])
        g = self.new(f"fsdp.sharded_grads[{unit or 'root'}]", "gradient", self.total[unit], "backward")
        self.sharded_grads.append(g)
        self.event("backward", unit, "fsdp.sharded_grads", born=[g])
        return [last] if last is not None else []

    def _last_grad(self, unit: str | None, mine: list[int]) -> int | None:
        """The gradient FSDP's loop variable still holds after the reduce-scatter: its last parameter's (any of that
        size: the bytes are what count)."""
        if not mine:
            return None
        want = self.unit_params[unit][-1].nbytes
        return next((g for g in mine if sympy.expand(self.rec.storages[g].nbytes - want) == 0), mine[-1])

    def _check(self) -> None:
        """Every unit with parameters had its pre-backward placed (else its gathers would be missing)."""
        if len(self.started) != len([u for u in [None, *self.units] if self.unit_params[u]]):
            raise SymmemError("FSDP's pre-backward hooks could not all be placed in the recorded backward")

    def _stepped(self) -> list[LiveStorage]:
        """Weights as their padded shards; the optimizer's state and temporaries after the rank's unpadded rows."""
        out = self.storages
        by_name = {p.name: p for p in self.params}
        for p in self.params:
            out[p.sid] = scaled(out[p.sid], self.shard[p.name])
        # what the optimizer makes belongs to the parameter its op ran for (the op's where)
        made_for = {i: o.where for o in self.rec.ops if o.phase == "step" for i in o.born}
        held: dict[str, Any] = {}
        for i, where in made_for.items():
            p = by_name.get(where)
            if p is not None and sympy.sympify(out[i].nbytes, strict=True) == p.nbytes:  # recorded bytes: numbers
                if p.name not in held:
                    shape = held_shape(p.shape, N, self.rank)
                    held[p.name] = sympy.Mul(*shape) * p.itemsize if shape else p.nbytes
                out[i] = scaled(out[i], held[p.name])
        return out
