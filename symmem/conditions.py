"""Storage decisions that depend on the symbols: a reshape that copies for some sizes and is a view for others.

PyTorch's ``reshape`` returns a view when the strides allow it and a copy otherwise, so the same line of model
code can keep different storages for different sizes.  HF's ``repeat_kv`` is the case that matters:
``x[:, :, None].expand(B, G, h/G, S, d).reshape(B, h, S, d)`` merges the G heads with the stride-0 repeat
dimension, which is only possible without a copy when ``G = 1`` (multi-query attention); then every head is a
stride-0 view of one (B, 1, S, d) tensor, and a kernel that keeps the view keeps B*S*d elements, not B*h*S*d.

Such a decision is a sympy condition instead of a bool.  The op rules derive it from the strides
(:mod:`symmem.strides`: repeat_kv's reshape copies where ``Ne(G, 1) & Ne(h/G, 1)``) and keep it in the node's
``facts``; a builder may also state one in an attribute (``reshape(..., copy=Ne(B, 1))``, a matmul's
``copy_inputs=((1, Eq(G, 1)),)``, attention's ``v_contiguous=Ne(G, 1)``).  This module is the algebra of such
conditions; :mod:`symmem.passes.branches` finds the conditions of a graph
that the symbols left free do not decide, and the derivation works out the kept storages once per truth
assignment and merges them into ``Piecewise`` expressions (equal branches collapse, so a model whose total
does not depend on the decision shows no ``Piecewise`` in its total).

>>> import sympy
>>> from symmem.symbols import G
>>> canonical(sympy.Ne(G, 1))
(Eq(G, 1), False)
>>> holds(sympy.Ne(G, 1), {sympy.Eq(G, 1): True})
False
>>> canonical(~(sympy.Ne(G, 1) & sympy.Ne(G, 2)))
(Eq(G, 1) | Eq(G, 2), True)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sympy
from sympy.core.relational import Relational
from sympy.logic.boolalg import Boolean, BooleanFunction, to_nnf

Branch = Mapping[sympy.Basic, bool]


def is_condition(value: Any) -> bool:
    """Whether ``value`` is a symbolic condition (not a plain bool or sympy's true/false)."""
    # (a Symbol is a sympy Boolean too: only relations and their combinations are conditions)
    return isinstance(value, Relational | BooleanFunction)


@functools.lru_cache(maxsize=256)
def canonical(cond: Boolean) -> tuple[Boolean, bool]:
    """``cond`` as (one representative of ``cond`` and its negation, whether ``cond`` is that representative).

    The representative is the form with fewer ``Ne``/``Not`` (``Eq(G, 1) | Eq(h/G, 1)`` rather than
    ``Ne(G, 1) & Ne(h/G, 1)``), so a condition and its negation are one branch decision.
    """
    pos, neg = to_nnf(cond), to_nnf(sympy.Not(cond))

    def weight(c: Boolean) -> tuple[int, str]:
        return (len(c.atoms(sympy.Ne, sympy.Not)), sympy.srepr(c))

    return (pos, True) if weight(pos) <= weight(neg) else (neg, False)


def reshape_copies(shape: Sequence[Any], broadcast: Iterable[int], new_shape: Sequence[Any]) -> Any:
    """When ``reshape(new_shape)`` of a tensor of ``shape`` whose ``broadcast`` dims have stride 0 must copy.

    (The rules now take this from the strides themselves, :func:`symmem.strides.reshaped`; this shortcut for a
    contiguous tensor with stride-0 dimensions stays for code that builds conditions by hand.)

    PyTorch's ``computeStride`` (``aten/src/ATen/TensorUtils.cpp``) can view a group of dimensions merged into
    one only if each dimension's stride is the next one's stride times its size, size-1 dimensions aside.  A
    stride-0 (expanded) dimension next to one with a real stride never satisfies that, unless one side has
    size 1.  So the reshape copies iff some merged group holds both expanded dimensions of size != 1 and
    other dimensions of size != 1 (the other dimensions are taken as contiguous among themselves).  Groups are
    found by equal running products of the two shapes.  Returns sympy's true/false or a condition.

    >>> from symmem.symbols import B, G, S, h
    >>> reshape_copies((B, G, h / G, S), {2}, (B, h, S))
    Ne(G, 1) & Ne(h/G, 1)
    >>> reshape_copies((B, 1, h, S), {2}, (B, h, S))
    False
    """
    old = [sympy.sympify(d, strict=True) for d in shape]
    new = [sympy.sympify(d, strict=True) for d in new_shape]
    stride0 = set(broadcast)
    bounds_new = set()
    run = sympy.Integer(1)
    for d in new:
        run = run * d
        bounds_new.add(_canonical_size(run))
    copies: list[Boolean] = []
    group: list[int] = []
    run = sympy.Integer(1)
    for i, d in enumerate(old):
        run = run * d
        group.append(i)
        if _canonical_size(run) in bounds_new or i == len(old) - 1:
            expanded = sympy.Mul(*(old[j] for j in group if j in stride0))
            other = sympy.Mul(*(old[j] for j in group if j not in stride0))
            copies.append(sympy.And(sympy.Ne(expanded, 1), sympy.Ne(other, 1)))
            group = []
    return sympy.Or(*copies)


def _canonical_size(e: sympy.Expr) -> sympy.Expr:
    """One form per size: a product of dimensions as a cancelled ratio of expanded polynomials.

    (Not ``sympy.simplify``: it imports ``sympy.physics.units``, 0.1-0.25 s, and this runs when a model module
    is imported.)"""
    return sympy.cancel(e)


def holds(flag: Any, branch: Branch | None) -> bool:
    """The value of an op flag (a bool, sympy's true/false, or a condition) in ``branch``.

    A condition the branch does not decide counts as false: the structural reading of the graph.
    """
    if not is_condition(flag):
        return bool(flag)
    base, positive = canonical(flag)
    if branch is None or base not in branch:
        return False
    return branch[base] == positive


def slice_copies(shape: Sequence[Any], dim: int) -> Any:
    """When ``.contiguous()`` of a proper slice along ``dim`` of a contiguous tensor of ``shape`` copies.

    The slice keeps the strides, so the dimension before ``dim`` has a stride larger than the sliced length
    times the next stride: not contiguous, unless every dimension before ``dim`` has size 1 (then their strides
    do not matter, and ``contiguous()`` returns the slice itself).  ``labels[..., 1:]`` of (B, S) copies iff B != 1.

    >>> from symmem.symbols import B, S, V
    >>> slice_copies((B, S, V), 1)
    Ne(B, 1)
    """
    lead = sympy.Mul(*(sympy.sympify(d, strict=True) for d in shape[:dim % len(shape)]))
    return sympy.Ne(lead, 1)


def fold(expr: sympy.Expr) -> sympy.Expr:
    """A sum of ``Piecewise`` terms as one ``Piecewise`` (equal branches collapse); other sums unchanged.

    Terms whose conditions share no relation are independent: each group of terms that share one is folded on
    its own, so k independent conditions give k ``Piecewise`` terms, not one of 2**k pieces.

    >>> from symmem.symbols import B, G, S
    >>> e = sympy.Piecewise((S, sympy.Eq(B, 1)), (2 * S, True)) + sympy.Piecewise((1, sympy.Eq(G, 1)), (2, True))
    >>> fold(e + 3 * S)
    3*S + Piecewise((1, Eq(G, 1)), (2, True)) + Piecewise((S, Eq(B, 1)), (2*S, True))
    """
    if not expr.has(sympy.Piecewise):
        return expr
    terms = sympy.Add.make_args(sympy.piecewise_fold(expr)) if not isinstance(expr, sympy.Add) else expr.args
    groups: list[tuple[set[sympy.Basic], list[sympy.Expr]]] = []
    rest: list[sympy.Expr] = []
    for term in terms:
        atoms = _relations(term)
        if not atoms:
            rest.append(term)
            continue
        joined = [g for g in groups if g[0] & atoms]
        for g in joined:
            groups.remove(g)
        groups.append((atoms.union(*(g[0] for g in joined)), [x for g in joined for x in g[1]] + [term]))
    if len(groups) <= 1:
        return sympy.piecewise_fold(expr)
    return sympy.Add(*rest, *(sympy.piecewise_fold(sympy.Add(*g[1])) for g in groups))


def _relations(expr: sympy.Expr) -> set[sympy.Basic]:
    """The relations (``Eq(G, 1)`` ...) in the conditions of the ``Piecewise`` terms of ``expr``."""
    found: set[sympy.Basic] = set()
    for pw in expr.atoms(sympy.Piecewise):
        for _, cond in pw.args:
            found |= {canonical(r)[0] for r in cond.atoms(Relational)}
    return found
