"""Fine-tuning: a LoRA model built with ``peft`` traces with its adapters as the only trainable parameters, frozen
weights count as weights only, in their own dtype, and docs/fine-tuning.md runs (that one under ``-m deep``).

Truths: the tensors PyTorch itself holds after a real AdamW step (every parameter, the gradients it made, the
optimizer's state, its ``step`` counters left out as the parameter side leaves them out), and the peak of real
tracked training steps (:func:`symmem.record.steps.track_step`) at sizes never traced.  Tiny Llama configs (2 layers,
hidden 32), LoRA r=4 on q_proj and v_proj.
"""

from __future__ import annotations

import doctest
import importlib.util
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("peft") is None:  # imported where a test builds a model: collecting it costs no import
    pytest.skip("could not import 'peft'", allow_module_level=True)

import symmem  # noqa: E402
from symmem.importer.wrap import checkpointed, find_repeat  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402

pytestmark = pytest.mark.slow  # real PyTorch steps

DIMS = {"B": [("input_ids", 0), ("labels", 0)], "S": [("input_ids", 1), ("labels", 1)]}
AT = {"B": 3, "S": 5}
#: the variants: the base model's dtype (LoRA's adapters stay FP32: peft's autocast_adapter_dtype) and checkpointing
VARIANTS = {"fp32": (torch.float32, "none"), "bf16-base": (torch.bfloat16, "none"), "checkpointed": (torch.float32,
                                                                                                  "full")}


def lora_llama(dtype: torch.dtype = torch.float32, dropout: float = 0.1):
    import peft  # ~1 CPU-s with scipy: only on the worker that runs this module (conftest.WHOLE)

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=96, max_position_embeddings=64)
    base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=dropout)
    return peft.get_peft_model(base, config)


def ids(b: int, s: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (b, s), generator=torch.Generator().manual_seed(seed))


