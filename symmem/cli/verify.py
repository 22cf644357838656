"""``symmem verify``: measure the project's PyTorch reference of a model and compare with its formula."""

from __future__ import annotations

import argparse

from .common import add_derive_options, derivation_from_args

NAME = "verify"
HELP = "measure the project's PyTorch reference of a model and compare with the pytorch formula"
ORDER = 30


def configure(p: argparse.ArgumentParser) -> None:
    add_derive_options(p, convention="pytorch", device="cpu", regime=False)
    p.add_argument("-v", "--verbose", action="store_true", help="also show the measured bytes per saving op")


def run(args: argparse.Namespace) -> int:
    from ..verify import verify

    result = verify(derivation_from_args(args))
    print(result.report(verbose=args.verbose))
    return 0 if result.exact else 1
