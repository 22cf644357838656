"""``symmem fit``: the largest batch size (or sequence length) that fits a memory budget."""

from __future__ import annotations

import argparse

from ..errors import SymmemError
from .common import acceptor_from_args, add_derive_options, derivation_from_args

NAME = "fit"
HELP = "the largest batch size (or sequence length) that fits a memory budget"
ORDER = 40


def configure(p: argparse.ArgumentParser) -> None:
    add_derive_options(p)
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="memory budget: 80GiB, 40GB, 512MiB, 1024 (bytes); without it, print the memory the "
                        "current value of --solve needs")
    p.add_argument("--solve", default="B", metavar="SYMBOL", help="the symbol to maximise (default: B)")
    p.add_argument("--format", choices=["text", "json"], default="text")


def run(args: argparse.Namespace) -> int:
    import json

    from ..apps.budget import largest, smallest_budget
    from ..units import format_bytes

    d = derivation_from_args(args)
    accepts = acceptor_from_args(args)
    if d.notes:  # a convention that sees nothing: say why rather than "does not grow" or a size of the input alone
        raise SymmemError(d.notes[0])
    if args.solve not in {s.name for s in d.free} and args.free is None:
        # Keep the solved symbol in the formula even when the model writes it as a number by default.
        args.free = ",".join([s.name for s in d.free] + [args.solve])
        d = derivation_from_args(args)
    if args.budget is None:
        value = next((v for s, v in d.numbers.items() if s.name == args.solve), None)
        if value is None:
            raise SymmemError(f"{d.model} has no symbol {args.solve!r}")
        need = smallest_budget(d, args.solve, value)
        if args.format == "json":
            print(json.dumps({"model": d.model, "convention": d.convention, "symbol": args.solve,
                              "value": value, "smallest_budget": need}, indent=2))
        else:
            print(f"{d.model} ({d.convention}) at {args.solve} = {value:,} needs {format_bytes(need)} ({need:,} B)")
        return 0
    r = largest(d, args.solve, args.budget, accepts=lambda value: accepts(args.solve, value))
    print(json.dumps(r.to_dict(), indent=2) if args.format == "json" else str(r))
    return 0
