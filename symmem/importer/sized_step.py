"""The peak of the training step in every size: the step recorded at the fit's small configurations, each of its
storages' bytes the exact polynomial in the sizes through them.

A formula in the sizes (:mod:`symmem.importer.symbolic_sizes`) comes from traces at small configurations; so does
its step.  At each configuration the module is built and its training step recorded op by op on fake tensors
(:func:`symmem.importer.recording.record_step`, the input sizes B, S symbolic), the repeated blocks written out 4
and 5 times as for any traced peak (:mod:`symmem.importer.traced_step`).  The records must line up: the same ops in
the same order making and freeing the same storages -- then every moment of the step is the same set of storages at
every configuration, and each storage's bytes is fitted as the exact polynomial in the sizes (probes at three
values of each variable, then its grid, as the kept storages are).  The fitted records at 4 and 5 layers fold to
the layer count ``L`` moment by moment, and the one peak algebra (:func:`symmem.peak.summarize`) gives the
``Max`` of the moments that can be largest, in every size.

Checked, mandatory: each fitted record at a configuration never fitted (every variable moved), storage by
storage; and the fold's every moment at another configuration never fitted, written out 6 times.  A size that
decides which ops run (the records do not line up) is refused with the op where they part.

The domain: the input sizes >= 2, the plan's own conditions and the forward's guards as the fit lifted them from
every trace it read (:func:`symmem.importer.symbolic_sizes._guards_of_fit`: ``S <= H/4``).  The step runs that
forward, so past a guard it runs the other branch: the peak at such numbers is refused in
:meth:`~symmem.derivation.Derivation.at`'s words (``H = 26, S = 7 lie outside the formulas' domain (S <= H/4
fails)``), where the formula said 17,648 bytes and a real step peaks at 16,192 (stop 43).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import sympy

from ..derivation import outside
from ..errors import SymmemError
from ..peak import Candidate, Peak
from .inputs import check_inputs, sym_for
from .recording import StepOptions, StepRecord
from .symbolic_sizes import LAYERS, Plan, _degree, _interpolate, built
from .traced_step import COUNTS, StepPeak, _keyed, _node, _peak, peak_of

#: layer counts the fitted records are written out at (the fold's two) and the one the fold is checked at
FITTED, CHECKED = COUNTS[:2], COUNTS[2]
#: whether a configuration the fit traced records its step in that trace's fake world (False: built and recorded
#: afresh, the slow path the fast one is compared with); a world the fit's traces shared (importer.fit_world) is
#: the step's of the first configuration that claims it, the others' steps record in worlds of their own
SEEDED = True

Key = tuple[Any, ...]


def _shape(rec: StepRecord) -> tuple[Any, ...]:
    """What must agree between two configurations' records: every storage but its bytes, every op."""
    return (rec.start, rec.freed_first,
            tuple((s.category, s.dtype, s.op, s.where, s.module, s.step, s.phase, s.host) for s in rec.storages),
            tuple((o.step, o.phase, o.op, o.where, o.module, o.born, o.freed, tuple(i for i, _ in o.resized))
                  for o in rec.ops))


def _quantities(rec: StepRecord) -> dict[Key, tuple[Any]]:
    out: dict[Key, tuple[Any]] = {("s", s.sid): (sympy.expand(sympy.sympify(s.nbytes, strict=True)),)
                                  for s in rec.storages}
    for o in rec.ops:
        for j, (_, b) in enumerate(o.resized):
            out[("r", o.index, j)] = (sympy.expand(sympy.sympify(b, strict=True)),)
    return out


def _parting(a: StepRecord, b: StepRecord) -> str:
    """Where two records part: the first op (or storage) that differs."""
    oa, ob = _shape(a)[3], _shape(b)[3]
    for i in range(max(len(oa), len(ob))):
        x = oa[i] if i < len(oa) else None
        y = ob[i] if i < len(ob) else None
        if x != y:
            if x and y and x[:3] == y[:3]:  # the same op: what it makes or frees differs
                what = "makes" if x[5] != y[5] else ("frees" if x[6] != y[6] else "grows")
                return f"op {i} of the step, {x[1]} {x[2]} in {x[3] or x[4] or 'the module'}, {what} other storages"
            return (f"op {i} of the step: {x[1] + ' ' + x[2] if x else 'none'} vs "
                    f"{y[1] + ' ' + y[2] if y else 'none'}")
    return "the storages the ops make"


