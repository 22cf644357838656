"""Invariants over generated cases (hypothesis, bounded): what must hold whatever the model, convention or value.

* one layer x L + what lies outside the layer = the whole model, for every built-in model with a layer and every
  convention (a storage made outside the layer and kept by each layer counts once, in the whole model only);
* size conditions combined without enumerating every truth assignment give what the exhaustive merge gives,
  and twelve independent ones derive in well under a second;
* every derived number is a non-negative integer; sizes print exactly; the largest fitting value is the
  boundary of the formula evaluated independently.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from fractions import Fraction

import pytest
import sympy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from symmem import GraphBuilder, derive
from symmem.apps.budget import largest
from symmem.conventions import names as conventions
from symmem.graph import Model
from symmem.models import available, build
from symmem.passes import branches
from symmem.symbols import B, H
from symmem.units import UNITS, format_bytes, parse_size
from tests.kept_cases import kept

HUNT = int(os.environ.get("SYMMEM_FUZZ", "0"))


def bounded(n: int) -> settings:
    return settings(max_examples=HUNT or n, deadline=None, derandomize=not HUNT, database=None,
                    suppress_health_check=list(HealthCheck))


def _layered():
    out = []
    for name in sorted(available()):
        m = build(name)
        if m.layer is not None or len(m.graph.blocks) == 1:
            out.append(name)
    return out


LAYERED = _layered()
SEQUENCE = {"gpt2", "bert-base", "bert-large", "llama", "gpt-megatron"}


def _outside(d, model, layer):
    inside = {n for n in model.graph.order() if model.graph.node(n).block == layer}
    return sympy.Add(*(s.expr for s in d.storages
                       if s.category == "activation" and s.kept_at_forward_end and s.node not in inside))


#: the (convention, model) pairs the default suite asks (stop 42, docs/testing.md): a greedy cover of the pairs' line
#: coverage (every convention stays); -m deep asks every pair
LAYERED_KEPT = {"paper-gpt-megatron", "pytorch-vit-ti16", "paper-llama", "megatron-gpt2", "paper-bert-large",
                "pytorch-gpt-megatron", "pytorch-llama", "cs231n-gpt-megatron", "pytorch-vit-l16",
                "megatron-gpt-megatron", "megatron-vit-s16", "pytorch-gpt2"}
PAIRS = [(c, n) for n in LAYERED for c in conventions()]


@pytest.mark.filterwarnings("ignore::symmem.errors.NothingCounted")  # sweeps meet conventions that see nothing
@pytest.mark.parametrize("conv, name", kept(PAIRS, ["-".join(p) for p in PAIRS], LAYERED_KEPT, unpack=True))
def test_layer_times_count_plus_the_rest_is_the_whole(name, conv):
    m = build(name)
    layer = m.layer or next(iter(m.graph.blocks))
    count = m.graph.blocks[layer].count
    values = {"B": 2}
    if name in SEQUENCE:
        values |= {"S": 16, "L": 3}
        if name == "llama":  # both branches of repeat_kv's copy: G = 1 (a view) and G = 2 (a copy)
            values |= {"H": 64, "h": 4, "G": 2 if conv == "pytorch" else 1}
    whole = derive(name, convention=conv, values=values)
    one = derive(name, convention=conv, values=values, per_layer=True)
    n = whole.evaluate(count)
    assert whole.value("activations") == n * one.value("activations") + whole.evaluate(_outside(whole, m, layer))
    # and symbolically, where the formulas have no branches
    if not whole.activations.has(sympy.Piecewise) and count in whole.free:
        diff = sympy.expand(whole.activations - count * one.activations - _outside(whole, m, layer))
        assert diff == 0


def test_llama_rotary_tables_are_counted_once():
    """The cos/sin tables are made once per forward and kept by every layer: once in the whole model, never in
    one layer's formula (before: 8HS/h in the layer, so L x layer over-counted (L - 1) x 8HS/h)."""
    one = derive("llama", convention="pytorch", per_layer=True)
    assert not any(s.node.startswith("rotary_emb") for s in one.storages if s.category == "activation")
    whole = derive("llama", convention="pytorch")
    tables = [s for s in whole.storages if s.node in ("rotary_emb.cos", "rotary_emb.sin")]
    assert len(tables) == 2 and all(s.count == 1 for s in tables)


