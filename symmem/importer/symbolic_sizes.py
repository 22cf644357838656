"""Every size symbolic: a module's formula in the sizes it is built from (H, F, h, G, V, L ...), from traces.

A module reads its sizes as Python ints (``nn.Linear(hidden_size, ...)``), so its parameters' shapes cannot be
symbols.  Instead the module is built and traced (fake tensors, the declared input sizes B, S symbolic) at a few
small configurations, and every quantity of the trace -- each kept storage's bytes and shape, each parameter's
shape -- is recovered as the exact polynomial through them:

1. **variables**: a size that must be a multiple of another (``divisible={"H": "h"}``: the head size ``H/h`` is a
   whole number) is traced through its quotient, so ``H = h * (H/h)`` and the formulas stay polynomials in the
   variables (``G * H/h`` for a grouped key projection); a size whose default is 1 stays 1 (its own case);
2. **probes**: each variable alone at three values, the others at a base (``2k + 1`` traces): a quantity's degree
   in each variable (0, 1 or 2) and so the variables it depends on;
3. **grid**: each quantity's tensor grid over the variables it depends on (shared between quantities; most
   points are probes): exact Lagrange interpolation, rational coefficients;
4. **check** (mandatory): two configurations never used for fitting, every variable moved and the layer count
   too: every storage, parameter and total must agree exactly, else :class:`~symmem.errors.SymmemError` names
   the quantity and the sizes it read.

The layer count is the size named ``L``: the repeated blocks fold to ``L`` copies as in any trace (traced at 2
layers, checked at 3).  The domain says what was assumed: each divisibility, each variable at least 2 (1 is a
case of its own: PyTorch specializes size 1), the head size even where it was traced even, and the guards of every
trace the fit read, a bound that moves with the sizes written in them (:func:`_guards_of_fit`; a branch a size moves
where no line says is refused).

>>> plan = Plan.of({"H": 64, "h": 4, "F": 128}, {"H": "h"})
>>> [v.name for v in plan.variables], plan.sizes_at(plan.base)
(['H/h', 'h', 'F'], {'H': 8, 'h': 2, 'F': 24})
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import sympy

from ..errors import SymmemError
from . import fit_world
from .fit_world import FitWorld
from .inputs import sym_for
from .records import Repeat, Trace, TracedParameter, TracedStorage, TracedSymbol

#: the layer count's name: its size is the repeated blocks' count, folded to the symbol L as in any trace
LAYERS = "L"
#: values of a count (heads, groups, an integer multiple): three to fit, two more to check
COUNT_VALUES = (2, 3, 5, 4, 7)
#: values of a quotient by a count (the head size H/h): even, as rotary embeddings need
QUOTIENT_VALUES = (4, 6, 10, 8, 14)
#: the layer count: traced at 2, checked at 3
LAYER_VALUES = (2, 3)
#: refuse plans that need more traces than this
MAX_TRACES = 200
#: ``Trace.extra`` key of :func:`trace_at`'s module and example inputs (the trace's fake world holds it weakly)
BUILT = "built"


@dataclass(frozen=True)
class Variable:
    """One variable of the fit: a size (``F``), or a size's quotient by its divisor (``H/h``)."""

    name: str
    symbol: sympy.Symbol
    size: str
    divisor: str | int | None
    values: tuple[int, ...]  # three fitted, then two checked
    default: int

    @property
    def fixed(self) -> bool:
        return len(self.values) == 1


@dataclass(frozen=True)
class Plan:
    """The sizes, their divisibility and the variables they are traced through."""

    defaults: dict[str, int]
    divisible: dict[str, str | int]
    variables: tuple[Variable, ...]
    #: quotient variables fitted at >= 2 and checked at 1 too (h/G: G = h as well as G < h): the domain says >= 1
    one: frozenset[str] = frozenset()

    @staticmethod
    def of(sizes: Mapping[str, int], divisible: Mapping[str, str | int] | None = None) -> Plan:
        sizes = _check_sizes(sizes)
        div = _check_divisible(dict(divisible or {}), sizes)
        divisors = {m for m in div.values() if isinstance(m, str)}
        variables = []
        plain = 0
        for n, value in sizes.items():
            if n == LAYERS:
                continue
            m = div.get(n)
            if m is None:
                name, default = n, value
                if n in divisors:
                    values = COUNT_VALUES
                else:
                    b = 24 + 16 * plain
                    plain += 1
                    values = (b, b + 8, b + 24, b + 12, b + 20)
            else:
                d = sizes[m] if isinstance(m, str) else m
                name, default = f"{n}/{m}", value // d
                values = COUNT_VALUES if (n in divisors or isinstance(m, int)) else QUOTIENT_VALUES
            if default == 1:  # a case of its own (multi-head attention's G = h): traced there only
                values = (1,)
            symbol = sym_for(n) if m is None else sympy.Symbol(f"q_{n}_{m}", positive=True, integer=True)
            variables.append(Variable(name, symbol, n, m, values, default))
        return Plan(sizes, div, tuple(variables))

    @property
    def base(self) -> tuple[int, ...]:
        return tuple(v.values[0] for v in self.variables)

    @property
    def has_layers(self) -> bool:
        return LAYERS in self.defaults

    def sizes_at(self, point: tuple[int, ...], layers: int = LAYER_VALUES[0]) -> dict[str, int]:
        """The sizes at a point of the variables (a size is its quotient times its divisor's size)."""
        by_size = {v.size: (v, x) for v, x in zip(self.variables, point, strict=True)}
        out: dict[str, int] = {}

        def size(n: str) -> int:
            if n not in out:
                v, x = by_size[n]
                d = 1 if v.divisor is None else (v.divisor if isinstance(v.divisor, int) else size(v.divisor))
                out[n] = x * d
            return out[n]

        for n in self.defaults:
            if n == LAYERS:
                out[n] = layers
            else:
                size(n)
        return {n: out[n] for n in self.defaults}

    def back(self) -> dict[sympy.Symbol, sympy.Expr]:
        """Each quotient variable in the sizes: ``q_H_h -> H/h``."""
        out = {}
        for v in self.variables:
            if v.fixed:
                out[v.symbol] = sympy.Integer(1)
            elif v.divisor is not None:
                d = sympy.Integer(v.divisor) if isinstance(v.divisor, int) else sym_for(v.divisor)
                out[v.symbol] = sym_for(v.size) / d
        return out

    def domain(self) -> list[sympy.Basic]:
        """What the fit assumed: the divisibility, each variable at least 2 (or exactly 1), even quotients."""
        out: list[sympy.Basic] = []
        back = self.back()
        for v in self.variables:
            size = sym_for(v.size)
            expr = back.get(v.symbol, size) if not v.fixed else None
            if v.divisor is not None:
                d = sympy.Integer(v.divisor) if isinstance(v.divisor, int) else sym_for(v.divisor)
                out.append(sympy.Eq(sympy.Mod(size, d), 0))
                if v.fixed:
                    out.append(sympy.Eq(size, d))
                    continue
                if all(x % 2 == 0 for x in v.values):
                    out.append(sympy.Eq(sympy.Mod(size, 2 * d), 0))
                out.append(sympy.Ge(size, d if v.name in self.one else 2 * d))
            elif v.fixed:
                out.append(sympy.Eq(size, 1))
            else:
                out.append(sympy.Ge(expr, 2))
        if self.has_layers:
            out.append(sympy.Ge(sym_for(LAYERS), 2))
        return out


