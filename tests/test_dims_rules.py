"""Sizes a user sets that the model ties to others: a clear one-line refusal naming the rule, never a silent number.

1. An input built with another's shape (a causal LM's ``labels`` beside ``input_ids``) must carry the same symbols:
   left at its example size, the loss's view of the logits as ``(B*S, V)`` against ``B*S`` labels pins the trace to
   ``Eq(B*S, 16)``.  The command line refused such ``--dims`` (stop 43); :func:`symmem.trace` from Python traced on
   and gave formulas that hold at one size only.  Now one check (``symmem.importer.inputs.check_companions``) makes
   both refuse, in their own words.  Truth: the real module, which refuses labels of another size (PyTorch's
   ``cross_entropy`` says the batch sizes differ) and runs with labels of the tokens' size; the command line's own
   refusal of the same ``--dims``.
2. ViT's sequence follows from the image, ``S = floor(Hi/16)*floor(Wi/16) + 1``: ``derive("vit-b16").at(S=50)``
   gave S = 50 beside the 224 x 224 image's bytes (the image term at 224, the attention at 50), and ``values(Hi=...,
   Wi=...)`` kept S at the example image's.  Now ``at``/``values`` refuse an S the image does not give, naming the
   rule and the sizes to set, and ``values`` moves S with Hi and Wi as ``at`` does.  Truth: real PyTorch's saved
   bytes of the faithful reference ViT (:func:`symmem.record.verify.verify`) at each image size.
(3. a size in the fit's domain alone, Mistral's sliding window: tests/test_symbolic_domain.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import symmem  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.errors import SymmemError  # noqa: E402
from symmem.importer.inputs import check_inputs  # noqa: E402
from symmem.importer.sources import load, parse_dims  # noqa: E402
from symmem.record.verify import verify  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GPT2 = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32}
CLI_GPT2 = [x for k, v in GPT2.items() for x in ("--config", f"{k}={v}")]


def lm(**sizes: int) -> tuple[Any, dict[str, Any]]:
    """A tiny Hugging Face GPT-2 given its labels, as ``symmem trace hf:gpt2 --loss cross-entropy`` builds it (also
    a ``build(**sizes)`` for ``sizes=``)."""
    loaded = load("hf:gpt2", config={**GPT2, **sizes}, loss="cross-entropy")
    return loaded.module, loaded.example_inputs


ON_BOTH = {"B": [("input_ids", 0), ("labels", 0)], "S": [("input_ids", 1), ("labels", 1)]}
#: id: (dims from Python, the same --dims on the command line, the refusal's words; None: accepted)
COMPANIONS = {
    "tokens-only": ({"B": [("input_ids", 0)], "S": [("input_ids", 1)]}, "B=input_ids:0,S=input_ids:1",
                    "B is dimension 0 of input 'input_ids'; declare it on 'labels' too"),
    "S-on-tokens-only": ({"B": ON_BOTH["B"], "S": [("input_ids", 1)]}, "B=input_ids:0,B=labels:0,S=input_ids:1",
                         "S is dimension 1 of input 'input_ids'; declare it on 'labels' too"),
    "both": (ON_BOTH, "B=input_ids:0,B=labels:0,S=input_ids:1,S=labels:1", None),
    "conventional": (ON_BOTH, "B,S", None),
}


@pytest.mark.parametrize("case", list(COMPANIONS))
def test_a_companion_input_carries_the_symbols_from_python_as_on_the_command_line(case, capsys, monkeypatch):
    dims, flag, words = COMPANIONS[case]
    module, inputs = lm()
    if words is None:
        assert check_inputs(inputs, dims).examples == {"B": 2, "S": 8}  # what the trace then runs
        assert parse_dims(flag, load("hf:gpt2", config=GPT2, loss="cross-entropy")) == dims
        return
    # from Python: refused before anything is traced, naming the pairs to add (the module, and a build of sizes)
    with pytest.raises(SymmemError, match=words.replace("(", r"\(")) as refused:
        symmem.trace(module, inputs, dims, loss="output")
    assert "\n" not in str(refused.value) and "('labels', " in str(refused.value)
    with pytest.raises(SymmemError, match=words):
        symmem.trace(lm, dims=dims, sizes={"n_embd": 32}, loss="output")
    # the command line: the same rule in --dims words, one line, exit 2
    monkeypatch.chdir(ROOT)
    assert main(["trace", "hf:gpt2", *CLI_GPT2, "--loss", "cross-entropy", "--dims", flag]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and words.replace("input ", "") in err, err
    # the real module: labels of another size than the tokens are refused by PyTorch itself, the tokens' size runs
    ids = torch.randint(0, GPT2["vocab_size"], (3, 5))
    with pytest.raises(ValueError, match="batch_size"):
        module(input_ids=ids, labels=inputs["labels"])
    assert module(input_ids=ids, labels=ids.clone()).loss.shape == ()


def test_a_same_shaped_input_of_any_module_is_a_companion():
    """Any module, positional inputs: a second input of the first's shape is declared too, or given a symbol of its
    own; an input of another shape (a class target) is the module's own business."""
    x = torch.zeros(2, 6)
    with pytest.raises(SymmemError, match=r"declare it on 1 too \('B': \[\(0, 0\), \(1, 0\)\]\)"):
        check_inputs((x, x.clone()), {"B": [(0, 0)]})
    assert check_inputs((x, x.clone()), {"B": [(0, 0), (1, 0)]}).examples == {"B": 2}
    assert check_inputs((x, torch.zeros(2, dtype=torch.long)), {"B": [(0, 0)]}).examples == {"B": 2}


