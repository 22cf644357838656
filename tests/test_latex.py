"""LaTeX export: every expression symmem prints parses back (sympy's lark parser) to an equal expression, and
``align`` output compiles in a plain ``article`` with no overfull line and blocks that fit a page.

The round trip runs over a fixed sample of derivations that covers every model family, every convention, both
attention kernels and GELU forms, whole models and single layers, the branch (``Piecewise``) cases of Llama
and the causal-LM loss, ZeRO, tensor and pipeline parallelism, and every symbol kept free (the floors of
strided shapes and of the ViT token count).  Parsing LaTeX costs about 0.7 ms a character, so the sample is
kept to what exercises distinct printed forms; ``test_sample_covers`` checks its coverage against the
registries, so a new family or convention cannot slip past it.
"""

from __future__ import annotations

import random
import re
import shutil

import pytest
import sympy

import symmem
from symmem.conventions import names as convention_names
from symmem.errors import SymmemError
from symmem.models import available
from symmem.report.latex import MAX_LINES, align, equations, expression, labels, lines, parse, read, rows, split, table
from symmem.simplify import rounded
from symmem.symbols import B, G, H, Hi, L, N, Nact, Psi, S, V, Wi, h


def _parse(text: str) -> sympy.Expr:
    """``parse`` (which caches by text: the sample's derivations share many formulas)."""
    return parse(text)


def _equal(a: sympy.Expr, b: sympy.Expr) -> bool:
    """``a`` and ``b`` are the same expression: equal, or their difference expands to 0 in every branch."""
    if a == b:
        return True
    diff = sympy.piecewise_fold(a - b)
    if isinstance(diff, sympy.Piecewise):
        if all(sympy.expand(e) == 0 for e, _ in diff.args):
            return True
        return sympy.simplify(diff) == 0
    return sympy.expand(diff) == 0


def _family(name: str) -> str:
    return "gpt-megatron" if name == "gpt-megatron" else re.match(r"[a-z]+", name).group()


# (model, builder options, derive options, convention, one layer): every model family under the paper and
# pytorch conventions between them, the megatron and cs231n conventions, both attention kernels and GELU
# forms, the branch (Piecewise) cases of the causal-LM loss (in B) and of Llama's key/value heads (in G), and
# the regimes that change the printed forms (ZeRO's /N, tensor-parallel /t, pipeline L/p).
SAMPLE = [
    ("resnet50-v1", {}, {}, "paper", False),
    ("vgg16", {}, {}, "cs231n", False),
    ("mlp", {}, {}, "pytorch", False),
    ("vit-b16", {"attention": "naive"}, {}, "paper", False),
    ("vit-ti16", {"attention": "sdpa"}, {}, "pytorch", True),
    ("gpt2", {"attention": "naive", "gelu": "new"}, {"loss": "cross-entropy"}, "pytorch", False),
    ("gpt2", {"attention": "sdpa", "gelu": "fused"}, {}, "pytorch", True),
    ("bert-base", {"attention": "naive"}, {}, "pytorch", True),
    ("bert-large", {"attention": "sdpa"}, {}, "paper", True),
    ("llama", {"attention": "sdpa"}, {}, "pytorch", True),
    ("llama", {"attention": "naive"}, {}, "paper", True),
    ("gpt-megatron", {}, {"tensor_parallel": True, "sequence_parallel": True}, "megatron", True),
    ("counts", {}, {"zero": 2}, "paper", False),
    ("vit-b16", {"attention": "naive"}, {"zero": 3}, "paper", False),
    ("vit-b16", {"attention": "naive"}, {"pipeline_parallel": True}, "paper", False),
]
# Every symbol free: floors of strided shapes (ResNet, VGG) and of the ViT token count.
ALL_FREE = [("vgg11", "paper"), ("vit-ti16", "paper")]


def _check(d: symmem.Derivation, form: str = "compact") -> None:
    """Every equation ``align`` prints parses back, alone and re-read from the whole block."""
    table_ = rows(d, form)
    got = read(align(d, form=form))
    assert [label for label, _ in got] == [r.label for r in table_]
    for r, (_, e) in zip(table_, got, strict=True):
        assert _equal(_parse(r.tex), r.expr), r.tex            # each right-hand side, as printed
        assert _equal(e, r.expr.xreplace({Psi: d.parameters}) if r.label != r"\Psi" else r.expr), r.label