def _check_sizes(sizes: Any) -> dict[str, int]:
    if not isinstance(sizes, Mapping) or not sizes:
        raise SymmemError(f"sizes must map size names to their values, e.g. {{'H': 4096, 'h': 32}}, got {sizes!r}")
    out = {}
    for n, v in sizes.items():
        if not isinstance(n, str) or not n.isidentifier():
            raise SymmemError(f"sizes: {n!r} is not a symbol name (an identifier such as H or d_ff)")
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SymmemError(f"sizes[{n!r}] must be a positive integer (where the formula is evaluated), got {v!r}")
        out[n] = v
    if LAYERS in out and out[LAYERS] < 1:
        raise SymmemError("sizes['L'] (the layer count) must be at least 1")
    return out


def _check_divisible(div: dict[str, Any], sizes: dict[str, int]) -> dict[str, str | int]:
    for n, m in div.items():
        if n not in sizes or n == LAYERS:
            raise SymmemError(f"divisible names {n!r}, which is not among the sizes ({', '.join(sizes)})")
        if isinstance(m, str):
            if m not in sizes or m == n or m == LAYERS:
                raise SymmemError(f"divisible[{n!r}] = {m!r}: the divisor must be another size "
                                  f"({', '.join(x for x in sizes if x != n)}) or a positive integer")
            d = sizes[m]
        elif isinstance(m, int) and not isinstance(m, bool) and m >= 1:
            d = m
        else:
            raise SymmemError(f"divisible[{n!r}] must name a size or be a positive integer, got {m!r}")
        if sizes[n] % d:
            raise SymmemError(f"divisible says {m} divides {n}, but {n} = {sizes[n]} is not a multiple of {d}")
    seen: set[str] = set()
    for n in div:  # no cycles: H/h, h/G, G/H would have no base
        chain, x = [], n
        while isinstance(div.get(x), str) and x not in chain:
            chain.append(x)
            x = div[x]
        if x in chain:
            raise SymmemError(f"divisible is circular: {' -> '.join([*chain, x])}")
        seen |= set(chain)
    return div


# -- the quantities of a trace --------------------------------------------------------------------------
Key = tuple[str, str]


@dataclass(frozen=True)
class Stacks(Repeat):
    """Runs of blocks one size counts, folded together: an encoder's and a decoder's layers (both ``L``), child ``i``
    of every run being layer ``i``, so one layer is one block of each run (the first run names the fold); and a
    run whose first block keeps more than the others (T5's computes the relative position bias): those
    ``extras`` (storages) and ``outside`` (modules) are kept once, outside the fold.  The same interface as
    :class:`~symmem.importer.records.Repeat`."""

    runs: tuple[Repeat, ...] = ()
    extras: frozenset[str] = frozenset()
    outside: frozenset[str] = frozenset()

    @staticmethod
    def of(runs: list[Repeat], extras: frozenset[str] = frozenset(), outside: frozenset[str] = frozenset()
           ) -> Stacks:
        return Stacks(runs[0].path, runs[0].children, tuple(n for r in runs for n in r.storages if n not in extras),
                      sympy.expand(sympy.Add(*[r.bytes for r in runs])), tuple(runs), extras, outside)

    def owns(self, module: str) -> int | None:
        if any(module == m or module.startswith(m + ".") for m in self.outside):
            return None
        return next((i for i in (r.owns(module) for r in self.runs) if i is not None), None)

    def child_of(self, storage: TracedStorage) -> int | None:
        if storage.name in self.extras:
            return None
        return next((i for i in (r.child_of(storage) for r in self.runs) if i is not None), None)


def _child(path: str, i: int) -> str:
    return f"{path}.{i}" if path else str(i)


