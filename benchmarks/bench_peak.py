"""The peak of a training step as a formula, against the empirical route: tracking one real step.

    python benchmarks/bench_peak.py            # prints a table (seconds on this machine; derive + peak: first call)

For every built-in model with a PyTorch reference: the time to derive the model and its symbolic peak (first
call, then cached), the time to evaluate the peak at a new configuration, and the time one real training step
takes under the live-bytes tracker (the route a user would otherwise take, once per configuration) at the small
sizes the tests use.  The ratio is tracked step / derived peak.
"""

from __future__ import annotations

import statistics
import time

from symmem import derive
from symmem.record.verify import _reference

CASES = [
    ("mlp", {"B": 32}, {}),
    ("resnet18", {"B": 8, "Hi": 64, "Wi": 64, "K": 10}, {}),
    ("resnet50", {"B": 8, "Hi": 64, "Wi": 64, "K": 10}, {}),
    ("vit-ti16", {"B": 8, "Hi": 64, "Wi": 64, "L": 4, "K": 10}, {"attention": "sdpa"}),
    ("gpt2", {"B": 4, "S": 128, "L": 4, "H": 256, "h": 4, "V": 1000}, {"loss": "cross-entropy"}),
    ("bert-base", {"B": 4, "S": 128, "L": 4, "H": 256, "h": 4, "V": 1000}, {}),
    ("llama", {"B": 2, "S": 128, "L": 4, "H": 256, "h": 4, "G": 2, "F": 512, "V": 1000}, {"loss": "cross-entropy"}),
]


def _median(fn, runs: int = 3) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def every_model() -> None:
    """The target: every built-in model's peak (steady and first step) derives in < 1 s, default sizes."""
    from symmem import available_models

    times = {}
    for name in available_models():
        if name == "counts":
            continue
        for kw in ({}, {"loss": "cross-entropy"}) if name in ("gpt2", "llama") else ({},):
            t = time.perf_counter()
            d = derive(name, convention="pytorch", device="cpu", **kw)
            d.value("peak"), d.value("peak_first_step")
            times[name + (" + loss" if kw else "")] = time.perf_counter() - t
    slowest = max(times, key=times.get)
    print(f"every built-in model, derive + peak + first-step peak (first call): median "
          f"{statistics.median(times.values()):.2f}s, slowest {slowest} {times[slowest]:.2f}s")


def main() -> None:
    from symmem.record.steps import track_step

    print(f"{'model':<10} {'derive + peak':>14} {'new config':>11} {'tracked step':>13} {'ratio':>7}")
    for name, values, kw in CASES:
        derived = _median(lambda name=name, values=values, kw=kw: derive(
            name, convention="pytorch", device="cpu", optimizer="adamw", values=values, **kw).peak, 1)
        d = derive(name, convention="pytorch", device="cpu", optimizer="adamw", values=values, **kw)
        d.peak  # noqa: B018 (computed once)
        b = next(s for s in d.free if s.name == "B")
        evaluate = _median(lambda d=d, b=b: d.at(**{b.name: d.numbers[b] + 1}).value("peak"), 5)
        module, inputs, _, target = _reference(d)
        loss = "cross-entropy" if kw.get("loss") else "sum"
        tracked = _median(lambda m=module, i=inputs, lo=loss, t=target: track_step(
            m, i, loss=lo, target=t, optimizer="adamw", steps=1, keep_output=False), 1)
        print(f"{name:<10} {derived:>13.2f}s {evaluate * 1000:>9.1f}ms {tracked:>12.2f}s {tracked / derived:>6.1f}x")
    every_model()


if __name__ == "__main__":
    main()
