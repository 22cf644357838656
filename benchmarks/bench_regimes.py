"""A per-device peak under every regime against the single-device peak: ``derive`` + the peak, per model.

    python benchmarks/bench_regimes.py              # gpt2 and llama at their default sizes, N = 8, t = 2
    python benchmarks/bench_regimes.py --rounds 5 llama
    python benchmarks/bench_regimes.py --filed --calls --rounds 1   # the issue's target, in function calls

The target (issue 19, item 5): the peak per device under any engine "costs no more than the single-device peak
does today" -- today being the day the issue was filed.  ``--filed`` holds every case against the one-device peak
(the same checkpointing and gradient accumulation) of the tree the issue was filed against (:data:`FILED`, unpacked
from this checkout's history) and, beside it, against this tree's own one device (the stricter ratio: the one device
got faster since).  ``--calls`` counts the Python function calls each case makes (cProfile) in place of its CPU
seconds: the same count on every run, where this machine's CPU time moves by up to 20% between runs.
Each case is a first call, as on the command line: its own fresh process (imports done before the clock
starts; the modules a case imports lazily read their compiled bytecode, as an installed symmem does: the checkouts
are compiled once, before any round, into a cache of the benchmark's own, so ``PYTHONDONTWRITEBYTECODE`` in the
environment does not charge each case the compiling of the modules it imports), CPU time of that process
(``time.process_time``: other people's load on the machine slows the wall clock, less the CPU time).
Each round times every case once, one device first, and the ratio is taken within the round (paired), then the
median over rounds.  ``--warm``: every case in this process after a warm-up round (sympy's
and the builders' caches filled), a repeated call.  Side by side with another commit, on the same machine and
load: ``PYTHONPATH=<that commit's checkout> python benchmarks/bench_regimes.py`` (each case's process imports
``symmem`` from ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from symmem import derive

#: pipeline parallelism (torch.distributed.pipelining) at p = 4 stages, M = 8 micro-batches; with FSDP2, DDP and
#: ZeroRedundancyOptimizer at N = 8
PIPELINE: list[tuple[str, dict]] = [
    ("pipeline 1f1b p=4 M=8", {"pipeline_parallel": True, "micro_batches": 8, "values": {"p": 4}}),
    ("pipeline gpipe p=4 M=8", {"pipeline_parallel": True, "pipeline_schedule": "gpipe", "micro_batches": 8,
                                "values": {"p": 4}}),
    ("fsdp x pipeline", {"data_parallel": "fsdp", "pipeline_parallel": True, "micro_batches": 8,
                         "values": {"N": 8, "p": 4}}),
    ("ddp x pipeline", {"data_parallel": "ddp", "pipeline_parallel": True, "micro_batches": 8,
                        "values": {"N": 8, "p": 4}}),
    ("zero-1 x pipeline", {"data_parallel": "zero-redundancy", "pipeline_parallel": True, "micro_batches": 8,
                           "values": {"N": 8, "p": 4}}),
    ("ddp-bucket-view x pipeline", {"data_parallel": "ddp-bucket-view", "pipeline_parallel": True, "micro_batches": 8,
                                    "values": {"N": 8, "p": 4}}),
]

#: (label, derive keywords): the engines at N = 8 (ranks), tensor parallel at t = 2, the papers' ZeRO-3
REGIMES: list[tuple[str, dict]] = [
    ("one device", {}),
    *[(engine, {"data_parallel": engine, "values": {"N": 8}})
      for engine in ("ddp", "ddp-bucket-view", "zero-redundancy", "fsdp", "fsdp-no-reshard", "fsdp1",
                     "fsdp1-grad-op")],
    ("--zero 3", {"zero": 3, "values": {"N": 8}}),
    ("tensor parallel t=2", {"tensor_parallel": True, "values": {"t": 2}}),
    ("sequence parallel t=2", {"tensor_parallel": True, "sequence_parallel": True, "values": {"t": 2}}),
    ("fsdp x tensor parallel", {"data_parallel": "fsdp", "tensor_parallel": True, "values": {"N": 8, "t": 2}}),
    ("tensor parallel x pipeline", {"tensor_parallel": True, "pipeline_parallel": True, "micro_batches": 8,
                                    "values": {"t": 2, "p": 4}}),
    ("fsdp x tensor parallel x pipeline", {"data_parallel": "fsdp", "tensor_parallel": True,
                                           "pipeline_parallel": True, "micro_batches": 8,
                                           "values": {"N": 8, "t": 2, "p": 4}}),
    ("sequence parallel x pipeline", {"tensor_parallel": True, "sequence_parallel": True, "pipeline_parallel": True,
                                      "micro_batches": 8, "values": {"t": 2, "p": 4}}),
    ("fsdp x sequence parallel x pipeline", {"data_parallel": "fsdp", "tensor_parallel": True,
                                             "sequence_parallel": True, "pipeline_parallel": True, "micro_batches": 8,
                                             "values": {"N": 8, "t": 2, "p": 4}}),
    *PIPELINE,
    # activation checkpointing and FSDP2's MixedPrecisionPolicy, the configurations people train with (one device
    # with the same checkpointing is the row to hold the checkpointed ones against)
    ("one device, full checkpointing", {"checkpoint": "full"}),
    ("fsdp, full checkpointing", {"data_parallel": "fsdp", "checkpoint": "full", "values": {"N": 8}}),
    ("zero-redundancy, full checkpointing", {"data_parallel": "zero-redundancy", "checkpoint": "full",
                                             "values": {"N": 8}}),
    ("fsdp, bf16 policy", {"data_parallel": "fsdp", "param_dtype": "bfloat16", "values": {"N": 8}}),
    ("fsdp, bf16 policy, full checkpointing, M=4", {"data_parallel": "fsdp", "param_dtype": "bfloat16",
                                                     "checkpoint": "full", "micro_batches": 4, "values": {"N": 8}}),
    ("tensor parallel t=2, full checkpointing", {"tensor_parallel": True, "checkpoint": "full", "values": {"t": 2}}),
    ("pipeline 1f1b p=4 M=8, full checkpointing", {"pipeline_parallel": True, "micro_batches": 8, "checkpoint": "full",
                                                   "values": {"p": 4}}),
]

#: the models' default sizes (GPT-2 124M, Llama-2-7B); tensor parallel is DTensor's Llama plan only
MODELS = {"gpt2": [r for r in REGIMES if not r[1].get("tensor_parallel")], "llama": REGIMES}


def timed(model: str, keywords: dict) -> float:
    """CPU seconds of ``derive`` and its steady and first-step peaks (with ``SYMMEM_BENCH_CALLS`` set in the
    environment: the Python function calls they make instead, as cProfile counts them -- a repeatable measure
    where the machine's CPU time moves between runs)."""
    if os.environ.get("SYMMEM_BENCH_CALLS"):
        import cProfile
        import pstats

        profile = cProfile.Profile()
        profile.enable()
        d = derive(model, convention="pytorch", device="cpu", **keywords)
        d.value("peak"), d.value("peak_first_step")
        profile.disable()
        return float(pstats.Stats(profile).total_calls)
    t = time.process_time()
    d = derive(model, convention="pytorch", device="cpu", **keywords)
    d.value("peak"), d.value("peak_first_step")
    return time.process_time() - t


#: where the checkouts' modules are compiled (``PYTHONPYCACHEPREFIX``), not in the checkouts themselves
PYCACHE = os.path.join(tempfile.gettempdir(), "symmem-bench-pycache")


def _environment(tree: str | None) -> dict[str, str]:
    """The case's environment: ``tree``'s ``symmem`` first on the path (None: the environment's), bytecode read
    from and written to :data:`PYCACHE`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = PYCACHE
    if tree is not None:
        env["PYTHONPATH"] = tree
    return env


def compiled(tree: str | None) -> None:
    """``tree``'s ``symmem`` (None: the environment's) compiled into :data:`PYCACHE` before the clock runs, as a
    package's install compiles it (a first call then reads bytecode, not source, for what it imports lazily)."""
    where = os.path.join(tree, "symmem") if tree else os.path.dirname(sys.modules["symmem"].__file__ or ".")
    subprocess.run([sys.executable, "-m", "compileall", "-q", where], capture_output=True, check=False,
                   env=_environment(tree))


