"""LaTeX through sympy's printer, with symbol names from the symbol table.

Products are printed with an explicit ``\\cdot``: LaTeX that juxtaposes factors (``192 H^{2} L``) is
ambiguous to read back (sympy's lark parser rejects it after a power and reads ``\\left`` as ``\\le ft``),
and every expression symmem emits must parse back to itself (:func:`parse`).

>>> from symmem.symbols import B, S, H, Hi
>>> expression(9 * B * S * H)
'9 \\\\cdot B \\\\cdot H \\\\cdot S'
>>> expression(Hi * B)
'B \\\\cdot H_{i}'
>>> parse(expression(Hi * B)) == Hi * B
True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import sympy

from ..symbols import dims, latex_names

if TYPE_CHECKING:
    from ..derivation import Derivation

# Roles of the small kept tensors the seed's Table 1 puts in its own column ("Indices / Masks").
AUX_ROLES = ("indices", "mask", "dropout_mask")


def expression(expr: sympy.Expr) -> str:
    """LaTeX for one expression (no surrounding ``$``); parses back with :func:`parse`."""
    return sympy.latex(expr, symbol_names=latex_names(), mul_symbol="dot")


def parse(text: str) -> sympy.Expr:
    """Read LaTeX that :func:`expression` wrote back into an expression in symmem's symbols.

    The parser makes plain symbols; they are mapped back by their LaTeX name (``H_{i}`` -> ``Hi``), so
    the result compares equal to the original.

    >>> from symmem.symbols import B, H, S, h
    >>> e = 9 * B * S * H + B * h * S**2
    >>> sympy.expand(parse(expression(e)) - e)
    0
    """
    from sympy.parsing.latex import parse_latex

    if r"\begin{cases}" in text:
        return _parse_cases(text)
    parsed = parse_latex(text, backend="lark")
    by_latex = {d.name: d.symbol for d in dims()}
    # The parser names a symbol by its LaTeX, without the backslash of a Greek letter (\\psi -> psi).
    by_latex.update({d.latex.removeprefix("\\"): d.symbol for d in dims()})
    return parsed.xreplace({s: by_latex[s.name] for s in parsed.free_symbols if s.name in by_latex})


def _top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside braces and ``\\left( ... \\right)``."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        for opener in ("{", r"\left("):
            if text.startswith(opener, i):
                depth += 1
                i += len(opener) - 1
                break
        else:
            for closer in ("}", r"\right)"):
                if text.startswith(closer, i):
                    depth -= 1
                    i += len(closer) - 1
                    break
            else:
                if depth == 0 and text.startswith(sep, i):
                    parts.append(text[start:i])
                    start = i + len(sep)
                    i = start - 1
        i += 1
    return [*parts, text[start:]]


def _parse_condition(text: str) -> sympy.Basic:
    """A condition as sympy prints a ``Piecewise``'s: relations joined by ``\\vee``, ``\\wedge``, ``\\neg``."""
    text = text.strip()
    for sep, op in ((r"\vee", sympy.Or), (r"\wedge", sympy.And)):
        parts = _top_level(text, sep)
        if len(parts) > 1:
            return op(*(_parse_condition(p) for p in parts))
    if text.startswith(r"\neg"):
        return sympy.Not(_parse_condition(text.removeprefix(r"\neg")))
    if text.startswith(r"\left(") and text.endswith(r"\right)"):
        return _parse_condition(text[len(r"\left("):-len(r"\right)")])
    return parse(text)


def _parse_cases(text: str) -> sympy.Expr:
    """LaTeX with ``\\begin{cases}`` blocks (a ``Piecewise``): each block read on its own, the rest around it."""
    begin, end = r"\begin{cases}", r"\end{cases}"
    blocks: dict[sympy.Symbol, sympy.Expr] = {}
    while begin in text:
        i = text.index(begin)
        j = text.index(end, i)
        pieces = []
        for row in _top_level(text[i + len(begin):j], r"\\"):
            value, cond = _top_level(row, "&")
            cond = cond.strip()
            truth = sympy.true if cond == r"\text{otherwise}" else _parse_condition(
                cond.removeprefix(r"\text{for}\:"))
            pieces.append((parse(value), truth))
        mark = sympy.Symbol(f"Z_{{{len(blocks)}}}")  # a placeholder name no symmem symbol has
        blocks[mark] = sympy.Piecewise(*pieces)
        text = f"{text[:i]} Z_{{{len(blocks) - 1}}} {text[j + len(end):]}"
    return parse(text).xreplace(blocks)


