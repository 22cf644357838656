"""Jupyter display and plots: thin views of the derivation, every figure its own expression evaluated."""

from __future__ import annotations

import re

import pytest

import symmem
from symmem.cli import main

MiB = 2**20


@pytest.fixture(scope="module")
def resnet():
    return symmem.derive("resnet50-v1", convention="paper")


def test_html_table(resnet):
    html = resnet._repr_html_()
    for t in resnet.terms:
        assert f"<code>{t.name}</code>" in html
    # The FP32 analysis's stage-1 conv1 (49 MiB) and conv1 stem (196 MiB) figures, and the exact 3.025 GiB total.
    assert "196.000 MiB" in html and "49.000 MiB" in html and "3.025 GiB" in html
    rows = re.findall(r"<tr>", html)
    assert len(rows) >= len(resnet.terms) + 3


@pytest.mark.parametrize("model, values", [("mlp", {"B": 4}), ("resnet18", {"B": 2, "Hi": 64, "Wi": 64})])
def test_html_shows_the_peak_a_real_step_reaches(model, values):
    """Under the default convention a notebook's display ends with the peak of a training step, first and steady:
    the live bytes two real training steps reach (symmem.record.steps), in the units the display uses."""
    pytest.importorskip("torch")
    from symmem.record.verify import verify_peak
    from symmem.units import format_bytes

    d = symmem.derive(model, device="cpu", values=values)
    html = d._repr_html_()
    real = verify_peak(d)
    steady = re.search(r"peak of a training step</th><td>at ([^<]+)</td><th[^>]*>([^<]+)</th>", html)
    first = re.search(r"peak \(first step\)</th><td>at ([^<]+)</td><th[^>]*>([^<]+)</th>", html)
    assert steady and first, html[-600:]
    assert steady.group(2) == format_bytes(real.measured) and first.group(2) == format_bytes(real.measured_first)


def test_latex_repr(resnet):
    text = resnet._repr_latex_()
    assert text.startswith("$$") and text.endswith("$$") and "44355584 B + 16 \\Psi" in text


def test_show_without_ipython(capsys):
    symmem.show("vit-b16", attention="naive")
    out = capsys.readouterr().out
    assert "vit-b16" in out and "blocks.softmax" in out


@pytest.mark.parametrize("kind, extra, suffix, magic", [
    ("breakdown", ["--compare", "paper"], ".png", b"\x89PNG"),
    ("batch", ["--budget", "80GiB"], ".pdf", b"%PDF"),
    ("seq", ["--attention", "naive", "--budget", "24GiB"], ".svg", b"<?xml"),
    ("profile", [], ".png", b"\x89PNG"),
])
def test_plot_cli(tmp_path, kind, extra, suffix, magic):
    # VGG-11's profile and sweep (was ResNet-50 v1's: its ~180 ops' tick labels and floors, 3 CPU-s each): the same
    # command, file format and check
    model = {"breakdown": "resnet50-v1", "batch": "vgg11", "profile": "vgg11"}.get(kind, "vit-b16")
    out = tmp_path / f"plot{suffix}"
    assert main(["plot", kind, model, *extra, "--output", str(out)]) == 0
    assert out.read_bytes()[:len(magic)] == magic and out.stat().st_size > 5000


def test_plot_bad_suffix(tmp_path, capsys):
    assert main(["plot", "profile", "resnet50-v1", "--output", str(tmp_path / "x.jpg")]) == 2
    assert "use one of" in capsys.readouterr().err


def test_sweep_marks_the_fit():
    from symmem.apps.budget import largest
    from symmem.report.plots import sweep

    d = symmem.derive("vit-b16", convention="paper", attention="naive")
    fig = sweep(d, "B", budget="80GiB")
    marked = [ln for ln in fig.axes[0].lines if ln.get_marker() == "o"]
    assert marked[0].get_xdata()[0] == largest(d, "B", "80GiB").max


