"""The compiled evaluator (symmem/evaluator.py) against sympy substitution, the independent truth.

Oracle: ``sympy.sympify(expr.xreplace(numbers))``, rounded as ``Derivation.evaluate`` always rounded (integers
stay, fractions of a byte go up).  Every quantity and every term of every built-in model under every convention
must agree exactly at several configurations, one at a time (``value``, ``at``) and all at once (``values``): under
``-m deep``; the default suite runs the labels whose lines cover every line the whole sweep runs (``EVERY_KEPT`` ...).
"""

from __future__ import annotations

import functools
import itertools
import warnings
from fractions import Fraction

import numpy as np
import pytest
import sympy

from symmem import Derivation, SymmemError, derive
from symmem.conventions import names as convention_names
from symmem.derivation import QUANTITIES
from symmem.evaluator import INT64_MAX, Evaluator, evaluator
from symmem.models import available
from symmem.symbols import B, G, H, L, N, S, h, t
from tests.kept_cases import kept


def truth(expr: sympy.Expr, numbers) -> int:
    value = sympy.sympify(sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in numbers.items()}))
    assert value.is_number, (expr, value)
    return int(value) if value.is_integer else int(sympy.ceiling(value))


# Configurations beyond the defaults, for the symbols a formula keeps (those it does not keep are skipped).
CONFIGS = [{"B": 1}, {"B": 3, "S": 77, "H": 96, "h": 4, "L": 5}, {"B": 2, "G": 1}, {"B": 5, "G": 4, "h": 8},
           {"B": 7, "S": 1, "F": 300, "V": 1000}]
REGIMES = [{}, {"zero": 3, "tensor_parallel": True, "pipeline_parallel": True, "checkpoint": "every-2"},
           {"checkpoint": "selective", "precision": "mixed", "zero": 1}]


def _specs() -> list[tuple[str, str, dict]]:
    """Every (label, model, derive keywords) the tests sweep: each built-in model under each convention at the
    defaults, the two other regimes for the paper convention and four models, and five option sets.  Only names:
    the derivations are made by the tests that use them (:func:`derived`), not at collection, where each xdist
    worker made all 150 of them (~4.5 CPU-s a worker) before its first test."""
    out = []
    for name in sorted(available()):
        for conv in convention_names():
            for i, regime in enumerate(REGIMES):
                if i and conv != "paper" and name not in ("llama", "gpt2", "vit-b16", "resnet50"):
                    continue
                out.append((f"{name}-{conv}-{i}", name, {"convention": conv, **regime}))
    for name, kw in (("llama", {"loss": "cross-entropy", "convention": "pytorch"}),
                     ("gpt2", {"loss": "cross-entropy", "convention": "pytorch", "device": "cpu"}),
                     ("vit-b16", {"free": ("B", "Hi", "Wi", "H", "h", "L")}),
                     ("resnet50", {"free": ("B", "Hi", "Wi"), "convention": "pytorch"}),
                     ("llama", {"free": ("B", "S", "H", "h", "G", "L", "F", "V"), "convention": "pytorch",
                                "attention": "naive", "loss": "cross-entropy"})):
        out.append((f"{name}-{'-'.join(map(str, kw.values()))}", name, kw))
    return out


SPECS = _specs()
KEYWORDS = {label: (name, kw) for label, name, kw in SPECS}


@functools.cache  # one derivation a label and process: the tests below ask for the same ones
def derived(label: str) -> Derivation | SymmemError:
    """The label's derivation, or the one-line refusal it gets (a convention that does not cover the model, a
    regime a model has no layer for: checkpointing without repeated layers, tensor parallelism without attention)."""
    from symmem.errors import NothingCounted

    name, kw = KEYWORDS[label]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NothingCounted)  # the sweep meets conventions that see nothing in a model
        try:
            return derive(name, **kw)
        except SymmemError as exc:
            return exc


def derivation_or_refusal(label: str) -> Derivation | None:
    """The label's derivation; None, after checking the refusal is one line, where it is refused."""
    d = derived(label)
    if isinstance(d, SymmemError):
        assert "\n" not in str(d) and str(d), (label, d)
        return None
    return d


