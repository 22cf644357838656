"""The field's factoring (issue 20 item 4): :func:`symmem.report.factoring.field` on a table of cases.

Truth for each case: sympy's equality with the unfactored formula -- of the form itself, of its text read back by
``sympy.parse_expr`` and of its LaTeX read back by sympy's LaTeX parser (:func:`symmem.report.latex.parse`) -- plus
the printed shape the field writes, typed in from the papers' forms (Korthikanti et al.'s ``sbh(34 + 5as/h)`` in
symmem's symbols, a layer count last, a common monomial outside).
"""

from __future__ import annotations

import pytest
import sympy

from symmem.report.factoring import field
from symmem.report.latex import parse
from symmem.symbols import B, F, G, H, L, Psi, S, V, dims, h

# (formula, its text, its LaTeX)
CASES = [
    # Korthikanti's per-layer activations without the layer count: the common monomial B*S outside, no ratio
    (34 * B * S * H + 5 * B * h * S**2, "B*S*(34*H + 5*S*h)", r"B S {\left(34 H + 5 S h\right)}"),
    # ... with it: the layer count last in the monomial (sbhL)
    (34 * B * S * H * L + 5 * B * h * S**2 * L, "B*S*L*(34*H + 5*S*h)", r"B S L {\left(34 H + 5 S h\right)}"),
    # two widths in a block: the hidden size before the MLP width
    (4 * B * F * L + 4 * B * H * L, "4*B*L*(H + F)", r"4 B L {\left(H + F\right)}"),
    # Llama's activations in every size: the repeated layer first, its own ratio (the key/value width G*H/h) kept,
    # no ratio that the layer did not compute (not B*F*L*S*(16 + 32*H/F + ...))
    (16 * B * F * L * S + 8 * B * G * H * L * S / h + 32 * B * H * L * S + 4 * B * L * S * h + 8 * B * L * S
     + 12 * B * H * S + 4 * B * S,
     "4*B*S*L*(2 + 8*H + 2*H*G/h + 4*F + h) + 4*B*S*(1 + 3*H)",
     r"4 B S L {\left(2 + 8 H + \frac{2 H G}{h} + 4 F + h\right)} + 4 B S {\left(1 + 3 H\right)}"),
    # Llama's parameter count: H*L outside the layer, the embeddings and the head after it
    (3 * F * H * L + 2 * G * H**2 * L / h + 2 * H**2 * L + 2 * H * L + 2 * H * V + H,
     "H*L*(2 + 2*H + 2*H*G/h + 3*F) + H*(1 + 2*V)",
     r"H L {\left(2 + 2 H + \frac{2 H G}{h} + 3 F\right)} + H {\left(1 + 2 V\right)}"),
    # one term: as it is, sizes in order
    (4 * B * S * H, "4*B*S*H", "4 B S H"),
    (192 * H**2 * L, "192*H**2*L", "192 L H^{2}"),
    # a number alone is not pulled out of a sum (it would read 256*(333232*B + 830))
    (85307392 * B + 212480, "212480 + 85307392*B", "212480 + 85307392 B"),
    # a size below the line in every term goes outside, below the line
    (8 * H * S / h + 8 * G * S / h, "8*S/h*(H + G)", r"\frac{8 S}{h} {\left(H + G\right)}"),
    # a negative term; a fraction of a byte count
    (4 * B * S * H - 4 * B * S, "4*B*S*(-1 + H)", r"4 B S {\left(- 1 + H\right)}"),
    (B * S * H / 2 + B * S, "B*S/2*(2 + H)", r"\frac{B S}{2} {\left(2 + H\right)}"),
    # a power inside and outside
    (3 * B * L * H**2 * S**2 + 6 * B * L * H * S, "3*B*S*H*L*(2 + S*H)", r"3 B S H L {\left(2 + S H\right)}"),
    # not a monomial (the causal-LM loss's branch): kept as it is, after the blocks
    (sympy.Piecewise((4 * B * V, sympy.Eq(B, 1)), (8 * B * V, True)) + 4 * B * S * H * L + 8 * B * S * L,
     "4*B*S*L*(2 + H) + Piecewise((4*B*V, Eq(B, 1)), (8*B*V, True))", None),
    (16 * Psi, "16*Psi", r"16 \Psi"),
    (sympy.Integer(0), "0", "0"),
]


@pytest.mark.parametrize(("expr", "text", "latex"), CASES, ids=[c[1][:40] for c in CASES])
def test_field_form_equals_the_formula_and_reads_as_the_field_writes(expr: sympy.Expr, text: str,
                                                                      latex: str | None) -> None:
    form = field(expr)
    assert sympy.simplify(form.expr() - expr) == 0
    assert form.text() == text
    assert sympy.simplify(sympy.parse_expr(text, local_dict={d.name: d.symbol for d in dims()}) - expr) == 0
    if latex is not None:
        assert form.latex() == latex
    assert sympy.simplify(parse(form.latex()) - expr) == 0


def test_without_a_layer_count_the_layer_is_not_put_first() -> None:
    form = field(4 * B * F * L + 4 * B * H * L + 4 * B * S, layers=None)
    assert form.text() == "4*B*(S + H*L + F*L)"
    assert sympy.expand(form.expr() - (4 * B * F * L + 4 * B * H * L + 4 * B * S)) == 0
