"""``hf:`` is what users have: a Hub id (its config.json from the local Hugging Face cache), a local directory or a
config.json, or a model type; encoder-decoders get decoder inputs.  Fully offline: the configs are written to
``tmp_path`` and the Hub cache is a directory laid out as huggingface_hub lays one out
(``models--org--name/refs/main`` and ``snapshots/<commit>/config.json``), with ``HF_HUB_OFFLINE=1``.

Truths: a tiny BART's traced kept bytes against the tensors autograd saves in a real forward
(:func:`symmem.record.verify.measure`), its traced peak against a real tracked training step
(:func:`symmem.record.steps.track_step`), both at sizes never traced; the Hub-id route against the model-type route
with the same keys; the model transformers builds from the file (its parameters, its class).
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from symmem import SymmemError  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.importer import hub, sources  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402

pytestmark = pytest.mark.slow  # real PyTorch steps and measurements

#: a tiny BART (2 + 2 layers, hidden 32): what its config.json holds
BART = {"model_type": "bart", "d_model": 32, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "encoder_layers": 2,
        "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4, "vocab_size": 96,
        "max_position_embeddings": 64}
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "tiny-org/tiny-bart"


def hub_cache(root, repo: str, config: dict) -> None:
    """A Hugging Face hub cache under ``root`` holding ``repo``'s config.json at ``main`` (no weights)."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    (folder / "snapshots" / COMMIT).mkdir(parents=True)
    (folder / "snapshots" / COMMIT / "config.json").write_text(json.dumps(config))


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """HF_HOME at an empty tmp directory, offline: ``hub`` is its hub cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


class Positional(torch.nn.Module):
    """``model(**dict(zip(names, inputs)))``: keyword inputs for the tracker, which passes them by position."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor):  # type: ignore[no-untyped-def]
        return self.model(**dict(zip(self.names, inputs, strict=True)))


@pytest.fixture(scope="module")
def bart():
    """The tiny BART from a Hub id in the cache, traced with its LM loss at B=3, S=5 (traced at 2 and 8), and from
    the model type with the same keys, built (the trace is a function of what is built: the module, its inputs, the
    loss; the first test compares those)."""
    keys = {k: v for k, v in BART.items() if k != "model_type"}
    with pytest.MonkeyPatch.context() as mp:
        import tempfile
        from pathlib import Path

        root = Path(tempfile.mkdtemp())
        hub_cache(root, REPO, BART)
        mp.setenv("HF_HUB_CACHE", str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        out = {}
        for spec, config in ((f"hf:{REPO}", {}), ("hf:bart", keys)):
            loaded = sources.load(spec, config=config, loss="cross-entropy")
            dims = sources.parse_dims("B,S", loaded)
            d = sources.trace(loaded, dims, values={"B": 3, "S": 5}, optimizer="adamw",
                              keep_logits=False) if spec != "hf:bart" else None
            out[spec] = (loaded, dims, d)
    return out


def _built(loaded) -> tuple:
    """What a trace of ``loaded`` reads: its class, every parameter and buffer (name, shape, dtype, values), the
    example inputs, the inputs that follow the first and the loss."""
    m = loaded.module
    return (type(m), [(n, tuple(t.shape), t.dtype, t.detach().tolist()) for n, t in m.named_parameters()],
            [(n, tuple(t.shape), t.dtype, t.tolist()) for n, t in m.named_buffers()],
            [(k, t.tolist()) for k, t in loaded.example_inputs.items()], loaded.follow, loaded.loss)


def test_a_hub_id_from_the_cache_is_the_model_types_model(bart):
    (hub_loaded, hub_dims, from_hub), (type_loaded, type_dims, _) = bart[f"hf:{REPO}"], bart["hf:bart"]
    assert type(hub_loaded.module).__name__ == "BartForConditionalGeneration"
    assert sorted(hub_loaded.example_inputs) == ["decoder_input_ids", "input_ids", "labels"]
    assert any(n.startswith("config: ") and n.endswith("config.json") for n in hub_loaded.notes)
    # the same model, inputs and loss as the model type's: the same trace (one made, in the fixture)
    assert _built(hub_loaded) == _built(type_loaded) and hub_dims == type_dims
    assert hub_loaded.module.config.to_diff_dict() == type_loaded.module.config.to_diff_dict()
    assert from_hub.value("peak") > 0


def test_an_encoder_decoder_keeps_what_autograd_saves_and_peaks_as_a_real_step(bart):
    """Tiny BART with its own LM loss: the formula at B=3, S=5 against the tensors a real forward saves, and the peak
    against two real AdamW steps."""
    loaded, dims, d = bart[f"hf:{REPO}"]
    kept = sources.verify_module(loaded, d, dims)
    assert kept.exact and not kept.differences(), kept.report()
    assert kept.measured > 0 and kept.measured_input == 3 * 5 * 8 * 3  # input_ids, decoder_input_ids, labels
    names = list(loaded.example_inputs)
    _, inputs = sources.resized(loaded, dims, {"B": 3, "S": 5})
    fresh = sources.load("hf:bart", config={k: v for k, v in BART.items() if k != "model_type"},
                         loss="cross-entropy").module
    real = track_step(Positional(fresh, names), tuple(inputs[n] for n in names), loss=lambda out: out.loss,
                      optimizer="adamw", keep_output=False)
    assert (d.value("peak_first_step"), d.value("peak")) == (real.first.bytes, real.steady.bytes)


def test_a_directory_and_a_config_json_build_the_hub_ids_model(tmp_path, offline):
    hub_cache(offline, REPO, BART)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(BART))
    (tmp_path / "tiny.json").write_text(json.dumps(BART))

    def built(spec: str) -> list:
        module = sources.load(spec).module
        return [(n, tuple(p.shape), p.dtype, float(p.sum())) for n, p in module.named_parameters()]

    reference = built(f"hf:{REPO}")
    assert built(f"hf:{tmp_path / 'model'}") == reference == built(f"hf:{tmp_path / 'tiny.json'}")
    keys = {k: v for k, v in BART.items() if k != "model_type"}
    assert [(n, s, t) for n, s, t, _ in reference] == [
        (n, tuple(p.shape), p.dtype) for n, p in sources.load("hf:bart", config=keys).module.named_parameters()]
    # --config still overrides the file's keys, derived ones following (head sizes from d_model)
    two = sources.load(f"hf:{tmp_path / 'tiny.json'}", config={"decoder_layers": 1, "d_model": 16}).module
    assert len(two.model.decoder.layers) == 1 and two.model.shared.weight.shape == (96, 16)


