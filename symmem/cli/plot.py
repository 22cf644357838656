"""``symmem plot``: a breakdown, memory against batch size or sequence length, or a per-layer profile."""

from __future__ import annotations

import argparse
import re

from ..errors import SymmemError
from ..units import MAX_SIZE
from .common import add_derive_options, add_symbolic_options, derivation_from_args, is_spec, sees_nothing

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
    add_symbolic_options(p)
    p.add_argument("--output", "-o", required=True, help="file to write: .png, .pdf or .svg")
    p.add_argument("--budget", default=None, metavar="SIZE", help="GPU budget line, e.g. 80GiB (batch/seq)")
    p.add_argument("--range", default=None, metavar="START:STOP[:STEP]", help="values to sweep (batch/seq)")
    p.add_argument("--compare", default=None, metavar="CONV,...",
                   help="breakdown: more conventions, one bar each")


#: The most values one sweep plots.
MAX_POINTS = 10_000
_NUMBER = re.compile(r"^\s*[0-9][0-9_]*\s*$")


def _range(text: str | None) -> list[int] | None:
    """``START:STOP[:STEP]`` as the values to sweep, STOP included.

    >>> _range("1:10:4")
    [1, 5, 9]
    """
    if text is None:
        return None
    shown = text if len(text) <= 60 else text[:40] + "..."
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(_NUMBER.match(p) for p in parts):
        raise SymmemError(f"--range {shown!r}: expected START:STOP or START:STOP:STEP in positive integers")
    if any(len(p.strip().replace("_", "").lstrip("0")) > len(str(MAX_SIZE)) for p in parts):
        raise SymmemError(f"--range {shown!r}: more than the largest size PyTorch allows (2**63 - 1)")
    nums = [int(p.replace("_", "")) for p in parts]
    start, stop, step = nums[0], nums[1], nums[2] if len(nums) == 3 else 1
    if start < 1 or stop < start or step < 1:
        raise SymmemError(f"--range {shown!r}: expected 1 <= START <= STOP and STEP >= 1")
    if stop > MAX_SIZE:
        raise SymmemError(f"--range {shown!r}: STOP is more than the largest size PyTorch allows (2**63 - 1)")
    points = (stop - start) // step + 1
    if points > MAX_POINTS:
        raise SymmemError(f"--range {shown!r} has {points:,} values, more than the {MAX_POINTS:,} a plot shows; "
                          "give a STEP")
    return list(range(start, stop + 1, step))


#: The most ops a timeline writes out (every layer's ops, op by op): about half a minute on a 2-core machine.
MAX_TIMELINE_OPS = 10_000


def _check_timeline_size(args: argparse.Namespace, d: object) -> None:
    """Refuse a timeline that would write out more ops than :data:`MAX_TIMELINE_OPS` (``--set L=100000``)."""
    from .common import acceptor_from_args

    graph = acceptor_from_args(args).model.graph
    ops = sum(d.evaluate(graph.node(n).count) for n in graph.order())  # type: ignore[attr-defined]
    if ops > MAX_TIMELINE_OPS:
        raise SymmemError(f"the timeline writes out every op of every layer: {ops:,} ops at these sizes, more than "
                          f"{MAX_TIMELINE_OPS:,}; plot fewer layers (--set L=...) or use `plot batch`")


def run(args: argparse.Namespace) -> int:
    import copy

    from ..report import plots

    plots.check_output(args.output)  # before any work: a path that cannot be written is an error now
    values = _range(args.range)
    if is_spec(args.model) and args.compare:
        raise SymmemError("--compare: a traced module has one convention (what PyTorch kept); drop --compare")
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
        if not is_spec(args.model):  # a traced step was run op by op on fake tensors: it has its ops already
            _check_timeline_size(args, d)
        fig = plots.timeline(d, args.step, output=args.output)
    else:
        if sees_nothing(d):  # a convention that sees nothing: its flat curve would answer nothing
            raise SymmemError(sees_nothing(d))
        name = "B" if args.kind == "batch" else "S"
        if name not in {s.name for s in d.free}:
            if not any(s.name == name for s in d.numbers):
                raise SymmemError(f"{d.model} has no symbol {name}, so there is no {args.kind} sweep")
            args.free = ",".join([s.name for s in d.free] + [name])
            d = derivation_from_args(args)
        from ..apps.budget import domain_check
        from .common import acceptor_from_args

        check = acceptor_from_args(args)  # the checks derive makes of a size: the sweep plots only those it accepts
        sym = next(s for s in d.free if s.name == name)
        inside = domain_check(d, sym)  # and only where the formulas hold (a traced module's guards)

        def accepts(value: int) -> str | None:
            why = check(name, value)
            return why if why is not None or inside is None else inside(value)

        if any(s.name == name for s in d.tied):
            # a size that follows from others (ViT's S from the image) moves with them along the sweep, which
            # derive's checks of the size alone refuse: the sweep is then held to PyTorch's largest size only
            accepts = None  # type: ignore[assignment]
        fig = plots.sweep(d, name, values, args.budget, output=args.output, accepts=accepts)
        if args.budget is not None:
            from ..apps.budget import largest

            plots.close(fig)
            print(args.output)
            largest(d, name, args.budget, accepts=accepts)  # "nothing fits" is an answer: exit 1, after drawing it
            return 0
    plots.close(fig)
    print(args.output)
    return 0
