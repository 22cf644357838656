"""``symmem.importer.trace_module`` against real eager PyTorch: exact bytes at sizes that were not traced.

Oracle: one real training-mode forward (real tensors, CPU) with every tensor autograd packs recorded, storages
counted once, parameters/buffers and inputs apart — :func:`symmem.record.verify.measure` for positional inputs, the
same rule for keyword inputs in :func:`measured` below.  Each model is traced once at small example sizes
(module-scoped fixtures); its formula is evaluated at other sizes inside its domain and must equal the
measurement there, activation bytes and input bytes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import sympy

torch = pytest.importorskip("torch")

from symmem.errors import SymmemError  # noqa: E402
from symmem.importer import Trace, trace_module  # noqa: E402
from symmem.record.verify import measure  # noqa: E402
from symmem.symbols import B, L, S  # noqa: E402

nn = torch.nn
TEXT = {"B": [("input_ids", 0)], "S": [("input_ids", 1)]}
MASKED = {"B": [("input_ids", 0), ("attention_mask", 0)], "S": [("input_ids", 1), ("attention_mask", 1)]}
IMAGE = {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]}
SIDES32 = {"Hi": 32, "Wi": 32}
VOCAB = 96


def measured(module: Any, inputs: Any) -> dict[str, int]:
    """Activation and input bytes one real forward keeps (``measure``'s rule; keyword inputs too)."""
    if isinstance(inputs, tuple):
        m = measure(module, *inputs)
        return {"activation": m.activations, "input": m.input}
    module.train()

    def key(t: Any) -> tuple[str, int]:
        return (str(t.device), t.untyped_storage().data_ptr())

    params = {key(p) for p in module.parameters()} | {key(b) for b in module.buffers()}
    given = {key(v) for v in inputs.values() if isinstance(v, torch.Tensor)}
    seen: dict[tuple[str, int], tuple[str, int]] = {}
    keep = []

    def pack(t: Any) -> Any:
        k = key(t)
        if k not in seen:
            kind = "parameter" if k in params else "input" if k in given else "activation"
            seen[k] = (kind, t.untyped_storage().nbytes())
        keep.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(**inputs)
    del out
    keep.clear()
    totals = {"activation": 0, "input": 0}
    for kind, n in seen.values():
        if kind in totals:
            totals[kind] += n
    return totals


def traced(trace: Trace, **values: int) -> dict[str, int]:
    assert trace.holds_at(**values), f"{values} outside the domain {trace.domain}"
    return {"activation": trace.value("activations", **values), "input": trace.value("input", **values)}


def ids(b: int, s: int, mask: bool = False) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1000 * b + s)
    out = {"input_ids": torch.randint(0, VOCAB, (b, s), generator=g)}
    if mask:
        out["attention_mask"] = torch.ones(b, s, dtype=torch.long)
    return out


def image(b: int, hi: int, wi: int, c: int = 3) -> tuple[Any]:
    g = torch.Generator().manual_seed(b * 7 + hi + wi)
    return (torch.randn(b, c, hi, wi, generator=g),)


def tf() -> Any:
    """transformers, or skip: the torch.nn tests run without it."""
    return pytest.importorskip("transformers")


def hf(config: Any, cls: Any, attn: str | None = None) -> Any:
    if attn is not None:
        config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config)


def gpt2(attn: str, p: float, layers: int = 2) -> Any:
    cfg = tf().GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                  resid_pdrop=p, embd_pdrop=p, attn_pdrop=p, bos_token_id=0, eos_token_id=0)
    return hf(cfg, tf().GPT2LMHeadModel, attn)


def llama(attn: str = "sdpa", device: str | None = None, layers: int = 2) -> Any:
    cfg = tf().LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0)
    with torch.device(device) if device else contextlib.nullcontext():
        return hf(cfg, tf().LlamaForCausalLM, attn)


# --- Hugging Face language models ------------------------------------------------------------------------
GPT2_CASES = [("eager", 0.0), ("eager", 0.1), ("sdpa", 0.0), ("sdpa", 0.1)]
#: the case whose two blocks the fold and storage tests read; the others are one block (every op of GPT-2's block
#: and its head traced and held to the real forward; the hand-over from block to block is this case's, exact too)
FOLDED = ("eager", 0.1)


