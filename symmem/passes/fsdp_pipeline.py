"""FSDP x pipeline: FSDP2's ``fully_shard`` on every pipeline stage of a p x N mesh, per stage and rank.

The engine is torchtitan's recipe (:mod:`symmem.record.fsdp_pipeline_runs`): ``init_device_mesh(device, (p, N),
mesh_dim_names=("pp", "dp"))``, each stage's module (the embedding on the first stage, the final norm and the head
on the last, ``L/p`` layers each) gets ``fully_shard`` on each of its layers and on the stage root over
``mesh["dp"]``, then ``PipelineStage`` and ``ScheduleGPipe`` / ``Schedule1F1B`` run ``M`` micro-batches.  What
torch 2.13 does (``torch/distributed/pipelining/stage.py``), and what a stage holds beyond the pipeline's replay
(:class:`~symmem.passes.model_parallel._Replay`, the single-device step cut by stage):

* **between steps** -- the padded shards of the stage's parameters (dim 0 padded to a multiple of N, split
  evenly), AdamW's two moments of the *unpadded* rows a rank holds and a 4-byte ``step`` per parameter
  (:func:`~symmem.passes.data_parallel.held_shape`: the last ranks of a group hold fewer), the receive buffers, the
  last stage's logits;
* **forward** -- each unit's pre-forward all-gathers it (the all-gather output and the unsharded parameters) unless
  it is unsharded already, and frees the unit before's all-gather output; its post-forward frees the unsharded
  parameters under ``reshard_after_forward`` (``fsdp``; ``fsdp-no-reshard`` keeps them); the stage root's
  post-forward, before the loss, frees the last all-gather output;
* **backward** -- ``backward_maybe_with_nosync`` turns off FSDP's gradient sync and its reshard after backward for
  every micro-batch: a unit's pre-backward all-gathers it where a forward resharded it, prefetches the next unit's
  all-gather output, and nothing is freed or reduced; the unsharded gradients accumulate across micro-batches as
  one device's do (the replay's);
* **after the last backward** -- ``perform_reduce_grad`` runs every unit's post-backward, the stage root first, then
  the layers in order: the unsharded parameters freed, the previous reduce-scatter input freed and the unit's
  made, the unit's unsharded gradients freed and its sharded gradients made; the final callback frees the last
  reduce-scatter input;
* **the optimizer step** -- for-loop AdamW on the held rows (every sharded gradient, one parameter's ``sqrt`` and
  ``denom`` beside the previous one's).

Data-parallel rank 0 of each stage holds whole shards, the most; every rank's peak is
:meth:`FsdpPipelineStep.rank_peaks` (rank ``s*N + r`` is stage ``s``'s data-parallel rank ``r``).

>>> from symmem import derive
>>> d = derive("llama", data_parallel="fsdp-no-reshard", pipeline_parallel=True, pipeline_schedule="gpipe",
...            micro_batches=2, loss="cross-entropy", attention="sdpa", device="cpu",
...            values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 63, "F": 64, "p": 2, "N": 2})
>>> d.value("peak"), d.peak_at().where(step=False)  # the engine's, tests/test_fsdp_pipeline.py
(330780, 'rank 2 (stage 1 of 2, data-parallel rank 0 of N = 2): pipeline layers.mlp.gate_up (layer 2), micro-batch 0')
>>> d.step.rank_peaks(d)  # {rank: (first step, steady)}; V = 63 rows: rank 1 of each stage holds 31 of 32
{0: (252320, 297672), 1: (252320, 297416), 2: (285296, 330780), 3: (285296, 330524)}
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError
from ..shapes import numel
from ..training import Regime
from .model_parallel import _Cut, _integer, _ops, _Replay, _step_temporaries, memory_of
from .pipeline_step import BATCH, PipelineStep, StageMoment
from .stretch import _renamed
from .unroll import iteration  # here, not in the hooks: they run at every op of every micro-batch


def refusal(model_name: str, regime: Regime, device: str, engine: str = "FSDP") -> str | None:
    """Why the ``engine`` x pipeline peak (FSDP's; :mod:`.ddp_pipeline`'s DDP) is not modelled for this derivation
    (None: it is): what was measured.  Both engines were measured on an H200 too (benchmarks/check_cuda_parallel.py
    ``--mesh`` and ``--mesh-fsdp``, four ranks on the GPU: tests/test_cuda_pipeline_measured.py,
    tests/test_cuda_mesh_fsdp_measured.py): FSDP2 with CUDA's default foreach AdamW, exact once gloo's device
    temporaries inside the collectives and FSDP2's copy-out metadata are left out (allocator histories)."""
    if regime.precision != "fp32" or regime.optimizer not in ("adam", "adamw") or regime.optimizer_impl not in (
            "auto", "for-loop"):
        return f"the {engine} x pipeline peak is modelled for FP32 Adam/AdamW's for-loop step, as measured"
    if model_name not in ("gpt2", "llama"):
        return f"the {engine} x pipeline peak is measured for the gpt2 and llama references, not {model_name!r}"
    return None


