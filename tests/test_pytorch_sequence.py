"""The ``pytorch`` convention for sequence models against what real eager PyTorch keeps (CPU).

Oracle: the project's faithful references (symmem/reference/sequence_models.py, mirrored from timm and Hugging
Face) measured by :func:`symmem.record.verify.verify` (``saved_tensors_hooks``; every packed storage counted once,
parameters, buffers and the inputs apart); the op table and the bfloat16 cases use the small ``_measure``
here.  The formula of ``--convention pytorch --device cpu`` must give the measured activation bytes exactly,
at two or more values of B (>= 2) and of S, for naive and SDPA attention, with and without dropout.
"""

from __future__ import annotations

import math

import pytest
import sympy

torch = pytest.importorskip("torch")
F = torch.nn.functional

from symmem import derive  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.graph import GraphBuilder, Model  # noqa: E402
from symmem.models.gpt import gelu_new  # noqa: E402
from symmem.record.verify import verify  # noqa: E402
from symmem.reference.sequence_models import reference  # noqa: E402
from tests.kept_cases import kept  # noqa: E402


def _measure(module, inputs) -> int:
    """Activation bytes autograd keeps: storages counted once, parameters, buffers and inputs apart."""
    state = list(module.parameters()) + list(module.buffers()) + list(inputs)
    skip = {t.untyped_storage().data_ptr() for t in state}
    kept: dict[int, tuple[int, object]] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            kept[s.data_ptr()] = (s.nbytes(), t)  # holding t keeps the storage from being reused
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(*inputs)
    return sum(n for n, _ in kept.values())


def _measured(d) -> int:
    c = verify(d)
    assert c.exact, c.report()
    return c.measured


TINY = {"H": 16, "h": 2, "L": 2, "V": 50}
# family, symbol values (besides B and S), the (B, S) points, builder options to sweep
FAMILIES = [
    ("gpt2", TINY, [(2, 8), (3, 5), (2, 11)], {"gelu": "new"}),
    ("gpt2", TINY, [(2, 8), (3, 5)], {"gelu": "fused"}),
    ("bert-base", TINY, [(2, 8), (3, 5), (2, 11)], {}),
    ("llama", {"H": 32, "h": 4, "G": 2, "L": 2, "V": 50, "F": 24}, [(2, 8), (3, 5), (2, 11)], {}),
    ("llama", {"H": 32, "h": 4, "G": 4, "L": 1, "V": 50, "F": 24}, [(2, 8), (3, 5)], {}),
    # G = 1: repeat_kv's reshape of the stride-0 expand is a view (symmem.conditions)
    ("llama", {"H": 32, "h": 4, "G": 1, "L": 2, "V": 50, "F": 24}, [(2, 8), (3, 5)], {}),
    # ViT: S follows the image (S = (Hi/16)*(Wi/16) + 1): 5, 10 and 17 tokens
    ("vit-ti16", {"H": 16, "h": 2, "L": 2, "K": 10}, [(2, (32, 32)), (3, (32, 64)), (2, (64, 64))], {}),
]
CASES = [(name, values, points, {**opts, "attention": att, "dropout": p})
         for name, values, points, opts in FAMILIES for att in ("naive", "sdpa") for p in (0.0, 0.1)]


def _values(name, values, point):
    b, s = point
    if name.startswith("vit"):
        return {**values, "B": b, "Hi": s[0], "Wi": s[1]}
    return {**values, "B": b, "S": s}


#: the cases the default suite measures (stop 42, docs/testing.md): those a greedy cover of the cases' line coverage
#: keeps, and Llama's G = 1 with eager attention (repeat_kv's view: the cover keeps no G = 1 case); -m deep all
KEPT = {"gpt2-gelu=fused-attention=sdpa-dropout=0.0-6", "llama-attention=naive-dropout=0.0-12",
        "bert-base-attention=sdpa-dropout=0.1-11", "vit-ti16-attention=sdpa-dropout=0.1-27",
        "vit-ti16-attention=naive-dropout=0.1-25", "gpt2-gelu=new-attention=naive-dropout=0.1-1",
        "llama-attention=sdpa-dropout=0.0-14", "bert-base-attention=naive-dropout=0.0-8",
        "llama-attention=sdpa-dropout=0.1-15", "vit-ti16-attention=naive-dropout=0.0-24",
        "llama-attention=naive-dropout=0.1-17", "llama-attention=naive-dropout=0.0-20"}


