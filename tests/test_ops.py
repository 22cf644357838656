"""One row per op kind: input shapes and attributes -> output shape, parameter count, view or new storage.

The oracles are PyTorch's own shape formulas (e.g. a 7x7/2 conv with padding 3 takes 224 to 112) and
parameter counts of the equivalent nn modules.
"""

from __future__ import annotations

import pytest
import sympy

from symmem import ops
from symmem.symbols import B, C, F, H, Hi, S, V, Wi, h
from symmem.tensor import TensorSpec


def T(*shape, dtype="act"):
    return TensorSpec(shape, dtype)


CASES = [
    # kind, inputs, attrs, output shape, parameter elements, view
    ("conv2d", [T(B, 3, 224, 224)], dict(out_channels=64, kernel=7, stride=2, padding=3, bias=False),
     (B, 64, 112, 112), 9408, False),
    ("conv2d", [T(B, 64, 56, 56)], dict(out_channels=64, kernel=3, padding=1, groups=64),
     (B, 64, 56, 56), 64 * 9 + 64, False),
    ("conv2d", [T(B, C, Hi, Wi)], dict(out_channels=H, kernel=16, stride=16),
     (B, H, sympy.floor(Hi / 16), sympy.floor(Wi / 16)), H * C * 256 + H, False),
    ("conv2d", [T(B, 8, 10, 10)], dict(out_channels=8, kernel=3, dilation=2), (B, 8, 6, 6), 8 * 8 * 9 + 8, False),
    ("batchnorm", [T(B, 64, 56, 56)], {}, (B, 64, 56, 56), 128, False),
    ("relu", [T(B, 64)], {}, (B, 64), 0, False),
    ("relu", [T(B, 64)], dict(inplace=True), (B, 64), 0, True),
    ("relu6", [T(B, 64)], {}, (B, 64), 0, False),
    ("maxpool2d", [T(B, 64, 112, 112)], dict(kernel=3, stride=2, padding=1), (B, 64, 56, 56), 0, False),
    ("maxpool2d", [T(B, 64, 7, 7)], dict(kernel=2, stride=2, ceil_mode=True), (B, 64, 4, 4), 0, False),
    ("avgpool2d", [T(B, 64, 8, 8)], dict(kernel=2), (B, 64, 4, 4), 0, False),
    ("adaptive_avgpool2d", [T(B, 2048, 7, 7)], dict(output_size=1), (B, 2048, 1, 1), 0, False),
    ("flatten", [T(B, 2048, 1, 1)], dict(start_dim=1), (B, 2048), 0, True),
    ("reshape", [T(B, S, 3 * H)], dict(shape=(B, S, 3, h, H / h)), (B, S, 3, h, H / h), 0, True),
    ("reshape", [T(B, h, S, H / h)], dict(shape=(B, S, H), copy=True), (B, S, H), 0, False),
    ("reshape", [TensorSpec((B, S, h, H / h), strides=(S * H, H / h, S * H / h, 1))], dict(shape=(B, S, H)),
     (B, S, H), 0, False),
    ("transpose", [T(B, S, h, 64)], dict(dim0=1, dim1=2), (B, h, S, 64), 0, True),
    ("permute", [T(B, S, 3, h, 64)], dict(dims=(2, 0, 3, 1, 4)), (3, B, h, S, 64), 0, True),
    ("select", [T(3, B, h, S, 64)], dict(dim=0, index=1), (B, h, S, 64), 0, True),
    ("slice", [T(B, S, H)], dict(dim=2, start=0, stop=H / 2), (B, S, H / 2), 0, True),
    ("expand", [T(1, 1, H)], dict(shape=(B, 1, H)), (B, 1, H), 0, True),
    # contiguous() returns a contiguous input itself; a transposed one is copied (the strides decide)
    ("contiguous", [T(B, S, H)], {}, (B, S, H), 0, True),
    ("contiguous", [TensorSpec((B, h, S, H / h), strides=(S * H, H / h, H, 1))], {}, (B, h, S, H / h), 0, False),
    ("linear", [T(B, S, H)], dict(out_features=F), (B, S, F), H * F + F, False),
    ("linear", [T(B, S, H)], dict(out_features=V, bias=False, tied=True), (B, S, V), 0, False),
    ("layernorm", [T(B, S, H)], {}, (B, S, H), 2 * H, False),
    ("rmsnorm", [T(B, S, H)], {}, (B, S, H), H, False),
    ("gelu", [T(B, S, F)], {}, (B, S, F), 0, False),
    ("silu", [T(B, S, F)], {}, (B, S, F), 0, False),
    ("softmax", [T(B, h, S, S)], dict(dim=-1), (B, h, S, S), 0, False),
    ("dropout", [T(B, S, H)], dict(p=0.1), (B, S, H), 0, False),
    ("dropout", [T(B, S, H)], dict(p=0.0), (B, S, H), 0, True),
    ("matmul", [T(B, h, S, 64), T(B, h, 64, S)], {}, (B, h, S, S), 0, False),
    ("attention", [T(B, h, S, 64), T(B, h, S, 64), T(B, h, S, 64)], {}, (B, h, S, 64), 0, False),
    ("add", [T(B, S, H), T(1, S, H)], {}, (B, S, H), 0, False),
    ("mul", [T(B, S, F), T(B, S, F)], {}, (B, S, F), 0, False),
    ("scale", [T(B, h, S, 64)], dict(factor=sympy.Rational(1, 8)), (B, h, S, 64), 0, False),
    ("embedding", [T(B, S, dtype="int64")], dict(num_embeddings=V, dim=H), (B, S, H), V * H, False),
    ("patch_embed", [T(B, 3, 224, 224)], dict(patch=16, dim=768), (B, 196, 768), 768 * 3 * 256 + 768, False),
    ("concat", [T(B, 1, H), T(B, S - 1, H)], dict(dim=1), (B, S, H), 0, False),
    ("cross_entropy", [T(B, 1000), T(B, dtype="int64")], {}, (), 0, False),
    ("parameter", [], dict(shape=(1, S, H)), (1, S, H), S * H, False),
    ("input", [], dict(shape=(B, C, Hi, Wi)), (B, C, Hi, Wi), 0, False),
    ("constant", [], dict(shape=(1, S), dtype="int64"), (1, S), 0, False),
    ("buffer", [], dict(shape=(1, 1, 1024, 1024), dtype="bool"), (1, 1, 1024, 1024), 0, False),
    ("scalar_add", [T(B, S, 1)], dict(value=1e-6), (B, S, 1), 0, False),
    ("cast", [T(B, S, H)], dict(dtype="float32"), (B, S, H), 0, True),
    ("mean", [T(B, S, H)], dict(dim=-1, keepdim=True), (B, S, 1), 0, False),
    ("mean", [T(B, S, H)], dict(dim=1), (B, H), 0, False),
    ("rope_table", [T(1, S, dtype="int64")], dict(dim=H / h), (1, S, H / h), 0, False),
    # elementwise kinds: same shape, a new tensor (a view when in place)
    ("tanh", [T(B, H)], {}, (B, H), 0, False),
    ("sigmoid", [T(B, S, H)], dict(inplace=True), (B, S, H), 0, True),
    ("exp", [T(B, h, S, S)], {}, (B, h, S, S), 0, False),
    ("neg", [T(B, S, H / 2)], {}, (B, S, H / 2), 0, False),
    ("rsqrt", [T(B, S, 1)], {}, (B, S, 1), 0, False),
    ("sqrt", [T(1)], {}, (1,), 0, False),
    ("pow", [T(B, S, F)], dict(exponent=3), (B, S, F), 0, False),
    ("clone", [T(B, S, H)], {}, (B, S, H), 0, False),
    ("to_dtype", [T(B, S, H)], dict(dtype="bfloat16"), (B, S, H), 0, False),
    ("rotary", [T(B, h, S, 64)], {}, (B, h, S, 64), 0, False),
    ("log_softmax", [T(B, S, V)], dict(dim=-1, dtype="float32"), (B, S, V), 0, False),
    ("log_softmax", [T()], dict(dim=0), (), 0, False),  # a 0-dim tensor takes dim 0 or -1, as in PyTorch
    # binary kinds: broadcast
    ("sub", [T(B, S, H), T(H)], {}, (B, S, H), 0, False),
    ("div", [T(B, h, S, S), T()], {}, (B, h, S, S), 0, False),
    ("div", [T(B, S, H), T(B, S, 1)], dict(inplace=True), (B, S, H), 0, True),
    ("masked_fill", [T(B, h, S, S), T(1, 1, S, S, dtype="bool")], {}, (B, h, S, S), 0, False),
    ("where", [T(B, h, S, S), T(1, 1, S, S, dtype="bool")], {}, (B, h, S, S), 0, False),
    # aliases: the same storage
    ("block_input", [T(B, S, H)], {}, (B, S, H), 0, True),
    ("identity", [T(B, H)], {}, (B, H), 0, True),
    # PyTorch's rules where they differ from the obvious formula
    ("maxpool2d", [T(B, 1, 5, 5)], dict(kernel=2, stride=2, padding=1, ceil_mode=True), (B, 1, 3, 3), 0, False),
    ("maxpool2d", [T(B, 1, 10, 10)], dict(kernel=3, stride=1, dilation=2), (B, 1, 6, 6), 0, False),
    ("avgpool2d", [T(B, 3, 2, 2)], dict(kernel=1, stride=2, ceil_mode=True), (B, 3, 1, 1), 0, False),
    ("slice", [T(B, 1024)], dict(dim=1, start=0, stop=2000), (B, 1024), 0, True),  # clamped to the size
    ("select", [T(B, 3, H)], dict(dim=1, index=-1), (B, H), 0, True),
    ("expand", [T(1, 3, 1)], dict(shape=(B, -1, H)), (B, 3, H), 0, True),
    ("expand", [T(3, 1)], dict(shape=(2, 3, 4)), (2, 3, 4), 0, True),
    ("attention", [T(1, h, S, 64), T(B, 1, S, 64), T(B, 1, S, 32)], {}, (B, h, S, 32), 0, False),
    ("flatten", [T(B, 3, 4, 5)], dict(start_dim=1, end_dim=2), (B, 12, 5), 0, True),
    ("concat", [T(B, 2, H), T(B, 3, H), T(B, 1, H)], dict(dim=-2), (B, 6, H), 0, False),
]