@pytest.mark.filterwarnings("ignore::symmem.errors.NothingCounted")  # sweeps meet conventions that see nothing
@pytest.mark.parametrize("name, build, options, conv, layer", SAMPLE,
                         ids=[f"{n}-{c}-{'-'.join(map(str, {**b, **o}.values()))}{'-layer' if y else ''}"
                              for n, b, o, c, y in SAMPLE])
def test_round_trip(name, build, options, conv, layer):
    _check(symmem.derive(name, convention=conv, per_layer=layer, **build, **options))


@pytest.mark.parametrize("name, options", [("vit-b16", {"attention": "naive"}),
                                           ("llama", {"convention": "pytorch", "per_layer": True})])
def test_round_trip_terms_and_json(name, options):
    """The per-term form and the JSON's (unsimplified) LaTeX, without and with branches (Llama's in G)."""
    d = symmem.derive(name, **options)
    _check(d, "terms")
    out = d.to_dict()
    for key, text in out["latex"].items():
        assert _equal(_parse(text), d.expression(key)), key
    for row, t in zip(out["breakdown"], d.terms, strict=True):
        assert _equal(_parse(row["latex"]), t.expr), t.name


@pytest.mark.parametrize("name, conv", ALL_FREE)
def test_round_trip_all_symbols_free(name, conv):
    model = symmem.build(name)
    d = symmem.derive(model, convention=conv, free=tuple(s.name for s in model.symbols))
    assert _equal(_parse(expression(d.total)), d.total)           # the JSON's form: nested floors
    total = rows(d)[-1]                                           # align's: merged (numerically equal)
    assert total.label == r"\text{kept after forward + parameters}" and _equal(_parse(total.tex), total.expr)
    assert _equal(total.expr.xreplace({Psi: d.parameters}), rounded(d.total))


def test_sample_covers():
    """The sample covers every model family, every convention, both forms of each attention/GELU option a
    family has, whole models and single layers, and both branch cases."""
    assert {_family(n) for n in available()} <= {_family(n) for n, *_ in SAMPLE}
    # (the traced convention derives traced modules only: tests/test_trace_derivation.py prints one)
    assert set(convention_names()) - {"traced"} <= {c for _, _, _, c, _ in SAMPLE}
    for name, entry in available().items():
        for key, option in entry.options.items():
            if option.choices and key in ("attention", "gelu"):
                seen = {b.get(key) for n, b, _, _, _ in SAMPLE if _family(n) == _family(name)}
                assert set(option.choices) <= seen, (name, key)
    assert {y for *_, y in SAMPLE} == {False, True}
    assert any(o.get("loss") for _, _, o, _, _ in SAMPLE)
    assert ("llama", "pytorch") in {(n, c) for n, _, _, c, _ in SAMPLE}


@pytest.mark.parametrize("expr", [
    9 * B * S * H + B * h * S**2,
    sympy.Mul(B, S, H, 9 + S * h / H, evaluate=False),       # the factored form, in braces
    B * sympy.floor(Hi / 16) * sympy.floor(Wi / 16),         # the ViT token count: two floors side by side
    sympy.Rational(3, 2) * B * Hi * Wi,
    4 * (sympy.floor(Hi / 2 - sympy.Rational(1, 2)) + 1) ** 2 * B,
    4 * B * V * (S - 1) + 192 * H**2 * L,                    # a parenthesis after symbols; a power last
    B * L * H**2 * S**2,                                     # two powers: \cdot between them, in braces
    B * sympy.ceiling(Hi / 4) ** 2 * sympy.ceiling(Wi / 4),  # a power of a ceiling next to a ceiling
    16 * Psi / N + 4 * Psi,                                  # ZeRO's parameter side
    B * Nact + 2 * Psi,
    sympy.floor(3 * Hi / 2) * B,                             # a floor that does not print inline
    -4 * B * H + 3 * L * S**2,
    sympy.Piecewise((8 * B * S, sympy.Eq(B, 1)), (4 * B * S * (S - 1), True)),
    sympy.Piecewise((L, sympy.Eq(G, 1) | sympy.Eq(h / G, 1)), (0, True)) * B * H * S,
])
def test_round_trip_forms(expr):
    assert _equal(parse(expression(expr)), expr), expression(expr)


