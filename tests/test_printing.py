"""symmem.printing.text against sympy's own str(): the same text for every formula a derivation prints (its terms,
the totals, rounded and factored as the views print them), where the sums carry rational coefficients,
Piecewise in B and G, and floors of the image size."""

import warnings

import pytest

import symmem
from symmem.printing import text
from symmem.simplify import factored, rounded


@pytest.mark.parametrize("name, options", [
    ("gpt2", dict(convention="pytorch", loss="cross-entropy")),
    ("llama", dict(convention="pytorch")),
    ("resnet50-v1", dict(free=("B", "Hi", "Wi"))),
])
def test_text_is_str(name, options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = symmem.derive(name, **options)
    formulas = [t.expr for t in d.terms] + [d.expression(k) for k in ("activations", "parameter_memory", "total")]
    shown = [f(e) for e in formulas for f in (lambda e: e, rounded, factored)]
    assert len(shown) > 30
    for e in shown:
        assert text(e) == str(e)
