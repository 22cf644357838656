"""Reference modules for the vision models: torchvision's ResNet and VGG, and the MLP.

Written to run the same ops in the same order as ``torchvision/models/resnet.py`` and ``vgg.py``: in-place
ReLUs, ``out += identity`` in each block, ``torch.flatten(x, 1)`` before the classifier, one shared
``self.relu`` module per block.  ``resnet50-v1`` moves the stride from the 3x3 conv to the first 1x1 conv
(the original paper's geometry).  Weights are initialised as torchvision does; their values do not change
what autograd keeps.

>>> from symmem.reference import reference
>>> net, (x,) = reference("resnet18", {"B": 2, "C": 3, "Hi": 32, "Wi": 32, "K": 10}, {"depth": 18})
>>> tuple(net(x).shape), sum(p.numel() for p in net.parameters())
((2, 10), 11181642)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import register


def _resnet_classes() -> tuple[type, type, type]:
    import torch
    from torch import nn

    def conv3x3(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
        return nn.Conv2d(cin, cout, kernel_size=3, stride=stride, padding=1, bias=False)

    def conv1x1(cin: int, cout: int, stride: int = 1) -> nn.Conv2d:
        return nn.Conv2d(cin, cout, kernel_size=1, stride=stride, bias=False)

    class BasicBlock(nn.Module):
        expansion = 1

        def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                     v1: bool = False) -> None:
            super().__init__()
            self.conv1 = conv3x3(inplanes, planes, stride)
            self.bn1 = nn.BatchNorm2d(planes)
            self.relu = nn.ReLU(inplace=True)
            self.conv2 = conv3x3(planes, planes)
            self.bn2 = nn.BatchNorm2d(planes)
            self.downsample = downsample

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            identity = x
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.bn2(self.conv2(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            out += identity
            return self.relu(out)

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None,
                     v1: bool = False) -> None:
            super().__init__()
            s1, s2 = (stride, 1) if v1 else (1, stride)
            self.conv1 = conv1x1(inplanes, planes, s1)
            self.bn1 = nn.BatchNorm2d(planes)
            self.conv2 = conv3x3(planes, planes, s2)
            self.bn2 = nn.BatchNorm2d(planes)
            self.conv3 = conv1x1(planes, planes * 4)
            self.bn3 = nn.BatchNorm2d(planes * 4)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = downsample

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            identity = x
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            out += identity
            return self.relu(out)

    class ResNet(nn.Module):
        def __init__(self, block: type, layers: tuple[int, ...], num_classes: int = 1000, in_channels: int = 3,
                     v1: bool = False) -> None:
            super().__init__()
            self.inplanes = 64
            self.v1 = v1
            self.conv1 = nn.Conv2d(in_channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
            self.bn1 = nn.BatchNorm2d(64)
            self.relu = nn.ReLU(inplace=True)
            self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
            self.layer1 = self._make_layer(block, 64, layers[0])
            self.layer2 = self._make_layer(block, 128, layers[1], stride=2)
            self.layer3 = self._make_layer(block, 256, layers[2], stride=2)
            self.layer4 = self._make_layer(block, 512, layers[3], stride=2)
            self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
            self.fc = nn.Linear(512 * block.expansion, num_classes)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

        def _make_layer(self, block: type, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
            downsample = None
            if stride != 1 or self.inplanes != planes * block.expansion:
                downsample = nn.Sequential(conv1x1(self.inplanes, planes * block.expansion, stride),
                                           nn.BatchNorm2d(planes * block.expansion))
            layers = [block(self.inplanes, planes, stride, downsample, v1=self.v1)]
            self.inplanes = planes * block.expansion
            layers += [block(self.inplanes, planes, v1=self.v1) for _ in range(1, blocks)]
            return nn.Sequential(*layers)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
            x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
            x = torch.flatten(self.avgpool(x), 1)
            return self.fc(x)

    return BasicBlock, Bottleneck, ResNet


_RESNET_LAYERS = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}


def _image(numbers: Mapping[str, int]) -> Any:
    import torch

    return torch.randn(numbers["B"], numbers["C"], numbers["Hi"], numbers["Wi"])


def resnet(numbers: Mapping[str, int], options: Mapping[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """torchvision ``resnet{depth}`` (``v1``: stride on the first 1x1 conv)."""
    import torch

    basic, bottleneck, net = _resnet_classes()
    depth = int(options["depth"])
    torch.manual_seed(0)
    model = net(basic if depth < 50 else bottleneck, _RESNET_LAYERS[depth], numbers["K"], numbers["C"],
                bool(options.get("v1", False)))
    return model, (_image(numbers),)


_VGG = {11: (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
        13: (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
        16: (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
        19: (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512,
             "M")}


def _linear(n_in: int, n_out: int) -> Any:
    """``nn.Linear`` filled with zeros: values do not change what autograd keeps, and drawing VGG's 120 M
    random weights would cost seconds per module."""
    import torch
    from torch import nn

    layer = torch.nn.utils.skip_init(nn.Linear, n_in, n_out)
    with torch.no_grad():
        layer.weight.zero_()
        layer.bias.zero_()
    return layer


def vgg(numbers: Mapping[str, int], options: Mapping[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """torchvision ``vgg{depth}`` / ``vgg{depth}_bn``: features, AdaptiveAvgPool2d((7, 7)), classifier."""
    import torch
    from torch import nn

    class VGG(nn.Module):
        def __init__(self, features: nn.Module, num_classes: int, dropout: float) -> None:
            super().__init__()
            self.features = features
            self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
            self.classifier = nn.Sequential(
                _linear(512 * 7 * 7, 4096), nn.ReLU(True), nn.Dropout(p=dropout),
                _linear(4096, 4096), nn.ReLU(True), nn.Dropout(p=dropout),
                _linear(4096, num_classes))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = torch.flatten(self.avgpool(self.features(x)), 1)
            return self.classifier(x)

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    cin = numbers["C"]
    for v in _VGG[int(options["depth"])]:
        if v == "M":
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        assert isinstance(v, int)
        layers.append(nn.Conv2d(cin, v, kernel_size=3, padding=1))
        if options.get("batch_norm"):
            layers.append(nn.BatchNorm2d(v))
        layers.append(nn.ReLU(inplace=True))
        cin = v
    model = VGG(nn.Sequential(*layers), numbers["K"], float(options.get("dropout", 0.5)))
    return model, (_image(numbers),)


def mlp(numbers: Mapping[str, int], options: Mapping[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """Linear - ReLU - Dropout per hidden layer, then Linear (``widths`` or the symbolic H, L, K)."""
    import torch
    from torch import nn

    from ..models.mlp import _widths

    text = str(options.get("widths", "784,1024,1024,10"))
    if text == "symbolic":
        widths = [784] + [numbers["H"]] * (numbers["L"] + 1) + [numbers["K"]]
    else:
        widths = _widths(text)
    p = float(options.get("dropout", 0.0))
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers += [nn.ReLU(), nn.Dropout(p)]
    return nn.Sequential(*layers), (torch.randn(numbers["B"], widths[0]),)


register([f"resnet{d}" for d in _RESNET_LAYERS] + ["resnet50-v1"], resnet)
register([f"vgg{d}{bn}" for d in _VGG for bn in ("", "_bn")], vgg)
register("mlp", mlp)
