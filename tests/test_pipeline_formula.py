"""The pipeline peak as a formula in the model's sizes (``symmem.passes.pipeline_formula``), substituted at OTHER
sizes than it was derived at.

Truths: the real gloo pipeline (two ranks, GPT-2, 1F1B, three layers a stage: the job :data:`JOBS` rides in
``test_model_parallel.test_against_the_engines``' spawn and :func:`against_the_engines` compares) and the
existing cases of that spawn (one layer a stage: ``L`` keeps its number); and the engine's own replay at numbers
(checked to the byte against gloo in test_model_parallel / test_pipeline_replay) at many sizes: a moment's formula
derived at one set of sizes is, at another, the bytes of the same op of the same micro-batch in the replay there --
the peak where that moment is the peak there, below it where another moment is.
"""

from __future__ import annotations

import functools

import pytest
import sympy

from symmem import derive
from symmem.passes.unroll import iteration, template

OPTIONS = {"attention": "naive", "dropout": 0.0, "device": "cpu"}
#: the gloo job: GPT-2, 1F1B, M = 3, two stages of three layers (``F`` = 4H in the reference)
REAL = {"B": 2, "S": 32, "H": 32, "h": 2, "L": 6, "V": 64}
JOBS = [("pipeline", "gpt2", REAL, ("1f1b", 3, "cross-entropy"))]
#: other sizes with the same peak moments (the last layer's GELU of micro-batch 1 on stage 0, of micro-batch 2 on
#: stage 1), and other sizes where stage 0's is another (the MLP's output projection)
SAME = {"B": 4, "S": 24, "H": 48, "h": 3, "L": 8, "V": 100, "F": 192}
OTHER = {"B": 3, "S": 16, "H": 64, "h": 4, "L": 8, "V": 128, "F": 128}


def _gpt2(values, schedule="1f1b", m=3, loss="cross-entropy"):
    return _derived("gpt2", tuple(sorted(values.items())), schedule, m, loss, ())


@functools.lru_cache(maxsize=32)
def _derived(model, values, schedule, m, loss, options):
    """A pipeline derivation with p = 2 (kept: the tests here and the spawns' checks ask for the same ones)."""
    return derive(model, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, loss=loss,
                  values={**dict(values), "p": 2}, **{**OPTIONS, **dict(options)})


def _at(d, expr, values):
    """``expr`` at ``values`` (names), the other symbols at ``d``'s numbers."""
    return d.at(**values).evaluate(expr)


def against_the_engines(real, existing, cases):
    """``real``: per rank, the :data:`JOBS` run; ``existing``: per rank, test_model_parallel's ``cases`` (p = 2,
    L = 2).  Each stage's formula derived at other sizes, at the measured sizes, is the measured peak."""
    sizes = {**REAL, "F": 128}
    d = _gpt2(SAME)
    steady, first = d.step.stage_moments(d.numbers), d.step.stage_moments(d.numbers, "first")
    assert [m.pinned() for m in steady] == ["at p = 2, M = 3"] * 2  # L/p in the formula
    assert [_at(d, m.total, sizes) for m in steady] == [r[0].peak for r in real] == [2764440, 1533100]
    assert [_at(d, m.total, sizes) for m in first] == [r[0].first_peak for r in real]
    # where stage 0's peak is another moment at the sizes derived at, its formula is that moment's: below the peak
    o = _gpt2(OTHER)
    moment = o.step.stage_moments(o.numbers)[0]
    assert moment.node == "h.mlp.c_proj" and _at(o, moment.total, sizes) < real[0][0].peak
    assert _at(o, moment.total, sizes) in _replayed(_gpt2(sizes), 0, moment, 4)
    # the spawn's one-layer stages: L keeps its number, the other sizes are symbols (H, h, F, V others here)
    other = {"B": 2, "S": 32, "H": 48, "h": 3, "V": 80, "F": 192, "L": 2}
    for k, (schedule, m, loss) in enumerate(cases):
        d = _gpt2(other, schedule, m, loss)
        each = d.step.stage_moments(d.numbers)
        assert all(x.pinned().endswith(", L = 2") or x.phase == "step" for x in each)
        found = [_at(d, x.total, {**REAL, "L": 2, "F": 128}) for x in each]
        assert found == [r[k].peak for r in existing], cases[k]


