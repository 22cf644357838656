"""A formula the way the field writes it: the repeated layer first, the largest common monomial outside, the sizes
in the customary order.

Korthikanti et al. write a transformer layer's activations as ``sbh(34 + 5as/h)``; the hand-made formulas
of this kind share three habits, which :func:`field` follows for a formula in a model's own sizes
(:mod:`symmem.importer.symbolic_sizes`):

* **the repeated layer first**: the terms that scale with the layer count ``L`` make one block that leads the
  sum (``4 B S L (...)``), the embedding, final norm and head after it;
* **the largest common monomial outside**: each block pulls out the greatest common divisor of its terms, the
  numbers' and the sizes' (``B S (34 H + 5 h S)``), so that no size that is not in every term turns into a ratio
  (not ``B F L S (16 + 32 H/F + ...)``); ratios the model itself computes (a head size ``H/h``) stay;
* **the customary order**: sizes in a product as the field lists them (:data:`ORDER`: batch, sequence, widths,
  heads, vocabulary ..., the layer count last, as in ``sbhL``), and the terms in a parenthesis from the lowest
  degree to the highest (``34 + 5as/h``; ``34 H + 5 h S``), ties in that order.

:class:`Form` keeps the blocks and prints them as text (:meth:`Form.text`, which ``sympy.sympify`` reads back)
and as LaTeX (:meth:`Form.latex`, which :func:`symmem.report.latex.parse` reads back); :meth:`Form.expr` is the
same formula as an unevaluated sympy expression.  Terms that are not monomials (a ``Piecewise``, a floor) are kept
as they are, after the blocks.

>>> from symmem.symbols import B, F, G, H, L, S, V, h
>>> print(field(34 * B * S * H + 5 * B * h * S**2).text())
B*S*(34*H + 5*S*h)
>>> print(field(16*B*F*L*S + 8*B*G*H*L*S/h + 32*B*H*L*S + 4*B*L*S*h + 8*B*L*S + 12*B*H*S + 4*B*S).text())
4*B*S*L*(2 + 8*H + 2*H*G/h + 4*F + h) + 4*B*S*(1 + 3*H)
>>> print(field(16*B*F*L*S + 8*B*G*H*L*S/h + 32*B*H*L*S + 4*B*L*S*h + 8*B*L*S + 12*B*H*S + 4*B*S).latex())
4 B S L {\\left(2 + 8 H + \\frac{2 H G}{h} + 4 F + h\\right)} + 4 B S {\\left(1 + 3 H\\right)}
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sympy

from ..symbols import L, latex_names

if TYPE_CHECKING:
    from ..derivation import Derivation

#: Sizes in the order the field writes them in a product: batch, sequence, the widths, the heads, the vocabulary,
#: image sizes and classes, the layer count (``sbhL``), then the parallel sizes.  A symbol not listed follows these,
#: by name.
ORDER = ("B", "S", "H", "F", "h", "G", "V", "P", "C", "Hi", "Wi", "K", "L", "t", "p", "N", "m", "Psi", "Nact")

Powers = tuple[tuple[sympy.Symbol, int], ...]


def _rank(s: sympy.Symbol) -> tuple[int, str]:
    return (ORDER.index(s.name), "") if s.name in ORDER else (len(ORDER), s.name)


@dataclass(frozen=True)
class Monomial:
    """One monomial ``coeff * prod(symbol**power)`` (a negative power is a size below the line)."""

    coeff: sympy.Rational
    powers: Powers

    @property
    def degree(self) -> int:
        return sum(k for _, k in self.powers)

    def expr(self) -> sympy.Expr:
        return self.coeff * sympy.Mul(*(s**k for s, k in self.powers))

    def key(self) -> tuple:
        """Lowest degree first; ties: the larger power of the earlier size in :data:`ORDER` first."""
        powers = dict(self.powers)
        ranked = sorted(powers, key=_rank)
        return (self.degree, tuple((_rank(s), -powers[s]) for s in ranked))


@dataclass(frozen=True)
class Factor:
    """``coeff * monomial * (inner[0] + inner[1] + ...)``; one inner term of 1 prints no parenthesis."""

    coeff: sympy.Rational
    monomial: Powers
    inner: tuple[Monomial, ...]

    def expr(self) -> sympy.Expr:
        head = [self.coeff] if self.coeff != 1 else []
        head += [s**k for s, k in self.monomial]
        inner = sympy.Add(*(t.expr() for t in self.inner), evaluate=False) if len(self.inner) > 1 else (
            self.inner[0].expr())
        if inner == 1 and head:
            return sympy.Mul(*head, evaluate=False) if len(head) > 1 else head[0]
        return sympy.Mul(*head, inner, evaluate=False) if head else inner


@dataclass(frozen=True)
class Form:
    """A formula as blocks (the repeated layer's first) and the terms that are not monomials (``other``)."""

    blocks: tuple[Factor, ...]
    other: sympy.Expr = sympy.Integer(0)

    def expr(self) -> sympy.Expr:
        """The same formula, unevaluated in this form (``sympy.expand`` gives the original back)."""
        parts = [b.expr() for b in self.blocks] + ([self.other] if self.other != 0 else [])
        if not parts:
            return sympy.Integer(0)
        return parts[0] if len(parts) == 1 else sympy.Add(*parts, evaluate=False)

    def text(self) -> str:
        """As sympy's ``str`` writes a formula (``4*B*S*L*(2 + 8*H)``), in this form and order."""
        parts = [_block_text(b) for b in self.blocks] + ([str(self.other)] if self.other != 0 else [])
        return _join(parts)

    def latex(self, breakable: bool = False, printer: Callable[[sympy.Expr], str] | None = None) -> str:
        """LaTeX in symmem's symbol names that :func:`symmem.report.latex.parse` reads back.  ``breakable``: a
        parenthesis after ``\\cdot`` (``{4 B S L} \\cdot \\left(...\\right)``), which
        :func:`symmem.report.latex.align` may break across lines, rather than in braces.  ``printer`` writes the
        terms that are not monomials (default: sympy's LaTeX in symmem's names;
        :func:`symmem.report.latex.expression` where this is called from there)."""
        if printer is None:
            names = latex_names()

            def printer(e: sympy.Expr) -> str:
                return sympy.latex(e, symbol_names=names)

        parts = [_block_tex(b, breakable) for b in self.blocks]
        return _join(parts + ([printer(self.other)] if self.other != 0 else []))


def _join(parts: list[str]) -> str:
    out = ""
    for p in parts:
        if not out:
            out = p
        elif p.startswith("-"):
            out += " - " + p[1:].lstrip()
        else:
            out += " + " + p
    return out or "0"


def _monomial(expr: sympy.Expr) -> Monomial | None:
    """``expr`` as a :class:`Monomial`, or None where it is not a rational number times powers of symbols."""
    coeff, rest = expr.as_coeff_Mul()
    if not coeff.is_Rational:
        return None
    powers: dict[sympy.Symbol, int] = {}
    for f in sympy.Mul.make_args(rest):
        base, k = f.as_base_exp()
        if f == 1:
            continue
        if not (base.is_Symbol and k.is_Integer):
            return None
        powers[base] = powers.get(base, 0) + int(k)
    return Monomial(coeff, tuple(sorted(((s, k) for s, k in powers.items() if k), key=lambda sk: _rank(sk[0]))))


def _block(terms: list[Monomial]) -> Factor:
    """The terms with their greatest common divisor outside: the numbers' (sign of the first term kept) and each
    size's least power where it is in every term above the line (or in every term below it)."""
    coeff = abs(functools.reduce(sympy.gcd, [t.coeff for t in terms])) * (1 if any(t.coeff > 0 for t in terms) else -1)
    symbols = {s for t in terms for s, _ in t.powers}
    common: dict[sympy.Symbol, int] = {}
    for s in symbols:
        ks = [dict(t.powers).get(s, 0) for t in terms]
        low, high = min(ks), max(ks)
        if low > 0:
            common[s] = low
        elif high < 0:
            common[s] = high
    monomial = tuple(sorted(common.items(), key=lambda sk: _rank(sk[0])))
    if not monomial and len(terms) > 1:
        coeff = sympy.Integer(1)  # a number alone outside reads worse than the sum (256*(333232*B + 830))
    inner = []
    for t in terms:
        left = {s: k - common.get(s, 0) for s, k in t.powers}
        inner.append(Monomial(t.coeff / coeff, tuple(sorted(((s, k) for s, k in left.items() if k),
                                                        key=lambda sk: _rank(sk[0])))))
    return Factor(coeff, monomial, tuple(sorted(inner, key=Monomial.key)))


def field(expr: sympy.Expr, layers: sympy.Symbol | None = L) -> Form:
    """``expr`` the way the field writes it (see the module docstring): the terms linear in ``layers`` in one
    block first (None: no layer block), the other monomials in a second, the rest as it is.

    >>> from symmem.symbols import B, F, H
    >>> print(field(4*B*F*L + 4*B*H*L).text())
    4*B*L*(H + F)
    >>> sympy.expand(field(4*B*F*L + 4*B*H*L).expr() - (4*B*F*L + 4*B*H*L))
    0
    """
    e = sympy.expand(sympy.sympify(expr, strict=True))
    per_layer: list[Monomial] = []
    rest: list[Monomial] = []
    other: list[sympy.Expr] = []
    for a in sympy.Add.make_args(e):
        if a == 0:
            continue
        t = _monomial(a)
        if t is None:
            other.append(a)
        elif layers is not None and dict(t.powers).get(layers, 0) == 1:
            per_layer.append(t)
        else:
            rest.append(t)
    groups = [per_layer, rest]
    if per_layer and rest:
        # the embedding and the head in the layer's own sizes (4*B*S*(1 + 3*H) after 4*B*S*L*(...)), the rest after
        outer = {s: k for s, k in _block(per_layer).monomial if s != layers}
        if outer:
            groups[1:] = [[t for t in rest if _divides(outer, t)], [t for t in rest if not _divides(outer, t)]]
    blocks = tuple(_block(ts) for ts in groups if ts)
    return Form(blocks, sympy.Add(*other))


def _divides(monomial: dict[sympy.Symbol, int], t: Monomial) -> bool:
    """Whether ``monomial`` divides ``t`` (each size to at least its power there, on the same side of the line)."""
    powers = dict(t.powers)
    return all(0 < k <= powers.get(s, 0) or 0 > k >= powers.get(s, 0) for s, k in monomial.items())


def fields(*exprs: sympy.Expr) -> Form:
    """Several formulas the field's way, one after the other (the kept memory, then the parameter side), as one
    sum."""
    forms = [field(e) for e in exprs if sympy.sympify(e, strict=True) != 0]
    return Form(tuple(b for f in forms for b in f.blocks), sympy.Add(*(f.other for f in forms)))


def _power_text(s: sympy.Symbol, k: int) -> str:
    return s.name if abs(k) == 1 else f"{s.name}**{abs(k)}"


def _term_text(coeff: sympy.Rational, powers: Powers) -> str:
    """``2*G*H/h``; a coefficient of 1 left out, a fraction's denominator below the line with the sizes."""
    num, den = coeff.p, coeff.q
    top = [_power_text(s, k) for s, k in powers if k > 0]
    below = [_power_text(s, k) for s, k in powers if k < 0]
    head = [] if abs(num) == 1 and top else [str(abs(num))]
    text = "*".join(head + top) or "1"
    low = ([str(den)] if den != 1 else []) + below
    if low:
        text += "/" + (low[0] if len(low) == 1 else f"({'*'.join(low)})")
    return ("-" if num < 0 else "") + text


def _block_text(b: Factor) -> str:
    inner = _join([_term_text(t.coeff, t.powers) for t in b.inner])
    if len(b.inner) == 1:
        t = b.inner[0]
        return _term_text(b.coeff * t.coeff, _merge(b.monomial, t.powers))
    head = _term_text(b.coeff, b.monomial)
    return inner if head == "1" else f"-({inner})" if head == "-1" else f"{head}*({inner})"


def _merge(a: Powers, b: Powers) -> Powers:
    out = dict(a)
    for s, k in b:
        out[s] = out.get(s, 0) + k
    return tuple(sorted(((s, k) for s, k in out.items() if k), key=lambda sk: _rank(sk[0])))


def _power_tex(s: sympy.Symbol, k: int) -> str:
    name = latex_names().get(s, s.name)
    return name if abs(k) == 1 else f"{name}^{{{abs(k)}}}"


def _product_tex(number: int, powers: list[tuple[sympy.Symbol, int]]) -> str:
    """``4 B H S^{2}``: the number, the plain sizes in :data:`ORDER`, then the powers (sympy's LaTeX parser reads a
    run of plain symbols only before the first power), two powers apart by ``\\cdot``."""
    plain = [_power_tex(s, k) for s, k in powers if abs(k) == 1]
    raised = [_power_tex(s, k) for s, k in powers if abs(k) != 1]
    head = ([str(number)] if number != 1 or not (plain or raised) else []) + plain
    if len(raised) > 1:
        tail = [r" \cdot ".join(raised)]
        if head:
            tail = [f"{{{tail[0]}}}"]
    else:
        tail = raised
    return " ".join(head + tail)


def _term_tex(coeff: sympy.Rational, powers: Powers) -> str:
    num, den = abs(coeff.p), coeff.q
    top = _product_tex(num, [(s, k) for s, k in powers if k > 0])
    below = [(s, k) for s, k in powers if k < 0]
    if den != 1 or below:
        top = rf"\frac{{{top}}}{{{_product_tex(den, below)}}}"
    return ("- " if coeff < 0 else "") + top


def _block_tex(b: Factor, breakable: bool = False) -> str:
    if len(b.inner) == 1:
        t = b.inner[0]
        return _term_tex(b.coeff * t.coeff, _merge(b.monomial, t.powers))
    inner = _join([_term_tex(t.coeff, t.powers) for t in b.inner])
    head = _term_tex(b.coeff, b.monomial)
    if head == "1":
        return inner
    if head == "- 1":
        return rf"- \left({inner}\right)"
    if breakable:  # sympy's parser reads a run of symbols before \cdot only in braces
        return rf"{{{head}}} \cdot \left({inner}\right)"
    return rf"{head} {{\left({inner}\right)}}"


def in_sizes(d: Derivation) -> bool:
    """Whether ``d`` is a formula in a model's own sizes (:mod:`symmem.importer.symbolic_sizes`), which the views
    write the field's way."""
    return any(n.startswith("every size symbolic") for n in d.notes)


def per_layer_note(storages: Any, layer_count: Any, parameters: Any) -> str | None:
    """One layer's kept bytes and parameters, written as the table writes them (:func:`field`, no layer block),
    so that the note and the table agree; None without a repeated layer.  ``storages``: the derivation's;
    ``parameters``: the parameter count with the layers counted by ``layer_count``.

    >>> from types import SimpleNamespace
    >>> from symmem.symbols import B, F, H, S, h
    >>> kept = [SimpleNamespace(group="layer", category="activation", expr=4*B*S*L*(2*F + 10*H + 3*S*h + 4))]
    >>> per_layer_note(kept, L, L * (2*F*H + F + 4*H**2 + 9*H) + 5*H)
    'per layer: 4*B*S*(4 + 10*H + 2*F + 3*S*h) bytes kept for backward, 9*H + F + 4*H**2 + 2*H*F parameters'
    """
    kept = [s.expr for s in storages if s.group == "layer" and s.category == "activation"]
    if not kept or layer_count is None:
        return None
    one = sympy.expand(sympy.Add(*kept) / layer_count)
    params = sympy.expand(sympy.sympify(parameters, strict=True)).coeff(layer_count)
    return (f"per layer: {field(one, layers=None).text()} bytes kept for backward"
            + (f", {field(params, layers=None).text()} parameters" if params != 0 else ""))


def legend(d: Derivation) -> list[str]:
    """What each symbol of ``d``'s formulas stands for, in :data:`ORDER`: the config key it was read from where
    there is one (``H = hidden_size (hidden size)``), else symmem's meaning of it, else that it is a size of the
    module.

    >>> from symmem import derive
    >>> legend(derive("gpt2", free=("B", "H", "h")))
    ['B: batch size (micro-batch per device)', 'H: hidden size', 'h: attention heads']
    """
    return [f"{s.name} = {key} ({said})" if key else f"{s.name}: {said}" for s, key, said in meanings(d)]


def meanings(d: Derivation) -> list[tuple[sympy.Symbol, str | None, str]]:
    """(symbol, the config key it was read from or None, what it stands for) for each free symbol of ``d``, in
    :data:`ORDER` (:func:`legend` in words)."""
    from ..symbols import meaning

    keys = d.options.get("config_keys") or {}
    return [(s, keys.get(s.name), meaning(s) or "a size the module is built from") for s in sorted(d.free, key=_rank)]