LABELS = [label for label, _, _ in SPECS]
#: the peak is the pytorch convention's (the others count no step)
PEAKS = [label for label in LABELS if KEYWORDS[label][1].get("convention", "pytorch") == "pytorch"][::4]


#: the tables' kept labels (tests.kept_cases.kept marks the rest deep) run every line of symmem and of this file that
#: the whole table runs (tests/table_cover.py, docs/testing.md "Stop 42: thinviews42"), sharing their derivations
#: test_every_quantity_and_term_equals_sympy_substitution's default labels (28 of 179)
EVERY_KEPT = {
    "bert-base-cs231n-0", "bert-base-megatron-0", "bert-base-paper-0", "counts-cs231n-0", "counts-pytorch-0",
    "gpt-megatron-cs231n-0", "gpt-megatron-megatron-0", "gpt-megatron-paper-2", "gpt-megatron-pytorch-0",
    "gpt2-cross-entropy-pytorch-cpu", "gpt2-cs231n-0", "gpt2-pytorch-1",
    "llama-('B', 'S', 'H', 'h', 'G', 'L', 'F', 'V')-pytorch-naive-cross-entropy", "llama-cross-entropy-pytorch",
    "llama-cs231n-0", "mlp-cs231n-0", "mlp-paper-0", "resnet101-cs231n-0", "resnet18-cs231n-0", "resnet18-paper-0",
    "resnet18-pytorch-0", "resnet50-v1-paper-1", "vgg11-cs231n-0", "vgg11_bn-paper-1", "vgg19-pytorch-0",
    "vit-b16-cs231n-0", "vit-b16-pytorch-2", "vit-s16-megatron-0"
}

#: test_peak_equals_sympy_substitution's (8 of 10)
PEAK_KEPT = {
    "bert-base-pytorch-0", "gpt2-pytorch-0", "resnet152-pytorch-0", "resnet50-('B', 'Hi', 'Wi')-pytorch",
    "resnet50-pytorch-1", "vgg11_bn-pytorch-0", "vit-b16-pytorch-1", "vit-ti16-pytorch-0"
}

#: test_interpreted_first_configuration_equals_compiled's (13 of 60)
INTERPRETED_KEPT = {
    "llama-cross-entropy-pytorch", "resnet18-cs231n-0", "vgg11_bn-paper-1",
    # tests/test_table_cover.py's check: these derive where the three above read a derivation another table made
    "bert-base-cs231n-0", "counts-cs231n-0", "gpt-megatron-cs231n-0", "gpt2-cs231n-0", "llama-cs231n-0",
    "mlp-cs231n-0", "resnet101-cs231n-0", "resnet50-v1-paper-1", "vgg11-cs231n-0", "vit-b16-cs231n-0",
}

#: test_values_over_a_grid_equal_one_at_a_time's (4 of 26)
GRID_KEPT = {
    "counts-paper-0", "gpt2-cross-entropy-pytorch-cpu", "vgg11_bn-paper-1", "vit-b16-pytorch-1"
}


def _settable(d: Derivation) -> set[str]:
    """The free symbols a configuration sets: not one that follows from others (ViT's S from the image, which
    ``at`` refuses where it contradicts them: tests/test_dims_rules.py), so the rest of the configuration is kept."""
    return {s.name for s in d.free} - {s.name for s in d.tied}


@pytest.mark.parametrize("label", kept(LABELS, LABELS, EVERY_KEPT))
def test_every_quantity_and_term_equals_sympy_substitution(label):
    d = derivation_or_refusal(label)
    if d is None:
        return
    names = _settable(d)
    configs = [{}] + [{k: v for k, v in c.items() if k in names} for c in CONFIGS]
    for config in configs:
        try:
            e = d.at(**config)
            truth(d.total, e.numbers)
        except (SymmemError, AssertionError):
            continue  # values the model's assumptions refuse (G must divide h ...)
        for key in QUANTITIES:
            if key.startswith("peak"):
                continue  # below, for the derivations that have one
            assert e.value(key) == truth(d.expression(key), e.numbers), (label, config, key)
        for term in d.terms:
            assert e.evaluate(term.expr) == truth(term.expr, e.numbers), (label, config, term.name)