@pytest.fixture(scope="module")
def gpt2_traces():
    out = {}
    for attn, p in GPT2_CASES:
        m = gpt2(attn, p, layers=2 if (attn, p) == FOLDED else 1)
        out[(attn, p)] = (m, trace_module(m, ids(2, 8), TEXT))
    return out


@pytest.mark.parametrize("attn, p", GPT2_CASES, ids=[f"{a}-dropout{p}" for a, p in GPT2_CASES])
def test_gpt2_exact(gpt2_traces, attn, p):
    m, t = gpt2_traces[(attn, p)]
    assert t.method == "symbolic" and t.check is not None and t.check.exact
    assert t.activations.free_symbols == {B, S}
    for b, s in [(3, 5), (4, 11)]:
        assert traced(t, B=b, S=s) == measured(m, ids(b, s))


def test_gpt2_formulas_say_what_eager_keeps(gpt2_traces):
    """Naive attention keeps the S^2 scores; fused SDPA does not, unless dropout sends it to the math path;
    dropout on CPU keeps a float32 noise tensor of its input's size (F.dropout's CPU path)."""
    _, eager = gpt2_traces[("eager", 0.0)]
    _, sdpa = gpt2_traces[("sdpa", 0.0)]
    _, sdpa_drop = gpt2_traces[("sdpa", 0.1)]
    assert sympy.degree(eager.activations, S) == 2
    assert sympy.degree(sdpa.activations, S) == 1
    assert sympy.degree(sdpa_drop.activations, S) == 2
    drops = [s for s in sdpa_drop.storages if s.op == "dropout" and s.kind == "activation"]
    assert drops and all(s.dtype == "float32" for s in drops)


def test_gpt2_repeated_blocks_fold(gpt2_traces):
    _, t = gpt2_traces[FOLDED]
    rep = t.layers
    assert rep.path == "transformer.h" and rep.count == 2 and rep.children == ("transformer.h.0", "transformer.h.1")
    parts = t.split()
    assert parts["count"] == 2
    assert sympy.expand(parts["stem"] + 2 * parts["layer"] + parts["head"] - t.activations) == 0
    assert sympy.expand(t.folded().subs(L, 2) - t.activations) == 0
    # the residual stream a block passes on is kept by the next block's layer norm: it belongs there
    ln = [s for s in t.storages if s.name == "transformer.h.1.ln_1:layer_norm"]
    assert ln and ln[0].producer_module.startswith("transformer.h.0") and ln[0].module == "transformer.h.1.ln_1"


def test_gpt2_storages_record_births_and_savers(gpt2_traces):
    _, t = gpt2_traces[FOLDED]
    acts = t.of_kind("activation")
    assert acts and all(s.born is not None and s.saved_by for s in acts)
    for s in acts:
        assert all(v.seq is not None and v.seq >= s.born for v in s.saved_by), s
        assert all(v.node.endswith("Backward0") or "Backward" in v.node for v in s.saved_by), s
    assert len({s.name for s in t.storages}) == len(t.storages)


def test_gpt2_parameters_tied_once(gpt2_traces):
    m, t = gpt2_traces[("eager", 0.0)]
    names = [p.name for p in t.parameters]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    assert sum(p.numel for p in t.parameters) == sum(p.numel() for p in m.parameters())


@pytest.fixture(scope="module")
def bert_trace():
    cfg = tf().BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  vocab_size=VOCAB, max_position_embeddings=24)
    m = hf(cfg, tf().BertForMaskedLM, "sdpa")
    return m, trace_module(m, ids(2, 8), TEXT)


def test_bert_exact_and_position_table_is_the_domain(bert_trace):
    m, t = bert_trace
    assert t.method == "symbolic"
    assert any(g.expr == (S <= 24) for g in t.guards)
    assert dict((n, (lo, hi)) for n, lo, hi in t.bounds)["S"] == (2, 24)
    assert not t.holds_at(B=2, S=25)
    for b, s in [(3, 5), (4, 24)]:
        assert traced(t, B=b, S=s) == measured(m, ids(b, s))