@pytest.mark.parametrize("name, values, points, opts", kept(
    CASES, [f"{c[0]}-{'-'.join(f'{k}={v}' for k, v in c[3].items())}-{i}" for i, c in enumerate(CASES)], KEPT,
    unpack=True))
def test_formula_equals_measured_bytes(name, values, points, opts):
    for point in points:
        d = derive(name, convention="pytorch", options={"device": "cpu"}, values=_values(name, values, point),
                   **opts)
        assert d.value("activations") == _measured(d), (name, point, opts)


BF16 = [(name, values, points[0], {**opts, "attention": att, "dropout": p})
        for name, values, points, opts in FAMILIES[:1] + FAMILIES[2:4] + FAMILIES[6:]
        for att in ("naive", "sdpa") for p in (0.0, 0.1)]


#: the cover's cases (every model and attention once); -m deep all
BF16_KEPT = {"bert-base-sdpa-0.0", "llama-sdpa-0.1", "vit-ti16-naive-0.1", "gpt2-sdpa-0.0", "llama-naive-0.1",
             "gpt2-naive-0.0", "bert-base-naive-0.0", "vit-ti16-sdpa-0.0", "vit-ti16-sdpa-0.1"}


@pytest.mark.parametrize("name, values, point, opts", kept(
    BF16, [f"{c[0]}-{c[3]['attention']}-{c[3]['dropout']}" for c in BF16], BF16_KEPT, unpack=True))
def test_bfloat16_formula_equals_measured_bytes(name, values, point, opts):
    """A model cast to bfloat16 (not autocast): casts copy, the CPU math attention computes in float32."""
    d = derive(name, convention="pytorch", options={"device": "cpu"}, precision="mixed-megatron",
               values=_values(name, values, point), **opts)
    assert d.regime.activation_dtype == "bfloat16"
    torch.manual_seed(0)
    module, inputs = reference(name, {s.name: v for s, v in d.numbers.items()}, **opts)
    module = module.to(torch.bfloat16)
    inputs = tuple(x.to(torch.bfloat16) if x.is_floating_point() else x for x in inputs)
    assert d.value("activations") == _measure(module, inputs)


@pytest.mark.parametrize("name, count", [
    ("vit-b16", 86_567_656), ("gpt2", 124_439_808), ("bert-base", 109_482_240), ("bert-large", 335_141_888),
    ("llama", 6_738_415_616),  # Llama-2-7B as HF counts it
])
def test_parameter_counts(name, count):
    assert derive(name, convention="pytorch").value("parameters") == count


def test_reference_parameter_counts_match_the_graph():
    """The references and the builders agree on every parameter, at a tiny size (tied GPT-2 head once)."""
    for name, values in [("gpt2", {**TINY, "S": 4}), ("bert-base", {**TINY, "S": 4}),
                         ("llama", {"H": 32, "h": 4, "G": 2, "L": 2, "V": 50, "F": 24, "S": 4})]:
        d = derive(name, convention="pytorch", values={"B": 2, **values})
        module, _ = reference(name, {s.name: v for s, v in d.numbers.items()}, **d.options)
        assert sum(p.numel() for p in module.parameters()) == d.value("parameters"), name


@pytest.mark.parametrize("name, values, opts", [
    ("gpt2", TINY, {"attention": "sdpa", "dropout": 0.0}), ("gpt2", TINY, {"attention": "naive", "dropout": 0.1}),
    ("llama", {"H": 32, "h": 4, "G": 2, "L": 2, "V": 50, "F": 24}, {"attention": "sdpa", "dropout": 0.1}),
])
def test_use_cache_false(name, values, opts):
    """``cache="none"`` (``use_cache=False``): no DynamicCache copies; GPT-2's SDPA then keeps views of c_attn."""
    d = derive(name, convention="pytorch", options={"device": "cpu"}, values={**values, "B": 2, "S": 8},
               cache="none", **opts)
    assert _measured(d) == d.value("activations")
    with_cache = derive(name, convention="pytorch", options={"device": "cpu"}, values={**values, "B": 2, "S": 8},
                        **opts)
    extra = 2 * 4 * 2 * 8 * values["H"] * values["L"] if opts == {"attention": "sdpa", "dropout": 0.0} else 0
    assert with_cache.value("activations") - d.value("activations") == extra