def _first_special(trace: Trace, taken: list[Repeat]) -> tuple[list[Repeat], set[str], set[str]]:
    """Containers of two blocks at ``L = 2`` whose first block keeps what the second keeps and more (T5's first
    block computes the relative position bias): each a run of two, with the first block's extra storages and
    modules (those the second lacks) to be kept once."""
    mods = {p.name.rsplit(".", 1)[0] for p in trace.parameters if "." in p.name} | {
        s.module for s in trace.storages if s.module}
    paths = {".".join(m.split(".")[:i]) for m in mods for i, x in enumerate(m.split(".")) if x in ("0", "1")}
    runs: list[Repeat] = []
    extras: set[str] = set()
    outside: set[str] = set()
    for path in sorted(paths):
        c0, c1, c2 = (_child(path, i) for i in range(3))
        if any(r.path == path or r.owns(c0) is not None for r in (*taken, *runs)) or any(
                m == c2 or m.startswith(c2 + ".") for m in mods):
            continue
        rep = Repeat(path, (c0, c1), (), sympy.Integer(0))
        sig = {c: {(s.name[len(c):], s.dtype, sympy.srepr(sympy.expand(s.bytes))): s.name
                   for s in trace.of_kind("activation") if s.name.startswith(c) and rep.child_of(s) == i}
               for i, c in enumerate((c0, c1))}
        under = {c: {m[len(c):] for m in mods if m == c or m.startswith(c + ".")} for c in (c0, c1)}
        if not sig[c1] or not set(sig[c1]) < set(sig[c0]) or not under[c1] <= under[c0]:
            continue
        extras |= {n for k, n in sig[c0].items() if k not in sig[c1]}
        outside |= {c0 + m for m in under[c0] - under[c1]}
        runs.append(Repeat(path, (c0, c1), tuple(n for k, n in sig[c0].items() if k in sig[c1]),
                           sympy.expand(sympy.Add(*[s.bytes for s in trace.storages if s.name in sig[c0].values()
                                                    and s.name not in extras]))))
    return runs, extras, outside


def _stacked(trace: Trace) -> Trace:
    """The trace at ``L = 2`` with every run of two blocks (not inside another's blocks) folded together: an
    encoder-decoder's two stacks both count ``L``; blocks after a first that keeps more count too
    (:class:`Stacks`).  One plain run stays as it is."""
    runs = [r for r in trace.repeats if r.count == LAYER_VALUES[0]]
    runs = [r for r in runs if not any(o is not r and o.owns(r.path) is not None for o in runs)]
    special, extras, outside = _first_special(trace, runs)
    if not special and len(runs) < 2:
        return trace
    every = [*runs, *special]
    rest = tuple(r for r in trace.repeats if all(r is not o for o in every))
    return replace(trace, repeats=(Stacks.of(every, frozenset(extras), frozenset(outside)), *rest))


def _itemsize(s: TracedStorage) -> Any:
    return sympy.sympify(s.bytes, strict=True) / s.elements if s.elements != 0 else sympy.Integer(1)


def _quantities(trace: Trace) -> dict[Key, tuple[Any, ...]]:
    """Every quantity of a trace by a name stable across sizes: a storage's shape after what its bytes hold beyond
    that shape (0 for a whole storage: nothing to fit), a parameter's or buffer's shape."""
    out: dict[Key, tuple[Any, ...]] = {}
    for s in trace.storages:
        shape = tuple(sympy.sympify(d, strict=True) for d in s.shape)
        rest = sympy.expand(sympy.sympify(s.bytes, strict=True) - _itemsize(s) * sympy.Mul(*shape))
        out[("storage", s.name)] = (rest, *shape)
    for p in trace.parameters:
        out[("parameter", p.name)] = tuple(sympy.Integer(d) for d in p.shape)
    for b in trace.buffers:
        out[("buffer", b.name)] = tuple(sympy.Integer(d) for d in b.shape)
    return out


def _bytes(s: TracedStorage, formula: tuple[Any, ...]) -> Any:
    """A storage's bytes from its fitted (rest, *shape)."""
    return sympy.expand(formula[0] + _itemsize(s) * sympy.Mul(*formula[1:]))


class Miss(SymmemError):
    """The polynomials missed a configuration never fitted."""


def _degree(ys: list[Any], xs: tuple[int, ...]) -> int:
    """The degree (0, 1 or 2) of the polynomial through (xs[i], ys[i]), two or three points."""
    d1 = [sympy.expand((ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])) for i in range(len(xs) - 1)]
    if all(d == 0 for d in d1):
        return 0
    return 1 if len(d1) == 1 or sympy.expand(d1[1] - d1[0]) == 0 else 2


def _basis(symbol: sympy.Symbol, nodes: tuple[int, ...], i: int) -> sympy.Expr:
    """The Lagrange basis polynomial of node ``i``."""
    out = sympy.Integer(1)
    for j, x in enumerate(nodes):
        if j != i:
            out *= (symbol - x) / sympy.Integer(nodes[i] - x)
    return out


@dataclass
class _Traces:
    """Traces by point, made on demand: ``build`` at the point's sizes, then :func:`trace_module`."""

    plan: Plan
    build: Callable[..., Any]
    dims: dict[str, Any]
    options: dict[str, Any]
    made: dict[tuple[tuple[int, ...], int], Trace]
    seconds: float = 0.0
    #: the (point, layers) of every trace the fit read since its plan was set: whose guards make the domain
    used: set[tuple[tuple[int, ...], int]] = field(default_factory=set, repr=False)
    #: the fake world the fit's traces share where none changes it (:mod:`.fit_world`)
    world: FitWorld = field(default_factory=FitWorld, repr=False)
    _quantities: dict[tuple[int, ...], dict[Key, tuple[Any, ...]]] = field(default_factory=dict, repr=False)

    def at(self, point: tuple[int, ...], layers: int = LAYER_VALUES[0]) -> Trace:
        key = (point, layers)
        self.used.add(key)
        if key not in self.made:
            sizes = self.plan.sizes_at(point, layers)
            start = time.perf_counter()
            self.made[key] = trace_at(self.build, sizes, self.dims, self.options,
                                      world=self.world if fit_world.ONE_WORLD else None)
            self.seconds += time.perf_counter() - start
        return self.made[key]

    def quantities(self, point: tuple[int, ...]) -> dict[Key, tuple[Any, ...]]:
        """:func:`_quantities` of the trace at ``point`` (the layer count as traced), computed once a trace: the
        probes, the grid and the checks read the same traces."""
        self.used.add((point, LAYER_VALUES[0]))
        if point not in self._quantities:  # a point means the same sizes in either plan (fit_sizes)
            self._quantities[point] = _quantities(self.at(point))
        return self._quantities[point]