@pytest.mark.parametrize("kind, inputs, attrs, shape, n_params, view", CASES, ids=[c[0] for c in CASES])
def test_rule(kind, inputs, attrs, shape, n_params, view):
    info = ops.infer(kind, inputs, attrs)
    assert info.out.shape == tuple(sympy.sympify(d) for d in shape)
    total = sympy.Add(*(sympy.Mul(*s) for s in info.params.values()))
    assert sympy.expand(total - n_params) == 0
    assert (info.view_of is not None) == view


def test_every_kind_has_a_row():
    assert set(ops.kinds()) <= {c[0] for c in CASES}


@pytest.mark.parametrize("kind, inputs, attrs, fragment", [
    ("maxpool2d", [T(B, 1, 5, 5)], dict(kernel=2, padding=2), "more than half the kernel"),
    ("select", [T(B, 3)], dict(dim=1, index=3), "out of range"),
    ("select", [T(B, 3)], dict(dim=1, index=-4), "out of range"),
    ("expand", [T(B, 3)], dict(shape=(B, 4)), "is not 1"),
    ("expand", [T(3)], dict(shape=(-1, 3)), "-1 is not allowed"),
    ("slice", [T(B, 4)], dict(dim=1, start=4), "empty slice"),
    ("cross_entropy", [T(), T(dtype="int64")], {}, "class dimension"),
    ("embedding", [T(B, dtype="int64")], dict(num_embeddings=5, dim=4, padding_idx=5), "out of range"),
    ("batchnorm", [T(1, 8, 1, 1)], {}, "more than one value per channel"),
])
def test_rule_refuses_what_pytorch_refuses(kind, inputs, attrs, fragment):
    with pytest.raises(ops.OpError, match=fragment):
        ops.infer(kind, inputs, attrs)