@dataclass(frozen=True)
class _Param:
    name: str
    unit: int | None        # the layer (1-based iteration), or None: the stage root
    shard: int              # elements of the rank's padded shard
    held: tuple[int, ...]   # the unpadded rows the rank holds (what AdamW's state follows)
    grad: str               # the name of its gradient's storage in the single-device step


class _Units:
    """FSDP2's units of one stage at numbers: the stage root's parameters (embedding, final norm, head) and each
    layer's, in the order ``module.parameters()`` lists them, with their shards on data-parallel rank ``rank``."""

    def __init__(self, cut: Any, s: int, world: int, rank: int) -> None:
        from .data_parallel import held_shape, shard_rows

        key = ("stored", cut.per * cut.p)  # the unrolled graph's parameters (at L layers): alike on every stage, rank
        if key not in cut.memo:
            cut.memo[key] = stored_at(cut)
        stored = dict(cut.memo[key])
        # the tied heads, found once for every stage and batch (outside the layers: the template's are the graph's)
        g = _template(cut)
        tied = ("tied heads", cut.per * cut.p)
        if tied not in cut.memo:
            cut.memo[tied] = [n for n in g.program_order() if g.node(n).kind == "linear" and
                              g.node(n).attrs.get("tied")]
        heads = cut.memo[tied]
        if heads and s == cut.p - 1:  # the last stage's own copy of a tied embedding (nn.Linear: (V, H))
            node = g.node(heads[0])
            stored[f"{heads[0]}.weight"] = (node.attrs["out_features"], _node(cut, node.inputs[0]).out.shape[-1])
        self.params: list[_Param] = []
        # each dimension at the cut's numbers once (every layer's parameters have the same few: half of the units'
        # making was sympy's substitution of the same dimension again)
        sized: dict[Any, int] = cut.__dict__.setdefault("dims", {})
        entries = owners(cut, key)
        if heads and s == cut.p - 1:  # the tied copy in its place among them (where the graph stores it) or last
            tied_name = f"{heads[0]}.weight"
            found = _node(cut, tied_name)
            owner = tied_name if found is not None and found.kind == "parameter" else heads[0]
            copy_ = (tied_name, stored[tied_name], owner, cut.stage_of(owner))
            entries = ([copy_ if e[0] == tied_name else e for e in entries] if tied_name in cut.memo[key] else
                       [*entries, copy_])
        for name, shape, owner in [(name, shape, owner) for name, shape, owner, at in entries if at == s]:
            for d in shape:
                if d not in sized:
                    sized[d] = _integer(d, cut.subs, name)
            dims = tuple(sized[d] for d in shape)
            rows = shard_rows(dims, world) if dims else 1
            shard = int(rows) * int(numel(dims[1:])) if dims else 1
            held = tuple(int(x) for x in held_shape(dims, world, rank))
            grad = f"{name}.grad" if owner not in heads else (
                cut._sim.gradient_of(owner) if hasattr(cut, "_sim") else
                next((st.name for st in cut.tl.storages if st.category == "gradient" and st.node == owner), ""))
            self.params.append(_Param(name, iteration(owner) or None, shard, held, grad))
        self._arrange(world)

    def _arrange(self, world: int) -> None:
        """The units in FSDP's order over ``self.params``: the root first, then the layers."""
        self.world = world
        self.order: list[int | None] = list(dict.fromkeys(p.unit for p in self.params))
        if None in self.order:  # the root's pre-forward runs first, its post-backward first in the reduce
            self.order = [None, *(u for u in self.order if u is not None)]
        self.layers = [u for u in self.order if u is not None]

    def of(self, unit: int | None) -> list[_Param]:
        return [p for p in self.params if p.unit == unit]

    def gather_bytes(self, unit: int | None) -> int:
        """The all-gather output (and the reduce-scatter input): N shards of the unit."""
        return self.world * self.shard_bytes(unit)

    def shard_bytes(self, unit: int | None) -> int:
        return sum(p.shard for p in self.of(unit)) * 4

    def at_rest(self) -> tuple[int, int]:
        """(the shards' bytes, AdamW's state: two moments of the held rows and a step per parameter); worked out
        once for these params (the peak's three batches share the units; a copy with other params its own)."""
        found = self.__dict__.get("_at_rest")
        if found is None or found[0] is not self.params:
            params = self.params
            # (the held rows are ints: their product in Python, sympy's Mul of ints is the same integer)
            found = self._at_rest = (params, (sum([p.shard for p in params]) * 4,
                                              sum([2 * (math.prod(p.held) if _ints(p.held) else int(numel(p.held)))
                                                   * 4 + 4 for p in params])))
        return found[1]


