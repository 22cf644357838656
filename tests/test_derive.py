"""Derivation: symbolic repetition, storage counting, substitution, units and the JSON contract."""

from __future__ import annotations

import json

import pytest
import sympy

from symmem import GraphBuilder, Model, derive
from symmem.cli import main
from symmem.conventions import Convention, Saved
from symmem.symbols import B, H, L
from symmem.units import format_bytes, parse_size, to_unit


class SavesLinearInputs(Convention):
    """A toy storage-counting convention: every linear keeps its input."""

    name, description, dedup, options = "toy", "linear inputs", True, {}

    def saved(self, graph, node, options):
        return [Saved("input", 0)] if node.kind == "linear" else []


def _stack(head_saves: bool) -> Model:
    g = GraphBuilder("stack")
    x = g.input("x", (B, H))
    with g.group("stem"):
        x = g.op("relu", x, name="stem")
    with g.group("layer"), g.repeat("layer", L, x) as rep:
        y = g.op("linear", rep.input, name="fc", out_features=H)
        rep.output(g.op("relu", y, name="act"))
    with g.group("head"):
        if head_saves:
            g.op("linear", rep.result, name="out", out_features=H)
        else:
            g.op("relu", rep.result, name="out")
    return Model("stack", g.finish(), {B: 8, H: 16, L: 5}, (B, H, L), layer="layer")


@pytest.mark.parametrize("head_saves, act_copies", [(True, L), (False, L - 1)])
def test_repeated_layer_storages(head_saves, act_copies):
    """Layer k's input is the stem output for k = 1 and layer k-1's output after: counted once each."""
    d = derive(_stack(head_saves), convention=SavesLinearInputs())
    terms = {t.name: t for t in d.terms if t.category == "activation"}
    assert terms["stem"].count == 1
    assert sympy.expand(terms["layer.act"].count - act_copies) == 0
    assert sympy.expand(d.activations - 4 * B * H * (1 + act_copies)) == 0
    # The same, unrolled: L = 5 layers hold 5 (or 4) layer outputs plus the stem output.
    assert d.value("activations") == 4 * 8 * 16 * (1 + (5 if head_saves else 4))


def test_per_layer_and_symbolic_parameters():
    d = derive(_stack(True), convention=SavesLinearInputs(), per_layer=True)
    assert d.activations == 4 * B * H
    assert sympy.expand(d.parameters - (H**2 + H)) == 0
    whole = derive(_stack(True), convention=SavesLinearInputs())
    assert sympy.expand(whole.parameters - (L * (H**2 + H) + H**2 + H)) == 0


def test_values_and_free_symbols():
    d = derive("vit-b16", convention="paper", attention="sdpa", values={"B": 32})
    assert d.numbers[B] == 32
    assert d.value("activations") * 2 == derive("vit-b16", convention="paper", attention="sdpa").value("activations")
    only_b = derive("vit-b16", convention="paper", attention="sdpa", free=("B",))
    assert only_b.activations.free_symbols == {B}
    whole = derive("vit-b16", convention="paper", attention="sdpa")
    assert only_b.evaluate(only_b.activations) == whole.value("activations")


def test_non_free_override_enters_the_formula():
    # F is not a free symbol of vit-b16 (its default is 4H); setting it puts the number in the formula.
    d = derive("vit-b16", convention="paper", attention="sdpa", per_layer=True, values={"F": 1000})
    assert sympy.expand(d.activations / 4 - (5 * B * sympy.Symbol("S", positive=True, integer=True) * H
                                             + 1000 * B * sympy.Symbol("S", positive=True, integer=True))) == 0


def test_image_size_moves_the_token_count():
    d = derive("vit-b16", convention="paper", values={"Hi": 384, "Wi": 384})
    assert d.numbers[sympy.Symbol("S", positive=True, integer=True)] == 577


