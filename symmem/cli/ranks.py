"""``symmem ranks``: one tensor-parallel rank's memory as DTensor's standard plan holds it."""

from __future__ import annotations

import argparse

from ..errors import SymmemError
from .common import add_derive_options, derive_arguments

NAME = "ranks"
HELP = "one tensor-parallel rank's memory under DTensor's standard plan (parallelize_module), with t ranks"
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
    kw = derive_arguments(args)
    for key in ("convention", "per_layer", "free", "options", "pipeline_parallel", "pipeline_schedule", "zero"):
        kw.pop(key, None)
    values = dict(kw.pop("values") or {})
    size = int(values.pop("t", DEFAULTS[t]))
    if args.device is not None:
        kw["device"] = args.device
    rank = tensor_parallel_rank(args.model, values=values, **kw)
    from ..api import derive

    d = derive(args.model, values=values, device=args.device, loss=args.loss,
               **{k: v for k, v in kw.items() if k not in ("device", "loss", "sequence_parallel", "tensor_parallel")})
    numbers = {s.name: int(v) for s, v in d.numbers.items()}
    found = rank.at({**numbers, "t": size})
    plan = "tensor and sequence parallel" if args.sequence_parallel else "tensor parallel"
    print(f"one rank of t={size} ({plan}, DTensor's standard plan): bytes")
    for name in ("saved", "parameters", "gradients", "optimizer_state"):
        print(f"  {name.replace('_', ' '):<16} {found[name]:>16,}")
    print(f"  {'total':<16} {sum(found.values()):>16,}")
    return 0