def test_grouped_query_attention_keeps_the_G_key_value_heads():
    """transformers 5.23 gives SDPA the G key/value heads (``enable_gqa``): the fused kernel keeps (B, G, S, d) key
    and value tensors for every G -- no branch on G.  The eager path's ``repeat_kv`` copies for 1 < G < h and is
    a view the matmul copies for G = 1: the same bytes, so no ``Piecewise`` either."""
    B, S, H, h, G = (sympy.Symbol(n, positive=True, integer=True) for n in ("B", "S", "H", "h", "G"))
    layer = {att: derive("llama", convention="pytorch", options={"device": "cpu"}, attention=att, per_layer=True)
             for att in ("sdpa", "naive")}
    sdpa = layer["sdpa"].activations
    assert not sdpa.has(sympy.Piecewise) and not layer["naive"].activations.has(sympy.Piecewise)
    # the cache's copies of k and v, G heads each, kept by the kernel: 2 * 4 * B * S * G * d bytes
    at_h = sdpa.subs(G, h)
    assert sympy.expand(at_h - sdpa - 2 * 4 * B * S * (H / h) * (h - G)) == 0
    # G decided by the values when it is not free: the same formula at that number
    fixed = derive("llama", convention="pytorch", options={"device": "cpu"}, values={"G": 1}, free=("B", "S"))
    full = derive("llama", convention="pytorch", options={"device": "cpu"})
    assert full.at(G=1).value("activations") == fixed.value("activations") < full.value("activations")


def test_symbols_are_settable_and_free():
    d = derive("llama", convention="pytorch", attention="sdpa", per_layer=True)
    assert {s.name for s in d.free} >= {"B", "S", "H", "h", "G", "F"}
    small = derive("llama", convention="pytorch", values={"G": 8}).value("parameters")
    assert small == 6_738_415_616 - 32 * 2 * 4096 * (4096 - 1024)


@pytest.mark.parametrize("name, values, match", [
    ("llama", {"h": 4, "G": 3}, "Mod"),  # repeat_kv needs G | h
    ("gpt2", {"S": 1025}, "1024"),  # wpe has 1024 rows
    ("bert-base", {"S": 600}, "512"),
])
def test_inconsistent_symbols_are_errors(name, values, match):
    with pytest.raises(SymmemError, match=match):
        derive(name, convention="pytorch", values=values)


def test_device_differences():
    """CUDA: bool dropout masks, float32 norm statistics, no math fallback for SDPA with dropout."""
    layer = {dev: derive("gpt2", convention="pytorch", options={"device": dev}, attention="sdpa", dropout=0.1,
                         per_layer=True) for dev in ("cpu", "cuda")}
    B, S, h = (sympy.Symbol(n, positive=True, integer=True) for n in ("B", "S", "h"))
    cpu, cuda = layer["cpu"].activations, layer["cuda"].activations
    # the CPU falls back to the math kernel (B*h*S^2 probabilities, noise, dropped); CUDA stays fused
    assert sympy.degree(cpu, S) == 2 and sympy.degree(cuda.subs(sympy.ceiling(S / 32), 1), S) == 1
    assert sympy.expand(layer["cpu"].sum(role="attn_probs") - 4 * B * h * S**2) == 0
    masks = {dev: [t for t in d.terms if t.role == "dropout_mask"] for dev, d in layer.items()}
    assert masks["cuda"] and all(t.dtype == "bool" for t in masks["cuda"])
    assert masks["cpu"] and all(t.dtype == "act" for t in masks["cpu"])
    assert layer["cuda"].sum(role="rng_state") == 16
    assert sympy.expand(layer["cuda"].sum(role="attn_lse") - 4 * B * h * 32 * sympy.ceiling(S / 32)) == 0
    flash = derive("gpt2", convention="pytorch", options={"device": "cuda"}, attention="sdpa", precision="mixed",
                   per_layer=True)
    assert sympy.expand(flash.sum(role="attn_lse") - 4 * B * S * h) == 0
    assert layer["cpu"].sum(role="rng_state") == 0
    # layernorm statistics: float32 on CUDA whatever the activation dtype, the input's dtype on the CPU
    stats = {dev: {t.dtype for t in d.terms if t.role == "norm_stats"} for dev, d in layer.items()}
    assert stats == {"cpu": {"act"}, "cuda": {"float32"}}


