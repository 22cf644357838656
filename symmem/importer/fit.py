"""The fallback: the exact polynomial through traces at several concrete sizes, checked at more.

Used when the symbolic trace cannot give a formula: the module specializes on a declared size at every
example (``int(x.shape[1])``, a size used as a Python number), or fake tensors cannot run it at all
(``.item()``, data-dependent shapes) and ``method="fit"`` was asked for.  Each declared symbol takes the
values ``k * example`` for ``k = 1 … d + 1`` (multiples keep image sides divisible by the strides); the
traces on the whole grid give every storage's bytes, interpolated exactly (rational coefficients) by the
polynomial of degree ≤ d in each symbol, and checked at two more points (every symbol at ``(d + 2) *
example``, and one symbol alone there).  ``d`` = 2, then 3.  Concrete traces run on fake tensors when they
can and on real tensors (the module's own weights, inputs tiled to size) when they cannot.

The result is exact on the multiples of the example sizes the checks cover; it says nothing about sizes
whose conv arithmetic rounds differently (``Trace.method == "fitted"`` and a note say so).

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
from .inputs import Inputs
from .records import Storage

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
    return t.repeat(*reps).narrow(dim, 0, size).contiguous()


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
             device: str, real: bool) -> list[Storage]:
    """Storages of one forward at concrete sizes: fake tensors first, real ones if fake cannot run it."""
    from .trace import fake_run, real_run, to_storages

    try:
        return fake_run(module, inputs, values, symbols, device, None, symbolic=False).storages
    except SymmemError:
        if not real:
            raise
    outcome = real_run(module, resized_real(inputs, values))
    return to_storages(outcome, lambda x: sympy.Integer(int(x)), outcome.op_modules)  # type: ignore[attr-defined]


def _quantities(storages: list[Storage]) -> dict[tuple[str, str], tuple[Any, ...]]:
    """(name, kind) -> (bytes, *shape) as integers."""
    return {(s.name, s.kind): (int(s.bytes), *(int(d) for d in s.shape)) for s in storages}


def fit_trace(module: Any, inputs: Inputs, symbols: dict[str, sympy.Symbol], device: str, real: bool) -> Any:
    """A :class:`~symmem.importer.trace.Run` whose formulas are fitted polynomials."""
    from .trace import Run

    names = list(inputs.examples)
    base = inputs.examples
    cache: dict[tuple[int, ...], list[Storage]] = {}

    def at(point: tuple[int, ...]) -> list[Storage]:
        if point not in cache:
            cache[point] = concrete(module, inputs, dict(zip(names, point, strict=True)), symbols, device, real)
        return cache[point]

    last_error = ""
    for degree in (2, 3):
        ks = range(1, degree + 2)
        grid = list(itertools.product(*[[base[n] * k for k in ks] for n in names]))
        if len(grid) > MAX_POINTS:
            raise SymmemError(f"fitting {len(names)} symbols at degree {degree} needs {len(grid)} traces; declare "
                              "fewer symbols")
        runs = [_quantities(at(p)) for p in grid]
        keys = list(runs[0])
        if any(list(r) != keys or any(len(r[k]) != len(runs[0][k]) for k in keys) for r in runs):
            last_error = "the storages differ between sizes (the module's structure depends on the size)"
            continue
        # tensor-product Vandermonde, inverted once
        inv = [inverse([[x**e for e in range(degree + 1)] for x in [base[n] * k for k in ks]]) for n in names]
        exps = list(itertools.product(range(degree + 1), repeat=len(names)))
        monos = [sympy.Mul(*[symbols[n] ** e for n, e in zip(names, ex, strict=True)]) for ex in exps]
        # coefficient of exponent tuple ex = sum over grid index g of prod_i inv_i[ex_i][g_i] * value(g)
        gidx = list(itertools.product(range(degree + 1), repeat=len(names)))
        weights = [[_prod(inv[i][ex[i]][g[i]] for i in range(len(names))) for g in gidx] for ex in exps]
        fitted: dict[tuple[str, str], list[Any]] = {}
        for key in keys:
            cols = []
            for q in range(len(runs[0][key])):
                vals = [r[key][q] for r in runs]
                coeffs = [sum(w * v for w, v in zip(ws, vals, strict=True)) for ws in weights]
                cols.append(sympy.expand(sympy.Add(*[sympy.Rational(c.numerator, c.denominator) * m
                                                     for c, m in zip(coeffs, monos, strict=True) if c])))
            fitted[key] = cols
        checks = [tuple(base[n] * (degree + 2) for n in names)]
        checks += [tuple(base[n] * (degree + 2) if j == i else base[n] for j, n in enumerate(names))
                   for i in range(len(names)) if len(names) > 1]
        ok = True
        for point in checks:
            got = _quantities(at(point))
            subs = {symbols[n]: v for n, v in zip(names, point, strict=True)}
            if list(got) != keys or any(tuple(int(e.xreplace(subs)) for e in fitted[k]) != got[k] for k in keys):
                ok = False
                last_error = f"the degree-{degree} fit misses at {dict(zip(names, point, strict=True))}"
                break
        if not ok:
            continue
        first = at(grid[0])
        out = []
        for s in first:
            cols = fitted[(s.name, s.kind)]
            itemsize = sympy.Integer(int(s.bytes)) / int(s.elements) if int(s.elements) else 1
            out.append(Storage(name=s.name, module=s.module, op=s.op, dtype=s.dtype, shape=tuple(cols[1:]),
                               elements=sympy.expand(cols[0] / itemsize), bytes=cols[0], kind=s.kind,
                               producer=s.producer, producer_module=s.producer_module, born=s.born,
                               saved_by=s.saved_by))
        note = (f"fitted: polynomial of degree <= {degree} in each of {', '.join(names)} through "
                f"{len(grid)} concrete traces at multiples of the example sizes, checked at {len(checks)} more")
        return Run(out, 0, [], {}, [], {}, [note])
    raise SymmemError(f"no exact polynomial fits the concrete traces: {last_error}")


def _prod(xs: Any) -> Fraction:
    out = Fraction(1)
    for x in xs:
        out *= x
    return out