#: DDP x pipeline (test_ddp_pipeline's spawn: its DDP, ZeRO-1 and bucket-view cases, p = N = 2):
#: other sizes; at each, a stage's formula is its moment's, the measured peak where that moment is the peak
DDP_OTHER = {0: [{"B": 4, "S": 8, "H": 48, "h": 3, "V": 80}],
             1: [{"S": 32, "V": 100, "F": 128}],
             # ZeRO-1: the rank's own state is the partition's at these sizes (whole parameters): B and S move
             2: [{"B": 4, "S": 8}], 3: [{"B": 3, "S": 8}],
             4: [{"B": 4, "S": 8, "H": 64, "h": 4, "V": 40}, {"B": 3, "S": 24, "H": 48, "h": 3, "V": 80}]}


def ddp_against_the_engines(everything, cases, derived):
    """``everything``: per rank (rank s*N + r), test_ddp_pipeline's results of its ``cases``; ``derived``: its
    derive.  DDP's buckets (the stage's gradients; under the bucket view the step's gradients themselves) beside the
    stage's moment, ZeRO-1's own state in place of the stage's: each stage's formula from other sizes, at the
    measured sizes, is at most the stage's largest measured rank's peak, and equal to it from some other sizes,
    steady and first step."""
    for k, others in DDP_OTHER.items():
        case = cases[k]
        model, values = case[0], case[1]
        sizes = {**values, **({"F": 4 * values["H"]} if model == "gpt2" else {})}
        real = [rank[k] for rank in everything]
        found = []
        for other in others:
            d = derived(model, {**values, **other}, *case[2:])
            assert all("a line in B" not in m.pinned() for m in d.step.stage_moments(d.numbers)), case
            found.append([[_at(d, m.total, sizes) for m in d.step.stage_moments(d.numbers, step)]
                          for step in ("steady", "first")])
        # each stage's largest data-parallel rank (ZeRO-1's differ; DDP's are alike)
        steady = [max(r.steady_peak for r in real if r.pp == s) for s in (0, 1)]
        first = [max(r.first_peak for r in real if r.pp == s) for s in (0, 1)]
        assert [max(f[0][s] for f in found) for s in (0, 1)] == steady, (case, found)
        assert all(f[1][s] <= first[s] for f in found for s in (0, 1)), (case, found)
        # the first step's too, where its moment is the peak at the other sizes (GPT-2's stage 1 under DDP is the
        # optimizer step there, its last layer's MLP output projection here)
        assert any(f[1][s] == first[s] for f in found for s in (0, 1)), case


def _replayed(d, s, moment, per_derived):
    """Stage ``s``'s bytes in ``d``'s replay at every op of ``moment``'s template and micro-batch, in the layer
    that stands where ``moment``'s stood (the stage's last or first, or as far from the nearer end)."""
    per = d.numbers[sympy.Symbol("L", positive=True, integer=True)] // 2
    own = int(moment.layer) - s * per_derived if moment.layer else None
    layer = None if own is None else own if own - 1 <= per_derived - own else per - (per_derived - own)
    replay = d.step._replays(d.step._named(None))[s]
    return {live for live, node, mb in replay.moments if node and template(node) == moment.node
            and mb == moment.micro_batch and (layer is None or iteration(node) - s * per == layer)}


#: (model, sizes derived at, other sizes, schedule, M, options): the other sizes keep the branch of the step's copies
CASES = [
    ("gpt2", SAME, [{"B": 5, "S": 16, "H": 64, "h": 4, "L": 12, "F": 256, "V": 100}], "1f1b", 3, {}),
    ("llama", {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 8, "V": 64, "F": 64},
     [{"B": 2, "S": 32, "H": 32, "h": 4, "G": 2, "L": 10, "V": 64, "F": 64},
      {"B": 2, "S": 16, "H": 16, "h": 4, "G": 2, "L": 6, "V": 80, "F": 96}], "1f1b", 3, {"attention": "naive"}),
    ("llama", {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 8, "V": 64, "F": 64},
     [{"B": 2, "S": 32, "H": 16, "h": 2, "G": 1, "L": 10, "V": 80, "F": 64}], "gpipe", 2, {"attention": "sdpa"}),
]