# -- one op kind at a time ----------------------------------------------------------------------------------
def _graph_case(shapes, build, consts=()):
    """A graph whose inputs are activations ``scale(parameter)``; ``consts`` are no-grad tensors made inside."""
    g = GraphBuilder("case")
    xs = [g.op("scale", g.parameter(f"p{i}", s), name=f"x{i}", factor=1) for i, s in enumerate(shapes)]
    cs = [g.op(kind, name=f"c{i}", shape=s, dtype=dt) for i, (kind, s, dt) in enumerate(consts)]
    build(g, *xs, *cs)
    return Model("case", g.finish(), {}, ())


_W, _B = torch.nn.Parameter(torch.ones(8)), torch.nn.Parameter(torch.zeros(8))


def _torch_case(shapes, fn, consts=()):
    leaves = [torch.randn(*s, requires_grad=True) for s in shapes]
    cs = [c() for c in consts]

    class Case(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w, self.b = _W, _B  # weights are parameters, reported apart

        def forward(self, *leaves):
            return fn(*[x * 1 for x in leaves], *cs)

    return _measure(Case(), leaves)


def _rotate(x):
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def _g_rotary(g, x, cos, sin):
    a = g.op("mul", x, cos)
    x1 = g.op("slice", x, dim=-1, start=0, stop=4)
    x2 = g.op("slice", x, dim=-1, start=4, stop=8)
    b = g.op("mul", g.op("concat", g.op("neg", x2), x1, dim=-1), sin)
    g.op("add", a, b)


def _g_rms(g, x):
    y = g.op("cast", x, dtype="float32")
    v = g.op("scalar_add", g.op("mean", g.op("pow", y, exponent=2), dim=-1, keepdim=True), value=1e-6)
    y = g.op("cast", g.op("mul", y, g.op("rsqrt", v)), dtype="act")
    g.op("mul", g.parameter("w", (8,)), y)


def _t_rms(x):
    x32 = x.to(torch.float32)
    return _W * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


QKV = [(2, 3, 5, 8)] * 3
HEADS_VIEW = [(2, 5, 3, 8)] * 3  # (B, S, h, d) tensors whose permute is the head split
OPS = [
    ("layernorm", [(2, 5, 8)], lambda g, x: g.op("layernorm", x), lambda x: F.layer_norm(
        x, (8,), _W, _B), ()),
    ("rmsnorm written out", [(2, 5, 8)], _g_rms, _t_rms, ()),
    ("gelu", [(2, 5, 8)], lambda g, x: g.op("gelu", x), F.gelu, ()),
    ("gelu_new written out", [(2, 5, 8)], lambda g, x: gelu_new(g, x), lambda x: 0.5 * x * (
        1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))), ()),
    ("silu", [(2, 5, 8)], lambda g, x: g.op("silu", x), F.silu, ()),
    ("tanh", [(2, 5, 8)], lambda g, x: g.op("tanh", x), torch.tanh, ()),
    ("pow", [(2, 5, 8)], lambda g, x: g.op("pow", x, exponent=3), lambda x: torch.pow(x, 3.0), ()),
    ("softmax", [(2, 5, 8)], lambda g, x: g.op("softmax", x, dim=-1), lambda x: x.softmax(-1), ()),
    ("scale", [(2, 5, 8)], lambda g, x: g.op("scale", x, factor=0.5), lambda x: 0.5 * x, ()),
    ("mul tensors", [(2, 5, 8), (2, 5, 8)], lambda g, x, y: g.op("mul", x, y), torch.mul, ()),
    ("mul by a no-grad tensor", [(2, 5, 8)], lambda g, x, c: g.op("mul", x, c), torch.mul,
     [(lambda: torch.randn(1, 5, 8), ("constant", (1, 5, 8), "act"))]),
    ("div by a 0-dim tensor", [(2, 5, 8)], lambda g, x, c: g.op("div", x, c), torch.div,
     [(lambda: torch.full([], 2.0), ("constant", (), "act"))]),
    ("masked_fill with a made mask", [(2, 5, 8)], lambda g, x, m: g.op("masked_fill", x, m),
     lambda x, m: x.masked_fill(m, 0.0), [(lambda: torch.rand(5, 8) > 0.5, ("constant", (5, 8), "bool"))]),
    ("embedding of made ids", [(10, 8)], lambda g, w, i: g.op("embedding", i, num_embeddings=10, dim=8),
     lambda w, i: F.embedding(i, w), [(lambda: torch.arange(5).unsqueeze(0), ("constant", (1, 5), "int64"))]),
    ("matmul contiguous", [(2, 3, 5, 8), (2, 3, 8, 4)], lambda g, x, y: g.op("matmul", x, y), torch.matmul, ()),
    ("matmul of head views", [(2, 5, 3, 8), (2, 5, 3, 8)],
     lambda g, x, y: g.op("matmul", g.op("permute", x, dims=(0, 2, 1, 3)),
                          g.op("transpose", g.op("permute", y, dims=(0, 2, 1, 3)), dim0=-1, dim1=-2),
                          copy_inputs=(0, 1)),
     lambda x, y: x.permute(0, 2, 1, 3) @ y.permute(0, 2, 1, 3).transpose(-1, -2), ()),
    ("concat, slice, neg", [(2, 5, 8)], lambda g, x: g.op("concat", g.op("neg", g.op("slice", x, dim=-1, start=4)),
                                                          x, dim=-1),
     lambda x: torch.cat((-x[..., 4:], x), dim=-1), ()),
    ("rotary", [(2, 3, 5, 8)], _g_rotary, lambda x, c, s: x * c + _rotate(x) * s,
     [(lambda: torch.randn(1, 1, 5, 8), ("constant", (1, 1, 5, 8), "act"))] * 2),
    ("sdpa contiguous", QKV, lambda g, q, k, v: g.op("attention", q, k, v), F.scaled_dot_product_attention, ()),
    ("sdpa causal of head views", HEADS_VIEW,
     lambda g, *t: g.op("attention", *[g.op("permute", x, dims=(0, 2, 1, 3)) for x in t], causal=True,
                        q_layout="bshd"),
     lambda *t: F.scaled_dot_product_attention(*[x.permute(0, 2, 1, 3) for x in t], is_causal=True), ()),
    ("sdpa with dropout (math)", QKV, lambda g, q, k, v: g.op("attention", q, k, v, dropout=0.2, v_contiguous=True),
     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.2), ()),
    ("sdpa with dropout of head views", HEADS_VIEW,
     lambda g, *t: g.op("attention", *[g.op("permute", x, dims=(0, 2, 1, 3)) for x in t], dropout=0.2,
                        q_layout="bshd"),
     lambda *t: F.scaled_dot_product_attention(*[x.permute(0, 2, 1, 3) for x in t], dropout_p=0.2), ()),
    ("dropout", [(2, 5, 8)], lambda g, x: g.op("dropout", x, p=0.3), lambda x: F.dropout(x, 0.3), ()),
]


