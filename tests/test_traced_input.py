"""The model's input is one tensor, however many blocks save it: a traced ledger whose repeated block's first op
keeps the input (a Linear, a LayerNorm, a Conv at the stack's head) counts it once, against real PyTorch's saved
tensors (:func:`symmem.record.verify.measure`) at a depth never traced; so does the every-size fit."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from symmem.api import trace  # noqa: E402
from symmem.record.verify import measure  # noqa: E402

nn = torch.nn


def _linear(n: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n, n), nn.Tanh())


def _norm(n: int) -> nn.Module:
    return nn.Sequential(nn.LayerNorm(n), nn.Linear(n, n), nn.GELU())


def _conv(n: int) -> nn.Module:
    return nn.Sequential(nn.Conv1d(n, n, 3, padding=1), nn.ReLU())


def _net(block: Any, layers: int, stem: str | None, n: int = 8) -> nn.Module:
    """``layers`` blocks after an optional stem: ``plain`` (a Linear, whose output block 0 keeps first) or
    ``kept`` (a Linear and a Tanh, which keeps its output itself)."""
    torch.manual_seed(0)
    conv = block is _conv
    head = {None: [], "plain": [nn.Conv1d(n, n, 1) if conv else nn.Linear(n, n)],
            "kept": [nn.Conv1d(n, n, 1) if conv else nn.Linear(n, n), nn.Tanh()]}[stem]
    return nn.Sequential(*head, *[block(n) for _ in range(layers)])


CASES = [(b, s) for b in (_linear, _norm, _conv) for s in (None, "plain", "kept")]
#: the default suite's cases: together every line the nine run (stop 42, line coverage); the other six are deep
KEPT = {(_linear, None), (_norm, "kept"), (_conv, "kept")}


@pytest.mark.parametrize("block, stem", [pytest.param(b, s, id=f"{b.__name__[1:]}-{s or 'no'}-stem",
                                                      marks=[] if (b, s) in KEPT else [pytest.mark.deep])
                                         for b, s in CASES])
def test_input_kept_by_block_zero_counted_once(block: Any, stem: str | None) -> None:
    conv = block is _conv
    shape, dims = ((2, 8, 6), {"B": [(0, 0)], "S": [(0, 2)]}) if conv else ((2, 8), {"B": [(0, 0)]})
    d = trace(_net(block, 3, stem), (torch.zeros(*shape),), dims)
    for layers in (3, 5):  # traced with 3 blocks; 5 only through the fold
        x = torch.randn(5, 8, 7) if conv else torch.randn(5, 8)
        real = measure(_net(block, layers, stem), x)
        at = {"B": 5, "S": 7} if conv else {"B": 5}
        folded = {s.name: v for s, v in d.numbers.items()}.get("L")
        if folded is not None:  # L counts the folded run: block 0 stays out of it where it keeps more than the rest
            at["L"] = folded - 3 + layers
        elif layers != 3:
            continue  # no fold: the formula is of the traced depth only
        got = d.at(**at)
        assert (got.value("input"), got.value("activations")) == (real.input, real.activations), (layers, d.terms)
        assert real.input == x.numel() * 4  # one tensor


def test_every_size_fit_accepts_a_block_keeping_the_input() -> None:
    """The fit's L check used to refuse this module (the input counted L times at L = 3).  Its per-layer note
    writes the formulas as the table does (the field's order), so the two agree."""

    def build(H: int, F: int, L: int) -> tuple[nn.Module, tuple[Any, ...]]:
        torch.manual_seed(0)
        blocks = [nn.Sequential(nn.Linear(H, F), nn.Tanh(), nn.Linear(F, H), nn.Tanh()) for _ in range(L)]
        return nn.Sequential(*blocks), (torch.zeros(2, H),)

    d = trace(build, dims={"B": [(0, 0)]}, sizes={"H": 8, "F": 16, "L": 3}, optimizer="sgd")
    for h, f, layers in ((8, 16, 3), (12, 20, 5)):
        x = torch.randn(5, h)
        real = measure(build(h, f, layers)[0], x)
        got = d.at(B=5, H=h, F=f, L=layers)
        assert (got.value("input"), got.value("activations")) == (real.input, real.activations)
    note = next(n for n in d.notes if n.startswith("per layer:"))
    # by hand: each layer keeps its two Tanh outputs (B x F, B x H floats); H*F + F + F*H + H parameters
    assert note == "per layer: 4*B*(H + F) bytes kept for backward, H + F + 2*H*F parameters"
    table = d.table()
    assert "4*B*L*(H + F)" in table and "L*(H + F + 2*H*F)" in table  # the table's rows, in the note's order
