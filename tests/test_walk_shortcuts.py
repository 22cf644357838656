"""The shortcuts the tensor-parallel and mesh walks take for speed (issue 19, item 5) give what sympy gives.

* a candidate moment's bytes at the probes (``tensor_step.ceiling_at``: each part's exact value kept, no
  ``xreplace`` that rebuilds and re-evaluates every ``Max``) equal ``int(ceiling(x.xreplace(probe)))`` -- every
  candidate of the tensor-parallel, sequence-parallel, FSDP x TP and FSDP x SP walks, compared one by one;
* ``largest_of``'s term-by-term bound (coefficient dicts, no sympy difference) decides as the sympy difference's
  coefficients do, for every pair of the optimizer step's candidates of TP, FSDP2 x TP and FSDP1 x TP;
* a domain's ``Eq(N, 8)`` / ``Ge(L, 2)`` built without sympy's attempt to decide them equal sympy's, and are
  sympy's own verdict where sympy decides (a size 0, ``Ge(N, 1)``).
"""

from __future__ import annotations

import itertools

import pytest
import sympy

from symmem import derive
from symmem.passes import fsdp_tensor, tensor_step
from symmem.symbols import N, at_least, equals, t

SMALL = {"L": 2, "H": 64, "h": 4, "G": 2, "F": 128, "S": 16, "V": 1030, "B": 2}


def _sympy_ceiling(x, env, memo):
    return int(sympy.ceiling(x.xreplace(env)))


@pytest.mark.parametrize("walk, numbers, engine", [
    (tensor_step._LayerWalk, {**SMALL, "t": 2}, None),
    # under ``-m deep`` since stop 42: its lines are all run by the other four (line coverage, docs/testing.md)
    pytest.param(tensor_step._SequenceWalk, {**SMALL, "t": 2}, None, marks=pytest.mark.deep),
    (tensor_step._SequenceWalk, {**SMALL, "t": 2, "B": 1}, None),
    (fsdp_tensor._MeshWalk, {**SMALL, "L": 3, "t": 2, "N": 2}, "fsdp"),
    (fsdp_tensor._MeshSequenceWalk, {**SMALL, "L": 3, "t": 2, "N": 2}, "fsdp"),
])
def test_candidates_at_the_probes_equal_sympys_evaluation(walk, numbers, engine, monkeypatch):
    sequence = issubclass(walk, tensor_step._SequenceWalk)
    step = derive("llama", convention="pytorch", device="cpu", values=numbers, tensor_parallel=True,
                  sequence_parallel=sequence, data_parallel=engine).step
    found = walk(step.graph, step.conv, step.options, step.regime, numbers).candidates()
    monkeypatch.setattr(tensor_step, "ceiling_at", _sympy_ceiling)
    truth = walk(step.graph, step.conv, step.options, step.regime, numbers).candidates()
    assert len(found) > 50
    assert found == truth


def test_largest_of_bounds_as_the_sympy_difference_does(monkeypatch):
    seen = []
    given = []  # (candidate, the terms its caller worked out from its sizes' expanded once)
    real = tensor_step.largest_of

    def spy(cs, terms=None):
        seen.append(list(cs))
        given.extend(zip(cs, terms, strict=True) if terms is not None else [])
        return real(cs, terms)

    monkeypatch.setattr(tensor_step, "largest_of", spy)
    for engine in (None, "fsdp", "fsdp1"):
        d = derive("llama", convention="pytorch", device="cpu", tensor_parallel=True, data_parallel=engine,
                   values={"t": 2, "L": 2, **({"N": 3} if engine else {})})
        d.value("peak")
        if engine == "fsdp":
            d.step.per_rank(d.numbers)  # the last rank's shards: fewer rows (Max(0, ...) in its sizes)
    # TP's, FSDP x TP's rank 0 and its last rank (each optimizer step worked out once for both steps: was twice)
    assert len(seen) == 3
    # the terms combined from each size's (the optimizer step's candidates, TP's and FSDP x TP's) are sympy's of
    # the candidate expanded
    assert len(given) > 20
    for c, terms in given:
        assert terms == tensor_step._terms(sympy.expand(c)), c

    def bounds(a, b):  # what it was: the difference built in sympy
        if a.has(sympy.Piecewise) or b.has(sympy.Piecewise):
            return False
        return all(c >= 0 for c in (a - b).as_coefficients_dict().values())

    pairs = 0
    for found in seen:
        expanded = [sympy.expand(c) for c in dict.fromkeys(found)]
        for a, b in itertools.product(expanded, expanded):
            assert tensor_step._bounds(tensor_step._terms(a), tensor_step._terms(b)) == bounds(a, b), (a, b)
            pairs += 1
    assert pairs > 300


def test_relations_built_without_sympys_decision_are_sympys():
    for value in (0, 1, 2, 8, sympy.Integer(4)):
        assert equals(N, value) == sympy.Eq(N, value)
        assert at_least(N, value) == sympy.Ge(N, value)
    assert equals(N, 0) is sympy.false and at_least(N, 1) is sympy.true
    assert equals(t / N, 1) == sympy.Eq(t / N, 1)  # not a symbol: sympy's own
