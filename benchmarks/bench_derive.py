"""Speed and scaling of derivation (run by hand: ``python benchmarks/bench_derive.py``; results in the README).

Targets: each built-in model derives in < 1 s; a synthetic graph of 10,000 ops builds and derives in < 10 s
with close to linear growth; a derived formula evaluates at 1,000,000 configurations in < 1 s with lambdify.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import sympy

from symmem import GraphBuilder, Model, derive
from symmem.models import available
from symmem.symbols import B, H, S


def _time(fn, repeat: int = 3) -> tuple[float, float]:
    """(first, best) wall time: the first run pays sympy's cold caches, later runs show the steady state."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times[0], min(times)


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
    print("synthetic graphs (build + lint + derive):")
    previous = None
    for n in (1_000, 3_000, 10_000):
        t0 = time.perf_counter()
        model = synthetic(n)
        t1 = time.perf_counter()
        d = derive(model, convention="paper")
        d.value("total")
        t2 = time.perf_counter()
        growth = "" if previous is None else f"  ({(t2 - t0) / previous[1]:.2f}x time for {n / previous[0]:.2f}x ops)"
        print(f"  {n:>6} ops: build {t1 - t0:6.2f} s, derive {t2 - t1:6.2f} s, total {t2 - t0:6.2f} s{growth}")
        previous = (n, t2 - t0)
    print("evaluation at 1,000,000 configurations with lambdify:")
    d = derive("vit-b16", attention="naive")
    f = sympy.lambdify(d.free, d.total, "numpy")
    rng = np.random.default_rng(0)
    args = [rng.integers(1, 1024, 1_000_000).astype(np.float64) for _ in d.free]
    t = _time(lambda: f(*args))
    print(f"  vit-b16 total over {len(d.free)} symbols: {t[1] * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
