"""The number that must fit leads every view (issue 21, item 4): the peak of a training step heads the text table,
the JSON, the Jupyter display, LaTeX and the plots -- the bytes two real training steps reach -- and where there is
no peak every view says why in one line; the Jupyter display fits a 1,400-pixel window with its terms folded."""

from __future__ import annotations

import json
import re

import pytest

import symmem
from symmem.cli import main

SMALL = ["--device", "cpu", "--widths", "16,32,4", "--set", "B=3"]


@pytest.fixture(scope="module")
def small():
    """The built-in mlp at a small size on the CPU, and the steady peak two real training steps reach."""
    pytest.importorskip("torch")
    from symmem.record.steps import track_step
    from symmem.reference import reference

    d = symmem.derive("mlp", device="cpu", widths="16,32,4", values={"B": 3})
    module, inputs = reference("mlp", {s.name: v for s, v in d.numbers.items()}, d.options)
    return d, track_step(module, inputs).steady.bytes  # the defaults of both: AdamW, the output's sum


def test_every_view_leads_with_the_real_peak(small, capsys):
    from symmem.report.latex import align
    from symmem.report.plots import breakdown, close
    from symmem.units import format_bytes

    d, real = small
    assert main(["derive", "mlp", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == (f"peak of a training step (what must fit): {real / 2**30:.3f} GiB ({real / 2**20:.2f} MiB) "
                        f"at {d.peak_at().where(step=False)}")
    assert any(ln.startswith("kept after forward + parameters ") for ln in lines)      # "total", named for what it is
    assert main(["derive", "mlp", *SMALL, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["values"]["peak"] == real and "peak_refused" not in out
    html = d._repr_html_()
    assert html.index(f"what must fit): {format_bytes(real)}</b>") < html.index("<table")
    tex = align(d).splitlines()
    assert tex[1].startswith(f"% peak of a training step (what must fit): {format_bytes(real)} ({real:,} bytes)")
    assert tex[2].startswith(r"\noindent\textbf{Peak of a training step (what must fit):}")
    assert d._repr_latex_().startswith(r"$$\begin{aligned} M_{\text{peak}} &=")
    fig = breakdown([d])
    lines = [c for c in fig.axes[0].collections if c.get_segments()]
    assert [seg[0][1] for c in lines for seg in c.get_segments()] == [pytest.approx(real / 2**30)]
    assert any(t.get_text().startswith(f"peak {real / 2**30:.2f}") for t in fig.axes[0].texts)
    close(fig)


def _fitted():
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    return symmem.trace(net, (torch.zeros(2, 4),), {"B": [(0, 0)]}, method="fit")


NO_PEAK = {
    "tensor parallel": (lambda: symmem.derive("gpt2", tensor_parallel=True), ["derive", "gpt2", "--tensor-parallel"],
                        "no peak: the tensor-parallel peak follows DTensor's standard plan, which is Llama's; not "
                        "gpt2"),
    "paper": (lambda: symmem.derive("vit-b16", convention="paper"), ["derive", "vit-b16", "--convention", "paper"],
              "no peak for the paper convention (an accounting by role)"),
    "fitted": (_fitted, ["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B", "--method", "fit"],
               "no peak: the formula was fitted from traces at concrete sizes"),
    "loss output": (None, ["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B", "--loss", "output"],
                    "no peak: loss='output' is not a scalar here, so backward() cannot run: give loss='sum' or "
                    "'cross-entropy', or a module that returns its loss"),
}


@pytest.mark.parametrize("case", NO_PEAK)
def test_no_peak_says_why_in_every_view(case, capsys):
    """Text and JSON answer alike (exit 0, the formula, and why there is no peak, in one line); LaTeX, Jupyter
    and the plots say the same line."""
    from symmem.report.latex import align
    from symmem.report.plots import breakdown, close

    make, argv, why = NO_PEAK[case]
    if argv[0] == "trace":
        pytest.importorskip("torch")
    assert main(argv) == 0
    text = capsys.readouterr().out
    said = next(ln for ln in text.splitlines() if ln.startswith("no peak"))
    assert said.startswith(why[:len(said)]) and "\n\n" not in text.split("group / term")[0].split(said)[0]
    assert main([*argv, "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["values"]["peak"] is None and out["peak_refused"].startswith(why)
    assert "activations" in out["values"] and out["values"]["parameters"] is not None
    if make is None:
        return
    d = make()
    assert f"<p><b>{why}" in d._repr_html_().replace("&#x27;", "'")
    assert f"% {why}" in align(d)
    fig = breakdown([d])
    assert any(why in t.get_text() for t in fig.texts)
    close(fig)


def test_jupyter_fits_a_1400_pixel_window():
    """A traced pytorch derivation (every storage a term): the display is at most 1,300 pixels wide, its formulas
    wrap (text, not one-line LaTeX), its terms are folded under <details>, and term names read as path · op."""
    torch = pytest.importorskip("torch")
    from symmem.report.jupyter import MAX_WIDTH, display_name

    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    d = symmem.trace(net, (torch.zeros(2, 8),), {"B": [(0, 0)]})
    html = d._repr_html_()
    assert MAX_WIDTH <= 1400 and html.startswith(f"<div class='symmem' style='max-width:{MAX_WIDTH}px'>")
    before, details = html.split("<details>")
    assert all(t.name not in before for t in d.terms if ":" in t.name)          # every term folded
    assert details.count("<tr>") == len(d.terms) + 1
    assert "$" not in html                                                     # no unbreakable MathJax line
    cells = re.findall(r"<td([^>]*)>(<code[^>]*>)", html)
    assert cells and all("overflow-wrap:anywhere" in a + b for a, b in cells)  # every formula wraps
    names = [t.name for t in d.terms if "#" in t.name]
    assert names and all(f"<code>{display_name(n)}</code>" in details for n in names)
    assert display_name("blocks.L.ln1:layer_norm#2") == "blocks.L.ln1 · layer_norm (2nd)"
    assert all(f"title='{t.name}'" in details for t in d.terms)  # the JSON key, on hover
