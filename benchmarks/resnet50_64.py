"""ResNet-50 at 64x64 in plain torch (torchvision's layers, symmem's reference copy), for ``symmem trace``::

    symmem trace benchmarks/resnet50_64.py:resnet50 --dims B --multiple-of Hi=32,Wi=32
"""

from __future__ import annotations

from typing import Any


def resnet50() -> tuple[Any, tuple[Any, ...]]:
    """torchvision's ``resnet50`` (1,000 classes) and a batch of 2 images at 64x64."""
    from symmem.reference.vision_models import resnet

    return resnet({"B": 2, "C": 3, "Hi": 64, "Wi": 64, "K": 1000}, {"depth": 50})