def test_products_juxtaposed():
    assert expression(9 * B * S * H) == "9 B H S"
    assert expression(192 * H**2 * L) == "192 L H^{2}"           # the power last: the parser reads that
    assert expression(B * h * S**2) == "B h S^{2}"
    assert expression(4 * B * V * (S - 1)) == r"4 B V {\left(S - 1\right)}"
    assert expression(B * L * H**2 * S**2) == r"B L {H^{2} \cdot S^{2}}"
    assert expression(16 * Psi / N) == r"\frac{16 \Psi}{N}"
    assert expression(Nact * B) == r"B N_{\mathrm{act}}"
    floors = sympy.ceiling(Hi / 4) * sympy.ceiling(Wi / 4) * B
    assert expression(floors) == r"B \lceil H_{i}/4 \rceil \lceil W_{i}/4 \rceil"


def test_symbol_names_map_back():
    assert parse("H_{i} \\cdot W_{i}") == Hi * Wi
    assert parse("H_{i} W_{i}") == Hi * Wi
    assert parse(r"\frac{16 \Psi}{N}") == 16 * Psi / N
    assert parse(r"N_{\mathrm{act}} B") == Nact * B


def test_ambiguous_text_is_refused():
    """``B \\left(`` also reads as ``B \\le ft(``: the printer never writes it, and parse refuses it."""
    with pytest.raises(SymmemError, match="more than one way"):
        parse(r"B \left(S - 1\right)")


@pytest.mark.parametrize("text", [r"\frac{", "B +", "", r"\foo{B}", r"B \cdot \cdot"])
def test_unreadable_text_is_a_symmem_error(text):
    with pytest.raises(SymmemError, match="cannot read") as info:
        parse(text)
    assert "\n" not in str(info.value)


def test_nested_floors_merge():
    assert rounded(sympy.floor(sympy.floor(Hi / 2) / 2)) == sympy.floor(Hi / 4)
    assert rounded(sympy.floor(sympy.floor(Hi / 2 - sympy.Rational(1, 2)) / 2) + 1) == sympy.ceiling(Hi / 4)
    assert rounded(sympy.ceiling(sympy.ceiling(Hi / 2) / 2)) == sympy.ceiling(Hi / 4)


@pytest.mark.parametrize("name", ["resnet50-v1", "resnet18", "vgg11_bn", "vit-ti16"])
def test_rounded_keeps_the_values(name):
    """ResNet's image-size formulas with ``free=(B, Hi, Wi)``: ``ceil(Hi/32)`` in place of five nested floors,
    equal at every image size tried."""
    d = symmem.derive(name, convention="pytorch", free=("B", "Hi", "Wi"))
    before, after = d.total, rounded(d.total)
    assert sympy.count_ops(after) < sympy.count_ops(before) or before == after
    if name.startswith("resnet"):
        assert not any(isinstance(f.args[0].func, sympy.floor) for f in after.atoms(sympy.floor, sympy.ceiling))
    f, g = (sympy.lambdify((B, Hi, Wi), e, "math") for e in (before, after))
    rng = random.Random(0)
    for hi, wi in [(224, 224), (1, 1), (33, 65)] + [(rng.randint(1, 1024), rng.randint(1, 1024)) for _ in range(300)]:
        assert f(3, hi, wi) == g(3, hi, wi), (hi, wi)


def test_compact_vit():
    """The seed's ViT-B/16: the layer once, times L (9BSH + BhS^2 elements, in bytes), Psi and its multiple."""
    d = symmem.derive("vit-b16", convention="paper", attention="naive")
    text = align(d)
    assert r"\text{layer} &= L \cdot \left(36 B H S + 4 B h S^{2}\right)" in text
    assert r"\Psi &= 12 L H^{2} + 13 H L + H S + 1772 H + 1000" in text
    assert r"\text{parameter memory} &= 16 \Psi" in text
    assert (r"\text{kept after forward + parameters} &= B H L S {\left(36 + \frac{4}{L} + \frac{4 S h}{H}\right)}"
            r" + 16 \Psi") in text
    assert r"\cdot" not in text.replace(r"L \cdot \left(", "")
    got = dict(read(text))
    assert _equal(got[r"\text{kept after forward + parameters}"], d.total) and got[r"\Psi"] == d.parameters
    assert sympy.expand(got[r"\text{layer}"] / L / 4) == 9 * B * S * H + B * h * S**2


