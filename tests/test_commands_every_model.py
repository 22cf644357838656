"""Every command takes every model (issue 21, item 1): ``derive``, ``fit``, ``plot`` and ``verify`` accept a built-in
name or any SPEC ``symmem trace`` accepts, with ``--dims`` and the trace options; ``fit`` says which sizes it held and
never answers past the formulas' domain or the model's position table without saying so; numbers outside the
domain warn in one line; ``python -m symmem`` is the ``symmem`` command.

Oracles: real training steps under the live-bytes tracker (``symmem.record.steps.track_step``) for the largest batch
that fits and for ``verify SPEC --peak``; the module's own code for its guard (``x.shape[0] >= 16``) and PyTorch's
own refusal past a Hugging Face model's position table; every bad input is one line ``symmem: error: ...``, exit 2.
Modules are tiny (a two-layer MLP, a one-layer GPT-2 of width 32) and each SPEC is traced once per command.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from symmem.apps.budget import largest  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.errors import OutsideDomain  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NET = '''
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 64)
        self.b = torch.nn.Linear(64, 4)

    def forward(self, x):
        h = self.a(x).relu()
        if x.shape[0] >= 16:  # a size the code branches on: the trace's guard, B < 16 at the example B = 2
            h = torch.cat([h] * 8, 1).relu()[:, :64].contiguous()
        return self.b(h)


class Plain(Net):
    def forward(self, x):
        return self.b(self.a(x).relu())


def plain():
    torch.manual_seed(0)
    return Plain(), (torch.randn(2, 8),)


def guarded():
    torch.manual_seed(0)
    return Net(), (torch.randn(2, 8),)
'''
TINY_GPT2 = ["--config", "n_layer=1", "--config", "n_embd=32", "--config", "n_head=2", "--config", "vocab_size=64",
             "--config", "n_positions=64"]


@pytest.fixture(scope="module")
def net(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "net.py"
    path.write_text(textwrap.dedent(NET))
    return path


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def user(net):
    """The file's module, imported (the truths run its callables)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_net_truth", net)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def real_peak(user, b: int) -> int:
    """The steady step's peak of the plain module at batch ``b``, as the traced step runs it (AdamW's for-loop on
    the CPU, the output's sum, the output dropped once the loss is computed)."""
    module, _ = user.plain()
    x = torch.randn(b, 8, generator=torch.Generator().manual_seed(b))
    return track_step(module, x, loss="sum", optimizer="adamw", impl="for-loop", keep_output=False).steady.bytes


# -- the table: every command on a file module and a built-in ----------------------------------------------------
@pytest.mark.parametrize("command, extra", [
    (["derive"], []),
    (["derive"], ["--format", "json"]),
    (["verify"], ["--set", "B=3"]),
])
def test_derive_and_verify_take_a_file_module(capsys, net, command, extra):
    code, out, err = run(capsys, *command, f"{net}:plain", "--dims", "B", *extra)
    assert code == 0, err
    assert f"{net}:plain" in out and "error" not in err
    if "verify" in command:
        assert out.rstrip().endswith("exact")  # one real forward measured against the traced formula


def test_fit_answers_the_largest_batch_a_real_step_fits(capsys, net, user):
    """The budget lies halfway between real steps at B = 40 and B = 41: fit answers 40, and verify --peak at 40
    prints the real step's peak next to the traced one, equal."""
    at40, at41 = real_peak(user, 40), real_peak(user, 41)
    assert at40 < at41
    budget = (at40 + at41) // 2
    code, out, err = run(capsys, "fit", f"{net}:plain", "--dims", "B", "--budget", str(budget), "--format", "json")
    assert code == 0, err
    r = json.loads(out)
    assert (r["max"], r["quantity"], r["convention"]) == (40, "peak", "traced")
    assert r["total_at_max"] == at40 and r["total_above"] == at41
    assert r["held"] == {} and r["held_from"] == {}
    code, out, err = run(capsys, "verify", f"{net}:plain", "--dims", "B", "--peak", "--set", "B=40")
    assert code == 0, err
    steady = next(line for line in out.splitlines() if line.strip().startswith("steady step")).split()
    assert [int(x.replace(",", "")) for x in steady[2:4]] == [at40, at40] and steady[4] == "+0"


