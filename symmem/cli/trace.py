"""``symmem trace``: the training-memory formula of a module that is not in the zoo, traced from PyTorch.

``SPEC`` is ``package.module:callable``, ``path/to/file.py:callable``, ``hf:MODEL_TYPE``, ``hf:org/name``,
``hf:DIR`` or ``hf:path/config.json`` (a transformers config, ``--config key=value`` to change them),
``torchvision:NAME`` or ``timm:NAME``
(:mod:`symmem.importer.sources`).  The module runs once on fake tensors whose ``--dims`` are symbols
(:func:`symmem.trace`); the formula prints as ``symmem derive`` prints a zoo model's.  ``--symbolic
H=hidden_size,...`` makes config keys of an ``hf:`` model symbols too (:mod:`symmem.importer.hf_sizes`).
"""

from __future__ import annotations

import argparse

from .common import (
    SPEC_FORMS,
    add_formula_options,
    add_output_options,
    add_symbolic_options,
    add_trace_options,
    emit,
    regime_from_args,
    symbolic_from_args,
    traced_from_args,
)

NAME = "trace"
HELP = "trace a PyTorch module (yours, hf:, torchvision:, timm:) into its training-memory formula"
ORDER = 25


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC",
                   help=SPEC_FORMS)
    add_trace_options(p)
    add_symbolic_options(p)
    add_formula_options(p, model_options=False, front="trace")
    add_output_options(p)


def run(args: argparse.Namespace) -> int:
    from ..importer.collector import no_young_passes

    with no_young_passes():  # the collector's young passes walk millions of live objects for nothing
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    if args.symbolic is not None:
        d = symbolic_from_args(args, per_layer=args.per_layer, peak=args.symbolic_peak, **regime_from_args(args))
    else:
        if args.symbolic_peak:
            from ..errors import SymmemError

            raise SymmemError("--symbolic-peak goes with --symbolic: without it the peak is traced at the sizes given")
        _, _, d = traced_from_args(args, per_layer=args.per_layer, **regime_from_args(args))
    emit(d, args)
    return 0
