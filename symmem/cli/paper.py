"""``symmem paper``: write (and compile) the LaTeX paper on ResNet-50 and ViT-B/16 memory."""

from __future__ import annotations

import argparse

NAME = "paper"
HELP = "write (and compile) the LaTeX paper on ResNet-50 and ViT-B/16 memory"
ORDER = 60


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", "-o", required=True, metavar="DIR", help="directory for main.tex and the PDF")
    p.add_argument("--no-pdf", action="store_true", help="write the .tex files only")
    p.add_argument("--force", action="store_true", help="overwrite an existing main.tex in DIR")


def run(args: argparse.Namespace) -> int:
    from ..paper import write

    p = write(args.output, compile=not args.no_pdf, force=args.force)
    print(p.pdf if p.pdf is not None else p.tex)
    if p.note and p.pdf is None:
        print(f"note: {p.note}")
    return 0
