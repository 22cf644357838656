"""A learned position table caps the tokens: past its rows the real module raises, so symmem warns or refuses there.

One table, every model with an absolute position table symmem derives: Hugging Face GPT-2 (``n_positions = 16``)
traced at concrete sizes, fitted in its own sizes (``sizes=``, the command line's ``--symbolic``: its peak in every
size too) and with the table's rows a symbol of their own (``P = n_positions``: ``S <= P``); BERT
(``max_position_embeddings = 24``); the built-in ``gpt2`` (1,024 rows) and ``bert-base`` (512).  Truth: real
PyTorch -- at the limit the module runs and symmem's kept bytes equal what one real forward saves (``measured``:
the saved-tensor hooks) and its peak the live-bytes tracker's (``track_step``, two steps); one past the limit the
module raises (an index past the table) and symmem says so, naming the table (``OutsideDomain``), or refuses the
peak in the same words.  Rotary models (Llama) have no table and no limit: left alone.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trace_helpers import BERT, GPT2, VOCAB, at_least_two, bert, gpt2, saved_bytes  # noqa: E402

import symmem  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.errors import OutsideDomain, SymmemError  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402

transformers.logging.set_verbosity_error()
TEXT = {"B": [("input_ids", 0)], "S": [("input_ids", 1)]}
LABELED = {"B": [("input_ids", 0), ("labels", 0)], "S": [("input_ids", 1), ("labels", 1)]}
B = 2


def hf_gpt2(H: int = 32, P: int = 16) -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=H, n_head=2, vocab_size=VOCAB, n_positions=P, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def hf_bert(rows: int = 24) -> Any:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                  vocab_size=VOCAB, max_position_embeddings=rows)
    return transformers.BertModel(cfg)


PAD = 5  # RoBERTa's pad id: one that ids(2, 8), ids(2, 18) and ids(1, 19) never hold (unpadded inputs; asserted)


def hf_roberta(rows: int = 24) -> Any:
    """RoBERTa: positions ``cumsum(ids != pad) * (ids != pad) + pad``, from pad + 1 on unpadded inputs."""
    torch.manual_seed(0)
    cfg = transformers.RobertaConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=VOCAB, pad_token_id=PAD, max_position_embeddings=rows)
    return transformers.RobertaModel(cfg)


def hf_opt(rows: int = 24) -> Any:
    """OPT: positions ``cumsum(mask) * mask - 1`` shifted by 2, in a table of ``rows + 2``."""
    torch.manual_seed(0)
    cfg = transformers.OPTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, ffn_dim=64,
                                 vocab_size=VOCAB, max_position_embeddings=rows, word_embed_proj_dim=32)
    return transformers.OPTModel(cfg)


def ids(b: int, s: int) -> Any:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(1000 * b + s))


def labeled(H: int = 32, P: int = 16) -> tuple[Any, dict[str, Any]]:
    """``build(**sizes)`` for ``sizes=``: GPT-2 with its loss (labels), its example at 8 tokens."""
    x = ids(B, 8)
    return hf_gpt2(H, P), {"input_ids": x, "labels": x.clone()}


class LM(torch.nn.Module):
    """``model(input_ids=..., labels=...)`` with positional inputs, for the tracker; the loss is the model's."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Any, labels: Any) -> Any:
        return self.model(input_ids=x, labels=labels)


def measured(module: Any, inputs: dict[str, Any]) -> int:
    """Every byte one real forward saves for backward, parameters and buffers apart (the inputs it saves too)."""
    return saved_bytes(module, **inputs)


def real_peak(module: Any, s: int) -> int:
    """The steady peak of two real steps at (B, s): AdamW (foreach), the model's own loss."""
    x = ids(B, s)
    return track_step(LM(module), (x, x.clone()), loss=lambda out: out.loss, optimizer="adamw",
                      impl="foreach", keep_output=False).steady.bytes


