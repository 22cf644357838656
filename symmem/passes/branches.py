"""Storage decisions that depend on the sizes, per branch: find the open conditions, enumerate, merge.

:func:`conditions` finds the conditions (:mod:`symmem.conditions`) in a graph's attributes and storage facts that
the symbols left free do not decide; the derivation works out the kept storages once per truth assignment
(:func:`assignments`) and :func:`merge` joins them into one list whose expressions are ``Piecewise`` over the
conditions (equal branches collapse).

>>> from symmem.models import build
>>> g = build("llama", attention="naive", cache="none").graph
>>> open_, decided = conditions(g, list(g.order()), {})
>>> open_
[Eq(G, 1) | Eq(h/G, 1)]
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import sympy
from sympy.logic.boolalg import Boolean, BooleanAtom

from ..conditions import Branch, canonical, is_condition
from ..derivation import Storage
from ..graph import Graph
from ..simplify import max_of


def _walk(value: Any) -> Iterable[Boolean]:
    if is_condition(value):
        yield value
    elif isinstance(value, tuple | list):
        for v in value:
            yield from _walk(v)


def conditions(graph: Graph, nodes: Iterable[str], subs: Mapping[sympy.Symbol, sympy.Expr]
               ) -> tuple[list[Boolean], dict[Boolean, bool]]:
    """The conditions in the attributes and the storage facts of ``nodes`` (a reshape that copies unless G = 1 or
    G = h): (still open after ``subs``, decided by ``subs``)."""
    open_: list[Boolean] = []
    decided: dict[Boolean, bool] = {}
    for n in nodes:
        node = graph.node(n)
        for value in (*node.attrs.values(), *node.facts.values()):
            for cond in _walk(value):
                base, _ = canonical(cond)
                if base in decided or base in open_:
                    continue
                now = base.xreplace(dict(subs))
                if isinstance(now, BooleanAtom):
                    decided[base] = bool(now)
                else:
                    open_.append(base)
    return open_, decided


def assignments(open_: Sequence[Boolean], decided: Branch) -> list[dict[sympy.Basic, bool]]:
    """Every truth assignment of the open conditions, each with the decided ones; with several open conditions,
    those that contradict themselves are left out (``Eq(G, 1)`` true but ``Eq(G, 1) | Eq(h/G, 1)`` false).

    >>> from symmem.symbols import G, h
    >>> one, either = sympy.Eq(G, 1), sympy.Eq(G, 1) | sympy.Eq(h / G, 1)
    >>> [tuple(b.values()) for b in assignments([either, one], {})]
    [(True, True), (True, False), (False, False)]
    """
    found = [{**dict(decided), **dict(zip(open_, values, strict=True))}
             for values in itertools.product((True, False), repeat=len(open_))]
    return found if len(open_) < 2 else [b for b in found if _propositional(b)[0] is not None]


def _propositional(branch: Branch) -> tuple[Any, dict[sympy.Symbol, sympy.Eq]]:
    """The branch's conditions as one propositional formula over their relations (``Ne`` a negated ``Eq``, each
    relation a variable), or None where no truth values satisfy it; and the equation each variable stands for."""
    from sympy.core.relational import Relational
    from sympy.logic.inference import satisfiable

    conj = sympy.And(*(c if v else sympy.Not(c) for c, v in branch.items() if is_condition(c)))
    relations = conj.atoms(Relational)

    def positive(r: Relational) -> Relational:
        return sympy.Eq(r.lhs, r.rhs) if isinstance(r, sympy.Ne) else r

    atoms = sorted({positive(r) for r in relations}, key=sympy.srepr)
    names = {a: sympy.Symbol(f"_relation{i}") for i, a in enumerate(atoms)}
    formula = conj.xreplace({r: sympy.Not(names[positive(r)]) if isinstance(r, sympy.Ne) else names[r]
                             for r in relations})
    if satisfiable(formula) is False:
        return None, {}
    return formula, {v: a for a, v in names.items() if isinstance(a, sympy.Eq)}


def _implied(branch: Branch) -> dict[sympy.Symbol, sympy.Expr]:
    """Substitutions for the equations the branch's conditions imply together (``Eq(G, 1) | Eq(h/G, 1)`` true
    with ``Eq(G, 1)`` false: G = h), where no one condition implies them alone."""
    from sympy.logic.inference import satisfiable

    formula, equations = _propositional(branch)
    subs: dict[sympy.Symbol, sympy.Expr] = {}
    for var, eq in equations.items():
        if formula is not None and satisfiable(formula & sympy.Not(var)) is False:
            subs.update(_given(eq, True))
    return subs


def carriers(graph: Graph, nodes: Iterable[str], open_: Sequence[Boolean]) -> dict[Boolean, set[str]]:
    """The nodes whose attributes or storage facts hold each open condition (or its negation)."""
    found: dict[Boolean, set[str]] = {c: set() for c in open_}
    for n in nodes:
        node = graph.node(n)
        for value in (*node.attrs.values(), *node.facts.values()):
            for cond in _walk(value):
                base, _ = canonical(cond)
                if base in found:
                    found[base].add(n)
    return found


#: Up to this many open conditions, every truth assignment of all of them is derived (2**k runs); beyond, only
#: the assignments of the conditions that interact (:func:`combine`).
EXHAUSTIVE_UP_TO = 2


def combine(graph: Graph, nodes: Sequence[str], open_: Sequence[Boolean], decided: Branch,
            run: Callable[[Branch], list[Storage]]) -> list[Storage]:
    """The storages of every branch of the open conditions, merged (see :func:`merge`), without 2**k runs.

    ``run(branch)`` gives the storages of one truth assignment.  Conditions interact when their footprints
    overlap: the storages that change when the condition alone flips, and those made or kept by the nodes that
    carry it.  Each group of interacting conditions is enumerated on its own, the others held false, and a
    storage takes its ``Piecewise`` from the one group it depends on: independent conditions cost a run or two
    each, and k of them give k small ``Piecewise`` terms, not one of 2**k pieces.
    """
    if len(open_) <= EXHAUSTIVE_UP_TO:
        return merge(open_, [(b, run(b)) for b in assignments(open_, decided)])
    base = {**dict(decided), **{c: False for c in open_}}
    base_run = _keyed(run(base))
    held = carriers(graph, nodes, open_)
    flips = {c: _keyed(run({**base, c: True})) for c in open_}
    footprint: dict[Boolean, set[tuple[Any, ...]]] = {}
    for c in open_:
        changed = {k for k in base_run.keys() | flips[c].keys() if base_run.get(k) != flips[c].get(k)}
        touched = {k for k, s in (base_run | flips[c]).items() if s.node in held[c] or set(s.keepers) & held[c]}
        footprint[c] = changed | touched
    groups = _groups(open_, footprint)
    while True:
        merged: list[tuple[list[Boolean], dict[tuple[Any, ...], Storage], set[tuple[Any, ...]]]] = []
        for group in groups:
            if len(group) == 1:
                c = group[0]
                runs = [({**base, c: True}, flips[c]), (base, base_run)]
            else:
                runs = [(b, _keyed(run({**base, **b}))) for b in assignments(group, {})]
            differs = {k for _, r in runs for k in r if any(o.get(k) != r[k] for _, o in runs)}
            out = merge(group, [({**base, **b}, list(r.values())) for b, r in runs])
            merged.append((group, _keyed(out), differs))
        claimed: dict[tuple[Any, ...], int] = {}
        clash = None
        for i, (_, _, differs) in enumerate(merged):
            for k in differs:
                if k in claimed and claimed[k] != i:
                    clash = (claimed[k], i)
                claimed.setdefault(k, i)
        if clash is None:
            break
        # a storage that two groups change: they interact after all, so they are one group
        i, j = clash
        groups = [g for n, g in enumerate(groups) if n not in (i, j)] + [groups[i] + groups[j]]
    order = list(dict.fromkeys([*base_run, *(k for _, keyed, _ in merged for k in keyed)]))
    out: list[Storage] = []
    for k in order:
        if k in claimed:
            out.append(merged[claimed[k]][1][k])
        elif k in base_run:
            out.append(base_run[k])
    return out


def _groups(open_: Sequence[Boolean], footprint: Mapping[Boolean, set[Any]]) -> list[list[Boolean]]:
    """The conditions in groups whose footprints overlap (connected components), in the order of ``open_``."""
    groups: list[list[Boolean]] = []
    for c in open_:
        joined = [g for g in groups if any(footprint[c] & footprint[o] for o in g)]
        for g in joined:
            groups.remove(g)
        groups.append([x for x in open_ if x == c or any(x in g for g in joined)])
    return sorted(groups, key=lambda g: open_.index(g[0]))


def _keyed(storages: Iterable[Storage]) -> dict[tuple[Any, ...], Storage]:
    """Storages by (name, group, category, occurrence), the key :func:`merge` matches branches by."""
    out: dict[tuple[Any, ...], Storage] = {}
    seen: dict[tuple[Any, ...], int] = {}
    for t in storages:
        base = (t.name, t.group, t.category)
        seen[base] = seen.get(base, 0) + 1
        out[(*base, seen[base])] = t
    return out


def _given(cond: Boolean, value: bool) -> dict[sympy.Symbol, sympy.Expr]:
    """Substitutions a branch implies (``Eq(G, 1)`` true: G = 1; ``Eq(h/G, 1)`` true: G = h), to write the
    branch's formula plainly."""
    return dict(_solved(cond, value))