# -- size conditions ------------------------------------------------------------------------------------
def _conditional(k, chained=()):
    """k inputs (B, x_i, H), each through a linear, a transpose and a ``contiguous`` that copies iff x_i != 1,
    into a linear that keeps it; ``chained`` pairs (i, j) add a second view of i's copy whose copy also
    depends on x_j, so that i's and j's conditions interact."""
    g = GraphBuilder(f"cond{k}")
    xs = [sympy.Symbol(f"x{i}", positive=True, integer=True) for i in range(k)]
    outs = []
    for i, s in enumerate(xs):
        y = g.op("linear", g.input(f"in{i}", (B, s, H)), name=f"fc{i}", out_features=H)
        y = g.op("transpose", y, name=f"t{i}", dim0=1, dim1=2)
        outs.append(g.op("contiguous", y, name=f"c{i}", copy=sympy.Ne(s, 1)))
        g.op("linear", outs[-1], name=f"out{i}", out_features=4)
    for i, j in chained:
        y = g.op("transpose", outs[i], name=f"tt{i}{j}", dim0=1, dim1=2)
        y = g.op("contiguous", y, name=f"cc{i}{j}", copy=sympy.Eq(xs[j], 1))
        g.op("linear", y, name=f"o{i}{j}", out_features=4)
    return Model(g.graph.graph["name"], g.finish(), {B: 2, H: 8, **{s: 3 for s in xs}}, (B, H, *xs)), xs


CONDITIONS = st.integers(3, 4).flatmap(lambda k: st.tuples(st.just(k), st.lists(
    st.tuples(st.integers(0, k - 1), st.integers(0, k - 1)), max_size=2, unique=True)))


def _combined_equals_exhaustive(case):
    k, chained = case
    model, xs = _conditional(k, chained)
    results = []
    for limit in (branches.EXHAUSTIVE_UP_TO, 99):
        old = branches.EXHAUSTIVE_UP_TO
        branches.EXHAUSTIVE_UP_TO = limit
        try:
            results.append(derive(model, convention="pytorch", options={"device": "cpu"}))
        finally:
            branches.EXHAUSTIVE_UP_TO = old
    combined, exhaustive = results
    for point in itertools.product((1, 2), repeat=k):
        values = {s.name: v for s, v in zip(xs, point, strict=True)}
        a, e = combined.at(**values), exhaustive.at(**values)
        assert sorted((s.name, a.evaluate(s.expr)) for s in a.storages) == \
            sorted((s.name, e.evaluate(s.expr)) for s in e.storages), values
        # (the exhaustive total is one Piecewise of 2**k pieces: summed term by term, not folded)
        assert a.value("total") == sum(e.evaluate(t.expr) for t in e.terms)


# 4 cases in the default suite (was 10), 20 under -m deep: the same body, drawn twice
test_combined_branches_equal_the_exhaustive_merge = bounded(4)(given(CONDITIONS)(_combined_equals_exhaustive))
test_more_combined_branches_equal_the_exhaustive_merge = pytest.mark.deep(
    bounded(20)(given(CONDITIONS)(_combined_equals_exhaustive)))


def test_twelve_independent_conditions_are_fast():
    model, xs = _conditional(12)
    start = time.perf_counter()
    d = derive(model, convention="pytorch", options={"device": "cpu"})
    total = d.total
    assert d.value("total") > 0
    elapsed = time.perf_counter() - start
    assert elapsed < 1.0, elapsed  # 2**12 branches took 5.7 s (33 s on a loaded machine) before
    assert len(sympy.Add.make_args(total)) >= 12 and all(
        len(p.args) == 2 for p in total.atoms(sympy.Piecewise))  # 12 small Piecewise terms, not 4096 pieces