def said(f: Any) -> tuple[Any, list[str]]:
    """``f()`` and the OutsideDomain warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f()
    return out, [str(w.message) for w in caught if issubclass(w.category, OutsideDomain)]


# -- the cases: id -> (derivation, {symbol: number} at the limit, the limit's symbol, the real module there) -------
def _gpt2_traced() -> Any:
    x = ids(B, 8)
    return symmem.trace(hf_gpt2(), {"input_ids": x, "labels": x.clone()}, LABELED, loss="output",
                        optimizer="adamw", optimizer_impl="foreach")


def _gpt2_sized() -> Any:
    return symmem.trace(labeled, dims=LABELED, sizes={"H": 32}, peak=True, loss="output", optimizer="adamw",
                        optimizer_impl="foreach")


def _gpt2_rows() -> Any:
    return symmem.trace(labeled, dims=LABELED, sizes={"H": 32, "P": 16}, loss="output")


def _bert_traced() -> Any:
    return symmem.trace(hf_bert(), {"input_ids": ids(B, 8)}, TEXT)


def _roberta_traced() -> Any:
    return symmem.trace(hf_roberta(), {"input_ids": ids(B, 8)}, TEXT)


def _opt_traced() -> Any:
    return symmem.trace(hf_opt(), {"input_ids": ids(B, 8)}, TEXT)


def _zoo(name: str, values: dict[str, int]) -> Any:
    return symmem.derive(name, convention="pytorch", options={"device": "cpu"}, values=values,
                         free=("B", "S", "L"), attention="sdpa", dropout=0.0)


CASES = {
    # id: (derivation, numbers at the limit (S last), the table's rows there, the real module at those numbers,
    #      whether the peak is compared, the table's words)
    "hf-gpt2": (_gpt2_traced, {"S": 16}, lambda: hf_gpt2(), True, "transformer.wpe has 16 rows (n_positions = 16)"),
    "hf-gpt2-sizes": (_gpt2_sized, {"S": 16}, lambda: hf_gpt2(), True,
                      "transformer.wpe has 16 rows (n_positions = 16)"),
    "hf-gpt2-rows-a-size": (_gpt2_rows, {"P": 24, "S": 24}, lambda: hf_gpt2(P=24), False,
                            "transformer.wpe has P rows"),
    "hf-bert": (_bert_traced, {"S": 24}, lambda: hf_bert(), False,
                "embeddings.position_embeddings has 24 rows (max_position_embeddings = 24)"),
    # the config says 24 positions, the forward looks up S + PAD (stop 44: the config's S <= 24 claimed S = 19-24)
    "hf-roberta": (_roberta_traced, {"S": 24 - PAD - 1}, lambda: hf_roberta(), False,
                   f"embeddings.position_embeddings has 24 rows (looked up at positions up to S + {PAD})"),
    # a table of 26 rows for 24 positions: no config bound found it (stop 44: none was said)
    "hf-opt": (_opt_traced, {"S": 24}, lambda: hf_opt(), False,
               "decoder.embed_positions has 26 rows (looked up at positions up to S + 1)"),
    "gpt2": (lambda: _zoo("gpt2", {**GPT2, "L": 2}), {"S": 1024}, lambda: gpt2("sdpa", 0.0), False,
             "wpe has 1,024 rows"),
    "bert-base": (lambda: _zoo("bert-base", {**BERT, "L": 2}), {"S": 512}, lambda: bert("sdpa", 0.0), False,
                  "embeddings.position_embeddings has 512 rows"),
}


@pytest.fixture(scope="module")
def derived() -> dict[str, Any]:
    return {}


@pytest.mark.parametrize("case", list(CASES))
def test_at_the_table_symmem_equals_pytorch_and_one_past_it_both_refuse(derived, case):
    make, limit, real, with_peak, table = CASES[case]
    d = derived.setdefault(case, make())
    sizes = {"B": B, **limit}
    s = limit["S"]
    inside, words = said(lambda: d.at(**sizes))
    assert words == []
    module = real()
    x = ids(B, s)
    if case == "hf-roberta":  # unpadded: its positions run from PAD + 1 to PAD + S
        assert not any(bool((t == PAD).any()) for t in (ids(B, 8), x, ids(1, s + 1)))
    labels = case.startswith("hf-gpt2")  # traced with the model's own loss: the labels are an input
    kept = d.activations + d.input + d.loss
    if case in ("gpt2", "bert-base"):  # the zoo's formula for B >= 2, as tests/test_zoo_drift.py compares it
        kept = at_least_two(kept)
    assert inside.evaluate(kept) == measured(module, {"input_ids": x, **({"labels": x.clone()} if labels else {})})
    if with_peak:
        assert inside.value("peak") == real_peak(module, s)
    # one past the table: the real module raises (GPT-2: an index past its rows; BERT: its position ids, a slice
    # of a 24-long buffer, do not expand to 25), symmem says why
    with pytest.raises((IndexError, RuntimeError)):
        module(input_ids=ids(1, s + 1))
    past, words = said(lambda: d.at(**{**sizes, "S": s + 1}))
    assert len(words) == 1 and "fails: past the model's position table: " + table in words[0], words
    assert words[0].startswith(f"S = {s + 1:,} lies outside") or words[0].startswith("P = 24, S = 25 lie outside")
    _, words = said(lambda: d.values("total", S=[s, s + 1]))
    assert len(words) == 1 and table in words[0], words
    if case == "hf-gpt2-sizes":  # the peak in every size past the table: refused in the same words
        with pytest.raises(SymmemError, match="position table: transformer.wpe has 16 rows"):
            past.value("peak")
        with pytest.raises(SymmemError, match="position table"), warnings.catch_warnings():
            warnings.simplefilter("ignore", OutsideDomain)
            d.values("peak", S=[s, s + 1])


def test_the_command_line_says_the_table_and_caps_the_fit(capsys):
    """``--symbolic``: ``--set S=17`` past GPT-2's 16 positions is one warning line naming the table (the tree
    before printed the numbers silently), the peak in every size is refused there, and ``fit --solve S`` caps at
    16 (the tree before said S = 3,260 at 1 GiB)."""
    config = ["--config", "n_layer=2", "--config", "n_embd=32", "--config", "n_head=2", "--config",
              f"vocab_size={VOCAB}", "--config", "n_positions=16"]
    assert main(["derive", "hf:gpt2", "--dims", "B,S", *config, "--symbolic", "H=n_embd", "--symbolic-peak",
                 "--set", "S=17"]) == 0
    out, err = capsys.readouterr()
    assert "symmem: warning: S = 17 lies outside the formulas' domain (S <= 16 fails: past the model's position " \
           "table: transformer.wpe has 16 rows (n_positions = 16))" in err
    assert "no peak: the peak in every size: S = 17 lies outside" in out
    assert main(["fit", "hf:gpt2", "--dims", "B,S", *config, "--symbolic", "H=n_embd", "--solve", "S",
                 "--set", "B=2", "--budget", "1GiB"]) == 0
    out, _ = capsys.readouterr()
    assert "largest S = 16 " in out and "capped at S = 16" in out and "position table" in out
    # the truth: this GPT-2 runs 16 tokens and refuses 17
    module = hf_gpt2()
    module(input_ids=ids(1, 16))
    with pytest.raises(IndexError):
        module(input_ids=ids(1, 17))


def test_opt_with_its_attention_mask_given_is_capped_the_same():
    """OPT counts its positions from the attention mask: given as an input (all ones: the unpadded inputs every trace
    assumes), the bound is the one it has without it, ``S <= 24`` of 26 rows."""
    masked = {n: [("input_ids", d), ("attention_mask", d)] for n, d in (("B", 0), ("S", 1))}
    x = ids(B, 8)
    module = hf_opt()
    d = symmem.trace(module, {"input_ids": x, "attention_mask": torch.ones_like(x)}, masked)
    assert {str(c): w for c, w in d.why.items()} == {"S <= 24": "past the model's position table: "
                                                     "decoder.embed_positions has 26 rows (looked up at positions up "
                                                     "to S + 1)"}
    x = ids(B, 24)
    inside, words = said(lambda: d.at(B=B, S=24))
    assert words == []
    assert inside.evaluate(d.activations + d.input + d.loss) == measured(module, {"input_ids": x,
                                                                                  "attention_mask": torch.ones_like(x)})
    x = ids(1, 25)
    with pytest.raises(IndexError):
        module(input_ids=x, attention_mask=torch.ones_like(x))
    _, words = said(lambda: d.at(B=B, S=25))
    assert len(words) == 1 and "decoder.embed_positions has 26 rows" in words[0]
