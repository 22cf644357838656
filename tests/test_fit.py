"""Will it fit: the largest B or S under a budget, solved from the formula and checked at the boundary.

Oracles: the seed's own per-image figures (ResNet-50 keeps 2658.25 + 49 MiB of activations at B = 64, and
16 bytes per parameter for 25,557,032 parameters), and totals re-derived at the answer with ``Derivation.at``.
"""

from __future__ import annotations

import json

import pytest

import symmem
from symmem.cli import main
from symmem.fit import largest, smallest_budget

MiB, GiB = 2**20, 2**30


@pytest.fixture(scope="module")
def resnet():
    return symmem.derive("resnet50-v1")


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
    assert r.total_at_max == resnet.at(B=r.max).value("total") <= nbytes < resnet.at(B=r.max + 1).value("total")


@pytest.mark.parametrize("model, options, solve, budget", [
    ("vit-b16", {"attention": "naive"}, "B", "80GiB"),
    ("vit-b16", {"attention": "naive"}, "S", "80GiB"),   # quadratic in S: B h S^2
    ("vit-b16", {"attention": "sdpa"}, "S", "40GB"),
    ("vit-l16", {"attention": "naive"}, "S", "24GiB"),
    ("vgg16", {}, "B", "16GiB"),
])
def test_boundary(model, options, solve, budget):
    d = symmem.derive(model, **options)
    r = largest(d, solve, budget)
    assert r.total_at_max == d.at(**{solve: r.max}).value("total") <= r.budget
    assert d.at(**{solve: r.max + 1}).value("total") > r.budget


def test_vit_sequence_quadratic():
    """S solved from 4 B h L S^2 + ...: the seed's ViT-B/16 at B = 64 fits S = 197 in 8 GiB, not in 6 GiB."""
    d = symmem.derive("vit-b16", attention="naive")
    assert largest(d, "S", "8GiB").max >= 197 > largest(d, "S", "6GiB").max


def test_smallest_budget_is_the_seed_total(resnet):
    assert smallest_budget(resnet, "B", 64) / GiB == pytest.approx(3.0246, abs=5e-5)


def test_nothing_fits_is_an_answer(capsys):
    """Exit 1 (an answer), not the 2 of bad input; one line that says how much the smallest size needs."""
    assert main(["fit", "resnet50-v1", "--budget", "100MiB"]) == 1
    err = capsys.readouterr().err.strip()
    need = symmem.derive("resnet50-v1").at(B=1).value("total")
    assert err.startswith("symmem: nothing fits") and f"{need:,} B" in err and "\n" not in err


@pytest.mark.parametrize("args, message", [
    (["fit", "mlp", "--budget", "1GiB", "--set", "B=1"], "does not grow"),
    (["fit", "resnet50-v1", "--budget", "80 parsecs"], "unknown unit"),
    (["fit", "resnet50-v1", "--budget", "80GiB", "--solve", "S"], "no symbol 'S'"),
])
def test_errors(capsys, args, message):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_cli_json(capsys):
    assert main(["fit", "vit-b16", "--attention", "naive", "--budget", "80GiB", "--solve", "B",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["symbol"] == "B" and out["budget"] == 80 * GiB
    d = symmem.derive("vit-b16", attention="naive")
    assert out["total_at_max"] == d.at(B=out["max"]).value("total") <= out["budget"]
    assert out["total_above"] == d.at(B=out["max"] + 1).value("total") > out["budget"]


def test_cli_smallest_budget(capsys):
    assert main(["fit", "resnet50-v1", "--set", "B=64", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["smallest_budget"] == symmem.derive("resnet50-v1").value("total")
