"""Views that copy for some sizes only (symmem/conditions.py), against what ``torch.reshape`` does."""

from __future__ import annotations

import pytest
import sympy

torch = pytest.importorskip("torch")

from symmem.conditions import canonical, holds, reshape_copies  # noqa: E402
from symmem.symbols import B, G, S, h  # noqa: E402

# shape of the expanded tensor, its stride-0 dimensions, the new shape
CASES = [
    ((2, 3, 4, 5), {2}, (2, 12, 5)),  # repeat_kv with G = 3, h/G = 4
    ((2, 1, 4, 5), {2}, (2, 4, 5)),  # G = 1: multi-query
    ((2, 3, 1, 5), {2}, (2, 3, 5)),  # h/G = 1: G = h
    ((2, 3, 4, 5), {2}, (2, 3, 20)),  # the repeat merged with a later dimension
    ((2, 3, 4, 5), {0}, (6, 4, 5)),
    ((1, 3, 4, 5), {0}, (3, 4, 5)),
    ((2, 3, 4, 5), {1, 2}, (2, 12, 5)),  # two expanded dimensions merged: still stride 0
    ((2, 3, 4, 5), {2}, (2, 3, 4, 5)),  # no merge
]


@pytest.mark.parametrize("shape, broadcast, new", CASES)
def test_reshape_copies_as_torch_does(shape, broadcast, new):
    base = torch.zeros(*[1 if i in broadcast else d for i, d in enumerate(shape)])
    t = base.expand(*shape)
    viewed = t.reshape(*new).untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert bool(reshape_copies(shape, broadcast, new)) is not viewed


def test_symbolic_repeat_kv_condition():
    cond = reshape_copies((B, G, h / G, S), {2}, (B, h, S))
    for g_, h_, copies in ((1, 8, False), (2, 8, True), (8, 8, False), (4, 8, True)):
        assert bool(cond.xreplace({G: g_, h: h_})) is copies
    base, positive = canonical(cond)
    assert not positive and base == sympy.Eq(G, 1) | sympy.Eq(h / G, 1)
    assert holds(cond, {base: False}) and not holds(~cond, {base: False})


def test_piecewise_latex_parses_back():
    """The LaTeX of a Piecewise formula (``\\begin{cases}``) reads back to it, with one or two conditions."""
    from symmem import derive
    from symmem.conditions import fold
    from symmem.report.latex import expression, parse

    layer = derive("llama", convention="pytorch", attention="sdpa", per_layer=True).activations  # G
    loss = derive("llama", convention="pytorch", loss="cross-entropy")  # B
    for e in (layer, loss.loss, loss.input, fold(layer + loss.loss)):
        assert sympy.simplify(parse(expression(e)) - e) == 0


@pytest.mark.parametrize("assumptions", [{}, {"positive": True, "integer": True}, {"nonzero": True}])
def test_ratio_conditions_solved_as_sympy_solves(assumptions):
    """A size condition ``Eq(y/x, 1)`` (Llama's ``Eq(h/G, 1)``) gives its branch the substitution ``sympy.solve``
    gives, worked out without it (``branches._ratio_of``: solve's check of its solution imports
    ``sympy.physics.units``, most of Llama's first ``derive``); any other condition is left to ``sympy.solve``."""
    from symmem.passes.branches import _ratio_of, _substitutions

    a, b, c = sympy.symbols("G h a", **assumptions)
    z = sympy.Symbol("Z")
    shortcuts = 0
    for cond in (sympy.Eq(b / a, 1), sympy.Eq(a / b, 1), sympy.Eq(a / c, 1), sympy.Eq(c / a, 1), sympy.Eq(b / z, 1),
                 sympy.Eq(z / b, 1), sympy.Eq(a * b, 1), sympy.Eq(b / a, 2), sympy.Eq(2 * b / a, 1),
                 sympy.Eq(b / (a * c), 1), sympy.Eq(a / b + 1, 2)):
        x = min(cond.free_symbols, key=lambda s: s.name)
        solved = sympy.solve(cond.lhs - cond.rhs, x)
        long_way = {x: solved[0]} if len(solved) == 1 else {}
        assert _substitutions(cond, True) == long_way, cond
        shortcuts += _ratio_of(cond, x) is not None
    assert shortcuts == 6