def test_t5_gets_decoder_inputs_shaped_like_its_input():
    t5 = {"d_model": 32, "d_ff": 64, "num_layers": 2, "num_heads": 4, "d_kv": 8, "vocab_size": 96}
    loaded = sources.load("hf:t5", config=t5)
    assert type(loaded.module).__name__ == "T5ForConditionalGeneration"
    ids, dec = loaded.example_inputs["input_ids"], loaded.example_inputs["decoder_input_ids"]
    assert dec.shape == ids.shape and dec.dtype == torch.int64 and loaded.follow == ("decoder_input_ids",)
    assert sources.parse_dims("B,S", loaded) == {"B": [("input_ids", 0), ("decoder_input_ids", 0)],
                                                 "S": [("input_ids", 1), ("decoder_input_ids", 1)]}
    with_loss = sources.load("hf:t5", config=t5, loss="cross-entropy")
    assert with_loss.follow == ("decoder_input_ids", "labels") and with_loss.loss == "cross-entropy"
    # the model runs on them (its own loss from the labels)
    assert torch.isfinite(with_loss.module(**with_loss.example_inputs).loss)


def test_a_config_in_another_dtype_builds_in_it_and_says_so(tmp_path, offline):
    (tmp_path / "config.json").write_text(json.dumps({**BART, "torch_dtype": "bfloat16"}))
    loaded = sources.load(f"hf:{tmp_path}")
    assert {p.dtype for p in loaded.module.parameters()} == {torch.bfloat16}
    assert any("bfloat16, the config's dtype" in n for n in loaded.notes)
    fp32 = sources.load(f"hf:{tmp_path}", config={"dtype": "float32"})
    assert {p.dtype for p in fp32.module.parameters()} == {torch.float32}


def test_the_forms_of_hf_targets(tmp_path, monkeypatch):
    assert [hub.kind_of(t) for t in ("gpt2", "openai-community/gpt2", "a/b/config.json", "./m", "x.json")] == [
        "model type", "hub", "path", "path", "path"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gpt2").mkdir()  # a directory named like a model type, without a config.json: not a model
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text(json.dumps(BART))
    assert [hub.kind_of(t) for t in ("gpt2", "mine", "gpt2/")] == ["model type", "path", "path"]


def errors_of(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "untyped.json").write_text(json.dumps({"d_model": 32}))
    (tmp_path / "alien.json").write_text(json.dumps({"model_type": "gpt3"}))
    (tmp_path / "wrong.json").write_text(json.dumps({**BART, "d_model": "wide"}))
    return [
        ("no-org/not-cached", "not in the Hugging Face cache"),
        ("no-org/not-cached", "set HF_HUB_OFFLINE=0 to fetch it, or download its config.json and pass the path"),
        (str(tmp_path / "empty"), "the directory holds no config.json"),
        (str(tmp_path / "missing.json"), "no such file or directory"),
        (str(tmp_path / "bad.json"), "is not JSON (line 1, column 2"),
        (str(tmp_path / "list.json"), "holds a JSON list, not a config"),
        (str(tmp_path / "untyped.json"), "has no model_type"),
        (str(tmp_path / "alien.json"), "unknown model type 'gpt3' (the model_type of"),
        (str(tmp_path / "wrong.json"), "BartConfig refuses the keys of"),
        ("bad id/x", "not a Hub id"),
        ("", "hf: names no model"),
    ]


def test_bad_targets_are_one_line_errors(tmp_path, offline, capsys):
    for target, fragment in errors_of(tmp_path):
        with pytest.raises(SymmemError, match=None) as e:
            sources.load(f"hf:{target}")
        assert fragment in str(e.value) and "\n" not in str(e.value), (target, str(e.value))
    assert main(["trace", "hf:no-org/not-cached", "--dims", "B,S"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("symmem: error: hf:no-org/not-cached: ") and err.count("\n") == 1


def test_a_hub_id_online_with_the_hub_unreachable_says_the_way_out(offline, monkeypatch):
    """Online allowed, the Hub at a closed local port: refused at once (huggingface_hub itself retries for ~25 s)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(SymmemError, match=r"the Hub \(http://127.0.0.1:9\) cannot be reached .*download its "
                                          r"config.json and pass the path"):
        hub.locate("no-org/not-cached")
