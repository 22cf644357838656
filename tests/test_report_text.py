"""The text table never cuts a formula: every formula cell, its continuation lines joined, parses back to the
derivation's expression, and no line is wider than the table's width."""

from __future__ import annotations

import functools
import re
import warnings

import pytest
import sympy
from sympy.parsing.sympy_parser import parse_expr, standard_transformations

import symmem
from symmem.errors import NothingCounted
from symmem.report.headline import LABELS, SHORT_LABELS
from symmem.report.text import table, wrap
from symmem.simplify import factored, rounded
from symmem.symbols import dims

# What a formula may name: symmem's symbols and the few functions sympy writes in a formula, nothing else
# (the text is checked against this list before sympy's parser sees it).
NAMES = {d.name: d.symbol for d in dims()} | {
    "Piecewise": sympy.Piecewise, "Eq": sympy.Eq, "Ne": sympy.Ne, "And": sympy.And, "Or": sympy.Or,
    "Not": sympy.Not, "floor": sympy.floor, "ceiling": sympy.ceiling, "True": sympy.true, "False": sympy.false}
PARSER = {"Integer": sympy.Integer, "Rational": sympy.Rational, "Float": sympy.Float, "Symbol": sympy.Symbol}


def formula(text: str) -> sympy.Expr:
    unknown = set(re.findall(r"[A-Za-z_]\w*", text)) - set(NAMES)
    assert not unknown, f"{text!r} names {unknown}"
    return parse_expr(text, local_dict=dict(NAMES), global_dict={"__builtins__": {}, **PARSER},
                      transformations=standard_transformations)


@functools.lru_cache(maxsize=1024)  # the three widths print the same cells: each pair is simplified once
def same(a: sympy.Expr, b: sympy.Expr) -> bool:
    return a == b or sympy.simplify(a - b) == 0


def read(text: str) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """The table parsed back: (label, formula, MiB) per row, continuation lines joined; (key, formula) per total."""
    lines = text.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("group / term"))
    start = lines[header].index("formula (bytes)")
    mib = len(lines[header]) - 12
    rule = [i for i, ln in enumerate(lines) if ln and set(ln) == {"-"}]
    assert rule[0] == header + 1 and len(rule) == 2
    rows: list[list[str]] = []
    pending = ""
    for ln in lines[rule[0] + 1:rule[1]]:
        if len(ln) <= mib and ln[:start].strip() == "" and rows and not pending:  # a continuation line
            rows[-1][1] += " " + ln.strip()
        elif len(ln) < len(lines[header]) or not re.search(r"\d\.\d\d$|\?$", ln):  # a long name, alone
            pending += ln
        else:
            label = (pending or ln[:start]).strip()
            rows.append([label, ln[start:mib].strip(), ln[mib:].strip()])
            pending = ""
    totals: list[list[str]] = []
    for ln in lines[rule[1] + 1:]:
        if not ln:  # the peak of a training step follows (symmem derive's summary)
            break
        if ln.startswith(" "):
            totals[-1][1] += " " + ln.strip()
        else:
            key, _, rest = ln.partition("   = ")
            key = next((k for names in (LABELS, SHORT_LABELS) for k, shown in names.items() if key.startswith(shown)),
                       key.split()[0])
            totals.append([key, rest.strip()])
    return [tuple(r) for r in rows], [tuple(t) for t in totals]


def expected(d: symmem.Derivation, fold: bool) -> list[tuple[str, sympy.Expr]]:
    out = []
    for group, expr in d.groups().items():
        out.append((group, expr))
        if not fold:
            out += [(t.name, t.expr) for t in d.terms
                    if t.group == group and t.category != "parameter" and group != "input"]
    return out


CASES = [
    ("vit-b16", dict(attention="naive")),
    ("gpt2", dict(convention="pytorch", loss="cross-entropy")),  # ~40 rows, Piecewise in B
    ("bert-base", dict(convention="pytorch")),                   # names longer than the name column
    ("llama", dict(convention="pytorch")),                       # Piecewise in G
    ("resnet50-v1", dict(free=("B", "Hi", "Wi"))),               # floors of the image size
    ("vit-b16", dict(zero=3, tensor_parallel=True)),
    ("counts", dict(zero=2)),
]