@pytest.mark.parametrize("zero, side", [(1, r"8 \Psi + \frac{8 \Psi}{N}"), (2, r"4 \Psi + \frac{12 \Psi}{N}"),
                                        (3, r"\frac{16 \Psi}{N}")])
def test_zero_in_psi(zero, side):
    d = symmem.derive("vit-b16", convention="paper", attention="naive", zero=zero)
    text = align(d)
    assert rf"\text{{parameter memory}} &= {side}" in text
    assert _equal(parse(side).xreplace({Psi: d.parameters}), d.parameter_memory)


def test_terms_form_one_labelled_line_per_term():
    d = symmem.derive("vit-b16", convention="paper", attention="naive")
    text = align(d, form="terms")
    got = read(text)
    # every term, Psi, then activations (factored), parameter memory and total
    assert len(got) == len(d.terms) + 1 + 3
    short = labels(d)
    body = [ln for ln in text.splitlines() if "&=" in ln]
    for t, line, (label, e) in zip([t for t in d.terms if t.category != "parameter"], body, got, strict=False):
        assert label == rf"\text{{{short[t.name].replace('_', chr(92) + '_')}}}"
        assert line.endswith(f"% {t.name}" + (f" [{t.role}]" if t.role else ""))  # the full name, in a comment
        assert _equal(e, t.expr)
    assert short["blocks.softmax"] == "softmax" and len(set(short.values())) == len(short)
    # lines() keeps the quantities by full name, activations factored
    names = [n for n, _ in lines(d)]
    assert names[:len(d.terms)] == [t.name for t in d.terms] and names[-3:] == ["activations", "parameter memory",
                                                                                "total"]
    assert sympy.expand(lines(d)[-3][1] - d.activations) == 0


def test_long_blocks_split():
    d = symmem.derive("resnet50", convention="pytorch")
    text = align(d, form="terms")
    blocks = re.findall(r"\\begin\{align\*\}\n(.*?)\n\\end\{align\*\}", text, re.S)
    assert len(blocks) >= 3
    assert all(len(b.splitlines()) <= MAX_LINES for b in blocks)
    assert r"\intertext{stage 1 (continued)}" in text or "(continued)" in text
    assert len(equations(text)) == len(d.terms) + 1 + 4  # input is a total here too


# -- compiled ----------------------------------------------------------------------------------------------
HAVE_PDFLATEX = shutil.which("pdflatex")
# The representative derivations of the issue, under the paper and pytorch conventions.
COMPILED = [
    ("resnet50", "paper", {}), ("resnet50", "pytorch", {}),
    ("vit-b16", "paper", {"attention": "naive"}), ("vit-b16", "pytorch", {"attention": "naive"}),
    ("gpt2", "paper", {}), ("gpt2", "pytorch", {"loss": "cross-entropy"}),
    ("bert-base", "paper", {}), ("bert-base", "pytorch", {}),
    ("llama", "paper", {}), ("llama", "pytorch", {}),
    ("vgg16", "cs231n", {}), ("vgg16", "pytorch", {}),
    ("mlp", "paper", {}), ("mlp", "pytorch", {}),
    ("vit-b16", "paper", {"attention": "naive", "zero": 3}),
    ("gpt-megatron", "megatron", {"tensor_parallel": True, "sequence_parallel": True}),
    ("resnet50", "paper", {"free": ("B", "Hi", "Wi")}),
    ("counts", "paper", {"zero": 2}),
]


