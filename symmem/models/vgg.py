"""VGG as torchvision builds it: ``vgg11/13/16/19`` and their ``_bn`` variants.

3x3 convs (padding 1) with in-place ReLU, 2x2 max-pools, an adaptive average pool to 7x7, and the classifier
Linear(25088, 4096) - ReLU - Dropout(0.5) - Linear(4096, 4096) - ReLU - Dropout(0.5) - Linear(4096, K).

Roles: ``conv`` (conv outputs), ``pool`` (max-pool outputs), ``fc`` (linear outputs).

>>> from symmem import derive
>>> derive("vgg16").value("parameters")
138357544
"""

from __future__ import annotations

from ..graph import GraphBuilder, Model
from ..symbols import B, C, Hi, K, Wi

CONFIGS: dict[int, tuple[int | str, ...]] = {
    11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    13: (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    19: (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"),
}


def build_vgg(name: str, depth: int, batch_norm: bool = False, dropout: float = 0.5) -> Model:
    g = GraphBuilder(name)
    x = g.input("image", (B, C, Hi, Wi))
    block, i = 1, 0
    for item in CONFIGS[depth]:
        with g.group(f"block {block}"):
            if item == "M":
                x = g.op("maxpool2d", x, name=f"features.{i}", role="pool", kernel=2, stride=2)
                block += 1
                i += 1
                continue
            x = g.op("conv2d", x, name=f"features.{i}", role="conv", out_channels=item, kernel=3, padding=1)
            i += 1
            if batch_norm:
                x = g.op("batchnorm", x, name=f"features.{i}")
                i += 1
            x = g.op("relu", x, name=f"features.{i}", inplace=True)
            i += 1
    with g.group("classifier"):
        x = g.op("adaptive_avgpool2d", x, name="avgpool", output_size=7)
        x = g.op("flatten", x, name="flatten", start_dim=1)
        x = g.op("linear", x, name="classifier.0", role="fc", out_features=4096)
        x = g.op("relu", x, name="classifier.1", inplace=True)
        x = g.op("dropout", x, name="classifier.2", p=dropout)
        x = g.op("linear", x, name="classifier.3", role="fc", out_features=4096)
        x = g.op("relu", x, name="classifier.4", inplace=True)
        x = g.op("dropout", x, name="classifier.5", p=dropout)
        g.op("linear", x, name="classifier.6", role="fc", out_features=K)
    desc = f"VGG-{depth}{' with BatchNorm' if batch_norm else ''} (torchvision), classifier dropout {dropout}"
    return Model(name, g.finish(), {B: 64, C: 3, Hi: 224, Wi: 224, K: 1000}, (B,), desc,
                 options={"depth": depth, "batch_norm": batch_norm, "dropout": dropout})