def worlds(traces: _Traces) -> dict[tuple[tuple[str, int], ...], Any]:
    """The fit's symbolic traces at the layer count a configuration is built with, by their sizes (sorted items):
    ``(module, example_inputs, fake_world)``, the module built there, what it was traced with and the fake world
    its forward ran in (``Trace.extra["fake_world"]``).  The step in every size (:mod:`symmem.importer.sized_step`)
    records the step of that module at those sizes in that world instead of building and tracing it afresh."""
    out = {}
    for (point, layers), t in traces.made.items():
        world, made = t.extra.get("fake_world"), t.extra.get(BUILT)
        if layers == LAYER_VALUES[0] and world is not None and made is not None and world[0]() is made[0]:
            out[tuple(sorted(traces.plan.sizes_at(point, layers).items()))] = (*made, world)
    return out


def built(build: Callable[..., Any], sizes: dict[str, int]) -> tuple[Any, Any]:
    """``build(**sizes)``: the module and its example inputs, or a one-line :class:`SymmemError`."""
    try:
        made = build(**sizes)
    except SymmemError as e:
        raise SymmemError(f"building the module at {sizes}: {e}") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise SymmemError(f"building the module at {sizes} failed ({type(e).__name__}: {first}); sizes that must "
                          "divide one another need divisible={...}") from None
    if not (isinstance(made, tuple) and len(made) == 2):
        raise SymmemError(f"build(**sizes) must return (module, example_inputs), got {type(made).__name__}")
    return made


def trace_at(build: Callable[..., Any], sizes: dict[str, int], dims: dict[str, Any], options: dict[str, Any],
             world: FitWorld | None = None) -> Trace:
    """One trace of the module ``build(**sizes)`` makes, its input sizes symbolic; ``world``: the fit's shared fake
    world (:mod:`.fit_world`: the trace is the same as in a fresh one)."""
    from .trace import trace_module

    module, inputs = built(build, sizes)
    try:
        t = trace_module(module, inputs, dims, check=False, fit_world=world, **options)
    except SymmemError as e:
        raise SymmemError(f"tracing the module at {sizes}: {e}") from None
    if t.method == "fitted":
        raise SymmemError(f"at {sizes} the module specializes on its input sizes ({', '.join(t.values)}) and was "
                          "fitted at concrete sizes: a formula in its sizes needs a symbolic trace in the input "
                          "dims (trace it without sizes=, or declare fewer dims)")
    # the module and its example inputs, held with the trace: the peak in every size records the training step of
    # the same module in the fake world its forward ran in (``world``), each forward op's first occurrence computed
    # once, as a traced module's step does (importer.traced.step_of)
    return replace(t, extra={**t.extra, BUILT: (module, inputs)})


def fit_sizes(build: Callable[..., Any], sizes: Mapping[str, int], dims: dict[str, Any], *,
              divisible: Mapping[str, str | int] | None = None, **options: Any) -> Trace:
    """The :class:`~symmem.importer.Trace` of ``build(**sizes)`` with every size a symbol (module docstring).

    ``build`` takes the sizes as keywords and returns ``(module, example_inputs)``; ``dims`` declares the input
    sizes as for :func:`~symmem.importer.trace_module` (they stay symbolic in every trace); ``divisible`` maps a size
    to the size (or integer) that must divide it; ``options`` are :func:`trace_module`'s (``device``, ``training``,
    ``method``, ``autocast``, ``checkpoint``).  ``Trace.extra["sizes"]`` says how many traces it took.

    A count divided by a count (the heads per key/value group ``h/G``) has two regimes that can run different code
    (``repeat_kv`` is the identity at ``G = h``): it is fitted at ``h/G >= 2`` and checked at ``h/G = 1`` at two
    more configurations; where the formula holds there too the domain says ``h >= G`` (one formula for both),
    else it keeps ``h >= 2G`` (or, for a configuration at ``G = h``, the fit at ``h/G = 1`` only) and a note
    says which regime it holds in and how to get the other.
    """
    given = Plan.of(sizes, divisible)
    divisors = {m for m in given.divisible.values() if isinstance(m, str)}
    regimes = [i for i, v in enumerate(given.variables) if isinstance(v.divisor, str) and v.size in divisors]
    plan = replace(given, variables=tuple(replace(v, values=COUNT_VALUES) if i in regimes else v
                                          for i, v in enumerate(given.variables)))
    traces = _Traces(plan, build, dims, dict(options), {})
    notes: list[str] = []
    try:
        first, formulas, reads = _fit_plan(plan, traces)
    except SymmemError as e:
        if plan == given:
            raise
        # the grouped regime fails where the configuration asked for the other: that regime alone, as asked
        notes.append(_regime_note(given, [i for i in regimes if given.variables[i].fixed], str(e), grouped=False))
        plan = traces.plan = given  # the traces so far stand: a point means the same sizes in either plan
        traces.used = set()  # the failed regime's traces are not the fit's: their guards leave the domain
        first, formulas, reads = _fit_plan(plan, traces)
        return _fitted_trace(first, plan, formulas, len(traces.made), traces.seconds, notes, worlds(traces),
                             traces)
    ones = []
    for i in regimes:
        v = plan.variables[i]
        check = replace(plan, variables=tuple(replace(w, values=(*w.values[:3], 1, 1)) if j == i else w
                                              for j, w in enumerate(plan.variables)))
        used = set(traces.used)
        try:
            _verify(check, traces, list(formulas), formulas, first, reads)
            ones.append(v.name)
        except SymmemError as e:  # G = h keeps other tensors (or the same in other sizes): not that regime
            traces.used = used  # that regime is not claimed: its checks' guards are not the domain's
            if given.variables[i].fixed:  # the configuration is at G = h: its own regime, as before
                notes.append(_regime_note(given, [i], str(e), grouped=False))
                plan = traces.plan = given  # the traces so far stand: a point means the same sizes in either plan
                traces.used = set()
                first, formulas, reads = _fit_plan(plan, traces)
                return _fitted_trace(first, plan, formulas, len(traces.made), traces.seconds, notes,
                                     worlds(traces), traces)
            notes.append(_regime_note(plan, [i], str(e), grouped=True))
    if ones:
        said = ", ".join(f"{plan.variables[i].size} = {plan.variables[i].divisor}" for i in regimes
                         if plan.variables[i].name in ones)
        notes.append(f"one formula for {said} too: fitted at {', '.join(ones)} >= 2 and checked at "
                     f"{', '.join(o + ' = 1' for o in ones)} (two more configurations never fitted)")
    plan = replace(plan, one=frozenset(ones))
    return _fitted_trace(first, plan, formulas, len(traces.made), traces.seconds, notes, worlds(traces), traces)


