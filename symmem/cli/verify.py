"""``symmem verify``: measure the project's PyTorch reference of a model and compare with its formula.

``symmem verify --module SPEC --dims B,S`` does the same for any module (the forms of ``symmem trace``): it is
traced, then one real training-mode forward at the derivation's numbers (``--set B=4 --set S=16``; default
the example sizes) is measured and compared with the traced formula there.
"""

from __future__ import annotations

import argparse

from ..errors import SymmemError
from .common import add_derive_options, add_step_options, add_trace_options, derivation_from_args, traced_from_args

NAME = "verify"
HELP = "measure the project's PyTorch reference of a model (or any module: --module SPEC) and compare with its formula"
ORDER = 30


def configure(p: argparse.ArgumentParser) -> None:
    from ..training import OPTIMIZERS

    add_derive_options(p, convention="pytorch", regime=False, optional_model=True)
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
    module = p.add_argument_group("--module SPEC: trace any module and measure it (the SPEC forms of symmem trace)")
    module.add_argument("--module", dest="spec", default=None, metavar="SPEC",
                        help="package.module:callable, path/to/file.py:callable, hf:MODEL_TYPE, torchvision:NAME "
                             "or timm:NAME, instead of a built-in model")
    add_trace_options(module, dims_required=False)


def run(args: argparse.Namespace) -> int:
    from ..record.verify import verify, verify_peak

    if args.device is None:
        args.device = "cpu"  # the module's own device: references are built, and modules loaded, on the CPU

    if not args.peak and (args.optimizer != "adamw" or args.optimizer_impl != "auto" or args.keep_logits
                          or args.micro_batches != 1):
        raise SymmemError("--optimizer, --optimizer-impl, --keep-logits and --micro-batches shape the training "
                          "step: add --peak (without it verify measures what one forward pass keeps)")
    if args.spec is not None:
        return _module(args)
    if args.model is None:
        raise SymmemError("name a built-in model (see `symmem models`) or a module: --module SPEC --dims B,S")
    traced_only = [f"--{k.replace('_', '-')}" for k in ("dims", "multiple_of") if getattr(args, k)]
    traced_only += [f"--{k}" for k in ("config", "example") if getattr(args, k)]
    traced_only += ["--no-check"] if args.no_check else []
    traced_only += ["--method"] if args.method != "auto" else []
    if traced_only:
        raise SymmemError(f"{', '.join(traced_only)} apply to --module SPEC, not to a built-in model")
    from ..units import parse_size

    limit = None if args.max_memory is None else parse_size(args.max_memory)
    d = derivation_from_args(args)
    result = verify_peak(d, max_memory=limit) if args.peak else verify(d, max_memory=limit)
    print(result.report() if args.peak else result.report(verbose=args.verbose))
    return 0 if result.exact else 1


def _module(args: argparse.Namespace) -> int:
    from ..importer import sources
    from .common import model_option_names, values_from_args

    if args.model is not None:
        raise SymmemError(f"give a built-in model ({args.model!r}) or --module SPEC, not both")
    if args.dims is None:
        raise SymmemError("--module needs --dims: the sizes to keep symbolic, e.g. --dims B,S")
    if args.peak:
        raise SymmemError("--peak measures the project's references of built-in models; --module measures one "
                          "forward pass")
    if args.convention != "pytorch" or args.per_layer:
        raise SymmemError("--module: a traced module has its own convention (what PyTorch kept) and is measured "
                          "whole: drop --convention and --per-layer")
    given = [k for k in sorted(model_option_names()) if getattr(args, k, None) is not None]
    if given:
        raise SymmemError(f"--{given[0].replace('_', '-')} is an option of the built-in models; a module's own "
                          "options are its code (hf: --config key=value)")
    if args.precision != "fp32":
        raise SymmemError("verify measures the module as it is: its activations' dtype is its own; drop --precision")
    if "L" in values_from_args(args):
        raise SymmemError("--set L: the module has the layers it was built with; verify measures it as built "
                          "(hf: --config n_layer=...)")
    loaded, dims, d = traced_from_args(args)
    from ..record.verify import check_memory
    from ..units import parse_size

    check_memory(d, None if args.max_memory is None else parse_size(args.max_memory))  # before the real forward
    result = sources.verify_module(loaded, d, dims)
    print(result.report(verbose=args.verbose))
    return 0 if result.exact else 1