def _template(cut: Any) -> Any:
    """The graph a cut's nodes are read from: its template (``cut.small``, the layers alike: :class:`_Cut`), or the
    graph at all ``L`` layers where the cut has none."""
    return cut.small if isinstance(cut, _Cut) else cut.g


def _node(cut: Any, name: str) -> Any:
    """Node ``name`` of the graph at ``L`` layers (None where it has none), read from the template: a layer's node
    as its first layer's (the layers are alike, as :meth:`_Cut._stage_of` reads them).  Unrolling the graph to
    Llama-2-7B's 32 layers for its nodes was a thirtieth of an FSDP x pipeline peak's calls."""
    if not isinstance(cut, _Cut):
        return cut.g.node(name) if name in cut.g else None
    k = iteration(name)
    if k:
        if k > cut.layers:
            return None
        name = _renamed(name, 1)
    return cut.small.node(name) if name in cut.small else None


def stored_at(cut: Any) -> dict[str, tuple[Any, ...]]:
    """Each parameter the step at ``L`` layers stores and its shape, in registration order
    (:func:`~symmem.passes.data_parallel.stored_shapes`), written from the template's where its layers' parameters
    are one run of alike layers (layer ``k``'s are the first layer's renamed, in the same places); else from the
    graph unrolled to ``L`` layers, as before (the same entries: the template is that graph's first layers)."""
    from .data_parallel import stored_shapes
    from .parameters import in_registration_order, program_parameters

    def listed(g: Any) -> dict[str, tuple[Any, ...]]:
        return stored_shapes(g, in_registration_order(g, program_parameters(g)))

    if not isinstance(cut, _Cut):
        return listed(cut.g)
    small = listed(cut.small)
    layers = max((iteration(n) for n in small), default=0)
    if layers == cut.layers:
        return small  # the template is the whole graph (L <= 6)
    items = list(small.items())
    at = [k for k, (n, _) in enumerate(items) if iteration(n)]
    first = [(n, shape) for n, shape in items if iteration(n) == 1]
    # the layers' parameters one run (no parameter outside them between), each layer the first's renamed
    if not at or at != list(range(at[0], at[0] + len(at))) or len(at) != layers * len(first) or any(
            items[at[0] + j * len(first) + i] != (_renamed(n, j + 1), shape)
            for j in range(layers) for i, (n, shape) in enumerate(first)):
        return listed(cut.g)
    out = dict(items[:at[0]])
    for j in range(1, cut.layers + 1):
        out.update((_renamed(n, j), shape) for n, shape in first)
    out.update(items[at[-1] + 1:])
    return out


def owners(cut: Any, key: tuple[str, int]) -> list[tuple[str, Any, str, int]]:
    """Each parameter the step stores (``cut.memo[key]``: the unrolled graph's, in registration order): its name,
    shape, the node that owns it and that node's stage, found once for every stage, batch and rank (each stage's
    units walked every parameter of the graph at L layers for its own)."""
    found = cut.memo.get(("owners", key, cut.p, type(cut).stage_of))
    if found is None or found[0] is not cut.memo[key]:
        stored = cut.memo[key]
        out = []
        for name, shape in stored.items():
            node = _node(cut, name)
            owner = name if node is not None and node.kind == "parameter" else name.rsplit(".", 1)[0]
            out.append((name, shape, owner, cut.stage_of(owner)))
        found = cut.memo[("owners", key, cut.p, type(cut).stage_of)] = (stored, out)
    return found[1]


