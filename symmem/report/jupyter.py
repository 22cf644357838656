"""Rich display in Jupyter: a derivation shows its formula, a per-term table and its totals.

``Derivation._repr_latex_`` and ``_repr_html_`` call these; :func:`symmem.show` derives and displays in one call.
Every number shown is the derivation's own expression evaluated at its numbers.

>>> from symmem import derive
>>> html = derive("vit-b16", attention="naive")._repr_html_()
>>> "blocks.softmax" in html and "GiB" in html
True
"""

from __future__ import annotations

import html as _html
from typing import TYPE_CHECKING

from ..units import format_bytes
from .latex import expression, lines, rows

if TYPE_CHECKING:
    from ..derivation import Derivation


def _size(n: int | None) -> str:
    return "?" if n is None else format_bytes(n)


def title(d: Derivation) -> str:
    """``ViT-B/16 (vit-b16) — FP32 analysis (paper convention), FP32 + AdamW`` (:meth:`Derivation.title`)."""
    return d.title()


def latex(d: Derivation) -> str:
    """The total as one displayed equation, its value beside it: factored around its leading term, the
    parameter side in :math:`\\Psi` (the parameter count, defined below it) as ``align`` prints it."""
    total = d.try_evaluate(d.total)
    value = "" if total is None else rf"\quad (\text{{{format_bytes(total)}}})"
    table = rows(d)
    line = rf"M &= {table[-1].tex}\ \text{{bytes}}{value}"
    psi = [r for r in table if r.label == r"\Psi"]
    if psi:
        line += rf" \\ \Psi &= {psi[0].tex}"
    return rf"$$\begin{{aligned}} {line} \end{{aligned}}$$"


def html(d: Derivation) -> str:
    """A header, the formula, a table of every term (group, name, role, formula, size) and the totals."""
    esc = _html.escape
    nums = ", ".join(f"{s.name}={v:,}" for s, v in sorted(d.numbers.items(), key=lambda kv: kv[0].name))
    out = [f"<div class='symmem'><p><b>{esc(title(d))}</b><br><small>{esc(nums)}</small></p>",
           *(f"<p><b>Note:</b> {esc(n)}</p>" for n in d.notes),
           f"<p>{esc(latex(d))}</p>",
           "<table><thead><tr><th>group</th><th>term</th><th>role</th><th>formula (bytes)</th>"
           "<th>size</th></tr></thead><tbody>"]
    for t in d.terms:
        out.append(f"<tr><td>{esc(t.group)}</td><td><code>{esc(t.name)}</code></td><td>{esc(t.role or '')}</td>"
                   f"<td>${esc(expression(t.expr))}$</td>"
                   f"<td style='text-align:right'>{_size(d.try_evaluate(t.expr))}</td></tr>")
    out.append("</tbody><tbody>")
    totals = lines(d)[len(d.terms):]
    for name, e in totals:
        out.append(f"<tr><th colspan='3' style='text-align:left'>{esc(name)}</th>"
                   f"<td>${esc(expression(e))}$</td><th style='text-align:right'>{_size(d.try_evaluate(e))}</th></tr>")
    params = d.try_evaluate(d.parameters)
    out.append(f"<tr><td colspan='3'>parameters (count)</td><td>${esc(expression(d.parameters))}$</td>"
               f"<td style='text-align:right'>{'?' if params is None else f'{params:,}'}</td></tr>")
    out += [*_peak_rows(d), "</tbody></table></div>"]
    return "\n".join(out)


def _peak_rows(d: Derivation) -> list[str]:
    """The peak of a training step, steady and first, with where it occurs (what must fit on a device; the
    totals above are kept at the end of the forward pass + the parameter side)."""
    from .text import step_peaks

    found = step_peaks(d)
    if not found:
        return []
    esc = _html.escape
    out = ["</tbody><tbody>"]
    for key, v, at in found:
        label = "peak of a training step" if key == "peak" else "peak (first step)"
        out.append(f"<tr><th colspan='3' style='text-align:left'>{esc(label)}</th><td>at {esc(at.where(step=False))}"
                   f"</td><th style='text-align:right'>{_size(v)}</th></tr>")
    return out
