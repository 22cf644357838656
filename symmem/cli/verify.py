"""``symmem verify``: measure the project's PyTorch reference of a model and compare with its formula.

``symmem verify SPEC --dims B,S`` (or ``--module SPEC``) does the same for any module (the forms of ``symmem
trace``): it is traced, then one real training-mode forward at the derivation's numbers (``--set B=4 --set S=16``;
default the example sizes) is measured and compared with the traced formula there; with ``--peak``, two real
training steps of the module under the live-bytes tracker (:func:`symmem.record.steps.track_step`) against its
traced peak.
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import SymmemError
from .common import (
    SPEC_FORMS,
    add_derive_options,
    add_step_options,
    add_symbolic_options,
    builtin_only,
    derivation_from_args,
    is_spec,
    traced_from_args,
)

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
    p.add_argument("--module", dest="spec", default=None, metavar="SPEC",
                   help=f"a module to trace and measure, as the MODEL|SPEC argument takes it: {SPEC_FORMS}")
    sized = p.add_argument_group("--symbolic: the formula in an hf: model's own sizes, checked where it was not "
                                 "fitted (--set H=48 --set L=3 builds the real model there)")
    add_symbolic_options(sized)


def run(args: argparse.Namespace) -> int:
    from ..record.verify import verify, verify_peak

    if args.device is None:
        args.device = "cpu"  # the module's own device: references are built, and modules loaded, on the CPU
    args.peak = args.peak or args.symbolic_peak  # --symbolic-peak: the peak in the sizes, checked by real steps

    if not args.peak and (args.optimizer != "adamw" or args.optimizer_impl != "auto" or args.keep_logits
                          or args.micro_batches != 1):
        raise SymmemError("--optimizer, --optimizer-impl, --keep-logits and --micro-batches shape the training "
                          "step: add --peak (without it verify measures what one forward pass keeps)")
    if args.spec is not None:
        if args.model is not None:
            raise SymmemError(f"give a built-in model ({args.model!r}) or --module SPEC, not both")
        if args.dims is None:
            raise SymmemError("--module needs --dims: the sizes to keep symbolic, e.g. --dims B,S")
        return _module(args)
    if args.model is None:
        raise SymmemError("name a built-in model (see `symmem models`) or a module: SPEC --dims B,S")
    if is_spec(args.model):
        args.spec = args.model
        return _module(args)
    builtin_only(args)
    from ..units import parse_size

    limit = None if args.max_memory is None else parse_size(args.max_memory)
    d = derivation_from_args(args)
    result = verify_peak(d, max_memory=limit) if args.peak else verify(d, max_memory=limit)
    print(result.report() if args.peak else result.report(verbose=args.verbose))
    return 0 if result.exact else 1


def _module(args: argparse.Namespace) -> int:
    from ..importer import sources
    from .common import model_option_names, values_from_args

    if args.spec.endswith(".py"):
        raise SymmemError(f"{args.spec}: name the callable that builds the module, e.g. {args.spec}:build")
    if args.dims is None:
        raise SymmemError(f"{args.spec}: a traced module needs --dims, the sizes to keep symbolic, e.g. --dims B,S")
    if args.convention != "pytorch" or args.per_layer:
        raise SymmemError("--module: a traced module has its own convention (what PyTorch kept) and is measured "
                          "whole: drop --convention and --per-layer")
    given = [k for k in sorted(model_option_names()) if getattr(args, k, None) is not None]
    if given:
        raise SymmemError(f"--{given[0].replace('_', '-')} is an option of the built-in models; a module's own "
                          "options are its code (hf: --config key=value)")
    if args.precision != "fp32":
        raise SymmemError("verify measures the module as it is: its activations' dtype is its own; drop --precision")
    if args.symbolic is not None or args.symbolic_peak:
        return _sized(args)
    if "L" in values_from_args(args):
        raise SymmemError("--set L: the module has the layers it was built with; verify measures it as built "
                          "(hf: --config n_layer=...)")
    from ..record.verify import check_memory
    from ..units import parse_size

    limit = None if args.max_memory is None else parse_size(args.max_memory)
    if args.peak:
        from .common import regime_from_args

        loaded, dims, d = traced_from_args(args, **regime_from_args(args))
        check_memory(d, limit, step=True)  # before the real steps
        peak = _module_peak(loaded, d, dims)
        print(peak.report())
        return 0 if peak.exact else 1
    loaded, dims, d = traced_from_args(args)
    check_memory(d, limit)  # before the real forward
    result = sources.verify_module(loaded, d, dims)
    print(result.report(verbose=args.verbose))
    return 0 if result.exact else 1


def _sized(args: argparse.Namespace) -> int:
    """``--symbolic``: the formula in the model's own sizes (fitted through small configurations), evaluated at the
    sizes ``--set`` gives (default: the config's), against the real model built there: one training-mode forward's
    saved tensors, and with ``--peak`` (or ``--symbolic-peak``) also two real training steps against the peak in
    the sizes."""
    from ..importer import sources
    from ..record.verify import check_memory
    from ..units import parse_size
    from .common import regime_from_args, symbolic_from_args

    if args.symbolic is None:
        raise SymmemError("--symbolic-peak goes with --symbolic: verify --symbolic H=hidden_size,... --symbolic-peak "
                          "checks the peak in the sizes")
    peak = args.peak or args.symbolic_peak
    d = symbolic_from_args(args, peak=peak, **(regime_from_args(args) if peak else {}))
    model = args.hf_sizes
    numbers = {s.name: int(v) for s, v in d.numbers.items()}
    at = {s: numbers[s] for s in model.keys}
    limit = None if args.max_memory is None else parse_size(args.max_memory)
    check_memory(d, limit, step=peak)  # before the real model is built and run
    with sources.user_code(f"{args.spec}: building the module at {at}"):
        loaded = model.load(at).to(args.device or "cpu")
    dims = sources.parse_dims(args.dims, loaded)
    print(f"{args.spec} in its sizes ({', '.join(f'{s} = {k}' for s, k in model.keys.items())}), fitted at small "
          f"configurations, against the real model built at {', '.join(f'{s}={v}' for s, v in at.items())} "
          f"({', '.join(f'{n}={numbers[n]}' for n in dims)})")
    kept = sources.verify_module(loaded, d, dims)  # what one forward saves, always: the formula's own quantity
    print(kept.report(verbose=args.verbose))
    if not peak:
        return 0 if kept.exact else 1
    steps = _module_peak(loaded, d, dims)
    print(steps.report())
    return 0 if kept.exact and steps.exact else 1


def _module_peak(loaded: Any, d: Any, dims: dict[str, Any]) -> Any:
    """Two real training steps of the loaded module at the derivation's numbers under the live-bytes tracker
    (:func:`symmem.record.steps.track_step`: the loss, optimizer, implementation, kept output and micro-batches the
    traced step ran) against the traced peak (:func:`symmem.record.verify.peak_comparison`)."""
    import torch

    from ..importer import sources
    from ..record.steps import track_step
    from ..record.verify import peak_comparison

    if loaded.on_meta:
        raise SymmemError(f"{loaded.spec}: the weights are on the meta device; there is no real step to measure")
    regime = d.regime
    device = str(d.options.get("device", "cpu"))
    numbers = {s.name: int(v) for s, v in d.numbers.items()}
    args, kwargs = sources.resized(loaded, dims, numbers)
    names = list(kwargs)

    class _Keywords(torch.nn.Module):
        """The module called with its keyword inputs given in order (the tracker passes positional ones)."""

        def __init__(self, module: Any) -> None:
            super().__init__()
            self.module = module

        def forward(self, *values: Any) -> Any:
            return self.module(*values[:len(args)], **dict(zip(names, values[len(args):], strict=True)))

    module = _Keywords(loaded.module) if names else loaded.module
    loss = d.options.get("loss", "sum")
    step_loss: Any = _own_loss if loss == "output" else loss
    impl = regime.optimizer_impl if regime.optimizer_impl != "auto" else (
        "foreach" if device.startswith("cuda") else "for-loop")
    with sources.user_code(f"{loaded.spec}: running real training steps"):
        trace = track_step(module, (*args, *kwargs.values()), loss=step_loss, optimizer=regime.optimizer, impl=impl,
                           steps=2, keep_output=regime.keep_logits, micro_batches=regime.micro_batches,
                           autocast=d.options.get("autocast"))
    return peak_comparison(d, trace)


def _own_loss(out: Any) -> Any:
    """The module's own loss (``loss='output'``): a Hugging Face model given labels returns it as ``.loss``."""
    from ..record.steps import loss_value

    return loss_value("output", out, None)
