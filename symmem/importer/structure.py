"""Fold identical repeated blocks: the children of a ``ModuleList``/``Sequential`` that keep the same storages.

A storage belongs to the module of the op that first saved it, so the residual stream a block passes on
is counted in the next block (whose layer norm keeps it), and the last block's output in the head: every
block of a transformer stack then keeps the same storages.  A storage made outside the children and kept by
several of them (Llama's rotary ``cos``/``sin``, made once before the stack) belongs to none of them; one made
in a child and kept by the next too (a residual block's output, kept by its own ReLU and the next block's
convolution) belongs to the first that saved it.  Two children are identical when their storages,
named relative to the child, have the same dtypes and byte formulas.  Runs of at least two consecutive
identical children are reported, largest total first (at the example sizes).
"""

from __future__ import annotations

from typing import Any

import sympy

from .records import Repeat, TracedStorage


def _under(module: str, child: str) -> bool:
    return module == child or module.startswith(child + ".")


def _own(s: TracedStorage, child: str, siblings: list[str]) -> bool:
    """Whether ``s`` belongs to ``child``: first saved there, unless it was made outside the children and
    siblings keep it too (a table made once before the stack)."""
    if not _under(s.module, child):
        return False
    shared = any(_under(v.module, o) for v in s.saved_by if v.module for o in siblings if o != child)
    return not shared or any(_under(s.producer_module, o) for o in siblings)


def signature(storages: list[TracedStorage], child: str, siblings: list[str]) -> tuple[tuple[str, str, str], ...]:
    """The child's activation storages, named relative to the child, with dtype and byte formula."""
    out = []
    for s in storages:
        if s.kind == "activation" and _own(s, child, siblings):
            out.append((s.name[len(child):], s.dtype, sympy.srepr(sympy.expand(s.bytes))))
    return tuple(sorted(out))


def repeats(module: Any, storages: tuple[TracedStorage, ...] | list[TracedStorage],
            values: dict[sympy.Symbol, int] | None = None) -> tuple[Repeat, ...]:
    """Runs of identical children in every ``ModuleList``/``Sequential`` of ``module``."""
    import torch

    acts = [s for s in storages if s.kind == "activation"]
    found: list[Repeat] = []
    for path, container in module.named_modules():
        if not isinstance(container, torch.nn.ModuleList | torch.nn.Sequential) or len(container) < 2:
            continue
        children = [f"{path}.{name}" if path else name for name, _ in container.named_children()]
        sigs = [signature(acts, c, children) for c in children]
        i = 0
        while i < len(children):
            j = i + 1
            while j < len(children) and sigs[j] == sigs[i]:
                j += 1
            if j - i >= 2 and sigs[i]:
                first = [s for s in acts if _own(s, children[i], children)]
                found.append(Repeat(path, tuple(children[i:j]), tuple(s.name for s in first),
                                    sympy.expand(sympy.Add(*[s.bytes for s in first]))))
            i = j
    subs = values or {}

    def size(r: Repeat) -> float:
        total = sympy.sympify(r.bytes * r.count)
        free = total.free_symbols
        return float(total.xreplace({s: subs.get(s, 8) for s in free}))

    return tuple(sorted(found, key=lambda r: (-size(r), r.path)))