def fresh(model: str, keywords: dict, tree: str | None = None) -> float:
    """:func:`timed` in a new process: a first call.  The script itself is run (not ``python -c`` in the current
    directory, which would put the working directory's ``symmem`` before ``PYTHONPATH``'s); ``tree``: the checkout
    whose ``symmem`` it imports (``PYTHONPATH``; None: the environment's)."""
    out = subprocess.run([sys.executable, __file__, "--case", model, json.dumps(keywords)], capture_output=True,
                         text=True, check=True, env=_environment(tree))
    return float(out.stdout.split()[-1])


def paired(model: str, rounds: int, trees: Sequence[str], only: Sequence[str] = ()
           ) -> list[tuple[str, list[float], list[float], float]]:
    """(label, median seconds per tree, median ratio to one device per tree, median over rounds of the first tree's
    CPU over the second's) per regime, each case timed under every checkout of ``trees`` back to back in each round
    (one device first; the trees' order turns round by round, so that neither always runs first), so that the
    trees are compared on the same load; ``only``: the regimes whose label holds one of them (one device always;
    none: every regime)."""
    cases = [c for c in MODELS[model] if c[0] == "one device" or any(x in c[0] for x in only or [""])]
    for tree in trees:
        compiled(tree)
    times = {label: [[] for _ in trees] for label, _ in cases}
    ratios = {label: [[] for _ in trees] for label, _ in cases}
    for r in range(rounds):
        base = [0.0] * len(trees)
        order = [(r + i) % len(trees) for i in range(len(trees))]
        for label, kw in cases:
            for k in order:
                t = fresh(model, kw, trees[k])
                if label == "one device":
                    base[k] = t
                times[label][k].append(t)
                ratios[label][k].append(t / base[k])
    return [(label, [statistics.median(x) for x in times[label]], [statistics.median(x) for x in ratios[label]],
             statistics.median(a / b for a, b in zip(times[label][0], times[label][-1], strict=True)))
            for label, _ in cases]