@pytest.fixture(scope="module")
def llama_traces():
    eager, sdpa = llama("eager"), llama("sdpa")
    return {"eager": (eager, trace_module(eager, ids(2, 8, mask=True), MASKED)),
            "sdpa": (sdpa, trace_module(sdpa, {**ids(2, 8), "use_cache": False}, TEXT))}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_llama_grouped_query_attention_exact(llama_traces, attn):
    m, t = llama_traces[attn]
    extra = {} if attn == "eager" else {"use_cache": False}  # eager: with an all-ones mask; sdpa: no cache
    for b, s in [(3, 5), (4, 12)]:
        assert traced(t, B=b, S=s) == measured(m, {**ids(b, s, mask=attn == "eager"), **extra})
    # SDPA with grouped-query attention keeps no (B, 1, S, S) mask and no repeated keys: linear in S
    if attn == "sdpa":
        assert sympy.degree(t.activations, S) == 1


def test_llama_rotary_tables_do_not_break_the_fold(llama_traces):
    _, t = llama_traces["sdpa"]
    assert t.layers.path == "model.layers" and t.layers.count == 2
    assert sympy.expand(t.folded().subs(L, 2) - t.activations) == 0


@pytest.mark.parametrize("extra, dims", [({"use_cache": False}, TEXT),
                                         ({"attention_mask": torch.ones(2, 8, dtype=torch.long)}, MASKED)],
                         ids=["packed-sequence-check", "padding-check"])
def test_hf_fake_tensor_predicates_would_change_the_formula(monkeypatch, extra, dims):
    """transformers treats fake tensors as tracing: it cannot rule out packed sequences (no cache) or padding
    (a mask given), builds a (B, 1, S, S) mask that SDPA keeps and repeats the key/value heads.  With its
    fake-tensor predicate switched off (and the mask reads replayed) the trace is the eager formula (the Llama
    tests above: sdpa without cache, eager with a mask); without, the check against the real forward at the
    example size refuses the other code path."""
    import symmem.importer.runs as tr

    monkeypatch.setattr(tr, "eager_predicates", contextlib.nullcontext)
    with pytest.raises(SymmemError, match="disagrees with a real eager forward"):  # one layer: each layer's mask
        trace_module(llama("sdpa", layers=1), {**ids(2, 8), **extra}, dims)


def test_weights_on_meta_trace_without_allocating(llama_traces):
    """A model built on the meta device traces (no real forward to check; data reads assume no padding)."""
    m = llama("sdpa", device="meta")
    assert all(p.device.type == "meta" for p in m.parameters())
    t = trace_module(m, {**ids(2, 8), "use_cache": False}, TEXT)
    assert t.check is None and any("meta" in n for n in t.notes)
    assert sympy.expand(t.activations - llama_traces["sdpa"][1].activations) == 0


# --- Hugging Face vision models ----------------------------------------------------------------------------
def _vit():
    cfg = tf().ViTConfig(image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=32,
                                 num_attention_heads=4, intermediate_size=64, num_labels=10)
    return hf(cfg, tf().ViTForImageClassification)


def _resnet():
    cfg = tf().ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 32], depths=[1, 3, 1, 1],
                                    num_labels=10)
    return hf(cfg, tf().ResNetForImageClassification)


def _convnext():
    cfg = tf().ConvNextConfig(hidden_sizes=[8, 16, 16, 32], depths=[1, 2, 1, 1], num_labels=10)
    return hf(cfg, tf().ConvNextForImageClassification)


def _swin():
    cfg = tf().SwinConfig(image_size=64, patch_size=4, embed_dim=8, depths=[2, 2], num_heads=[2, 2],
                                  window_size=2, num_labels=10)
    return hf(cfg, tf().SwinForImageClassification)


def _mobilenet():
    cfg = tf().MobileNetV2Config(image_size=32, depth_multiplier=0.25, num_labels=10)
    return hf(cfg, tf().MobileNetV2ForImageClassification)


