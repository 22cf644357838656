"""Vision Transformers as timm builds them (``VisionTransformer`` with a class token; DeiT shares it).

``vit-b16`` is ViT-B/16 = DeiT-Base: 224x224 images, 16x16 patches, S = 14*14 + 1 = 197 tokens with the class
token, H = 768, h = 12, L = 12, MLP width F = 4H, 1000 classes.  The token count S is its own symbol, tied
to the image size by its default ``floor(Hi/16)*floor(Wi/16) + 1`` (setting ``Hi=384`` moves S to 577).

>>> from symmem.models import build
>>> m = build("vit-ti16")
>>> m.defaults[m.free[2]]
192
"""

from __future__ import annotations

from ..graph import GraphBuilder, Model
from ..symbols import B, C, F, H, Hi, K, L, S, Wi, h
from .transformer import prenorm_layer

_TITLES = {"ti": "Ti", "s": "S", "b": "B", "l": "L"}  # ViT-Ti/16, ViT-S/16 ...
_SIZES = {"ti": (192, 3, 12), "s": (384, 6, 12), "b": (768, 12, 12), "l": (1024, 16, 24)}


def build_vit(name: str, size: str, attention: str = "sdpa", dropout: float = 0.0, patch: int = 16) -> Model:
    hidden, heads, layers = _SIZES[size]
    g = GraphBuilder(name)
    img = g.input("image", (B, C, Hi, Wi))
    with g.group("embed"):
        x = g.op("conv2d", img, name="patch_embed.proj", out_channels=H, kernel=patch, stride=patch)
        _, _, rows, cols = g.spec(x).shape  # floor(Hi/patch), floor(Wi/patch): the grid of patches
        x = g.op("reshape", x, name="patch_embed.flatten", shape=(B, H, S - 1))
        x = g.op("transpose", x, name="patch_embed.transpose", dim0=1, dim1=2)
        cls = g.parameter("cls_token", (1, 1, H))
        cls = g.op("expand", cls, name="cls_expand", shape=(B, 1, H))
        x = g.op("concat", cls, x, name="cat_cls", dim=1)
        pos = g.parameter("pos_embed", (1, S, H))
        x = g.op("add", x, pos, name="pos_add", role="patch_embed")
        x = g.op("dropout", x, name="pos_drop", p=dropout)
    with g.group("layer"), g.repeat("blocks", L, x, input_role="residual") as layer:
        layer.output(prenorm_layer(g, layer.input, attention_kind=attention, dropout=dropout))
    assert layer.result is not None
    with g.group("head"):
        x = g.op("layernorm", layer.result, name="norm", eps=1e-6)
        x = g.op("select", x, name="cls_pool", dim=1, index=0)
        x = g.op("dropout", x, name="head_drop", p=dropout)
        g.op("linear", x, name="head", out_features=K)
    defaults = {B: 64, C: 3, Hi: 224, Wi: 224, S: rows * cols + 1, H: hidden, h: heads, L: layers, F: 4 * H, K: 1000}
    desc = (f"ViT-{_TITLES[size]}/{patch} (timm VisionTransformer, class token; {attention} attention): "
            f"H={hidden}, h={heads}, L={layers}")
    return Model(name, g.finish(), defaults, (B, S, H, h, L), desc, layer="blocks",
                 options={"attention": attention, "dropout": dropout, "patch": patch})