def _regime_note(plan: Plan, which: list[int], why: str, grouped: bool) -> str:
    """Which regime of a count divided by a count the formula holds in, why not the other, and the way to it."""
    names = [(plan.variables[i].size, plan.variables[i].divisor) for i in which]
    if grouped:
        held = ", ".join(f"{n} >= 2*{m}" for n, m in names)
        other = ", ".join(f"{n} = {m}" for n, m in names)
    else:
        held = ", ".join(f"{n} = {m}" for n, m in names)
        other = ", ".join(f"{n} >= 2*{m}" for n, m in names)
    what = why.split(" in a way")[0].split(": a size decides")[0].split(" fitted vs ")[0][:120]  # which quantity
    return (f"the formula holds for {held} only: at {other} the module keeps other tensors ({what}); for "
            f"{other} trace a configuration there")


def _fit_plan(plan: Plan, traces: _Traces) -> tuple[Trace, dict[Key, tuple[Any, ...]], dict[Key, list[str]]]:
    """The base trace, every quantity's formula in the sizes and the variables each reads, checked (:func:`_verify`)."""
    fitted = [v for v in plan.variables if not v.fixed]
    base = plan.base
    first = _stacked(traces.at(base)) if plan.has_layers else traces.at(base)
    ranks = _quantities(first)
    keys = list(ranks)

    def point(changes: Mapping[int, int]) -> tuple[int, ...]:
        return tuple(changes.get(i, x) for i, x in enumerate(base))

    index = {v.name: i for i, v in enumerate(plan.variables)}
    for probes in (2, 3):
        # probes: each variable at two values (degree <= 1, what a shape's sizes have), then three (<= 2) where
        # the lines miss the check; each component of each quantity on its own grid: the variables it depends on
        degrees: dict[tuple[Key, int], dict[int, int]] = {(k, q): {} for k in keys for q in range(len(ranks[k]))}
        for v in fitted:
            i = index[v.name]
            xs = v.values[:probes]
            runs = [_checked(traces, point({i: x}), keys, ranks, plan) for x in xs]
            for k, q in degrees:
                e = _degree([r[k][q] for r in runs], xs)
                if e:
                    degrees[(k, q)][i] = e
        grids = {c: sorted(d.items()) for c, d in degrees.items()}
        needed = {point(dict(zip([i for i, _ in g], combo, strict=True)))
                  for g in grids.values() for combo in itertools.product(
                      *[plan.variables[i].values[:e + 1] for i, e in g])}
        if len(needed) + 2 > MAX_TRACES:
            raise SymmemError(f"the sizes need {len(needed) + 2} traces to pin every term (more than {MAX_TRACES}): "
                              "declare fewer sizes symbolic")
        quantities = {p: _checked(traces, p, keys, ranks, plan) for p in sorted(needed)}
        formulas = {k: tuple(_interpolate(k, q, grids[(k, q)], plan, base, quantities)
                             for q in range(len(ranks[k]))) for k in keys}
        back = plan.back()
        formulas = {k: tuple(sympy.expand(sympy.sympify(e, strict=True).xreplace(back)) for e in f)
                    for k, f in formulas.items()}
        reads = {k: sorted({plan.variables[i].name for (kk, _), g in grids.items() if kk == k for i, _ in g})
                 for k in keys}
        try:
            _verify(plan, traces, keys, formulas, first, reads)
            break
        except Miss:
            if probes == 3:
                raise
    return first, formulas, reads


def _checked(traces: _Traces, p: tuple[int, ...], keys: list[Key], ranks: dict[Key, tuple[Any, ...]], plan: Plan
             ) -> dict[Key, tuple[Any, ...]]:
    """The quantities of the trace at ``p``, which must name the same things as the base trace's (``ranks``)."""
    q = traces.quantities(p)
    if set(q) != set(keys):
        odd = sorted(set(q) ^ set(keys))[:3]
        raise SymmemError(f"the module keeps different tensors at {plan.sizes_at(p)} than at "
                          f"{plan.sizes_at(plan.base)} ({', '.join(f'{a} {b}' for a, b in odd)}): a size decides "
                          "which ops run, which no polynomial expresses; keep that size fixed (leave it out of the "
                          "symbolic sizes)")
    for k in keys:
        if len(q[k]) != len(ranks[k]):
            raise SymmemError(f"{k[0]} {k[1]} changes rank between sizes {plan.sizes_at(p)}: keep that size fixed")
    return q


