"""What a trace found, as frozen dataclasses: symbols, saved storages, guards, parameters, repeated blocks.

Everything here is plain data (sympy expressions, strings, integers); nothing holds a tensor, so a
:class:`Trace` can be kept, compared and printed without torch.

>>> import sympy
>>> from symmem.symbols import B, S
>>> st = TracedStorage(name="h.0.attn:matmul", module="h.0.attn", op="matmul", dtype="float32", shape=(B, S, S),
...              elements=B * S**2, bytes=4 * B * S**2, kind="activation")
>>> t = Trace(module="Toy", symbols=(TracedSymbol("B", B, 2, ((0, 0),)), TracedSymbol("S", S, 8, ((0, 1),))),
...           storages=(st,))
>>> t.activations
4*B*S**2
>>> t.value("activations", B=3, S=5)
300
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy

from ..errors import SymmemError

#: what a saved storage is: a parameter or buffer of the module, one of the inputs given, or anything else
KINDS = ("activation", "input", "parameter")


@dataclass(frozen=True)
class TracedSymbol:
    """A declared size: its name, its sympy symbol, the example value traced, and where it appears."""

    name: str
    symbol: sympy.Symbol
    example: int
    positions: tuple[tuple[int | str, int], ...]


@dataclass(frozen=True)
class Save:
    """One autograd node that keeps a storage for backward.

    ``seq`` is the node's position in forward order on the same counter as :attr:`TracedStorage.born` (the
    index of the aten op that ran under it; None when no op could be matched), ``node`` the grad_fn name
    (``MmBackward0``), ``autograd_seq`` autograd's own sequence number of the node.
    """

    seq: int | None
    node: str
    autograd_seq: int
    module: str = ""


@dataclass(frozen=True)
class TracedStorage:
    """One storage autograd keeps for backward, counted once however many tensors (views) were saved from it.

    ``name`` is stable across runs (``transformer.h.0.attn:matmul``; ``#2``, ``#3`` … for the second and
    later storages with the same module and op).  ``module`` and ``op`` are where it was first saved: the
    innermost module running and the outermost torch function (``matmul``, ``layer_norm``).  ``shape`` is the
    shape of the first tensor saved from it, ``elements`` and ``bytes`` are the whole storage's (a saved
    view keeps its base).  ``producer`` is the aten op that created the storage, ``born`` that op's
    position in forward order (None for parameters and inputs, which exist before the forward),
    ``saved_by`` the autograd nodes that keep it.
    """

    name: str
    module: str
    op: str
    dtype: str
    shape: tuple[Any, ...]
    elements: Any
    bytes: Any
    kind: str
    producer: str | None = None
    producer_module: str = ""
    born: int | None = None
    saved_by: tuple[Save, ...] = ()

    @property
    def first_saved(self) -> int:
        """Forward position of the first op that saved it (the storage's owner is that op's module)."""
        seqs = [s.seq for s in self.saved_by if s.seq is not None]
        return min(seqs) if seqs else (self.born if self.born is not None else -1)


@dataclass(frozen=True)
class Guard:
    """A condition PyTorch assumed while tracing, in the declared symbols, and where it was recorded."""

    expr: Any
    text: str
    module: str = ""
    op: str = ""
    where: str = ""


@dataclass(frozen=True)
class TracedParameter:
    """A parameter of the module (tied parameters listed once, under their first name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    requires_grad: bool = True


@dataclass(frozen=True)
class Repeat:
    """A run of identical children of a ``ModuleList``/``Sequential``: same storages, same formulas.

    ``path`` is the container (``transformer.h``), ``children`` the folded children in order, ``count`` how
    many (the default of the symbol ``L``), ``storages`` the names of the first child's storages and
    ``bytes`` the activation bytes of one child.
    """

    path: str
    children: tuple[str, ...]
    storages: tuple[str, ...]
    bytes: Any

    @property
    def count(self) -> int:
        return len(self.children)

    def owns(self, module: str) -> int | None:
        """The index (0-based) of the child that ``module`` lies in, or None."""
        for i, c in enumerate(self.children):
            if module == c or module.startswith(c + "."):
                return i
        return None

    def child_of(self, storage: TracedStorage) -> int | None:
        """The child a storage belongs to: the one whose op first saved it — unless it was made outside the
        children and ops of several children keep it (Llama's rotary ``cos``/``sin``): then none."""
        i = self.owns(storage.module)
        if i is None:
            return None
        others = {self.owns(s.module) for s in storage.saved_by if s.module} - {None, i}
        return None if others and self.owns(storage.producer_module) is None else i


@dataclass(frozen=True)
class Check:
    """The traced formula at the example sizes against one real eager forward at the same sizes."""

    values: tuple[tuple[str, int], ...]
    traced: tuple[tuple[str, int], ...]
    measured: tuple[tuple[str, int], ...]

    @property
    def exact(self) -> bool:
        return self.traced == self.measured


@dataclass(frozen=True)
class Trace:
    """The symbolic record of one training-mode forward: what autograd keeps, as formulas in the declared symbols.

    ``method`` is ``symbolic`` (one trace on fake tensors with symbolic sizes), ``retraced`` (the trace at the
    example sizes specialized on a size; a symbolic trace at other sizes did not) or ``fitted`` (the exact
    polynomial through traces at several concrete sizes, checked at more).  ``guards`` are the conditions
    PyTorch assumed; ``domain`` is where the formulas hold: every declared symbol ≥ 2 and every guard.
    ``repeats`` are the folded runs of identical blocks, largest first.  ``check`` compares the formulas at
    the example sizes with a real eager forward (None when none could run: weights on ``meta``).
    """

    module: str
    symbols: tuple[TracedSymbol, ...]
    storages: tuple[TracedStorage, ...]
    parameters: tuple[TracedParameter, ...] = ()
    buffers: tuple[TracedParameter, ...] = ()
    guards: tuple[Guard, ...] = ()
    domain: Any = sympy.true
    bounds: tuple[tuple[str, int, int | None], ...] = ()
    method: str = "symbolic"
    device: str = "cpu"
    training: bool = True
    repeats: tuple[Repeat, ...] = ()
    check: Check | None = None
    notes: tuple[str, ...] = ()
    ops: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # --- symbols -------------------------------------------------------------------------------------
    @property
    def values(self) -> dict[str, int]:
        """The example value of every declared symbol (what was traced)."""
        return {s.name: s.example for s in self.symbols}

    def symbol(self, name: str) -> sympy.Symbol:
        for s in self.symbols:
            if s.name == name:
                return s.symbol
        raise SymmemError(f"the trace has no symbol {name!r}; it has {', '.join(self.values) or 'none'}")

    # --- totals --------------------------------------------------------------------------------------
    def of_kind(self, kind: str) -> tuple[TracedStorage, ...]:
        if kind not in KINDS:
            raise SymmemError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
        return tuple(s for s in self.storages if s.kind == kind)

    def bytes(self, kind: str = "activation") -> Any:
        """Bytes of the storages of one kind, as one expanded sympy expression."""
        return sympy.expand(sympy.Add(*[s.bytes for s in self.of_kind(kind)]))

    @property
    def activations(self) -> Any:
        """Bytes of kept storages that are not parameters, buffers or inputs."""
        return self.bytes("activation")

    @property
    def input(self) -> Any:
        """Bytes of kept input storages."""
        return self.bytes("input")

    def value(self, what: str = "activations", **values: int) -> int:
        """``activations``, ``input`` or ``parameter`` bytes at the given sizes (example values for the rest)."""
        expr = {"activations": self.activations, "input": self.input, "parameter": self.bytes("parameter"),
                "parameters": self.bytes("parameter")}.get(what)
        if expr is None:
            raise SymmemError(f"value of {what!r}? use activations, input or parameter")
        return int(self.evaluate(expr, **values))

    def evaluate(self, expr: Any, **values: int) -> Any:
        unknown = set(values) - set(self.values)
        if unknown:
            raise SymmemError(f"the trace has no symbol {sorted(unknown)[0]!r}; it has {', '.join(self.values)}")
        subs = {s.symbol: values.get(s.name, s.example) for s in self.symbols}
        for name, v in values.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SymmemError(f"{name} must be a positive integer, got {v!r}")
        try:
            return sympy.sympify(expr, strict=True).xreplace(subs)  # never parse a string: that would run it
        except sympy.SympifyError:
            raise SymmemError(f"evaluate takes a sympy expression, not {expr!r}") from None

    def holds_at(self, **values: int) -> bool:
        """Whether the sizes lie in the formula's domain (each symbol ≥ 2 and every guard)."""
        return bool(self.evaluate(self.domain, **values))

    # --- structure -----------------------------------------------------------------------------------
    def by_module(self, kind: str = "activation") -> dict[str, Any]:
        """Bytes per owning module (the module of the op that first saved the storage)."""
        out: dict[str, Any] = {}
        for s in self.of_kind(kind):
            out[s.module] = out.get(s.module, 0) + s.bytes
        return {k: sympy.expand(v) for k, v in out.items()}

    @property
    def layers(self) -> Repeat | None:
        """The run of repeated blocks holding the most bytes (the stack ``L`` counts), if any."""
        return self.repeats[0] if self.repeats else None

    def split(self, repeat: Repeat | None = None) -> dict[str, Any]:
        """Activation bytes as ``stem``, one ``layer``, ``head`` and the layer ``count`` of a repeat.

        ``stem + count * layer + head`` equals :attr:`activations`.  Storages are assigned by the op that
        first saved them: the stream a block passes on belongs to the block (or head) that keeps it.
        """
        rep = repeat or self.layers
        if rep is None:
            raise SymmemError("the trace found no repeated blocks to fold")
        stem: list[Any] = []
        head: list[Any] = []
        layer: list[Any] = []
        first_seq: int | None = None
        for s in self.of_kind("activation"):
            i = rep.child_of(s)
            if i is not None:
                if i == 0:
                    layer.append(s.bytes)
                seq = s.first_saved
                first_seq = seq if first_seq is None else min(first_seq, seq)
        for s in self.of_kind("activation"):
            if rep.child_of(s) is None:  # outside the stack, or shared by its blocks: by when it was made
                when = s.born if s.born is not None and rep.owns(s.module) is not None else s.first_saved
                (stem if first_seq is not None and when < first_seq else head).append(s.bytes)
        return {"stem": sympy.expand(sympy.Add(*stem)), "layer": sympy.expand(sympy.Add(*layer)),
                "head": sympy.expand(sympy.Add(*head)), "count": rep.count}

    def folded(self, layers: sympy.Symbol | None = None) -> Any:
        """Activation bytes as ``stem + L*layer + head`` with ``L`` a symbol (``symmem.symbols.L`` by default).

        At ``L = count`` this equals :attr:`activations`.
        """
        from ..symbols import L

        parts = self.split()
        sym = layers if layers is not None else L
        return parts["stem"] + sym * parts["layer"] + parts["head"]

    # --- reading -------------------------------------------------------------------------------------
    def table(self, kind: str = "activation") -> str:
        """One line per storage: name, dtype, shape, bytes."""
        rows = [f"{s.name:<48} {s.dtype:<9} {str(tuple(s.shape)):<28} {s.bytes}" for s in self.of_kind(kind)]
        return "\n".join(rows)
