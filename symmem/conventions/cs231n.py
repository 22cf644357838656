"""The ``cs231n`` convention: the accounting of CS231n's "Computational Considerations" and its VGGNet case study
(https://cs231n.github.io/convolutional-networks/).

Activations are every layer's output volume plus the input: the output of each CONV layer (its ReLU works in
place, so a CONV/RELU pair is one volume), POOL layer and FC layer, and of normalization and embedding layers
in other networks.  Their sum is the forward figure the course's table adds up (``values.activations``).  The
course doubles it "for the backward pass" (the gradients of the activations): that is the separate
``transient`` term ``backward``.  Its "parameters x3" (weights, gradients, one optimizer cache such as
momentum) is the regime ``fp32`` + ``sgd-momentum``.

torchvision's VGG has an adaptive average pool to 7x7 before the classifier that CS231n's VGGNet does not
have (at 224x224 it maps 7x7 to 7x7); it is not counted, and neither are dropout outputs, which the course
does not list as layers.

>>> from symmem import derive
>>> d = derive("vgg16", convention="cs231n", optimizer="sgd-momentum", values={"B": 1})
>>> d.value("activations") // 4, d.value("parameters")
(15237608, 138357544)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy

from ..derivation import FORWARD_END, Storage
from . import Convention, Saved, register

if TYPE_CHECKING:
    from ..graph import Graph, Node

#: Op kinds that are a "layer" whose output volume CS231n counts.
LAYER_KINDS = frozenset({"conv2d", "linear", "maxpool2d", "avgpool2d", "batchnorm", "layernorm", "embedding",
                         "patch_embed"})


@dataclass(frozen=True)
class CS231n(Convention):
    name: str = "cs231n"
    description: str = (
        "The CS231n memory rule (Karpathy's course notes): every layer's output volume (CONV/RELU, POOL, FC) "
        "plus the input, counted once each; x2 for the backward pass as its own term")
    dedup: bool = False
    options: Mapping[str, Any] = None  # type: ignore[assignment]
    blind_to: Mapping[str, str] = field(default_factory=lambda: {
        "dropout": "it counts layer outputs, and a dropout is no layer in its table",
        "cache": "it counts layer outputs, and the key/value cache copies are none",
        "gelu": "it counts layer outputs, and an activation works in place in its rule",
        "attention": "it counts layer outputs, and attention's internals are none",
        "loss": "it counts layer outputs, and the loss is none"})

    def __post_init__(self) -> None:
        if self.options is None:
            object.__setattr__(self, "options", {})

    def saved(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> list[Saved]:
        if node.kind == "input" and node.role == "input":
            return [Saved("new", label="volume", spec=node.out.with_(role="input"), role="input")]
        if node.kind in LAYER_KINDS:
            return [Saved("output", role=node.role or node.kind)]
        return []

    def extra_storages(self, storages: list[Storage], options: Mapping[str, Any]) -> list[Storage]:
        # Code beyond the data: the course's x2 for the backward pass, alive while backward runs.
        forward = sympy.Add(*(x.expr for x in storages if x.category == "activation"))
        if forward == 0:
            return []
        return [Storage("backward", "backward", "transient", forward, "activation_gradients",
                        born=FORWARD_END, dies="step")]

    def finds_nothing(self, graph: Graph) -> str | None:
        if any(graph.node(n).kind in LAYER_KINDS for n in graph.order()):
            return None
        return ("the cs231n convention counts the outputs of layers (conv, pool, fc, norm, embedding) and this "
                "graph has none")


register("cs231n", CS231n())