class _FsdpReplay(_Replay):
    """:class:`~symmem.passes.model_parallel._Replay` of one stage with FSDP2's units around its ops (the module's
    note); ``at`` is the stage's parts under FSDP."""

    def __init__(self, cut: Any, s: int, at: Mapping[str, int], schedule: str, m: int, units: _Units,
                 reshard: bool) -> None:
        super().__init__(cut, s, at, schedule, m)
        self.units, self.reshard = units, reshard
        self.held: dict[tuple[str, Any], int] = {}   # FSDP's storages alive: (kind, unit) -> bytes
        self.first_op: dict[int | None, str] = {}
        self.last_op: dict[int | None, str] = {}
        if self._layout() is not None:  # the stage's plan read from the template (passes/pipeline_layout.py)
            forward = [node for node, _, _ in self._plan(0, "F")]
        elif type(cut).on is _Cut.on:  # the stage's ops as its plans read them (sorted out once for every stage)
            forward = [e.node for _, e in _ops(cut, 0, "F")[s]]
        else:
            forward = [e.node for _, e in cut.passes[0]["F"] if cut.on(e.node, s)]
        for n in forward:
            u = self._unit(n)
            self.first_op.setdefault(u, n)
            self.last_op[u] = n
        model = [n for n in forward if n is not None and not self._in_loss(n)]
        self.root_end = model[-1] if model else None
        self.started: set[int | None] = set()
        self.opened = False
        # FSDP2's post-forward order over the step's forwards and each unit's places in it (its backward prefetch)
        self.post_forward: list[int | None] = []
        self.indices: dict[int | None, list[int]] = {}
        self._known: dict[str | None, tuple[int | None, bool, bool, bool, bool]] = {}  # _facts'
        self._pure = all(getattr(type(self), name) is getattr(_FsdpReplay, name)
                         for name in ("_unit", "_in_loss", "_is_first", "_is_last", "_is_root_end"))

    # what the cut's ops are (a traced module's cut says otherwise: importer/traced_fsdp_pipeline.py)
    def _unit(self, node: str | None) -> int | None:
        """The FSDP unit an op runs in: its layer (1-based), or None (the stage root)."""
        return iteration(node) or None if node is not None else None

    def _in_loss(self, node: str | None) -> bool:
        found = self.cut.__dict__.setdefault("in_loss", {})  # asked at every op of every micro-batch
        if node not in found:
            found[node] = node is None or getattr(_node(self.cut, node), "group", None) == "loss"
        return found[node]

    def _is_first(self, unit: int | None, node: str | None) -> bool:
        """Whether ``node`` is ``unit``'s first op in a forward (its pre-forward runs before it)."""
        return self.first_op.get(unit) == node

    def _is_last(self, unit: int | None, node: str | None) -> bool:
        return self.last_op.get(unit) == node

    def _is_root_end(self, node: str | None) -> bool:
        """Whether ``node`` is the stage's last op before the loss (the root's post-forward runs after it)."""
        return node == self.root_end

    # FSDP's storages
    def _make(self, key: tuple[str, Any], nbytes: int) -> None:
        if key not in self.held:
            self.held[key] = nbytes
            self.live += nbytes

    def _drop(self, key: tuple[str, Any]) -> None:
        self.live -= self.held.pop(key, 0)

    def _has(self, unit: int | None) -> bool:
        # asked by the hooks at every unit boundary of every segment walked: each unit's answer kept (units.of reads
        # every parameter of the stage)
        having = self.__dict__.setdefault("_having", {})
        if unit not in having:
            having[unit] = bool(self.units.of(unit))
        return having[unit]

    def _gather(self, unit: int | None, node: str | None, mb: int, with_params: bool = True) -> None:
        """The unit's all-gather output and (``with_params``) its unsharded parameters, unless it is unsharded; the
        moment named after the op it comes before (``node``: a backward's ends in ``'s backward``)."""
        if not self._has(unit) or ("P", unit) in self.held:
            return
        self._make(("A", unit), self.units.gather_bytes(unit))
        if with_params:
            for p in self.units.of(unit):
                self._make(("P", (unit, p.name)), self.units.world * p.shard * 4)
            self.held[("P", unit)] = 0
        self.moment(self.live, f"all-gather before {node}", mb)

    def _reshard(self, unit: int | None) -> None:
        if ("P", unit) in self.held:
            for p in self.units.of(unit):
                self._drop(("P", (unit, p.name)))
            self._drop(("P", unit))

    # what the hooks carry from one segment to the next (model_parallel._Replay._repeated: a segment begun alike is
    # its record moved): the storages FSDP holds, and in a backward the unit each unit's pre-backward prefetches
    def _hook_state(self, kind: str, mb: int) -> Any:
        if not self._pure:
            return None  # a traced module's replay counts the ops as they run: walked every time
        held = frozenset(self.held.items())
        if kind == "F":
            return held
        # which post-forward index each unit's pre-backward pops, and the unit before it there (its prefetch)
        targets = tuple((u, self.post_forward[self.indices[u][-1] - 1] if self.indices[u][-1] > 0 else "first")
                        for u in self.units.order if self.indices.get(u))
        return held, targets

    def _hook_mark(self) -> Any:
        return len(self.post_forward), {u: len(x) for u, x in self.indices.items()}

    def _hook_effect(self, mark: Any) -> Any:
        made, had = mark
        popped = tuple(u for u, n in had.items() if len(self.indices.get(u, ())) < n)
        return dict(self.held), tuple(self.post_forward[made:]), popped, self.opened, frozenset(self.started)

    def _hook_redo(self, effect: Any) -> None:
        held, forwards, popped, opened, started = effect
        self.held = dict(held)
        for u in popped:
            self.indices[u].pop()
        for u in forwards:
            self._post_forward(u)
        self.opened, self.started = opened, set(started)

    def _acting(self, pass_: int, kind: str) -> Any:
        cls = type(self)
        if cls.before is not _FsdpReplay.before or cls.after is not _FsdpReplay.after \
                or cls.moment is not _Replay.moment or not self._pure:
            return None  # a traced module's replay counts the ops as they run: every op
        return self._fsdp_acting(pass_, kind)

    def _fsdp_acting(self, pass_: int, kind: str) -> frozenset[int]:
        """:meth:`_acting` of FSDP's hooks (``begin`` empties what a segment opened and started): in a forward the
        first op (the root's pre-forward) and each unit's first and last op and the root's last; in a backward the
        first op of each unit and of each side of the loss (a pre-backward acts once a segment, at the first op
        that calls it: each of those calls comes from an op's unit and whether it is in the loss)."""
        found = self.__dict__.setdefault("_fsdp_acts", {})
        key = (pass_, kind)
        if key not in found:
            nodes = [node for node, _, _ in self._plan(pass_, kind)]
            if kind == "F":  # (first_op and last_op: each unit's, its unit the op's own)
                ends = {n for u, n in (*self.first_op.items(), *self.last_op.items()) if u is not None}
                ends.add(self.root_end)
                acts = {i for i, node in enumerate(nodes) if node in ends}
                acts.add(0)
            else:
                # an op's unit and whether it is in the loss (no more: _facts' rest is the forward's), by its
                # node, kept on the cut (every stage's replay, both passes: the same ops' names)
                units = self.cut.__dict__.setdefault("_fsdp_unit", {})
                losses, in_loss_of = self.cut.__dict__.setdefault("in_loss", {}), self._in_loss
                firsts: dict[tuple[int | None, bool], int] = {}
                for i, node in enumerate(nodes):
                    unit = units[node] if node in units else units.setdefault(node, iteration(node) or None
                                                                              if node is not None else None)
                    side = (unit, losses[node] if node in losses else in_loss_of(node))
                    if side not in firsts:
                        firsts[side] = i
                acts = set(firsts.values())
            found[key] = frozenset(acts)
        return found[key]

    # the hooks of the replay
    def begin(self, kind: str, mb: int) -> None:
        self.opened = False
        self.started = set()

    def _facts(self, node: str | None) -> tuple[int | None, bool, bool, bool, bool]:
        """``node``'s unit, whether in the loss, its unit's first op, its unit's last op, the root's last op: asked
        before and after every op of every micro-batch, worked out once an op where they are the op's alone (a
        traced module's replay counts the ops as they run: asked anew)."""
        found = self._known.get(node)
        if found is None:
            unit = self._unit(node)
            found = (unit, self._in_loss(node), unit is not None and self._is_first(unit, node),
                     unit is not None and self._is_last(unit, node), self._is_root_end(node))
            if self._pure:
                self._known[node] = found
        return found

    def before(self, kind: str, node: str | None, mb: int) -> None:
        unit, in_loss, first, _, _ = self._facts(node)
        if kind == "F":
            if not self.opened:  # the stage root's pre-forward
                self.opened = True
                self._gather(None, node, mb)
            if first:
                before = [k for k in self.held if k[0] == "A" and k[1] != unit]
                self._gather(unit, node, mb)
                for k in before:
                    self._drop(k)
            return
        last_stage = self.s == self.cut.p - 1
        if last_stage and not in_loss:
            self._pre_backward(None, node, mb)  # the root's output, the logits, has its gradient
        if unit is not None:
            self._pre_backward(unit, node, mb)
            if not last_stage and self.units.layers and unit == self.units.layers[-1]:
                # the stage's output is its last layer's and the root's: their hooks in the order registered
                self._pre_backward(None, node, mb)

    def _pre_backward(self, unit: int | None, op: str | None, mb: int) -> None:
        """FSDP2's pre-backward of ``unit`` before the backward of ``op``: all-gather it where it is sharded, then
        prefetch (all-gather output only) the unit whose post-forward came just before the one this backward pops
        (``post_forward_order``)."""
        if unit in self.started or not self._has(unit):
            return
        node = f"{op}'s backward"  # the moments' name (made here: most ops' backward starts no unit)
        self.started.add(unit)
        self._gather(unit, node, mb)
        self._drop(("A", unit))
        index = self.indices[unit].pop() if self.indices.get(unit) else None
        if index is not None and index > 0:
            target = self.post_forward[index - 1]
            if ("P", target) not in self.held and ("A", target) not in self.held:
                self._gather(target, node, mb, with_params=False)

    def _post_forward(self, unit: int | None) -> None:
        self.indices.setdefault(unit, []).append(len(self.post_forward))
        self.post_forward.append(unit)

    def after(self, kind: str, node: str | None, mb: int) -> None:
        if kind != "F":
            return
        unit, _, _, last, root_end = self._facts(node)
        if last and self._has(unit):
            if self.reshard:
                self._reshard(unit)
            self._post_forward(unit)
        if root_end:  # the root's post-forward
            if self.reshard:
                self._reshard(None)
            if self._has(None):
                self._post_forward(None)
            for k in [k for k in self.held if k[0] == "A"]:
                self._drop(k)

    def finish(self) -> None:
        """``perform_reduce_grad``: every unit's post-backward with gradient sync, the root first."""
        grads: dict[str, list[tuple[int, int]]] = {}  # a gradient's name -> its storages alive (a tied weight's: two)
        storage = self.cut.storage if self._layout() is not None else self.cut.tl.storages.__getitem__
        for mb, sid in self.alive:
            st = storage(sid)
            if st.category == "gradient":
                grads.setdefault(st.name, []).append((mb, sid))
        previous = None
        for unit in self.units.order:
            params = self.units.of(unit)
            self._reshard(unit)
            if previous is not None:
                self._drop(previous)
            previous = ("R", unit)
            self._make(previous, self.units.gather_bytes(unit))
            what = f"the reduce-scatter of {'the stage root' if unit is None else f'layer {unit}'}"
            self.moment(self.live, what, None)
            mine = [key for p in params for key in grads.get(p.grad, [])]
            for key in mine[:-1]:
                self.free(key)
            self._make(("G", unit), self.units.shard_bytes(unit))
            self.moment(self.live, what, None)
            for key in mine[-1:]:
                self.free(key)
        if previous is not None:
            self._drop(previous)


