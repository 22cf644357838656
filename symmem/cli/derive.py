"""``symmem derive``: a model's training-memory formula as a table, LaTeX or JSON."""

from __future__ import annotations

import argparse

from .common import add_derive_options, add_output_options, add_symbolic_options, derivation_from_args, emit

NAME = "derive"
HELP = "derive a model's training-memory formula"
ORDER = 20


def configure(p: argparse.ArgumentParser) -> None:
    add_derive_options(p)
    add_symbolic_options(p)
    add_output_options(p)


def run(args: argparse.Namespace) -> int:
    emit(derivation_from_args(args), args)
    return 0
