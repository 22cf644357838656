"""``symmem derive``: a model's training-memory formula as a table, LaTeX or JSON."""

from __future__ import annotations

import argparse

from .common import add_derive_options, derivation_from_args

NAME = "derive"
HELP = "derive a model's training-memory formula"
ORDER = 20


def configure(p: argparse.ArgumentParser) -> None:
    add_derive_options(p)
    p.add_argument("--format", choices=["text", "latex", "json"], default="text")


def run(args: argparse.Namespace) -> int:
    d = derivation_from_args(args)
    if args.format == "json":
        import json

        print(json.dumps(d.to_dict(), indent=2))
    elif args.format == "latex":
        from ..report.latex import align

        print(align(d))
    else:
        print(d.table())
    return 0
