"""``symmem plot``: a breakdown, memory against batch size or sequence length, or a per-layer profile."""

from __future__ import annotations

import argparse

from ..errors import SymmemError
from .common import add_derive_options, derivation_from_args

NAME = "plot"
HELP = "plot a breakdown, memory vs batch size or sequence length, a per-layer profile, or a step's timeline"
ORDER = 50
KINDS = ("breakdown", "batch", "seq", "profile", "timeline")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("kind", choices=KINDS, help="breakdown | batch | seq | profile | timeline (live memory over a "
                                              "training step; needs --convention pytorch)")
    p.add_argument("--step", choices=["steady", "first"], default="steady",
                   help="timeline: the steady step, or the first (which creates the optimizer state)")
    add_derive_options(p)
    p.add_argument("--output", "-o", required=True, help="file to write: .png, .pdf or .svg")
    p.add_argument("--budget", default=None, metavar="SIZE", help="GPU budget line, e.g. 80GiB (batch/seq)")
    p.add_argument("--range", default=None, metavar="START:STOP[:STEP]", help="values to sweep (batch/seq)")
    p.add_argument("--compare", default=None, metavar="CONV,...",
                   help="breakdown: more conventions, one bar each")


def _range(text: str | None) -> list[int] | None:
    if text is None:
        return None
    parts = text.split(":")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise SymmemError(f"--range {text!r}: expected START:STOP or START:STOP:STEP in integers") from None
    if len(nums) not in (2, 3) or nums[0] < 1 or nums[1] < nums[0]:
        raise SymmemError(f"--range {text!r}: expected 1 <= START <= STOP")
    return list(range(nums[0], nums[1] + 1, nums[2] if len(nums) == 3 and nums[2] > 0 else 1))


def run(args: argparse.Namespace) -> int:
    import copy

    from ..report import plots

    d = derivation_from_args(args)
    if args.kind == "breakdown":
        ds = [d]
        for conv in [c.strip() for c in (args.compare or "").split(",") if c.strip()]:
            other = copy.copy(args)
            other.convention = conv
            ds.append(derivation_from_args(other))
        fig = plots.breakdown(ds, output=args.output)
    elif args.kind == "profile":
        fig = plots.profile(d, output=args.output)
    elif args.kind == "timeline":
        fig = plots.timeline(d, args.step, output=args.output)
    else:
        name = "B" if args.kind == "batch" else "S"
        if name not in {s.name for s in d.free}:
            if not any(s.name == name for s in d.numbers):
                raise SymmemError(f"{d.model} has no symbol {name}, so there is no {args.kind} sweep")
            args.free = ",".join([s.name for s in d.free] + [name])
            d = derivation_from_args(args)
        fig = plots.sweep(d, name, _range(args.range), args.budget, output=args.output)
        if args.budget is not None:
            from ..fit import largest

            plots.close(fig)
            print(args.output)
            largest(d, name, args.budget)  # "nothing fits" is an answer: exit 1, after drawing it
            return 0
    plots.close(fig)
    print(args.output)
    return 0
