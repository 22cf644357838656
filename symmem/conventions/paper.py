"""The ``paper`` convention: the accounting of the FP32 analysis of ResNet-50 and ViT-B/16 (Bandyopadhyay, 2024).

It is data (a :class:`~symmem.conventions.RoleConvention`): the roles it keeps and the max-pool indices it adds.

>>> from symmem.conventions import convention
>>> convention("paper").keep_inputs
{'downsample': (0,)}
"""

from __future__ import annotations

from . import Extra, RoleConvention, register

PAPER = RoleConvention(
    name="paper",
    description=(
        "The accounting of the FP32 analysis of ResNet-50 and ViT-B/16 (Bandyopadhyay, 2024): per ResNet "
        "bottleneck the 1x1-reduce, 3x3 and 1x1-expand conv outputs (6PHW), the input of each projection "
        "shortcut, the conv1 and max-pool outputs and max-pool indices at 4 bytes; per transformer layer the two "
        "residual inputs, Q, K, V and the MLP hidden (9BSH) plus the B*h*S^2 attention probabilities when "
        "attention is naive, and the patch-embedding output once."
    ),
    keep_outputs=frozenset({"stem", "stem_pool", "main_path", "residual", "qkv", "mlp_hidden", "attn_probs",
                            "patch_embed"}),
    keep_inputs={"downsample": (0,)},
    extras={"maxpool2d": (Extra("indices", "int32", "indices"),)},
    blind_to={"dropout": "it counts no dropout mask or output", "cache": "it counts no key/value cache copy",
              "gelu": "it counts the MLP hidden whichever GELU follows", "loss": "it counts nothing of the loss"},
)

register("paper", PAPER)
