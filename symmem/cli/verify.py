"""``symmem verify``: measure the project's PyTorch reference of a model and compare with its formula."""

from __future__ import annotations

import argparse

from .common import add_derive_options, derivation_from_args

NAME = "verify"
HELP = "measure the project's PyTorch reference of a model and compare with the pytorch formula"
ORDER = 30


def configure(p: argparse.ArgumentParser) -> None:
    add_derive_options(p)
    p.add_argument("-v", "--verbose", action="store_true", help="also show the measured bytes per saving op")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="refuse to measure when the model needs more than this (e.g. 16GiB); default: half of the "
                        "device's memory")
    p.set_defaults(convention="pytorch")


def run(args: argparse.Namespace) -> int:
    from ..conventions import convention
    from ..verify import verify

    if args.device is None and "device" in convention(args.convention).options:
        args.device = "cpu"  # the formula for the device the measurement runs on
    from ..units import parse_size

    limit = None if args.max_memory is None else parse_size(args.max_memory)
    result = verify(derivation_from_args(args), max_memory=limit)
    print(result.report(verbose=args.verbose))
    return 0 if result.exact else 1
