"""Rich display in Jupyter: a derivation shows the peak of a training step (what must fit) first, then its totals,
and its per-term table folded under ``<details>``.

``Derivation._repr_latex_`` and ``_repr_html_`` call these; :func:`symmem.show` derives and displays in one call.
Every number shown is the derivation's own expression evaluated at its numbers.  The HTML fits a 1,400-pixel
window: formulas are text that wraps (``overflow-wrap``), not one-line LaTeX, and the container is at most
:data:`MAX_WIDTH` pixels wide; term names read as ``blocks.L.ln1 · layer_norm (2nd)`` (:func:`display_name`; the
JSON keeps the names).

>>> from symmem import derive
>>> html = derive("vit-b16", attention="naive")._repr_html_()
>>> "blocks.softmax" in html and "GiB" in html and "<details>" in html
True
"""

from __future__ import annotations

import html as _html
import re
from typing import TYPE_CHECKING, Any

from ..simplify import rounded
from ..symbols import latex_names
from ..units import format_bytes
from .factoring import field, fields, in_sizes, legend, meanings
from .latex import expression, lines

if TYPE_CHECKING:
    from ..derivation import Derivation

#: the widest the display may be, in pixels (a 1,400-pixel window less Jupyter's margins)
MAX_WIDTH = 1300
#: a formula cell wraps rather than widen the table (text, not LaTeX: MathJax does not break lines)
_WRAP = "white-space:normal;overflow-wrap:anywhere;word-break:break-word"


def _size(n: int | None) -> str:
    return "?" if n is None else format_bytes(n)


def title(d: Derivation) -> str:
    """``ViT-B/16 (vit-b16) — FP32 analysis (paper convention), FP32 + AdamW`` (:meth:`Derivation.title`)."""
    return d.title()


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def display_name(name: str) -> str:
    """A term's name as the display shows it: ``module path · op``, a later storage of the same op numbered in
    words; names without a path are unchanged.

    >>> display_name("blocks.L.ln1:layer_norm#2"), display_name("h.attn:matmul"), display_name("blocks.softmax")
    ('blocks.L.ln1 · layer_norm (2nd)', 'h.attn · matmul', 'blocks.softmax')
    """
    path, sep, op = name.rpartition(":")
    if not sep:
        return name
    m = re.fullmatch(r"(.*)#(\d+)", op)
    if m:
        op = f"{m.group(1)} ({_ordinal(int(m.group(2)))})"
    return f"{path} · {op}" if path else op


def latex(d: Derivation) -> str:
    """The peak of a training step (the formula of its moment at these sizes, its value beside it) or why there
    is none, then what is kept at the end of the forward pass + the parameter side, factored around its leading
    term, the parameter side in :math:`\\Psi` (the parameter count, defined below it) as ``align`` prints it."""
    from .headline import peak_state
    from .latex import escape, rows

    found, why = peak_state(d)
    if found:
        _, v, moment = found[0]
        head = rf"M_{{\text{{peak}}}} &= {expression(moment.total)}\ \text{{bytes}}\quad (\text{{{format_bytes(v)}}})"
        pinned = moment.pinned() if hasattr(moment, "pinned") else ""  # a pipeline's: the schedule's numbers
        head += rf"\quad \text{{{escape(pinned)}}}" if pinned else ""
    else:
        head = rf"&\text{{{escape(why or 'no peak')}}}"
    total = d.try_evaluate(d.total)
    value = "" if total is None else rf"\quad (\text{{{format_bytes(total)}}})"
    table = rows(d)
    line = rf"{head} \\ M_{{\text{{kept}}}} &= {table[-1].tex}\ \text{{bytes}}{value}"
    psi = [r for r in table if r.label == r"\Psi"]
    if psi:
        line += rf" \\ \Psi &= {psi[0].tex}"
    if in_sizes(d):  # a formula in the model's own sizes: what each symbol stands for, a row each
        for s, key, said in meanings(d):
            name = latex_names().get(s, s.name)
            key_tex = rf"\mathtt{{{key.replace('_', chr(92) + '_')}}}\ " if key else ""
            line += rf" \\ {name} &: {key_tex}\text{{{said}}}"
    return rf"$$\begin{{aligned}} {line} \end{{aligned}}$$"


def _formula(expr: Any, sized: bool = False) -> str:
    """A formula as text that wraps; ``sized``: in a model's own sizes, the field's way."""
    text = field(rounded(expr)).text() if sized else str(rounded(expr))
    return f"<code style='{_WRAP}'>{_html.escape(text)}</code>"


