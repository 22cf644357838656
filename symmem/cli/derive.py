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
    view = p.add_argument_group("text and LaTeX layout")
    view.add_argument("--width", type=_width, default=None, metavar="COLUMNS",
                      help="text table width (default: the terminal's, else 100)")
    view.add_argument("--fold", action="store_true", help="text: one row per group, without its terms")
    view.add_argument("--cut", action="store_true",
                      help="text: each formula on one line, cut with an ellipsis (information lost)")
    view.add_argument("--latex-form", choices=["compact", "terms"], default="compact",
                      help="LaTeX: one line per group, a repeated layer once times its count (compact), or one "
                           "line per kept tensor (terms)")


def _width(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--width takes a number of columns, not {text!r}") from None
    if not 40 <= value <= 1000:
        raise argparse.ArgumentTypeError(f"--width must be between 40 and 1000 columns, not {value}")
    return value


def run(args: argparse.Namespace) -> int:
    d = derivation_from_args(args)
    if args.format == "json":
        import json

        print(json.dumps(d.to_dict(), indent=2))
    elif args.format == "latex":
        from ..report.latex import align

        print(align(d, form=args.latex_form))
    else:
        from ..report.text import table

        print(table(d, width=args.width, fold=args.fold, cut=args.cut))
    return 0
