"""A traced module's pipeline stages: each stage's peak moment as a formula in the module's sizes.

:class:`~symmem.passes.pipeline_formula.StageFormulas` reads a moment's formula off the stage's replay run again up
to that moment: what the stage holds at rest plus the storages alive there.  A traced stage's replay runs on its
recorded step (:class:`~symmem.importer.traced_pipeline.TracedCut`), whose storages' sizes are the record's
formulas in the module's sizes (``B``, ``S``, ... as the trace named them: :mod:`symmem.importer.symbolic_sizes`);
what the stage holds at rest and its optimizer step's largest moment are
:func:`~symmem.importer.traced_pipeline.stage_memory`'s, worked out on sizes that carry their formula
(:class:`_Sized`: an integer that adds up its formula beside its value, so the same code gives both and the largest
moment of the step is chosen by the values).  The record is at its number of blocks, so the formula holds at it
(said), as at ``p`` and ``M``; every formula is checked against the line it replaces at the three batches the line
was read at (a module traced at numbers, whose sizes are not formulas, keeps its lines, said so).

>>> import torch
>>> from symmem.api import trace
>>> class Block(torch.nn.Module):
...     def __init__(self) -> None:
...         super().__init__()
...         self.norm, self.up = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)
...     def forward(self, x):
...         return x + self.up(self.norm(x))
>>> class Net(torch.nn.Module):
...     def __init__(self) -> None:
...         super().__init__()
...         self.inp, self.head = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
...         self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
...     def forward(self, x):
...         x = self.inp(x)
...         for block in self.blocks:
...             x = block(x)
...         return self.head(x)
>>> d = trace(Net(), (torch.randn(4, 8),), {"B": (0, 0)}, optimizer="adamw", loss="cross-entropy",
...           pipeline_parallel=True, pipeline_schedule="gpipe", micro_batches=2, values={"p": 2})
>>> m = d.peak_at()
>>> m.total, m.pinned()
(656*B + 13160, 'at p = 2, M = 2, L = 4')
>>> d.at(B=5).evaluate(m.total) == d.at(B=5).value("peak")  # the same moment peaks there (not at B = 9)
True
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy


class _Sized(int):
    """An integer (a size at the numbers) that carries its formula through ``+``, ``-`` and ``*``: ``max`` and the
    comparisons read the value, so code written for integers gives the formula of what it picks too.

    >>> B = sympy.Symbol("B")
    >>> a, b = _Sized(8, 4 * B), _Sized(12, 6 * B)
    >>> c = max(0 + a, b - 2) * 2
    >>> int(c), c.expr
    (20, 12*B - 4)
    """

    expr: sympy.Expr

    def __new__(cls, value: int, expr: Any) -> _Sized:
        out = super().__new__(cls, value)
        out.expr = sympy.sympify(expr, strict=True)
        return out

    def __add__(self, other: Any) -> _Sized:
        return _Sized(int(self) + int(other), self.expr + _expr(other))

    __radd__ = __add__

    def __sub__(self, other: Any) -> _Sized:
        return _Sized(int(self) - int(other), self.expr - _expr(other))

    def __rsub__(self, other: Any) -> _Sized:
        return _Sized(int(other) - int(self), _expr(other) - self.expr)

    def __mul__(self, other: Any) -> _Sized:
        return _Sized(int(self) * int(other), self.expr * _expr(other))

    __rmul__ = __mul__


def _expr(value: Any) -> sympy.Expr:
    return value.expr if isinstance(value, _Sized) else sympy.Integer(int(value))


class _SizedCut:
    """A :class:`~symmem.importer.traced_pipeline.TracedCut` whose storages' sizes are :class:`_Sized` (the
    record's formula beside the value at the cut's numbers), its boundaries too."""

    def __init__(self, cut: Any, boundaries: Callable[[Any], list[Any]]) -> None:
        self._cut = cut
        self.boundary = boundaries(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cut, name)

    def size(self, sid: int) -> _Sized:
        return _Sized(self._cut.size(sid), self._cut.tl.storages[sid].nbytes)


class TracedFormulas:
    """:class:`~symmem.passes.pipeline_formula.StageFormulas`' ``engine`` for a traced module's stages (``step``: a
    :class:`~symmem.importer.traced_pipeline.TracedPipelineStep`; ``stage_memory`` and ``boundaries``: that
    module's, handed over as it imports this one)."""

    def __init__(self, step: Any, named: Mapping[str, int], stage_memory: Callable[..., list[dict[str, Any]]],
                 boundaries: Callable[[Any], list[Any]]) -> None:
        self.step, self.named = step, dict(named)
        self.stage_memory, self.boundaries = stage_memory, boundaries
        symbol = getattr(step.step, "symbol", None)
        #: the blocks' symbol: the record is at its number (said)
        self.count = symbol.name if symbol is not None else "L"
        self._parts: list[dict[str, Any]] | None = None

    def replay(self, s: int, numbers: Sequence[Mapping[str, int]], packed: bool) -> Any:
        """Stage ``s``'s replay of the step recorded at ``numbers[0]`` (a traced step's lines are read from a
        replay at each batch)."""
        found = self.step._make_replays(numbers[0])
        if self._parts is None:
            sized = _SizedCut(found[s].cut, self.boundaries)
            self._parts = self.stage_memory(sized, self.step.micro_batches)
        return found[s]

    def snapshot(self, replay: Any) -> None:
        return None

    def layer(self, node: str | None) -> int:
        return 0  # the record's ops are named by module and op, not by an unrolled layer: the blocks at a number

    def size(self, cut: Any, sid: int) -> sympy.Expr:
        return cut.tl.storages[sid].nbytes

    def terms(self, held: Any, cut: Any, s: int) -> list[tuple[int, sympy.Expr, int]]:
        return []

    def _part(self, s: int, name: str) -> sympy.Expr:
        if self._parts is None:  # the optimizer step's formula, asked for before any moment's
            self.replay(s, [{**self.named, "B": int(self.named.get("B", 1))}], False)
        return _expr(self._parts[s][name])  # type: ignore[index]

    def rest(self, memory: Any, s: int) -> sympy.Expr:
        return sympy.expand(self._part(s, "at_rest"))

    def outputs(self, memory: Any, s: int) -> sympy.Expr:
        return sympy.expand(self._part(s, "outputs"))

    def step_peak(self, memory: Any, s: int) -> sympy.Expr:
        return self._part(s, "step_peak")

    def state(self, memory: Any, s: int) -> sympy.Expr:
        return self._part(s, "optimizer_state")
