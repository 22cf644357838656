"""Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Table 2.

Each row is the paper's per-layer activation memory in bytes (16-bit activations, 1-byte dropout masks),
written in the paper's symbols s, b, h, a, t and mapped to ours (s->S, b->B, h->H, a->h).  The engine derives
its side from the ``gpt-megatron`` layer graph under the ``megatron`` convention and the regime of the row.
"""

from __future__ import annotations

import pytest
import sympy

from symmem import derive
from symmem.symbols import B, H, S, h, t

s, b, hid, a = sympy.symbols("s b h a", positive=True)
TO_OURS = {s: S, b: B, hid: H, a: h}

TABLE_2 = [
    ("no parallelism", {}, s * b * hid * (34 + 5 * a * s / hid)),
    ("tensor parallel", {"tensor_parallel": True}, s * b * hid * (10 + 24 / t + 5 * a * s / (hid * t))),
    ("tensor + sequence parallel", {"tensor_parallel": True, "sequence_parallel": True},
     s * b * hid / t * (34 + 5 * a * s / hid)),
    ("tensor + sequence parallel + selective recompute",
     {"tensor_parallel": True, "sequence_parallel": True, "checkpoint": "selective"}, 34 * s * b * hid / t),
    ("full recompute", {"checkpoint": "full"}, 2 * s * b * hid),
]


@pytest.mark.parametrize("row, regime, published", TABLE_2, ids=[r[0] for r in TABLE_2])
def test_table2(row, regime, published):
    d = derive("gpt-megatron", convention="megatron", precision="mixed-megatron", per_layer=True, **regime)
    assert sympy.simplify(d.activations - published.xreplace(TO_OURS)) == 0


def test_table2_itemized():
    # Section 4.1: attention 11sbh + 5as^2b, MLP 19sbh, the two LayerNorm inputs 4sbh.
    d = derive("gpt-megatron", convention="megatron", precision="mixed-megatron", per_layer=True)
    by_name = {x.name.removeprefix("layers."): x.expr for x in d.terms if x.category == "activation"}
    attention = ("norm1", "qkv", "softmax", "attn_drop", "attn_drop.mask", "merge", "proj_drop.mask")
    mlp = ("norm2", "fc1", "act", "drop.mask")
    norms = ("input", "add1")
    assert sympy.expand(sum(by_name[n] for n in attention)) == 11 * S * B * H + 5 * h * S**2 * B
    assert sympy.expand(sum(by_name[n] for n in mlp)) == 19 * S * B * H
    assert sympy.expand(sum(by_name[n] for n in norms)) == 4 * S * B * H
    assert set(by_name) == set(attention + mlp + norms)


def test_recompute_is_shown():
    # What is recomputed stays visible as a transient term: one layer's activations (full), or one layer's
    # attention core (selective).
    full = derive("gpt-megatron", convention="megatron", precision="mixed-megatron", per_layer=True,
                  checkpoint="full")
    assert sympy.expand(full.transient) == 34 * B * S * H + 5 * h * S**2 * B
    sel = derive("gpt-megatron", convention="megatron", precision="mixed-megatron", per_layer=True,
                 checkpoint="selective")
    assert sympy.expand(sel.transient) == 5 * h * S**2 * B
    assert sympy.expand(sel.total - sel.parameter_memory) == 34 * B * S * H + 5 * h * S**2 * B


def test_whole_model_full_recompute():
    d = derive("gpt-megatron", convention="megatron", precision="mixed-megatron", checkpoint="full")
    layers = next(x for x in d.terms if x.name == "layers.checkpoint")
    assert layers.expr == 2 * B * S * H * d.free[2]  # 2sbh per layer, L layers