# name, builder, dims, example sizes, multiple_of, sizes to check (B, Hi, Wi)
VISION = [
    ("vit", _vit, {"B": [(0, 0)]}, (2, 32, 32), None, [(3, 32, 32), (5, 32, 32)]),
    ("resnet", _resnet, IMAGE, (2, 64, 64), SIDES32, [(3, 64, 96), (2, 128, 64)]),
    ("convnext", _convnext, IMAGE, (2, 64, 64), SIDES32, [(3, 64, 96), (2, 128, 64)]),
    ("swin", _swin, IMAGE, (2, 64, 64), SIDES32, [(3, 64, 96), (2, 96, 128)]),
    ("mobilenetv2", _mobilenet, {"B": [(0, 0)]}, (2, 32, 32), None, [(3, 32, 32), (5, 32, 32)]),
]


@pytest.fixture(scope="module")
def vision_traces():
    out = {}
    for name, build, dims, (b, hi, wi), mult, _ in VISION:
        m = build()
        out[name] = (m, trace_module(m, image(b, hi, wi), dims, multiple_of=mult))
    return out


@pytest.mark.parametrize("name, build, dims, example, mult, sizes", VISION, ids=[v[0] for v in VISION])
def test_hf_vision_exact(vision_traces, name, build, dims, example, mult, sizes):
    m, t = vision_traces[name]
    assert t.check is not None and t.check.exact
    for b, hi, wi in sizes:
        values = {"B": b, "Hi": hi, "Wi": wi}
        assert traced(t, **{k: v for k, v in values.items() if k in t.values}) == measured(m, image(b, hi, wi))


def test_vision_formulas_are_polynomials_on_multiples(vision_traces):
    hi, wi = sympy.symbols("Hi Wi", positive=True, integer=True)
    _, resnet = vision_traces["resnet"]
    assert resnet.method == "symbolic" and resnet.activations.is_polynomial(B, hi, wi)
    assert sympy.Eq(sympy.Mod(hi, 32), 0) in resnet.domain.args
    # a block's output is kept by its own ReLU and by the next block's convolution: it belongs to the block,
    # so the blocks after a stage's first are identical and fold
    rep = resnet.layers
    assert rep.path == "resnet.encoder.stages.1.layers" and rep.count == 2
    parts = resnet.split()
    assert sympy.expand(parts["stem"] + 2 * parts["layer"] + parts["head"] - resnet.activations) == 0
    _, swin = vision_traces["swin"]
    assert swin.activations.is_polynomial(B, hi, wi)
    _, vit = vision_traces["vit"]
    assert vit.activations.free_symbols == {B}


def test_mobilenet_batch_is_symbolic(vision_traces):
    """MobileNetV2's TF-style padding reads the image side as a Python int: with the side declared the trace
    pins it and fits it (benchmarks/bench_trace.py shows that run; it takes several traces); the batch alone
    stays symbolic."""
    _, t = vision_traces["mobilenetv2"]
    assert t.method == "symbolic" and t.activations.free_symbols <= {B}


# --- torch.nn modules ------------------------------------------------------------------------------------
class _MHA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: Any) -> Any:
        return self.attn(x, x, x)[0]


