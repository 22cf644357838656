"""Every op kind's shape rule against PyTorch's own shape functions, on meta tensors, over generated cases.

For concrete sizes, ``symmem.ops.infer`` and the matching torch call on ``torch.empty(shape, device="meta")``
must agree: the same output shape when PyTorch accepts the case, an error (``OpError`` or ``SymmemError``)
when PyTorch refuses it.  symmem refuses a few cases PyTorch accepts, on purpose, listed in ``REFUSES``:
empty tensors (a size of 0) and shapes the zoo never needs.  Nothing else may raise: a rule that fails with an
``IndexError`` or ``KeyError`` on a schema-valid case is a bug.
"""

from __future__ import annotations

import os

import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symmem import SymmemError, ops
from symmem.tensor import TensorSpec

torch = pytest.importorskip("torch")
F = torch.nn.functional

#: SYMMEM_FUZZ=N runs N cases per kind, at random (a longer hunt than the suite's fixed EXAMPLES, or 40 under -m deep).
HUNT = int(os.environ.get("SYMMEM_FUZZ", "0"))
SETTINGS = settings(max_examples=HUNT or 40, deadline=None, derandomize=not HUNT, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
#: Cases run, counted by the tests (reported by test_every_kind_is_checked).
RUN: dict[str, int] = {}

size = st.integers(1, 6)
small = st.integers(1, 3)


def shape(min_rank: int = 0, max_rank: int = 4, sizes=size):
    return st.lists(sizes, min_size=min_rank, max_size=max_rank).map(tuple)


DEVICE = ["meta"]


def meta(s, dtype=None):
    """A tensor of shape ``s`` on the device being tried (meta, then the CPU: some meta kernels check less)."""
    return torch.zeros(s, device=DEVICE[0], dtype=dtype or torch.float32)


def pair(x):
    return tuple(x) if isinstance(x, tuple | list) else (x, x)


# kind -> (strategy of (input shapes, attrs), torch function of (meta inputs, attrs) -> output tensor)
def _conv_case():
    return st.tuples(shape(3, 5), st.integers(1, 6), st.integers(1, 4), small, st.integers(0, 2), small,
                     st.sampled_from([1, 2, 3])).map(
        lambda t: ([t[0]], dict(out_channels=t[1], kernel=t[2], stride=t[3], padding=t[4], dilation=t[5],
                                groups=t[6])))


def _conv_torch(xs, a):
    x = xs[0]
    g = a.get("groups", 1)
    kh, kw = pair(a["kernel"])
    w = meta((a["out_channels"], x.shape[1] // g if x.shape[1] % g == 0 else x.shape[1], kh, kw))
    return F.conv2d(x, w, None, a.get("stride", 1), a.get("padding", 0), a.get("dilation", 1), g)


def _pool_case(dilation):
    def build(t):
        a = dict(kernel=t[1], stride=t[2], padding=t[3], ceil_mode=t[5])
        if dilation:
            a["dilation"] = t[4]
        return [t[0]], a

    return st.tuples(shape(3, 5, st.integers(1, 9)), st.integers(1, 4), small, st.integers(0, 2), small,
                     st.booleans()).map(build)


def _pool_torch(kind):
    def fn(xs, a):
        k, s, p = a["kernel"], a.get("stride", a["kernel"]), a.get("padding", 0)
        if kind == "maxpool2d":
            return F.max_pool2d(xs[0], k, s, p, a.get("dilation", 1), a.get("ceil_mode", False))
        return F.avg_pool2d(xs[0], k, s, p, a.get("ceil_mode", False))

    return fn


def _broadcast_case():
    return st.tuples(shape(0, 4, st.sampled_from([1, 2, 3])), shape(0, 4, st.sampled_from([1, 2, 3]))).map(
        lambda t: (list(t), {}))


def _slice_case():
    return st.tuples(shape(1, 4), st.integers(-5, 4), st.integers(0, 7), st.integers(1, 9)).map(
        lambda t: ([t[0]], dict(dim=t[1], start=t[2], stop=t[3])))


def _slice_torch(xs, a):
    return torch.ops.aten.slice.Tensor(xs[0], a.get("dim", 0), a.get("start", 0), a.get("stop", None))


def _expand_case():
    return st.tuples(shape(0, 3, st.sampled_from([1, 2, 3])),
                     st.lists(st.sampled_from([-1, 1, 2, 3]), min_size=0, max_size=4).map(tuple)).map(
        lambda t: ([t[0]], dict(shape=t[1])))


def _same_shape():
    return shape(0, 4).map(lambda s: ([s], {}))


def _dim_case(kind_attrs=()):
    return st.tuples(shape(0, 4), st.integers(-5, 4)).map(lambda t: ([t[0]], dict(dim=t[1])))


def _ce_torch(xs, a):
    logits, target = xs
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _attention_torch(xs, a):
    q, k, v = xs
    # symmem's attention repeats key/value heads that differ from the query's (grouped-query attention)
    gqa = min(q.dim(), k.dim(), v.dim()) >= 3 and (q.shape[-3] != k.shape[-3] or q.shape[-3] != v.shape[-3])
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)


def _rope_torch(xs, a):
    return torch.cat([xs[0].float()[..., None]] * a["dim"], dim=-1)


def _patch_torch(xs, a):
    x = xs[0]
    p = a["patch"]
    y = F.conv2d(x, meta((a["dim"], x.shape[1], p, p)), None, p)
    y = y.flatten(2).transpose(1, 2)
    if "tokens" in a and a["tokens"] != y.shape[1]:
        raise RuntimeError("tokens do not match the grid")
    return y


def _flatten_torch(xs, a):
    return torch.flatten(xs[0], a.get("start_dim", 1), a.get("end_dim", -1))


def _mean_torch(xs, a):
    return torch.mean(xs[0], a.get("dim", -1), a.get("keepdim", False))


ELEMENTWISE = ("relu", "relu6", "silu", "tanh", "sigmoid", "exp", "neg", "rsqrt", "sqrt", "rotary", "clone",
               "to_dtype", "gelu", "contiguous", "dropout", "block_input", "identity", "cast", "scalar_add")
CASES = {
    "conv2d": (_conv_case(), _conv_torch),
    "maxpool2d": (_pool_case(True), _pool_torch("maxpool2d")),
    "avgpool2d": (_pool_case(False), _pool_torch("avgpool2d")),
    "adaptive_avgpool2d": (st.tuples(shape(3, 5), st.integers(1, 4)).map(
        lambda t: ([t[0]], dict(output_size=t[1]))), lambda xs, a: F.adaptive_avg_pool2d(xs[0], a["output_size"])),
    "batchnorm": (shape(0, 5).map(lambda s: ([s], {})),
                  lambda xs, a: F.batch_norm(xs[0], None, None, training=True)),
    "layernorm": (shape(0, 4).map(lambda s: ([s], {})),
                  lambda xs, a: F.layer_norm(xs[0], xs[0].shape[-1:])),
    "rmsnorm": (shape(0, 4).map(lambda s: ([s], {})), lambda xs, a: F.rms_norm(xs[0], xs[0].shape[-1:])),
    "softmax": (_dim_case(), lambda xs, a: torch.softmax(xs[0], a["dim"])),
    "log_softmax": (_dim_case(), lambda xs, a: torch.log_softmax(xs[0], a["dim"])),
    "pow": (_same_shape().map(lambda c: (c[0], dict(exponent=2))), lambda xs, a: xs[0].pow(2)),
    "scale": (_same_shape().map(lambda c: (c[0], dict(factor=sympy.Rational(1, 2)))), lambda xs, a: xs[0] * 0.5),
    "add": (_broadcast_case(), lambda xs, a: xs[0] + xs[1]),
    "sub": (_broadcast_case(), lambda xs, a: xs[0] - xs[1]),
    "mul": (_broadcast_case(), lambda xs, a: xs[0] * xs[1]),
    "div": (_broadcast_case(), lambda xs, a: xs[0] / xs[1]),
    "masked_fill": (_broadcast_case(), lambda xs, a: xs[0].masked_fill(xs[1].bool(), 0.0)
                    if torch.broadcast_shapes(xs[0].shape, xs[1].shape) == xs[0].shape else
                    torch.where(xs[1].bool(), xs[0], 0.0)),
    "where": (_broadcast_case(), lambda xs, a: torch.where(xs[1].bool(), xs[0], 0.0)),
    "flatten": (st.tuples(shape(0, 4), st.integers(-4, 3), st.integers(-4, 3)).map(
        lambda t: ([t[0]], dict(start_dim=t[1], end_dim=t[2]))), _flatten_torch),
    "reshape": (st.tuples(shape(0, 3), shape(0, 3)).map(lambda t: ([t[0]], dict(shape=t[1]))),
                lambda xs, a: xs[0].reshape(a["shape"])),
    "transpose": (st.tuples(shape(0, 4), st.integers(-4, 3), st.integers(-4, 3)).map(
        lambda t: ([t[0]], dict(dim0=t[1], dim1=t[2]))), lambda xs, a: xs[0].transpose(a["dim0"], a["dim1"])),
    "permute": (st.tuples(shape(0, 4), st.lists(st.integers(-4, 3), max_size=4).map(tuple)).map(
        lambda t: ([t[0]], dict(dims=t[1]))), lambda xs, a: xs[0].permute(a["dims"])),
    "expand": (_expand_case(), lambda xs, a: xs[0].expand(a["shape"])),
    "slice": (_slice_case(), _slice_torch),
    "select": (st.tuples(shape(0, 4), st.integers(-4, 3), st.integers(-7, 6)).map(
        lambda t: ([t[0]], dict(dim=t[1], index=t[2]))), lambda xs, a: xs[0].select(a["dim"], a["index"])),
    "concat": (st.tuples(st.lists(shape(0, 3, st.sampled_from([1, 2])), min_size=2, max_size=3),
                         st.integers(-3, 2)).map(lambda t: (t[0], dict(dim=t[1]))),
               lambda xs, a: torch.cat(xs, a["dim"])),
    "linear": (st.tuples(shape(0, 3), size, st.one_of(st.none(), size)).map(
        lambda t: ([t[0]], dict(out_features=t[1]) | ({} if t[2] is None else dict(in_features=t[2])))),
               lambda xs, a: F.linear(xs[0], meta((a["out_features"], a.get("in_features", xs[0].shape[-1]))))),
    "matmul": (st.tuples(shape(1, 4, st.sampled_from([1, 2, 3])), shape(1, 4, st.sampled_from([1, 2, 3]))).map(
        lambda t: (list(t), {})), lambda xs, a: torch.matmul(xs[0], xs[1])),
    "attention": (st.tuples(shape(2, 4, st.sampled_from([1, 2, 4])), shape(2, 4, st.sampled_from([1, 2, 4])),
                            shape(2, 4, st.sampled_from([1, 2, 4]))).map(lambda t: (list(t), {})), _attention_torch),
    "embedding": (st.tuples(shape(0, 3), size, size, st.integers(-7, 6)).map(
        lambda t: ([(t[0], "int64")], dict(num_embeddings=t[1], dim=t[2], padding_idx=t[3]))),
        lambda xs, a: F.embedding(xs[0], meta((a["num_embeddings"], a["dim"])), a.get("padding_idx"))),
    "cross_entropy": (st.tuples(shape(0, 3), shape(0, 2)).map(lambda t: ([t[0], (t[1], "int64")], {})), _ce_torch),
    "mean": (st.tuples(shape(0, 4), st.integers(-4, 3), st.booleans()).map(
        lambda t: ([t[0]], dict(dim=t[1], keepdim=t[2]))), _mean_torch),
    "rope_table": (st.tuples(shape(0, 3), size).map(lambda t: ([(t[0], "int64")], dict(dim=t[1]))), _rope_torch),
    "patch_embed": (st.tuples(shape(4, 4, st.integers(1, 9)), st.integers(1, 4), size,
                              st.one_of(st.none(), st.integers(1, 9))).map(
        lambda t: ([t[0]], dict(patch=t[1], dim=t[2]) | ({} if t[3] is None else dict(tokens=t[3])))),
        _patch_torch),
    **{k: (shape(0, 3).map(lambda s: ([], dict(shape=s))), lambda xs, a: meta(a["shape"]))
       for k in ("input", "parameter", "constant", "buffer")},
    **{k: (_same_shape(), lambda xs, a: xs[0].clone()) for k in ELEMENTWISE if k != "cast"},
    "cast": (_same_shape().map(lambda c: (c[0], dict(dtype="float32"))), lambda xs, a: xs[0].float()),
}

#: Cases PyTorch accepts that symmem refuses on purpose, and why.
REFUSES = {
    "empty": "a size of 0 (an empty tensor holds no memory worth a formula)",
    "unbatched": "conv and pool inputs of another rank than (N, C, H, W); batchnorm of a vector",
    "matmul": "1-D operands of matmul (vector products): the zoo multiplies matrices",
    "rank0": "a 0-dim tensor where symmem's rule needs dimensions (flatten, transpose, permute, cat)",
    "attention": "attention operands of rank 2 (no heads dimension)",
}


def _spec(s):
    return TensorSpec(*s) if isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], str) else TensorSpec(s)


