"""The peak of a traced module's training step (symmem.trace) against real steps
(symmem.record.steps.track_step), and the traced formulas under autocast, a bfloat16 module, activation
checkpointing and at size one against real forwards.

Every module is traced once at small example sizes; the formulas are compared with real PyTorch at sizes (and layer
counts) never traced.  Tiny configs: the fake step costs ~1.5 ms per aten op.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import sympy  # noqa: E402
from trace_helpers import cnn as user_cnn  # noqa: E402

import symmem  # noqa: E402
from symmem.importer.inputs import check_inputs  # noqa: E402
from symmem.importer.recording import StepOptions, record_step  # noqa: E402
from symmem.importer.wrap import autocasting, checkpointed  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402
from symmem.record.verify import measure  # noqa: E402

SEQ = {"B": [(0, 0)], "S": [(0, 1)]}
IMAGE = {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]}


def peaks(d, **values):
    at = d.at(**values)
    return at.value("peak_first_step"), at.value("peak")


def real_peaks(module, inputs, **kw):
    t = track_step(module, inputs, keep_output=False, **kw)
    return t.first.bytes, t.steady.bytes


# --- a small CNN: the peak folds to L ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cnn():
    optimizer, impl = "adam", "for-loop"
    torch.manual_seed(0)
    d = symmem.trace(user_cnn(), (torch.randn(2, 3, 8, 8),), IMAGE, optimizer=optimizer, optimizer_impl=impl,
                     loss="cross-entropy")
    return d, optimizer, impl


@pytest.mark.parametrize("layers, b, hi, wi", [(6, 5, 12, 16), (2, 3, 9, 9)])
def test_cnn_peak_equals_real_steps(cnn, layers, b, hi, wi):
    d, optimizer, impl = cnn
    L = symmem.symbol("L")
    assert d.peak.has(L) and "interpolated in L" in " ".join(d.step.notes)
    assert len(d.step.module.blocks) == 4  # the stack was written out at 4, 5 and 6 layers and put back
    torch.manual_seed(1)
    real = real_peaks(user_cnn(layers), torch.randn(b, 3, hi, wi), loss="cross-entropy", optimizer=optimizer, impl=impl)
    assert peaks(d, B=b, Hi=hi, Wi=wi, L=layers) == real


def test_peak_moment_and_views(cnn):
    d, _, _ = cnn
    at = d.at(B=3, Hi=10, Wi=6, L=6)
    moment = at.peak_at()
    assert moment.phase == "backward" and moment.layer == "L" and moment.step == "steady"
    assert sum(at.live_at_peak().values()) == at.value("peak")
    timeline = at.timeline()
    assert max(sum(v.values()) for _, _, v in timeline) == at.value("peak")
    out = d.to_dict()
    assert out["options"]["method"] == "symbolic" and out["values"]["peak"] == d.value("peak")
    assert d.table().splitlines()[0].endswith("symbolic formula; on cpu")  # how the formula was found, and where


# --- Hugging Face GPT-2 with its LM loss ---------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def gpt2(layers: int = 2):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=96, n_positions=64)
    return transformers.GPT2LMHeadModel(cfg)


class LM(torch.nn.Module):
    """``model(input_ids=..., labels=...)`` with positional inputs, for the tracker; the loss is HF's."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, labels: torch.Tensor):  # type: ignore[no-untyped-def]
        return self.model(input_ids=ids, labels=labels)


@pytest.fixture(scope="module")
def gpt():
    transformers.logging.set_verbosity_error()
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(0))
    dims = {"B": [("input_ids", 0), ("labels", 0)], "S": [("input_ids", 1), ("labels", 1)]}
    return symmem.trace(gpt2(), {"input_ids": ids, "labels": ids.clone()}, dims, loss="output", optimizer="adamw",
                        optimizer_impl="foreach")