def test_the_peak_with_many_conditions_is_the_selected_step(monkeypatch):
    """Beyond PEAK_CONDITIONS size conditions the peak is the step the numbers select (not 2**k steps merged):
    at every point its bytes equal the merge over every assignment, and its domain names the conditions."""
    from symmem import engine

    many, _ = _conditional(12)
    assert derive(many, convention="pytorch", options={"device": "cpu"}).value("peak") > 0  # 4096 steps before
    model, xs = _conditional(5)
    selected = derive(model, convention="pytorch", options={"device": "cpu"})
    monkeypatch.setattr(engine, "PEAK_CONDITIONS", 99)
    merged = derive(model, convention="pytorch", options={"device": "cpu"})
    for point in [(1, 2, 2, 2, 2), (2, 1, 1, 2, 3), (3, 3, 3, 3, 3), (1, 1, 1, 1, 1)]:
        values = {s.name: v for s, v in zip(xs, point, strict=True)}
        a, m = selected.at(**values), merged.at(**values)
        assert (a.value("peak"), a.value("peak_first_step")) == (m.value("peak"), m.value("peak_first_step"))
    assert len(selected._peak().domain) == 5 and len(merged._peak().domain) == 0


# -- numbers --------------------------------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::symmem.errors.NothingCounted")  # sweeps meet conventions that see nothing
@bounded(25)
@given(st.sampled_from(["resnet18", "vgg11", "vit-ti16", "gpt2", "bert-base", "llama", "mlp"]),
       st.sampled_from(conventions()), st.integers(1, 2**20))
def test_derived_numbers_are_non_negative_integers(name, conv, b):
    d = derive(name, convention=conv, values={"B": b})
    for key in ("activations", "parameter_memory", "total", "input", "parameters"):
        v = d.value(key)
        assert isinstance(v, int) and v >= 0
    assert all(d.evaluate(t.expr) >= 0 for t in d.terms)


@bounded(200)
@given(st.integers(0, 10**60), st.sampled_from([True, False]))
def test_format_bytes_is_exact(n, binary):
    text = format_bytes(n, binary)
    number, unit = text.split()
    scale = UNITS[unit]
    assert abs(Fraction(number) - Fraction(n, scale)) <= Fraction(1, 2000)
    if n >= 2**10:
        assert unit != "B"


@bounded(100)
@given(st.integers(1, 10**30), st.sampled_from(["B", "KiB", "MiB", "GiB", "TiB", "kB", "MB", "GB", "TB"]))
def test_parse_size_is_exact(n, unit):
    assert parse_size(f"{n}{unit}") == n * UNITS[unit]


@bounded(25)
@given(st.integers(2 * 2**30, 2**50))
def test_largest_is_the_boundary(budget):
    d = derive("vit-b16", convention="paper", attention="naive")
    free = sorted(d.total.free_symbols, key=str)

    def plain(x):
        total = Fraction(0)
        for exps, coeff in sympy.Poly(d.total, *free).terms():
            term = Fraction(int(coeff.p), int(coeff.q))
            for s, e in zip(free, exps, strict=True):
                term *= (x if s.name == "B" else d.numbers[s]) ** e
            total += term
        return math.ceil(total)

    r = largest(d, "B", budget)
    assert plain(r.max) <= budget < plain(r.max + 1)


@pytest.mark.parametrize("name", ["gpt2", "resnet18"])
def test_micro_batches_repeat(name, monkeypatch):
    """Gradient accumulation: passes after the second repeat it, so writing out three gives the peak every pass
    written out gives (K = 5 here), and a huge K is as fast as 3 (it took 0.4 s per micro-batch before)."""
    from symmem.passes import schedule

    def peaks(k):
        d = derive(name, convention="pytorch", device="cpu", micro_batches=k, values={"B": 2})
        return d.value("peak"), d.value("peak_first_step")

    start = time.perf_counter()
    short = {k: peaks(k) for k in (5, 10**6)}
    assert time.perf_counter() - start < 30
    monkeypatch.setattr(schedule, "MICRO_BATCH_PASSES", 10**9)
    assert short[5] == short[10**6] == peaks(5)
