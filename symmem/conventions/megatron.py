"""The ``megatron`` convention: Korthikanti et al. 2022's activation accounting ("Reducing Activation
Recomputation in Large Transformer Models", section 4.1 and Table 2).

Per transformer layer it keeps, in the regime's activation dtype (16 bit in their paper): the input of each
LayerNorm (the two ``residual`` tensors), each LayerNorm output (``attn_input``, ``mlp_input``), Q, K and V
(``qkv``), the softmax output (``attn_probs``) and the attention dropout's output (``attn_dropout``), the
projection input (``proj_input``), the GeLU input (``mlp_hidden``) and output (``mlp_act``), plus a 1-byte mask
for every dropout with p > 0.  Each reference is counted as the paper counts it, without storage sharing.
That gives sbh(34 + 5as/h) bytes per layer in 16 bit; with tensor parallelism, sequence parallelism and
selective or full recomputation (see :mod:`symmem.passes.regimes`) the other rows of Table 2 follow.

Code beyond the data: a dropout that is the identity (p = 0, eval mode) keeps no mask, and the attention
dropout's mask has its own role.

>>> from symmem import derive
>>> d = derive("gpt-megatron", convention="megatron", precision="mixed-megatron", per_layer=True)
>>> d.activations
34*B*H*S + 5*B*S**2*h
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import Extra, RoleConvention, Saved, register

if TYPE_CHECKING:
    from ..graph import Graph, Node


class _Megatron(RoleConvention):
    def saved(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> list[Saved]:
        if node.kind == "dropout" and node.view_of is not None:
            return []  # p = 0 or eval mode: no mask, and the output is its input
        found = super().saved(graph, node, options)
        if node.kind == "dropout" and node.role == "attn_dropout":
            found = [Saved(s.source, s.index, s.label, s.spec, "attn_dropout_mask") if s.label == "mask" else s
                     for s in found]
        return found


MEGATRON = _Megatron(
    name="megatron",
    description=(
        "Korthikanti et al. 2022 (Megatron-LM): per layer the two LayerNorm inputs and outputs, Q, K, V, the "
        "softmax output and attention-dropout output, the projection input, GeLU input and output, and a "
        "1-byte mask per dropout: sbh(34 + 5as/h) bytes at 16 bit"),
    keep_outputs=frozenset({"residual", "attn_input", "qkv", "attn_probs", "attn_dropout", "proj_input",
                            "mlp_input", "mlp_hidden", "mlp_act"}),
    extras={"dropout": (Extra("mask", "uint8", "dropout_mask"),)},
    blind_to={"cache": "it counts no key/value cache copy", "loss": "it counts nothing of the loss"},
)

register("megatron", MEGATRON)