#: the commit issue 19 ("The peak per device under the engines people train with") was filed against: the parent
#: of its first commit (2026-11-25 21:58 UTC).  Its item 5 asks that a per-device peak cost "no more than the
#: single-device peak does today": this tree's one-device peak is that cost
FILED = "58610349f309f0d6c14b4ede87e4f7d27e0ef40e"


def filed_tree() -> str:
    """:data:`FILED`'s ``symmem``, unpacked once into the temporary directory from this checkout's history."""
    where = os.path.join(tempfile.gettempdir(), f"symmem-filed-{FILED[:12]}")
    if not os.path.isfile(os.path.join(where, "symmem", "__init__.py")):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        archive = subprocess.run(["git", "-C", root, "archive", FILED, "symmem"], capture_output=True, check=False)
        if archive.returncode:
            raise SystemExit(f"bench_regimes: --filed needs this checkout's git history (commit {FILED[:12]}): "
                             f"{archive.stderr.decode().strip()}")
        os.makedirs(where, exist_ok=True)
        subprocess.run(["tar", "-x", "-C", where], input=archive.stdout, check=True)
    return where


def single(keywords: dict) -> dict:
    """The one-device case a regime's case is held against: the same checkpointing and, outside a pipeline (where
    micro-batches are the schedule's), the same gradient accumulation."""
    kept = {k: keywords[k] for k in ("checkpoint",) if k in keywords}
    if "micro_batches" in keywords and not keywords.get("pipeline_parallel"):
        kept["micro_batches"] = keywords["micro_batches"]
    return kept


def against_filed(model: str, rounds: int) -> list[tuple[str, float, float, float]]:
    """(label, median cost, median ratio to the filed tree's one device, median ratio to this tree's) per regime,
    each held against the one device of :func:`single` (the same checkpointing and accumulation).  Each round
    times the filed tree's one-device cases before and after this tree's (their mean is the round's base), every
    case a first call in a fresh process."""
    filed = filed_tree()
    compiled(filed)
    compiled(None)
    cases = MODELS[model]
    bases = {json.dumps(single(kw), sort_keys=True): single(kw) for _, kw in cases}
    times: dict[str, list[float]] = {label: [] for label, _ in cases}
    to_filed: dict[str, list[float]] = {label: [] for label, _ in cases}
    to_same: dict[str, list[float]] = {label: [] for label, _ in cases}
    for _ in range(rounds):
        before = {key: fresh(model, kw, filed) for key, kw in bases.items()}
        seconds = {label: fresh(model, kw) for label, kw in cases}
        # this tree's one device with each checkpointing: the case's own time where it is a case (timed once)
        own = {json.dumps(kw, sort_keys=True): seconds[label] for label, kw in cases}
        mine = {key: own[key] if key in own else fresh(model, kw) for key, kw in bases.items()}
        base = {key: (before[key] + fresh(model, kw, filed)) / 2 for key, kw in bases.items()}
        for label, kw in cases:
            key = json.dumps(single(kw), sort_keys=True)
            times[label].append(seconds[label])
            to_filed[label].append(seconds[label] / base[key])
            to_same[label].append(seconds[label] / mine[key])
    return [(label, statistics.median(times[label]), statistics.median(to_filed[label]),
             statistics.median(to_same[label])) for label, _ in cases]