def _interpolate(key: Key, q: int, grid: list[tuple[int, int]], plan: Plan, base: tuple[int, ...],
                 quantities: dict[tuple[int, ...], dict[Key, tuple[Any, ...]]]) -> Any:
    """The tensor-product Lagrange interpolation of one component of one quantity over its grid."""
    idx = [i for i, _ in grid]
    nodes = [plan.variables[i].values[:e + 1] for i, e in grid]
    out = sympy.Integer(0)
    for combo in itertools.product(*[range(len(ns)) for ns in nodes]):
        p = tuple(base[i] if i not in idx else nodes[idx.index(i)][combo[idx.index(i)]] for i in range(len(base)))
        weight = sympy.Integer(1)
        for j, i in enumerate(idx):
            weight *= _basis(plan.variables[i].symbol, nodes[j], combo[j])
        out += weight * quantities[p][key][q]
    return sympy.expand(out)


def _subs_at(plan: Plan, point: tuple[int, ...], layers: int) -> dict[sympy.Symbol, int]:
    sizes = plan.sizes_at(point, layers)
    return {sym_for(n): v for n, v in sizes.items()}


def _verify(plan: Plan, traces: _Traces, keys: list[Key], formulas: dict[Key, tuple[Any, ...]], first: Trace,
            reads: dict[Key, list[str]]) -> None:
    """Two configurations never fitted: every quantity at the first (the layer count as traced), the totals at the
    second (every variable moved, the layer count too)."""
    fitted = [v for v in plan.variables if not v.fixed]
    if plan.has_layers and (first.layers is None or first.layers.count != LAYER_VALUES[0]):
        found = (f"it folds {first.layers.count} identical children of {first.layers.path or 'the module'}"
                 if first.layers is not None else "it finds no identical children to fold")
        raise SymmemError(f"the size L must count the repeated blocks, but at L = {LAYER_VALUES[0]} {found}: build "
                          "L identical blocks (each reading the previous one's output), or name the size otherwise")
    if not fitted and not plan.has_layers:
        return
    one = tuple(v.values[3] if not v.fixed else v.values[0] for v in plan.variables)
    two = tuple(v.values[4] if not v.fixed else v.values[0] for v in plan.variables)
    got = traces.quantities(one)
    subs = _subs_at(plan, one, LAYER_VALUES[0])
    for k in keys:
        if k not in got:
            raise SymmemError(f"at the check {plan.sizes_at(one)} the module keeps no {k[0]} {k[1]}: a size decides "
                              "which ops run; keep that size fixed")
        want = tuple(sympy.expand(e.xreplace(subs)) for e in formulas[k])
        if any(sympy.expand(a - b) != 0 for a, b in zip(want, got[k], strict=True)):
            raise Miss(_miss(k, want, got[k], plan.sizes_at(one), first, reads[k]))
    if set(got) != set(keys):
        extra = sorted(set(got) - set(keys))[0]
        raise SymmemError(f"at the check {plan.sizes_at(one)} the module keeps {extra[0]} {extra[1]}, which the "
                          "fitted configurations did not: a size decides which ops run; keep that size fixed")
    layers = LAYER_VALUES[1] if plan.has_layers else LAYER_VALUES[0]
    t2 = traces.at(two, layers)
    subs = _subs_at(plan, two, layers)
    for what, want, real in _totals(first, formulas, layers, t2):
        w = sympy.expand(want.xreplace(subs))
        if sympy.expand(w - real) != 0:
            raise Miss(f"the formula in the sizes misses the trace at {plan.sizes_at(two, layers)}: {what} "
                              f"{w} fitted vs {real} traced; the repeated layers do not fold to L, or a size is "
                              "read in a way no polynomial of degree <= 2 expresses: keep that size fixed")


def _miss(k: Key, want: tuple[Any, ...], got: tuple[Any, ...], sizes: dict[str, int], first: Trace,
          reads: list[str]) -> str:
    """Which op and which size: the quantity whose fit missed the check."""
    where = k[1]
    op = next((s.op for s in first.storages if s.name == k[1]), None) if k[0] == "storage" else None
    shape = want[1:] if k[0] == "storage" else want
    real = got[1:] if k[0] == "storage" else got
    said = (f"its shape is {tuple(real)} traced, {tuple(shape)} by the polynomial" if shape != real else
            f"its bytes beyond its shape are {got[0]} traced, {want[0]} by the polynomial")
    return (f"{k[0]} {where}{f' (op {op})' if op else ''} reads {', '.join(reads) or 'a size'} in a way no "
            f"polynomial of degree <= 2 in each size expresses (rounding, a branch, a root): at {sizes} {said} "
            "fitted through the other configurations; keep that size fixed (out of the symbolic sizes) or declare "
            "what divides it (divisible=)")


def _totals(first: Trace, formulas: dict[Key, tuple[Any, ...]], layers: int, real: Trace
            ) -> list[tuple[str, Any, int | Any]]:
    """(what, fitted total with the repeated block counted ``layers`` times, the trace's own) for activations,
    inputs and parameters."""
    rep = first.layers

    def times(module: str) -> int:
        if rep is None:
            return 1
        i = rep.owns(module)
        return 1 if i is None else (layers if i == 0 else 0)

    out = []
    for kind in ("activation", "input"):
        want = sympy.Integer(0)
        for s in first.of_kind(kind):
            i = rep.child_of(s) if rep is not None and kind != "input" else None  # the input is one tensor
            n = 1 if i is None else (layers if i == 0 else 0)
            want += n * _bytes(s, formulas[("storage", s.name)])
        out.append((f"{kind} bytes", want, real.bytes(kind)))
    want = sympy.Integer(0)
    for p in first.parameters:
        want += times(p.name.rsplit(".", 1)[0]) * sympy.Mul(*formulas[("parameter", p.name)])
    out.append(("parameter count", want, sum(p.numel for p in real.parameters)))
    return out