#: (case, fold, width) the default suite keeps: together they run every line of symmem and of this file that the 42
#: layouts run (line coverage, stop 42: docs/testing.md, "Stop 42: thinviews42"); the others run under ``-m deep``
LAYOUTS_KEPT = {("counts-2", False, 100), ("bert-base-pytorch", False, 100), ("vit-b16-naive", False, 100),
                ("gpt2-pytorch-cross-entropy", False, 100), ("llama-pytorch", False, 100),
                ("resnet50-v1-('B', 'Hi', 'Wi')", False, 100), ("vit-b16-3-True", False, 100),
                ("vit-b16-3-True", True, 60)}


def _layouts() -> list:
    out = []
    for case in CASES:
        name = f"{case[0]}-{'-'.join(map(str, case[1].values()))}"
        for fold in (False, True):
            for width in (100, 60, 140):
                deep = () if (name, fold, width) in LAYOUTS_KEPT else pytest.mark.deep
                out.append(pytest.param(case, fold, width, id=f"{name}-{fold}-{width}", marks=deep))
    return out


@pytest.fixture(scope="module")
def derivation(request):
    name, options = request.param
    with warnings.catch_warnings():  # the layout is under test, whatever the convention sees
        warnings.simplefilter("ignore", NothingCounted)
        return symmem.derive(name, **options)


@pytest.mark.parametrize("derivation, fold, width", _layouts(), indirect=["derivation"])
def test_every_formula_parses_back_and_fits(derivation, width, fold):
    d = derivation
    text = table(d, width=width, fold=fold)
    assert max(len(ln) for ln in text.splitlines()) <= width, text
    rows, totals = read(text)
    want = expected(d, fold)
    assert len(rows) == len(want)                                     # rows in the derivation's order
    for (label, cell, mib), (name, expr) in zip(rows, want, strict=True):
        assert name in label, (label, name)
        assert same(formula(cell), rounded(expr)), (label, cell)
        value = d.evaluate(expr) if not (expr.free_symbols - set(d.numbers)) else None
        assert mib == ("?" if value is None else f"{value / 2**20:.2f}")
    keys = ["activations", "parameter_memory", "total"] + [k for k in ("input", "loss", "transient")
                                                          if d.expression(k) != 0]
    assert [k for k, _ in totals] == [*keys, "parameters"]
    for key, cell in totals:
        e = d.expression(key)
        e = rounded(e)  # floors merged where they nest; tests/test_latex.py checks that this keeps the values
        assert same(formula(cell), factored(e) if key == "activations" else e), (key, cell)


def test_readme_case_is_no_longer_cut():
    """The README's ViT-B/16 table cut the parameter formula after ``16*H*S + 28``; now it is whole."""
    d = symmem.derive("vit-b16", convention="paper", attention="naive")
    text = table(d, width=100)
    assert "192*H**2*L + 208*H*L + 16*H*S + 28352*H + 16000" in text
    assert table(d) == text  # not a terminal: 100 columns


def test_width_follows_the_terminal(monkeypatch):
    """On a terminal the table takes its width; elsewhere (a pipe, a file, pytest's capture) 100 columns."""
    import io
    import os
    import shutil
    import sys

    from symmem.report.text import terminal_width

    class Tty(io.StringIO):
        def isatty(self):
            return True

    assert terminal_width() == 100
    monkeypatch.setattr(sys, "stdout", Tty())
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(100, 24): os.terminal_size((72, 24)))
    d = symmem.derive("vit-b16", convention="paper", attention="naive")
    assert terminal_width() == 72 and max(len(ln) for ln in table(d).splitlines()) <= 72


def test_fold_is_one_row_per_group():
    d = symmem.derive("gpt2", convention="pytorch", loss="cross-entropy")
    rows, _ = read(table(d, fold=True))
    assert [r[0] for r in rows] == list(d.groups())
    assert len(read(table(d))[0]) > 3 * len(rows)


