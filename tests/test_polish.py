"""Issue 21's last gaps: what the header says of a module's own dtype, a real autocast step against the traced
peak, the notes ``fit`` refuses, and the fit table's words for a model with no fitting size."""
from __future__ import annotations

import pytest

import symmem
from symmem.cli import main


def test_a_bfloat16_module_is_headed_by_its_own_dtype():
    """A module cast to bfloat16 says "bfloat16 weights", not the regime's FP32; its parameter side is what a
    real AdamW step holds for those weights: the weights, their gradients and both moments, all bfloat16."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(torch.bfloat16)
    d = symmem.trace(net, (torch.zeros(4, 32, dtype=torch.bfloat16),), dims={"B": [(0, 0)]})
    assert "bfloat16 weights + AdamW" in d.title() and "FP32" not in d.title()
    net(torch.randn(4, 32, dtype=torch.bfloat16)).sum().backward()
    opt = torch.optim.AdamW(net.parameters())
    opt.step()
    real = sum(t.numel() * t.element_size() for p in net.parameters()
               for t in (p, p.grad, *(v for v in opt.state[p].values() if v.dim() > 0)))
    assert d.evaluate(d.parameter_memory) == real


def test_verify_peak_under_autocast_runs_a_real_autocast_step(capsys):
    """`verify --peak --autocast bfloat16` measures a real loop with forward and loss under torch.autocast: at
    B = 512 the peak is in backward, where autocast halves the saved activations, and the traced peak equals it
    to the byte; the same loop without autocast peaks higher (what verify measured before it took autocast)."""
    torch = pytest.importorskip("torch")
    from symmem.record.steps import track_step
    from tests.trace_helpers import mlp_with_inputs

    spec = "tests.trace_helpers:mlp_with_inputs"
    argv = ["verify", spec, "--dims", "B", "--peak", "--autocast", "bfloat16", "--set", "B=512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "  steady step            156,116         156,116            +0" in out, out
    net, _ = mlp_with_inputs()
    x = torch.randn(512, 16)
    assert track_step(net, x, autocast="bfloat16").steady.bytes == 156_116
    assert track_step(net, x).steady.bytes == 238_040  # FP32 activations: autocast is what made the difference
    with pytest.raises(symmem.SymmemError, match="^unknown autocast 'int8'; choose from bfloat16, float16$"):
        track_step(net, x, autocast="int8")


def test_python_trace_of_a_transformers_model_has_its_position_table_in_the_domain():
    """symmem.trace of a GPT-2 with 64 positions, as the commands do: S <= 64 joins the domain, and S = 65 is said
    to lie past the position table; the truth: PyTorch's GPT-2 refuses 65 tokens."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import sympy

    from symmem.errors import OutsideDomain

    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.zeros(2, 8, dtype=torch.long)
    dims = {"B": [(0, 0)], "S": [(0, 1)]}
    with pytest.warns(OutsideDomain) as said:
        d = symmem.trace(model, (ids,), dims, values={"B": 2, "S": 65})
    S = sympy.Symbol("S", integer=True, positive=True)
    assert sympy.Le(S, 64) in d.domain.args
    assert [str(w.message) for w in said] == [
        "S = 65 lies outside the formulas' domain (S <= 64 fails: past the model's position table: transformer.wpe "
        "has 64 rows (n_positions = 64)): they are not known to hold there"]
    model(torch.zeros(1, 64, dtype=torch.long))
    with pytest.raises(IndexError):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_an_hf_vision_model_is_held_at_its_image_size(capsys):
    """A ViT takes its config's image size only (PyTorch's forward refuses 64x64 for image_size 32): --set
    Hi=64 is said to lie past it, with why."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tiny = ["--config", "num_hidden_layers=1", "--config", "hidden_size=32", "--config", "num_attention_heads=2",
            "--config", "intermediate_size=64", "--config", "image_size=32", "--config", "patch_size=8"]
    assert main(["trace", "hf:vit", *tiny, "--dims", "B,Hi,Wi", "--set", "Hi=64", "--format", "json"]) == 0
    err = capsys.readouterr().err
    assert ("symmem: warning: Hi = 64 lies outside the formulas' domain (Eq(Hi, 32) fails: the model takes 32x32 "
            "images only (image_size = 32; its forward refuses others)): they are not known to hold there") in err
    cfg = transformers.ViTConfig(num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                 image_size=32, patch_size=8)
    model = transformers.ViTModel(cfg)
    model(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError):
        model(torch.zeros(1, 3, 64, 64))


MEGATRON_TINY = {"H": 64, "L": 2, "S": 128, "h": 4, "V": 512}


def test_fit_is_stopped_only_by_a_convention_that_sees_nothing(capsys):
    """gpt-megatron's default B = 1 lies outside its pytorch formulas' domain (B >= 2): a note, not a reason to
    refuse solving for B, so fit answers as Python's largest() does; a convention that sees nothing still refuses,
    in one line."""
    import warnings

    from symmem.apps.budget import largest

    argv = ["fit", "gpt-megatron", *(f"--set={k}={v}" for k, v in MEGATRON_TINY.items()), "--budget", "1GiB",
            "--format", "json"]
    assert main(argv) == 0
    import json

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = symmem.derive("gpt-megatron", values=MEGATRON_TINY)
    assert d.notes  # the informational note that once stopped the fit
    assert json.loads(capsys.readouterr().out)["max"] == largest(d, "B", "1GiB").max == 342
    assert main(["fit", "resnet50-v1", "--convention", "megatron", "--budget", "24GiB"]) == 2
    assert capsys.readouterr().err == (
        "symmem: error: resnet50-v1: the megatron convention counts tensors by role (attn_dropout, attn_input, "
        "attn_probs, mlp_act, mlp_hidden, mlp_input, proj_input, qkv, residual) and no node of this graph has one of "
        "them, so it keeps nothing; use --convention pytorch\n")


def test_the_paper_fit_table_says_when_only_a_size_outside_the_domain_fits():
    """A budget between the peaks at B = 1 and B = 2 of a model whose formulas hold for B >= 2: the row says B = 1
    fits outside the domain (not "does not grow with B", which is false: the peak grows by 3 MiB from B = 1 to 2)."""
    import warnings

    from symmem.apps import article

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = symmem.derive("gpt-megatron", values=MEGATRON_TINY)
        one, two = d.at(B=1).value("peak"), d.at(B=2).value("peak")  # B = 1: said to lie outside the domain
    assert one < two
    rows = article._fit_rows([article.ModelRow("GPT", "gpt-megatron", None, d, False)], str(one))
    table = article._fit_table(rows, str(one))
    assert r"GPT & \multicolumn{3}{l}{$B = 1$ fits, outside the formulas' domain (B >= 2)} \\" in table
    assert "whose peak of a training step (PyTorch) fits" in table


def test_a_fixed_length_embedding_bag_formula_has_no_unit_floor():
    """EmbeddingBag on a (B, S) batch: its offsets are ceil(B*S/S) = B long, which sympy wrote as
    B + 1 + floor(-1/S); for a positive integer S that floor is -1, so the formula is plain, and it equals what
    autograd really keeps at other sizes."""
    torch = pytest.importorskip("torch")
    from symmem.record.verify import measure

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.EmbeddingBag(50, 8, mode="mean"), torch.nn.Linear(8, 3))
    d = symmem.trace(net, (torch.randint(0, 50, (4, 6)),), {"B": [(0, 0)], "S": [(0, 1)]}, values={"B": 5, "S": 7})
    assert not d.activations.has(__import__("sympy").floor), d.activations
    real = measure(net, torch.randint(0, 50, (5, 7)))
    assert d.value("activations") + d.value("input") == real.activations + real.input


def test_the_paper_fit_table_says_at_which_sizes_a_traced_module_is_held():
    """A traced module's other sizes are its example's (here S = 6), not a model's defaults: the fit table's caption
    says them, as `fit` does ("held: S = 6")."""
    torch = pytest.importorskip("torch")
    from symmem.apps import article

    net = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    d = symmem.trace(net, (torch.zeros(2, 6, dtype=torch.long),), {"B": [(0, 0)], "S": [(0, 1)]})
    table = article._fit_table(article._fit_rows([article.ModelRow("net", "net", None, d, False)], "1GiB"), "1GiB")
    assert r"Other sizes held: net at $S = 6$ (\texttt{--set} answers at others).}" in table
