"""ResNets as torchvision builds them (``resnet18`` ... ``resnet152``), and ``resnet50-v1``.

torchvision's Bottleneck puts the stride on the 3x3 conv ("ResNet v1.5"); the original paper and the stage
accounting of the FP32 analysis of ResNet-50 and ViT-B/16 (Bandyopadhyay, 2024) put it on the first 1x1 conv of
each stage's first block (``resnet50-v1``).
Identical blocks after the first of each stage are one repeated block.

Roles: ``stem`` (conv1 output), ``stem_pool`` (max-pool output), ``main_path`` (the convs of a block),
``downsample`` (the projection shortcut's conv).

>>> from symmem.graph import parameter_count
>>> from symmem.models import build
>>> m = build("resnet50")
>>> parameter_count(m.graph).xreplace(dict(m.defaults))
25557032
"""

from __future__ import annotations

from typing import Any

from ..graph import GraphBuilder, Model
from ..symbols import B, C, Hi, K, Wi

_LAYOUTS = {18: ("basic", (2, 2, 2, 2)), 34: ("basic", (3, 4, 6, 3)), 50: ("bottleneck", (3, 4, 6, 3)),
            101: ("bottleneck", (3, 4, 23, 3)), 152: ("bottleneck", (3, 8, 36, 3))}


def _conv_bn(g: GraphBuilder, x: str, name: str, out: Any, kernel: int, stride: int, role: str | None,
             relu: bool, bn_name: str | None = None) -> str:
    y = g.op("conv2d", x, name=name, role=role, out_channels=out, kernel=kernel, stride=stride,
             padding=kernel // 2, bias=False)
    y = g.op("batchnorm", y, name=bn_name or name.replace("conv", "bn"))
    if relu:
        y = g.op("relu", y, name=f"relu_{name}", inplace=True)
    return y


def _block(g: GraphBuilder, x: str, kind: str, inplanes: int, planes: int, stride: int, v1: bool) -> str:
    """One BasicBlock or Bottleneck; returns the output node (after the final ReLU)."""
    expansion = 4 if kind == "bottleneck" else 1
    if kind == "bottleneck":
        s1, s2 = (stride, 1) if v1 else (1, stride)
        y = _conv_bn(g, x, "conv1", planes, 1, s1, "main_path", True)
        y = _conv_bn(g, y, "conv2", planes, 3, s2, "main_path", True)
        y = _conv_bn(g, y, "conv3", planes * expansion, 1, 1, "main_path", False)
    else:
        y = _conv_bn(g, x, "conv1", planes, 3, stride, "main_path", True)
        y = _conv_bn(g, y, "conv2", planes, 3, 1, "main_path", False)
    identity = x
    if stride != 1 or inplanes != planes * expansion:
        identity = _conv_bn(g, x, "downsample.0", planes * expansion, 1, stride, "downsample", False,
                            bn_name="downsample.1")
    y = g.op("add", y, identity, name="add", inplace=True)
    return g.op("relu", y, name="relu", inplace=True)


def build_resnet(name: str, depth: int, v1: bool = False, num_classes: int = 1000) -> Model:
    kind, blocks = _LAYOUTS[depth]
    expansion = 4 if kind == "bottleneck" else 1
    g = GraphBuilder(name)
    x = g.input("image", (B, C, Hi, Wi))
    with g.group("stem"):
        x = g.op("conv2d", x, name="conv1", role="stem", out_channels=64, kernel=7, stride=2, padding=3,
                 bias=False)
        x = g.op("batchnorm", x, name="bn1")
        x = g.op("relu", x, name="relu", inplace=True)
        x = g.op("maxpool2d", x, name="maxpool", role="stem_pool", kernel=3, stride=2, padding=1)
    inplanes = 64
    for i, (planes, n) in enumerate(zip((64, 128, 256, 512), blocks, strict=True), start=1):
        stride = 1 if i == 1 else 2
        with g.scope(f"layer{i}.0", group=f"stage {i}"):
            x = _block(g, x, kind, inplanes, planes, stride, v1)
        inplanes = planes * expansion
        if n > 1:
            with g.group(f"stage {i}"), g.repeat(f"layer{i}.1" if n == 2 else f"layer{i}.1-{n - 1}", n - 1,
                                                 x) as rep:
                rep.output(_block(g, rep.input, kind, inplanes, planes, 1, v1))
            x = rep.result or x
    with g.group("head"):
        x = g.op("adaptive_avgpool2d", x, name="avgpool", output_size=1)
        x = g.op("flatten", x, name="flatten", start_dim=1)
        x = g.op("linear", x, name="fc", out_features=K)
    v1_note = " v1 (stride on the first 1x1, as in the original paper and the FP32 analysis)"
    desc = (f"ResNet-{depth}{v1_note if v1 else ''}"
            f" as torchvision builds it, {num_classes} classes")
    return Model(name, g.finish(), {B: 64, C: 3, Hi: 224, Wi: 224, K: num_classes}, (B,), desc,
                 options={"depth": depth, "v1": v1})