class LM(torch.nn.Module):
    """``model(input_ids=..., labels=...)`` with positional inputs, for the tracker; the loss is the model's."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, labels: torch.Tensor):  # type: ignore[no-untyped-def]
        return self.model(input_ids=x, labels=labels)


#: fp32's trace and its two checks are deep (stop 42): every line they run the other variants run, and fp32 LoRA's
#: parameter side and peak against a real AdamW step are the command line's (test_the_command_line_fine_tunes_with_lora)
DEEP_VARIANTS = {"fp32"}


@pytest.fixture(scope="module", params=[pytest.param(v, marks=pytest.mark.deep) if v in DEEP_VARIANTS else v
                                        for v in VARIANTS])
def traced(request):
    dtype, checkpoint = VARIANTS[request.param]
    x = ids(2, 8)
    d = symmem.trace(lora_llama(dtype), {"input_ids": x, "labels": x.clone()}, DIMS, loss="output",
                     optimizer="adamw", keep_logits=False, checkpoint=checkpoint, values=AT)
    return request.param, d


def held_after_a_real_step(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes PyTorch holds for the parameter side after one real AdamW step -- every parameter, the gradients, the
    optimizer's moments --, the number of trainable elements)."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, foreach=False)
    x = ids(3, 5)
    model(input_ids=x, labels=x.clone()).loss.backward()
    opt.step()
    size = [t.numel() * t.element_size() for t in (*model.parameters(), *(p.grad for p in model.parameters()
                                                                          if p.grad is not None))]
    size += [t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step"]
    return sum(size), sum(p.numel() for p in trainable)


def test_the_adapters_are_the_only_trainable_parameters(traced):
    name, d = traced
    model = lora_llama(VARIANTS[name][0])
    adapters = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    held, trainable = held_after_a_real_step(model)
    # by hand: per layer q_proj's A (4 x 32) and B (32 x 4), v_proj's A (4 x 32) and B (16 x 4: 2 KV heads of 8)
    assert trainable == 2 * (4 * 32 + 32 * 4 + 4 * 32 + 16 * 4) and len(adapters) == 2 * 4
    assert (d.value("parameters"), d.value("parameter_memory")) == (trainable, held)


def test_the_peak_is_a_real_steps(traced):
    name, d = traced
    dtype, checkpoint = VARIANTS[name]
    model = lora_llama(dtype)
    # checkpointed: symmem's own wrapping (non-reentrant torch.utils.checkpoint) of each layer, on the real module
    container, children = find_repeat(model)
    assert container == "base_model.model.model.layers" and len(children) == 2
    x = ids(AT["B"], AT["S"], seed=1)
    with checkpointed(model, children if checkpoint == "full" else []):
        real = track_step(LM(model), (x, x.clone()), loss=lambda out: out.loss, optimizer="adamw", keep_output=False)
    assert (d.value("peak_first_step"), d.value("peak")) == (real.first.bytes, real.steady.bytes)


TINY = [f"--config={k}={v}" for k, v in (("num_hidden_layers", 2), ("hidden_size", 32), ("intermediate_size", 64),
                                         ("num_attention_heads", 4), ("num_key_value_heads", 2), ("vocab_size", 96),
                                         ("max_position_embeddings", 64))]


def test_the_command_line_fine_tunes_with_lora(capsys):
    """``symmem trace hf:llama --lora ...``: the same parameter side and peak as PyTorch's own step of that model."""
    import json

    from symmem.cli import main

    assert main(["trace", "hf:llama", *TINY, "--lora", "r=4,alpha=8,targets=q_proj,v_proj", "--dims", "B,S",
                 "--loss", "cross-entropy", "--optimizer", "adamw", "--set", "B=3", "--set", "S=5",
                 "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert "LoRA (r=4, lora_alpha=8, target_modules=['q_proj', 'v_proj']): 896 trainable of 25,632" in err
    values = json.loads(out)["values"]
    held, trainable = held_after_a_real_step(lora_llama(dropout=0.0))  # peft's default dropout: none
    assert (values["parameters"], values["parameter_memory"]) == (trainable, held)
    x = ids(AT["B"], AT["S"], seed=1)
    real = track_step(LM(lora_llama(dropout=0.0)), (x, x.clone()), loss=lambda out: out.loss, optimizer="adamw",
                      keep_output=False)
    assert (values["peak_first_step"], values["peak"]) == (real.first.bytes, real.steady.bytes)


@pytest.mark.parametrize("lora, says", [("rank=8", "--lora rank=8: unknown key 'rank'; the keys are r, alpha"),
                                        ("alpha=16", "give the rank, e.g. --lora r=8"),
                                        ("r=0", "the rank r is a positive whole number"),
                                        ("r=4,dropout=1.5", "dropout is a probability in [0, 1)"),
                                        ("r=4,targets=nope", "Target modules {'nope'} not found")])
def test_a_bad_lora_is_one_line(capsys, lora, says):
    from symmem.cli import main

    assert main(["trace", "hf:llama", *TINY, "--lora", lora, "--dims", "B,S"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("symmem: error: ") and err.count("\n") == 1 and says in err, err


DOC = Path(__file__).resolve().parents[1] / "docs" / "fine-tuning.md"


@pytest.mark.deep  # ~18 CPU-s: the 7B's 32-layer fake forward and its fold's three step records (docs/testing.md)
def test_the_fine_tuning_page_runs():
    """docs/fine-tuning.md's Python blocks, each on its own as a doctest (a 7B config, on the meta device).

    Deep: its path -- peft's LoRA on a BF16 Llama base, every layer checkpointed, the model's own loss, AdamW, the
    peak folded in L -- is this module's default tests' (the ``bf16-base`` and ``checkpointed`` traces against real
    steps, the command line's), and a model on the meta device is test_importer's; what only this test checks is
    the page's own printed figures for the 7B shape."""
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert blocks
    for i, block in enumerate(blocks):
        test = doctest.DocTestParser().get_doctest(block, {}, f"fine-tuning.md[{i}]", str(DOC), 0)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        result = runner.summarize(verbose=False)
        assert result.attempted >= 1 and result.failed == 0
