"""Where the CPU time of ``symmem trace`` with its peak goes, phase by phase (issue 23's profile).

    python benchmarks/bench_trace_speed.py                   # GPT-2 (6 layers, n_embd 256), ResNet-50 at 64x64
    python benchmarks/bench_trace_speed.py qwen2 llama       # only the cases whose name contains one of these
    python benchmarks/bench_trace_speed.py --profile gpt2    # and cProfile's top functions of the trace + peak

Phases (CPU seconds of this process): ``import`` (torch, transformers, sympy, symmem), ``load`` (building the module
from its SPEC), ``trace`` (:func:`symmem.trace`: one real forward to check against where the weights are real, the
fake forward with symbolic sizes, the fold of identical blocks) and ``peak`` (the training step recorded on fake
tensors at 4, 5 and 6 layers of the repeated blocks, in the trace's fake world and shape cache, folded in L, and the
peak algebra); within the trace and the
peak, the time spent in the fake forward, backward and optimizer step (the recorders' ``_guarded`` calls).  The
whole process against two real training steps of the same model is timed side by side with
``benchmarks/two_real_steps.py`` (its docstring has the command); the README's rows quote those ratios.  This
process keeps Python's default collector; ``symmem trace`` runs without its young passes
(:mod:`symmem.importer.collector`), which the side-by-side command includes.
"""

from __future__ import annotations

import time

T0 = time.process_time()

import collections  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402, F401
import transformers  # noqa: E402, F401

from symmem.importer import sources  # noqa: E402
from symmem.record import saved_tensors  # noqa: E402

IMPORT = time.process_time() - T0
# name, SPEC, --config, --dims
CASES = [
    ("gpt2 6x256", "hf:gpt2", ["n_layer=6", "n_embd=256", "n_head=4"], "B,S"),
    ("resnet50 64x64", "benchmarks/resnet50_64.py:resnet50", [], "B"),
    ("qwen2 (default, meta)", "hf:qwen2", [], "B,S"),
    ("llama (default, meta)", "hf:llama", [], "B,S"),
    ("mistral (default, meta)", "hf:mistral", [], "B,S"),
]
SPENT: collections.Counter = collections.Counter()


def _timed_guarded() -> None:
    """Count the time of each recorder run (forward, backward, optimizer step) by what it ran."""
    inner = saved_tensors.SavedRecorder._guarded

    def guarded(self: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
        c = time.process_time()
        try:
            return inner(self, fn, *args, **kwargs)
        finally:
            what = getattr(fn, "__name__", "") if not hasattr(fn, "func") else "forward"
            kind = "step" if type(self).__name__ == "_StepRecorder" else "trace"
            SPENT[f"{kind} {'forward' if what not in ('backward', 'step') else what}"] += time.process_time() - c

    saved_tensors.SavedRecorder._guarded = guarded  # type: ignore[method-assign]


def run(name: str, spec: str, config: list[str], dims: str, profile: bool) -> None:
    SPENT.clear()
    c = time.process_time()
    loaded = sources.load(spec, config=sources.parse_config(config), loss=None, inputs=None)
    load = time.process_time() - c
    declared = sources.parse_dims(dims, loaded)
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    c = time.process_time()
    d = sources.trace(loaded, declared, method="auto", check=True, multiple_of=None, device="cpu", values={},
                      free=None, loss="sum")
    trace = time.process_time() - c
    c = time.process_time()
    d.value("peak")
    peak = time.process_time() - c
    if prof:
        prof.disable()
    inside = ", ".join(f"{k} {v:.2f}" for k, v in sorted(SPENT.items()))
    print(f"{name:<24} load {load:5.2f}  trace {trace:5.2f}  peak {peak:5.2f}   ({inside})")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv: list[str]) -> int:
    profile = "--profile" in argv
    only = [a for a in argv if a != "--profile"]
    _timed_guarded()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; CPU seconds; import {IMPORT:.2f}")
    for name, spec, config, dims in CASES:
        if (only and any(o in name for o in only)) or (not only and "meta" not in name):
            run(name, spec, config, dims, profile)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