@pytest.mark.filterwarnings("ignore::symmem.errors.NothingCounted")  # ops and stand-ins that keep nothing
@pytest.mark.parametrize("label, shapes, build, fn, consts", OPS, ids=[o[0] for o in OPS])
def test_op_table(label, shapes, build, fn, consts):
    model = _graph_case(shapes, build, [c[1] for c in consts])
    predicted = derive(model, convention="pytorch", options={"device": "cpu"}).value("activations")
    torch.manual_seed(0)
    assert predicted == _torch_case(shapes, fn, [c[0] for c in consts]), label


def _shown(e):
    """A formula as the docs print it: factored, branch by branch for a ``Piecewise``."""
    if isinstance(e, sympy.Piecewise):
        return sympy.Piecewise(*[(_shown(x), c) for x, c in e.args])
    return sympy.factor(sympy.expand(e))


def test_docs_formula_table_comes_from_the_engine():
    """Every row of the per-layer table in docs/pytorch-sequence.md is what the engine derives."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).parents[1] / "docs" / "pytorch-sequence.md").read_text()
    rows = re.findall(r"^\| `([\w-]+)` \| (naive|sdpa) \| (?:(cuda|cpu) (fp32|mixed)|`paper`) \| `([^`]*)` \| "
                      r"([\d.]+)", text, flags=re.M)
    assert len(rows) >= 10
    for name, att, dev, prec, formula, gib in rows:
        conv, opts = ("pytorch", {"device": dev}) if dev else ("paper", {})
        kw = dict(convention=conv, options=opts, attention=att, precision=prec or "fp32")
        layer = derive(name, per_layer=True, **kw)
        # a `|` inside a table cell is written `\|`
        assert str(_shown(layer.activations)) == formula.replace("\\|", "|"), (name, att, dev, prec)
        assert f"{derive(name, **kw).value('activations') / 2**30:.2f}" == gib, (name, att, dev, prec)