@pytest.mark.parametrize("b, s", [(3, 5), (4, 11)])
def test_gpt2_peak_equals_real_steps(gpt, b, s):
    ids = torch.randint(0, 96, (b, s), generator=torch.Generator().manual_seed(b))
    real = real_peaks(LM(gpt2()), (ids, ids.clone()), loss=lambda out: out.loss, optimizer="adamw", impl="foreach")
    assert peaks(gpt, B=b, S=s) == real  # L = 2: below the fold's domain, the step is recorded at 2 layers


# --- torch.nn.TransformerEncoder: plain, checkpointed, autocast, bfloat16 --------------------------------------------
class Encoder(torch.nn.Module):
    def __init__(self, n: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=dropout, batch_first=True)
        self.enc = torch.nn.TransformerEncoder(layer, n, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(self.proj(x))


def encoder(n: int = 2, dtype: torch.dtype = torch.float32) -> Encoder:
    torch.manual_seed(0)
    return Encoder(n).to(dtype)


class Autocast(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x)


def autocast_sum(out: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return out.sum()


REGIMES = {"plain": {"optimizer": "sgd-momentum", "optimizer_impl": "foreach"},
           "checkpoint": {"checkpoint": "full", "optimizer": "sgd"}, "autocast": {"autocast": "bfloat16",
                                                                                 "optimizer": "adamw"},
           "bfloat16": {"optimizer": "sgd"}}


@pytest.fixture(scope="module", params=list(REGIMES))
def regime(request):
    dtype = torch.bfloat16 if request.param == "bfloat16" else torch.float32
    d = symmem.trace(encoder(2, dtype), (torch.randn(2, 8, 8, dtype=dtype),), SEQ, **REGIMES[request.param])
    return request.param, dtype, d


#: (regime, L, B, S): every regime at two sizes; checkpointing's and bfloat16's second size are deep (stop 42: every
#: line they run, the kept cases run)
REGIME_SIZES = [pytest.param(name, *size, id="-".join(map(str, (name, *size))),
                             marks=[pytest.mark.deep] if (name, size) in {("checkpoint", (2, 4, 11)),
                                                                         ("bfloat16", (2, 4, 11))} else [])
                for name in REGIMES for size in ((2, 3, 5), (2, 4, 11))]


@pytest.mark.parametrize("regime, layers, b, s", REGIME_SIZES, indirect=["regime"], scope="module")
def test_regimes_equal_real_forwards_and_steps(regime, layers, b, s):
    name, dtype, d = regime
    optimizer = REGIMES[name]["optimizer"]
    impl = REGIMES[name].get("optimizer_impl", "for-loop")
    m = encoder(layers, dtype)
    x = torch.randn(b, s, 8, dtype=dtype)
    children = [f"enc.layers.{i}" for i in range(layers)] if name == "checkpoint" else []
    with checkpointed(m, children), autocasting("bfloat16" if name == "autocast" else None):
        kept = measure(m, x)
    at = d.at(B=b, S=s, L=layers)
    assert (at.value("activations"), at.value("input")) == (kept.activations, kept.input)
    with checkpointed(m, children):
        if name == "autocast":
            real = real_peaks(Autocast(m), x, loss=autocast_sum, optimizer=optimizer, impl=impl)
        else:
            real = real_peaks(m, x, optimizer=optimizer, impl=impl)
    assert peaks(d, B=b, S=s, L=layers) == real


def test_regimes_show_in_the_derivation(regime):
    name, _, d = regime
    L, B, S = symmem.symbol("L"), symmem.symbol("B"), symmem.symbol("S")
    if name == "checkpoint":  # each block keeps its input, nothing else
        assert d.activations == 32 * B * L * S and d.options["checkpoint"] == "enc.layers.0, enc.layers.1"
    if name == "autocast":
        assert d.options["autocast"] == "bfloat16"
        assert any(t.dtype == "bfloat16" for t in d.terms)


# --- size one ----------------------------------------------------------------------------------------------------
class MHA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(16, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)[0]


def test_size_one_is_exact_and_its_own_piece():
    torch.manual_seed(0)
    m = MHA()
    d = symmem.trace(m, (torch.randn(2, 8, 16),), SEQ, size_one=True, optimizer="sgd")
    B, S = symmem.symbol("B"), symmem.symbol("S")
    assert d.activations.has(sympy.Piecewise) and d.options["size_one"] is True
    # a reshape that copies for B >= 2 is a view at B = 1
    assert d.activations.subs({B: 1, S: 7}) == 16 * 7**2 + 320 * 7 != (16 * 7**2 + 384 * 7)
    assert d.domain.subs({B: 1, S: 5}) is sympy.true
    for b, s in [(1, 3), (1, 7), (3, 5), (2, 1)]:
        x = torch.randn(b, s, 16)
        kept = measure(m, x)
        at = d.at(B=b, S=s)
        assert (at.value("activations"), at.value("input")) == (kept.activations, kept.input)
        assert at.value("peak") == real_peaks(m, x, optimizer="sgd")[1]


# --- the recorder itself ------------------------------------------------------------------------------------------
def test_fake_storages_are_freed_like_real_ones():
    """One fake step, op by op, equals the tracker's real one: weakref.finalize fires on fake storages at the same
    moments as on real ones."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    inputs = check_inputs((torch.randn(2, 4),), {"B": [(0, 0)]})
    B = symmem.symbol("B")
    rec = record_step(net, inputs, {"B": 2}, {"B": B}, StepOptions(loss="cross-entropy", optimizer="adam",
                                                                   keep_output=False))
    real = track_step(net, torch.randn(5, 4), loss="cross-entropy", optimizer="adam", keep_output=False)
    ours = [(phase, sum(v.values())) for phase, _, v in rec.timeline("first", {B: 5})]
    theirs = [(r.phase, r.live) for r in real.records if r.step == 1]
    assert ours == theirs


class Dense(torch.nn.Module):
    """Every layer's output is kept for one concatenation: a storage whose size grows with the layer count."""

    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.stem = torch.nn.Linear(4, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        outs = []
        for layer in self.layers:
            x = layer(x)
            outs.append(x)
        return torch.cat(outs, -1)


def test_a_step_that_does_not_fold_is_given_at_its_own_layer_count():
    torch.manual_seed(0)
    d = symmem.trace(Dense(), (torch.randn(2, 4),), {"B": [(0, 0)]}, optimizer="sgd")
    L = symmem.symbol("L")
    assert not d.peak.has(L) and "not folded" in " ".join(d.step.notes)
    for layers, b in [(2, 3), (5, 2)]:
        real = real_peaks(Dense(layers), torch.randn(b, 4), optimizer="sgd")
        assert peaks(d, B=b, L=layers) == real


def test_regimes_the_step_does_not_run_are_refused_or_absent():
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    x = (torch.randn(2, 4),)
    with pytest.raises(symmem.SymmemError, match="^precision='mixed' .* FP32: .* autocast"):
        symmem.trace(net, x, {"B": [(0, 0)]}, precision="mixed")  # activations would stay FP32: refused
    half = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).to(torch.bfloat16)
    mixed = symmem.trace(half, tuple(t.to(torch.bfloat16) for t in x), {"B": [(0, 0)]}, precision="mixed")
    with pytest.raises(symmem.SymmemError, match="autocast"):
        _ = mixed.peak
    assert not symmem.trace(net, x, {"B": [(0, 0)]}, optimizer="lion").has_peak  # not a torch.optim optimizer
    with pytest.raises(symmem.SymmemError, match="every-K"):
        symmem.trace(net, x, {"B": [(0, 0)]}, checkpoint="every-2")


def test_allocated_peak_rounds_every_storage(cnn):
    d, _, _ = cnn
    at = d.at(B=3, Hi=10, Wi=6, L=2)
    assert at.value("peak") <= at.peak_allocated() <= at.value("peak") + 512 * 200
    assert at.peak_allocated() % 512 == 0


class _Pair(torch.nn.Module):
    """A module whose output is a tuple, a dict or a Hugging Face ModelOutput: a loss reduces its first tensor."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.fc, self.head = kind, torch.nn.Linear(8, 16), torch.nn.Linear(16, 5)

    def forward(self, x):
        h = torch.relu(self.fc(x))
        logits = self.head(h)
        if self.kind == "tuple":
            return logits, h
        if self.kind == "dict":
            return {"logits": logits, "hidden": h}
        from transformers.modeling_outputs import SequenceClassifierOutput

        return SequenceClassifierOutput(logits=logits, hidden_states=(h,))


#: (loss, kind): each loss and each kind of output once in the default suite; the other three are deep (stop 42: every
#: line they run, the kept three run)
LOSS_KINDS = [pytest.param(loss, kind, id=f"{loss}-{kind}",
                           marks=[pytest.mark.deep] if (loss, kind) in {("cross-entropy", "tuple"),
                                                                         ("cross-entropy", "dict"),
                                                                         ("sum", "model-output")} else [])
              for loss in ("cross-entropy", "sum") for kind in ("tuple", "dict", "model-output")]


@pytest.mark.parametrize("loss, kind", LOSS_KINDS)
def test_a_loss_reduces_the_first_tensor_of_any_output(kind, loss):
    """Issue 22 item 13: cross-entropy (or sum) on a module returning a tuple, a dict or a ModelOutput crashed when
    the peak was asked for; the traced peak now equals two real tracked steps (the truth) at other sizes."""
    if kind == "model-output":
        pytest.importorskip("transformers")
    torch.manual_seed(0)
    d = symmem.trace(_Pair(kind), (torch.randn(2, 8),), {"B": [(0, 0)]}, loss=loss, optimizer="adam")
    torch.manual_seed(0)
    assert peaks(d, B=7) == real_peaks(_Pair(kind), torch.randn(7, 8), loss=loss, optimizer="adam")


def _qwen2(layers: int):
    from trace_helpers import hf

    return hf("Qwen2ForCausalLM", "sdpa", hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=96, use_sliding_window=True,
              sliding_window=16, max_window_layers=0)


@pytest.fixture(scope="module")
def qwen2():
    """Qwen2 with a sliding window on every layer, traced at 3 layers (its fold's three step records made once)."""
    pytest.importorskip("transformers")
    model = _qwen2(3)
    assert model.config.layer_types == ["sliding_attention"] * 3
    return symmem.trace(model, (torch.randint(0, 96, (2, 8)),), SEQ, loss="sum", optimizer="adamw")


#: (L, B, S) of the real steps: L = 7 past the fold's records (4, 5, 6); L = 5, one of them, is deep (stop 42: its
#: lines are L = 7's)
QWEN2_STEPS = [(7, 2, 5), pytest.param(5, 3, 7, marks=pytest.mark.deep)]


@pytest.mark.parametrize("layers, b, s", QWEN2_STEPS)
def test_a_stack_with_per_layer_types_folds_in_L(qwen2, layers, b, s):
    """Issue 22 item 14: Qwen2's config carries a per-layer ``layer_types`` list, which the fold in L (the step
    written out at 4, 5 and 6 layers) once indexed past its end.  Traced at 3 layers (fewer than the fold writes out:
    before, ``layer_types[3]`` was past the end of the config's list, which now grows with the run), the peak at 7
    layers (at 5 under ``-m deep``) and other sizes equals two real tracked steps (the truth).

    Issue 23 too (since stop 39; Mistral's own fold is deep): with a sliding window on every layer, Qwen2's model
    builds transformers' ``DynamicCache`` in its own forward with one ``DynamicSlidingWindowLayer`` -- and one
    tensor -- per decoder layer before the first runs (Mistral's cache layers): ops outside the blocks whose count is
    the layer count, which the fold once refused."""
    d = qwen2
    assert symmem.symbol("L") in d.peak.free_symbols and "not folded" not in " ".join(d.step.notes)
    # the cache's tensors: one per layer, outside the blocks
    assert [sum(o.op == "aten.lift_fresh.default" and o.where == "model" for o in d.step.record(n).ops)
            for n in (4, 5)] == [4, 5]
    real = real_peaks(_qwen2(layers), torch.randint(0, 96, (b, s)), loss="sum", optimizer="adamw")
    assert peaks(d, B=b, S=s, L=layers) == real


def test_a_sequential_of_named_blocks_folds_in_L():
    """Issue 22 item 15: torchvision's VisionTransformer keeps its blocks in a Sequential of named children
    (``encoder_layer_0`` ...), whose layer count the fold could not change: no peak.  The same shape here: the
    traced peak folds in L and equals two real tracked steps of a model with another layer count (the truth)."""
    from collections import OrderedDict

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

        def forward(self, x):
            return x + torch.relu(self.fc(self.ln(x)))

    class Encoder(torch.nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.layers = torch.nn.Sequential(OrderedDict((f"encoder_layer_{i}", Block()) for i in range(n)))
            self.head = torch.nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.layers(x).mean(1))

    d = symmem.trace(Encoder(6), (torch.randn(2, 5, 16),), SEQ, optimizer="adam")
    L = symmem.symbol("L")
    # the first block keeps the batch itself (its residual input), the other five are the repeated run: L = 5
    assert L in d.peak.free_symbols and d.numbers[L] == 5
    assert peaks(d, B=3, S=7, L=4) == real_peaks(Encoder(5), torch.randn(3, 7, 16), optimizer="adam")


def _mistral(layers: int):
    from trace_helpers import hf

    return hf("MistralForCausalLM", "sdpa", hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, vocab_size=96, sliding_window=16)


def test_mistral_at_its_own_layer_count_equals_a_real_step():
    """Hugging Face Mistral (a sliding window on every layer) traced at 2 layers: the peak at its own layer count
    (below the fold's L >= 4: the step recorded at 2 layers) and other sizes equals a real tracked step (the truth).
    Its fold in L (issue 23, below) is deep; the fold over the same per-layer cache is Qwen2's with a sliding window
    (``test_a_stack_with_per_layer_types_folds_in_L``)."""
    pytest.importorskip("transformers")
    d = symmem.trace(_mistral(2), (torch.randint(0, 96, (2, 8)),), SEQ, loss="sum", optimizer="adamw")
    real = real_peaks(_mistral(2), torch.randint(0, 96, (3, 7)), loss="sum", optimizer="adamw")
    assert peaks(d, B=3, S=7, L=2) == real


@pytest.mark.deep  # three step records of its own; the same fold (per-layer cache tensors): Qwen2's, above
def test_a_cache_made_per_layer_outside_the_blocks_folds_in_L():
    """Issue 23: Mistral (a sliding window) builds transformers' ``DynamicCache`` in its model's own forward, one
    cache layer -- and one tensor -- per decoder layer before the first runs: ops outside the blocks whose count is
    the layer count.  The fold once refused them (the step was recorded at the module's own 32 layers instead, twice
    llama's time).  Traced at 6 layers, the peak at 5 and at 7 layers equals two real tracked steps (the truth)."""
    pytest.importorskip("transformers")
    build = _mistral
    d = symmem.trace(build(6), (torch.randint(0, 96, (2, 8)),), SEQ, loss="sum", optimizer="adamw")
    assert symmem.symbol("L") in d.peak.free_symbols and "not folded" not in " ".join(d.step.notes)
    for layers, b, s in [(5, 3, 7), (7, 2, 5)]:
        real = real_peaks(build(layers), torch.randint(0, 96, (b, s)), loss="sum", optimizer="adamw")
        assert peaks(d, B=b, S=s, L=layers) == real
