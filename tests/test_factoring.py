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


#: cases whose lines of symmem and of this file the others run, under ``-m deep`` only (line coverage, stop 42:
#: docs/testing.md, "Stop 42: thinviews42"); Korthikanti's two forms stay in the default suite for their figures,
#: 192*H**2*L as the one LaTeX with a power that the reader reads back
DEEP_TEXTS = {"4*B*L*(H + F)", "H*L*(2 + 2*H + 2*H*G/h + 3*F) + H*(1 + 2*V)", "4*B*S*H", "3*B*S*H*L*(2 + S*H)"}


@pytest.mark.parametrize(("expr", "text", "latex"), [
    pytest.param(*c, id=c[1][:40], marks=pytest.mark.deep if c[1] in DEEP_TEXTS else ()) for c in CASES])
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


# -- the views of a formula in a module's own sizes ---------------------------------------------------------------
torch = pytest.importorskip("torch")


class _Block(torch.nn.Module):
    """A pre-norm MLP block with a residual: keeps the norm's input and statistics, the two Linears' inputs and
    GELU's input."""

    def __init__(self, H: int, F: int) -> None:
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(H), torch.nn.Linear(H, F), torch.nn.Linear(F, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _build(H: int, F: int, L: int, B: int = 2, S: int = 4) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(H, H), *[_Block(H, F) for _ in range(L)]), (torch.randn(B, S, H),)


@pytest.fixture(scope="module")
def sized() -> object:
    from symmem import trace

    return trace(_build, dims={"B": [(0, 0)], "S": [(0, 1)]}, sizes={"H": 768, "F": 3072, "L": 12}, optimizer="sgd")


def _read(text: str) -> sympy.Expr:
    return sympy.parse_expr(text, local_dict={d.name: d.symbol for d in dims()})


def test_the_views_print_the_field_form_that_real_pytorch_keeps(sized: object) -> None:
    """The table's, the JSON's and the HTML's activations read back and evaluated at sizes never traced are a real
    forward's saved bytes; each is written the field's way, the layer first, and says what its symbols stand for."""
    from symmem.record.verify import measure

    d = sized
    text = field(d.activations).text()
    # by hand, a layer: the norm's input (B S H), mean and rstd (B S each), up's input (B S H), GELU's and down's
    # inputs (B S F each), FP32; the first Linear's input is the model's input
    assert text == "8*B*S*L*(1 + H + F)"
    table, got, html = d.table(), d.to_dict(), d._repr_html_()
    assert f"= {text}" in table.replace("\n" + " " * 68, " ")
    assert got["factored"]["activations"] == text
    assert got["latex"]["activations"] == r"8 B S L {\left(1 + H + F\right)}"
    assert sympy.expand(parse(got["latex"]["total"]) - d.total) == 0
    assert text in html
    legend = ["B: batch size (micro-batch per device)", "S: sequence length in tokens (ViT: patches + class token)",
              "H: hidden size", "F: MLP (feed-forward) width", "L: number of repeated layers"]
    assert got["legend"] == legend
    assert "where " + "; ".join(legend[:2]) in table.replace("\n", " ")
    assert "where " + "; ".join(legend) in html
    rich = d._repr_latex_()  # Jupyter's LaTeX: the kept memory the field's way, a row per symbol
    assert r"M_{\text{kept}} &= {8 B S L} \cdot \left(1 + H + F\right)" in rich and r"H &: \text{hidden size}" in rich
    module, (x,) = _build(H=40, F=56, L=3, B=3, S=5)
    real = measure(module, x)
    assert _read(text).subs({B: 3, S: 5, H: 40, F: 56, L: 3}) == real.activations
    assert _read(got["factored"]["total"]).subs({B: 3, S: 5, H: 40, F: 56, L: 3}) == (
        real.activations + real.input + 8 * sum(p.numel() for p in module.parameters()))  # SGD: weights, grads


def test_the_latex_reads_back_and_compiles_within_the_page(sized: object, tmp_path: object) -> None:
    import re
    import shutil

    from symmem.report.latex import align, read

    d = sized
    for form in ("compact", "terms"):
        tex = align(d, form=form)
        got = dict(read(tex))
        assert sympy.expand(got[r"\text{activations}"] - d.activations) == 0
        assert sympy.expand(got[r"\text{kept after forward + parameters}"] - d.total) == 0
        assert r"{8 B S L} \cdot \left(1 + H + F\right)" in tex
        assert r"$H$ (hidden size); $F$ (MLP (feed-forward) width)" in tex
    if shutil.which("pdflatex") is None:
        pytest.skip("pdflatex is not installed")
    body = "\n".join(align(d, form=form) for form in ("compact", "terms"))
    from tests.latex_helpers import pdflatex

    code, log = pdflatex(tmp_path, [body])
    assert code == 0 and "Overfull" not in log, re.findall(r"Overfull.*", log)