# -- 2: ViT's S follows from the image -----------------------------------------------------------------------------
TINY_VIT = {"H": 16, "h": 2, "L": 2, "K": 10}
OPTIONS = {"convention": "pytorch", "options": {"device": "cpu"}, "attention": "sdpa", "dropout": 0.0}
RULE = "S = floor(Hi/16)*floor(Wi/16) + 1"


def test_vit_sequence_moves_with_the_image_and_a_contrary_one_is_refused():
    """``values`` over image sizes equals real PyTorch at each (S moved with Hi, Wi); an S the image does not give is
    refused by ``at`` and ``values`` with the rule and the sizes that give it (a square image where there is one)."""
    d = symmem.derive("vit-ti16", values={**TINY_VIT, "B": 2, "Hi": 32, "Wi": 32}, free=("B", "S", "Hi", "Wi"),
                      **OPTIONS)
    images = [(2, 32, 32), (3, 32, 64), (2, 64, 64)]  # 5, 9 and 17 tokens
    got = d.values("activations", B=[b for b, _, _ in images], Hi=[h for _, h, _ in images],
                   Wi=[w for _, _, w in images])
    for (b, hi, wi), value in zip(images, got.tolist(), strict=True):
        real = verify(d.at(B=b, Hi=hi, Wi=wi)).measured
        assert value == real, (b, hi, wi)
    assert d.at(S=5).numbers == d.numbers  # the S the image gives is no contradiction
    refusals = [
        (lambda: d.at(S=17), f"{RULE}, which is 5 at Hi = 32, Wi = 32, not 17; set Hi and Wi instead of S "
                             "(at(Hi=64, Wi=64) moves S with them for S = 17)"),
        (lambda: d.at(S=9, Hi=64, Wi=64), "which is 17 at Hi = 64, Wi = 64, not 9"),
        (lambda: d.values("activations", Hi=[32, 64], Wi=[32, 64], S=17), "which is 5 at Hi = 32, Wi = 32, not 17"),
        # the image a number (the default free symbols): derive again with it
        (lambda: symmem.derive("vit-ti16", values={**TINY_VIT, "Hi": 32, "Wi": 32}, **OPTIONS).at(S=18),
         "not 18; set Hi and Wi instead of S (derive again with values={'Hi': ..., 'Wi': ...})"),
    ]
    for call, words in refusals:
        with pytest.raises(SymmemError, match="S follows from Hi, Wi: ") as refused:
            call()
        assert words in str(refused.value) and "\n" not in str(refused.value)