@pytest.mark.filterwarnings("ignore::symmem.errors.NothingCounted")  # sweeps meet conventions that see nothing
@pytest.mark.skipif(not HAVE_PDFLATEX, reason="pdflatex is not installed: the LaTeX cannot be compiled here")
def test_align_compiles_without_overfull_lines(tmp_path):
    """Every block of every case, both forms, in one ``article``: no overfull box, and each block (measured in
    a box) is at most MAX_LINES lines and no taller than the text height."""
    parts, where = [], []
    for name, conv, options in COMPILED:
        d = symmem.derive(name, convention=conv, **options)
        for form in ("compact", "terms"):
            text = align(d, form=form)
            for block in re.findall(r"\\begin\{align\*\}.*?\\end\{align\*\}", text, re.S):
                assert len(block.splitlines()) - 2 <= MAX_LINES, (name, conv, form)
                k = len(where)
                where.append((name, conv, form))
                parts.append(rf"\setbox0\vbox{{\hsize\textwidth\noindent {block}}}"
                             rf"\typeout{{BLOCK{k}=\the\dimexpr\ht0+\dp0\relax}}\unvbox0\clearpage")
    from tests.latex_helpers import pdflatex

    code, log = pdflatex(tmp_path, [r"\typeout{TEXTHEIGHT=\the\textheight}", *parts])
    assert code == 0, log[-3000:]
    assert "Overfull" not in log, re.findall(r"Overfull.*", log)
    page = float(re.search(r"TEXTHEIGHT=([\d.]+)pt", log).group(1))
    for k, case in enumerate(where):
        height = float(re.search(rf"BLOCK{k}=([\d.]+)pt", log).group(1))
        assert height <= page, (case, height, page)


def test_table1_booktabs():
    """The seed's Table 1, recomputed: its rounded figures (GiB, 3 decimals) appear in the rows."""
    rows_ = [("ResNet-50", symmem.derive("resnet50-v1", convention="paper")),
             ("ViT-B/16 naive MHA", symmem.derive("vit-b16", convention="paper", attention="naive")),
             ("ViT-B/16 SDPA/Flash", symmem.derive("vit-b16", convention="paper", attention="sdpa"))]
    text = table(rows_)
    assert "\\toprule" in text and "\\midrule" in text and "\\bottomrule" in text
    body = [ln for ln in text.splitlines() if ln.strip().endswith("\\\\") and "Model" not in ln]
    seed = {"ResNet-50": ("2.596", "0.048", "0.381", "3.025"),   # seed: 3.03 from 25.6 M parameters
            "ViT-B/16 naive MHA": ("5.264", "0.000", "1.290", "6.554"),
            "ViT-B/16 SDPA/Flash": ("3.932", "0.000", "1.290", "5.222")}
    for line in body:
        cells = [c.strip() for c in line.strip().removesuffix("\\\\").split("&")]
        assert tuple(cells[2:]) == seed[cells[0]], line
    for _, d in rows_:
        s = split(d)
        assert s["activations"] + s["aux"] + s["parameter_memory"] + s.get("other", 0) == s["total"]


def test_cli_latex(capsys):
    from symmem.cli import main

    assert main(["derive", "resnet50-v1", "--convention", "paper", "--format", "latex"]) == 0
    out = capsys.readouterr().out
    d = symmem.derive("resnet50-v1", convention="paper")
    assert out == align(d) + "\n"
    assert "\\begin{align*}" in out and r"\Psi &= 25557032" in out and r"\text{stage 1} &=" in out
    got = dict(read(out))
    assert _equal(got[r"\text{kept after forward + parameters}"], d.total)
    assert _equal(got[r"\text{activations}"], d.activations)


def test_docs_examples_are_current(capsys):
    """docs/jupyter-latex-plots.md shows real output: its `$ symmem derive ...` and `$ symmem fit ...` examples are
    re-run, and its Python block runs on its own (plain Python: `symmem.show` prints the text table)."""
    import shlex
    from pathlib import Path

    from symmem.cli import main

    doc = (Path(__file__).resolve().parents[1] / "docs" / "jupyter-latex-plots.md").read_text()
    examples = re.findall(r"```\n\$ symmem ((?:derive|fit) .*?)\n(.*?)```", doc, re.S)
    assert len(examples) >= 5
    for command, shown in examples:
        assert main(shlex.split(command)) == 0
        assert capsys.readouterr().out == shown, command
    blocks = re.findall(r"```python\n(.*?)```", doc, re.S)
    assert len(blocks) == 1
    exec(compile(blocks[0], "jupyter-latex-plots.md", "exec"), {})  # noqa: S102 - the page's own example
    assert capsys.readouterr().out.startswith("ViT-B/16 (vit-b16) — PyTorch autograd (pytorch convention)")