def _meta(s):
    if isinstance(s, tuple) and len(s) == 2 and isinstance(s[1], str):
        return meta(s[0], torch.int64)
    return meta(s)


def torch_shape(kind, inputs, attrs):
    """The output shape PyTorch gives on meta tensors, confirmed on small CPU tensors, or the error it raises."""
    out = []
    try:
        for device in ("meta", "cpu"):
            DEVICE[0] = device
            out.append(tuple(CASES[kind][1]([_meta(s) for s in inputs], attrs).shape))
    except (RuntimeError, IndexError, ValueError, TypeError, AssertionError) as exc:
        return exc
    finally:
        DEVICE[0] = "meta"
    assert out[0] == out[1], (kind, inputs, attrs, out)
    return out[0]


def check(kind, case):
    inputs, attrs = case
    RUN[kind] = RUN.get(kind, 0) + 1
    expected = torch_shape(kind, inputs, attrs)
    try:
        got = ops.infer(kind, [_spec(s) for s in inputs], attrs)
    except (ops.OpError, SymmemError) as exc:
        if isinstance(expected, Exception):
            return
        ranks = [len(_spec(s).shape) for s in inputs]
        unbatched = (kind in ("conv2d", "maxpool2d", "avgpool2d", "adaptive_avgpool2d") and ranks[0] != 4) or (
            kind == "batchnorm" and ranks[0] < 2)
        if 0 in expected or unbatched or (kind == "matmul" and 1 in ranks) or (
                kind == "attention" and min(ranks) < 3) or (0 in ranks and kind in (
                "flatten", "transpose", "permute", "concat")):
            return  # REFUSES
        raise AssertionError(f"{kind} {inputs} {attrs}: torch gives {expected}, symmem refuses: {exc}") from None
    if isinstance(expected, Exception):
        # symmem may accept with an assumption it checks with numbers later; with numbers there is none open
        raise AssertionError(f"{kind} {inputs} {attrs}: torch refuses ({expected}), symmem gives "
                             f"{got.out.shape}")
    assert got.out.shape == tuple(sympy.Integer(d) for d in expected), (kind, inputs, attrs, got.out.shape, expected)
    assert not got.assumptions or all(sympy.sympify(a) == sympy.sympify(b) for a, b in got.assumptions)