def stage_at(memory: Any, numbers: Mapping[str, int], units: _Units, regime: Regime, layers: int) -> dict[str, int]:
    """The stage's parts at ``numbers`` under FSDP: the pipeline stage's buffers, inputs and outputs, the shards,
    their gradients, AdamW's state of the held rows and the for-loop step's temporaries on them."""
    # the pipeline stage's parts FSDP keeps (the rest are the shards', below; each part at numbers is sympy's work)
    at = dict(memory.at(numbers, ("buffers", "inputs", "outputs")))
    weights, state = units.at_rest()
    before = [p.held for p in units.params if p.unit is None and units.params.index(p) < _first_layer(units)]
    after = [p.held for p in units.params if p.unit is None and units.params.index(p) > _first_layer(units)]
    layer = [p.held for p in units.of(units.layers[0])] if units.layers else []
    # CUDA's default foreach step (the engine resolves "auto" by device): one ``sqrt`` of every held parameter at once
    impl = "foreach" if regime.optimizer_impl == "foreach" else "for-loop"
    temps = _temporaries(regime, tuple(before), tuple(layer), tuple(after), layers, impl)
    at.update(parameters=weights, gradients=weights, optimizer_state=state, step_temporaries=temps)
    at["at_rest"] = weights + state + at["buffers"] + at["inputs"] + at["outputs"]
    at["step_peak"] = at["at_rest"] + weights + temps
    return at


