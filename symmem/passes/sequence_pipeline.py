"""Sequence parallelism on pipeline stages: torchtitan's plan (the norms ``SequenceParallel``) on every stage of a
p x t mesh, per stage and rank.

The engine (:mod:`symmem.record.tensor_pipeline_runs` with ``sequence_parallel``) is the tensor x pipeline one
(:mod:`.tensor_pipeline`) with :func:`~symmem.record.model_parallel_runs.llama_sequence_plan` on each stage: the
hidden stream is split over S between a row-parallel output's reduce-scatter (the embedding's on the first stage)
and the column-parallel inputs' all-gather.  What crosses a stage boundary is the last layer's output, a plain
``(B, S/t, H)`` local shard on each tensor-parallel rank (torchtitan's ``layers_io_shape``: ``seq_len // tp``), so
the receive buffers and a stage's output are ``1/t`` of the whole; each stage's rotary tables (and eager
attention's mask) still cover the whole sequence (torchtitan's are the model's, for its sequence), since the
attention runs on the all-gathered input.

A stage's replay is :class:`~symmem.passes.tensor_pipeline._TensorReplay`'s at the sizes and with the collectives
of :class:`~symmem.passes.tensor_step._SequenceWalk` (the single-device sequence-parallel walk, measured op by op):
each storage at one rank's size (the gathered copies a column-parallel linear keeps, the S-split stream), and at
each op what the collectives add for the current micro-batch (the all-gathers' and reduce-scatters' transients,
the S-split norm outputs beside the gathered copies), worked out once per op of the two-micro-batch step the
pipeline replays (the other micro-batches a stage holds are at rest: forward done, their gathered copies kept).

>>> from symmem import derive
>>> d = derive("llama", tensor_parallel=True, sequence_parallel=True, pipeline_parallel=True, micro_batches=2,
...            attention="sdpa", device="cpu", values={"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 64,
...            "F": 64, "p": 2, "t": 2})
>>> d.step.rank_peaks(d)  # {rank: (first step, steady)}: gloo's, docs/regimes.md
{0: (136864, 182472), 1: (136864, 182472), 2: (133348, 179216), 3: (133348, 179216)}
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy

from ..errors import SymmemError
from .fsdp_pipeline import _FsdpReplay
from .fsdp_tensor_pipeline import FsdpTensorPipelineStep, _MeshReplay, mesh_acting
from .model_parallel import _Cut, _integer, _pack, _Replay
from .pipeline_step import BATCH
from .tensor_pipeline import TensorPipelineStep, _Sizes, _TensorCut, _TensorPackedCut, _TensorReplay, stage_at
from .tensor_step import _LayerWalk, _SequenceWalk


class _SequenceSizes(_Sizes, _SequenceWalk):
    """Each storage of the cut's two-micro-batch step at one rank's size under sequence parallelism, and what the
    collectives add at each op (:class:`~symmem.passes.tensor_step._SequenceWalk`'s rules, per micro-batch pass)."""

    def __init__(self, cut: _Cut, conv: Any, options: Mapping[str, Any]) -> None:
        from .saved import kept

        _Sizes.__init__(self, cut)
        g, tl = self.g, self.tl
        self.subs = cut.subs
        # the step's numbering from its template (None: the step was simulated or written out as it is): which
        # written ops repeat a middle layer (:meth:`_repeats`)
        self.layout = getattr(cut, "layout", None)
        # at B = 1 the asynchronous all-gathers over S keep two copies (batch_of_one.single_copy): a symbol of its
        # own, 1 or 0 at each batch (_SequenceCut), so that the bytes at B >= 2 are lines in B
        self.once = ONCE
        self.evaluate = False
        self.cache_kept = []
        act = "float32"
        # who keeps each saved storage, of the column-parallel linears (all that is read of it: their inputs are
        # the gathered copies): the storages those linears save, found from them alone (every op's saved
        # storages at all L layers were ~5% of the sequence-parallel peak); in the graph unrolled to L layers
        # no storage is a later layer's input (``rest``), so each one a linear keeps is kept by the whole list too
        # (tests/test_pipeline_shortcuts.py holds it against the keepers of every op's storages)
        self.keepers = {s.name: s.keepers for s in kept(g, conv, options, act,
                                                         [n for n in g.program_order() if n in self.column], False,
                                                         cut.branch)}
        self.final_norm = {n for n in g.program_order() if g.node(n).group == "head" and g.node(n).block is None
                           and n != self.head and g.node(n).kind not in ("parameter", "buffer", "constant")}
        self.qkv = {n for n in self.column if g.node(n).role == "qkv"}
        self.copies = {}
        self.held = []
        self.gathered_grads = {i for i, s in enumerate(tl.storages) if s.node in self.qkv
                               and s.name.endswith(".grad_sum")}
        spans_of = []
        born_at = {i: k for k, e in enumerate(tl.events) for i in e.born}
        # the activations a column-parallel linear keeps, in their order (the rest of the 7,557 storages of
        # Llama-2-7B's 32-layer step were asked of at each pass)
        kept_by = self.keepers
        candidates = [(i, s) for i, s in enumerate(tl.storages)
                      if s.category == "activation" and s.name in kept_by and i in born_at]
        for found in cut.passes:
            forward: dict[str, int] = {}
            backward: dict[str, int] = {}
            for k, e in found["F"]:
                if e.node is not None:
                    forward.setdefault(e.node, k)
            for k, e in found["B"]:
                if e.node is not None:
                    backward[e.node] = k
            lo = found["F"][0][0]
            hi = found["B"][-1][0] if found["B"] else len(tl.events)
            rows = sorted(forward[n] for n in self.row if n in forward)
            for i, s in candidates:
                if not lo <= born_at[i] <= hi:
                    continue
                linears = [n for n in kept_by[s.name] if n in self.column and n in forward]
                if not linears:
                    continue
                attention = [n for n in linears if n in self.qkv]
                groups = ([tuple(attention)] if attention else []) + [(n,) for n in linears if n not in self.qkv]
                spans = sorted(((min(forward[n] for n in grp), max(backward.get(n, hi) for n in grp),
                                 1 + (0 if grp[0] in self.qkv else self.once)) for grp in groups),
                               key=lambda x: x[:2])
                after = [r for r in rows if r > spans[-1][0]]
                dies = (after[0] if attention else after[0] + 1) if after else hi
                self.copies[i] = (dies, spans)
            spans_of.append((forward, rows, lo, hi))
        for forward, rows, lo, hi in spans_of:  # once every copy is known (the sizes are worked out once)
            self.held += [x for x in self._held(forward, rows) if lo <= x[0] <= hi]

    def _local(self, i: int) -> sympy.Expr:
        """:class:`~symmem.passes.tensor_step._SequenceWalk`'s size, but the head's output is the replicated
        logits alone, as :meth:`_Sizes._local`'s (the stage's output chunk), and the loss's tensors whole."""
        s = self.tl.storages[i]
        if s.name == self.head and s.category not in ("parameter", "optimizer_state", "input", "buffer"):
            return s.nbytes
        if s.node in self.g and self.g.node(s.node).group == "loss":
            # the loss reads the replicated logits: its tensors whole (the shifted labels are (B, S), not the
            # S-split stream's)
            return _LayerWalk._local(self, i)
        return _SequenceWalk._local(self, i)

    def _collectives(self, e: Any, alive: set[int], k: int) -> sympy.Expr:
        """The walk's, and at B = 1 a row-parallel linear's backward keeps its output gradient's all-gather twice
        (the view of funcol's output and its wrapper, as the asynchronous gathers do in the forward: measured on
        the stages' last layer, 2,048 B at B = 1, S = 16, H = 32)."""
        found = _SequenceWalk._collectives(self, e, alive, k)
        if e.phase == "backward" and e.node in self.row:
            found += self.once * self._whole(e.node)
        return found

    def extras(self, ops: Any, numbered: dict[int, int] | None = None,
               listed: list[tuple[int, sympy.Expr]] | None = None) -> dict[int, sympy.Expr]:
        """What the collectives add at each of ``ops`` (event indices), beside the storages' sizes: the walk's
        :meth:`~symmem.passes.tensor_step._SequenceWalk._collectives` at the storages alive then.  ``numbered`` and
        ``listed``, where given, are filled with each op's formula's number and (the first op, the formula) of each
        number, in the order they are made (the ops alike share one: a table read by number, not by formula)."""
        tl = self.tl
        numbered = {} if numbered is None else numbered
        listed = [] if listed is None else listed
        wanted = set(ops)
        alive = set(tl.start)
        out: dict[int, sympy.Expr] = {}
        # the walk's rule at each of the thousands of ops builds its formula anew from every gathered copy alive
        # (most of a sequence-parallel pipeline peak), yet Llama-2-7B's 7,869 ops give 20 formulas: each is made
        # once for all it reads (:class:`_Reads`) and found again by it
        made: dict[Any, tuple[sympy.Expr, int]] = {}  # key -> (its formula, its number)
        reads = _Reads(self)
        # and the middle layers of each sweep repeat one layer: their ops' formulas are its ops' (_repeats), the
        # keys of the ops after them read afresh (_Reads.refresh)
        repeats = self._repeats()
        stale = False
        events = tl.events
        k, end = 0, len(events)
        while k < end:
            if k in repeats:
                last, first = repeats[k]
                if not [j for j in range(last - k) if k + j in wanted and first + j not in out]:
                    for j in range(last - k):
                        if k + j in wanted:
                            out[k + j] = out[first + j]
                            numbered[k + j] = numbered[first + j]
                    # what the layer makes and frees, at once (each storage is made once, freed after it is made)
                    alive |= {i for e in events[k:last] for i in e.born}
                    alive -= {i for e in events[k:last] for i in e.freed}
                    stale = True
                    k = last
                    continue
            e = events[k]
            alive.update(e.born)
            if stale:
                reads.refresh(alive, k, e)
                stale = False
            key = reads.at(k, e)
            if k in wanted:
                found = made.get(key)
                if found is None:
                    found = made[key] = (self._collectives(e, alive, k), len(listed))
                    listed.append((k, found[0]))
                out[k], numbered[k] = found
            alive.difference_update(e.freed)
            reads.after(e)
            k += 1
        return out

    def _repeats(self) -> dict[int, tuple[int, int]]:
        """A layer's first written op -> (the op after its last, the first op of its sweep's first repeated layer)
        for the layers 5 to
        ``L - 4`` (written from the template's middle layer, as are the two layers either way of each) but that
        first one: what the walk's rule reads at an op (:class:`_Reads`: the op's storages, by their template
        storage's sizes, and the gathered copies of its own layer and its neighbours', their spans and ends within
        those layers) is then the same at each, so its formula is.  Llama-2-7B's 32 layers: 23 of each sweep's.
        Empty where the step is not numbered from a template (:class:`~.pipeline_layout.Layout`).
        ``tests/test_pipeline_shortcuts.py`` holds it against the walk at every op."""
        from .stretch import _MIDDLE, TEMPLATE

        layout = self.layout
        out: dict[int, tuple[int, int]] = {}
        if layout is None or len(self.tl.events) != layout.ops:
            return out
        lo, hi = TEMPLATE, layout.layers - (TEMPLATE - 1)
        for segment in layout.segments:
            if segment[0] != "sweep" or _MIDDLE not in segment[2]:
                continue
            _, ascending, by_label, _, starts = segment
            x, y = by_label[_MIDDLE]
            first = lo if ascending else hi
            for n in range(lo, hi + 1):
                if n != first:
                    out[starts[n]] = (starts[n] + y - x, starts[first])
        return out


class _Reads:
    """All that :meth:`_SequenceSizes._collectives` (the walk's rule, :meth:`_SequenceWalk._collectives`, and the
    B = 1 all-gather) reads at an op, as one hashable key, kept up to date as the walk goes (:meth:`at` before the
    op's frees, :meth:`after` once they are done): two ops with one key have one formula.

    It reads: the phase; which collective the op is (row- or column-parallel, the attention's, the head's, the
    embedding's) and the op's whole output size; the sizes the op makes and frees (where a branch or a gather at
    this op adds them); what eager attention holds there; and each gathered copy alive that adds something (a
    copy's size, where its gathers and releases are against the op, whether its S-split output is still held,
    whether the op frees it), in the walk's order.  A copy that adds nothing is left out: the rule skips it.  What a
    copy adds changes only at its gathers, releases and its output's end, so only those copies are read again
    there (and every alive copy where the phase changes)."""

    def __init__(self, sizes: _SequenceSizes) -> None:
        self.sizes = sizes
        self.place = {i: n for n, i in enumerate(sizes.copies)}
        # each copy's spans with their counts as one object per value (a key's counts are then compared by identity:
        # each copy's count was a formula of its own, compared by sympy)
        counts: dict[Any, Any] = {}
        self.spans = {i: [(f, r, counts.setdefault(n, n)) for f, r, n in spans]
                      for i, (_, spans) in sizes.copies.items()}
        self.marks: dict[int, list[int]] = {}  # event -> the copies whose part changes there
        for i, (dies, spans) in sizes.copies.items():
            for k in {dies + 1, *(x + d for f, r, _ in spans for x in (f, r) for d in (0, 1))}:
                self.marks.setdefault(k, []).append(i)
        # alive copy -> what it adds at the op (None: nothing); those alive as the step begins read at its first op
        self.parts: dict[int, Any] = dict.fromkeys(i for i in sizes.tl.start if i in sizes.copies)
        self.phase: str | None = None
        self.copies: tuple[Any, ...] | None = None  # the parts that add something, in the walk's order
        self.gathers = False  # whether one of them is gathered at the op
        self.numbers: dict[tuple[Any, ...], int] = {}  # each distinct parts -> its number in the keys
        self.numbered = -1
        self.kinds: dict[Any, tuple[tuple[bool, ...], bool, int | None]] = {}
        every = sizes.every()  # each storage's size on the rank, by index (one per template storage), or by call
        self.local = every.__getitem__ if every is not None else sizes.local
        self._info: dict[int, tuple[int, int, str, bool]] = {}

    def info(self, j: int) -> tuple[int, int, str, bool]:
        """What a key reads of storage ``j`` an op makes (its size on the rank and whole, by object; its name;
        whether it is an input's gradient), once a storage."""
        found = self._info.get(j)
        if found is None:
            st = self.sizes.tl.storages[j]
            found = self._info[j] = (id(self.local(j)), id(st.nbytes), st.name, st.name.endswith(".grad_input0"))
        return found

    def part(self, i: int, k: int, e: Any) -> Any:
        """What alive copy ``i`` adds at op ``k``, as the rule reads it (None: nothing)."""
        dies, spans = self.sizes.copies[i][0], self.spans[i]
        size = id(self.sizes.tl.storages[i].nbytes)
        if e.phase == "forward":
            later = tuple(n for f, _, n in spans if f > k)
            here = tuple(n for f, _, n in spans if f == k)
            held = k <= dies
            return (size, later, held, here) if later or held or here else None
        if e.phase == "backward":
            done = tuple(n for _, r, n in spans if r < k)
            gone = tuple(n for _, r, n in spans if r == k) if i not in e.freed else ()
            return (size, done, gone) if done or gone else None
        return None

    def at(self, k: int, e: Any) -> tuple[Any, ...]:
        """The key of op ``k`` (event ``e``), its storages made (not yet what it frees)."""
        sizes, parts, copies = self.sizes, self.parts, self.sizes.copies
        changed = [i for i in e.born if i in copies] if e.born else []
        if e.phase != self.phase:  # every alive copy read again
            self.phase = e.phase
            changed += list(parts)
        marks = self.marks.get(k)
        if marks is not None:
            changed += [i for i in marks if i in parts]
        for i in changed:
            parts[i] = self.part(i, k, e)
        if changed or self.copies is None:
            self.copies = tuple(parts[i] for i in sorted(parts, key=self.place.__getitem__) if parts[i] is not None)
            self.gathers = any(x[3] for x in self.copies if len(x) == 4)
            # the key holds the parts by a number, one per distinct parts (a tuple's hash is not kept: the
            # nested parts were hashed again at each op's key)
            self.numbered = self.numbers.setdefault(self.copies, len(self.numbers))
        node = e.node
        found = self.kinds.get(node)  # which collective the op is, and its output, once a node
        if found is None:
            g = sizes.g
            kind = (node in sizes.row, node == sizes.embedding, node in sizes.column, node in sizes.qkv,
                    node == sizes.head)
            found = self.kinds[node] = (kind, any(kind), id(g.node(node).out) if node in g else None)
        kind, collective, whole = found
        made = freed = None
        if self.gathers or collective:  # what the op makes and frees, where a branch or a gather here reads them
            info, local = self.info, self.local
            made = tuple((a, b, name == node, c) for a, b, name, c in map(info, e.born))
            freed = tuple(id(local(j)) for j in e.freed)
        else:
            whole = None
        # (empty without eager attention: no walk over them at each op)
        held = tuple(id(size) for start, end, size in sizes.held if start <= k <= end) if sizes.held else ()
        kept = (tuple(id(size) for start, end, size in sizes.cache_kept if start <= k <= end)
                if sizes.cache_kept else ())
        return (e.phase, kind, whole, made, freed, held, kept, self.numbered)

    def refresh(self, alive: set[int], k: int, e: Any) -> None:
        """Every alive copy read at op ``k`` (``e``), after ops that were not walked (:meth:`_SequenceSizes.extras`
        skipped their keys): what a copy adds depends on the op alone (:meth:`part`), the walk only reads it again
        where it changes."""
        copies = self.sizes.copies
        self.parts = {i: self.part(i, k, e) for i in alive if i in copies}
        self.phase = e.phase
        self.copies = None

    def after(self, e: Any) -> None:
        """Op ``e``'s frees done: the copies it freed are no longer read."""
        for i in e.freed:
            if i in self.parts and self.parts.pop(i) is not None:
                self.copies = None


#: :func:`~symmem.passes.batch_of_one.single_copy` as a symbol: 1 at B = 1, else 0
ONCE = sympy.Symbol("single_copy", nonnegative=True, integer=True)


def arms(e: sympy.Expr) -> list[sympy.Expr]:
    """Expressions without ``Max`` whose largest is ``e`` wherever its ``Max``' arguments and their factors are
    not negative (sizes): each moment with a collective's ``Max`` becomes one moment per arm, each a line in B.

    >>> from sympy import Max, symbols
    >>> x, y = symbols("x y", positive=True)
    >>> arms(3 + 2 * Max(x, y, evaluate=False))
    [2*x + 3, 2*y + 3]
    """
    if not e.has(sympy.Max):
        return [e]
    if isinstance(e, sympy.Max):
        return [a for x in e.args for a in arms(x)]
    if isinstance(e, sympy.Add):
        out = [sympy.Integer(0)]
        for term in e.args:
            out = [c + a for c in out for a in arms(term)]
        return out
    if isinstance(e, sympy.Mul):
        out = [sympy.Integer(1)]
        for factor in e.args:
            if factor.is_number and factor.is_negative:  # the largest of -Max(x, y) is no arm's
                raise SymmemError(f"no arms of {e}: a Max times a negative number")
            out = [c * a for c in out for a in arms(factor)]
        return out
    raise SymmemError(f"no arms of {e}")


class _SequenceCut(_TensorCut):
    """A :class:`~symmem.passes.tensor_pipeline._TensorCut` under sequence parallelism: its sizes
    :class:`_SequenceSizes`, its collectives by op."""

    def __init__(self, cut: _Cut, conv: Any, options: Mapping[str, Any]) -> None:
        key = ("sequence sizes", id(cut.tl))
        if key not in cut.memo or cut.memo[key][0] is not cut.tl:
            cut.memo[key] = (cut.tl, _SequenceSizes(cut, conv, options))
        cut.memo[("tensor sizes", id(cut.tl))] = cut.memo[key]
        super().__init__(cut)
        b = self.subs.get(sympy.Symbol("B", positive=True, integer=True))
        self.subs = {**self.subs, ONCE: sympy.Integer(1 if b == 1 else 0)}

    def collectives(self) -> dict[Any, tuple[int, ...]]:
        """What the collectives add at each op of every stage, by its event index: the bytes of each arm of the
        walk's formula (:func:`arms`); the head's forward also its local logits and the all-gather's output beside
        its wrapper (as on the p x t mesh)."""
        if "_extras" in self.__dict__:
            return self._extras
        memo = self._arms()
        values = self._values()
        table = [values[id(each)] for _, each in memo["distinct"]]
        out = {k: table[n] for k, n in memo["which"].items()}
        for k in memo["heads"]:
            out[k] = self._head(k, out[k])
        self._extras = out
        return out

    def _arms(self) -> dict[str, Any]:
        """Each op's arms (``arms``: event index -> the arms of its formula, one tuple for the ops alike; ``which``:
        event index -> that tuple's place in ``distinct``) and the head's forwards (``heads``), found once for every
        cut of the step (their numbers differ, not the step)."""
        memo = self.memo.setdefault(("sequence extras", id(self.tl)), {})
        if "arms" not in memo:
            sizes = self.sizes
            ops = [k for found in self.passes for kind in ("F", "B") for k, _ in found[kind]]
            # the head's forwards, whose logits are added at each batch (found once, not at each cut)
            memo["heads"] = [k for k in ops if self.tl.events[k].phase == "forward" and
                             self.tl.events[k].node == sizes.head]
            # each op's formula by its number (``numbered``), the numbers' formulas in the order the ops first
            # have them (``listed``: Llama-2-7B's 7,869 ops, ~20 formulas): each formula's arms once, and the ops'
            # tables made by number (each op's formula was hashed, or its object's id read, at each op)
            numbered: dict[int, int] = {}
            listed: list[tuple[int, sympy.Expr]] = []
            sizes.extras(ops, numbered, listed)
            made: dict[Any, int] = {}  # a formula -> its arms' place in ``distinct``
            memo["distinct"] = distinct = []  # (the first op, its arms) of each distinct arms, in the ops' order
            place = []  # a formula's number -> its arms' place in ``distinct``
            for k, e in listed:  # (formulas alike by value from other keys share their arms, as before)
                n = made.get(e)
                if n is None:
                    n = made[e] = len(distinct)
                    distinct.append((k, tuple(dict.fromkeys(arms(e)))))
                place.append(n)
            memo["which"] = which = {k: place[n] for k, n in numbered.items()}
            memo["arms"] = {k: distinct[n][1] for k, n in which.items()}
        return memo

    def _values(self) -> dict[int, tuple[int, ...]]:
        """The bytes of each op's arms at the cut's numbers, by the arms' tuple (``id``): each evaluated once."""
        if "_arm_values" not in self.__dict__:
            self._arm_values = {id(each): tuple(_integer(e, self.subs, f"the collectives at op {k}") for e in each)
                                for k, each in self._arms()["distinct"]}
        return self._arm_values

    def _head(self, k: int, found: tuple[int, ...]) -> tuple[int, ...]:
        """``found`` (the head's forward ``k``'s arms' bytes) with its local logits and the all-gather's output."""
        e = self.tl.events[k]
        whole = sum(self.full(i) for i in e.born if self.tl.storages[i].name == e.node)
        t = self.ranks()
        return tuple(x + whole + whole // t for x in found)


class _SequencePackedCut(_TensorPackedCut):
    """:class:`_SequenceCut` at three batches, packed (:class:`~symmem.passes.tensor_pipeline._TensorPackedCut`)."""

    def collectives(self) -> dict[Any, tuple[int, ...]]:
        if "_extras" not in self.__dict__:
            cuts: list[Any] = self.tcuts
            memo = cuts[0]._arms()  # the cuts' one step (model_parallel.batch_moments packs no others): its arms
            # the ops share a few arms (the same tuple: _SequenceCut._arms), each with its bytes at every cut's
            # numbers: each packed once, and the ops' table made in one pass (each cut's table was made and read)
            values = [c._values() for c in cuts]
            packed: list[tuple[int, ...]] = []  # by the arms' place in ``distinct``
            for _, each in memo["distinct"]:
                three = [v[id(each)] for v in values]
                packed.append(tuple(_pack([x[j] for x in three]) for j in range(len(three[0]))))
            self._extras = {k: packed[n] for k, n in memo["which"].items()}
            for k in memo["heads"]:
                three = [c._head(k, v[id(memo["arms"][k])]) for c, v in zip(cuts, values, strict=True)]
                self._extras[k] = tuple(_pack([x[j] for x in three]) for j in range(len(three[0])))
        return self._extras


class _SequenceReplay(_TensorReplay):
    """One stage's replay on a tensor-parallel rank under sequence parallelism: at each op what the collectives
    add for it (:meth:`_SequenceCut.collectives`)."""

    arms: tuple[int, ...] = (0,)

    def begin(self, kind: str, mb: int) -> None:
        from .model_parallel import _ops

        super().begin(kind, mb)
        self._index = [k for k, _ in _ops(self.cut, self.pass_, kind)[self.s]]

    def _acting(self, pass_: int, kind: str) -> Any:
        if type(self).before is not _SequenceReplay.before or type(self).moment is not _SequenceReplay.moment \
                or type(self).after is not _SequenceReplay.after:
            return None
        return self._tensor_acting(pass_, kind)

    def _tensor_acting(self, pass_: int, kind: str) -> frozenset[int]:
        """The ops whose collectives add a moment's bytes (any arm but a single 0), and the head's backward: at
        every other op the one moment is the stage alone's."""
        found = self.__dict__.setdefault("_tensor_acts", {})
        key = (pass_, kind)
        if key not in found:
            from .model_parallel import _ops

            extras, head, backward = self._extras, self.tcut.sizes.head, kind == "B"
            index = [k for k, _ in _ops(self.cut, pass_, kind)[self.s]]
            found[key] = frozenset({i for i, (node, _, _) in enumerate(self._plan(pass_, kind))
                                    if extras.get(index[i], (0,)) != (0,) or (backward and node == head)})
        return found[key]

    def before(self, kind: str, node: str | None, mb: int) -> None:
        # ``_at``: the op's index in the plan (set by _Replay._hooked)
        self.arms = self._extras.get(self._index[self._at], (0,))
        self.fix = None
        if kind == "B" and node == self.tcut.sizes.head:
            # the cross-entropy's whole logits gradient (a storage of its own): DTensor copies the rank's columns
            # out of it (V/t wide) and lets it go before the head's gradient mms (as on the p x t mesh,
            # _TensorReplay.before; the walk, measured with the loss sum, holds it to the op's end)
            dying = self._ops[self._at][2]
            gone = sum(self.alive.get((mb, sid), 0) for sid in dying
                       if self.cut.tl.storages[sid].category == "activation_grad")
            if gone:
                self.fix = (self.live, gone, self.tcut.logits_grad())

    def moment(self, live: int, node: str | None, mb: int | None) -> None:
        # none of the p x t mesh's other fixes (_TensorReplay.moment): the walk's collectives hold them; one moment
        # per arm of their Max (each a line in B)
        gone = 0
        if self.fix is not None:
            base, gone, local = self.fix
            if base is not None:  # the copy beside the whole gradient, before the op's gradients are made
                _Replay.moment(self, base + local, node, mb)
                self.fix = (None, gone, local)
        for extra in self.arms:
            _Replay.moment(self, live + extra - gone, node, mb)

    def after(self, kind: str, node: str | None, mb: int) -> None:
        self.arms, self.fix = (0,), None


class _MeshSequenceReplay(_MeshReplay, _SequenceReplay):
    """One stage's replay on one rank of the 3-D mesh under sequence parallelism: FSDP2's units around the ops
    (:class:`~symmem.passes.fsdp_tensor_pipeline._MeshReplay`), the sequence-parallel collectives inside them
    (:class:`_SequenceReplay`)."""

    def begin(self, kind: str, mb: int) -> None:
        _FsdpReplay.begin(self, kind, mb)
        _SequenceReplay.begin(self, kind, mb)
        # FSDP's hooks act at their own ops only (_FsdpReplay._fsdp_acting; no-ops at the rest): at the
        # collectives' other ops (most of the ops hooked here) they are not called (a traced module's replay, not
        # pure, calls them at every op)
        self._fsdp_here = self._fsdp_acting(0 if mb == 0 else 1, kind) if self._pure else None

    def _acting(self, pass_: int, kind: str) -> Any:
        return mesh_acting(self, _MeshSequenceReplay, _MeshSequenceReplay, pass_, kind)

    def before(self, kind: str, node: str | None, mb: int) -> None:
        here = self._fsdp_here
        if here is None or self._at in here:
            _FsdpReplay.before(self, kind, node, mb)
        _SequenceReplay.before(self, kind, node, mb)

    def moment(self, live: int, node: str | None, mb: int | None) -> None:
        _SequenceReplay.moment(self, live, node, mb)

    def after(self, kind: str, node: str | None, mb: int) -> None:
        _SequenceReplay.after(self, kind, node, mb)
        here = self._fsdp_here
        if here is None or self._at in here:
            _FsdpReplay.after(self, kind, node, mb)


def split_buffers(at: dict[str, int], memory: Any, numbers: Mapping[str, int]) -> dict[str, int]:
    """A stage's parts ``at`` with its receive buffers S-split (``(B, S/t, H)``, what crosses a boundary under
    sequence parallelism); the module's own buffers (the rotary frequencies) whole."""
    own = memory.at(numbers, ("module_buffers",))["module_buffers"]
    less = (at["buffers"] - own) - (at["buffers"] - own) // int(numbers["t"])
    out = dict(at)
    for part in ("buffers", "at_rest", "step_peak"):
        if part in out:
            out[part] -= less
    return out


@dataclass(eq=False)
class SequencePipelineStep(TensorPipelineStep):
    """:class:`~symmem.passes.tensor_pipeline.TensorPipelineStep` under torchtitan's sequence-parallel plan (the
    module's note): each stage's replay is :class:`_SequenceReplay`, the receive buffers S-split."""

    def _replay(self) -> type[_TensorReplay]:
        return _SequenceReplay

    def _packing(self) -> type[_TensorPackedCut]:
        return _SequencePackedCut

    def _make_cut(self, plain: _Cut) -> _TensorCut:
        return _SequenceCut(plain, self.conv, self.options)

    def _parts(self, cut: _TensorCut, s: int, memory: Any, numbers: Mapping[str, int]) -> dict[str, int]:
        return split_buffers(stage_at(cut, s, memory, numbers), memory, numbers)

    def _peak(self, named: dict[str, int]) -> Any:
        return _packed_from_one(self, named, self._ranked, lambda n: TensorPipelineStep._peak(self, n))

    def _no_line_from_one(self, named: Mapping[str, int]) -> bool:
        return no_line_from_one(named)


def _packed_from_one(step: Any, named: dict[str, int], ranked: Callable[[Any, Mapping[str, int]], Any],
                     alone: Callable[[Mapping[str, int]], Any]) -> Any:
    """``step``'s peak at ``named`` (:func:`with_batch_of_one`): at B = 1, B = 1's bytes and the lines from B = 2 from
    one replay packed at B = 1, 2, 3, 4 -- the replay's steps do not depend on the bytes (each op's collectives are
    the arms of one formula at every batch), so each batch's moments are its own replay's
    (tests/test_pipeline_shortcuts.py holds it against the two replays); ``ranked(lines, numbers)`` turns a batch's
    lines into the peak; ``alone(numbers)``: the peak where the replay cannot be packed so, or B is not 1."""
    if named.get(BATCH) == 1:
        found = step._batch_moments(named, 1, count=4)
        if found is not None:
            one = [([rows[0]] * 3, [parts[0]] * 3) for rows, parts in found]
            above = [(rows[1:], parts[1:]) for rows, parts in found]
            return with_batch_of_one(lambda n: ranked(
                step._lines(n, 1, None, one) if n[BATCH] == 1 else step._lines(n, n[BATCH], n[BATCH], above), n),
                named)
    return with_batch_of_one(alone, named)


@dataclass(eq=False)
class FsdpSequencePipelineStep(FsdpTensorPipelineStep):
    """:class:`~symmem.passes.fsdp_tensor_pipeline.FsdpTensorPipelineStep` (torchtitan's 3-D mesh) under its
    sequence-parallel plan: each stage's replay is :class:`_MeshSequenceReplay`, the receive buffers S-split."""

    def _replay_class(self) -> type[_MeshReplay]:
        return _MeshSequenceReplay

    _packing = SequencePipelineStep._packing
    _make_cut = SequencePipelineStep._make_cut

    def _stage_at(self, memory: Any, numbers: Mapping[str, int], units: Any, per: int) -> dict[str, int]:
        return split_buffers(FsdpTensorPipelineStep._stage_at(self, memory, numbers, units, per), memory, numbers)

    def _peak(self, named: dict[str, int]) -> Any:
        # FSDP's units are alike at every batch (no parameter's shape is in B): one replay packed at B = 1..4 too, not
        # a replay at B = 1 and another at B = 2, 3, 4 (a third of this row's calls)
        return _packed_from_one(self, named, self._meshed, lambda n: FsdpTensorPipelineStep._peak(self, n))

    def _no_line_from_one(self, named: Mapping[str, int]) -> bool:
        return no_line_from_one(named)


def no_line_from_one(named: Mapping[str, int]) -> bool:
    """At B = 1 every stage keeps the asynchronous all-gathers' second copy (:data:`ONCE`: each stage has layers,
    each layer column-parallel linears whose inputs are all-gathered over S), which no line through B = 2 and 3
    holds: the lines read from B = 1 are always refused (a replay of every stage at three batches), so B = 1 is read
    alone at once (``tests/test_pipeline_shortcuts.py`` holds it against the lines' attempt)."""
    return named.get("B") == 1


def with_batch_of_one(peak_of: Any, named: dict[str, int]) -> Any:
    """The peak at ``named`` (``peak_of``: the step's); at B = 1, where the asynchronous all-gathers keep two
    copies (:data:`ONCE`) so that the moments are no lines from B = 1, the lines of B >= 2 beside B = 1's bytes as
    constants, where that is exact at every B: no line at B = 1 above B = 1's bytes, and B = 1's bytes not above
    the peak at B = 2 (the peak grows with B; checked for the steady and the first step, else B = 1 alone, its
    domain ``B = 1``).  So ``fit`` and ``plot`` solve from the defaults' B = 1."""
    from ..peak import Peak

    at_one = peak_of(named)
    batch = sympy.Symbol("B", positive=True, integer=True)
    if named.get("B") != 1 or sympy.Eq(batch, 1) not in at_one.domain:
        return at_one
    above = peak_of({**named, "B": 2})
    for step in ("steady", "first"):
        one = at_one.value({batch: 1}, step)
        lines = [m.value({batch: 1}) for m in above.moments if m.step == step]
        if one is None or max(lines) > one or above.value({batch: 2}, step) < one:
            return at_one
    domain = tuple(c for c in above.domain if batch not in c.free_symbols)
    return Peak(None, None, above.moments + at_one.moments, domain)
