"""Evaluating a derived formula: one configuration at a time and 10,000 at once (run by hand:
``python benchmarks/bench_evaluate.py``; results in the README).

Targets: ``Derivation.value()`` / ``at()`` through a compiled, cached, exact evaluator; ``Derivation.values()``
at 10,000 distinct configurations in <= 3x the time of ``sympy.lambdify`` (numpy) on the same expression and
the same int64 arrays, exact where lambdify rounds.

* ``substitution``: what ``Derivation.evaluate`` did before: ``sympify(expr.xreplace(numbers))`` rounded up,
  per configuration (distinct configurations, so sympy's cache does not help);
* ``at().value()``: ``d.at(B=b, ...).value("total")`` per configuration, evaluator compiled and cached;
* ``evaluator 1``: the compiled evaluator of the total called at one configuration (what ``value`` runs);
* ``lambdify 1``: the lambdified function called with Python ints at one configuration (floats inside);
* ``values 10k`` / ``lambdify 10k``: 10,000 configurations as int64 arrays, best of several runs;
* ``rounded``: how many of the 10,000 lambdify gets wrong (its float result, rounded up, is not the exact
  integer).

Times are CPU time of this single-threaded process (``time.process_time``), which other work on a shared machine
barely moves.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import sympy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's symmem, not an installed one

from symmem import derive
from symmem.evaluator import evaluator

CASES = [
    ("vit-b16 naive", "vit-b16", {"attention": "naive"}),
    ("resnet50", "resnet50", {}),
    ("gpt2, ZeRO-3", "gpt2", {"zero": 3}),
    ("llama", "llama", {}),
    ("llama + loss (Piecewise)", "llama",
     {"convention": "pytorch", "loss": "cross-entropy", "free": ("B", "S", "G", "h", "H")}),
]
RANGES = {"B": (1, 512), "S": (2, 8192), "H": (64, 8192), "h": (1, 64), "G": (1, 64), "L": (1, 128),
          "F": (64, 32768), "V": (1000, 256000), "N": (1, 1024)}


def _substitution(d, expr, numbers) -> int:
    value = sympy.sympify(expr.xreplace(numbers))
    return int(value) if value.is_integer else int(sympy.ceiling(value))


def _best(fn, repeat: int = 15) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def _configs(d, n: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {s.name: rng.integers(*RANGES.get(s.name, (1, 64)), n, endpoint=True) for s in d.free}


def case(label: str, name: str, options: dict) -> dict[str, float]:
    d = derive(name, **options)
    expr = d.total
    rng = np.random.default_rng(0)
    few = _configs(d, 200, rng)
    rows = [{k: int(v[i]) for k, v in few.items()} for i in range(200)]
    symbols = {s.name: s for s in d.free}
    # substitution, the old evaluate
    t0 = time.process_time()
    old = [_substitution(d, expr, {**d.numbers, **{symbols[k]: v for k, v in row.items()}}) for row in rows]
    t_old = (time.process_time() - t0) / len(rows)
    # at().value(), compiled once (the first call compiles: timed apart)
    t0 = time.process_time()
    d.at(**rows[0]).value("total")
    t_first = time.process_time() - t0
    t0 = time.process_time()
    new = [d.at(**row).value("total") for row in rows]
    t_new = (time.process_time() - t0) / len(rows)
    assert new == old, label
    # lambdify at one configuration
    f = sympy.lambdify(d.free, expr, "numpy")
    args = [rows[0][s.name] for s in d.free]
    t_lam1 = _best(lambda: [f(*args) for _ in range(100)]) / 100
    compiled = evaluator(expr)
    compiled_args = [rows[0].get(s.name, d.numbers.get(s)) for s in compiled.symbols]
    compiled(*compiled_args)
    t_ev1 = _best(lambda: [compiled(*compiled_args) for _ in range(100)]) / 100
    # 10,000 configurations
    many = _configs(d, 10_000, rng)
    arrays = [many[s.name] for s in d.free]
    exact = d.values("total", **many)
    t_values = _best(lambda: d.values("total", **many))
    t_lam = _best(lambda: f(*arrays))
    approx = np.asarray(f(*arrays), dtype=float)
    rounded = int(np.sum(np.ceil(approx) != exact.astype(float))) if exact.dtype != object else -1
    # the old evaluate at 10,000 configurations, extrapolated from 200
    return {"label": label, "old": t_old, "first": t_first, "new": t_new, "lam1": t_lam1, "ev1": t_ev1,
            "values": t_values,
            "lam": t_lam, "rounded": rounded, "dtype": str(exact.dtype)}


def main() -> int:
    print("per configuration: substitution (old evaluate) / at().value() (compiled) / lambdify at 1 config;")
    print("10,000 configurations: values() / lambdify (numpy, same int64 arrays); lambdify wrong after rounding up")
    print(f"  {'formula':<26} {'substitution':>12} {'at().value':>11} {'speed-up':>9} {'evaluator 1':>11} "
          f"{'lambdify 1':>11} {'values 10k':>11} {'lambdify 10k':>13} {'ratio':>6} {'vs old':>9} {'rounded':>8}")
    for label, name, options in CASES:
        r = case(label, name, options)
        print(f"  {r['label']:<26} {r['old'] * 1e6:9.0f} us {r['new'] * 1e6:8.1f} us {r['old'] / r['new']:8.0f}x "
              f"{r['ev1'] * 1e6:8.1f} us {r['lam1'] * 1e6:8.1f} us {r['values'] * 1e6:8.0f} us "
              f"{r['lam'] * 1e6:10.0f} us {r['values'] / r['lam']:5.2f}x {r['old'] * 10_000 / r['values']:8.0f}x "
              f"{r['rounded']:>8}")
        print(f"  {'':<26} (first value(), interpreted: {r['first'] * 1e3:.1f} ms; values dtype {r['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
