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


def parse_size(text: str) -> int:
    """Bytes in a size such as ``80GiB``, ``40 GB``, ``512MiB`` or ``1024`` (bytes); rounds down."""
    m = _SIZE.match(text or "")
    if not m:
        raise SymmemError(f"{text!r} is not a size; write e.g. 80GiB, 40GB, 512MiB or 1024 (bytes)")
    number, unit = m.groups()
    unit = unit or "B"
    canon = _CANON.get(unit.lower(), unit)
    if canon.lower() == "bytes" or canon.lower() == "byte":
        canon = "B"
    if canon not in UNITS:
        raise SymmemError(f"unknown unit {unit!r} in {text!r}; use one of {', '.join(_CANON.values())}")
    value = Fraction(number.replace("_", "")) * UNITS[canon]
    if value <= 0:
        raise SymmemError(f"size {text!r} must be positive")
    return int(value)


def to_unit(nbytes: int | float, unit: str) -> float:
    """``nbytes`` expressed in ``unit``."""
    if unit not in UNITS:
        raise SymmemError(f"unknown unit {unit!r}; use one of {', '.join(UNITS)}")
    return float(Fraction(int(nbytes)) / UNITS[unit]) if float(nbytes).is_integer() else nbytes / UNITS[unit]


def format_bytes(nbytes: int | float, binary: bool = True) -> str:
    """A readable size with three decimals: ``2.596 GiB``, ``49.000 MiB``, ``1.29 GB``."""
    steps = ("B", "KiB", "MiB", "GiB", "TiB") if binary else ("B", "kB", "MB", "GB", "TB")
    unit = steps[0]
    for u in steps:
        if abs(nbytes) >= UNITS[u]:
            unit = u
    if unit == "B":
        return f"{int(nbytes)} B"
    return f"{nbytes / UNITS[unit]:.3f} {unit}"
