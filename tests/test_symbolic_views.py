"""Every view of a formula in the sizes of an ``hf:`` model (issue 20 item 1): ``symmem fit``, ``derive`` and
``plot`` take ``--symbolic``/``--symbolic-peak`` for a SPEC as ``symmem trace`` does.

Truths: :func:`symmem.record.verify.measure` (autograd's saved tensors of one real training-mode forward) and the
real module's parameter count at the answered vocabulary size and one above it, neither ever traced; fp32 AdamW
keeps 16 bytes per parameter (weight, gradient, two moments: a hand count); the exact one-line errors.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from symmem.record.verify import measure  # noqa: E402
from tests.symbolic_traces import GROUP, shared_traces  # noqa: E402, F401

#: GPT-2 as test_symbolic_sizes' and test_symbolic_checks' CLI tests build it (its traces in V shared in a process)
CONFIG = ("--config", "n_layer=2", "--config", "n_embd=32", "--config", "n_head=2")


def _main(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    from symmem.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _real_total(V: int, B: int, S: int) -> int:
    """What real PyTorch holds for a training step of GPT-2 (2 layers, width 32) with vocabulary V: the forward's
    saved tensors and input, plus 16 bytes per parameter (fp32 AdamW: weight, gradient, two moments)."""
    from symmem.importer import sources

    loaded = sources.load("hf:gpt2", config={"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": V})
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(0))
    real = measure(loaded.module, input_ids=ids)
    return real.activations + real.input + 16 * sum(p.numel() for p in loaded.module.parameters())


@pytest.mark.xdist_group(GROUP)  # GPT-2 in V: traced once a process (tests/symbolic_traces.py)
@pytest.mark.usefixtures("shared_traces")
def test_fit_solves_for_the_vocabulary_as_real_pytorch_holds(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    budget = 2**21  # the position table (1,024 x 32, 16 bytes a parameter) takes 0.5 MiB of it
    code, out, _ = _main(capsys, "fit", "hf:gpt2", *CONFIG, "--dims", "B,S", "--symbolic", "V=vocab_size",
                         "--solve", "V", "--budget", str(budget), "--set", "B=2", "--set", "S=8", "--format", "json")
    assert code == 0
    got = json.loads(out)
    V = got["max"]
    assert got["symbol"] == "V" and got["held"] == {"B": 2, "S": 8, "L": 2}
    at, above = _real_total(V, 2, 8), _real_total(V + 1, 2, 8)
    assert (got["total_at_max"], got["total_above"]) == (at, above)
    assert at <= budget < above


@pytest.mark.parametrize(("argv", "message"), [
    (["fit", "gpt2-small", "--symbolic", "V=vocab_size", "--budget", "80GiB"],
     "symmem: error: --symbolic applies to a module traced from a SPEC (package.module:callable, "
     "path/to/file.py:callable, hf:MODEL_TYPE | hf:org/name | hf:DIR | hf:path/config.json, torchvision:NAME or "
     "timm:NAME), not to the built-in model 'gpt2-small'"),
    (["derive", "hf:gpt2", "--dims", "B,S", "--symbolic-peak"],
     "symmem: error: --symbolic-peak goes with --symbolic: without it the peak is traced at the sizes given"),
    (["plot", "batch", "tests/trace_helpers.py:mlp", "--dims", "B", "--symbolic", "H=hidden_size", "-o", "x.png"],
     "symmem: error: --symbolic maps symbols to keys of a transformers config: it applies to hf:MODEL_TYPE; from "
     "Python, symmem.trace(build, dims=..., sizes={...}) takes any module built from sizes"),
])
def test_symbolic_bad_input_in_the_views_is_one_line(capsys: pytest.CaptureFixture, argv: list[str],
                                                     message: str) -> None:
    code, out, err = _main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.strip() == message
