"""One palette keyed by what the memory is: a category has the same colour in every figure (the notebooks and the
paper draw several side by side), and axes are labelled in words."""

from __future__ import annotations

import pytest

import symmem
from symmem.report import plots

pytest.importorskip("matplotlib")


def _bars(fig):
    from matplotlib.colors import to_hex

    return {c.get_label(): to_hex(c.patches[0].get_facecolor()) for c in fig.axes[0].containers}


def test_a_category_keeps_its_colour_across_figures():
    from matplotlib.colors import to_hex

    resnet = symmem.derive("resnet50-v1", optimizer="adamw", device="cpu")
    vit = symmem.derive("vit-b16", convention="paper")
    megatron = symmem.derive("gpt-megatron", convention="megatron", precision="mixed-full-copies", per_layer=True)
    figs = [plots.breakdown([resnet]), plots.breakdown([vit, resnet]), plots.breakdown([megatron])]
    timeline = plots.timeline(resnet)
    try:
        one, two, mixed = (_bars(f) for f in figs)
        live = {c.get_label(): to_hex(c.get_facecolor()[0]) for c in timeline.axes[0].collections if c.get_label()}
        for name in ("weights", "gradients", "exp_avg", "exp_avg_sq", "input"):
            assert one[name] == two[name], name
        # the breakdown's parameter side and input wear the timeline's category colours
        assert (one["weights"], one["gradients"], one["exp_avg"], one["input"]) == (
            live["parameter"], live["gradient"], live["optimizer state"], live["input"])
        # a mixed-precision regime's FP16 weights are weights, its FP32 copies the optimizer's
        assert mixed["weights"] == one["weights"] and mixed["exp_avg"] == one["exp_avg"]
        assert mixed["master_weights"] != mixed["weights"]
        # a transformer layer's parts keep their colours whatever else is drawn
        assert two["layer: attention"] == mixed["layer: attention"] and two["layer: MLP"] == mixed["layer: MLP"]
    finally:
        for f in [*figs, timeline]:
            plots.close(f)


def test_axes_in_words():
    d = symmem.derive("gpt2", values={"B": 8})
    fig = plots.scaling([d], name="S", budget="80GiB", values=range(64, 1025, 64))
    try:
        ax = fig.axes[0]
        assert (ax.get_xlabel(), ax.get_ylabel()) == ("sequence length S (tokens)", "peak of a training step (GiB)")
    finally:
        plots.close(fig)