def headline(d: Derivation, state: tuple[list[Any], str | None] | None = None) -> str:
    """The first line under the title: the peak of a training step and where it occurs, or why there is none."""
    from .headline import PEAK_LABEL, peak_state

    found, why = peak_state(d) if state is None else state
    esc = _html.escape
    if not found:
        return f"<p><b>{esc(why or 'no peak')}</b></p>"
    _, v, moment = found[0]
    from .headline import per_device

    each = per_device(d)
    stages = "" if each is None else "<br><small>peak per stage: " + esc("; first step: ".join(", ".join(
        f"{i}: {format_bytes(x)}" for i, x in enumerate(each[k])) for k in ("peak_per_stage",
                                                                            "peak_first_step_per_stage"))) + "</small>"
    pinned = moment.pinned() if hasattr(moment, "pinned") else ""  # a pipeline's: the schedule's numbers
    return (f"<p><b>{esc(PEAK_LABEL)}: {esc(format_bytes(v))}</b> at {esc(moment.where(step=False))}<br>"
            f"<small>= {_formula(moment.total, in_sizes(d))} bytes{f' ({esc(pinned)})' if pinned else ''}"
            f"</small>{stages}</p>")


def html(d: Derivation) -> str:
    """A header, the peak (or why there is none), the totals, and every term (group, name, role, formula,
    size) folded under ``<details>``."""
    from .headline import name_of, peak_state

    esc = _html.escape
    state = peak_state(d)
    nums = ", ".join(f"{s.name}={v:,}" for s, v in sorted(d.numbers.items(), key=lambda kv: kv[0].name))
    out = [f"<div class='symmem' style='max-width:{MAX_WIDTH}px'><p><b>{esc(title(d))}</b><br>"
           f"<small style='{_WRAP}'>{esc(nums)}</small></p>",
           *([f"<p style='{_WRAP}'><small>where {esc('; '.join(legend(d)))}</small></p>"] if in_sizes(d) else []),
           *(f"<p style='{_WRAP}'><b>Note:</b> {esc(n)}</p>" for n in d.notes),
           headline(d, state),
           f"<table style='table-layout:auto;max-width:{MAX_WIDTH}px'><tbody>"]
    totals = lines(d)[len(d.terms):]
    sized = in_sizes(d)
    for name, e in totals:
        shown = _formula(e, sized) if not (sized and name == "total") else (  # the kept part, then the parameters
            f"<code style='{_WRAP}'>{esc(fields(rounded(e - d.parameter_memory), d.parameter_memory).text())}</code>")
        out.append(f"<tr><th style='text-align:left'>{esc(name_of(name))}</th><td style='{_WRAP}'>{shown}"
                   f"</td><th style='text-align:right;white-space:nowrap'>{_size(d.try_evaluate(e))}</th></tr>")
    params = d.try_evaluate(d.parameters)
    out.append(f"<tr><td>parameters (count)</td><td style='{_WRAP}'>{_formula(d.parameters, sized)}</td>"
               f"<td style='text-align:right'>{'?' if params is None else f'{params:,}'}</td></tr>")
    out += [*_peak_rows(state), "</tbody></table>"]
    out += [f"<details><summary>every kept tensor and the parameter side ({len(d.terms)} terms)</summary>",
            f"<table style='table-layout:auto;max-width:{MAX_WIDTH}px'><thead><tr><th>group</th><th>term</th>"
            "<th>role</th><th>formula (bytes)</th><th>size</th></tr></thead><tbody>"]
    for t in d.terms:
        out.append(f"<tr><td>{esc(t.group)}</td><td style='{_WRAP}' title='{esc(t.name)}'>"
                   f"<code>{esc(display_name(t.name))}</code></td><td>{esc(t.role or '')}</td>"
                   f"<td style='{_WRAP}'>{_formula(t.expr, sized)}</td>"
                   f"<td style='text-align:right;white-space:nowrap'>{_size(d.try_evaluate(t.expr))}</td></tr>")
    out.append("</tbody></table></details></div>")
    return "\n".join(out)


def _peak_rows(state: tuple[list[Any], str | None]) -> list[str]:
    """The peak of a training step, steady and first, with where it occurs (what must fit on a device; the
    totals above are kept at the end of the forward pass + the parameter side)."""
    found, _ = state
    esc = _html.escape
    out = []
    for key, v, at in found:
        label = "peak of a training step" if key == "peak" else "peak (first step)"
        out.append(f"<tr><th style='text-align:left'>{esc(label)}</th><td>at {esc(at.where(step=False))}"
                   f"</td><th style='text-align:right'>{_size(v)}</th></tr>")
    return out
