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
