"""``symmem ranks``: one tensor-parallel rank's memory as DTensor's standard plan holds it."""

from __future__ import annotations

import argparse

from ..errors import SymmemError
from .common import add_derive_options, plan_arguments

NAME = "ranks"
HELP = ("one tensor-parallel rank's memory under DTensor's standard plan (parallelize_module), with t ranks "
        "(--data-parallel fsdp or fsdp1: on an N x t mesh)")
ORDER = 26


def configure(p: argparse.ArgumentParser) -> None:
    add_derive_options(p)


def run(args: argparse.Namespace) -> int:
    from ..api import tensor_parallel_rank
    from ..passes.regimes import DEFAULTS
    from ..symbols import t

    if not args.tensor_parallel:
        raise SymmemError("symmem ranks splits the model over tensor-parallel ranks: add --tensor-parallel (and "
                          "--sequence-parallel) and the group size (--set t=8)")
    if args.convention != "pytorch" or args.per_layer or args.free or args.pipeline_parallel or args.zero:
        raise SymmemError("symmem ranks follows DTensor's plan: leave out --convention, --per-layer, --free, "
                          "--pipeline-parallel and --zero")
    kw = plan_arguments(args, "zero")
    values = dict(kw.pop("values") or {})
    size = int(values.pop("t", DEFAULTS[t]))
    rank = tensor_parallel_rank(args.model, values=values, **kw)
    from ..api import derive

    # the numbers the rank is evaluated at, and its step's peak (passes/tensor_step.py), from derive
    d = derive(args.model, values={**values, "t": size}, **kw)
    numbers = {s.name: int(v) for s, v in d.numbers.items()}
    found = rank.at(numbers)
    plan = "tensor and sequence parallel" if args.sequence_parallel else "tensor parallel"
    if getattr(args, "data_parallel", None):  # FSDP x TP: rank 0 of its data-parallel group (the most rows)
        over = "sequence-parallel plan" if args.sequence_parallel else "standard plan"
        print(f"rank 0 of an N={numbers['N']} x t={size} mesh ({args.data_parallel} over DTensor's {over}): bytes")
    else:
        print(f"one rank of t={size} ({plan}, DTensor's standard plan): bytes")
    for name in ("saved", "parameters", "gradients", "optimizer_state"):
        print(f"  {name.replace('_', ' '):<16} {found[name]:>16,}")
    print(f"  {'total':<16} {sum(found.values()):>16,}")
    if getattr(args, "data_parallel", None):
        # the ranks alike (FSDP2's rows held, FSDP1's parts of the flat shards); a refused peak's step has none:
        # every rank then
        alike = getattr(d.step, "groups", None)
        groups = alike(d.numbers) if alike is not None else [[r] for r in range(numbers["N"])]
        states = [0] * numbers["N"]
        for group in groups:  # each set of held rows once
            state = tensor_parallel_rank(args.model, values=values, rank=group[0], **kw).at(numbers)["optimizer_state"]
            for r in group:
                states[r] = state
        if len(set(states)) > 1:  # the padding's rows are missing from the last ranks' optimizer state
            print("  optimizer state by data-parallel rank: " + ", ".join(f"{r}: {v:,}" for r, v in
                                                                          enumerate(states)))
    from ..report.headline import peak_state

    peaks, why = peak_state(d)
    if not peaks:
        print(why)
        return 0
    (_, steady, moment), (_, first, _) = peaks
    print(f"peak per rank: {steady:,} bytes at {moment.where(step=False)}; first step {first:,}")
    return 0
