"""``symmem verify --symbolic`` and ``symmem paper --symbolic`` (issue 20): the formula in an hf: model's own sizes,
fitted through small configurations, checked and written at sizes it never traced.

Truths: :func:`symmem.record.verify.measure` (autograd's saved tensors of one real training-mode forward) and
:func:`symmem.record.steps.track_step` (the live bytes of two real training steps) of the real model built at the
untraced sizes here, independently of the command; the exact one-line errors.
"""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.symbolic_traces import GROUP, shared_traces  # noqa: E402, F401

CONFIG = ("--config", "n_layer=2", "--config", "n_embd=32", "--config", "n_head=2")


def _main(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    from symmem.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _real(V: int = 200, L: int = 4) -> tuple[object, object]:
    """gpt2 built at vocabulary V, L layers, and token ids (3, 5)."""
    from symmem.importer import sources

    loaded = sources.load("hf:gpt2", config={"n_layer": L, "n_embd": 32, "n_head": 2, "vocab_size": V})
    return loaded.module, torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(0))


def _predicted(out: str, row: str) -> int:
    return int(re.search(rf"^  {row}\s+([\d,]+)", out, re.M).group(1).replace(",", ""))


@pytest.mark.xdist_group(GROUP)  # its trace at 2 layers is GPT-2 in V's first (vocabulary 24): made once a process
@pytest.mark.usefixtures("shared_traces")
def test_verify_symbolic_checks_the_formula_where_it_was_not_fitted(capsys: pytest.CaptureFixture) -> None:
    """The layer count in the sizes (a cheap fit: its step is recorded with 4 and 5 layers), checked at 6 layers
    and sizes B, S never traced: one real forward's saved tensors and two real training steps."""
    from symmem.record.steps import track_step
    from symmem.record.verify import measure

    code, out, _ = _main(capsys, "verify", "hf:gpt2", "--dims", "B,S", *CONFIG, "--config", "vocab_size=24",
                         "--symbolic", "L=n_layer", "--symbolic-peak", "--optimizer", "sgd", "--set", "L=6",
                         "--set", "B=3", "--set", "S=5")
    module, ids = _real(V=24, L=6)
    saved = measure(module, input_ids=ids)
    steps = track_step(module, (ids,), optimizer="sgd", impl="for-loop", keep_output=False)
    assert code == 0 and out.count("\n  exact\n") == 2
    assert "against the real model built at L=6 (B=3, S=5)" in out
    assert (_predicted(out, "activations"), _predicted(out, "input")) == (saved.activations, saved.input)
    assert (_predicted(out, "first step"), _predicted(out, "steady step")) == (steps.first.bytes, steps.steady.bytes)


@pytest.mark.xdist_group(GROUP)  # GPT-2 in V as test_symbolic_sizes' CLI: traced once a process
@pytest.mark.usefixtures("shared_traces")
def test_paper_symbolic_writes_the_formula_in_the_sizes(capsys: pytest.CaptureFixture, tmp_path: object) -> None:
    """The article's equations, read back from its LaTeX and evaluated at sizes never traced, are what the real
    model keeps there; the section says what each symbol stands for."""
    from symmem.record.verify import measure
    from symmem.report.latex import read
    from symmem.symbols import B, L, S, V

    code, out, _ = _main(capsys, "paper", "-o", str(tmp_path), "--no-pdf", "--model", "hf:gpt2", "--dims", "B,S",
                         *CONFIG, "--symbolic", "V=vocab_size", "--set", "V=200", "--set", "L=4")
    assert code == 0
    body = (tmp_path / "generated" / "body.tex").read_text()
    got = dict(read(body))
    module, ids = _real(V=200, L=4)
    real = measure(module, input_ids=ids)
    at = {B: 3, S: 5, V: 200, L: 4}
    assert got[r"\text{activations}"].subs(at) == real.activations
    assert got[r"\Psi"].subs(at) == sum(p.numel() for p in module.parameters())
    assert r"$V$ = \texttt{vocab\_size} (vocabulary size)" in body
    assert "in the model's own sizes $B$, $S$, $V$ and $L$" in body
    assert "$V = 200$, $L = 4$" in body


@pytest.mark.parametrize(("argv", "message"), [
    (["verify", "hf:gpt2", "--dims", "B,S", "--symbolic-peak"],
     "symmem: error: --symbolic-peak goes with --symbolic: verify --symbolic H=hidden_size,... --symbolic-peak checks "
     "the peak in the sizes"),
    (["verify", "tests/trace_helpers.py:mlp", "--dims", "B", "--symbolic", "H=hidden_size"],
     "symmem: error: --symbolic maps symbols to keys of a transformers config: it applies to hf:MODEL_TYPE; from "
     "Python, symmem.trace(build, dims=..., sizes={...}) takes any module built from sizes"),
    (["verify", "gpt2-small", "--symbolic", "V=vocab_size"],
     "symmem: error: --symbolic applies to a module traced from a SPEC (package.module:callable, "
     "path/to/file.py:callable, hf:MODEL_TYPE | hf:org/name | hf:DIR | hf:path/config.json, torchvision:NAME or "
     "timm:NAME), not to the built-in model 'gpt2-small'"),
])
def test_symbolic_bad_input_is_one_line(capsys: pytest.CaptureFixture, argv: list[str], message: str) -> None:
    code, out, err = _main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.strip() == message


# -- small fixes --------------------------------------------------------------------------------------------------
def test_a_bfloat16_module_built_from_sizes_names_its_dtype() -> None:
    """The header names the module's own dtype, as for a module given whole; the formula keeps 2 bytes an element,
    what a real bfloat16 forward saves at a size never traced."""
    from symmem import trace
    from symmem.record.verify import measure
    from symmem.symbols import B, H

    def build(H: int) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, H)).to(torch.bfloat16)
        return net, (torch.randn(2, H, dtype=torch.bfloat16),)

    d = trace(build, dims={"B": [(0, 0)]}, sizes={"H": 64}, optimizer="sgd")
    assert d.title() == ("Sequential — traced from PyTorch (traced convention), bfloat16 weights + SGD, symbolic "
                         "formula; on cpu")
    net, _ = build(40)
    assert d.activations.subs({B: 3, H: 40}) == measure(net, torch.randn(3, 40, dtype=torch.bfloat16)).activations


def test_symmem_without_a_command_prints_the_help(capsys: pytest.CaptureFixture) -> None:
    code, out, err = _main(capsys)
    assert code == 2 and out == ""
    assert err.startswith("usage: symmem [-h] [--version]")
    assert all(f"    {c} " in err for c in ("derive", "trace", "verify", "fit", "paper"))
    assert err.rstrip().endswith("symmem: error: name a command (symmem COMMAND --help for its options)")


def test_config_takes_comma_separated_pairs() -> None:
    from symmem.importer.sources import parse_config

    assert parse_config(["n_layer=2,n_embd=32", "n_head=2"]) == {"n_layer": 2, "n_embd": 32, "n_head": 2}
    assert parse_config(["name='a,b', n_layer=2,x=1e-5"]) == {"name": "a,b", "n_layer": 2, "x": 1e-5}


def test_config_value_with_a_comma_says_how_to_quote_it(capsys: pytest.CaptureFixture) -> None:
    code, out, err = _main(capsys, "trace", "hf:gpt2", "--dims", "B,S", "--config", "n_layer=2,3")
    assert code == 2 and out == ""
    assert err.strip() == ("symmem: error: --config 'n_layer=2,3': a comma separates key=value pairs, and '3' is not "
                           "one; a value with a comma goes in quotes: --config 'n_layer=\"2,3\"'")
