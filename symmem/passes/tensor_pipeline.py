"""Tensor parallel x pipeline: DTensor's standard plan on every pipeline stage of a p x t mesh, per stage and rank.

The engine is torchtitan's 2-D recipe (:mod:`symmem.record.tensor_pipeline_runs`): ``init_device_mesh(device,
(p, t), mesh_dim_names=("pp", "tp"))``, each stage's module (the embedding on the first stage, the final norm and
the head on the last, ``L/p`` layers each) ``parallelize_module``'d over ``mesh["tp"]`` with the standard Llama
plan, then ``PipelineStage`` and ``ScheduleGPipe`` / ``Schedule1F1B`` run ``M`` micro-batches.  What crosses a
stage boundary is a plain tensor, whole on every rank of the tp group (the row-parallel outputs come back
replicated), so the pipeline's own bookkeeping is the single device's.  A stage's replay
(:class:`~symmem.passes.model_parallel._Replay`, the single-device step cut by stage) is run with each storage at
one tensor-parallel rank's size, as the tensor-parallel rank's walk sizes it
(:class:`~symmem.passes.tensor_step._LayerWalk`: split over ``t`` where it has a head or MLP-width dimension, a
row-parallel output beside funcol's wrapper, the head's local and replicated logits, a linear's gradient split,
the embedding's whole), with what the collectives add for a moment (a row-parallel output's partial sum; a
column-parallel input gradient's all-reduce), and what lives between steps at the rank's sizes: the local
parameter shards, AdamW's state of them (and a 4-byte ``step`` each), the receive buffers (whole), the batch or
the labels, the last stage's logits (whole).  The optimizer step: for-loop AdamW on the local shards beside every
gradient (the embedding's whole ``V x H``).

Every tensor-parallel rank of a stage holds the same bytes; rank ``s*t + r`` is stage ``s``'s tensor-parallel rank
``r`` (the mesh's row-major order, as the real run's).

>>> from symmem import derive
>>> d = derive("llama", tensor_parallel=True, pipeline_parallel=True, micro_batches=2, attention="sdpa",
...            device="cpu", values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64, "F": 64,
...            "p": 2, "t": 2})
>>> d.value("peak"), d.step.rank_peaks(d)  # {rank: (first step, steady)}: gloo's, docs/regimes.md
(203080, {0: (157472, 203080), 1: (157472, 203080), 2: (143788, 189656), 3: (143788, 189656)})
>>> d.peak_at().where(step=False)
'rank 0 (stage 0 of 2, tensor-parallel rank 0 of t = 2, every one alike): pipeline layers.mlp.up_proj (layer 1), \
micro-batch 0'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from ..errors import SymmemError
from ..shapes import numel
from ..training import Regime
from .batch_of_one import collapsed
from .model_parallel import _Cut, _integer, _pack, _Replay, memory_of
from .pipeline_step import BATCH, PipelineStep, StageMoment


def refusal(model_name: str, regime: Regime, loss: str | None, device: str = "cpu") -> str | None:
    """Why the tensor x pipeline peak is not modelled for this derivation (None: it is): what was measured."""
    from .tensor_step import refusal as tensor_refusal

    if regime.zero or regime.data_parallel:
        return "a 3-D mesh (data x tensor x pipeline) is not modelled: tensor x pipeline is a p x t mesh"
    if regime.checkpoint != "none":  # the plain, DDP and FSDP stages are (passes/model_parallel.py), and the
        # tensor-parallel rank without stages (passes/tensor_checkpoint.py); TP on stages was not measured
        return "the tensor x pipeline peak is modelled without activation checkpointing (what was measured)"
    one = dataclasses.replace(regime, pipeline_parallel=False, pipeline_schedule="1f1b", micro_batches=1)
    # the pipeline runs' loss (cross-entropy on the last stage) was measured as well as the sum
    return tensor_refusal(model_name, one, None if loss == "cross-entropy" else loss, device)


class _Sizes:
    """Each storage of the cut's simulated step at one tensor-parallel rank's size, as
    :class:`~symmem.passes.tensor_step._LayerWalk` sizes its own (its rules borrowed, not copied)."""

    from .tensor_step import _LayerWalk

    _split = _LayerWalk._split

    def _local(self, i: int) -> sympy.Expr:
        """The walk's size, but the head's output is the replicated logits alone: the local ones (``V/t`` wide)
        go once gathered (the stage's output chunk is what the schedule keeps)."""
        s = self.tl.storages[i]
        if s.name == self.head and s.category not in ("parameter", "optimizer_state", "input", "buffer"):
            return s.nbytes
        return type(self)._LayerWalk._local(self, i)

    def local(self, i: int) -> sympy.Expr:
        """:meth:`_local`, worked out once for the storages alike in all it reads: the same size's object (the
        layers' copies share their template's: passes/stretch.py), category, and name and op but for the layer's
        number, in a layer after the first or not (what a layer's op reads is its own layer's, the layer before's
        or what no layer owns; the first layer's may be what comes before the layers).  Making each copy's formula
        anew, and deciding its split, was most of the replays' time."""
        found = self._locals.get(i)
        if found is None:
            from .unroll import iteration, template

            # the storages written from one template storage (passes/stretch.py) share all of the key: read from
            # the first one's name (the rest of the 32 layers' names were most of this)
            o = self._origin[i] if self._origin is not None else None
            key = self._keys.get(o) if o is not None else None
            if key is None:
                st = self.tl.storages[i]
                name, node = st.name, st.node
                key = (id(st.nbytes), st.category, template(name), iteration(name) == 1,
                       None if node is None else (template(node), iteration(node) == 1))
                if o is not None:
                    self._keys[o] = key
            found = self._alike.get(key)
            if found is None:
                found = self._alike[key] = self._local(i)
            self._locals[i] = found
        return found

    def every(self) -> list[sympy.Expr] | None:
        """Every storage's :meth:`local`, by its index, where the step was written from a template (None otherwise:
        each asked for on its own): one per template storage, shared by the storages written from it (their keys
        are one: :meth:`local`).  The replays and the collectives ask for thousands of storages: a list read."""
        if self._every is None and self._origin is not None:
            by: dict[int, sympy.Expr] = {}  # template storage -> its storages' size on the rank
            rep = self._rep
            for i, o in enumerate(self._origin):
                if o not in by:  # (a test, not a call: 7,557 storages at Llama-2-7B's 32 layers)
                    # a template storage of layer 3 or 4 is its sweep's layer 2's alike (the layout checked their
                    # names, categories, bytes and ops): that one's size, worked out once (``local``'s key tells
                    # them apart by their sizes' objects, each template layer's its own)
                    r = rep[o] if rep is not None else o
                    found = by.get(r) if r != o else None
                    by[o] = found if found is not None else self.local(i)
                    if r != o and found is None:
                        by[r] = by[o]
            self._every = [by[o] for o in self._origin]
        return self._every

    @staticmethod
    def _alike_of(cut: _Cut, origin: Any) -> list[int] | None:
        """Each template storage's alike one in layer 2 of its sweep (itself outside layers 3 and 4), where the step
        was written from ``cut``'s layout (None otherwise)."""
        sim = getattr(cut, "_sim", None)
        layout = getattr(sim, "layout", None)
        if layout is None or origin is None or sim.__dict__.get("tl") is not cut.tl:
            return None
        where = layout.where
        second = {(x[0], x[2]): ts for ts, x in enumerate(where) if x is not None and x[1] == 2}
        return [second[(x[0], x[2])] if x is not None and x[1] in (3, 4) else ts for ts, x in enumerate(where)]

    def __init__(self, cut: _Cut) -> None:
        self._every: list[sympy.Expr] | None = None
        self._alike: dict[Any, sympy.Expr] = {}
        g = self.g = cut.g
        self.tl = cut.tl
        # each storage's template storage where the step was written from a template (passes/stretch.py)
        origin = cut.memo.get(("origin", id(cut.tl)))
        self._origin: list[int] | None = origin[1] if origin is not None and origin[0] is cut.tl else None
        self._rep = self._alike_of(cut, self._origin)
        self._keys: dict[int, Any] = {}
        order = list(g.program_order())
        self.head = next(n for n in reversed(order) if g.node(n).kind == "linear" and g.node(n).block is None)
        self.embedding = next(n for n in order if g.node(n).kind == "embedding")
        linears = [n for n in order if g.node(n).kind == "linear"]
        self.column = {n for n in linears if g.node(n).role in ("qkv", "mlp_hidden") or n == self.head}
        self.row = {n for n in linears if n not in self.column}
        self.collapsed, self.once = False, sympy.Integer(0)
        self._splits: dict[str, bool] = {}
        self._locals: dict[int, sympy.Expr] = {}


class _TensorCut(_Cut):
    """A :class:`_Cut` whose storages are at one tensor-parallel rank's size."""

    def __init__(self, cut: _Cut) -> None:
        self.__dict__.update(cut.__dict__)
        key = ("tensor sizes", id(cut.tl))  # one simulated step, its storages' formulas, at every B the lines read
        if key not in cut.memo or cut.memo[key][0] is not cut.tl:
            cut.memo[key] = (cut.tl, _Sizes(cut))
        self.sizes = cut.memo[key][1]
        self.cache = {}
        self.whole: dict[int, int] = {}
        self.values: dict[int, int] = {}  # id of a size (held by sizes) -> bytes
        self.fulls: dict[int, int] = {}  # id of a single-device size (held by the timeline) -> bytes

    def size(self, sid: int) -> int:
        found = self.cache.get(sid)
        if found is None:
            # the layers' copies share a few formulas (the same objects: _Sizes.local): each evaluated once, found
            # by the object (a sympy expression's hash and equality were most of this)
            every = self.sizes.every()
            e = every[sid] if every is not None else self.sizes.local(sid)
            found = self.values.get(id(e))
            if found is None:
                found = self.values[id(e)] = _integer(e, self.subs, self.tl.storages[sid].name)
            self.cache[sid] = found
        return found

    def collectives(self) -> dict[tuple[int, str, str | None], int]:
        """What each collective op adds for its moment, by (pass, kind, op) (alike on every stage)."""
        if hasattr(self, "_extras"):
            return self._extras
        t = self.ranks()
        out: dict[tuple[int, str, str | None], int] = {}
        for key, kind, born, freed in self._collective_ops():
            if kind == "row":  # the all-reduce's partial sum beside its output and wrapper
                out[key] = sum(self.full(i) for i in born)
            elif kind == "head":  # the local logits and the all-gather's output beside its wrapper
                whole = sum(self.full(i) for i in born)
                out[key] = whole + whole // t
            else:  # a column-parallel linear's backward: its input gradient's all-reduce
                out[key] = max(0, 2 * self.full(born[0]) - sum(self.size(i) for i in freed))
        self._extras = out
        return out

    def _collective_ops(self) -> list[tuple[tuple[int, str, str | None], str, list[int], list[int]]]:
        """The collective ops of the simulated step, in order: (pass, kind, op), which (``row``, ``head``,
        ``column``), the storages they add (the op's output; a column-parallel backward's input gradient) and what
        that backward frees -- found once for every set of numbers the step is read at (the peak's three batches
        share it: only the bytes differ)."""
        key = ("tensor collectives", id(self.tl))
        found = self.memo.get(key)
        if found is None or found[0] is not self.tl:
            sizes, storages = self.sizes, self.tl.storages
            ops: list[tuple[tuple[int, str, str | None], str, list[int], list[int]]] = []
            for p, passes in enumerate(self.passes):
                for _, e in passes["F"]:
                    if e.node in sizes.row or e.node == sizes.head:
                        ops.append(((p, "F", e.node), "row" if e.node in sizes.row else "head",
                                    [i for i in e.born if storages[i].name == e.node], []))
                for _, e in passes["B"]:
                    if e.node in sizes.column:
                        grads = [i for i in e.born if storages[i].name.endswith(".grad_input0")]
                        if grads:
                            ops.append(((p, "B", e.node), "column", grads[:1], list(e.freed)))
            found = self.memo[key] = (self.tl, ops)
        return found[1]

    def logits_grad(self) -> int:
        """The rank's copy of the logits' gradient: the model's output over ``t`` (found once: the replay asks at
        each moment of the head's backward)."""
        if "_logits_grad" not in self.__dict__:
            # the head's output storages, found once for every cut of the step (each cut walked all storages)
            key = ("logits", id(self.tl))
            found = self.memo.get(key)
            if found is None or found[0] is not self.tl:
                found = self.memo[key] = (self.tl, [i for i, st in enumerate(self.tl.storages) if
                                                    st.name == self.sizes.head and
                                                    st.category not in ("parameter", "gradient")])
            whole = [self.full(i) for i in found[1]]
            self._logits_grad = whole[0] // self.ranks() if whole else 0
        return self._logits_grad

    def ranks(self) -> int:
        return int(self.subs[sympy.Symbol("t", positive=True, integer=True)])

    def full(self, sid: int) -> int:
        """Storage ``sid``'s single-device bytes."""
        found = self.whole.get(sid)
        if found is None:
            # by the size's object, as size(): the layers' storages share their template's (passes/stretch.py)
            e = self.tl.storages[sid].nbytes
            found = self.fulls.get(id(e))
            if found is None:
                found = self.fulls[id(e)] = _integer(e, self.subs, self.tl.storages[sid].name)
            self.whole[sid] = found
        return found


class _TensorPackedCut(_TensorCut):
    """Three :class:`_TensorCut` of one simulated step at numbers that differ in sizes only (the batches the lines
    are read at): each storage's bytes, and what each collective adds, the three packed into one integer
    (:func:`~symmem.passes.model_parallel.batch_moments`)."""

    def __init__(self, packed: _Cut, cuts: list[_TensorCut]) -> None:
        self.__dict__.update(packed.__dict__)
        self.tcuts, self.sizes = cuts, cuts[0].sizes
        self.cache = {}
        self.whole = {}
        self._packed: dict[int, int] = {}  # id of a rank's size (held by sizes, the three cuts') -> packed bytes
        self._shared = all(c.sizes is self.sizes for c in cuts)  # the cuts' sizes one (else each storage's own)

    # each packed once (the plans ask for every storage a stage's ops make), once for the storages alike: the three
    # cuts share one simulated step and its sizes on a rank (_Sizes.local: the same object for the storages alike),
    # and each cut's bytes of a storage are its size's at the cut's numbers
    def size(self, sid: int) -> int:
        found = self.cache.get(sid)
        if found is None:
            every = self.sizes.every()
            e = every[sid] if every is not None else self.sizes.local(sid)
            found = self._packed.get(id(e)) if self._shared else None
            if found is None:
                found = self._packed[id(e)] = _pack([c.size(sid) for c in self.tcuts])
            self.cache[sid] = found
        return found

    def full(self, sid: int) -> int:
        found = self.whole.get(sid)
        if found is None:
            found = self.whole[sid] = _pack([c.full(sid) for c in self.tcuts])
        return found

    def collectives(self) -> dict[tuple[int, str, str | None], int]:
        if "_extras" not in self.__dict__:
            each = [c.collectives() for c in self.tcuts]
            self._extras = {key: _pack([e[key] for e in each]) for key in each[0]}
        return self._extras

    def logits_grad(self) -> int:
        if "_logits_grad" not in self.__dict__:
            self._logits_grad = _pack([c.logits_grad() for c in self.tcuts])
        return self._logits_grad


class _TensorReplay(_Replay):
    """One stage's replay on a tensor-parallel rank: the collectives' transients around their ops."""

    def __init__(self, cut: _TensorCut, s: int, at: Mapping[str, int], schedule: str, m: int) -> None:
        super().__init__(cut, s, at, schedule, m)
        self.tcut = cut
        self.extra = 0
        self.pass_ = 0
        self._extras = cut.collectives()
        self.fix: tuple[int | None, int, int] | None = None  # the head's backward (before)

    def _hook_state(self, kind: str, mb: int) -> Any:
        """Nothing carried from one segment to the next (each op's collectives are its own): a segment begun alike
        is its record moved (:meth:`~symmem.passes.model_parallel._Replay._repeated`)."""
        return ()

    def _acting(self, pass_: int, kind: str) -> Any:
        if type(self).before is not _TensorReplay.before or type(self).moment is not _TensorReplay.moment \
                or type(self).after is not _TensorReplay.after:
            return None  # hooks of a subclass's (passes/mesh_formula.py's notes): around every op
        return self._tensor_acting(pass_, kind)

    def _tensor_acting(self, pass_: int, kind: str) -> frozenset[int]:
        """:meth:`_acting` of the collectives' hooks: the ops with a collective, and the head's backward; at every
        other op ``before`` finds no extra bytes and no mode, and ``after`` undoes nothing."""
        found = self.__dict__.setdefault("_tensor_acts", {})
        key = (pass_, kind)
        if key not in found:
            extras, head, backward = self._extras, self.tcut.sizes.head, kind == "B"
            found[key] = frozenset({i for i, (node, _, _) in enumerate(self._plan(pass_, kind))
                                    if extras.get((pass_, kind, node), 0) or (backward and node == head)})
        return found[key]

    def begin(self, kind: str, mb: int) -> None:
        self.pass_ = 0 if mb == 0 else 1
        self._ops = self._plan(self.pass_, kind)  # segment walks the same plan: before() reads it at ``_at``
        self._at = -1

    def before(self, kind: str, node: str | None, mb: int) -> None:
        # ``_at``: the op's index in the plan (set by _Replay._hooked)
        self.extra = self._extras.get((self.pass_, kind, node), 0)
        self.live += self.extra
        self.mode, self.accumulated = "", 0
        if kind != "B":  # (what follows is the backward's: a forward op adds its collective alone)
            self.head_backward = False
            return
        _, born, dying = self._ops[self._at]
        self.head_backward = node == self.tcut.sizes.head
        if self.extra:
            after = self._ops[self._at + 1] if self._at + 1 < len(self._ops) else None
            if self._at and self._ops[self._at - 1][0] == node and not born:
                # from the second micro-batch the new weight gradient is added into .grad by an op of its own
                # (AccumulateGrad, which autograd runs first): gone before the input gradient's all-reduce
                self.mode = "accumulate"
                grads = {sid for sid, _, _ in self._ops[self._at - 1][1]}
                self.accumulated = sum(self.alive.get((mb, sid), 0) for sid in dying if sid in grads)
            else:
                self.mode = "op" if after is not None and after[0] == node and not after[1] else "op, held"
        if self.head_backward and not self.extra:
            # the head's backward where the logits' whole gradient is a storage of its own (the cross-entropy's):
            # DTensor's redistribution copies the rank's columns out of it (V/t wide) and lets it go before the
            # weight's and the input's gradient mm; the head's saved input goes after them (measured on the p x t
            # and p x N x t meshes; the single-device step holds the whole gradient to the op's end)
            gone = sum(self.alive.get((mb, sid), 0) for sid in dying
                       if self.cut.tl.storages[sid].category == "activation_grad")
            if gone:
                self.fix = (self.live, gone, self.tcut.logits_grad())

    def moment(self, live: int, node: str | None, mb: int | None) -> None:
        if self.fix is not None:
            base, gone, local = self.fix
            if base is not None:  # the copy beside the whole gradient, before the op's gradients are made
                super().moment(base + local, node, mb)
                self.fix = (None, gone, local)
            live = live - gone + local
        if self.mode.startswith("op"):
            # a column-parallel linear's weight-gradient mm: its input gradient's all-reduce not yet made; at the
            # head (measured, B = 1) the logits' gradient redistributed to the rank's columns (a contiguous copy,
            # V/t wide) alive too.  Where the gradient is .grad itself (the first micro-batch) the all-reduce
            # follows in the same op; else at the accumulation
            super().moment(live - self.extra + (self.tcut.logits_grad() if self.head_backward else 0), node, mb)
            if self.mode == "op":
                return
        elif self.mode == "accumulate":
            live -= self.accumulated
        super().moment(live, node, mb)

    def after(self, kind: str, node: str | None, mb: int) -> None:
        self.live -= self.extra
        self.extra = 0
        self.head_backward, self.mode, self.fix = False, "", None


def stage_at(cut: _TensorCut, s: int, memory: Any, numbers: Mapping[str, int]) -> dict[str, int]:
    """Stage ``s``'s parts on one tensor-parallel rank: the local shards, their gradients (the embedding's whole),
    AdamW's state and its for-loop step's temporaries on the shards; the pipeline stage's buffers, inputs and
    outputs (whole: what crosses a boundary is replicated)."""
    from .data_parallel import stored_shapes
    from .parameters import in_registration_order, program_parameters

    g = cut.g
    t = int(numbers["t"])
    key = ("stored", cut.per * cut.p)
    if key not in cut.memo:
        cut.memo[key] = stored_shapes(g, in_registration_order(g, program_parameters(g)))
    # the stage's parameters at the numbers their shapes read, once (not B: the peak's three batches share them)
    names = cut.memo.get(("stored symbols", key[1]))
    if names is None:
        # each distinct dimension read once (the layers' shapes repeat a few)
        dims = {d for shape in cut.memo[key].values() for d in shape}
        names = cut.memo[("stored symbols", key[1])] = tuple(sorted({
            str(x) for d in dims for x in sympy.sympify(d, strict=True).free_symbols}))
    known = cut.memo.setdefault(("tensor stage sides", key[1], cut.p, t), {})
    side = (s, *(numbers.get(n) for n in names))
    if side not in known:
        # each shape's bytes at these numbers, shared by the stages (the layers repeat a few shapes)
        known[side] = _stage_side(cut, s, t, cut.memo[key], known.setdefault(("bytes", *side[1:]), {}))
    weights, grads, state, temps = known[side]
    at = dict(memory.at(numbers, ("buffers", "inputs", "outputs")))
    at.update(parameters=weights, gradients=grads, optimizer_state=state, step_temporaries=temps)
    at["at_rest"] = weights + state + at["buffers"] + at["inputs"] + at["outputs"]
    at["step_peak"] = at["at_rest"] + grads + temps
    return at


def _stage_side(cut: _TensorCut, s: int, t: int, stored: Mapping[str, Any], sized: dict[Any, int] | None = None
                ) -> tuple[int, int, int, int]:
    """Stage ``s``'s local weights, gradients (the embedding's whole), AdamW's state and its for-loop step's
    temporaries on one tensor-parallel rank (:func:`stage_at`); ``sized``: each shape's bytes at the numbers, kept
    for the other stages."""
    g = cut.g
    weights = grads = state = 0
    sizes: list[int] = []
    sized = {} if sized is None else sized
    for name, shape in stored.items():
        owner = name if name in g and g.node(name).kind == "parameter" else name.rsplit(".", 1)[0]
        if cut.stage_of(owner) != s:
            continue
        whole = sized.get(shape)
        if whole is None:
            whole = sized[shape] = _integer(numel(shape), cut.subs, name) * 4
        local = whole // t if len(shape) >= 2 else whole
        weights += local
        grads += whole if owner in g and g.node(owner).kind == "embedding" else local
        state += 2 * local + 4
        sizes.append(local)
    temps = max([2 * sizes[0]] + [a + 2 * b for a, b in zip(sizes, sizes[1:], strict=False)]) if sizes else 0
    return weights, grads, state, temps


@dataclass(frozen=True)
class TensorStageMoment(StageMoment):
    """A moment of one stage's step on the p x t mesh: every tensor-parallel rank of the stage alike, the first
    is rank ``s*t``."""

    ranks: int = 1

    @property
    def rank(self) -> int:
        return self.stage * self.ranks

    def where(self, step: bool = True) -> str:
        head = f"stage {self.stage} of {self.stages}"
        return super().where(step).replace(head, f"rank {self.rank} (stage {self.stage} of {self.stages}, "
                                                 f"tensor-parallel rank 0 of t = {self.ranks}, every one alike)", 1)


@dataclass(eq=False)
class TensorPipelineStep(PipelineStep):
    """:class:`~symmem.passes.pipeline_step.PipelineStep` with DTensor's standard plan on every stage (the
    module's note): each stage's replay is :class:`_TensorReplay` at one tensor-parallel rank's sizes (with
    sequence parallelism: :class:`~symmem.passes.sequence_pipeline.SequencePipelineStep`, its hooks' own)."""

    # the replay, the packed cut, the cut and the stage's parts: a subclass's (sequence parallelism) may differ
    def _replay(self) -> type[_TensorReplay]:
        return _TensorReplay

    def _packing(self) -> type[_TensorPackedCut]:
        return _TensorPackedCut

    def _make_cut(self, plain: _Cut) -> _TensorCut:
        return _TensorCut(plain)

    def _parts(self, cut: _TensorCut, s: int, memory: Any, numbers: Mapping[str, int]) -> dict[str, int]:
        return stage_at(cut, s, memory, numbers)

    def _make_replays(self, numbers: Mapping[str, int]) -> list[Any]:
        cut = self._cut(numbers)
        found = self._stages()
        out = []
        for s in range(cut.p):
            memory = memory_of(found, s, cut.p)
            out.append(self._replay()(cut, s, self._parts(cut, s, memory, numbers), self.schedule,
                                      self.micro_batches))
        return out

    def _formula_extra(self, named: Mapping[str, int]) -> Any:
        """The rank's storages, shards and collectives as formulas in ``t`` and the sizes
        (:class:`~symmem.passes.mesh_formula.TensorFormulas`)."""
        if type(self) is not TensorPipelineStep or getattr(self.regime, "sequence_parallel", False):
            return None  # sequence parallelism on stages: its formulas not checked at other sizes (lines in B)
        from .mesh_formula import Kit, TensorFormulas

        return {"engine": TensorFormulas(self, named, Kit(_TensorReplay, stage_at, packed=_TensorPackedCut,
                                                          cut=self._cut))}

    def _cut(self, numbers: Mapping[str, int]) -> _TensorCut:
        """The single-device step cut by stage at ``numbers``, its storages at a rank's size; the numbers checked."""
        from .model_parallel import TensorRank, requires

        requires(numbers.get("p"), numbers.get("L"), self.schedule, self.micro_batches)
        TensorRank(*(sympy.Integer(0),) * 4).at(numbers)  # t divides the heads, F and V (one line otherwise)
        if not isinstance(numbers.get("t"), int):
            raise SymmemError("the tensor x pipeline peak needs a number for t")
        cut = self._make_cut(_Cut(self.graph, self.conv, self.options, self.regime, numbers, self._memo()))
        # (the graph's own nodes: collapsed reads their templates, the same in the graph unrolled to L layers)
        if numbers.get("B") == 1 and collapsed(self.graph.program_order()).xreplace(cut.subs) is sympy.true:
            raise SymmemError("the tensor x pipeline peak at B = 1 with eager attention and one key/value head a "
                              "rank (G = t) is not modelled (the repeated keys and values are views of the cache's "
                              "copies there; measured 2,048 B above on the last stage): give B >= 2 or SDPA")
        return cut

    def _batch_moments(self, named: Mapping[str, int], b: int, count: int = 3) -> Any:
        """Every stage's moments and parts at ``B = b, b + 1, b + 2`` (``count`` batches from ``b``) from one replay
        (:func:`~symmem.passes.model_parallel.batch_moments`): the rank's sizes and the collectives' bytes packed;
        None where they cannot be (each replayed on its own)."""
        from .model_parallel import pack_parts

        numbers = [{**named, BATCH: b + k} for k in range(count)]
        cuts = [self._cut(n) for n in numbers]
        found = self._stages()

        shared: dict[int, Any] = {}  # one packed tensor cut for every stage (its ops sorted out, sizes packed once)
        kept: list[Any] = []  # each stage's cut, parts and plans: pipeline_formula's snapshot replays start from them

        def make(packed: Any, plain: Any, s: int) -> Any:
            memory = memory_of(found, s, packed.p)
            ats = [self._parts(c, s, memory, n) for c, n in zip(cuts, numbers, strict=True)]
            if id(packed) not in shared:
                shared.clear()
                shared[id(packed)] = (packed, self._packing()(packed, cuts))
            replay = self._replay()(shared[id(packed)][1], s, pack_parts(ats), self.schedule, self.micro_batches)
            kept.append((replay.cut, replay.at, replay._events))
            return replay, ats

        return self._kept_moments(named, b, numbers, make, kept)

    def _peak(self, named: dict[str, int]) -> Any:
        return self._ranked(super()._peak(named), named)

    def _ranked(self, found: Any, named: Mapping[str, int]) -> Any:
        """The stages' peak ``found`` with each moment a rank's of the p x t mesh."""
        from ..peak import Peak

        t = int(named["t"])
        moments = tuple(TensorStageMoment(**{f.name: getattr(m, f.name) for f in dataclasses.fields(m)}, ranks=t)
                        for m in found.moments)
        return Peak(None, None, moments, found.domain)

    def rank_peaks(self, derivation: Any) -> dict[int, tuple[int, int]]:
        """``{rank: (first-step peak, steady peak)}`` of every rank of the p x t mesh (rank ``s*t + r``: stage
        ``s``, tensor-parallel rank ``r``; the ranks of a stage alike)."""
        from ..symbols import t

        ranks = int(derivation.numbers[t])
        each = self.per_stage(derivation.numbers)
        return {s * ranks + r: (first, steady) for s, (first, steady) in
                enumerate(zip(each["peak_first_step_per_stage"], each["peak_per_stage"], strict=True))
                for r in range(ranks)}

    def rank_sides(self, derivation: Any) -> dict[int, dict[str, int]]:
        """Every rank's parameter side (:func:`symmem.passes.rank_side.parameter_side_per_rank`'s keys) at the
        derivation's numbers, as each stage's replay holds it: the local shards and the stage module's own buffers
        (Llama's rotary frequencies, on every stage), the gradients at the optimizer step (the embedding's whole),
        no DDP buckets, AdamW's state of the shards with a 4-byte ``step`` each; rank ``s*t + r``."""
        from ..symbols import t

        named = {s.name: int(v) for s, v in derivation.numbers.items()}
        ranks = int(derivation.numbers[t])
        found = self._stages()
        out: dict[int, dict[str, int]] = {}
        for s, replay in enumerate(self._replays(named)):
            memory = memory_of(found, s, len(self._replays(named)))
            own = memory.at(named, ("module_buffers",))["module_buffers"]
            one = {"parameters": replay.at["parameters"] + own, "gradients": replay.at["gradients"], "buckets": 0,
                   "optimizer_state": replay.at["optimizer_state"]}
            one["total"] = sum(one.values())
            out.update({s * ranks + r: one for r in range(ranks)})
        return out