@functools.lru_cache(maxsize=256)
def _solved(cond: Boolean, value: bool) -> tuple[tuple[sympy.Symbol, sympy.Expr], ...]:
    """:func:`_given`'s substitutions, worked out once per condition (``sympy.solve`` takes milliseconds, and every
    ZeRO-1 rank's step joins the same branches)."""
    return tuple(_substitutions(cond, value).items())


def _substitutions(cond: Boolean, value: bool) -> dict[sympy.Symbol, sympy.Expr]:
    if value and isinstance(cond, sympy.Eq) and isinstance(cond.lhs, sympy.Symbol) and cond.rhs.is_number:
        return {cond.lhs: cond.rhs}
    if value and isinstance(cond, sympy.Eq) and cond.free_symbols:
        first = min(cond.free_symbols, key=lambda x: x.name)
        ratio = _ratio_of(cond, first)
        if ratio is not None:
            return {first: ratio}
        found = sympy.solve(cond.lhs - cond.rhs, first)
        if len(found) == 1:
            return {first: found[0]}
    return {}


def _ratio_of(cond: sympy.Eq, x: sympy.Symbol) -> sympy.Symbol | None:
    """``y`` where ``cond`` is ``Eq(y/x, 1)`` or ``Eq(x/y, 1)`` (``x``, ``y`` symbols): ``sympy.solve``'s one
    solution for ``x``, without it.  A view that copies unless two sizes are equal (Llama's ``Eq(h/G, 1)``: the
    key and value heads repeated or not) is such a condition, and ``sympy.solve``'s check of its solution imports
    ``sympy.physics.units`` (0.2-0.4 CPU-s, most of Llama's ``derive`` in a fresh process); None: any other
    condition, solved by ``sympy.solve``."""
    lhs = cond.lhs
    if cond.rhs != 1 or not isinstance(lhs, sympy.Mul) or len(lhs.args) != 2:
        return None
    powers = [a.as_base_exp() for a in lhs.args]
    if not all(isinstance(b, sympy.Symbol) for b, _ in powers) or sorted(e for _, e in powers) != [-1, 1]:
        return None
    (b0, _), (b1, _) = powers
    if x not in (b0, b1) or b0 == b1:
        return None
    return b1 if b0 == x else b0