@pytest.mark.parametrize("label", kept(PEAKS, PEAKS, PEAK_KEPT))
def test_peak_equals_sympy_substitution(label):
    d = derivation_or_refusal(label)
    if d is None:
        return
    assert d.has_peak, label
    names = _settable(d)
    for config in [{}, {k: v for k, v in CONFIGS[1].items() if k in names}]:
        e = d.at(**config)
        try:
            found = e._peak(exact=True)
        except SymmemError as exc:
            pytest.skip(f"no peak here: {exc}")
        assert e.value("peak") == truth(found.expr, e.numbers), (label, config)
        assert e.value("peak_first_step") == truth(found.first, e.numbers), (label, config)


@pytest.mark.parametrize("label", kept(LABELS[::3], LABELS[::3], INTERPRETED_KEPT))
def test_interpreted_first_configuration_equals_compiled(label):
    # A fresh evaluator interprets its first configuration and compiles for the next ones: both paths agree.
    d = derivation_or_refusal(label)
    if d is None:
        return
    for expr in (d.total, d.activations, d.parameters):
        first, second = Evaluator(expr), Evaluator(expr)
        second._compile()
        values = [d.numbers[s] for s in first.symbols]
        assert first.exact(*values) == second.exact(*values) == Fraction(truth_fraction(expr, d.numbers))
        assert first._compiled is False and second._scalar is not None or second.source is None


def truth_fraction(expr: sympy.Expr, numbers) -> Fraction:
    value = sympy.sympify(sympy.sympify(expr).xreplace({s: sympy.Integer(v) for s, v in numbers.items()}))
    return Fraction(int(value.p), int(value.q))


@pytest.mark.parametrize("label", kept(LABELS[::7], LABELS[::7], GRID_KEPT))
def test_values_over_a_grid_equal_one_at_a_time(label):
    d = derivation_or_refusal(label)
    if d is None:
        return
    free = [s.name for s in d.free][:2]
    grids = {free[0]: np.array([1, 2, 3, 64])[:, None]}
    if len(free) > 1:
        grids[free[1]] = np.array([1, 5, 96])[None, :]
    for key in ("total", "activations", "parameter_memory"):
        try:
            got = d.values(key, **grids)
        except SymmemError:
            continue
        for index in itertools.product(*(range(n) for n in got.shape)):
            config = {k: int(np.broadcast_to(v, got.shape)[index]) for k, v in grids.items()}
            assert got[index] == d.at(**config).value(key), (label, key, config)


def test_llama_loss_piecewise_branches():
    d = derive("llama", convention="pytorch", loss="cross-entropy", free=("B", "S", "G", "h", "H"))
    assert d.total.has(sympy.Piecewise)
    for b, g, hh in itertools.product((1, 2), (1, 2, 4), (4, 8)):
        e = d.at(B=b, G=g, h=hh, H=64 * hh)
        assert e.value("total") == truth(d.total, e.numbers)
    grid = d.values("total", B=np.array([1, 2])[:, None, None], G=np.array([1, 2, 4])[None, :, None],
                    h=np.array([4, 8])[None, None, :], H=np.array([256, 512])[None, None, :])
    for i, j, k in itertools.product(range(2), range(3), range(2)):
        config = {"B": [1, 2][i], "G": [1, 2, 4][j], "h": [4, 8][k], "H": [256, 512][k]}
        assert grid[i, j, k] == d.at(**config).value("total")