class _LSTM(nn.Module):
    """One layer: the CPU's LSTM kernel with and without oneDNN is the same per layer, and the fit's traces cost in
    proportion to the layers (two: 2.7 CPU-s, one: 1.05 for test_lstm_without_onednn_exact, stop 39)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, num_layers=1, batch_first=True)

    def forward(self, x: Any) -> Any:
        return self.lstm(x)[0]


def _encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=4, dim_feedforward=32, dropout=0.1, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(inplace=True),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def seq(b: int, s: int, d: int = 16) -> tuple[Any]:
    return (torch.randn(b, s, d, generator=torch.Generator().manual_seed(b * 31 + s)),)


SEQ = {"B": [(0, 0)], "S": [(0, 1)]}


@pytest.fixture(scope="module")
def nn_traces():
    torch.manual_seed(0)
    enc, mha, cnn = _encoder(), _MHA(), _cnn()
    return {"encoder": (enc, trace_module(enc, seq(2, 8), SEQ)),
            "mha": (mha, trace_module(mha, seq(2, 8), SEQ, size_one=True)),
            "cnn": (cnn, trace_module(cnn, image(2, 16, 16), IMAGE))}


@pytest.mark.parametrize("name", ["encoder", "mha"])
def test_nn_sequence_modules_exact(nn_traces, name):
    m, t = nn_traces[name]
    for b, s in [(3, 5), (4, 11)]:
        assert traced(t, B=b, S=s) == measured(m, seq(b, s))


def test_transformer_encoder_folds(nn_traces):
    _, t = nn_traces["encoder"]
    assert t.layers.path == "layers" and t.layers.count == 2


def test_small_cnn_exact_and_range_guard(nn_traces):
    m, t = nn_traces["cnn"]
    for b, hi, wi in [(3, 8, 12), (4, 20, 14)]:
        assert traced(t, B=b, Hi=hi, Wi=wi) == measured(m, image(b, hi, wi))
    # the CPU convolution backend choice guards B < 16; the formula is the same beyond it
    assert any(g.expr == (B < 16) for g in t.guards) and not t.holds_at(B=17, Hi=8, Wi=8)
    got = {"activation": t.value("activations", B=17, Hi=8, Wi=8), "input": t.value("input", B=17, Hi=8, Wi=8)}
    assert got == measured(m, image(17, 8, 8))


def test_size_one_is_its_own_branch(nn_traces):
    m, t = nn_traces["mha"]
    at_one = t.extra["at_one"]["B"]
    for s in (3, 7):
        truth = measured(m, seq(1, s))
        assert int(at_one["activation"].subs(S, s)) == truth["activation"]
        assert int(at_one["input"].subs(S, s)) == truth["input"]


def test_lstm_cpu_onednn_workspace_is_refused():
    with pytest.raises(SymmemError, match=r"mkldnn\.flags\(enabled=False\)"):
        trace_module(_LSTM(), seq(2, 3, 4), SEQ)


def test_lstm_without_onednn_exact():
    m = _LSTM()
    with torch.backends.mkldnn.flags(enabled=False):
        t = trace_module(m, seq(2, 3, 4), SEQ)
        assert t.method == "fitted"
        for b, s in [(3, 5), (4, 7)]:
            assert traced(t, B=b, S=s) == measured(m, seq(b, s, 4))


# --- traps --------------------------------------------------------------------------------------------------
class _Pad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return nn.functional.pad(self.fc(x), (0, 0, 0, 1)).sigmoid()


def test_constant_pad_nd_stays_symbolic(monkeypatch):
    """constant_pad_nd's fake kernel reads concrete sizes (Eq(B, 2)); its Python decomposition does not."""
    x = torch.randn(2, 6, 4)
    t = trace_module(_Pad(), (x,), SEQ, method="symbolic")
    assert t.activations == 16 * B * S + 16 * B and t.guards == ()
    import symmem.importer.runs as tr

    monkeypatch.setattr(tr, "overrides", dict)
    with pytest.raises(SymmemError, match="specializes"):
        trace_module(_Pad(), (x,), SEQ, method="symbolic")


