"""The ``symmem`` command.

Bad input (unknown model, symbol or option; values that are not positive integers) prints one line
``symmem: error: ...`` and exits with status 2.  Nothing the user types is ever evaluated: ``--set`` parses
integers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from .errors import SymmemError

_SET = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_]*)\s*=\s*(.*?)\s*$")
_INT = re.compile(r"^[+]?[0-9][0-9_]*$")


def parse_assignment(text: str) -> tuple[str, int]:
    """``NAME=VALUE`` with VALUE a positive integer (underscores allowed: ``1_000``).

    >>> parse_assignment("B=32")
    ('B', 32)
    >>> parse_assignment("B=2.5")
    Traceback (most recent call last):
    symmem.errors.SymmemError: --set B=2.5: '2.5' is not a positive integer
    """
    m = _SET.match(text)
    if not m:
        raise SymmemError(f"--set {text!r}: expected NAME=VALUE, e.g. --set B=32")
    name, raw = m.groups()
    if not _INT.match(raw) or int(raw.replace("_", "")) <= 0:
        raise SymmemError(f"--set {text}: {raw!r} is not a positive integer")
    return name, int(raw.replace("_", ""))


def _parse_sets(items: Sequence[str] | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items or ():
        name, value = parse_assignment(item)
        out[name] = value
    return out


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise SymmemError(message)


def add_derive_options(p: argparse.ArgumentParser) -> None:
    """The options every command that derives a formula shares."""
    from .conventions import names as convention_names
    from .models import entry
    from .training import OPTIMIZERS, PRECISIONS

    p.add_argument("model", help="a built-in model (see `symmem models`)")
    p.add_argument("--convention", default="paper", choices=convention_names(),
                   help="which tensors are kept (default: paper)")
    p.add_argument("--optimizer", default="adamw", choices=list(OPTIMIZERS), help="default: adamw")
    p.add_argument("--precision", default="fp32", choices=list(PRECISIONS), help="default: fp32")
    p.add_argument("--attention", choices=["naive", "sdpa"], default=None,
                   help="transformers: naive keeps the B*h*S^2 probabilities, sdpa does not")
    p.add_argument("--dropout", type=float, default=None, help="dropout probability (sequence models)")
    gelu = entry("gpt2").options["gelu"]
    p.add_argument("--gelu", choices=list(gelu.choices or ()), default=None,
                   help=f"models with a GELU option (gpt2): {gelu.help} (default: {gelu.default})")
    p.add_argument("--set", action="append", metavar="NAME=VALUE", default=[],
                   help="give a symbol a value, e.g. --set B=32 (repeatable)")
    p.add_argument("--free", default=None, metavar="A,B,...",
                   help="symbols to keep in the formula (default: the model's)")
    p.add_argument("--per-layer", action="store_true", help="one repeated layer instead of the whole model")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None,
                   help="pytorch convention: the device whose kernels decide what is kept (default: cuda)")
    p.add_argument("--loss", choices=["cross-entropy"], default=None,
                   help="append the loss after the model's output, as its own group (default: no loss)")
    regime = p.add_argument_group("training regime (docs/regimes.md); sizes are symbols N, t, p: --set t=8")
    regime.add_argument("--checkpoint", default="none", metavar="none|full|selective|every-K",
                        help="activation checkpointing of the repeated layers (default: none)")
    regime.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3],
                        help="ZeRO stage over N data-parallel ranks (3 = FSDP full sharding)")
    regime.add_argument("--tensor-parallel", action="store_true", help="Megatron tensor parallelism over t ranks")
    regime.add_argument("--sequence-parallel", action="store_true",
                        help="with --tensor-parallel: split the remaining activations over t too")
    regime.add_argument("--pipeline-parallel", action="store_true",
                        help="p pipeline stages, 1F1B schedule (the first stage's memory)")


def derivation_from_args(args: argparse.Namespace) -> Any:
    """The derivation the shared options describe."""
    from .derive import derive
    from .models import entry

    e = entry(args.model)
    model_options = {k: getattr(args, k) for k in ("attention", "dropout", "gelu")
                     if getattr(args, k) is not None}
    unknown = [k for k in model_options if k not in e.options]
    if unknown:
        raise SymmemError(f"model {args.model!r} has no option --{unknown[0]}")
    free = tuple(x.strip() for x in args.free.split(",") if x.strip()) if args.free else None
    conv_options = {"device": args.device} if args.device is not None else {}
    return derive(args.model, convention=args.convention, optimizer=args.optimizer, precision=args.precision,
                  per_layer=args.per_layer, values=_parse_sets(args.set), free=free, options=conv_options,
                  loss=args.loss, checkpoint=args.checkpoint, zero=args.zero, tensor_parallel=args.tensor_parallel,
                  sequence_parallel=args.sequence_parallel, pipeline_parallel=args.pipeline_parallel,
                  **model_options)


def _cmd_models(args: argparse.Namespace) -> int:
    from .models import available, build

    pad = " " * 15
    for name, e in sorted(available().items()):
        m = build(name)
        defaults = ", ".join(f"{s.name}={m.defaults[s]}" for s in m.symbols if s in m.defaults)
        print(f"{name:<14} {e.description}")
        print(f"{pad}formula in {', '.join(s.name for s in m.free)}; defaults: {defaults}")
        if args.verbose:
            for key, o in e.options.items():
                choices = f" ({'|'.join(map(str, o.choices))})" if o.choices else ""
                print(f"{pad}--{key} {o.default}{choices}: {o.help}")
    return 0


def _cmd_derive(args: argparse.Namespace) -> int:
    d = derivation_from_args(args)
    if args.format == "json":
        print(json.dumps(d.to_dict(), indent=2))
    elif args.format == "latex":
        from .report.latex import align

        print(align(d))
    else:
        print(d.table())
    return 0


COMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None], str]] = {}


def command(name: str, help: str) -> Callable:  # type: ignore[type-arg]
    """Register a subcommand: decorate its ``configure(parser)``; it sets ``parser.set_defaults(run=...)``."""

    def wrap(configure: Callable[[argparse.ArgumentParser], None]) -> Callable:  # type: ignore[type-arg]
        COMMANDS[name] = (configure, help)
        return configure

    return wrap


@command("models", "list the built-in models")
def _models(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help="also show each model's options")
    p.set_defaults(run=_cmd_models)


@command("derive", "derive a model's training-memory formula")
def _derive(p: argparse.ArgumentParser) -> None:
    add_derive_options(p)
    p.add_argument("--format", choices=["text", "latex", "json"], default="text")
    p.set_defaults(run=_cmd_derive)


def _parser() -> argparse.ArgumentParser:
    import importlib

    for module in ("symmem.verify", "symmem.fit", "symmem.report.plots", "symmem.paper", "symmem.counts"):
        importlib.import_module(module)
    parser = _Parser(prog="symmem", description="Closed-form training-memory formulas.")
    from . import __version__

    parser.add_argument("--version", action="version", version=f"symmem {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (configure, help_text) in COMMANDS.items():
        configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``symmem`` command; returns the exit status."""
    try:
        args = _parser().parse_args(argv)
        return int(args.run(args))
    except SymmemError as exc:
        print(f"symmem: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    # Run the imported module's main: commands in other modules register on ``symmem.cli``, not ``__main__``.
    from symmem.cli import main as _main

    sys.exit(_main())
