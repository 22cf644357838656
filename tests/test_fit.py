"""Will it fit: the largest B or S under a budget, solved from the formula and checked at the boundary.

Oracles: the seed's own per-image figures (ResNet-50 keeps 2658.25 + 49 MiB of activations at B = 64, and
16 bytes per parameter for 25,557,032 parameters); the formula evaluated independently of the engine's
evaluation (plain Python integers and fractions from the polynomial's coefficients, :func:`plain_total`); and
real PyTorch, whose measured bytes at B = k make a budget whose answer must be k.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import sympy

import symmem
from symmem.apps.budget import largest, smallest_budget
from symmem.cli import main
from symmem.units import parse_size

MiB, GiB = 2**20, 2**30


def plain_total(d, name, x):
    """``d.total`` at ``name = x`` (other symbols at the derivation's numbers), in plain Python arithmetic: the
    sum of coefficient x product of value**exponent over the polynomial's terms, rounded up as bytes are.
    Independent of ``Derivation.evaluate``, ``value`` and ``at`` (and of sympy's substitution)."""
    free = sorted(d.total.free_symbols, key=str)
    values = [x if s.name == name else d.numbers[s] for s in free]
    total = Fraction(0)
    for exponents, coeff in sympy.Poly(d.total, *free).terms():
        term = Fraction(int(coeff.p), int(coeff.q))
        for v, e in zip(values, exponents, strict=True):
            term *= v ** e
        total += term
    return math.ceil(total)


@pytest.fixture(scope="module")
def resnet():
    return symmem.derive("resnet50-v1", convention="paper")


@pytest.mark.parametrize("budget, nbytes", [
    ("80GiB", 80 * GiB), ("80GB", 80 * 10**9), ("40 GB", 40 * 10**9), ("24576MiB", 24 * GiB),
    ("16000MB", 16 * 10**9), (str(12 * GiB), 12 * GiB), (12 * GiB, 12 * GiB),
])
def test_resnet_batch_from_seed_figures(resnet, budget, nbytes):
    per_image = (2658.25 + 49.00) * MiB / 64      # seed 000, section 2: activations + indices at B = 64
    fixed = 25_557_032 * 16                        # weights, gradients, two AdamW moments
    expected = int((nbytes - fixed) // per_image)
    r = largest(resnet, "B", budget)
    assert (r.max, r.budget) == (expected, nbytes)
    assert r.total_at_max == plain_total(resnet, "B", r.max) <= nbytes < plain_total(resnet, "B", r.max + 1)


@pytest.mark.parametrize("model, options, solve, budget", [
    ("vit-b16", {"attention": "naive"}, "B", "80GiB"),
    ("vit-b16", {"attention": "naive"}, "S", "80GiB"),   # quadratic in S: B h S^2
    ("vit-b16", {"attention": "sdpa"}, "S", "40GB"),
    ("vit-l16", {"attention": "naive"}, "S", "24GiB"),
    ("vgg16", {}, "B", "16GiB"),
])
def test_boundary(model, options, solve, budget):
    d = symmem.derive(model, convention="paper", **options)
    r = largest(d, solve, budget)
    assert r.total_at_max == plain_total(d, solve, r.max) <= r.budget < plain_total(d, solve, r.max + 1)
    assert r.total_above == plain_total(d, solve, r.max + 1)


def test_vit_sequence_quadratic():
    """S solved from 4 B h L S^2 + ...: the seed's ViT-B/16 at B = 64 fits S = 197 in 8 GiB, not in 6 GiB."""
    d = symmem.derive("vit-b16", convention="paper", attention="naive")
    assert largest(d, "S", "8GiB").max >= 197 > largest(d, "S", "6GiB").max


def test_smallest_budget_is_the_seed_total(resnet):
    assert smallest_budget(resnet, "B", 64) / GiB == pytest.approx(3.0246, abs=5e-5)


def test_nothing_fits_is_an_answer(capsys):
    """Exit 1 (an answer), not the 2 of bad input; one line that says how much the smallest size needs."""
    assert main(["fit", "resnet50-v1", "--convention", "paper", "--budget", "100MiB"]) == 1
    err = capsys.readouterr().err.strip()
    need = symmem.derive("resnet50-v1", convention="paper").at(B=1).value("total")
    assert err.startswith("symmem: nothing fits") and f"{need:,} B" in err and "\n" not in err


@pytest.mark.parametrize("args, message", [
    # the paper convention keeps tensors by the seed's roles, none of which an MLP has: not "does not grow"
    (["fit", "mlp", "--convention", "paper", "--budget", "1GiB", "--set", "B=1"],
     "keeps nothing; use --convention pytorch"),
    (["fit", "resnet50-v1", "--convention", "paper", "--budget", "80 parsecs"], "unknown unit"),
    (["fit", "resnet50-v1", "--convention", "paper", "--budget", "80GiB", "--solve", "S"], "no symbol 'S'"),
    # a value with a minus sign is read as the option's value (argparse would say "expected one argument")
    (["fit", "resnet50-v1", "--convention", "paper", "--budget", "-3GiB"], "'-3GiB' is not a size"),
])
def test_errors(capsys, args, message):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_json(capsys):
    assert main(["fit", "vit-b16", "--convention", "paper", "--attention", "naive", "--budget", "80GiB", "--solve", "B",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["symbol"] == "B" and out["budget"] == 80 * GiB
    d = symmem.derive("vit-b16", convention="paper", attention="naive")
    assert out["total_at_max"] == plain_total(d, "B", out["max"]) <= out["budget"]
    assert out["total_above"] == plain_total(d, "B", out["max"] + 1) > out["budget"]


@pytest.mark.parametrize("k", [3, 7])
def test_fit_against_pytorch(k):
    """A budget of exactly what PyTorch keeps at B = k (measured) plus the AdamW parameter side (16 bytes per
    parameter PyTorch counts) fits B = k and not B = k + 1: the answer is k."""
    torch = pytest.importorskip("torch")
    from symmem.record.verify import measure
    from symmem.reference import reference

    widths = "784,256,128,10"

    def kept(b):
        module, inputs = reference("mlp", {"B": b}, {"widths": widths, "dropout": 0.0})
        torch.manual_seed(0)
        m = measure(module, *inputs)
        return m.activations + m.input, sum(p.numel() for p in module.parameters())

    at_k, params = kept(k)
    d = symmem.derive("mlp", convention="pytorch", device="cpu", widths=widths)
    r = largest(d, "B", at_k + 16 * params, quantity="total")  # what is kept at the end of the forward
    assert (r.max, r.total_at_max, r.total_above) == (k, at_k + 16 * params, kept(k + 1)[0] + 16 * params)


def test_solve_only_values_the_model_accepts(capsys):
    """gpt2 with H = 768: the budget's bound on h is 201, but h must divide H; S is tied to the image in ViT."""
    d = symmem.derive("gpt2", convention="paper", free=("B", "S", "H", "h", "L", "F", "V"), attention="naive")
    bound = largest(d, "h", "80GiB").max  # naive attention: the B*h*S^2 probabilities make h a size that counts
    assert main(["fit", "gpt2", "--convention", "paper", "--attention", "naive", "--budget", "80GiB", "--solve", "h",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    best = max(x for x in range(1, bound + 1) if 768 % x == 0)
    assert (out["bound"], out["max"]) == (bound, best) and out["max"] < bound and "divide" in out["refused"]
    assert out["total_at_max"] == plain_total(d, "h", best)
    assert main(["fit", "vit-b16", "--convention", "paper", "--budget", "80GiB", "--solve", "S"]) == 2
    assert "S follows from Hi, Wi" in capsys.readouterr().err


def test_cli_smallest_budget(capsys):
    assert main(["fit", "resnet50-v1", "--convention", "paper", "--set", "B=64", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["smallest_budget"] == symmem.derive("resnet50-v1", convention="paper").value("total")


@pytest.mark.parametrize("model, solve, values, budget", [
    # S = floor(Hi/16) floor(Wi/16) + 1 moves with Hi (stop 42: ViT-Ti's Hi below runs the same lines; -m deep)
    pytest.param("vit-b16", "Hi", {"B": 8}, "80GiB", marks=pytest.mark.deep),
    ("vit-b16", "Wi", {"B": 2}, "24GiB"),
    ("vit-ti16", "Hi", {"B": 64, "Wi": 384}, "40GiB"),
])
def test_a_symbol_that_follows_moves_with_the_solved_one(model, solve, values, budget):
    """The answer's boundary against fresh derivations at the model's own sizes (S from the image, not 197)."""
    d = symmem.derive(model, values=values, free=("B", "S", solve))
    r = largest(d, solve, budget)
    cap = parse_size(budget)
    at = {**values, solve: r.max}
    above = {**values, solve: r.max + 1}
    assert symmem.derive(model, values=at).value("peak") == r.total_at_max <= cap
    assert symmem.derive(model, values=above).value("peak") == r.total_above > cap
    assert d.at(**{solve: r.max}).value("peak") == r.total_at_max  # at() moves S too