class _Token(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return self.fc(x).sigmoid()


def test_equal_example_sizes_stay_distinct():
    t = trace_module(_Token(), (torch.randn(3, 3, 4),), SEQ)
    assert t.activations == 16 * B * S and t.input == 16 * B * S


class _Pin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        n = int(x.shape[0])  # the size as a Python number: PyTorch specializes on it
        return self.fc(x).reshape(n, -1).sigmoid()


class _Branch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        y = self.fc(x)
        return y.sigmoid() if x.shape[1] == 8 else y.relu()


def test_a_pinned_size_is_fitted_never_constant():
    m = _Pin()
    t = trace_module(m, (torch.randn(6, 4),), {"B": [(0, 0)]})
    assert t.method == "fitted" and t.activations == 16 * B
    assert measured(m, (torch.randn(9, 4),))["activation"] == t.value("activations", B=9)
    with pytest.raises(SymmemError, match="specializes"):
        trace_module(m, (torch.randn(6, 4),), {"B": [(0, 0)]}, method="symbolic")


def test_a_branch_on_one_size_is_retraced_elsewhere():
    m = _Branch()
    t = trace_module(m, (torch.randn(2, 8, 4),), SEQ)
    assert t.method == "retraced" and sympy.Ne(S, 8) in t.domain.args and not t.holds_at(S=8)
    assert t.values == {"B": 2, "S": 16}
    assert traced(t, B=3, S=5) == measured(m, (torch.randn(3, 5, 4),))


# --- bad input --------------------------------------------------------------------------------------------
class _Item(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return self.fc(x) * (int(x.abs().sum().item()) % 3 + 1)


class _Nonzero(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return self.fc(x[torch.nonzero(x[:, 0] > 0).squeeze(1)]).sigmoid()


def test_data_dependent_modules_name_the_op_and_the_way_out():
    x = torch.randn(6, 4)
    with pytest.raises(SymmemError, match=r"op item .*method='fit'"):
        trace_module(_Item(), (x,), {"B": [(0, 0)]})
    with pytest.raises(SymmemError, match=r"aten.nonzero.*method='fit'"):
        trace_module(_Nonzero(), (x,), {"B": [(0, 0)]})
    t = trace_module(_Item(), (x,), {"B": [(0, 0)]}, method="fit")
    assert t.method == "fitted" and t.check.exact and t.input == 16 * B


class _Pinned(nn.Module):
    """Reads its batch size as a Python integer: every trace specializes on it (as torch 2.11's ``linear`` does
    with a 3-D input's sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return self.fc(x).reshape(int(x.shape[0]), 2, 2)


class _PinnedQuartic(nn.Module):
    """Pins its batch size and keeps 4*B**4 bytes: no polynomial fit of degree <= 3 holds."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        n = int(x.shape[0])
        return (self.fc(x).sum() * torch.ones(n**4)).sum()


@pytest.mark.parametrize("version, says", [("2.11.0+cu130", True), ("2.13.0+cpu", False),  # the first that does not
                                           pytest.param("2.14.1", False, marks=pytest.mark.deep)])  # lines: 2.13.0's
def test_a_torch_that_pins_sizes_is_named(monkeypatch, version, says):
    """Oracle: the version string itself; with a release before 2.13 the fallback to a fit (and the refusal under
    method='symbolic') say that torch pins the sizes."""
    monkeypatch.setattr(torch, "__version__", version)
    x = torch.randn(3, 4)
    t = trace_module(_Pinned(), (x,), {"B": [(0, 0)]})
    assert t.method == "fitted" and t.check.exact
    assert any(f"torch {version} reads the sizes" in n for n in t.notes) is says
    with pytest.raises(SymmemError, match="specializes on its sizes at every example") as info:
        trace_module(_Pinned(), (x,), {"B": [(0, 0)]}, method="symbolic")
    assert (f"torch {version}" in str(info.value)) is says
    with pytest.raises(SymmemError, match="no exact polynomial") as info:  # the fit fails too: why it was tried
        trace_module(_PinnedQuartic(), (x,), {"B": [(0, 0)]})
    assert (f"torch {version}" in str(info.value)) is says


@pytest.mark.parametrize("inputs, dims, message", [
    ((torch.zeros(2, 4),), {"B": [(1, 0)]}, "input position 1 does not exist"),
    ((torch.zeros(2, 4),), {"B": [("x", 0)]}, "unknown input 'x'"),
    ({"x": torch.zeros(2, 4)}, {"B": [("y", 0)]}, "unknown input 'y'; keyword inputs: x"),
    ((torch.zeros(2, 4),), {"B": [(0, 2)]}, "has 2 dimensions .* dimension 2 is out of range"),
    ((torch.zeros(2, 4), torch.zeros(3, 4)), {"B": [(0, 0), (1, 0)]}, "positions must agree"),
    ((torch.zeros(1, 4),), {"B": [(0, 0)]}, "sizes >= 2"),
    ((torch.zeros(2, 4), 3), {"B": [(1, 0)]}, "is a int, not a tensor"),
    ((torch.zeros(2, 4),), {"B": "0"}, "pair"),
])
def test_bad_input(inputs, dims, message):
    with pytest.raises(SymmemError, match=message):
        trace_module(nn.Linear(4, 4), inputs, dims)


def test_bad_options():
    x = (torch.zeros(2, 4),)
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:  # a CUDA build traces CUDA
        with pytest.raises(SymmemError, match="fake CUDA tracing needs a CUDA build of torch"):
            trace_module(nn.Linear(4, 4), x, {"B": [(0, 0)]}, device="cuda")
    with pytest.raises(SymmemError, match="method must be"):
        trace_module(nn.Linear(4, 4), x, {"B": [(0, 0)]}, method="guess")
    with pytest.raises(SymmemError, match="torch.nn.Module"):
        trace_module(lambda t: t, x, {"B": [(0, 0)]})
    with pytest.raises(SymmemError, match="multiple of 32 and at least 64"):
        trace_module(nn.Linear(4, 4), x, {"B": [(0, 0)]}, multiple_of={"B": 32})
    with pytest.raises(SymmemError, match="not a declared symbol"):
        trace_module(nn.Linear(4, 4), x, {"B": [(0, 0)]}, multiple_of={"Hi": 32})


def test_trace_leaves_the_module_as_it_was():
    m = _cnn().eval()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    trace_module(m, image(2, 8, 8), IMAGE)
    assert not m.training and all(not sub.training for sub in m.modules())
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # BN statistics restored


def test_a_fitted_domain_restricts_only_the_sizes_that_round():
    """Issue 22 item 19: a fit whose check off the examples' multiples failed put every fitted size on those
    multiples (``Mod(B, 2) = 0`` too), though only the image sides round in a stride-2 convolution.  Now each size is
    tried off its multiples alone: the domain names Hi and Wi, and the formula equals autograd's saved bytes at odd
    batches (the truth)."""
    import symmem
    from symmem.record.verify import measure

    class Strided(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.head = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(torch.relu(self.conv(x)).mean((2, 3)))

    d = symmem.trace(Strided(), (torch.randn(2, 3, 6, 6),), {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]},
                     method="fit")
    Hi, Wi = symmem.symbol("Hi"), symmem.symbol("Wi")
    mods = {a.args[0] for a in d.domain.atoms(sympy.Eq) if isinstance(a.args[0], sympy.Mod)}
    assert {m.args[0] for m in mods} == {Hi, Wi}
    for b, hi, wi in [(3, 12, 18), (5, 6, 12)]:
        at, real = d.at(B=b, Hi=hi, Wi=wi), measure(Strided(), torch.randn(b, 3, hi, wi))
        assert at.value("activations") + at.value("input") == real.activations + real.input


def test_a_module_fake_tensors_cannot_run_is_fitted_by_auto(capfd):
    """Issue 22 item 17: Mixtral's grouped-mm experts in FP32 fail on fake tensors (the fake kernel wants bfloat16;
    the CPU kernel runs float32).  ``auto`` now falls back to real traces at concrete sizes, and the formula equals
    autograd's saved bytes at sizes never traced; ``symbolic`` says to use ``fit``."""
    transformers = tf()
    import symmem
    from symmem.record.verify import measure

    config = transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                                        num_local_experts=4, num_experts_per_tok=2)
    model = hf(config, transformers.MixtralForCausalLM, "sdpa")
    ids = torch.randint(0, 96, (2, 8))
    seq = {"B": [(0, 0)], "S": [(0, 1)]}
    with pytest.raises(symmem.SymmemError, match="_grouped_mm.*method='fit' traces real tensors"):
        symmem.trace(model, (ids,), seq, method="symbolic")
    d = symmem.trace(model, (ids,), seq)
    assert "failed while attempting to run meta" not in capfd.readouterr().err  # symmem says it, once
    at, real = d.at(B=3, S=11), measure(model, torch.randint(0, 96, (3, 11)))
    assert at.value("activations") + at.value("input") == real.activations + real.input
