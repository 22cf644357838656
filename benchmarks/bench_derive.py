"""Speed and scaling of derivation (run by hand: ``python benchmarks/bench_derive.py [--big]``; results in the
README).

Targets: each built-in model derives in < 1 s; ``lint`` and ``derive`` of a synthetic graph of 30,000 ops take
<= 1 s each, growing close to linearly up to 100,000 ops (``--big`` adds 100,000); a derived formula evaluates at
1,000,000 configurations in < 1 s.

For each synthetic graph: ``build`` (GraphBuilder, including the lint ``finish()`` runs), ``lint`` of the built
graph, ``full lint`` of a copy (new nodes: every output inferred again, with the op rules' memo), ``derive``
(``symmem.derive``: storages with lifetimes) and ``total`` (the first ``value("total")`` of a derivation: the
kept view, its sum and the evaluation); best of 3 except ``build``.  Times are CPU seconds of this (single-threaded)
process, which other work on a shared machine barely moves; on an idle machine wall time is the same.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import sympy

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's symmem, not an installed one

from symmem import GraphBuilder, Model, derive
from symmem.graph import lint
from symmem.models import available
from symmem.symbols import B, H, S


def _time(fn, repeat: int = 3) -> tuple[float, float]:
    """(first, best) wall time: the first run pays sympy's cold caches, later runs show the steady state."""
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return times[0], min(times)


SIZES = (1_000, 3_000, 10_000, 30_000)


def synthetic(n_ops: int) -> Model:
    """A chain of n_ops ops: linear / layernorm / gelu / add, widths in H, sequence S."""
    g = GraphBuilder(f"synthetic-{n_ops}")
    x = g.input("x", (B, S, H))
    skip = x
    kinds = ("linear", "layernorm", "gelu", "add")
    for i in range(n_ops - 1):
        kind = kinds[i % 4]
        if kind == "linear":
            x = g.op("linear", x, name=f"op{i}", role="mlp_hidden", out_features=H)
        elif kind == "add":
            x = g.op("add", x, skip, name=f"op{i}", role="residual")
            skip = x
        else:
            x = g.op(kind, x, name=f"op{i}", role="qkv" if kind == "gelu" else None)
    return Model(g.graph.name, g.finish(), {B: 8, S: 128, H: 512}, (B, S, H))


def main() -> int:
    print("built-in models (build + derive: first run / best of 3):")
    for name in sorted(available()):
        for conv in ("paper", "pytorch"):
            try:
                t = _time(lambda name=name, conv=conv: derive(name, convention=conv).value("total"))
            except Exception as exc:  # a convention may not cover every model yet
                print(f"  {name:<14} {conv:<8} n/a ({type(exc).__name__})")
                continue
            print(f"  {name:<14} {conv:<8} {t[0] * 1000:8.1f} ms / {t[1] * 1000:6.1f} ms")
    print("synthetic graphs (seconds, best of 3; growth: time ratio to the previous size, for 3x or 3.3x the ops):")
    print(f"  {'ops':>7} {'build':>7} {'lint':>7} {'full lint':>9} {'derive':>7} {'total':>7}   "
          "growth of full lint / derive")
    previous = None
    for n in SIZES + ((100_000,) if "--big" in sys.argv else ()):
        t0 = time.process_time()
        model = synthetic(n)
        build = time.process_time() - t0
        copy = model.graph.copy()  # new nodes: lint infers every output again
        times = {"lint": [], "full": [], "derive": [], "total": []}
        for _ in range(3):
            t0 = time.process_time()
            lint(model.graph)
            t1 = time.process_time()
            lint(copy)
            t2 = time.process_time()
            d = derive(model, convention="paper")
            t3 = time.process_time()
            d.value("total")
            t4 = time.process_time()
            for key, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[key].append(t)
            del d
        row = {k: min(v) for k, v in times.items()}
        growth = "" if previous is None else \
            f"   {row['full'] / previous['full']:.1f}x / {row['derive'] / previous['derive']:.1f}x"
        print(f"  {n:>7,} {build:7.2f} {row['lint']:7.3f} {row['full']:9.3f} {row['derive']:7.2f} "
              f"{row['total']:7.2f}{growth}")
        previous = row
        del model, copy
    print("evaluation at 1,000,000 configurations:")
    d = derive("vit-b16", attention="naive")
    f = sympy.lambdify(d.free, d.total, "numpy")
    rng = np.random.default_rng(0)
    arrays = {s.name: rng.integers(1, 1024, 1_000_000) for s in d.free}
    args = [arrays[s.name].astype(np.float64) for s in d.free]
    t = _time(lambda: f(*args))
    print(f"  vit-b16 total over {len(d.free)} symbols, lambdify (float64): {t[1] * 1000:.1f} ms")
    t = _time(lambda: d.values("total", **arrays))
    print(f"  vit-b16 total over {len(d.free)} symbols, Derivation.values (exact int64): {t[1] * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