def _fitted_trace(first: Trace, plan: Plan, formulas: dict[Key, tuple[Any, ...]], count: int, seconds: float,
                  said: list[str] | None = None, worlds: dict[tuple[tuple[str, int], ...], Any] | None = None,
                  traces: _Traces | None = None) -> Trace:
    """The base trace with every quantity its formula in the sizes; ``extra["sizes"]["worlds"]``: :func:`worlds`;
    the domain: every guard of every trace the fit read (``traces.used``, :func:`_guards_of_fit`)."""
    guarded, lifted = _guards_of_fit(first, plan, traces) if traces is not None else (first.domain, [])
    storages = []
    for s in first.storages:
        f = formulas[("storage", s.name)]
        b = _bytes(s, f)
        storages.append(replace(s, bytes=b, shape=f[1:], elements=sympy.expand(b / _itemsize(s))))
    params = tuple(_param(p, formulas[("parameter", p.name)]) for p in first.parameters)
    buffers = tuple(_param(b, formulas[("buffer", b.name)]) for b in first.buffers)
    reps = tuple(replace(r, bytes=sympy.expand(sympy.Add(*[s.bytes for s in storages if s.name in r.storages])))
                 for r in first.repeats)
    symbols = (*first.symbols, *(TracedSymbol(n, sym_for(n), v, ()) for n, v in plan.defaults.items()
                                 if n != LAYERS))
    domain = sympy.And(guarded, *plan.domain())
    names = ", ".join(v.name for v in plan.variables if not v.fixed)
    fixed = ", ".join(f"{v.name} = 1" for v in plan.variables if v.fixed)
    note = (f"every size symbolic: {count} traces at small configurations ({seconds:.1f} s), each quantity the "
            f"exact polynomial (degree <= 2 in each of {names or 'no variable'}) through them, checked at two "
            "configurations never fitted" + (f"; traced with {fixed} only" if fixed else "")
            + (f"; the layers traced at {LAYER_VALUES[0]} and checked at {LAYER_VALUES[1]}" if plan.has_layers else ""))
    extra = {**{k: v for k, v in first.extra.items() if k != BUILT},
             "sizes": {"traces": count, "seconds": seconds, "plan": plan, "worlds": worlds or {}}}
    notes = tuple(n for n in first.notes if "check=False" not in n)  # the fit's own checks replace it
    return replace(first, storages=tuple(storages), parameters=params, buffers=buffers, repeats=reps,
                   symbols=symbols, domain=domain, notes=(*notes, note, *(said or ()), *lifted), extra=extra,
                   check=None)


# -- the domain: every trace's guards ------------------------------------------------------------------------
def _relation(c: Any) -> tuple[tuple[str, Any], Any] | None:
    """A guard as ``rest + constant REL 0`` (``REL``: ``<=``, ``==`` or ``!=``): ((REL, rest), constant), the same
    ``(REL, rest)`` for one guard at any sizes (``S <= 12`` and ``S <= 16``); None for what is not one relation
    (an ``Or``, a bare symbol)."""
    if isinstance(c, sympy.StrictLessThan | sympy.LessThan):
        d, rel = c.lhs - c.rhs, "<=" if isinstance(c, sympy.LessThan) else "<"
    elif isinstance(c, sympy.StrictGreaterThan | sympy.GreaterThan):
        d, rel = c.rhs - c.lhs, "<=" if isinstance(c, sympy.GreaterThan) else "<"
    elif isinstance(c, sympy.Eq | sympy.Ne):
        d, rel = c.lhs - c.rhs, "==" if isinstance(c, sympy.Eq) else "!="
    else:
        return None
    const, rest = sympy.expand(d).as_coeff_Add()
    if rest == 0 or not const.is_Rational:
        return None
    if rel in ("==", "!=") and rest.could_extract_minus_sign():  # Eq(S, 8) and Eq(8, S): one relation
        const, rest = -const, -rest
    if rel == "<":  # sizes are integers: rest + c < 0 is rest + c + 1 <= 0 where rest and c are whole
        if not (rest.is_integer and const.is_Integer):
            return None
        const, rel = const + 1, "<="
    return (rel, rest), const


def _lift(rel: str, rest: Any, const: Any) -> Any:
    """``rest + const REL 0`` written as the relation it reads as: ``S <= H/2``, ``S >= 3``."""
    if rel == "<=" and rest.could_extract_minus_sign():
        return sympy.Ge(-rest, const)
    return {"<=": sympy.Le, "==": sympy.Eq, "!=": sympy.Ne}[rel](rest, -const)


