"""The canonical dimension symbols, their LaTeX names and their meaning.

Every dimension is a ``sympy.Symbol`` that is positive and integer, so that sympy can cancel, factor and
compare shapes.  This module is the only place that creates them: everything else imports them from here
or looks them up by name with :func:`symbol`.

>>> from symmem.symbols import B, S, H, h
>>> 9 * B * S * H + B * h * S**2
9*B*H*S + B*S**2*h
>>> symbol("S") is S
True
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import sympy

from .errors import SymmemError


@dataclass(frozen=True)
class Dim:
    """One dimension: its symbol, its LaTeX name and what it stands for."""

    symbol: sympy.Symbol
    latex: str
    meaning: str

    @property
    def name(self) -> str:
        return self.symbol.name


_TABLE: dict[str, Dim] = {}


def _dim(name: str, latex: str, meaning: str) -> sympy.Symbol:
    sym = sympy.Symbol(name, positive=True, integer=True)
    _TABLE[name] = Dim(sym, latex, meaning)
    return sym


B = _dim("B", "B", "batch size (micro-batch per device)")
S = _dim("S", "S", "sequence length in tokens (ViT: patches + class token)")
H = _dim("H", "H", "hidden size")
h = _dim("h", "h", "attention heads")
P = _dim("P", "P", "bottleneck width (inner channels of a ResNet block)")
L = _dim("L", "L", "number of repeated layers")
Hi = _dim("Hi", "H_{i}", "input image height")
Wi = _dim("Wi", "W_{i}", "input image width")
C = _dim("C", "C", "input image channels")
F = _dim("F", "F", "MLP (feed-forward) width")
V = _dim("V", "V", "vocabulary size")
G = _dim("G", "G", "key/value heads (grouped-query attention)")
K = _dim("K", "K", "number of classes")
t = _dim("t", "t", "tensor-parallel size")
p = _dim("p", "p", "pipeline-parallel size")
N = _dim("N", "N", "data-parallel size")
m = _dim("m", "m", "micro-batches in flight per pipeline stage")
# sympy's lark parser reads neither upper-case Greek nor \mathrm subscripts: symmem.report.latex.parse maps these
# two names to names it reads before parsing, so they round-trip too.
Psi = _dim("Psi", r"\Psi", "parameter count (a model given by its counts, ZeRO's Psi)")
Nact = _dim("Nact", r"N_{\mathrm{act}}", "activation values per sample (a model given by its counts)")


@dataclass(frozen=True)
class UnitSize:
    """A size that is 1 in configurations people train, and the substitution that makes it 1."""

    size: sympy.Expr
    one: tuple[tuple[sympy.Symbol, sympy.Expr], ...]
    meaning: str

    @cached_property
    def atom(self) -> sympy.Basic:
        """The condition that the size is 1, as storage decisions state it (``Eq(G, 1)``); made once (sympy
        tries to decide ``Eq(h/G, 1)`` each time it is made, ~1 ms)."""
        return sympy.Eq(self.size, 1)


#: Sizes that may be 1, which storage decisions keep open as conditions (:mod:`symmem.strides`): PyTorch views a
#: tensor differently when a dimension has size 1, and these are 1 in real models.  Every other symbolic size
#: is taken to be at least 2 there, as :func:`symmem.shapes.same` takes distinct symbols to differ.  B is not
#: among them: a batched matmul of head views copies its operands for B >= 2 only, and the formulas take a batch
#: of at least 2 there (the causal-LM loss states its B = 1 case itself, :mod:`symmem.loss`).
UNIT_SIZES: tuple[UnitSize, ...] = (
    UnitSize(G, ((G, sympy.Integer(1)),), "multi-query attention: one key/value head"),
    UnitSize(h / G, ((h, G),), "multi-head attention: as many key/value heads as query heads"),
)


def equals(size: sympy.Expr, value: int) -> sympy.Basic:
    """``sympy.Eq(size, value)`` -- a size fixed at a number, as a peak's domain states it -- without sympy's
    attempt to decide it (~0.7 ms each) where nothing can: a positive integer symbol at a whole number from 1 on.

    >>> equals(N, 8), equals(N, 8) == sympy.Eq(N, 8), equals(N, 0)
    (Eq(N, 8), True, False)
    """
    if _undecided(size, value, 1):
        return sympy.Eq(size, value, evaluate=False)
    return sympy.Eq(size, value)


def at_least(size: sympy.Expr, value: int) -> sympy.Basic:
    """``sympy.Ge(size, value)`` without sympy's attempt to decide it where nothing can (a positive integer
    symbol, a whole number from 2 on: ``Ge(N, 1)`` is true).

    >>> at_least(N, 2), at_least(N, 2) == sympy.Ge(N, 2), at_least(N, 1)
    (N >= 2, True, True)
    """
    if _undecided(size, value, 2):
        return sympy.Ge(size, value, evaluate=False)
    return sympy.Ge(size, value)


def _undecided(size: sympy.Expr, value: Any, least: int) -> bool:
    """Whether a relation of ``size`` (a positive integer symbol) to ``value`` (a whole number, at least
    ``least``) is left as it is by sympy: any whole number from 1 on may be the symbol's."""
    if isinstance(value, bool) or not isinstance(value, (int, sympy.Integer)) or int(value) < least:
        return False
    return isinstance(size, sympy.Symbol) and size.is_integer is True and size.is_positive is True


def unordered(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Whether ``a`` and ``b`` are two different positive integer symbols: their order, ratio and remainder are then
    left as they are by sympy (any two whole numbers from 1 on may be theirs), so a relation between them can be
    built unevaluated (as :func:`equals` and :func:`at_least` build one of a symbol to a number).

    >>> unordered(L, p), unordered(L, L), unordered(L, 2 * p)
    (True, False, False)
    """
    return a != b and all(isinstance(x, sympy.Symbol) and x.is_integer is True and x.is_positive is True
                          for x in (a, b))


def symbol(name: str) -> sympy.Symbol:
    """The canonical symbol called ``name``; a :class:`SymmemError` lists the known ones otherwise.

    >>> symbol("H")
    H
    """
    try:
        return _TABLE[name].symbol
    except KeyError:
        known = ", ".join(sorted(_TABLE))
        raise SymmemError(f"unknown symbol {name!r}; known symbols: {known}") from None


def dims() -> tuple[Dim, ...]:
    """All dimensions in the order they were declared.

    >>> [d.name for d in dims()][:4]
    ['B', 'S', 'H', 'h']
    """
    return tuple(_TABLE.values())


def latex_names() -> dict[sympy.Symbol, str]:
    """Symbol -> LaTeX name, the table every LaTeX printer in symmem is given.

    >>> latex_names()[Hi]
    'H_{i}'
    """
    return {d.symbol: d.latex for d in _TABLE.values()}


def meaning(sym: sympy.Symbol) -> str:
    """What a symbol stands for ('' for symbols symmem does not own).

    >>> meaning(B)
    'batch size (micro-batch per device)'
    """
    d = _TABLE.get(sym.name)
    return d.meaning if d is not None and d.symbol == sym else ""