@pytest.mark.parametrize("model, derived, others, schedule, m, options", CASES)
def test_a_moments_formula_is_its_bytes_at_other_sizes(model, derived, others, schedule, m, options):
    """Every stage's largest moment (steady and first step), derived at one set of sizes: at each other set, its
    formula is the replay's bytes at that op there -- the stage's peak where the same moment is the peak."""
    d = _derived(model, tuple(sorted(derived.items())), schedule, m, "cross-entropy", tuple(options.items()))
    per = derived["L"] // 2
    same = 0
    for values in others:
        o = _derived(model, tuple(sorted(values.items())), schedule, m, "cross-entropy", tuple(options.items()))
        for step in ("steady", "first"):
            theirs = o.step.stage_moments(o.numbers, step)
            for s, moment in enumerate(d.step.stage_moments(d.numbers, step)):
                v = _at(d, moment.total, values)
                peak = o.evaluate(theirs[s].total)
                assert peak == (o.value("peak") if step == "steady" else o.value("peak_first_step")) or s != _top(o,
                                                                                                              step)
                if moment.phase == "step":
                    assert v == o.step.per_stage(o.numbers)["peak_per_stage" if step == "steady" else
                                                            "peak_first_step_per_stage"][s] or v <= peak
                    continue
                shift = 0 if step == "steady" else _state(o, s)
                assert v + shift in _replayed(o, s, moment, per), (values, step, s)
                assert v <= peak
                if sympy.expand(moment.total - theirs[s].total) == 0:
                    assert v == peak
                    same += 1
    assert same  # the same moment is the peak somewhere else


def _top(d, step):
    key = "peak_per_stage" if step == "steady" else "peak_first_step_per_stage"
    each = d.step.per_stage(d.numbers)[key]
    return each.index(max(each))


def _state(d, s):
    """Stage ``s``'s optimizer state (the first step's pipeline phase holds none of it)."""
    from symmem.passes.model_parallel import memory_of

    memory = memory_of(d.step._stages(), s, 2)
    return memory.at(d.step._named(None), ["optimizer_state"])["optimizer_state"]


def test_every_view_says_what_the_formula_holds_at(capsys):
    """The peak line, JSON, LaTeX and Jupyter: the moment's formula in the sizes and L/p, the schedule's numbers
    said; each stage's formula in JSON evaluates to its peak (an engine around the stages:
    tests/test_pipeline_formula_mesh.py; a traced stage's line in B: test_traced_stages_say_a_line_in_b)."""
    d = _gpt2(SAME)
    text = str(d)
    assert "(at p = 2, M = 3; the largest of" in " ".join(text.split())
    out = d.to_dict()
    assert out["peak_at"]["formula_at"] == "at p = 2, M = 3"
    per_stage = [sympy.sympify(e, locals={s.name: s for s in d.free}) for e in out["expressions"]["peak_per_stage"]]
    assert [d.evaluate(e) for e in per_stage] == out["values"]["peak_per_stage"]
    assert {"L", "p", "S", "H", "F", "V", "B"} <= {s.name for s in per_stage[0].free_symbols}
    formula = d.peak_at().total
    assert d.evaluate(formula) == d.value("peak") and sympy.Symbol("L", positive=True, integer=True) in (
        formula.free_symbols)
    assert "(at p = 2, M = 3)" in d._repr_html_() and "at p = 2, M = 3" in d._repr_latex_()
    # the JSON Max and values at many batches: the lines' values (fit and plot read them)
    assert d.values("peak", B=[2, 3, 7]).tolist() == [d.at(B=b).value("peak") for b in (2, 3, 7)]


def test_a_batch_of_one_and_short_stages():
    """At B = 1 (a branch of its own: the lines' domain is B >= 2) the formula is read from that replay; with two
    layers a stage no run of alike layers shows what one more holds: L keeps its number."""
    d = _gpt2({**SAME, "B": 1})
    m = d.peak_at()
    assert d.evaluate(m.total) == d.value("peak") and m.pinned() == "at p = 2, M = 3"
    short = _gpt2({**SAME, "L": 4})
    assert short.peak_at().pinned() == "at p = 2, M = 3, L = 4"
    assert sympy.Symbol("L", positive=True, integer=True) not in short.peak_at().total.free_symbols
    assert short.evaluate(short.peak_at().total) == short.value("peak")