def run(model: str, rounds: int, warm: bool = False) -> list[tuple[str, float, float]]:
    """(label, median seconds, median ratio to one device in the same round) per regime."""
    cases = MODELS[model]
    if not warm:
        compiled(None)
    if warm:
        for _, kw in cases:  # warm-up: imports, builders, caches
            timed(model, kw)
    timed_ = timed if warm else fresh
    times: dict[str, list[float]] = {label: [] for label, _ in cases}
    ratios: dict[str, list[float]] = {label: [] for label, _ in cases}
    for _ in range(rounds):
        base = timed_(model, {})
        times["one device"].append(base)
        ratios["one device"].append(1.0)
        for label, kw in cases[1:]:
            t = timed_(model, kw)
            times[label].append(t)
            ratios[label].append(t / base)
    return [(label, statistics.median(times[label]), statistics.median(ratios[label])) for label, _ in cases]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", metavar="MODEL", help="gpt2, llama (default: both)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="repeated calls in one process, not first calls")
    parser.add_argument("--against", metavar="CHECKOUT", action="append", default=[],
                        help="time each case under this checkout's symmem too, back to back in every round (paired); "
                             "the first tree is PYTHONPATH's")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="the regimes whose label holds TEXT (with --against; repeatable)")
    parser.add_argument("--filed", action="store_true",
                        help="each case against the one-device peak of the tree issue 19 was filed against (FILED) "
                             "as well as this tree's")
    parser.add_argument("--calls", action="store_true",
                        help="count Python function calls (cProfile) instead of CPU seconds: repeatable")
    parser.add_argument("--case", nargs=2, metavar=("MODEL", "JSON"), help=argparse.SUPPRESS)  # one fresh call
    args = parser.parse_args(argv)
    if args.calls:
        os.environ["SYMMEM_BENCH_CALLS"] = "1"  # read by every case's process (fresh() passes the environment)
    if args.case:
        print(timed(args.case[0], json.loads(args.case[1])))
        return
    unit = "function calls" if args.calls else "CPU seconds"
    if args.filed:
        for model in args.models or list(MODELS):
            print(f"{model} (default sizes): {unit} of a first call, median of {args.rounds}; ratio to the one-device "
                  f"peak (the same checkpointing and accumulation) of the tree issue 19 was filed against "
                  f"({FILED[:7]}) and to this tree's")
            for label, seconds, filed, same in against_filed(model, args.rounds):
                shown = f"{seconds:10,.0f}" if args.calls else f"{seconds:6.2f} s"
                print(f"  {label:<44} {shown}  {filed:5.2f}x filed  {same:5.2f}x this tree")
        return
    if args.against:
        trees = [os.environ.get("PYTHONPATH", ""), *args.against]
        for model in args.models or list(MODELS):
            print(f"{model} (default sizes): CPU seconds of a first call and ratio to one device, median of "
                  f"{args.rounds}, paired; trees: {', '.join(trees)}")
            for label, seconds, ratios, pair in paired(model, args.rounds, trees, args.only):
                cols = "  ".join(f"{t:6.2f} s {r:5.2f}x" for t, r in zip(seconds, ratios, strict=True))
                print(f"  {label:<44} {cols}  ({pair:4.2f} of the last tree's time, median of the rounds' pairs)")
        return
    for model in args.models or list(MODELS):
        print(f"{model} (default sizes): derive + peak (steady and first step), {unit} of a "
              f"{'repeated' if args.warm else 'first'} call, median of {args.rounds}")
        for label, seconds, ratio in run(model, args.rounds, args.warm):
            shown = f"{seconds:10,.0f}" if args.calls else f"{seconds:6.2f} s"
            print(f"  {label:<22} {shown}  {ratio:5.2f}x")


if __name__ == "__main__":
    main()
