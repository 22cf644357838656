"""The LaTeX reader without the Earley parser (``symmem.report.latex_grammar``) reads every text it reads as sympy's
lark parser does -- the same expression, ``srepr`` for ``srepr`` -- and leaves every other text to that parser:
an ambiguous one, one that does not parse, one where the grammar's rules it does not follow could apply.

The oracle is ``sympy.parsing.latex.parse_latex(text, backend="lark")`` itself (~0.05-0.3 CPU-s a text): a few
texts of each kind in the default suite, every text of ``TEXTS`` and every text the zoo's LaTeX hands the reader
under ``-m deep``.
"""

from __future__ import annotations

import re
import warnings

import pytest
import sympy

import symmem
from symmem.report import latex, latex_grammar

# texts the reader reads: products, sums, powers, fractions, floors, ceilings, relations, subscripts, Greek
TEXTS = [r"B H L S {\left(\frac{4 F}{H} + 20 + \frac{4}{L}\right)}",
         r"\frac{B H S {\left(66 + \frac{9 S h}{H}\right)}}{t}",
         r"B {\left(\lfloor (H_{i} - 1)/2 \rfloor + 1\right)^{2}}",
         r"B {\lceil H_{i}/4 \rceil^{2} \cdot \lceil W_{i}/4 \rceil}",
         r"\left(p - 1\right) \cdot  X_{a}", r"\frac{h}{G} = 1", r"-B - 3", r"B = -1", r"+B", r"B^{2}^{3}", r"B/2/3",
         r"1 2 B", r"\psi B", r"\varphi", r"S {B}", r"\frac{B}{2}^{2}", r"B - \left(S\right)", r"\left(a\right) b",
         r"(B + C)(B - C)", r"3 (B)", r"X_{ab} Y_{Z}", r"\lceil a \rceil \lceil b \rceil", r"B \cdot C \cdot E",
         r"B \lfloor \lfloor H_{i}/2 \rfloor/2 \rfloor \lfloor \lfloor W_{i}/2 \rfloor/2 \rfloor",
         r"\frac{3 B H_{i} W_{i}}{2}"]
# texts it leaves to the parser: two readings (\cdot after a product; B(S - 1) and B (S - 1); \left read as \le),
# no reading, a token of a rule it does not follow (the differential d, a decimal, a command, a prime)
LEFT = [r"B H \cdot S", r"\frac{a}{b} c \cdot e", r"B S/2", r"B \left(S - 1\right)", r"\left(a\right) \left(b\right)",
        r"2 \cdot 3 B", r"(a)(b)(c)", r"B + -1", r"B^{2} C", r"\lceil a \rceil b", "", r"\frac{", r"B \cdot \cdot",
        r"d x", r"1.5 B", r"\sqrt{B}", r"B'", r"\foo{B}", r"B = C = E", r"\Psi"]


def _shown(e: object) -> str:
    """``srepr`` without lark's token type in symbol names (a ``Token`` is the ``str`` it holds)."""
    return re.sub(r"Token\('[A-Z_]+', ('[^']*')\)", r"\1", sympy.srepr(e))


def _lark(text: str) -> str:
    from sympy.parsing.latex import parse_latex

    try:
        found = parse_latex(text, backend="lark")
    except Exception as exc:  # noqa: BLE001 -- any refusal of the parser
        return f"refused: {type(exc).__name__}"
    return _shown(found) if isinstance(found, sympy.Basic) else "two readings"


# four texts against the lark parser (TEXTS[0] and TEXTS[18], whose lines these run, and every other text: the deep
# test below; line coverage, stop 42)
@pytest.mark.parametrize("text", [TEXTS[2], TEXTS[5], TEXTS[6], TEXTS[13]])
def test_the_reader_reads_as_the_parser(text):
    assert _shown(latex_grammar.read(text)) == _lark(text)


@pytest.mark.parametrize("text", LEFT)
def test_the_reader_leaves_other_texts_to_the_parser(text):
    assert latex_grammar.read(text) is None


@pytest.mark.deep
def test_every_text_as_the_parser_reads_it(monkeypatch):
    """Every text of TEXTS and LEFT, and every text the LaTeX of every model at its defaults (pytorch and paper,
    compact and term by term, their Piecewise branches included) hands the reader."""
    seen: dict[str, object] = {}
    real = latex_grammar.read

    def recording(text: str) -> object:
        seen[text] = found = real(text)
        return found

    monkeypatch.setattr(latex_grammar, "read", recording)
    latex.parse.cache_clear()
    for name in symmem.available_models():
        for convention in ("pytorch", "paper"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # `counts` under pytorch keeps nothing, and says so
                d = symmem.derive(name, convention=convention)
            for form in ("compact", "terms"):
                latex.read(latex.align(d, form=form))
    monkeypatch.undo()
    for text in [*TEXTS, *LEFT]:
        seen[text] = latex_grammar.read(text)
    read = {t: v for t, v in seen.items() if v is not None}
    assert len(read) > 60
    for text, value in read.items():
        assert _shown(value) == _lark(text), text
    for text in LEFT:
        assert seen[text] is None
