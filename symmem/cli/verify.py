"""``symmem verify``: measure the project's PyTorch reference of a model and compare with its formula."""

from __future__ import annotations

import argparse

from ..errors import SymmemError
from .common import add_derive_options, add_step_options, derivation_from_args

NAME = "verify"
HELP = "measure the project's PyTorch reference of a model and compare with the pytorch formula"
ORDER = 30


def configure(p: argparse.ArgumentParser) -> None:
    from ..training import OPTIMIZERS

    add_derive_options(p, convention="pytorch", device="cpu", regime=False)
    p.add_argument("-v", "--verbose", action="store_true", help="also show the measured bytes per saving op")
    p.add_argument("--max-memory", default=None, metavar="SIZE",
                   help="refuse to measure when the model needs more than this (e.g. 16GiB); default: half of the "
                        "device's memory")
    step = p.add_argument_group("--peak: two real training steps under the live-bytes tracker")
    step.add_argument("--peak", action="store_true",
                      help="compare the derived peak of a training step (first and steady) with real steps")
    step.add_argument("--optimizer", default="adamw", choices=[o for o in OPTIMIZERS if o in (
        "sgd", "sgd-momentum", "adam", "adamw")], help="with --peak (default: %(default)s)")
    add_step_options(step)


def run(args: argparse.Namespace) -> int:
    from ..verify import verify, verify_peak

    if not args.peak and (args.optimizer != "adamw" or args.optimizer_impl != "auto" or args.keep_logits
                          or args.micro_batches != 1):
        raise SymmemError("--optimizer, --optimizer-impl, --keep-logits and --micro-batches shape the training "
                          "step: add --peak (without it verify measures what one forward pass keeps)")
    from ..units import parse_size

    limit = None if args.max_memory is None else parse_size(args.max_memory)
    d = derivation_from_args(args)
    result = verify_peak(d, max_memory=limit) if args.peak else verify(d, max_memory=limit)
    print(result.report() if args.peak else result.report(verbose=args.verbose))
    return 0 if result.exact else 1