def guards(open_: Sequence[Boolean], branches: Sequence[Branch]) -> list[Boolean]:
    """The condition under which each branch is the one taken, as the ``Piecewise`` of :func:`joiner` reads
    them: in order, the first that holds, the last being ``True`` (whatever the earlier ones leave)."""
    found: list[Boolean] = [sympy.And(*(c if branch[c] else sympy.Not(c) for c in open_)) for branch in branches]
    if found:
        found[-1] = sympy.true
    return found


def joiner(open_: Sequence[Boolean], branches: Sequence[Branch]) -> Callable[[list[sympy.Expr]], sympy.Expr]:
    """A function that joins one value per branch into a ``Piecewise`` over the branches' conditions (the value
    itself where every branch has the same)."""
    given = []
    for branch in branches:
        subs: dict[sympy.Symbol, sympy.Expr] = {}
        for c in open_:
            subs.update(_given(c, branch[c]))
        if len(open_) > 1:  # what the conditions imply together (one alone implies what _given finds)
            subs = {**_implied({c: branch[c] for c in open_}), **subs}
        given.append(subs)
    conds = guards(open_, branches)

    def piecewise(values: list[sympy.Expr]) -> sympy.Expr:
        # Most terms are the same in every branch; sympy's Piecewise simplification is slow, so skip it there.
        if all(v == values[0] for v in values[1:]):
            return values[0]
        pieces = [(_replace(v, subs), cond) for v, subs, cond in zip(values, given, conds, strict=True)]
        return sympy.Piecewise(*pieces, evaluate=False)

    return piecewise


def _replace(value: sympy.Expr, subs: Mapping[sympy.Symbol, sympy.Expr]) -> sympy.Expr:
    """``value.xreplace(subs)``, leaving a ``Max`` unevaluated (sympy's pairwise Max simplification is slow and
    proves nothing the peak's pruning did not)."""
    if isinstance(value, sympy.Max):
        return max_of(a.xreplace(dict(subs)) for a in value.args)
    return value.xreplace(dict(subs))


def merge(open_: Sequence[Boolean], branches: Sequence[tuple[Branch, list[Storage]]]) -> list[Storage]:
    """One list of storages from the storages of every branch: an expression is a ``Piecewise`` over them.

    Storages are matched by (name, group, category) and their order of appearance; one missing from a
    branch is zero there.
    """
    if len(branches) == 1:
        return list(branches[0][1])
    keyed: dict[tuple[Any, ...], dict[int, Storage]] = {}
    for i, (_, terms) in enumerate(branches):
        for key, t in _keyed(terms).items():
            keyed.setdefault(key, {})[i] = t
    piecewise = joiner(open_, [branch for branch, _ in branches])

    out: list[Storage] = []
    for by_branch in keyed.values():
        first = next(iter(by_branch.values()))
        zero = sympy.Integer(0)
        exprs = [by_branch[i].expr if i in by_branch else zero for i in range(len(branches))]
        counts = [by_branch[i].count if i in by_branch else zero for i in range(len(branches))]
        elems = [by_branch[i].elements if i in by_branch else first.elements for i in range(len(branches))]
        elements = None if any(e is None for e in elems) else piecewise(elems)
        out.append(replace(first, expr=piecewise(exprs), count=piecewise(counts), elements=elements))
    return out