@pytest.mark.parametrize("kw, layout", [
    ({}, ""),
    ({"data_parallel": "fsdp", "pipeline_parallel": True, "pipeline_schedule": "gpipe", "micro_batches": 2,
      "values": {"N": 2, "p": 2, "L": 2}}, ", per device: fsdp N=2, gpipe p=2 M=2"),
    ({"tensor_parallel": True, "sequence_parallel": True, "data_parallel": "fsdp1", "values": {"N": 2, "t": 2}},
     ", per device: fsdp1 N=2, sequence parallel t=2"),
])
def test_a_sweep_names_the_layout_its_values_are_one_device_of(kw, layout):
    """The figure's curves are one device's under a parallel layout: the title says which, in the command line's
    words and sizes."""
    from symmem.report.plots import close, sweep

    model = "llama" if kw.get("tensor_parallel") else "gpt2"
    d = symmem.derive(model, device="cpu", **kw)
    fig = sweep(d, "B", values=[1, 2])
    assert fig.axes[0].get_title().endswith(f"FP32 + AdamW on cpu{layout}: memory vs B")
    # under a pipeline the dashed curves are the papers' stage (both ends on it), which no device holds: named so
    labels = [x.get_text() for x in fig.axes[0].get_legend().get_texts()]
    assert sum("the papers' stage" in x for x in labels) == (2 if kw.get("pipeline_parallel") else 0), labels
    close(fig)
    # the table's (and every view's) header says it too
    assert d.title().endswith("fused attention (SDPA)" + layout)


def test_breakdown_splits_a_transformer_layer_and_speaks_plainly():
    from symmem.report.plots import breakdown, close, segments

    d = symmem.derive("vit-b16", convention="pytorch", attention="naive")
    parts = dict(segments(d))
    assert {"layer: residual stream", "layer: norms", "layer: attention", "layer: MLP"} <= set(parts)
    assert "layer" not in parts and sum(parts.values()) == d.value("total")   # the parts add up to the total
    resnet = symmem.derive("resnet50-v1", convention="paper")
    assert [n for n, _ in segments(resnet)][:2] == ["stem", "stage 1"]  # no layer to split
    fig = breakdown([d])
    ax = fig.axes[0]
    assert ax.get_title() == ("FP32 + AdamW: training memory by part\n(bars: kept after forward + parameters; line: "
                              "peak of a training step, what must fit)")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ViT-B/16 (naive)\nPyTorch autograd"]
    close(fig)


@pytest.mark.parametrize("kw", [
    {"values": {"L": 2, "B": 2, "S": 16}, "checkpoint": "full"},
    {"values": {"L": 3, "B": 2, "S": 16, "N": 2}, "data_parallel": "fsdp"},
    {"values": {"L": 2, "B": 2, "S": 16, "N": 2}, "data_parallel": "fsdp", "precision": "mixed"},  # refused
])
def test_a_view_below_the_formulas_domain_asks_the_peak_there(kw):
    """A view at a layer count below the formula's domain (the formula in L holds from 4) writes the step out after
    the peak at the derivation's numbers -- the one ``value("peak")`` works out and keeps (``symmem.step.exact_peak``)
    -- not after the formula in L, made before only for its refusals' words: the view refuses what that peak
    refuses, in its words, and answers what a fresh derivation's view does after the peak."""
    from symmem.errors import SymmemError

    def said(f):
        try:
            return f()
        except SymmemError as exc:
            return f"refused: {exc}"

    first = symmem.derive("gpt2", device="cpu", **kw)
    views = [said(lambda: first.timeline("first")), said(first.peak_allocated), said(lambda: first.value("peak"))]
    if isinstance(views[-1], int):
        assert (None, ()) not in first._step()._cache  # no formula in L was made
    again = symmem.derive("gpt2", device="cpu", **kw)
    peak = said(lambda: again.value("peak"))
    assert views == [said(lambda: again.timeline("first")), said(again.peak_allocated), peak]
    assert isinstance(peak, int) or views[0] == views[1] == peak
