"""``symmem counts``: the memory of a network given only by its activation and parameter counts."""

from __future__ import annotations

import argparse

from ..units import MAX_SIZE

NAME = "counts"
HELP = ("memory of your network given only by its activation and parameter counts: the CS231n memory rule and "
        "an exact FP32 + Adam accounting")
ORDER = 70


def _positive(text: str) -> int:
    """A positive integer (``1_000`` and ``1,000`` allowed) within PyTorch's sizes."""
    raw = text.replace("_", "").replace(",", "").strip()
    shown = text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"
    if not raw.isascii() or not raw.isdigit():
        raise argparse.ArgumentTypeError(f"{shown!r} is not a positive integer")
    if len(raw.lstrip("0")) > len(str(MAX_SIZE)) or int(raw) > MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{shown!r} is more than the largest size PyTorch allows (2**63 - 1)")
    if int(raw) <= 0:
        raise argparse.ArgumentTypeError(f"{shown!r} is not a positive integer")
    return int(raw)


_positive.__name__ = "positive integer"  # argparse names the type in its message


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--activations", type=_positive, required=True,
                   help="activation values per image (every layer's output volume added up)")
    p.add_argument("--parameters", type=_positive, required=True, help="parameter count")
    p.add_argument("--input", default="224x224x3", help="input WIDTHxHEIGHTxDEPTH (default 224x224x3)")
    p.add_argument("--batch", type=_positive, default=1, help="mini-batch size")


def run(args: argparse.Namespace) -> int:
    from ..apps.from_counts import from_counts, parse_shape

    report = from_counts(args.activations, args.parameters, parse_shape(args.input), args.batch)
    print(report.text())
    return 0