def test_size_units():
    d = derive("resnet50-v1", convention="paper")
    assert d.size("total", "GiB") == pytest.approx(3.0246, abs=5e-5)
    assert d.size("parameter_memory", "MB") == pytest.approx(25_557_032 * 16 / 1e6)


@pytest.mark.parametrize("text, nbytes", [
    ("80GiB", 80 * 2**30), ("80 GB", 80 * 10**9), ("512MiB", 512 * 2**20), ("1.5GiB", 3 * 2**29),
    ("4096", 4096), ("4096B", 4096), ("2_048 MB", 2048 * 10**6), ("1TiB", 2**40), ("3 kB", 3000),
])
def test_parse_size(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "0", "80 GiBs", "1e9", "eight GB"])
def test_parse_size_rejects(text):
    with pytest.raises(Exception, match="size|unit|positive"):
        parse_size(text)


def test_format_and_convert():
    assert format_bytes(49 * 2**20) == "49.000 MiB"
    assert format_bytes(1.29e9, binary=False) == "1.290 GB"
    assert to_unit(2**30, "MiB") == 1024.0


def test_json_contract(capsys):
    assert main(["derive", "vit-b16", "--convention", "paper", "--attention", "naive", "--per-layer",
                 "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "vit-b16" and out["convention"] == "paper" and out["per_layer"] is True
    assert out["expressions"]["activations"] == "36*B*H*S + 4*B*S**2*h"
    assert set(out["latex"]) >= {"activations", "parameter_memory", "total"}
    assert out["values"]["activations"] == 4 * (9 * 64 * 197 * 768 + 64 * 12 * 197**2)
    assert out["values"]["parameters"] == 12 * 768**2 + 13 * 768
    assert out["bytes_per_parameter"] == {"weights": 4, "gradients": 4, "exp_avg": 4, "exp_avg_sq": 4}
    rows = out["breakdown"]
    assert {r["name"] for r in rows} >= {"blocks.qkv", "blocks.softmax", "weights"}
    assert sum(r["bytes"] for r in rows) == out["values"]["total"]
    for row in rows:
        assert set(row) >= {"name", "group", "expr", "bytes", "latex"}


def test_json_whole_model_values(capsys):
    assert main(["derive", "resnet50-v1", "--convention", "paper", "--format", "json", "--set", "B=128"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["symbols"]["B"] == 128
    assert out["values"]["parameters"] == 25_557_032
    assert out["values"]["total"] == out["values"]["activations"] + out["values"]["parameter_memory"]
    indices = [r for r in out["breakdown"] if r["role"] == "indices"]
    assert len(indices) == 1 and indices[0]["bytes"] == 128 * 64 * 56 * 56 * 4


def test_text_and_latex_output(capsys):
    assert main(["derive", "resnet50-v1", "--convention", "paper"]) == 0
    text = capsys.readouterr().out
    assert "stage 2" in text and "784.00" in text and "3.025 GiB" in text
    assert main(["derive", "vit-b16", "--convention", "paper", "--attention", "naive", "--per-layer",
                 "--format", "latex"]) == 0
    tex = capsys.readouterr().out
    assert r"\begin{align*}" in tex and r"B H S {\left(36 + \frac{4 S h}{H}\right)}" in tex


def test_models_listing(capsys):
    assert main(["models", "-v"]) == 0
    out = capsys.readouterr().out
    for name in ("resnet50", "resnet50-v1", "vit-b16", "vgg16", "mlp"):
        assert name in out
    assert "S=floor(Hi/16)*floor(Wi/16) + 1" in out


def test_at_only_moves_free_symbols():
    d = derive("vit-b16", convention="paper", attention="sdpa")
    assert d.at(B=32).value("activations") * 2 == d.value("activations")
    with pytest.raises(Exception, match="'Hi' is not a symbol of this formula"):
        d.at(Hi=384)  # S follows the image size only when deriving again
    again = derive("vit-b16", convention="paper", attention="sdpa", values={"Hi": 384, "Wi": 384})
    assert {s.name: v for s, v in again.numbers.items()}["S"] == 577
