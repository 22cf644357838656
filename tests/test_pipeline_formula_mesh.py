"""The pipeline peak as a formula under an engine around the stages: FSDP2 on every stage (FSDP x PP,
``symmem.passes.mesh_formula``), in ``N`` and the model's sizes, substituted at OTHER sizes than it was derived at.

Truths: the real 2 x 2 gloo mesh of tests/test_fsdp_pipeline.py (its spawn calls :func:`fsdp_against_the_engines`
with every rank's measurement: no spawn of its own), and the engine's replay at numbers (checked to the byte against
gloo there) at other numbers of layers: a moment's formula derived at one set of sizes is, at another, the stage's
peak where that moment is the peak there, and below it where another moment is.
"""

from __future__ import annotations

import functools

import pytest
import sympy

from symmem import derive

N = sympy.Symbol("N", positive=True, integer=True)
L = sympy.Symbol("L", positive=True, integer=True)
T = sympy.Symbol("t", positive=True, integer=True)

#: per case of test_fsdp_pipeline.CASES: other sizes (N = 3 and 4 among them, the real mesh is N = 2; an odd
#: vocabulary there, padded): each stage's formula derived there, at the measured sizes, is at most the measured
#: rank's peak, and from some of them equal to it (the same moment is the peak)
FSDP_OTHER = {0: [{"B": 4, "S": 8, "H": 48, "h": 3}, {"V": 100, "N": 4}],
              1: [{"B": 3, "S": 8, "N": 4}, {"H": 64, "h": 4, "V": 40, "N": 4}],
              2: [{"H": 64, "h": 4, "V": 40, "N": 4}, {"B": 3, "S": 32, "F": 96, "N": 3}]}


@functools.lru_cache(maxsize=32)
def _fsdp(model, values, schedule, m, loss, options, reshard):
    """An FSDP x pipeline derivation, p = 2 (``values`` and ``options`` as sorted tuples; N = 2 unless given)."""
    sizes = {"p": 2, "N": 2, **dict(values)}
    if model == "gpt2":
        sizes.setdefault("F", 4 * sizes["H"])
    return derive(model, data_parallel="fsdp" if reshard else "fsdp-no-reshard", pipeline_parallel=True,
                  pipeline_schedule=schedule, micro_batches=m, loss=loss, device="cpu", values=sizes,
                  **dict(options))


def _each(d, sizes):
    """Each stage's largest moment's formula (steady, first step) at ``sizes``."""
    out = []
    for step in ("steady", "first"):
        moments = d.step.stage_moments(d.numbers, step)
        assert all("a line in B" not in m.pinned() for m in moments)
        out.append([d.at(**sizes).evaluate(m.total) for m in moments])
    return out


def fsdp_against_the_engines(everything, cases):
    """``everything``: per rank (rank s*N + r), test_fsdp_pipeline's results of its ``cases`` on the 2 x 2 mesh.
    Each stage's formula (data-parallel rank 0's, whole shards: the stage's largest) from other sizes, N
    included, at the measured sizes is the measured rank's peak where the same moment peaks, else below it."""
    for k, others in FSDP_OTHER.items():
        model, values, schedule, m, loss, options, reshard = cases[k]
        sizes = {**values, "p": 2, "N": 2, **({"F": 4 * values["H"]} if model == "gpt2" else {})}
        real = {r.pp: r for rank in everything for r in [rank[k]] if r.dp == 0}
        found = []
        for other in others:
            at = {**values, **other}
            if "h" in other and model == "llama":
                at["G"] = 1 if other["h"] % 2 else 2
            d = _fsdp(model, tuple(sorted(at.items())), schedule, m, loss, tuple(sorted(options.items())), reshard)
            assert N in d.peak_at().total.free_symbols, (k, other)  # the shards' padding: ceiling(V/N), ...
            found.append(_each(d, sizes))
        for which, (step, key) in enumerate((("steady", "steady_peak"), ("first", "first_peak"))):
            measured = [getattr(real[s], key) for s in (0, 1)]
            assert all(f[which][s] <= measured[s] for f in found for s in (0, 1)), (k, step, found, measured)
            assert any(f[which][s] == measured[s] for f in found for s in (0, 1)), (k, step, found, measured)
        assert [max(f[0][s] for f in found) for s in (0, 1)] == [real[s].steady_peak for s in (0, 1)], (k, found)


#: per case of test_tensor_pipeline.CASES (TP x PP, the real p x t = 2 x 2 mesh): other sizes, t = 4 among them
TENSOR_OTHER = {0: [{"t": 4, "h": 8, "G": 4}, {"H": 64, "h": 8, "G": 4}],
                1: [{"t": 4, "h": 8, "G": 4, "B": 4}, {"S": 32}]}