@dataclass
class SizedStep:
    """The :class:`~symmem.step.Step` of a formula in every size (module docstring): records made on demand."""

    build: Callable[..., Any]
    dims: dict[str, Any]
    plan: Plan
    options: StepOptions
    device: str
    training: bool
    repeat: tuple[str, tuple[str, ...]] | None
    symbol: sympy.Symbol | None
    numbers: dict[sympy.Symbol, int] = field(default_factory=dict)
    #: the symbols kept at their numbers (those not in ``free=``), written into the peak's formulas
    subs: dict[sympy.Symbol, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: the fit's traced modules by sizes (:func:`symmem.importer.symbolic_sizes.worlds`): a record there runs in the
    #: forward's fake world
    worlds: dict[tuple[tuple[str, int], ...], Any] = field(default_factory=dict, repr=False)
    #: the forward's guards as the fit lifted them (every trace it read: :func:`symmem.importer.symbolic_sizes.
    #: _guards_of_fit`), beyond the plan's own conditions: the step runs the forward, so its peak holds where they do
    #: (``S <= H/4``: past it the forward takes the other branch and the step keeps other tensors)
    guards: tuple[Any, ...] = ()
    #: the model's own limits among ``guards`` (a position table: :func:`symmem.importer.limits.sized_limits`), each
    #: with why: past one the real module refuses the sizes, so there is no step to give the peak of
    limits: dict[Any, str] = field(default_factory=dict, repr=False)
    _steps: dict[tuple[int, ...], StepPeak] = field(default_factory=dict, repr=False)
    _fits: dict[int | None, StepRecord] = field(default_factory=dict, repr=False)
    _peaks: dict[Any, Peak] = field(default_factory=dict, repr=False)

    @property
    def folds(self) -> bool:
        return self.repeat is not None and self.symbol is not None

    def _step(self, point: tuple[int, ...]) -> StepPeak:
        if point not in self._steps:
            sizes = self.plan.sizes_at(point)
            module, example, world = self.worlds.get(tuple(sorted(sizes.items()))) or (*built(self.build, sizes), None)
            module.train(self.training)
            inputs = check_inputs(example, self.dims)
            symbols = {n: sym_for(n) for n in inputs.examples}
            step = StepPeak(module, inputs, symbols, dict(inputs.examples), self.options, self.device, None, None,
                            self.repeat, self.symbol)
            # the fit traced this module at these sizes: its step runs in that forward's fake world, as a traced
            # module's step does (importer.traced.step_of)
            step.seed(world)
            self._steps[point] = step
        return self._steps[point]

    def _record(self, point: tuple[int, ...], count: int | None) -> StepRecord:
        return self._step(point).record(count)

    @property
    def records(self) -> int:
        return sum(len(s._records) for s in self._steps.values())

    def fitted(self, count: int | None) -> StepRecord:
        """The step written out with ``count`` layers (None: as built), every storage's bytes in the sizes."""
        if count not in self._fits:
            self._fits[count] = _fit(self.plan, lambda p: self._record(p, count))
        return self._fits[count]

    def _domain(self, layers: Any) -> tuple[Any, ...]:
        dims = tuple(sympy.Ge(sym_for(n), 2) for n in self.dims)
        sizes = tuple(c for c in self.plan.domain() if not (self.symbol is not None and c.has(self.symbol)))
        return tuple(dict.fromkeys((*layers, *dims, *sizes, *self.guards)))

    def _symbolic(self) -> Peak:
        if None not in self._peaks:
            if self.folds:
                assert self.symbol is not None
                a, b = (self.fitted(n) for n in FITTED)
                self._check_fold(a, b)
                self._peaks[None] = _folded(a, b, self.symbol, self.numbers,
                                            self._domain((sympy.Ge(self.symbol, FITTED[0]),)), self.subs)
                how = (f"the layers written out {FITTED[0]} and {FITTED[1]} times, folded to {self.symbol} and "
                       f"checked at {CHECKED} (holds for {self.symbol} >= {FITTED[0]})")
            else:
                self._peaks[None] = peak_of(self.fitted(None), subs=self.subs, numbers=self.numbers,
                                            domain=self._domain(()))
                how = "the module's own layers"
            self.notes.append(f"peak in every size: the training step recorded at {len(self._steps)} small "
                              f"configurations ({self.records} records, {how}), each storage the exact polynomial "
                              "in the sizes through them, checked at configurations never fitted")
        return self._peaks[None]

    def _check_fold(self, a: StepRecord, b: StepRecord) -> None:
        """Every moment of the fold at a configuration never fitted, the layers written out :data:`CHECKED` times."""
        two = tuple(v.values[4] if not v.fixed else v.values[0] for v in self.plan.variables)
        real = self._record(two, CHECKED)
        subs = {sym_for(n): v for n, v in self.plan.sizes_at(two).items() if n != LAYERS}
        for step in ("steady", "first"):
            ka, kb, kc = _keyed(a, step), _keyed(b, step), _keyed(real, step)
            if set(ka) != set(kc):
                raise SymmemError(f"the {step} step's ops at {self.plan.sizes_at(two)} with {CHECKED} layers differ "
                                  f"from the fitted ones: the layers do not repeat alike; trace without sizes= for "
                                  "the peak")
            for key, (o, la, _, place) in ka.items():
                lb = kb[key][1]
                want = sum(((la[x] + (lb[x] - la[x]) * (CHECKED - FITTED[0])) * x[1] for x in set(la) | set(lb)),
                           sympy.Integer(0))
                got = sum((n * x[1] for x, n in kc[key][1].items()), sympy.Integer(0))
                if sympy.expand(sympy.sympify(want, strict=True).xreplace(subs) - got) != 0:
                    raise SymmemError(f"the peak in every size misses the step at {self.plan.sizes_at(two)} with "
                                      f"{CHECKED} layers after {_node(o, place)} ({step} step): the layers do not "
                                      "fold to L in every size; trace without sizes= for the peak")

    # -- the Step interface ----------------------------------------------------------------------------------
    def domain(self) -> tuple[Any, ...]:
        if None in self._peaks:
            return tuple(self._peaks[None].domain)
        return self._domain((sympy.Ge(self.symbol, FITTED[0]),) if self.folds else ())

    def holds_at(self, numbers: Mapping[sympy.Symbol, int]) -> bool:
        return all(bool(sympy.sympify(c, strict=True).xreplace(dict(numbers))) for c in self.domain())

    def peak(self, at: Mapping[sympy.Symbol, int] | None = None) -> Peak:
        if at is None:
            return self._symbolic()
        at = dict(at)
        count = at.get(self.symbol) if self.folds else None
        past = outside(sympy.And(*self.limits), at, self.limits) if self.limits else ()
        if past:  # Derivation.at's words, with why: the module itself refuses these sizes
            raise SymmemError(f"the peak in every size: {'; '.join(past)} (the module refuses these sizes)")
        branch = outside(sympy.And(*self.guards), at)  # each guard every size of it has a number for
        if branch:  # Derivation.at's words: past a guard the forward takes another branch, the step keeps others
            raise SymmemError(f"the peak in every size: {'; '.join(branch)} (the forward takes another branch there "
                              "than at every configuration the fit traced): trace without sizes= at them for the peak")
        rest = [c for c in self.domain() if not (self.symbol is not None and c.has(self.symbol)) and c not in
                self.guards]
        failing = [c for c in rest if not bool(sympy.sympify(c, strict=True).xreplace(at))]
        if failing:
            raise SymmemError(f"the peak in every size holds where {' & '.join(map(str, failing))}, which these "
                              "sizes are not: trace without sizes= at them for the peak")
        if count is None or count >= FITTED[0]:
            return self._symbolic()
        key = int(count)
        if key not in self._peaks:
            rec = self.fitted(key)
            layers = rec.layers
            self._peaks[key] = peak_of(rec, subs={k: v for k, v in self.subs.items() if k != self.symbol},
                                       numbers={**self.numbers, **at},
                                       domain=self._domain((sympy.Eq(self.symbol, key),)), layers=layers)
        return self._peaks[key]

    def _refuse(self, *args: Any) -> Any:
        raise SymmemError("the op-by-op step of a formula in every size is given at one configuration: trace "
                          "without sizes= at those sizes for its timeline (the peak and its moment are here)")

    timeline = allocated = _refuse


@dataclass
class TensorSizedStep(SizedStep):
    """:class:`SizedStep` under tensor parallelism: each configuration's step is one rank's, recorded on fake
    DTensors under the module's plan (``base``, the :class:`~symmem.importer.traced_tensor.TensorStepPeak` of the
    module built at the fit's base configuration, makes each configuration's), the declared sizes symbolic; the
    records fitted and folded as one device's are.  The rank keeps after the forward what the fitted record with the
    layers written out 4 times holds there (:meth:`kept`).  At the ``t`` of the derivation: each
    configuration's shards split evenly (refused in one line where one does not)."""

    base: Any = None
    #: every parameter's shape in the sizes (the trace's): a sharded dimension's must divide by ``t``
    shapes: dict[str, tuple[Any, ...]] = field(default_factory=dict)

    def _step(self, point: tuple[int, ...]) -> StepPeak:
        if point not in self._steps:
            module, example = built(self.build, self.plan.sizes_at(point))
            module.train(self.training)
            inputs = check_inputs(example, self.dims)
            # the input sizes' hints at the derivation's numbers: a batch below t takes other guards (B < 8 at t = 8)
            hints = {n: int(self.numbers.get(sym_for(n), v)) for n, v in inputs.examples.items()}
            self._steps[point] = self.base.like(module, inputs, {n: sym_for(n) for n in inputs.examples}, hints)
        return self._steps[point]

    def _record(self, point: tuple[int, ...], count: int | None) -> StepRecord:
        try:
            return self._step(point).symbolic_record(count)  # type: ignore[attr-defined]
        except SymmemError as e:
            hint = (": the fit's configurations must split over t (give such a size a multiple of t, "
                    "divisible={'F': t})") if "does not divide" in str(e) else ""
            raise SymmemError(f"the tensor-parallel step in every size, at {self.plan.sizes_at(point)}: {e}{hint}"
                              ) from None

    def _domain(self, layers: Any) -> tuple[Any, ...]:
        """One device's domain, ``t``, the guards the rank's step took (at the base configuration) and every sharded
        dimension dividing by ``t`` (DTensor pads the last shard otherwise: the ranks would differ)."""
        world = self.base._fixed({})[2]
        rec = self._record(self.plan.base, FITTED[0] if self.folds else None)  # made for the fit too
        step = self._step(self.plan.base)
        split = []
        for name, dim in step.sharded:  # type: ignore[attr-defined]
            size = sympy.sympify(self.shapes[name][dim], strict=True) if name in self.shapes else sympy.Integer(0)
            if size.free_symbols:
                split.append(sympy.Eq(sympy.Mod(size, world), 0))
        return tuple(dict.fromkeys((*super()._domain(layers), *(g.expr for g in rec.guards), *split,
                                    *self.base._fixed_domain(None, world))))

    def kept(self) -> tuple[list[tuple[str, Any, str, int | None]], tuple[Any, ...], int | None]:
        """What the rank's autograd keeps at the forward's end, each storage's bytes in the sizes (``(module, bytes,
        op, block)``, as :meth:`~symmem.importer.traced_tensor.TensorStepPeak.kept`), where it holds, and the layer
        count of the record read (the fold's first, or the module's own where the blocks do not fold)."""
        count = FITTED[0] if self.folds else None
        rec = self.fitted(count)
        return self.base.kept_in(rec), self._domain(()), rec.count

    def per_rank(self, numbers: Mapping[sympy.Symbol, int]) -> dict[str, Any]:
        """Every rank's steady-step peak at ``numbers`` (all alike: the plan splits evenly), rank 0 named."""
        merged = {**self.numbers, **dict(numbers)}
        return {"peak_per_rank": [int(self.peak(merged).value(merged))] * self.base._fixed({})[2], "peak_rank": 0}


def _fit(plan: Plan, record: Callable[[tuple[int, ...]], StepRecord]) -> StepRecord:
    """The record at every configuration, each storage's bytes the exact polynomial in the sizes (checked at a
    configuration never fitted)."""
    base = plan.base
    first = record(base)
    shape = _shape(first)
    cache: dict[tuple[int, ...], dict[Key, tuple[Any]]] = {}

    def values(p: tuple[int, ...]) -> dict[Key, tuple[Any]]:
        if p not in cache:
            rec = record(p)
            if _shape(rec) != shape:
                raise SymmemError(f"the training step runs differently at {plan.sizes_at(p)} than at "
                                  f"{plan.sizes_at(base)} ({_parting(first, rec)}): a size decides which ops run, so "
                                  "the step's moments do not line up in the sizes; keep that size fixed, or trace "
                                  "without sizes= at the sizes you want for the peak")
            cache[p] = _quantities(rec)
        return cache[p]

    def point(changes: Mapping[int, int]) -> tuple[int, ...]:
        return tuple(changes.get(i, x) for i, x in enumerate(base))

    keys = list(values(base))
    one = tuple(v.values[3] if not v.fixed else v.values[0] for v in plan.variables)
    subs = {sym_for(n): x for n, x in plan.sizes_at(one).items() if n != LAYERS}
    back = plan.back()
    for probes in (2, 3):  # lines first (most storages), then parabolas (a weight H x H) where a line misses
        degrees: dict[Key, dict[int, int]] = {k: {} for k in keys}
        for i, v in enumerate(plan.variables):
            if v.fixed:
                continue
            xs = v.values[:probes]
            runs = [values(point({i: x})) for x in xs]
            for k in keys:
                e = _degree([r[k][0] for r in runs], xs)
                if e:
                    degrees[k][i] = e
        grids = {k: sorted(d.items()) for k, d in degrees.items()}
        needed = {point(dict(zip([i for i, _ in g], combo, strict=True))) for g in grids.values()
                  for combo in itertools.product(*[plan.variables[i].values[:e + 1] for i, e in g])}
        quantities = {p: values(p) for p in sorted(needed)}
        formulas = {k: sympy.expand(sympy.sympify(_interpolate(k, 0, grids[k], plan, base, quantities),
                                                  strict=True).xreplace(back)) for k in keys}
        if all(v.fixed for v in plan.variables):
            break
        got = values(one)
        miss = next((k for k in keys if sympy.expand(formulas[k].xreplace(subs) - got[k][0]) != 0), None)
        if miss is None:
            break
        if probes == 3:
            s = first.storages[miss[1]] if miss[0] == "s" else None
            what = f"{s.category} made by {s.op or 'the step'} in {s.where or s.module or 'the module'}" if s else miss
            raise SymmemError(f"the peak in every size: the {what} reads a size in a way no polynomial of degree "
                              f"<= 2 expresses (at {plan.sizes_at(one)} it is {got[miss][0]} bytes, "
                              f"{formulas[miss].xreplace(subs)} by the polynomial); keep that size fixed")
    storages = tuple(replace(s, nbytes=formulas[("s", s.sid)]) for s in first.storages)
    ops = tuple(replace(o, resized=tuple((i, formulas[("r", o.index, j)]) for j, (i, _) in enumerate(o.resized)))
                if o.resized else o for o in first.ops)
    return replace(first, storages=storages, ops=ops)


def _folded(a: StepRecord, b: StepRecord, symbol: sympy.Symbol, numbers: Mapping[sympy.Symbol, int],
            domain: tuple[Any, ...], subs: Mapping[sympy.Symbol, int] | None = None) -> Peak:
    """The peak in ``symbol`` from fitted records at :data:`FITTED` layers: each moment's storages one more set
    per layer (checked at :data:`CHECKED` by :meth:`SizedStep._check_fold`)."""
    cands: dict[str, list[Candidate]] = {"steady": [], "first": []}
    names: dict[Any, tuple[str, str]] = {}
    for step in ("steady", "first"):
        ka, kb = _keyed(a, step), _keyed(b, step)
        if set(ka) != set(kb):
            raise SymmemError(f"the {step} step's ops differ between {FITTED[0]} and {FITTED[1]} layers: the layers "
                              "do not repeat alike; trace without sizes= for the peak")
        for key, (o, la, cand_a, place) in ka.items():
            _, lb, cand_b, _ = kb[key]
            if not (cand_a or cand_b):
                continue
            parts = {x: (la[x], (lb[x] - la[x],)) for x in sorted(set(la) | set(lb), key=lambda x: (x[0], str(x[1])))}
            cands[step].append(Candidate(key, step, parts))
            names[(step, key)] = (_node(o, place), key[2])
    return _peak(cands, [symbol], dict(subs or {}), numbers, domain, names)


def sized_step(build: Callable[..., Any], recorded: Any, regime: Any, numbers: Mapping[sympy.Symbol, int],
               dims: dict[str, Any], loss: Any, device: str, layers: sympy.Symbol | None, free: Any) -> Any:
    """The derivation's ``step`` for a formula in every size (None or a refusal where a traced module has none:
    :func:`symmem.importer.traced.step_of` decides, on the module built at the fit's base configuration)."""
    from .symbolic_sizes import Stacks
    from .traced import step_of

    if isinstance(recorded.layers, Stacks):
        said = " and ".join(r.path for r in recorded.layers.runs)
        raise SymmemError(f"the peak in every size writes one run of layers out 4 and 5 times, but L counts "
                          f"{said}{' (a first block keeping more)' if recorded.layers.extras else ''}: trace without "
                          "peak=True (--symbolic-peak) for the kept memory in every size, or without sizes= "
                          "(--symbolic) for the peak at one configuration")
    # the step is recorded where the kept tensors were fitted; checked at h/G = 1 they were, the step was not
    plan = replace(recorded.extra["sizes"]["plan"], one=frozenset())
    module, example = built(build, plan.sizes_at(plan.base))
    module.train(recorded.training)
    found = step_of(module, recorded, regime, numbers, example, dims, loss, recorded.extra.get("autocast"), None,
                    device, free)
    if not isinstance(found, StepPeak):
        return found
    rep = recorded.layers
    fields = (build, dict(dims), plan, found.options, device, recorded.training,
              (rep.path, rep.children) if rep is not None else None, layers if rep is not None else None,
              dict(numbers), {} if free is None else {s: v for s, v in numbers.items() if s.name not in free})
    from .traced_tensor import TensorStepPeak

    # the forward's guards (every trace the fit read), not the plan's conditions or the inputs' sizes >= 2 the sized
    # step has already
    known = {*plan.domain(), *recorded.extra["sizes"]["plan"].domain(), *(sympy.Ge(sym_for(n), 2) for n in dims)}
    guards = tuple(c for c in sympy.And.make_args(sympy.sympify(recorded.domain, strict=True))
                   if c is not sympy.true and c not in known)
    limits = {c: why for c, why in recorded.extra.get("limits", {}).items() if c in guards}
    if isinstance(found, TensorStepPeak):  # one rank's step at each configuration
        found._fixed({})  # t a number (else refused in one line)
        return TensorSizedStep(*fields, guards=guards, limits=limits, base=found,
                               shapes={p.name: tuple(p.shape) for p in recorded.parameters})
    return SizedStep(*fields, guards=guards, limits=limits,
                     worlds=dict(recorded.extra["sizes"].get("worlds", {})) if SEEDED else {})