@functools.lru_cache(maxsize=256)
def _temporaries(regime: Regime, before: tuple[tuple[int, ...], ...], layer: tuple[tuple[int, ...], ...],
                 after: tuple[tuple[int, ...], ...], layers: int, impl: str) -> int:
    """:func:`stage_at`'s step temporaries, worked out once for the same held rows (the peak's three batches and the
    middle stages hold the same; each was a third of the units' parts).  The for-loop step's at held rows that are
    ints in Python (:func:`~symmem.passes.model_parallel._step_temporaries`' candidates, each an int: their ``Max``
    is the largest, the layers' wrap-around ``Piecewise`` its value at ``layers``)."""
    shapes = [*before, *layer, *after]
    if impl == "for-loop" and regime.optimizer in ("adam", "adamw") and isinstance(layers, int) and \
            all(_ints(shape) for shape in shapes):
        size = [math.prod(shape) * 4 for shape in shapes]
        if not size:
            return 0
        candidates = [2 * size[0]] + [prev + 2 * cur for prev, cur in zip(size, size[1:], strict=False)]
        if layer:
            k = len(before)
            candidates.append(size[k + len(layer) - 1] + 2 * size[k] if layers >= 2 else 0)
        return max(candidates)
    return _integer(_step_temporaries(regime, list(before), list(layer), list(after), layers, impl), {},
                    "step temporaries")