def escape(text: str) -> str:
    """``text`` safe inside LaTeX text mode."""
    return (text.replace("\\", r"\textbackslash{}").replace("_", r"\_").replace("&", r"\&")
            .replace("%", r"\%").replace("#", r"\#").replace("$", r"\$"))


def _label(text: str) -> str:
    return rf"\text{{{escape(text)}}}"


def lines(d: Derivation) -> list[tuple[str, sympy.Expr]]:
    """(name, bytes) for every term, then the totals: what :func:`align` prints, one line each."""
    from ..simplify import factored

    rows = [(t.name, t.expr) for t in d.terms]
    rows.append(("activations", factored(d.activations)))
    rows.append(("parameter memory", d.parameter_memory))
    for key in ("input", "loss", "transient"):
        if d.expression(key) != 0:
            rows.append((key, d.expression(key)))
    rows.append(("total", d.total))
    return rows


def align(d: Derivation) -> str:
    """An ``align*`` block with one named line per term and the totals, in bytes, ready to paste."""
    rows = [rf"  {_label(name)} &= {expression(e)} \\" for name, e in lines(d)]
    rows[-1] = rows[-1].removesuffix(r" \\")
    scope = f", one layer ({d.layer})" if d.per_layer else ""
    head = (f"% {d.model}, convention {d.convention}, {d.regime.precision} + {d.regime.optimizer}{scope}; "
            f"bytes, in {', '.join(s.name for s in d.free) or 'numbers only'}")
    return "\n".join([head, r"% needs \usepackage{amsmath}", r"\begin{align*}", *rows, r"\end{align*}"])


def equation(name: str, expr: sympy.Expr, label: str | None = None) -> str:
    """One displayed equation ``name = expr``."""
    tag = f"\\label{{{label}}}" if label else ""
    return "\n".join([r"\begin{equation}" + tag, f"  {name} = {expression(expr)}", r"\end{equation}"])


def split(d: Derivation) -> dict[str, int]:
    """Bytes in the seed's Table 1 columns: saved activations, indices/masks, parameter side, total.

    The parts come from the derivation's own sums, so they add up to its total (inputs and loss, which
    the seed leaves out, and transients, are reported only when present).
    """
    aux = sympy.Add(*(d.sum(role=r) for r in AUX_ROLES))
    out = {
        "activations": d.evaluate(d.activations - aux),
        "aux": d.evaluate(aux),
        "parameter_memory": d.value("parameter_memory"),
    }
    extra = d.input + d.loss + d.transient
    if extra != 0:
        out["other"] = d.evaluate(extra)
    out["total"] = d.value("total")
    return out


def table(rows: Sequence[tuple[str, Derivation]], unit: str = "GiB", digits: int = 3,
          caption: str = "FP32 training memory comparison", label: str | None = "tab:memory") -> str:
    """A booktabs table in the style of the seed's Table 1: one row per (label, derivation).

    Columns: model, convention, saved activations, indices/masks, parameter side (weights, gradients,
    optimizer state), total, and "Other" (inputs, loss, transients) when some row has them.
    """
    from ..units import UNITS

    scale = UNITS[unit]
    splits = [(name, d, split(d)) for name, d in rows]
    other = any("other" in s for _, _, s in splits)
    cols = ["Model", "Convention", "Activations", "Indices/masks", "Param.\\ side"]
    cols += ["Other"] if other else []
    cols += ["Total"]
    body = []
    for name, d, s in splits:
        cells = [escape(name), escape(d.convention)]
        keys = ["activations", "aux", "parameter_memory"] + (["other"] if other else []) + ["total"]
        cells += [f"{s.get(k, 0) / scale:.{digits}f}" for k in keys]
        body.append("  " + " & ".join(cells) + r" \\")
    spec = "ll" + "r" * (len(cols) - 2)
    out = [r"% needs \usepackage{booktabs}", r"\begin{table}[ht]", r"  \centering",
           rf"  \caption{{{escape(caption)} ({unit})}}"]
    if label:
        out.append(rf"  \label{{{label}}}")
    out += [rf"  \begin{{tabular}}{{{spec}}}", r"  \toprule", "  " + " & ".join(cols) + r" \\", r"  \midrule",
            *body, r"  \bottomrule", r"  \end{tabular}", r"\end{table}"]
    return "\n".join(out)