def test_exact_where_lambdify_rounds():
    # 2**60-scale bytes: float64 keeps 53 bits, the evaluator every one
    expr = 8 * B * G * H * L * S / h + 3
    f = evaluator(expr)
    big = dict(B=2**20 + 1, G=7, H=2**25 + 3, L=3, S=2**9 + 1, h=3)
    exact = Fraction(8 * big["B"] * 7 * big["H"] * 3 * big["S"], 3) + 3
    assert f.exact(**big) == exact and f(**big) == -(-exact.numerator // exact.denominator)
    lam = sympy.lambdify(f.symbols, expr, "numpy")
    assert int(lam(*(np.float64(big[s.name]) for s in f.symbols))) != f(**big)
    arr = f.many(**{k: np.array([v, v + 1]) for k, v in big.items()})
    assert arr.dtype == np.int64 and arr[0] == f(**big)


def test_object_arrays_beyond_int64():
    f = evaluator(B**3 * S**3 * H**2)
    values = {"B": [2**10, 2**20], "S": 2**12, "H": 2**15}
    out = f.many(**values)
    assert out.dtype == object and [int(x) for x in out] == [b**3 * 2**36 * 2**30 for b in values["B"]]
    assert max(out) > INT64_MAX
    small = f.many(B=[1, 2], S=3, H=4)
    assert small.dtype == np.int64 and small.tolist() == [27 * 16, 8 * 27 * 16]


@pytest.mark.parametrize("expr", [
    sympy.floor(H / 3) * B + sympy.ceiling(S / 7), sympy.Max(B / 2, S, 3 * h / 4) - sympy.Min(B, h / 3),
    sympy.Mod(h, G) + B, sympy.Piecewise((B / 3, sympy.Ne(G, 1) & (S > h)), (S**2, sympy.Eq(h / G, 2)),
                                         (B * S - 1, True)),
    B * S / (S + 1) + 1 / N, (B + S) ** -2 * H**3, sympy.Piecewise((B, sympy.Le(B, 2) | ~sympy.Ge(S, 4)),
                                                                  (t * H / 5, True)),
])
def test_operations_against_sympy(expr):
    f = evaluator(expr)
    symbols = f.symbols
    rng = np.random.default_rng(1)
    rows = rng.integers(1, 9, size=(40, len(symbols)))
    for row in rows:
        numbers = dict(zip(symbols, (int(x) for x in row), strict=True))
        want = sympy.sympify(expr.xreplace({s: sympy.Integer(v) for s, v in numbers.items()}))
        assert f.exact(*row.tolist()) == Fraction(int(want.p), int(want.q))
        assert f(*row.tolist()) == truth(expr, numbers)
    many = f.many(*(rows[:, i] for i in range(len(symbols))))
    assert many.tolist() == [f(*row.tolist()) for row in rows]


def test_unsupported_parts_fall_back_to_sympy():
    f = evaluator(sympy.sqrt(B) * 4 + sympy.Float(0.5) * S)
    assert f.source is None
    assert f(B=9, S=3) == truth(f.expr, {B: 9, S: 3}) == 14
    assert f.many(B=[9, 16], S=[3, 4]).tolist() == [14, 18]


def test_values_checks_its_input():
    d = derive("vit-b16")
    with pytest.raises(SymmemError, match="not a symbol of this formula"):
        d.values("total", Hi=[224])
    with pytest.raises(SymmemError, match="positive"):
        d.values("total", B=[0, 1])
    with pytest.raises(SymmemError, match="integers"):
        d.values("total", B=[1.5])
    assert d.values("parameters", B=[1, 2, 3]).tolist() == [d.value("parameters")] * 3


def test_at_keeps_the_worked_out_expressions():
    d = derive("llama", loss="cross-entropy")
    total = d.total
    assert d.at(B=2).__dict__["total"] is total


def test_peak_values_inside_and_outside_the_formulas_domain():
    d = derive("mlp", widths="symbolic", convention="pytorch")
    assert d._peak().domain  # L >= 4: fewer layers are written out one configuration at a time
    layers, batches = np.array([1, 2, 3, 4, 5, 8])[None, :], np.array([1, 7])[:, None]
    got = d.values("peak", L=layers, B=batches)
    assert got.tolist() == [[d.at(L=int(x), B=int(b)).value("peak") for x in layers[0]] for b in (1, 7)]
    assert d.values("peak_first_step", B=[1, 3]).tolist() == [d.at(B=b).value("peak_first_step") for b in (1, 3)]


def test_peak_values_at_one_configuration_given_as_numbers():
    d = derive("mlp", widths="symbolic", convention="pytorch")
    assert d.values("peak", L=2, B=3).tolist() == d.at(L=2, B=3).value("peak")
