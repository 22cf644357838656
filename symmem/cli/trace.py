"""``symmem trace``: the training-memory formula of a module that is not in the zoo, traced from PyTorch.

``SPEC`` is ``package.module:callable``, ``path/to/file.py:callable``, ``hf:MODEL_TYPE`` (a transformers
config's defaults, ``--config key=value`` to change them), ``torchvision:NAME`` or ``timm:NAME``
(:mod:`symmem.importer.sources`).  The module runs once on fake tensors whose ``--dims`` are symbols
(:func:`symmem.trace`); the formula prints as ``symmem derive`` prints a zoo model's.
"""

from __future__ import annotations

import argparse

from .common import add_formula_options, add_output_options, add_trace_options, emit, regime_from_args, traced_from_args

NAME = "trace"
HELP = "trace a PyTorch module (yours, hf:, torchvision:, timm:) into its training-memory formula"
ORDER = 25


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC",
                   help="package.module:callable, path/to/file.py:callable, hf:MODEL_TYPE, torchvision:NAME or "
                        "timm:NAME")
    add_trace_options(p)
    add_formula_options(p, model_options=False, front="trace")
    add_output_options(p)


def run(args: argparse.Namespace) -> int:
    _, _, d = traced_from_args(args, per_layer=args.per_layer, **regime_from_args(args))
    emit(d, args)
    return 0