def _ints(shape: tuple[Any, ...]) -> bool:
    """Whether every dimension of ``shape`` is a Python int (not a bool)."""
    return not [d for d in shape if type(d) is not int]


def _first_layer(units: _Units) -> int:
    found = [k for k, p in enumerate(units.params) if p.unit is not None]
    return found[0] if found else len(units.params)


@dataclass(frozen=True)
class MeshStageMoment(StageMoment):
    """A moment of one stage's step on the p x N mesh: its data-parallel rank 0 (whole shards) is rank ``s*N``."""

    world: int = 1

    @property
    def rank(self) -> int:
        return self.stage * self.world

    def where(self, step: bool = True) -> str:
        head = f"stage {self.stage} of {self.stages}"
        return super().where(step).replace(head, f"rank {self.rank} (stage {self.stage} of {self.stages}, "
                                                 f"data-parallel rank 0 of N = {self.world})", 1)


@dataclass(eq=False)
class FsdpPipelineStep(PipelineStep):
    """:class:`~symmem.passes.pipeline_step.PipelineStep` with FSDP2 on every stage (the module's note): each
    stage's replay is :class:`_FsdpReplay` of data-parallel rank ``rank`` (0: whole shards, the largest)."""

    reshard: bool = True
    rank: int = 0

    def _make_replays(self, numbers: Mapping[str, int]) -> list[Any]:
        world, cut = self._checked_cut(numbers)
        found = self._stages()
        out = []
        for s in range(cut.p):
            units = self._units(cut, s, world)
            at = self._stage_at(memory_of(found, s, cut.p), numbers, units, cut.per)
            out.append(self._replay(cut, s, at, units))
        return out

    def _batch_moments(self, named: Mapping[str, int], b: int, count: int = 3) -> Any:
        """Every stage's moments and parts at ``B = b, b + 1, b + 2`` (``count`` batches from ``b``) from one replay
        (:func:`~symmem.passes.model_parallel.batch_moments`): the units' bytes are alike at the batches
        (packed alike), the parts packed; None where the units differ between them (each replayed on its own), or
        where a subclass replays otherwise."""
        if type(self)._make_replays is not FsdpPipelineStep._make_replays:
            return None
        from .model_parallel import _pack, pack_parts

        numbers = [{**named, BATCH: b + k} for k in range(count)]
        world, cuts = self._batch_cuts(numbers)
        found = self._stages()

        kept: list[Any] = []  # each stage's replay's makings: pipeline_formula's snapshot replays start from them

        def make(packed: Any, plain: Any, s: int) -> Any:
            mine = plain if cuts is None else cuts
            memory = memory_of(found, s, packed.p)
            units = [self._units(mine[0], s, world)]
            # the units read the numbers through the dimensions they size (cut.dims): where the other batches give
            # those the same values (no parameter's shape is in B) the units are the same
            sized = {str(x) for d in mine[0].__dict__.get("dims", {}) for x in getattr(d, "free_symbols", ())}
            units += [units[0] if all(n.get(x) == numbers[0].get(x) for x in sized) else self._units(c, s, world)
                      for c, n in zip(mine[1:], numbers[1:], strict=True)]
            if any(u.params != units[0].params for u in units):
                return None
            ats = [self._stage_at(memory, n, u, c.per) for n, u, c in zip(numbers, units, mine, strict=True)]
            alike = copy.copy(units[0])  # the same units, their shards' elements packed alike
            alike.params = [dataclasses.replace(p, shard=_pack([p.shard] * count)) for p in units[0].params]
            replay = self._replay(self._packed(packed, mine), s, pack_parts(ats), alike)
            kept.append((replay.cut, replay.at, alike, replay._events, replay._known))
            return replay, ats

        return self._kept_moments(named, b, numbers, make, kept)

    def _formula_extra(self, named: Mapping[str, int]) -> Any:
        """FSDP's storages beside the stage's replay as formulas in ``N`` and the sizes
        (:class:`~symmem.passes.mesh_formula.FsdpFormulas`); None for a subclass (its moments stay lines in B)."""
        if type(self) is not FsdpPipelineStep:
            return None
        from .mesh_formula import FsdpFormulas, Kit

        return {"engine": FsdpFormulas(self, named, Kit(_FsdpReplay, stage_at, units=_Units))}

    # what differs on the 3-D mesh (passes/fsdp_tensor_pipeline.py): the cut, at a tensor-parallel rank's sizes there,
    # the units on it and the replay
    def _checked_cut(self, numbers: Mapping[str, int]) -> tuple[int, Any]:
        """``N`` and the single-device step cut by stage at ``numbers``, the numbers checked."""
        from .model_parallel import requires

        requires(numbers.get("p"), numbers.get("L"), self.schedule, self.micro_batches)
        world = self._world(numbers)
        return world, _Cut(self.graph, self.conv, self.options, self.regime, numbers, self._memo())

    def _batch_cuts(self, numbers: list[dict[str, int]]) -> tuple[int, list[Any] | None]:
        """``N`` and the cuts the units and parts at each of the peak's three batches are read from (None: the
        plain cuts :func:`~symmem.passes.model_parallel.batch_moments` makes), the numbers checked."""
        from .model_parallel import requires

        requires(numbers[0].get("p"), numbers[0].get("L"), self.schedule, self.micro_batches)
        return self._world(numbers[0]), None

    def _units(self, cut: Any, s: int, world: int) -> _Units:
        return _Units(cut, s, world, self.rank)

    def _stage_at(self, memory: Any, numbers: Mapping[str, int], units: _Units, per: int) -> dict[str, int]:
        """The stage's parts at ``numbers`` (:func:`stage_at`; sequence parallelism splits its buffers)."""
        return stage_at(memory, numbers, units, self.regime, per)

    def _replay(self, cut: Any, s: int, at: Mapping[str, int], units: _Units) -> _FsdpReplay:
        return _FsdpReplay(cut, s, at, self.schedule, self.micro_batches, units, self.reshard)

    def _packed(self, packed: Any, cuts: list[Any]) -> Any:
        """The packed cut a replay at the three batches runs on (``cuts``: :meth:`_batch_cuts`')."""
        return packed

    def _world(self, numbers: Mapping[str, int]) -> int:
        """``N``, the data-parallel ranks of a stage (at least 2, above this step's rank)."""
        world = numbers.get("N")
        if not isinstance(world, int) or world < 2:
            raise SymmemError(f"FSDP x pipeline needs N >= 2 data-parallel ranks a stage, got N={world}")
        if self.rank >= world:
            raise SymmemError(f"rank {self.rank} is no place in a data-parallel group of N={world}")
        return world

    def _peak(self, named: dict[str, int]) -> Any:
        from ..peak import Peak

        found = super()._peak(named)
        world = int(named["N"])
        moments = tuple(MeshStageMoment(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)}, world=world)
                        for m in found.moments)
        return Peak(None, None, moments, found.domain)

    def at_rank(self, rank: int) -> FsdpPipelineStep:
        """The step of data-parallel rank ``rank`` of every stage (kept: the views ask for each rank again)."""
        if rank == self.rank:
            return self
        key = ("rank", rank)
        if key not in self._cache:
            self._cache[key] = dataclasses.replace(self, rank=rank,
                                                   _cache={"stages": self._stages(), "memo": self._memo()})
        return self._cache[key]

    def _firsts(self, derivation: Any) -> list[Any]:
        """Every parameter's first dimension at the derivation's numbers (which rows each rank holds)."""
        from .data_parallel import _stored

        return [derivation.evaluate(shape[0]) for shape in _stored(self.graph).values() if shape]

    def rank_peaks(self, derivation: Any) -> dict[int, tuple[int, int]] | None:
        """``{rank: (first-step peak, steady peak)}`` of every rank of the p x N mesh (rank ``s*N + r``: stage
        ``s``, data-parallel rank ``r``); None where every rank is alike."""
        from ..symbols import N
        from .data_parallel import alike_ranks

        numbers = derivation.numbers
        world = int(numbers[N])
        firsts = self._firsts(derivation)
        out: dict[int, tuple[int, int]] = {}
        for group in alike_ranks(firsts, world):  # ranks that hold the same rows: one replay for them all
            step = self.at_rank(group[0])
            each = step.per_stage(numbers)
            for s, (first, steady) in enumerate(zip(each["peak_first_step_per_stage"], each["peak_per_stage"],
                                                    strict=True)):
                out.update({s * world + r: (first, steady) for r in group})
        out = dict(sorted(out.items()))
        return out if len(set(out.values())) > 1 else None