def test_plot_takes_a_file_module(capsys, net, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "b.png"
    code, out, err = run(capsys, "plot", "batch", f"{net}:plain", "--dims", "B", "-o", str(png))
    assert code == 0, err
    assert out.strip() == str(png) and png.stat().st_size > 1000


def test_fit_of_a_built_in_says_what_it_held(capsys):
    code, out, err = run(capsys, "fit", "gpt2", "--set", "S=512", "--budget", "24GiB", "--format", "json")
    assert code == 0, err
    r = json.loads(out)
    assert r["held"]["S"] == 512 and r["held_from"]["S"] == "--set"
    assert r["held"]["L"] == 12 and r["held_from"]["L"] == "the model's default"  # GPT-2's 12 layers
    code, out, _ = run(capsys, "fit", "gpt2", "--set", "S=512", "--budget", "24GiB")
    assert out.splitlines()[1] == ("held: S = 512 (--set); H = 768, h = 12, L = 12, F = 3,072, V = 50,257 (the "
                                   "model's defaults); --set L=... answers at another L")


# -- the formulas' domain: the guard the trace recorded ----------------------------------------------------------
def test_numbers_outside_the_domain_warn_in_one_line(capsys, net):
    """The module branches at B >= 16 (its own code): the trace holds where B < 16, and --set B=64 says so."""
    code, out, err = run(capsys, "derive", f"{net}:guarded", "--dims", "B", "--set", "B=64")
    assert code == 0 and "holds where: (B >= 2) & (B < 16)" in out
    assert err == ("symmem: warning: B = 64 lies outside the formulas' domain (B < 16 fails): they are not known to "
                   "hold there\n")


def test_fit_caps_at_the_domain_and_python_says_so(capsys, net, user):
    code, out, err = run(capsys, "fit", f"{net}:guarded", "--dims", "B", "--budget", "1MiB")
    assert code == 0, err
    first = out.splitlines()[0]
    assert "largest B = 15 " in first and "capped at B = 15: B = 16 to " in first
    assert "they are outside the formulas' domain (B < 16)" in first
    import symmem

    module, example = user.guarded()
    d = symmem.trace(module, example, {"B": [(0, 0)]})
    r = largest(d, "B", "1MiB")
    assert (r.max, r.held) == (15, ()) and r.bound > 15 and "domain (B < 16)" in r.refused
    with pytest.warns(OutsideDomain, match=r"B = 64 lies outside the formulas' domain \(B < 16 fails\)"):
        d.at(B=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", OutsideDomain)
        d.at(B=8)  # inside: nothing said


def test_verify_peak_outside_the_domain_differs_and_exits_1(capsys, net):
    """At B = 16 the module takes its other branch (a concatenation the trace never saw): the real step's peak is
    larger than the traced formula's, and verify --peak says so with exit 1."""
    code, out, err = run(capsys, "verify", f"{net}:guarded", "--dims", "B", "--peak", "--set", "B=16")
    assert code == 1 and "NOT EXACT" in out and "B = 16 lies outside" in err


def test_paper_takes_a_file_module_and_says_where_it_capped(capsys, net, tmp_path):
    code, out, err = run(capsys, "paper", "-o", str(tmp_path), "--model", f"{net}:guarded", "--dims", "B", "--no-pdf")
    assert code == 0, err
    body = (tmp_path / "generated" / "body.tex").read_text()
    fit = (tmp_path / "generated" / "fit.tex").read_text()
    assert "traced from PyTorch" in body
    assert "15$^{\\dagger}$" in fit and "to $" in fit
    assert "would fit, but they are outside the formulas' domain (B < 16)" in fit


# -- a Hugging Face config: the model's position table ----------------------------------------------------------
def test_fit_of_an_hf_model_caps_at_its_position_table(capsys):
    """n_positions = 64: S = 65 is past GPT-2's position table (PyTorch refuses it), so the answer is capped at 64
    and says why; B is held at the example's 2 and said to be."""
    transformers = pytest.importorskip("transformers")
    code, out, err = run(capsys, "fit", "hf:gpt2", *TINY_GPT2, "--dims", "B,S", "--no-check", "--solve", "S",
                         "--budget", "1GiB", "--format", "json")
    assert code == 0, err
    r = json.loads(out)
    assert r["max"] == 64 and r["bound"] > 64 and r["held"] == {"B": 2} and r["held_from"] == {"B": "the example input"}
    assert r["refused"] == "past the model's position table: transformer.wpe has 64 rows (n_positions = 64)"
    # the truth: PyTorch's GPT-2 with these 64 positions refuses 65 tokens
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    model(torch.zeros(1, 64, dtype=torch.long))
    with pytest.raises(IndexError):
        model(torch.zeros(1, 65, dtype=torch.long))


# -- bad input: one line, exit 2 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["derive", "gpt3"], "unknown model 'gpt3'"),
    (["fit", "gpt2", "--dims", "B", "--budget", "1GiB"],
     "--dims applies to a module traced from a SPEC (package.module:callable, path/to/file.py:callable, "
     "hf:MODEL_TYPE | hf:org/name | hf:DIR | hf:path/config.json, torchvision:NAME or timm:NAME), "
     "not to the built-in model 'gpt2'"),
    (["derive", "{net}:plain"],
     "{net}:plain: a traced module needs --dims, the sizes to keep symbolic, e.g. --dims B,S"),
    (["fit", "{net}", "--dims", "B"], "{net}: name the callable that builds the module, e.g. {net}:build"),
    (["fit", "{net}:plain", "--dims", "B", "--convention", "paper"],
     "--convention paper: a traced module has its own convention (what PyTorch kept); drop --convention"),
    (["derive", "{net}:plain", "--dims", "B", "--attention", "sdpa"],
     "--attention is an option of the built-in models; a module's own options are its code (hf: --config key=value)"),
    (["paper", "-o", "x", "--model", "gpt2", "--dims", "B"],
     "--dims applies to a module traced from a SPEC (package.module:callable, path/to/file.py:callable, "
     "hf:MODEL_TYPE | hf:org/name | hf:DIR | hf:path/config.json, torchvision:NAME or timm:NAME), "
     "not to the built-in model 'gpt2'"),
    (["paper", "-o", "x", "--model", "{net}:plain", "--dims", "B", "--convention", "paper"],
     "--convention paper: a traced module has its own convention (what PyTorch kept), the pytorch one; drop "
     "--convention"),
    (["plot", "breakdown", "{net}:plain", "--dims", "B", "--compare", "paper", "-o", "x.png"],
     "--compare: a traced module has one convention (what PyTorch kept); drop --compare"),
])
def test_bad_input_is_one_line(capsys, net, argv, message):
    argv = [a.replace("{net}", str(net)) for a in argv]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err.startswith("symmem: error: " + message.replace("{net}", str(net))) and err.count("\n") == 1


def test_python_m_symmem_is_the_command():
    # a bare environment, but no bytecode written into the tree: later processes of the suite would read it (as
    # PYTHONDONTWRITEBYTECODE, which CI and these machines set, says they must not)
    done = subprocess.run([sys.executable, "-m", "symmem", "derive", "gpt3"], capture_output=True, text=True,
                          cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                         "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("symmem: error: unknown model 'gpt3'")
