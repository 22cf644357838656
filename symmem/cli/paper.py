"""``symmem paper``: write (and compile) a LaTeX paper on the training memory of the models named.

Without ``--model`` it is the paper on ResNet-50 and ViT-B/16 that reproduces the FP32 analysis of ResNet-50 and
ViT-B/16 (Bandyopadhyay, 2024).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import SymmemError

NAME = "paper"
HELP = "write (and compile) a LaTeX paper on the training memory of the models named (default: ResNet-50 and ViT-B/16)"
ORDER = 60


def configure(p: argparse.ArgumentParser) -> None:
    from ..conventions import names as convention_names
    from ..options import add_arguments
    from ..training import OPTIMIZERS

    p.add_argument("--output", "-o", required=True, metavar="DIR", help="directory for main.tex and the PDF")
    p.add_argument("--model", "-m", action="append", default=None, metavar="MODEL|SPEC",
                   help="a built-in model or a module to trace (a SPEC, with --dims) to write about (repeatable; "
                        "default: resnet50-v1 and vit-b16, the FP32 analysis of ResNet-50 and ViT-B/16)")
    p.add_argument("--attention", action="append", default=None, choices=["naive", "sdpa"],
                   help="attention kernel of the models that take one (repeatable: one row each; default: naive and "
                        "sdpa for the default models, else each model's own)")
    p.add_argument("--convention", default=None, choices=convention_names(),
                   help="which tensors are kept (default: paper; pytorch adds the peak of a training step)")
    p.add_argument("--optimizer", default=None, choices=list(OPTIMIZERS), help="default: adamw")
    add_arguments(p, "derive", ("precision", "checkpoint", "loss", "device"))
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="give a symbol a value in every model that has it, e.g. --set B=16 (repeatable)")
    p.add_argument("--budget", default=None, metavar="SIZE", help="budget of the scaling figure (default: 80GiB)")
    p.add_argument("--no-pdf", action="store_true", help="write the .tex files only")
    p.add_argument("--force", action="store_true", help="overwrite an existing main.tex in DIR")
    from .common import add_symbolic_options, add_trace_options

    traced = p.add_argument_group("a module traced from a SPEC (the forms of `symmem trace`)")
    add_trace_options(traced, dims_required=False)
    add_symbolic_options(traced)  # hf: the article's formula in the model's own sizes


def run(args: argparse.Namespace) -> int:
    from ..apps.article import Spec, write
    from .common import assignments

    values = dict(assignments(args.set))
    traced = _traced(args)
    spec = Spec.make(args.model, args.attention, convention=args.convention, optimizer=args.optimizer,
                     precision=args.precision, checkpoint=args.checkpoint, device=args.device,
                     loss=None if args.loss == "sum" else args.loss, values=values or None, budget=args.budget,
                     traced=traced or None)
    p = write(args.output, spec, compile=not args.no_pdf, force=args.force)
    print(p.pdf if p.pdf is not None else p.tex)
    if p.note and p.pdf is None:
        print(f"note: {p.note}")
    return 0


def _traced(args: argparse.Namespace) -> dict[str, Any]:
    """The SPECs among ``--model``, traced (``symmem trace``'s options, the paper's regime and ``--set``); a paper
    with one is on the ``pytorch`` convention (what PyTorch keeps), which a traced module is."""
    import copy

    from .common import builtin_only, is_spec, traced_derivation

    specs = [m for m in args.model or () if is_spec(m)]
    if not specs:
        builtin_only(argparse.Namespace(**{**vars(args), "model": ", ".join(args.model or ("resnet50-v1",))}))
        return {}
    if args.convention not in (None, "pytorch"):
        raise SymmemError(f"--convention {args.convention}: a traced module has its own convention (what PyTorch "
                          "kept), the pytorch one; drop --convention")
    args.convention = "pytorch"
    out = {}
    for spec in specs:
        one = copy.copy(args)
        one.model, one.optimizer, one.free, one.per_layer = spec, args.optimizer or "adamw", None, False
        out[spec] = traced_derivation(one)
    return out