@functools.lru_cache(maxsize=16)
def _tensor(values, schedule, m, loss, options):
    """A TP x pipeline derivation of the Llama reference, p = 2 (t = 2 unless given)."""
    return derive("llama", tensor_parallel=True, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m,
                  loss=loss, device="cpu", values={"p": 2, "t": 2, **dict(values)},
                  **{k: v for k, v in options if k != "tensor_parallel"})


def tensor_against_the_engines(everything, cases):
    """``everything``: per rank (rank s*t + r), test_tensor_pipeline's results of its ``cases`` on the 2 x 2 mesh
    (every tensor-parallel rank of a stage alike).  Each stage's formula, in t and the rank's local sizes, from
    other sizes (t = 4 among them), at the measured sizes is the measured peak where the same moment peaks there,
    else below it, steady and first step."""
    for k, others in TENSOR_OTHER.items():
        _, values, schedule, m, loss, options, _ = cases[k]
        sizes = {**values, "p": 2, "t": 2}
        real = {r.pp: r for rank in everything for r in [rank[k]] if r.dp == 0}
        found = []
        for other in others:
            d = _tensor(tuple(sorted({**values, **other}.items())), schedule, m, loss, tuple(sorted(options.items())))
            assert T in d.peak_at().total.free_symbols, (k, other)  # the rank's local sizes: V/t, F/t, ...
            found.append(_each(d, sizes))
        for which, key in enumerate(("steady_peak", "first_peak")):
            measured = [getattr(real[s], key) for s in (0, 1)]
            assert all(f[which][s] <= measured[s] for f in found for s in (0, 1)), (k, key, found, measured)
            assert [max(f[which][s] for f in found) for s in (0, 1)] == measured, (k, key, found, measured)


#: per case of test_fsdp_tensor_pipeline.CASES (the 3-D mesh, p x N x t = 2 x 2 x 2): other sizes, N = 3 and 4 and
#: t = 4 among them (V/t = 33 rows a tensor-parallel rank there, padded to 34 over N = 2)
MESH_OTHER = {0: [{"N": 4, "B": 3}, {"N": 3, "t": 4, "h": 8, "G": 4, "V": 132, "F": 128}]}


@functools.lru_cache(maxsize=16)
def _mesh(values, schedule, m, loss, options, reshard=True):
    """An FSDP x TP x pipeline derivation of the Llama reference (p = N = t = 2 unless given)."""
    return derive("llama", data_parallel="fsdp" if reshard else "fsdp-no-reshard", tensor_parallel=True,
                  pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, loss=loss, device="cpu",
                  values={"p": 2, "N": 2, "t": 2, **dict(values)},
                  **{k: v for k, v in options if k not in ("tensor_parallel", "data_parallel")})


def mesh_against_the_engines(everything, cases):
    """``everything``: per rank (rank s*N*t + d*t + r), test_fsdp_tensor_pipeline's results of its ``cases``.
    Each stage's formula (data-parallel rank 0's: whole shards), in N, t and the sizes, from other sizes, at the
    measured sizes is the measured peak where the same moment peaks there, else below it."""
    for k, others in MESH_OTHER.items():
        _, values, schedule, m, loss, options, reshard = cases[k]
        sizes = {**values, "p": 2, "N": 2, "t": 2}
        real = {r.pp: r for rank in everything for r in [rank[k]] if r.dp == 0 and r.tp == 0}
        found = []
        for other in others:
            d = _mesh(tuple(sorted({**values, **other}.items())), schedule, m, loss, tuple(sorted(options.items())),
                      reshard)
            assert {N, T} <= d.peak_at().total.free_symbols, (k, other)  # ceiling(V/(N*t)), ...
            found.append(_each(d, sizes))
        for which, key in enumerate(("steady_peak", "first_peak")):
            measured = [getattr(real[s], key) for s in (0, 1)]
            assert all(f[which][s] <= measured[s] for f in found for s in (0, 1)), (k, key, found, measured)
            assert [max(f[which][s] for f in found) for s in (0, 1)] == measured, (k, key, found, measured)


#: four layers a stage at L = 8 (p = 2), so a run of alike layers gives each moment's formula in L/p; checked at
#: L = 12 with another N or t against the engine's replay there: (the derivation, sizes, the other sizes)
LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "V": 64, "F": 64}
LAYERS = {
    # FSDP x PP (resharding: the backward's prefetch of the layer before the moment's is left out of the run)
    "fsdp": (lambda v: _fsdp("gpt2", v, "1f1b", 3, "cross-entropy", (("attention", "naive"), ("dropout", 0.0)), True),
             {"B": 2, "S": 16, "H": 32, "h": 2, "V": 65}, {"N": 3}),
    "tensor": (lambda v: _tensor(v, "1f1b", 3, "cross-entropy", (("attention", "sdpa"),)), LLAMA,
               {"t": 4, "h": 8, "G": 4}),
    "mesh": (lambda v: _mesh(v, "1f1b", 2, "cross-entropy", (("attention", "sdpa"),)), {**LLAMA, "V": 66},
             {"N": 3}),
}