def hunt(kind: str, examples: int) -> None:
    """``examples`` generated cases of ``kind`` (derandomized: the same ones every run) against PyTorch."""
    @settings(SETTINGS, max_examples=HUNT or examples)
    @given(CASES[kind][0])
    def run(case):
        check(kind, case)

    run()


#: Kinds whose shape rule another kind's runs line for line (the elementwise ones: one rule, PyTorch's answer a clone
#: for each): their cases run under ``-m deep`` only (line coverage of the 40 cases of every kind, stop 42:
#: docs/testing.md, "Stop 42: thinviews42").
DEEP_KINDS = {"constant", "exp", "gelu", "identity", "neg", "relu", "relu6", "rotary", "rsqrt", "sigmoid", "silu",
              "sqrt", "tanh", "to_dtype"}
#: The default suite's examples of a kind: the fewest of 8, 12 and 20 whose cases run every line of symmem and of
#: this file that the kind's 40 run (the rest at 40); ``-m deep`` runs all 40 of every kind.
EXAMPLES: dict[str, int] = {
    **dict.fromkeys(("add", "avgpool2d", "block_input", "buffer", "cast", "clone", "contiguous", "cross_entropy", "div",
                     "dropout", "embedding", "input", "layernorm", "log_softmax", "masked_fill", "maxpool2d", "mul",
                     "parameter", "pow", "reshape", "rmsnorm", "rope_table", "scalar_add", "scale", "slice", "softmax",
                     "sub", "transpose"), 8),
    "mean": 12, "patch_embed": 12,
    **dict.fromkeys(("batchnorm", "concat", "conv2d", "linear", "select", "where"), 20),
}


@pytest.mark.parametrize("kind", sorted(set(CASES) - DEEP_KINDS))
def test_shape_rule_agrees_with_torch(kind):
    hunt(kind, EXAMPLES.get(kind, 40))


@pytest.mark.deep
@pytest.mark.parametrize("kind", sorted(k for k in CASES if k in DEEP_KINDS or EXAMPLES.get(k, 40) < 40))
def test_shape_rule_agrees_with_torch_over_40_cases(kind):
    """The 40 cases of every kind the default suite runs fewer of (:data:`EXAMPLES`) or none of (:data:`DEEP_KINDS`)."""
    hunt(kind, 40)


def test_every_kind_is_checked():
    assert set(ops.kinds()) == set(CASES), set(ops.kinds()) ^ set(CASES)