# -- long texts (issue 22, item 11) and malformed cases (item 12) -------------------------------------------
def _long_sum(n: int) -> tuple[str, sympy.Expr]:
    """``n`` distinct terms of the forms symmem prints (juxtaposed products, powers, a ceiling, a parenthesis in
    braces), every seventh subtracted, as one text, and the expression it means (built by hand, not parsed)."""
    pool = [("B H S", B * H * S), ("B h S^{2}", B * h * S**2), (r"B \lceil H_{i}/4 \rceil", B * sympy.ceiling(Hi / 4)),
            (r"B V {\left(S - 1\right)}", B * V * (S - 1)), (r"L {H^{2} \cdot S^{2}}", L * H**2 * S**2)]
    parts, expected = [], sympy.Integer(0)
    for k in range(n):
        tex, e = pool[k % len(pool)]
        sign = -1 if k % 7 == 3 else 1
        parts.append(f"{'-' if sign < 0 else '+'} {k + 1} {tex}")
        expected += sign * (k + 1) * e
    return " ".join(parts).removeprefix("+ "), expected


def test_a_long_sum_is_read_term_by_term(monkeypatch):
    """The lark parser's time grows faster than the text (a product of 320 symbols: 8 s; 1,000: minutes): a text
    over AT_ONCE characters reaches the reader of a whole text (``_read``: the grammar's reader, else the parser)
    in pieces no longer than AT_ONCE, and means the same."""
    from symmem.report import latex

    seen: list[int] = []
    real = latex._read

    def counting(text):
        seen.append(len(text))
        return real(text)

    monkeypatch.setattr(latex, "_read", counting)
    latex.parse.cache_clear()  # every piece read here, not found from an earlier test (terms repeat across texts)
    # the limit lowered from 400 to 100 characters: the same cuts on a sum a quarter as long (12 terms, not 40:
    # the parser takes about 0.1 CPU-s a term here, whatever the limit)
    monkeypatch.setattr(latex, "AT_ONCE", 100)
    text, expected = _long_sum(12)
    assert len(text) > 2 * latex.AT_ONCE
    assert sympy.expand(parse(text) - expected) == 0
    assert seen and max(seen) <= latex.AT_ONCE
    # a long parenthesised sum after \cdot is read on its own (the L of a repeated layer in align's compact form)
    inner, inner_expected = _long_sum(8)
    assert len(inner) > latex.AT_ONCE
    seen.clear()
    assert sympy.expand(parse(rf"2 + L \cdot \left({inner}\right) - 3 B") - (2 + L * inner_expected - 3 * B)) == 0
    assert seen and max(seen) <= latex.AT_ONCE


def test_texts_too_long_to_read_fast_are_refused():
    from symmem.report import latex

    with pytest.raises(SymmemError, match=r"a term of 1,999 characters .* more than the 200 read at once"):
        parse(" ".join(["B"] * 1000))  # one product of 1,000 symbols: about two minutes whole
    with pytest.raises(SymmemError, match=rf"it has {latex.MAX_TEXT + 1:,} characters, more than {latex.MAX_TEXT:,}"):
        parse("B" * (latex.MAX_TEXT + 1))
    assert parse(" + ".join(["B"] * 1000)) == 1000 * B  # 1,000 symbols in a sum: read term by term


@pytest.mark.parametrize("text, message", [
    (r"\begin{cases}", r"a \\begin\{cases\} without its \\end\{cases\}"),
    (r"\begin{cases} B \end{cases}", "as a row of cases: expected VALUE & CONDITION"),
    (r"\begin{cases} B & S & H \end{cases}", "as a row of cases: expected VALUE & CONDITION"),
])
def test_malformed_cases_are_symmem_errors(text, message):
    with pytest.raises(SymmemError, match=message) as info:
        parse(text)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"width_pt": 0}, "width_pt must be a positive number, not 0"),
    ({"width_pt": float("nan")}, "width_pt must be a positive number, not nan"),
    ({"max_lines": 0}, "max_lines must be a positive integer, not 0"),
    ({"form": "bogus"}, "form must be 'compact' or 'terms', not 'bogus'"),
])
def test_align_options_out_of_range_are_symmem_errors(kwargs, message):
    """Before: a zero width printed anyway, a bad form was a ValueError."""
    with pytest.raises(SymmemError, match=re.escape(message)):
        align(symmem.derive("mlp"), **kwargs)