@pytest.mark.parametrize("engine", list(LAYERS))
def test_the_formula_in_l_over_p_is_the_engines_peak_elsewhere(engine):
    """An engine's storages of the stage's layers (FSDP's unsharded parameters and all-gathers, the rank's local
    storages and collectives) grow with ``L/p`` in the formula: derived at L = 8, at L = 12 and another N or t each
    stage's formula is the engine's stage peak there (the same moment peaks), steady and first step; the peak line
    names p and M alone."""
    make, values, other = LAYERS[engine]
    d = make(tuple(sorted({**values, "L": 8}.items())))
    moments = [d.step.stage_moments(d.numbers, step) for step in ("steady", "first")]
    assert all(L in x.total.free_symbols and "L =" not in x.pinned() for each in moments for x in each)
    assert d.peak_at().pinned().startswith(f"at p = 2, M = {d.step.micro_batches}")
    o = make(tuple(sorted({**values, "L": 12, **other}.items())))
    each = o.step.per_stage(o.numbers)
    for found, name in zip(moments, ("peak_per_stage", "peak_first_step_per_stage"), strict=True):
        assert [d.at(L=12, **other).evaluate(x.total) for x in found] == each[name], name


def test_every_view_gives_the_fsdp_formula():
    """The peak line, JSON (``formula_at``, each stage's formula evaluating to its peak) and the first step's:
    FSDP x PP's moments are formulas in N and the sizes, at p and M (no longer lines in B)."""
    d = _fsdp("llama", (("B", 2), ("F", 64), ("G", 2), ("H", 32), ("L", 2), ("S", 16), ("V", 63), ("h", 4)), "gpipe",
              2, "cross-entropy", (("attention", "sdpa"),), False)
    text = " ".join(str(d).split())
    assert "(at p = 2, M = 2, h/G != 1, L = 2; the largest of" in text and "a line in B" not in text
    out = d.to_dict()
    assert out["peak_at"]["formula_at"] == "at p = 2, M = 2, h/G != 1, L = 2"
    per_stage = [sympy.sympify(e, locals={s.name: s for s in d.free}) for e in out["expressions"]["peak_per_stage"]]
    assert [d.evaluate(e) for e in per_stage] == out["values"]["peak_per_stage"] == [297672, 330780]
    assert all(N in e.free_symbols for e in per_stage)
    assert d.evaluate(d.peak_at(step="first").total) == d.value("peak_first_step")


#: per case of test_traced_pipeline.CASES (two ranks): other sizes of the traced dimensions (the file module's B;
#: Hugging Face's B and S): the formula read from the replay there, at the measured sizes
#: test_traced_pipeline.CASES: the file module (0), HF Llama (6), HF Qwen2 (8; its real ranks under ``-m deep``)
TRACED_OTHER = {0: [{"B": 6}], 6: [{"B": 3, "S": 16}], 8: [{"S": 16}]}


def traced_against_the_engines(real, cases, derived):
    """``real``: per rank (the stage), test_traced_pipeline's results of its ``cases``; ``derived``: its derive.
    Each stage's formula in the module's traced sizes (the blocks at their number, said), derived at other sizes,
    at the measured sizes is the measured stage's peak where the same moment peaks there, else below it; the
    first step's too.  The cases without real ranks in ``real`` (None: not run) are left out."""
    for k, others in TRACED_OTHER.items():
        if any(rank[k] is None for rank in real):
            continue
        d = derived(*cases[k])
        ranks = [rank[k] for rank in real]
        for other in others:
            o = d.at(**other)
            for key, step in (("peak", "steady"), ("first_peak", "first")):
                moments = o.step.stage_moments(o.numbers, step)
                assert all(m.pinned().endswith(f", L = {d.evaluate(L)}") for m in moments if m.phase != "step"), k
                found = [d.evaluate(m.total) for m in moments]  # at the case's own sizes
                measured = [getattr(r, key) for r in ranks]
                assert all(f <= r for f, r in zip(found, measured, strict=True)), (k, other, step, found, measured)
                assert any(f == r for f, r in zip(found, measured, strict=True)), (k, other, step, found, measured)
                if step == "steady":
                    assert found == measured, (k, other, found, measured)

