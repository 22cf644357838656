"""LaTeX through sympy's printer, with symbol names from the symbol table.

>>> from symmem.symbols import B, S, H, Hi
>>> expression(9 * B * S * H)
'9 B H S'
>>> expression(Hi * B)
'B H_{i}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import sympy

from ..symbols import latex_names

if TYPE_CHECKING:
    from ..derive import Derivation


def expression(expr: sympy.Expr) -> str:
    """LaTeX for one expression (no surrounding ``$``)."""
    return sympy.latex(expr, symbol_names=latex_names())


def align(d: Derivation) -> str:
    """An ``align`` block: one named line per group, then the totals, ready to paste into a paper."""
    from ..simplify import factored

    rows = []
    for group, expr in d.groups().items():
        rows.append(rf"  \text{{{_escape(group)}}} &= {expression(expr)} \\")
    keys = ("activations", "parameter_memory") + (("transient",) if d.transient != 0 else ()) + ("total",)
    for key in keys:
        e = d.expression(key)
        shown = factored(e) if key == "activations" else e
        rows.append(rf"  \text{{{key.replace('_', ' ')}}} &= {expression(shown)} \\")
    rows[-1] = rows[-1].removesuffix(r" \\")
    head = f"% {d.model}, convention {d.convention}, {d.regime.precision} + {d.regime.optimizer}, bytes"
    return "\n".join([head, r"\begin{align}", *rows, r"\end{align}"])


def _escape(text: str) -> str:
    return text.replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("&", r"\&").replace("%", r"\%")
