"""Bytes and their units: binary (KiB, MiB, GiB, TiB = 2**10 ...) and decimal (kB, MB, GB, TB = 10**3 ...).

The seed paper and PyTorch's allocator use binary units; vendors' GPU sizes are decimal ("80 GB" cards
have 80 GiB-ish of usable memory).  Sizes are parsed, never ``eval``'d.

>>> parse_size("80GiB"), parse_size("1.5 GB"), parse_size("4096")
(85899345920, 1500000000, 4096)
>>> to_unit(2**30 * 3, "GiB")
3.0
>>> format_bytes(2787311616)
'2.596 GiB'
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

from .errors import SymmemError

UNITS: dict[str, int] = {
    "B": 1,
    "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40,
    "kB": 10**3, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
}
_CANON = {k.lower(): k for k in UNITS if k != "KB"}
_SIZE = re.compile(r"^\s*([0-9]+(?:_[0-9]+)*(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


#: The largest size a dimension, a symbol's value or a tensor's element count may have: PyTorch sizes are int64.
MAX_SIZE = 2**63 - 1

#: The longest number :func:`parse_size` reads: Python refuses to convert longer digit strings to int (4300
#: digits by default), and no memory is that large anyway.
MAX_DIGITS = 400


def parse_size(text: str) -> int:
    """Bytes in a size such as ``80GiB``, ``40 GB``, ``512MiB`` or ``1024`` (bytes); rounds down."""
    if not isinstance(text, str):
        raise SymmemError(f"a size is text such as 80GiB, got {text!r}")
    m = _SIZE.match(text)
    if not m:
        shown = text if len(text) <= 60 else text[:40] + "..."
        raise SymmemError(f"{shown!r} is not a size; write e.g. 80GiB, 40GB, 512MiB or 1024 (bytes)")
    number, unit = m.groups()
    if len(number) > MAX_DIGITS:
        raise SymmemError(f"size {text[:40]!r}...: {len(number)} digits are more than the {MAX_DIGITS} symmem reads")
    unit = unit or "B"
    canon = _CANON.get(unit.lower(), unit)
    if canon.lower() == "bytes" or canon.lower() == "byte":
        canon = "B"
    if canon not in UNITS:
        raise SymmemError(f"unknown unit {unit!r} in {text!r}; use one of {', '.join(_CANON.values())}")
    value = Fraction(number.replace("_", "")) * UNITS[canon]
    if int(value) <= 0:
        raise SymmemError(f"size {text!r} is less than one byte" if value > 0 else f"size {text!r} must be positive")
    return int(value)


def _exact(nbytes: int | float | Fraction) -> Fraction:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int | float | Fraction):
        raise SymmemError(f"a number of bytes is a number, got {nbytes!r}")
    if isinstance(nbytes, float) and not math.isfinite(nbytes):
        raise SymmemError(f"a number of bytes is finite, got {nbytes!r}")
    return Fraction(nbytes)


def to_unit(nbytes: int | float, unit: str) -> float:
    """``nbytes`` expressed in ``unit`` (a float; a :class:`SymmemError` when it is too large for one)."""
    if unit not in UNITS:
        raise SymmemError(f"unknown unit {unit!r}; use one of {', '.join(UNITS)}")
    try:
        return float(_exact(nbytes) / UNITS[unit])
    except OverflowError:
        raise SymmemError(f"{format_bytes(nbytes)} is too large to express as a float in {unit}") from None


def format_bytes(nbytes: int | float, binary: bool = True) -> str:
    """A readable size with three decimals: ``2.596 GiB``, ``49.000 MiB``, ``1.29 GB``.

    Computed exactly (no float), so any integer prints; beyond the largest unit the number of that unit grows.

    >>> format_bytes(10**30)
    '909494701772928237.915 TiB'
    """
    steps = ("B", "KiB", "MiB", "GiB", "TiB") if binary else ("B", "kB", "MB", "GB", "TB")
    value = _exact(nbytes)
    unit = steps[0]
    for u in steps:
        if abs(value) >= UNITS[u]:
            unit = u
    if unit == "B":
        return f"{int(value)} B"
    thousandths = round(value * 1000 / UNITS[unit])  # round half to even, as float formatting does
    sign = "-" if thousandths < 0 else ""
    whole, frac = divmod(abs(thousandths), 1000)
    return f"{sign}{whole}.{frac:03d} {unit}"