def _guards_of_fit(first: Trace, plan: Plan, traces: _Traces) -> tuple[Any, list[str]]:
    """Where every trace the fit read (``traces.used``) took the branches it took, and a note per guard lifted.

    Each trace holds at its own sizes where its guards do (its domain), and those guards are in the input sizes
    only (B, S: a model size is a number there).  A guard every trace has is the domain as it is.  A guard whose
    bound moves with the sizes (``S <= 12`` at H = 24, ``S <= 16`` at H = 32: ``if S <= H // 2``) is written in
    the sizes: its bound linear in the variables from the base and each variable's probe, and equal to that line
    at every other trace the fit read (the checks never fitted move every variable), as each quantity's formula
    is checked -- ``S <= H/2``.  A guard some traces have and others lack, or whose bound no line through them
    gives (``if S > F // 24``: no guard at F = 40, ``S > 2`` at F = 48), is a branch a size moves where no
    polynomial says: the formula, fitted on one side of it, would claim the other -- :class:`SymmemError`, as for
    a size that decides which ops run.
    """
    keys = sorted(traces.used)
    if not keys:
        return first.domain, []
    each = {k: list(sympy.And.make_args(sympy.sympify(traces.made[k].domain, strict=True))) for k in keys}
    common = set.intersection(*(set(v) for v in each.values()))
    if all(set(v) == common for v in each.values()):  # every trace the same guards: the base trace's domain
        return first.domain, []
    base = (plan.base, LAYER_VALUES[0])
    names = [v.name for v in plan.variables] + (["L"] if plan.has_layers else [])

    def coords(k: tuple[tuple[int, ...], int]) -> tuple[int, ...]:
        return (*k[0], k[1]) if plan.has_layers else k[0]

    def where(k: tuple[tuple[int, ...], int]) -> str:
        return ", ".join(f"{n} = {x}" for n, x in plan.sizes_at(*k).items())

    def moved(k: tuple[tuple[int, ...], int], o: tuple[tuple[int, ...], int]) -> str:
        a, b = plan.sizes_at(*k), plan.sizes_at(*o)
        return ", ".join(n for n in a if a[n] != b[n])

    symbols = [v.symbol for v in plan.variables] + ([sym_for(LAYERS)] if plan.has_layers else [])
    bounds: dict[tuple[str, Any], dict[tuple[tuple[int, ...], int], list[Any]]] = {}
    refused: list[str] = []
    for k, conds in each.items():
        for c in conds:
            if c in common:
                continue
            r = _relation(c)
            if r is None:
                refused.append(f"{', '.join(names)}: {c} at {where(k)}")
                continue
            bounds.setdefault(r[0], {}).setdefault(k, []).append(r[1])
    # One trace may hold several bounds on one expression (HF Mistral's sliding-window mask: S < W and S < W - 1,
    # ``S <= 23`` and ``S <= 22`` at W = 24): each trace's bounds ranked, tightest first (``rest + c <= 0``: the
    # largest c), and rank i paired with rank i of every other trace -- the same guard at other sizes where the
    # bounds keep their order.  A trace with fewer bounds lacks a guard the others have (refused as before).
    varying: list[tuple[tuple[str, Any], dict[tuple[tuple[int, ...], int], Any]]] = []
    for key, per in bounds.items():
        ranked = {k: sorted(set(cs), reverse=True) for k, cs in per.items()}
        for i in range(max(len(cs) for cs in ranked.values())):
            varying.append((key, {k: cs[i] for k, cs in ranked.items() if i < len(cs)}))
    lifted, said = [], []
    lines: dict[tuple[str, Any], list[Any]] = {}  # each key's lifted bounds (their constant in the sizes)
    for (rel, rest), at in varying:
        missing = [k for k in keys if k not in at]
        if missing or base not in at:
            other = missing[0] if missing else base
            k = next((k for k in at if moved(k, other).count(",") == 0), next(iter(at)))  # a probe, if any
            refused.append(f"{moved(k, other)}: {_lift(rel, rest, at[k])} at {where(k)}, no such guard at "
                           f"{where(other)}")
            continue
        b = coords(base)
        slope = [sympy.Integer(0)] * len(b)
        for k, c in at.items():  # a probe: one variable moved from the base
            diff = [i for i, (x, y) in enumerate(zip(coords(k), b, strict=True)) if x != y]
            if len(diff) == 1:
                slope[diff[0]] = sympy.Rational(c - at[base], coords(k)[diff[0]] - b[diff[0]])

        off = [k for k in keys if at[k] != at[base] + sum(a * (x - y) for a, x, y in zip(slope, coords(k), b,
                                                                                          strict=True))]
        if off:
            refused.append(f"{moved(off[0], base)}: {_lift(rel, rest, at[base])} at {where(base)}, "
                           f"{_lift(rel, rest, at[off[0]])} at {where(off[0])}")
            continue
        bound = sympy.expand(sympy.sympify(at[base] + sum(a * (s - y) for a, s, y in zip(slope, symbols, b,
                                                                                           strict=True)),
                                           strict=True).xreplace(plan.back()))
        if rel == "<=" and any((bound - o).is_number for o in lines.get((rel, rest), ())):
            continue  # parallel to a tighter bound lifted before (ranked tightest first): implied by it
        lines.setdefault((rel, rest), []).append(bound)
        g = _lift(rel, rest, bound)
        lifted.append(g)
        moves = [n for n, a in zip(names, slope, strict=True) if a != 0]
        said.append(f"the guard {g}: its bound moves with {', '.join(moves) or 'no size'} (traced "
                    f"{_lift(rel, rest, at[base])} at {where(base)}), linear through every trace the fit read")
    if refused:
        raise SymmemError(f"a size moves where the module branches on its input sizes in a way no polynomial "
                          f"expresses ({refused[0]}): the formula, fitted on one side of the branch, would claim "
                          "the other side too; keep that size fixed (out of the symbolic sizes)")
    return sympy.And(*common, *lifted), said


def _param(p: TracedParameter, shape: tuple[Any, ...]) -> TracedParameter:
    return replace(p, shape=tuple(shape), numel=sympy.expand(sympy.Mul(*shape)))


def no_peak(trace: Trace) -> str:
    """Why a formula in the sizes has no peak of the step (yet): the kept memory and the parameter side have it."""
    return ("the peak of the training step in every size records the step at each fitted configuration, which "
            "was not asked for: give peak=True (symmem trace --symbolic ... --symbolic-peak), or trace without "
            "sizes= at the sizes you want")


def in_domain(d: Any, name: str) -> Callable[[int], str | None]:
    """``accepts(value)`` for :func:`symmem.apps.budget.largest`: why ``value`` of the size ``name`` lies outside the
    derivation's domain (a head size that is not whole), the other sizes at their numbers; None inside it."""
    sym = next((s for s in d.numbers if s.name == name), None)
    if sym is None:
        raise SymmemError(f"{d.model} has no symbol {name!r}; it has {', '.join(sorted(s.name for s in d.numbers))}")
    others = {s: sympy.Integer(v) for s, v in d.numbers.items() if s != sym}
    domain = sympy.sympify(d.domain, strict=True).xreplace(others)

    def accepts(value: int) -> str | None:
        if bool(domain.xreplace({sym: sympy.Integer(value)})):
            return None
        return f"{name} = {value} lies outside the formula's domain ({domain})"

    return accepts
