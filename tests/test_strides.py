"""Strides on TensorSpec and the storage decisions taken from them (symmem/strides.py), against real PyTorch.

Oracle: PyTorch on the CPU.  Each case is a chain of ops from a contiguous tensor, written once as data and run
twice: through :class:`~symmem.graph.GraphBuilder` and on real tensors.  What is compared:

* the strides of every tensor of the chain (``y.stride()``);
* whether the last op (``reshape``, ``flatten``, ``contiguous``) is a view -- it shares its input's storage
  (``untyped_storage().data_ptr()``) -- or a copy;
* for ``matmul``, whether autograd keeps each operand's own storage or a copy, and for
  ``scaled_dot_product_attention`` the memory order of the output (CPU flash) and whether the math kernel keeps
  ``v`` or a copy.

Concrete sizes, size-1 dimensions included, give exact decisions.  The same chains built with symbols are
evaluated at generic sizes (every size at least 2, no two equal) and, where a decision depends on a unit size
(G = 1, G = h), at those sizes too: a condition must hold exactly where PyTorch copies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import sympy

torch = pytest.importorskip("torch")
F = torch.nn.functional

from symmem.conditions import is_condition  # noqa: E402
from symmem.graph import GraphBuilder  # noqa: E402
from symmem.strides import of as strides_of  # noqa: E402
from symmem.symbols import B, G, H, S, h  # noqa: E402
from symmem.tensor import TensorSpec  # noqa: E402

d = H / h
Q = sympy.Symbol("Q", positive=True, integer=True)  # a free size that no unit size involves


def _torch_op(t: Any, kind: str, a: dict[str, Any]) -> Any:
    """One op of a chain on a real tensor (sizes already numbers)."""
    if kind == "transpose":
        return t.transpose(a["dim0"], a["dim1"])
    if kind == "permute":
        return t.permute(*a["dims"])
    if kind == "expand":
        return t.expand(*a["shape"])
    if kind == "select":
        return t.select(a["dim"], a.get("index", 0))
    if kind == "slice":
        return t.narrow(a["dim"], a.get("start", 0), a["stop"] - a.get("start", 0))
    if kind == "reshape":
        return t.reshape(*a["shape"])
    if kind == "flatten":
        return t.flatten(a.get("start_dim", 1), a.get("end_dim", -1))
    if kind == "contiguous":
        return t.contiguous()
    if kind == "relu":
        return torch.relu(t)
    if kind == "gelu":
        return F.gelu(t)
    if kind == "pow":
        return t.pow(a["exponent"])
    if kind == "scale":
        return t * a["factor"]
    if kind == "scalar_add":
        return t + a["value"]
    if kind == "clone":
        contiguous = a.get("memory_format") == "contiguous"
        return t.clone(memory_format=torch.contiguous_format if contiguous else torch.preserve_format)
    if kind == "to_dtype":
        return t.to(torch.float64)
    if kind == "softmax":
        return t.softmax(a["dim"])
    if kind == "dropout":
        return F.dropout(t, a["p"])
    raise AssertionError(kind)


def _numbers(value: Any, at: dict[sympy.Symbol, int]) -> Any:
    if isinstance(value, dict):
        return {k: _numbers(v, at) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_numbers(v, at) for v in value)
    if isinstance(value, sympy.Basic):
        return int(value.xreplace(at)) if value.is_integer or value.xreplace(at).is_integer else value
    return value


def _strides(spec: TensorSpec, at: dict[sympy.Symbol, int]) -> tuple[int, ...]:
    # Piecewise strides (a reshape that copies unless G = 1) take their value at the numbers
    return tuple(int(sympy.sympify(s).xreplace(at)) for s in strides_of(spec.shape, spec.strides))


def _holds(flag: Any, at: dict[sympy.Symbol, int]) -> bool:
    return bool(flag.xreplace(at)) if is_condition(flag) else bool(flag)


Chain = list[tuple[str, dict[str, Any]]]


def _run_chain(shape: tuple[Any, ...], chain: Chain, at: dict[sympy.Symbol, int], symbolic: bool,
               grad: bool = False) -> tuple[GraphBuilder, list[str], list[Any]]:
    """The chain in a graph (sizes as symbols, or as the numbers ``at``) and on a real tensor (a leaf that
    requires grad with ``grad``)."""
    g = GraphBuilder("chain")
    names = [g.input("x", shape if symbolic else _numbers(shape, at))]
    tensors = [torch.zeros(*_numbers(shape, at), requires_grad=grad)]
    for kind, attrs in chain:
        names.append(g.op(kind, names[-1], **(attrs if symbolic else _numbers(attrs, at))))
        tensors.append(_torch_op(tensors[-1], kind, _numbers(attrs, at)))
    return g, names, tensors


# (label, input shape, chain; the last op is the decision checked)
VIEWS: list[tuple[str, tuple[Any, ...], Chain]] = [
    ("matmul's fold of a head split", (B, S, H),
     [("reshape", dict(shape=(B, S, h, d))), ("transpose", dict(dim0=1, dim1=2)),
      ("reshape", dict(shape=(B * h, S, d)))]),
    ("head merge of a transposed output", (B, h, S, d),
     [("transpose", dict(dim0=1, dim1=2)), ("reshape", dict(shape=(B, S, H)))]),
    ("head merge by contiguous()", (B, h, S, d),
     [("permute", dict(dims=(0, 2, 1, 3))), ("contiguous", {})]),
    ("contiguous() of a contiguous tensor", (B, S, H), [("contiguous", {})]),
    ("q of a packed qkv, folded", (B, S, 3 * H),
     [("reshape", dict(shape=(B, S, 3, h, d))), ("permute", dict(dims=(2, 0, 3, 1, 4))),
      ("select", dict(dim=0, index=0)), ("reshape", dict(shape=(B * h, S, d)))]),
    ("k^T of a packed qkv, folded", (B, S, 3 * H),
     [("reshape", dict(shape=(B, S, 3, h, d))), ("permute", dict(dims=(2, 0, 3, 1, 4))),
      ("select", dict(dim=0, index=1)), ("transpose", dict(dim0=-2, dim1=-1)), ("reshape", dict(shape=(B * h, d, S)))]),
    ("transposed twice", (B, S, H),
     [("reshape", dict(shape=(B, S, h, d))), ("transpose", dict(dim0=1, dim1=2)), ("transpose", dict(dim0=1, dim1=2)),
      ("reshape", dict(shape=(B, S, H)))]),
    ("k^T of a contiguous key, folded", (B, h, S, d),
     [("transpose", dict(dim0=-2, dim1=-1)), ("reshape", dict(shape=(B * h, d, S)))]),
    ("a slice of the hidden size, split into heads", (B, S, 3 * H),
     [("slice", dict(dim=2, start=H, stop=2 * H)), ("reshape", dict(shape=(B, S, h, d)))]),
    ("a slice of the sequence, flattened", (B, S, Q),
     [("slice", dict(dim=1, start=0, stop=S - 1)), ("reshape", dict(shape=(B * (S - 1), Q)))]),
    ("a slice of the sequence, contiguous()", (B, S, Q),
     [("slice", dict(dim=1, start=1, stop=S)), ("contiguous", {})]),
    ("an expanded row, flattened", (1, S),
     [("expand", dict(shape=(B, S))), ("reshape", dict(shape=(B * S,)))]),
    ("an expanded row in front, flattened", (S, Q),
     [("expand", dict(shape=(B, S, Q))), ("flatten", dict(start_dim=0, end_dim=1))]),
    ("channels last, flattened", (B, Q, S, S),
     [("permute", dict(dims=(0, 2, 3, 1))), ("flatten", dict(start_dim=1))]),
    ("a transpose flattened where it stays in order", (B, S, Q),
     [("transpose", dict(dim0=0, dim1=1)), ("flatten", dict(start_dim=1))]),
    ("a size-1 dimension added and merged", (B, S, H),
     [("reshape", dict(shape=(B, 1, S, H))), ("transpose", dict(dim0=0, dim1=1)),
      ("reshape", dict(shape=(B * S, H)))]),
    ("repeat_kv (HF Llama)", (B, S, G * d),
     [("reshape", dict(shape=(B, S, G, d))), ("transpose", dict(dim0=1, dim1=2)),
      ("reshape", dict(shape=(B, G, 1, S, d))), ("expand", dict(shape=(B, G, h / G, S, d))),
      ("reshape", dict(shape=(B, h, S, d)))]),
    ("repeat_kv of a contiguous key, folded for bmm", (B, G, S, d),
     [("reshape", dict(shape=(B, G, 1, S, d))), ("expand", dict(shape=(B, G, h / G, S, d))),
      ("reshape", dict(shape=(B, h, S, d))), ("transpose", dict(dim0=2, dim1=3)),
      ("reshape", dict(shape=(B * h, d, S)))]),
]

#: generic sizes: at least 2, pairwise different (h/G = 2, d = 4)
GENERIC = {B: 3, S: 7, H: 40, h: 10, G: 5, Q: 6}
#: size-1 dimensions, one or several at a time, and the unit sizes G = 1 (multi-query) and G = h (multi-head)
ONES = [{B: 1, S: 7, H: 40, h: 10, G: 5, Q: 6}, {B: 3, S: 1, H: 40, h: 10, G: 5, Q: 1},
        {B: 3, S: 7, H: 10, h: 10, G: 5, Q: 6}, {B: 3, S: 7, H: 4, h: 1, G: 1, Q: 6},
        {B: 1, S: 1, H: 1, h: 1, G: 1, Q: 1}, {B: 3, S: 2, H: 40, h: 10, G: 1, Q: 6},
        {B: 3, S: 7, H: 40, h: 10, G: 10, Q: 6}, {B: 2, S: 5, H: 8, h: 2, G: 2, Q: 3}]
UNITS = [{**GENERIC, G: 1}, {**GENERIC, G: 10}]


def _builds(at: dict[sympy.Symbol, int]) -> tuple[bool, ...]:
    """How to build a case checked at ``at``: with numbers always; with symbols where the sizes are generic or
    unit sizes (symbols take every other size to be at least 2: B = 1 is decided with numbers only)."""
    return (False, True) if at == GENERIC or at in UNITS else (False,)


def _view(label: str) -> Chain:
    return next(chain for name, _, chain in VIEWS if name == label)


def _fits(shape: tuple[Any, ...], chain: Chain, at: dict[sympy.Symbol, int]) -> bool:
    """Whether the sizes ``at`` make the chain valid (no empty slice, heads that divide)."""
    if at[H] % at[h] or at[h] % at[G]:
        return False
    sizes = [*_numbers(shape, at)]
    for _, attrs in chain:
        for key in ("shape", "stop"):
            if key in attrs:
                value = _numbers(attrs[key], at)
                sizes += list(value) if isinstance(value, tuple) else [value - _numbers(attrs.get("start", 0), at)]
    return min(sizes) >= 1


def _check(g: GraphBuilder, names: list[str], tensors: list[Any], at: dict[sympy.Symbol, int], label: str) -> None:
    for name, t in zip(names, tensors, strict=True):
        assert _strides(g.spec(name), at) == t.stride(), (label, name, at)
    node = g.graph.node(names[-1])
    view = tensors[-1].untyped_storage().data_ptr() == tensors[-2].untyped_storage().data_ptr()
    copy = node.facts["copy"]
    assert _holds(copy, at) is not view, (label, copy, at)
    assert (node.view_of is None) is (copy is True)


@pytest.mark.parametrize("at", [GENERIC, *ONES], ids=lambda at: ",".join(f"{k}={v}" for k, v in at.items()))
@pytest.mark.parametrize("label, shape, chain", VIEWS, ids=[v[0] for v in VIEWS])
def test_views_with_numbers(label, shape, chain, at):
    """Built with numbers, every decision is exact: size-1 dimensions included."""
    if not _fits(shape, chain, at):
        pytest.skip("sizes the chain does not take (an empty slice, heads that do not divide)")
    g, names, tensors = _run_chain(shape, chain, at, symbolic=False)
    _check(g, names, tensors, at, label)


@pytest.mark.parametrize("at", [GENERIC, *UNITS], ids=["generic", "G=1", "G=h"])
@pytest.mark.parametrize("label, shape, chain", VIEWS, ids=[v[0] for v in VIEWS])
def test_views_with_symbols(label, shape, chain, at):
    """Built with symbols: at generic sizes the decision is the generic one; at G = 1 and G = h the condition
    (``Ne(G, 1) & Ne(h/G, 1)`` for repeat_kv) decides as PyTorch does."""
    g, names, tensors = _run_chain(shape, chain, at, symbolic=True)
    _check(g, names, tensors, at, label)


def test_repeat_kv_condition_is_the_branch_condition():
    """The condition the strides give is the one the derivation branches on (symmem.conditions)."""
    g, names, _ = _run_chain((B, S, G * d), _view("repeat_kv (HF Llama)"), GENERIC, symbolic=True)
    assert g.graph.node(names[-1]).facts["copy"] == sympy.Ne(G, 1) & sympy.Ne(h / G, 1)


# -- elementwise ops: the memory order of a new output ----------------------------------------------------------
HEADS = [("reshape", dict(shape=(B, S, h, d))), ("transpose", dict(dim0=1, dim1=2))]  # a (B, S, h, d) memory
QKV = [("reshape", dict(shape=(B, S, 3, h, d))), ("permute", dict(dims=(2, 0, 3, 1, 4))),
       ("select", dict(dim=0, index=0))]  # not dense
UNARY = [("relu", {}), ("gelu", {}), ("pow", dict(exponent=2)), ("scale", dict(factor=0.5)),
         ("scalar_add", dict(value=1.0)), ("clone", {}), ("clone", dict(memory_format="contiguous")),
         ("to_dtype", {}), ("softmax", dict(dim=-1)),
         ("dropout", dict(p=0.3)), ("contiguous", {})]
INPUTS = [("head split", (B, S, H), HEADS), ("q of a packed qkv", (B, S, 3 * H), QKV),
          ("a size-1 head", (B, S, d), [("reshape", dict(shape=(B, S, 1, d))), ("transpose", dict(dim0=1, dim1=2))]),
          ("channels last", (B, S, S, Q), [("permute", dict(dims=(0, 3, 1, 2)))])]


@pytest.mark.parametrize("at", [GENERIC, ONES[0], ONES[4]], ids=["generic", "B=1", "all 1"])
@pytest.mark.parametrize("op, attrs", UNARY, ids=[u[0] for u in UNARY])
@pytest.mark.parametrize("label, shape, chain", INPUTS, ids=[i[0] for i in INPUTS])
def test_unary_layout(label, shape, chain, op, attrs, at):
    for symbolic in _builds(at):
        g, names, tensors = _run_chain(shape, [*chain, (op, attrs)], at, symbolic)
        assert _strides(g.spec(names[-1]), at) == tensors[-1].stride(), (label, op, symbolic)


BINARY: list[tuple[str, tuple[Any, ...], Chain, tuple[Any, ...], Chain, str]] = [
    ("head split + contiguous", (B, S, H), HEADS, (B, h, S, d), [], "add"),
    ("contiguous + head split", (B, h, S, d), [], (B, S, H), HEADS, "add"),
    ("head split * a broadcast table", (B, S, H), HEADS, (1, 1, S, d), [], "mul"),
    ("a broadcast table * head split", (1, 1, S, d), [], (B, S, H), HEADS, "mul"),
    ("two head splits", (B, S, H), HEADS, (B, S, H), HEADS, "sub"),
    ("q of a packed qkv / a row", (B, S, 3 * H), QKV, (d,), [], "div"),
]


@pytest.mark.parametrize("at", [GENERIC, ONES[0], ONES[2]], ids=["generic", "B=1", "d=1"])
@pytest.mark.parametrize("label, sx, cx, sy, cy, op", BINARY, ids=[b[0] for b in BINARY])
def test_binary_layout(label, sx, cx, sy, cy, op, at):
    fn = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "div": torch.div}[op]
    for symbolic in _builds(at):
        gx, nx, tx = _run_chain(sx, cx, at, symbolic)
        # the second operand in the same graph
        g = gx
        y = g.input("y", sy if symbolic else _numbers(sy, at))
        for kind, attrs in cy:
            y = g.op(kind, y, **(attrs if symbolic else _numbers(attrs, at)))
        _, _, ty = _run_chain(sy, cy, at, symbolic)
        out = g.op(op, nx[-1], y)
        assert _strides(g.spec(out), at) == fn(tx[-1], ty[-1]).stride(), (label, symbolic)


@pytest.mark.parametrize("label, shape, chain", INPUTS, ids=[i[0] for i in INPUTS])
def test_where_and_masked_fill_layout(label, shape, chain):
    at = GENERIC
    g, names, tensors = _run_chain(shape, chain, at, symbolic=True)
    x, t = names[-1], tensors[-1]
    mask_shape = t.shape[-1:]
    mask = g.op("constant", name="mask", shape=tuple(g.spec(x).shape[-1:]), dtype="bool")
    m = torch.zeros(mask_shape, dtype=torch.bool)
    where = g.op("where", x, mask)
    filled = g.op("masked_fill", x, mask)
    assert _strides(g.spec(where), at) == torch.where(m, t, 0.0).stride()
    assert _strides(g.spec(filled), at) == t.masked_fill(m, 0.0).stride()


# -- matmul: does autograd keep the operand's storage, or the copy that folds it into bmm? ------------------------
MATMUL = [
    ("q @ k^T of head splits", (B, S, H), HEADS, (B, S, H), [*HEADS, ("transpose", dict(dim0=-2, dim1=-1))]),
    ("contiguous q @ contiguous k^T", (B, h, S, d), [], (B, h, S, d), [("transpose", dict(dim0=-2, dim1=-1))]),
    ("probs @ v of a packed qkv", (B, h, S, S), [], (B, S, 3 * H), QKV),
    ("scaled q of a packed qkv @ k^T", (B, S, 3 * H), [*QKV, ("scale", dict(factor=0.5))],
     (B, h, S, d), [("transpose", dict(dim0=-2, dim1=-1))]),
    ("probs @ a stride-0 repeat of v", (B, h, S, S), [], (B, G, S, d),
     _view("repeat_kv of a contiguous key, folded for bmm")[:3]),
    ("a broadcast batch", (h, S, d), [], (B, h, d, S), []),
]


def _saved_storages(fn: Callable[..., Any], *tensors: Any) -> set[int]:
    found: set[int] = set()

    def pack(t: Any) -> Any:
        found.add(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*tensors)
    return found


@pytest.mark.parametrize("at", [GENERIC, ONES[0], *UNITS], ids=["generic", "B=1", "G=1", "G=h"])
@pytest.mark.parametrize("label, sa, ca, sb, cb", MATMUL, ids=[m[0] for m in MATMUL])
def test_matmul_copies(label, sa, ca, sb, cb, at):
    for symbolic in _builds(at):
        g, na, ta = _run_chain(sa, ca, at, symbolic, grad=True)
        _, _, tb = _run_chain(sb, cb, at, symbolic, grad=True)
        y = g.input("y", sb if symbolic else _numbers(sb, at))
        for kind, attrs in cb:
            y = g.op(kind, y, **(attrs if symbolic else _numbers(attrs, at)))
        out = g.op("matmul", na[-1], y)
        copies = dict(e if isinstance(e, tuple) else (e, True) for e in g.graph.node(out).facts["copy_inputs"])
        saved = _saved_storages(torch.matmul, ta[-1], tb[-1])
        for i, t in enumerate((ta[-1], tb[-1])):
            kept_itself = t.untyped_storage().data_ptr() in saved
            assert _holds(copies.get(i, False), at) is not kept_itself, (label, i, at, symbolic)


# -- attention: the layout the kernels see ----------------------------------------------------------------------
ATTENTION = [
    ("head splits (GPT-2, BERT, Llama)", (B, S, H), HEADS),
    ("a packed qkv (timm ViT)", (B, S, 3 * H), QKV),
    ("contiguous heads", (B, h, S, d), []),
    ("heads made contiguous", (B, S, H), [*HEADS, ("contiguous", {})]),
]


@pytest.mark.parametrize("label, shape, chain", ATTENTION, ids=[a[0] for a in ATTENTION])
def test_attention_layout_facts(label, shape, chain):
    at = GENERIC
    g, names, tensors = _run_chain(shape, chain, at, symbolic=True, grad=True)
    q = names[-1]
    k = g.op("input", name="k", shape=(B, h, S, d))
    out = g.op("attention", q, k, q, dropout=0.2)
    facts = g.graph.node(out).facts
    v = tensors[-1]
    kk = torch.zeros(v.shape, requires_grad=True)  # so that the product keeps v (for the probabilities' gradient)
    # CPU flash (no dropout): the output is empty_like(q); (B, S, h, d) memory makes the head merge a view
    with torch.no_grad():
        flash = F.scaled_dot_product_attention(v, kk, v)
    assert _holds(facts["q_bshd"], at) is flash.transpose(1, 2).is_contiguous(), label
    # CPU math (dropout): matmul(probs, v) keeps v itself or a copy
    saved = _saved_storages(lambda v: F.scaled_dot_product_attention(kk, kk, v, dropout_p=0.2), v)
    assert _holds(facts["v_contiguous"], at) is (v.untyped_storage().data_ptr() in saved), label


@pytest.mark.parametrize("at", [GENERIC, *UNITS], ids=["generic", "G=1", "G=h"])
def test_attention_keeps_a_grouped_value_only_when_its_heads_are_the_querys(at):
    """Grouped-query attention (enable_gqa): the CPU math kernel repeats G key/value heads to h, a copy, unless
    G = h -- then it keeps a contiguous value itself (Llama's cache copy)."""
    g = GraphBuilder("gqa")
    q = g.input("q", (B, h, S, d))
    v = g.input("v", (B, G, S, d))
    out = g.op("attention", q, v, v, causal=True, dropout=0.2)
    kept = g.graph.node(out).facts["v_contiguous"]
    n = {k: int(v) for k, v in at.items()}
    tq = torch.zeros(n[B], n[h], n[S], n[H] // n[h], requires_grad=True)
    tv = torch.zeros(n[B], n[G], n[S], n[H] // n[h], requires_grad=True)
    saved = _saved_storages(lambda v: F.scaled_dot_product_attention(tq, v, v, dropout_p=0.2, enable_gqa=True), tv)
    assert _holds(kept, at) is (tv.untyped_storage().data_ptr() in saved)


def test_rotary_keeps_the_head_split_layout():
    """HF Llama's rotary embedding on a head split: the sum keeps the (B, S, h, d) memory order, so SDPA's CPU
    flash output is already merged, and the eager matmul copies q to fold it (measured here)."""
    at = GENERIC
    half = d / 2
    g = GraphBuilder("rotary")
    x = g.input("x", (B, S, H))
    q = g.op("transpose", g.op("reshape", x, shape=(B, S, h, d)), dim0=1, dim1=2)
    cos = g.op("constant", name="cos", shape=(1, 1, S, d))
    a = g.op("mul", q, cos)
    x1 = g.op("slice", q, dim=-1, start=0, stop=half)
    x2 = g.op("slice", q, dim=-1, start=half, stop=d)
    r = g.op("mul", g.op("concat", g.op("neg", x2), x1, dim=-1), cos)
    qe = g.op("add", a, r)
    kt = g.op("transpose", g.op("input", name="k", shape=(B, h, S, d)), dim0=-2, dim1=-1)
    scores = g.op("matmul", qe, kt)

    n = {k: int(v) for k, v in at.items()}
    tq = torch.zeros(n[B], n[S], n[H]).view(n[B], n[S], n[h], n[H] // n[h]).transpose(1, 2)
    tc = torch.zeros(1, 1, n[S], n[H] // n[h])
    half_n = n[H] // n[h] // 2
    rot = torch.cat((-tq[..., half_n:], tq[..., :half_n]), -1) * tc
    tqe = (tq * tc + rot).requires_grad_()
    assert _strides(g.spec(qe), at) == tqe.stride()
    k = torch.zeros(tqe.shape, requires_grad=True)
    saved = _saved_storages(lambda a: torch.matmul(a, k.transpose(-2, -1)), tqe)
    assert tqe.untyped_storage().data_ptr() not in saved
    assert g.graph.node(scores).facts["copy_inputs"][0] == 0


# -- the zoo: storage facts come from strides, not from annotations ---------------------------------------------
def test_the_zoo_states_no_storage_facts():
    """No zoo model states its copies: the strides decide every one (Llama's eager matmuls with and without the
    cache included)."""
    import itertools

    from symmem.models import available, build

    for name, entry in available().items():
        if name == "counts":
            continue
        choices = {k: o.choices for k, o in entry.options.items() if k in ("attention", "cache")}
        for combo in itertools.product(*choices.values()):
            graph = build(name, **dict(zip(choices, combo, strict=True))).graph
            for n in graph.order():
                stated = {"copy", "copy_inputs", "q_layout", "v_contiguous"} & set(graph.node(n).attrs)
                assert not stated, (name, combo, n, stated)


def test_llama_eager_matmuls_copy_where_repeat_kv_is_a_view():
    """Without the cache, Llama's eager matmuls copy the key and value exactly where repeat_kv's reshape is a view
    (G = 1: stride 0; G = h: the rotary output's layout), and the rotary query always."""
    from symmem.conditions import canonical
    from symmem.models import build

    graph = build("llama", attention="naive", cache="none").graph
    derived = graph.node("layers.self_attn.k_repeat").facts["copy"]
    for n in ("layers.self_attn.scores", "layers.self_attn.attn_v"):
        facts = graph.node(n).facts["copy_inputs"]
        assert (0 in facts) is n.endswith("scores")
        (_, copied), = [f for f in facts if isinstance(f, tuple)]
        assert canonical(derived)[0] == canonical(copied)[0]
        assert canonical(derived)[1] is not canonical(copied)[1]


def test_explicit_attributes_still_win():
    """Graphs written before strides keep their meaning: a stated ``copy``/``copy_inputs``/``q_layout`` wins."""
    g = GraphBuilder("old")
    x = g.input("x", (B, S, H))
    kept = g.op("reshape", x, shape=(B, S, h, d), copy=True)
    assert g.graph.node(kept).view_of is None and g.spec(kept).strides is None
    heads = g.op("transpose", g.op("reshape", x, shape=(B, S, h, d)), dim0=1, dim1=2)
    declared_view = g.op("reshape", heads, shape=(B * h, S, d), copy=False)
    assert g.graph.node(declared_view).view_of == 0
    mm = g.op("matmul", heads, g.op("transpose", heads, dim0=-2, dim1=-1), copy_inputs=(1,))
    assert g.graph.node(mm).facts["copy_inputs"] == (1,)
    att = g.op("attention", heads, heads, heads, q_layout="bhsd")
    assert g.graph.node(att).facts["q_bshd"] is False


def test_tensor_spec_strides_are_a_value():
    assert TensorSpec((B, S), strides=(S, 1)) == TensorSpec((B, S))
    assert hash(TensorSpec((B, S), strides=(S, 1))) == hash(TensorSpec((B, S)))
    assert TensorSpec((S, B), strides=(1, S)) != TensorSpec((S, B))
    assert TensorSpec((S, B), strides=(1, S)).with_(role="x").strides == (1, S)
