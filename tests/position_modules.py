"""Small modules with a table of their own looked up at positions, no transformers config: the cases of
tests/test_position_lookups.py, and ``plain`` for the command line (``tests/position_modules.py:plain``)."""

from __future__ import annotations

from typing import Any

import torch

H, V = 8, 50


class _Base(torch.nn.Module):
    """Token embedding + the positions' rows + a linear layer: every case keeps the same kind of activations."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(V, H)
        self.lin = torch.nn.Linear(H, H)

    def out(self, x: Any, pos: Any) -> Any:
        return self.lin(self.tok(x) + pos).relu()


class Plain(_Base):
    """``nn.Embedding(R, H)`` at ``arange(S).unsqueeze(0).expand(B, S)``."""

    def __init__(self, rows: int = 12) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(rows, H)

    def forward(self, x: Any) -> Any:
        B, S = x.shape
        return self.out(x, self.pos(torch.arange(S, device=x.device).unsqueeze(0).expand(B, S)))


class Learned(_Base):
    """Hugging Face's learned positions without a config: a ``position_ids`` buffer, sliced ``[:, past:past + S]``."""

    def __init__(self, rows: int = 16, ids: int | None = None) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(rows, H)
        self.register_buffer("position_ids", torch.arange(ids or rows).expand((1, -1)), persistent=False)

    def forward(self, x: Any, past: int = 0) -> Any:
        return self.out(x, self.pos(self.position_ids[:, past:past + x.shape[1]]))


class Offset(_Base):
    """OPT's shift: positions ``arange(S) + 2`` in a table of R rows (S <= R - 2)."""

    def __init__(self, rows: int = 14) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(rows, H)

    def forward(self, x: Any) -> Any:
        return self.out(x, self.pos(torch.arange(x.shape[1]) + 2))


class Counted(_Base):
    """OPT's count without its offset: ``cumsum(mask) * mask - 1`` of a mask of ones made in the forward."""

    def __init__(self, rows: int = 12) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(rows, H)

    def forward(self, x: Any) -> Any:
        mask = torch.ones_like(x)
        return self.out(x, self.pos(torch.cumsum(mask, dim=1) * mask - 1))


class Past(_Base):
    """Positions after a cache of P tokens: ``arange(P, P + S)`` (P + S <= R)."""

    def __init__(self, rows: int = 16) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(rows, H)

    def forward(self, x: Any, cache: Any) -> Any:
        P, S = cache.shape[1], x.shape[1]
        return self.out(x, self.pos(torch.arange(P, P + S))) + self.lin(cache).sum(1, keepdim=True)


class Fixed(_Base):
    """A fixed table as a buffer read with ``index_select``."""

    def __init__(self, rows: int = 20) -> None:
        super().__init__()
        self.register_buffer("pe", torch.randn(rows, H))

    def forward(self, x: Any) -> Any:
        return self.out(x, self.pe.index_select(0, torch.arange(x.shape[1])))


class Indexed(_Base):
    """A parameter indexed ``table[arange(S)]``."""

    def __init__(self, rows: int = 18) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(rows, H))

    def forward(self, x: Any) -> Any:
        return self.out(x, self.table[torch.arange(x.shape[1])])


class Wrapped(_Base):
    """Token ids, positions wrapped (``% R``) and clamped (in place too): every S runs, so nothing is said."""

    def __init__(self, rows: int = 12) -> None:
        super().__init__()
        self.pos = torch.nn.Embedding(rows, H)

    def forward(self, x: Any) -> Any:
        n = self.pos.num_embeddings
        s, t = torch.arange(x.shape[1]), torch.arange(x.shape[1])
        t.view(1, -1).clamp_(max=n - 1)  # in place, through a view: t's values are no longer arange's
        return self.out(x, self.pos(s % n) + self.pos(s.clamp(max=n - 1)) + self.pos(t) + self.tok(x % 7))


def sized(R: int) -> tuple[Any, tuple[Any, ...]]:
    """``build(**sizes)`` for ``sizes=``: :class:`Plain` with ``R`` rows (its example: 6 tokens)."""
    return Plain(R), (ids(2, 6),)


def ids(b: int, s: int) -> Any:
    return torch.randint(0, V, (b, s), generator=torch.Generator().manual_seed(1000 * b + s))


def plain() -> tuple[Any, tuple[Any, ...]]:
    """The command line's case: :class:`Plain` with 12 rows, 8 tokens."""
    return Plain(), (ids(2, 8),)
