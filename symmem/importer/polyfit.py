"""The fallback: the exact polynomial through traces at several concrete sizes, checked at more.

Used when the symbolic trace cannot give a formula: the module specializes on a declared size at every
example (``int(x.shape[1])``, a size used as a Python number), a kernel cannot run with symbolic sizes
(the LSTM's C++ composite reads ``numel()``), or fake tensors cannot run it at all (``.item()``,
data-dependent shapes) and ``method="fit"`` was asked for.

Each fitted symbol takes the values ``k * example`` for ``k = 1 … d + 1`` (multiples keep image sides
divisible by the strides); the traces on that grid give every storage's bytes (and shape), interpolated
exactly (rational coefficients) by the polynomial of degree ≤ d in each symbol, and checked at two more
points (every symbol at ``(d + 2) * example``; the i-th at ``(d + 3 + i) * example``); ``d`` = 1, 2, 3.
Only the symbols that specialize are made concrete: the others stay symbolic in every trace of the grid
(MobileNetV2's TF padding pins ``Hi`` and ``Wi``; ``B`` stays a symbol).  Traces run on fake tensors when
they can and on real tensors (the module's own weights, inputs tiled to size, every symbol concrete) when
they cannot.

The result is exact on the multiples of the example sizes the checks cover.  One more trace, every fitted
size one above its example, tells whether it also holds off the multiples (an LSTM's ``B*S``); if not (stride
arithmetic that rounds differently: MobileNetV2's TF padding), the domain says ``Mod(Hi, example) = 0``.

>>> from fractions import Fraction
>>> inverse([[1, 1], [1, 2]])
[[Fraction(2, 1), Fraction(-1, 1)], [Fraction(-1, 1), Fraction(1, 1)]]
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

import sympy

from ..errors import SymmemError
from ..record.saved_tensors import OpaqueKernel
from .inputs import Inputs
from .records import TracedStorage

MAX_POINTS = 300


def inverse(m: list[list[int]]) -> list[list[Fraction]]:
    """Exact inverse of a small square matrix (Gauss-Jordan over fractions)."""
    n = len(m)
    a = [[Fraction(x) for x in row] + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(m)]
    for c in range(n):
        p = next(r for r in range(c, n) if a[r][c] != 0)
        a[c], a[p] = a[p], a[c]
        piv = a[c][c]
        a[c] = [x / piv for x in a[c]]
        for r in range(n):
            if r != c and a[r][c] != 0:
                f = a[r][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c], strict=True)]
    return [row[n:] for row in a]


def tile(t: Any, dim: int, size: int) -> Any:
    """``t`` repeated along ``dim`` and cut to ``size`` (keeps value patterns: token ids, all-ones masks)."""
    n = t.shape[dim]
    reps = [1] * t.dim()
    reps[dim] = -(-size // n)
    return t.repeat(*reps).narrow(dim, 0, size).clone()  # its own storage, exactly the size


def resized_real(inputs: Inputs, values: dict[str, int]) -> Inputs:
    """Real example inputs with every declared dimension at ``values`` (tiled)."""
    import torch

    new: dict[Any, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            where = inputs.sizes_at(key)
            t = value.detach()
            for d, name in where.items():
                t = tile(t, d, values[name])
            if where:
                new[key] = t.requires_grad_(value.requires_grad) if value.is_floating_point() else t
    args, kwargs = inputs.rebuild(new)
    return Inputs(args, kwargs, inputs.positions, dict(values))


def concrete(module: Any, inputs: Inputs, values: dict[str, int], symbols: dict[str, sympy.Symbol],
             device: str, real: bool, fitted: tuple[str, ...], multiple_of: dict[str, int]) -> Any:
    """One forward with the ``fitted`` sizes concrete (the others symbolic): fake tensors, or real ones
    (everything concrete) when fake tensors cannot run the module."""
    from .runs import Run, fake_run, real_run, to_storages

    symbolic = len(fitted) < len(values)
    try:
        return fake_run(module, inputs, values, symbols, device, None, symbolic=symbolic,
                        multiple_of={n: m for n, m in multiple_of.items() if n not in fitted}, concrete=fitted)
    except OpaqueKernel:
        raise
    except SymmemError:
        if not real or symbolic:
            raise
    # fake tensors cannot run it (data-dependent, or a kernel whose fake does not know its workspace): real ones
    outcome = real_run(module, resized_real(inputs, values))
    storages = to_storages(outcome, lambda x: sympy.Integer(int(x)))
    return Run(storages, outcome.ops, [], {}, [], {}, [])


def _quantities(storages: list[TracedStorage], grouped: bool = False) -> dict[tuple[str, ...], tuple[Any, ...]]:
    """(name, kind) -> (bytes, *shape); ``grouped``: (module, op, kind, dtype) -> (total bytes,), for modules
    whose number of storages grows with a size (an RNN unrolled over time steps keeps some per step)."""
    if not grouped:
        return {(s.name, s.kind): (s.bytes, *s.shape) for s in storages}
    out: dict[tuple[str, ...], tuple[Any, ...]] = {}
    for s in storages:
        key = (s.module, s.op, s.kind, s.dtype)
        out[key] = (out.get(key, (0,))[0] + s.bytes,)
    return out


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return len(a) == len(b) and all(sympy.expand(x - y) == 0 for x, y in zip(a, b, strict=True))


def fit_trace(module: Any, inputs: Inputs, symbols: dict[str, sympy.Symbol], device: str, real: bool,
              fitted: tuple[str, ...] | None = None, multiple_of: dict[str, int] | None = None,
              seed: dict[tuple[int, ...], Any] | None = None) -> Any:
    """A :class:`~symmem.importer.trace.Run` whose formulas are polynomials fitted in the ``fitted`` symbols
    (all by default); the other symbols stay symbolic in every trace of the grid.  ``seed``: runs already
    made, by point (the symbolic traces that specialized are such runs)."""
    from .runs import Run

    names = list(fitted or inputs.examples)
    base = inputs.examples
    cache: dict[tuple[int, ...], Any] = dict(seed or {})

    def at(point: tuple[int, ...]) -> Any:
        if point not in cache:
            values = {**base, **dict(zip(names, point, strict=True))}
            cache[point] = concrete(module, inputs, values, symbols, device, real, tuple(names), multiple_of or {})
        return cache[point]

    last_error = ""
    for degree in (1, 2, 3):
        ks = range(1, degree + 2)
        grid = list(itertools.product(*[[base[n] * k for k in ks] for n in names]))
        if len(grid) > MAX_POINTS:
            raise SymmemError(f"fitting {len(names)} symbols at degree {degree} needs {len(grid)} traces; declare "
                              "fewer symbols")
        grouped = False
        runs = [_quantities(at(p).storages) for p in grid]
        keys = list(runs[0])
        if any(list(r) != keys or any(len(r[k]) != len(runs[0][k]) for k in keys) for r in runs):
            grouped = True  # storages per time step: fit the bytes per (module, op, kind, dtype)
            runs = [_quantities(at(p).storages, True) for p in grid]
            keys = list(runs[0])
            if any(sorted(r) != sorted(keys) for r in runs):
                last_error = "the modules and ops that save differ between sizes"
                continue
        # tensor-product Vandermonde, inverted once per symbol
        inv = [inverse([[x**e for e in range(degree + 1)] for x in [base[n] * k for k in ks]]) for n in names]
        exps = list(itertools.product(range(degree + 1), repeat=len(names)))
        monos = [sympy.Mul(*[symbols[n] ** e for n, e in zip(names, ex, strict=True)]) for ex in exps]
        gidx = list(itertools.product(range(degree + 1), repeat=len(names)))
        weights = [[_prod(inv[i][ex[i]][g[i]] for i in range(len(names))) for g in gidx] for ex in exps]
        fits: dict[tuple[str, str], tuple[Any, ...]] = {}
        for key in keys:
            cols = []
            for q in range(len(runs[0][key])):
                vals = [sympy.sympify(r[key][q]) for r in runs]
                terms = []
                for ws, mono in zip(weights, monos, strict=True):
                    c = sympy.Add(*[sympy.Rational(w.numerator, w.denominator) * v
                                    for w, v in zip(ws, vals, strict=True) if w])
                    terms.append(c * mono)
                cols.append(sympy.expand(sympy.Add(*terms)))
            fits[key] = tuple(cols)
        # two more points off the grid: every symbol at (d + 2) x, and each at a different multiple
        checks = [tuple(base[n] * (degree + 2) for n in names),
                  tuple(base[n] * (degree + 3 + i) for i, n in enumerate(names))]
        ok = True
        for point in checks:
            got = _quantities(at(point).storages, grouped)
            subs = {symbols[n]: v for n, v in zip(names, point, strict=True)}
            if sorted(got) != sorted(keys) or any(not _same(tuple(e.xreplace(subs) for e in fits[k]), got[k])
                                                  for k in keys):
                ok = False
                last_error = f"the degree-{degree} fit misses at {dict(zip(names, point, strict=True))}"
                break
        if not ok:
            continue
        first = at(grid[0])
        out = []
        done: set[tuple[str, ...]] = set()
        for s in first.storages:
            key = (s.module, s.op, s.kind, s.dtype) if grouped else (s.name, s.kind)
            if key in done:
                continue
            done.add(key)
            cols = fits[key]
            itemsize = sympy.sympify(s.bytes) / s.elements if s.elements != 0 else 1
            name = (s.name if s.kind != "activation" else f"{s.module}:{s.op}") if grouped else s.name
            out.append(TracedStorage(name=name, module=s.module, op=s.op, dtype=s.dtype,
                               shape=() if grouped else cols[1:], elements=sympy.expand(cols[0] / itemsize),
                               bytes=cols[0], kind=s.kind, producer=s.producer, producer_module=s.producer_module,
                               born=s.born, saved_by=s.saved_by))
        # guards of the grid traces that do not involve the fitted sizes hold for the fit too
        fitted_syms = {symbols[n] for n in names}
        guards, seen = [], set()
        for p in grid:
            for g in at(p).guards:
                if not (sympy.sympify(g.expr).free_symbols & fitted_syms) and g.expr not in seen:
                    seen.add(g.expr)
                    guards.append(g)
        # off the grid: one more trace with every fitted size one above its example.  If the fit holds there
        # too it is taken to hold for all sizes; if not (stride arithmetic rounds differently), the domain
        # says the multiples of the examples, where it was checked
        def holds_at(off: tuple[int, ...], keys: Any = keys, fits: Any = fits, grouped: bool = grouped) -> bool:
            return _holds(at, off, {symbols[n]: v for n, v in zip(names, off, strict=True)}, keys, fits, grouped)

        general = holds_at(tuple(base[n] + 1 for n in names))
        # where it does not, each size is tried off its multiples alone: only those that fail are restricted
        # (a CNN's image sides round in the strides; its batch does not)
        restricted = [] if general else [n for n in names if len(names) == 1 or not holds_at(
            tuple(base[m] + (m == n) for m in names))] or list(names)
        conditions = [sympy.Eq(sympy.Mod(symbols[n], base[n]), 0) for n in restricted]
        kept = [n for n in base if n not in names]
        note = (f"fitted: polynomial of degree <= {degree} in each of {', '.join(names)} through {len(grid)} "
                f"traces at multiples of the example sizes ({', '.join(f'{n} = {base[n]}' for n in names)}), "
                f"checked at {len(checks)} more" + (f"; {', '.join(kept)} symbolic in every trace" if kept else "")
                + ("; the number of storages grows with the sizes: one entry per (module, op, kind, dtype)"
                   if grouped else "")
                + ("; it also holds one above the examples" if general else
                   f"; it does not hold off the multiples of {', '.join(restricted)} (checked one above the examples): "
                   "the domain says so"))
        bounds = {n: b for n, b in first.bounds.items() if n not in names}
        return Run(out, first.ops, guards, {}, conditions, bounds, [note])
    raise SymmemError(f"no exact polynomial of degree <= 3 fits the traces at concrete sizes: {last_error}")


def _holds(at: Any, off: tuple[int, ...], subs: dict[sympy.Symbol, int], keys: Any, fits: Any, grouped: bool) -> bool:
    """Whether the fitted formulas ``fits`` give every storage of the trace at ``off`` (sizes ``subs``)."""
    try:
        got = _quantities(at(off).storages, grouped)
    except SymmemError:
        return False
    return sorted(got) == sorted(keys) and all(_same(tuple(e.xreplace(subs) for e in fits[k]), got[k]) for k in keys)


def _prod(xs: Any) -> Fraction:
    out = Fraction(1)
    for x in xs:
        out *= x
    return out
