"""One table row per op kind the vision models use: a one-op graph under the ``pytorch`` convention against
the same op measured in PyTorch on CPU (:func:`symmem.record.verify.measure`), at two batch sizes.

The graph's input stands for the op's input activation; in torch it is a leaf that requires grad, so both
sides report it under ``input`` and the op's own tensors (indices, masks, statistics, outputs) under
``activations``.  Ops that are in place get a batch norm or a multiply in front, as in the models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from symmem import derive, ops  # noqa: E402
from symmem.graph import GraphBuilder, Model  # noqa: E402
from symmem.record.verify import compare, measure  # noqa: E402
from symmem.symbols import B, C, Hi, Wi  # noqa: E402

IMG = (B, C, Hi, Wi)
DEFAULTS = {C: 3, Hi: 9, Wi: 8}


def _one(*ops: tuple[str, dict[str, Any]], shape=IMG, dtype: str = "act") -> Callable[[], Model]:
    """A graph: input -> op -> op ..."""

    def build() -> Model:
        g = GraphBuilder("op")
        x = g.input("x", shape, dtype=dtype)
        for kind, attrs in ops:
            x = g.op(kind, x, **attrs)
        return Model("op", g.finish(), DEFAULTS, (B,))

    return build


class Fn(nn.Module):
    def __init__(self, fn: Callable[..., Any], *mods: nn.Module) -> None:
        super().__init__()
        self.fn, self.mods = fn, nn.ModuleList(mods)

    def forward(self, x):
        return self.fn(x, *self.mods)


def _loss_graph() -> Model:
    g = GraphBuilder("ce")
    x = g.input("x", (B, 7))
    t = g.input("t", (B,), dtype="int64")
    g.op("cross_entropy", x, t, name="loss")
    return Model("ce", g.finish(), DEFAULTS, (B,))


class CE(nn.Module):
    def forward(self, x, t):
        return nn.functional.cross_entropy(x, t)


F = nn.functional
# id, graph builder, torch module factory, input shape at B (None: image), device
CASES = [
    ("conv2d", _one(("conv2d", {"out_channels": 4, "kernel": 3, "padding": 1, "bias": False})),
     lambda: nn.Conv2d(3, 4, 3, padding=1, bias=False)),
    ("conv2d-stride2-bias", _one(("conv2d", {"out_channels": 5, "kernel": 3, "stride": 2})),
     lambda: nn.Conv2d(3, 5, 3, stride=2)),
    ("batchnorm", _one(("batchnorm", {})), lambda: nn.BatchNorm2d(3)),
    ("relu", _one(("relu", {})), lambda: nn.ReLU()),
    ("batchnorm-relu_", _one(("batchnorm", {}), ("relu", {"inplace": True})),
     lambda: nn.Sequential(nn.BatchNorm2d(3), nn.ReLU(inplace=True))),
    ("relu6", _one(("relu6", {})), lambda: nn.ReLU6()),
    ("batchnorm-relu6_", _one(("batchnorm", {}), ("relu6", {"inplace": True})),
     lambda: nn.Sequential(nn.BatchNorm2d(3), nn.ReLU6(inplace=True))),
    ("maxpool2d", _one(("maxpool2d", {"kernel": 3, "stride": 2, "padding": 1})),
     lambda: nn.MaxPool2d(3, 2, 1)),
    ("maxpool2d-2x2", _one(("maxpool2d", {"kernel": 2, "stride": 2})), lambda: nn.MaxPool2d(2, 2)),
    ("avgpool2d", _one(("avgpool2d", {"kernel": 2})), lambda: nn.AvgPool2d(2)),
    ("adaptive_avgpool2d-1", _one(("adaptive_avgpool2d", {"output_size": 1})), lambda: nn.AdaptiveAvgPool2d(1)),
    ("adaptive_avgpool2d-7", _one(("adaptive_avgpool2d", {"output_size": 7})), lambda: nn.AdaptiveAvgPool2d(7)),
    ("relu-flatten-linear", _one(("relu", {}), ("flatten", {"start_dim": 1}), ("linear", {"out_features": 5})),
     lambda: nn.Sequential(nn.ReLU(), nn.Flatten(), nn.Linear(3 * 9 * 8, 5))),
    ("adaptive7-flatten-linear", _one(("adaptive_avgpool2d", {"output_size": 7}), ("flatten", {"start_dim": 1}),
                                      ("linear", {"out_features": 5})),
     lambda: nn.Sequential(nn.AdaptiveAvgPool2d(7), nn.Flatten(), nn.Linear(3 * 49, 5))),
    ("linear", _one(("linear", {"out_features": 6}), shape=(B, 10)), lambda: nn.Linear(10, 6)),
    ("dropout", _one(("dropout", {"p": 0.5})), lambda: nn.Dropout(0.5)),
    ("dropout-p0", _one(("dropout", {"p": 0.0})), lambda: nn.Dropout(0.0)),
    ("dropout-p1", _one(("dropout", {"p": 1.0})), lambda: nn.Dropout(1.0)),
    ("relu-dropout-linear", _one(("relu", {}), ("dropout", {"p": 0.3}), ("linear", {"out_features": 4}),
                                 shape=(B, 10)),
     lambda: nn.Sequential(nn.ReLU(), nn.Dropout(0.3), nn.Linear(10, 4))),
    ("add-inplace-relu", _one(("batchnorm", {}), ("relu", {"inplace": True})),
     lambda: Fn(lambda x, bn: F.relu(bn(x).add_(1.0), inplace=True), nn.BatchNorm2d(3))),
    ("cross_entropy", _loss_graph, CE),
]


def _inputs(model: Model, b: int) -> tuple[Any, ...]:
    g = model.graph
    out = []
    for node in g.nodes_in_order():
        if node.kind != "input":
            continue
        spec = node.out
        shape = tuple(int(d.xreplace({B: b, **DEFAULTS})) for d in spec.shape)
        if spec.dtype == "int64":
            out.append(torch.randint(0, 7, shape))
        else:
            out.append(torch.randn(shape, requires_grad=True))
    return tuple(out)


@pytest.mark.filterwarnings("ignore::symmem.errors.NothingCounted")  # ops and stand-ins that keep nothing
@pytest.mark.parametrize("case, graph, module", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("b", [2, 3])
def test_op_formula_equals_measured(case, graph, module, b):
    model = graph()
    d = derive(model, convention="pytorch", options={"device": "cpu"}, values={"B": b})
    c = compare(d, measure(module(), *_inputs(model, b)))
    assert c.exact, c.report()


def test_every_vision_kind_has_a_case():
    used = {node.kind for _, graph, _ in CASES for node in graph().graph.nodes_in_order()}
    vision = {"conv2d", "batchnorm", "relu", "relu6", "maxpool2d", "avgpool2d", "adaptive_avgpool2d", "flatten",
              "linear", "dropout", "cross_entropy"}
    with_rule = {k for k in ops.kinds() if not isinstance(ops.entry(k).saves, ops.Unsupported)}
    assert vision <= used and vision <= with_rule


# Device differences, from the kernels (no CUDA here to measure): bytes of one op's own tensors at B=2.
@pytest.mark.filterwarnings("ignore::symmem.errors.NothingCounted")  # ops and stand-ins that keep nothing
@pytest.mark.parametrize("case, device, own", [
    ("dropout", "cpu", 2 * 3 * 9 * 8 * 4),   # float32 noise
    ("dropout", "cuda", 2 * 3 * 9 * 8 * 1),  # bool mask of native_dropout
    ("dropout-p0", "cuda", 0),
    ("batchnorm", "cuda", 2 * 3 * 4),        # save_mean, save_invstd; the cuDNN reserve is empty (NCHW)
    ("maxpool2d", "cuda", 2 * 3 * 5 * 4 * 8),  # int64 indices
    ("relu", "cuda", 2 * 3 * 9 * 8 * 4),
])
def test_device_table(case, device, own):
    graph = next(c[1] for c in CASES if c[0] == case)
    d = derive(graph(), convention="pytorch", options={"device": device}, values={"B": 2})
    assert d.value("activations") == own
