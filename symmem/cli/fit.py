"""``symmem fit``: the largest batch size (or sequence length) that fits a memory budget."""

from __future__ import annotations

import argparse

from ..errors import SymmemError
from .common import (
    acceptor_from_args,
    add_derive_options,
    add_symbolic_options,
    derivation_from_args,
    is_spec,
    parse_free,
    sees_nothing,
    values_from_args,
)

NAME = "fit"
HELP = "the largest batch size (or sequence length) that fits a memory budget"
ORDER = 40


def configure(p: argparse.ArgumentParser) -> None:
    add_derive_options(p)
    add_symbolic_options(p)
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="memory budget: 80GiB, 40GB, 512MiB, 1024 (bytes); without it, print the memory the "
                        "current value of --solve needs")
    p.add_argument("--solve", default="B", metavar="SYMBOL", help="the symbol to maximise (default: B)")
    p.add_argument("--format", choices=["text", "json"], default="text")


def run(args: argparse.Namespace) -> int:
    import json

    from ..apps.budget import held_line, held_sizes, largest, smallest_budget
    from ..units import format_bytes

    if is_spec(args.model) and args.free is not None and args.solve not in parse_free(args.free):
        args.free = f"{args.free},{args.solve}"  # keep the solved symbol in the formula (one trace, not two)
    d = derivation_from_args(args)
    if sees_nothing(d):  # a convention that sees nothing: say why rather than "does not grow" or the input alone
        raise SymmemError(sees_nothing(d))
    if args.solve not in {s.name for s in d.free} and args.free is None and not is_spec(args.model):
        # Keep the solved symbol in the formula even when the model writes it as a number by default.
        args.free = ",".join([s.name for s in d.free] + [args.solve])
        d = derivation_from_args(args)
    accepts = acceptor_from_args(args)
    held = held_sizes(d, args.solve)
    where = _held_from(args, d, held)
    if args.budget is None:
        value = next((v for s, v in d.numbers.items() if s.name == args.solve), None)
        if value is None:
            raise SymmemError(f"{d.model} has no symbol {args.solve!r}")
        need = smallest_budget(d, args.solve, value)
        if args.format == "json":
            print(json.dumps({"model": d.model, "convention": d.convention, "symbol": args.solve,
                              "value": value, "smallest_budget": need, "held": dict(held), "held_from": where},
                             indent=2))
        else:
            print(f"{d.model} ({d.convention}) at {args.solve} = {value:,} needs {format_bytes(need)} ({need:,} B)")
            print(held_line(held, where, tuple(s.name for s in d.tied)))
        return 0
    r = largest(d, args.solve, args.budget, accepts=lambda value: accepts(args.solve, value))
    if args.format == "json":
        print(json.dumps({**r.to_dict(), "held_from": where}, indent=2))
    else:
        print(r.text(where))
    return 0


def _held_from(args: argparse.Namespace, d: object, held: tuple[tuple[str, int], ...]) -> dict[str, str]:
    """Where each held size's value comes from: ``--set``, the trace's example inputs, the traced layers, or the
    built-in model's default."""
    given = values_from_args(args)
    traced = is_spec(args.model)
    dims = set(getattr(args, "dims_symbols", ()) or ())
    out = {}
    for name, _ in held:
        if name in given:
            out[name] = "--set"
        elif not traced:
            out[name] = "the model's default"
        elif name in dims:
            out[name] = "the example input"
        elif name in getattr(getattr(args, "hf_sizes", None), "keys", {}) and name != "L":
            out[name] = "the config's value"
        else:
            out[name] = "the traced module's layers"
    return out
