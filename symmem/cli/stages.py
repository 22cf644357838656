"""``symmem stages``: every pipeline stage's memory as ``torch.distributed.pipelining`` holds it."""

from __future__ import annotations

import argparse

from ..errors import SymmemError
from .common import add_derive_options, plan_arguments

NAME = "stages"
HELP = "each pipeline stage's memory and peak under GPipe or 1F1B (torch.distributed.pipelining)"
ORDER = 25


def configure(p: argparse.ArgumentParser) -> None:
    add_derive_options(p)


def run(args: argparse.Namespace) -> int:
    from ..api import pipeline_stages

    if args.pipeline_parallel is None:
        raise SymmemError("symmem stages splits the model into pipeline stages: add --pipeline-parallel [1f1b|gpipe] "
                          "and the stage count (--set p=4)")
    if args.convention != "pytorch" or args.per_layer or args.free:
        raise SymmemError("symmem stages follows PyTorch's step: leave out --convention, --per-layer and --free")
    kw = plan_arguments(args)
    schedule, m = args.pipeline_parallel, kw.pop("micro_batches")
    plan = pipeline_stages(args.model, schedule=schedule, micro_batches=m, **kw)
    print(plan.table())
    return 0
