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
import dataclasses
from typing import Any

from .common import (
    SPEC_FORMS,
    add_formula_options,
    add_output_options,
    add_trace_options,
    emit,
    free_from_args,
    regime_from_args,
    traced_from_args,
    values_from_args,
)

NAME = "trace"
HELP = "trace a PyTorch module (yours, hf:, torchvision:, timm:) into its training-memory formula"
ORDER = 25


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", metavar="SPEC",
                   help=SPEC_FORMS)
    add_trace_options(p)
    p.add_argument("--symbolic", default=None, metavar="SYM=config_key,...",
                   help="hf: make config keys symbols of the formula too, e.g. --symbolic H=hidden_size,"
                        "F=intermediate_size,h=num_attention_heads,G=num_key_value_heads,V=vocab_size,"
                        "L=num_hidden_layers (traced at small configurations, fitted exactly, checked at two "
                        "more; --set H=5120 evaluates)")
    p.add_argument("--symbolic-peak", action="store_true",
                   help="with --symbolic: also the peak of the training step in every size (the step recorded at "
                        "each fitted configuration, its layers written out 4 and 5 times: several times slower)")
    add_formula_options(p, model_options=False, front="trace")
    add_output_options(p)


def run(args: argparse.Namespace) -> int:
    if args.symbolic is not None:
        d = symbolic_from_args(args, per_layer=args.per_layer, peak=args.symbolic_peak, **regime_from_args(args))
    else:
        if args.symbolic_peak:
            from ..errors import SymmemError

            raise SymmemError("--symbolic-peak goes with --symbolic: without it the peak is traced at the sizes given")
        _, _, d = traced_from_args(args, per_layer=args.per_layer, **regime_from_args(args))
    emit(d, args)
    return 0


def symbolic_from_args(args: argparse.Namespace, **derive_options: Any) -> Any:
    """The derivation of an ``hf:`` model with the ``--symbolic`` config keys as symbols."""
    from ..api import trace
    from ..errors import SymmemError
    from ..importer import sources
    from ..importer.hf_sizes import hf_sizes, parse_symbolic
    from ..importer.symbolic_sizes import Plan

    if not args.spec.startswith("hf:"):
        raise SymmemError("--symbolic maps symbols to keys of a transformers config: it applies to hf:MODEL_TYPE; "
                          "from Python, symmem.trace(build, dims=..., sizes={...}) takes any module built from sizes")
    if args.multiple_of is not None:
        raise SymmemError("--multiple-of does not go with --symbolic: trace the image sides without it")
    hf_loss = args.loss if args.loss != "sum" else None
    derive_options["loss"] = "output" if hf_loss is not None else args.loss
    model = hf_sizes(args.spec, parse_symbolic(args.symbolic), sources.parse_config(args.config), hf_loss)
    plan = Plan.of(model.sizes, model.divisible)
    with sources.user_code(f"{args.spec}: building the module"):
        first = model.load(plan.sizes_at(plan.base))
    dims = sources.parse_dims(args.dims, first)
    meaning = ", ".join(f"{s} = {k}" for s, k in model.keys.items())
    try:
        with sources.user_code(f"{args.spec}: tracing the module"):
            d = trace(model.build, dims=dims, sizes=model.sizes, divisible=model.divisible, method=args.method,
                      device=args.device or "cpu", name=args.spec, values=values_from_args(args),
                      free=free_from_args(args), **derive_options)
    except SymmemError:
        raise
    except Exception as exc:
        raise SymmemError(f"{args.spec} cannot be traced on fake tensors: {type(exc).__name__}: "
                          f"{str(exc).strip()[:200]}") from None
    inputs = ", ".join(f"{n} = {', '.join(f'{k}:{i}' for k, i in pairs)}" for n, pairs in dims.items())
    said = (f"symbols: {meaning} (config keys of {args.spec}; the config's values: "
            f"{', '.join(f'{s}={v}' for s, v in model.sizes.items())}); {inputs} (input dimensions)")
    return dataclasses.replace(d, notes=(said, *d.notes))
