"""A multilayer perceptron of any widths: Linear - ReLU - (Dropout) ... - Linear.

The input width and the hidden widths are fixed numbers (``--widths 784,1024,1024,10``), or use the
symbols ``H`` (hidden width, repeated ``L`` times) with ``--widths symbolic``.

>>> from symmem import derive
>>> derive("mlp", widths="784,256,10").value("parameters")
203530
>>> derive("mlp", widths="symbolic").parameters
H**2*L + H*L + 795*H + 10
"""

from __future__ import annotations

from ..errors import SymmemError
from ..graph import GraphBuilder, Model
from ..symbols import B, H, K, L


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        raise SymmemError(f"mlp widths {text!r}: expected comma-separated positive integers") from None
    if len(widths) < 2 or any(w <= 0 for w in widths):
        raise SymmemError(f"mlp widths {text!r}: need at least two positive widths")
    return widths


def build_mlp(name: str, widths: str = "784,1024,1024,10", dropout: float = 0.0) -> Model:
    g = GraphBuilder(name)
    if widths == "symbolic":
        x = g.input("x", (B, 784))
        with g.group("input layer"):
            x = g.op("linear", x, name="fc_in", role="fc", out_features=H)
            x = g.op("relu", x, name="act_in", role="act")
            x = g.op("dropout", x, name="drop_in", p=dropout)
        with g.group("hidden"), g.repeat("hidden", L, x) as rep:
            y = g.op("linear", rep.input, name="fc", role="fc", out_features=H)
            y = g.op("relu", y, name="act", role="act")
            rep.output(g.op("dropout", y, name="drop", p=dropout))
        with g.group("head"):
            g.op("linear", rep.result, name="fc_out", role="fc", out_features=K)
        return Model(name, g.finish(), {B: 64, H: 1024, L: 2, K: 10}, (B, H, L),
                     f"MLP 784-(H x L)-K, ReLU, dropout {dropout}", layer="hidden",
                     options={"widths": widths, "dropout": dropout})
    ws = _widths(widths)
    x = g.input("x", (B, ws[0]))
    for i, w in enumerate(ws[1:], start=1):
        last = i == len(ws) - 1
        with g.group("head" if last else f"layer {i}"):
            x = g.op("linear", x, name=f"fc{i}", role="fc", out_features=w)
            if not last:
                x = g.op("relu", x, name=f"act{i}", role="act")
                x = g.op("dropout", x, name=f"drop{i}", p=dropout)
    return Model(name, g.finish(), {B: 64}, (B,), f"MLP {widths}, ReLU, dropout {dropout}",
                 options={"widths": widths, "dropout": dropout})