def test_cut_marks_what_it_cuts():
    d = symmem.derive("gpt2", convention="pytorch", loss="cross-entropy")
    text = table(d, width=80, cut=True)
    assert max(len(ln) for ln in text.splitlines()) <= 80
    assert "\u2026" in text
    assert "\u2026" not in table(d, width=80)


def test_wrap_joins_back():
    text = str(symmem.derive("gpt2", convention="pytorch", loss="cross-entropy").total)
    for width in (20, 37, 64):
        pieces = wrap(text, width)
        assert all(len(p) <= width for p in pieces)
        assert formula(" ".join(pieces)) == formula(text)


@pytest.mark.parametrize("argv, check", [
    (["--fold", "--width", "80"], lambda d, out: [r[0] for r in read(out)[0]] == list(d.groups())
     and max(map(len, out.splitlines())) <= 80),
    (["--cut", "--width", "60"], lambda d, out: "\u2026" in out and max(map(len, out.splitlines())) <= 60),
    (["--width", "64"], lambda d, out: max(map(len, out.splitlines())) <= 64 and all(
        same(formula(r[1]), e) for r, (_, e) in zip(read(out)[0], expected(d, False), strict=True))),
])
def test_cli_layout_options(capsys, argv, check):
    """``symmem derive`` exposes the table's width, folding and cutting."""
    from symmem.cli import main

    assert main(["derive", "gpt2", "--convention", "pytorch", "--loss", "cross-entropy", *argv]) == 0
    d = symmem.derive("gpt2", convention="pytorch", loss="cross-entropy")
    assert check(d, capsys.readouterr().out)


@pytest.mark.parametrize("form", ["compact", "terms"])
def test_cli_latex_form(capsys, form):
    from symmem.cli import main
    from symmem.report.latex import align

    assert main(["derive", "vit-b16", "--convention", "paper", "--format", "latex", "--latex-form", form]) == 0
    assert capsys.readouterr().out == align(symmem.derive("vit-b16", convention="paper"), form=form) + "\n"


@pytest.mark.parametrize("width", ["10", "wide", "5000"])
def test_cli_width_is_checked(capsys, width):
    from symmem.cli import main

    assert main(["derive", "mlp", "--convention", "paper", "--width", width]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("symmem: error: argument --width")


@pytest.mark.parametrize("model", ["vit-b16", "resnet18", "mlp"])
def test_derive_prints_the_peak_and_where(capsys, model):
    """The default convention models the step: `symmem derive` ends with the peak, where it occurs and the
    formula of that moment, which parses back to the moment's bytes."""
    from symmem.cli import main

    assert main(["derive", model, "--width", "100"]) == 0
    out = capsys.readouterr().out
    d = symmem.derive(model)
    tail = out[out.index("\nkept after forward + parameters = the tensors kept at the end"):].splitlines()
    steady = next(i for i, ln in enumerate(tail) if ln.startswith("peak "))
    mib = f"{d.value('peak') / 2**20:.2f} MiB"
    assert mib in tail[steady] and tail[steady].endswith("at " + d.peak_at().where().removesuffix(", steady step"))
    shown = " ".join(ln.strip() for ln in tail[steady + 1:] if not ln.startswith("peak"))
    shown = shown.removeprefix("= ").split("(the largest")[0].strip()
    assert d.evaluate(formula(shown)) == d.value("peak")
    assert any(ln.startswith("peak (first step)") and f"{d.value('peak_first_step') / 2**20:.2f}" in ln for ln in tail)


@pytest.mark.parametrize("model, convention", [("vit-b16", "pytorch"), ("resnet50-v1", "pytorch"),
                                               ("gpt2", "pytorch"), ("resnet50-v1", "paper"), ("llama", "pytorch")])
def test_rows_follow_the_graph(model, convention):
    """The table lists kept tensors in the order the model runs them (a node's own output before what it saves
    beside it), as the graph's topological order says."""
    from symmem.models import build

    d = symmem.derive(model, convention=convention)
    order = {n: i for i, n in enumerate(build(model).graph.order())}
    rows = [(order[t.node], t.name != t.node) for t in d.terms if t.category != "parameter" and t.node in order]
    assert rows == sorted(rows) and len(rows) > 3
