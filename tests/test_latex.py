"""LaTeX export: every expression symmem prints parses back (sympy's lark parser) to an equal expression.

The round trip runs over every built-in model, every convention, every choice of the models' options, whole
models and single layers, with the model's default free symbols and with every symbol kept free (which brings
in the floors of the ViT token count).  A combination a convention cannot derive yet is skipped by name.
"""

from __future__ import annotations

import itertools

import pytest
import sympy

import symmem
from symmem.conventions import names as convention_names
from symmem.models import available
from symmem.report.latex import align, expression, lines, parse, split, table
from symmem.symbols import B, H, Hi, S, Wi, h

_PARSED: dict[str, sympy.Expr] = {}


def _check(text: str, expr: sympy.Expr) -> None:
    """``text`` parses to ``expr``; a text already parsed is not parsed again (the ViT sizes share formulas)."""
    if text not in _PARSED:
        _PARSED[text] = parse(text)
    assert sympy.simplify(_PARSED[text] - expr) == 0, text


def _variants():
    for name, entry in sorted(available().items()):
        choices = {k: o.choices for k, o in entry.options.items() if o.choices}
        keys = sorted(choices)
        for combo in itertools.product(*(choices[k] for k in keys)):
            yield name, dict(zip(keys, combo, strict=True))


def _derivations(name, options, conv):
    out = []
    for per_layer in (False, True):
        try:
            out.append(symmem.derive(name, convention=conv, per_layer=per_layer, **options))
        except symmem.SymmemError as exc:
            if per_layer and "no repeated layer" in str(exc) or "several repeated blocks" in str(exc):
                continue
            if "has no rule" in str(exc):  # a convention still being written (e.g. pytorch on main)
                break
            raise
    return out


# With every symbol free the formulas carry the floors of strided shapes (ResNet, VGG) and of the ViT token
# count; parsing those is slow (seconds each), so one model per family covers these forms.
ALL_FREE = ("resnet18", "resnet50-v1", "vgg11_bn", "vit-ti16", "mlp")


@pytest.mark.parametrize("conv", convention_names())
@pytest.mark.parametrize("name, options", list(_variants()), ids=lambda v: v if isinstance(v, str) else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_round_trip(name, options, conv):
    derivations = _derivations(name, options, conv)
    if not derivations:
        pytest.skip(f"convention {conv!r} cannot derive {name} yet")
    for d in derivations:
        for e in [e for _, e in lines(d)] + [d.parameters]:
            _check(expression(e), e)
        for key, text in d.to_dict()["latex"].items():  # the JSON's LaTeX is the same printer
            _check(text, d.expression(key))


@pytest.mark.parametrize("conv", convention_names())
@pytest.mark.parametrize("name", ALL_FREE)
def test_round_trip_all_symbols_free(name, conv):
    model = symmem.build(name)
    try:
        d = symmem.derive(model, convention=conv, free=tuple(s.name for s in model.symbols))
    except symmem.SymmemError as exc:
        if "has no rule" in str(exc):
            pytest.skip(f"convention {conv!r} cannot derive {name} yet")
        raise
    for e in (d.total, d.parameters):
        _check(expression(e), e)


@pytest.mark.parametrize("expr", [
    9 * B * S * H + B * h * S**2,
    sympy.Mul(B, S, H, 9 + S * h / H, evaluate=False),       # the factored form, with \left( \right)
    B * sympy.floor(Hi / 16) * sympy.floor(Wi / 16),         # the ViT token count
    sympy.Rational(3, 2) * B * Hi * Wi,
    4 * (sympy.floor(Hi / 2 - sympy.Rational(1, 2)) + 1) ** 2 * B,
])
def test_round_trip_forms(expr):
    assert sympy.simplify(parse(expression(expr)) - expr) == 0


def test_symbol_names_map_back():
    assert parse("H_{i} \\cdot W_{i}") == Hi * Wi


def test_align_one_named_line_per_term():
    d = symmem.derive("vit-b16", attention="naive")
    text = align(d)
    body = text.split("\\begin{align*}")[1].split("\\end{align*}")[0].strip().splitlines()
    assert len(body) == len(d.terms) + 3  # activations, parameter memory, total
    for line, (name, expr) in zip(body, lines(d), strict=True):
        label, rhs = line.split("&=")
        assert name.replace("_", "\\_") in label
        assert sympy.simplify(parse(rhs.strip().removesuffix("\\\\").strip()) - expr) == 0
    # The factored activations line: B H L S (36 + 4/L + 4 S h / H), the seed's 9BSH + BhS^2 per layer.
    act = parse(body[-3].split("&=")[1].removesuffix("\\\\"))
    assert sympy.expand(act - d.activations) == 0


def test_table1_booktabs():
    """The seed's Table 1, recomputed: its rounded figures (GiB, 3 decimals) appear in the rows."""
    rows = [("ResNet-50", symmem.derive("resnet50-v1")),
            ("ViT-B/16 naive MHA", symmem.derive("vit-b16", attention="naive")),
            ("ViT-B/16 SDPA/Flash", symmem.derive("vit-b16", attention="sdpa"))]
    text = table(rows)
    assert "\\toprule" in text and "\\midrule" in text and "\\bottomrule" in text
    body = [ln for ln in text.splitlines() if ln.strip().endswith("\\\\") and "Model" not in ln]
    seed = {"ResNet-50": ("2.596", "0.048", "0.381", "3.025"),   # seed: 3.03 from 25.6 M parameters
            "ViT-B/16 naive MHA": ("5.264", "0.000", "1.290", "6.554"),
            "ViT-B/16 SDPA/Flash": ("3.932", "0.000", "1.290", "5.222")}
    for line in body:
        cells = [c.strip() for c in line.strip().removesuffix("\\\\").split("&")]
        assert tuple(cells[2:]) == seed[cells[0]], line
    for _, d in rows:
        s = split(d)
        assert s["activations"] + s["aux"] + s["parameter_memory"] + s.get("other", 0) == s["total"]


def test_cli_latex(capsys):
    from symmem.cli import main

    assert main(["derive", "resnet50-v1", "--format", "latex"]) == 0
    out = capsys.readouterr().out
    assert "\\begin{align*}" in out and "\\text{maxpool.indices}" in out
    total = out.split("\\text{total} &=")[1].split("\\end")[0]
    assert parse(total.strip()) == symmem.derive("resnet50-v1").total
