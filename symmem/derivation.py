"""The core result: storages with lifetimes, the terms kept at the end of the forward pass, and their totals.

A :class:`Derivation` holds every :class:`Storage` a training step of one model under one convention and
regime keeps: its bytes as a sympy expression (all copies: ``count`` x ``elements`` x bytes per element), its
producer, the nodes that keep it, and the phases of the step in which it is born and dies (:data:`PHASES`).
Everything else is a view of the storages:

* :attr:`Derivation.terms`, what is kept at the end of the forward pass plus the parameter side, summed into
  ``activations``, ``input``, ``loss``, ``parameter_memory``, ``transient`` and ``total``;
* the text table, JSON, LaTeX and Jupyter displays (:mod:`symmem.report`, imported by the methods that show
  them, when first used).

>>> from symmem import derive
>>> d = derive("vit-b16", convention="paper", attention="sdpa", per_layer=True)
>>> d.activations / 4
9*B*H*S
>>> s = d.storage("blocks.qkv")
>>> s.born, s.dies
('forward', 'backward')
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

import sympy

from . import symbols
from .conditions import fold
from .errors import OutsideDomain, SymmemError
from .evaluator import evaluator
from .graph import paused_gc
from .step import exact_peak
from .tensor import MAX_SIZE
from .timeline import checked
from .training import Regime, refuse_one_rank
from .units import format_bytes, to_unit

if TYPE_CHECKING:
    from .peak import Moment, Peak
    from .step import Step
    from .timeline import Row, Which

#: The named quantities a derivation sums (``parameters`` is a count, not bytes).
QUANTITIES = ("activations", "parameter_memory", "total", "input", "loss", "transient", "parameters", "peak",
              "peak_first_step")
#: What ``torch.cuda.max_memory_allocated`` adds to the allocated peak, measured on an H100 (torch 2.11): a
#: 32 MiB cuBLAS workspace per handle -- the forward's thread and autograd's backward thread each make one at
#: their first matmul -- and 1 MiB of cuBLASLt workspace at the first matmul with a bias (``addmm``), all kept
#: for the life of the process; and 0 to 105 MiB of kernel scratch inside an op (cuDNN convolution
#: workspaces).  A band, not a formula: it depends on the library versions and the kernels picked.  Once the
#: workspaces exist, the peak of a model without convolutions is ``peak_allocated()`` to the byte
#: (``benchmarks/check_cuda.py``).
CUDA_WORKSPACES = {"cublas": 2 * 32 * 2**20 + 2**20, "scratch": (0, 105 * 2**20)}
#: Phases of a training step, in order: what a storage's ``born`` and ``dies`` name (the step's op-by-op time is
#: its :class:`~symmem.timeline.Timeline`; here only which phase matters: what is alive when the forward ends).
PHASES = ("start", "forward", "backward", "step", "end")
START = "start"
END = "end"
#: The end of the forward pass, as the phase that follows it: what is born here is not "kept for backward".
FORWARD_END = "backward"


@dataclass(frozen=True)
class Term:
    """One named part of the memory: bytes as a sympy expression, and where it comes from.

    ``count`` is how many copies the formula holds (``L`` for a tensor kept once per layer); ``elements``
    is the size of one copy; ``expr`` = count * elements * bytes per element.
    """

    name: str
    group: str
    category: str
    expr: sympy.Expr
    role: str | None = None
    node: str | None = None
    dtype: str | None = None
    elements: sympy.Expr | None = None
    count: sympy.Expr = sympy.Integer(1)


@dataclass(frozen=True)
class Storage:
    """One storage of the training step (or ``count`` identical ones, one per layer), with its lifetime.

    ``keepers`` are the nodes that keep it for backward; ``born`` and ``dies`` are the phases of the step
    (:data:`PHASES`) in which it is born and dies.  ``shards`` is what a sharding regime divided ``expr`` by (ZeRO's
    N), so that views can print a component as one fraction.
    """

    name: str
    group: str
    category: str
    expr: sympy.Expr
    role: str | None = None
    node: str | None = None
    dtype: str | None = None
    elements: sympy.Expr | None = None
    count: sympy.Expr = sympy.Integer(1)
    keepers: tuple[str, ...] = ()
    born: str = START
    dies: str = END
    shards: sympy.Expr = sympy.Integer(1)

    @property
    def kept_at_forward_end(self) -> bool:
        """Whether it is alive when the forward pass ends (born in forward or before, dies in backward or
        later)."""
        return self.born in ("start", "forward") and self.dies in ("backward", "step", "end")

    def term(self) -> Term:
        return Term(self.name, self.group, self.category, self.expr, self.role, self.node, self.dtype,
                    self.elements, self.count)

    def with_(self, **changes: Any) -> Storage:
        return replace(self, **changes)


def kept_terms(storages: tuple[Storage, ...] | list[Storage]) -> tuple[Term, ...]:
    """The terms of "kept at the end of the forward pass + the parameter side + transients".

    Activations, inputs and loss tensors alive at the end of the forward pass are one term each; the
    parameter side is one term per component (weights, gradients, each optimizer state), summed over
    parameters at the place of its first storage; transients are one term each.
    """
    out: list[Term | str] = []
    components: dict[str, list[Storage]] = {}
    for s in storages:
        if s.category == "parameter":
            key = s.role or s.name
            if key not in components:
                components[key] = []
                out.append(key)
            components[key].append(s)
        elif s.category == "transient" or s.kept_at_forward_end:
            out.append(s.term())
    terms: list[Term] = []
    for item in out:
        if isinstance(item, Term):
            terms.append(item)
            continue
        parts = components[item]
        shards = parts[0].shards
        if all(p.shards == shards for p in parts) and shards != 1:
            expr = sympy.Add(*(p.expr * shards for p in parts)) / shards
        else:
            expr = sympy.Add(*(p.expr for p in parts))
        terms.append(Term(item, parts[0].group, "parameter", expr, item))
    return tuple(terms)


#: Cached properties of a :class:`Derivation` that do not depend on its numbers, kept by :meth:`Derivation.at`.
_NUMBER_FREE = frozenset({"terms", "activations", "input", "loss", "parameter_memory", "transient", "total",
                          "_groups", "_settable"})


@functools.lru_cache(maxsize=8)
def _copied_fields(cls: type) -> frozenset[str] | None:
    """What :meth:`Derivation.at` copies: the dataclass fields and the cached expressions that do not depend on
    the numbers; None when the class checks its fields in ``__post_init__`` (then the constructor runs)."""
    if hasattr(cls, "__post_init__") or hasattr(cls, "__slots__"):
        return None
    return frozenset(f.name for f in dataclasses.fields(cls)) | _NUMBER_FREE


def positive_int(name: str, value: Any) -> int:
    """``value`` as a positive int (a :class:`SymmemError` naming ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, int | sympy.Integer):
        raise SymmemError(f"{name} must be a positive integer, got {value!r}")
    if int(value) <= 0:
        raise SymmemError(f"{name} must be a positive integer, got {value}")
    if int(value) > MAX_SIZE:
        raise SymmemError(f"{name} = {_digits(int(value))} is more than the largest size PyTorch allows (2**63 - 1)")
    return int(value)


def _digits(n: int) -> str:
    """``n`` for a message: the number itself, or its first digits and its length when it is long."""
    if n.bit_length() < 200:
        return str(n)
    return f"a {int(n.bit_length() * 0.30103) + 1}-digit number"


@dataclass(frozen=True)
class Derivation:
    """The memory of one model under one convention and regime: storages with lifetimes, terms and totals.

    Expressions are in :attr:`free` symbols; :attr:`numbers` gives every symbol a value for evaluation.
    """

    model: str
    convention: str
    regime: Regime
    storages: tuple[Storage, ...]
    free: tuple[sympy.Symbol, ...]
    numbers: Mapping[sympy.Symbol, int]
    parameters: sympy.Expr
    per_layer: bool = False
    layer: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    #: the training step, which computes its peak (:mod:`symmem.peak`) on first use; None where the convention
    #: does not model the step (an accounting by role) or for one layer
    step: Step | None = field(default=None, compare=False, repr=False)
    #: where the formulas hold beyond every size being a positive integer (a traced module's guards: S <= 512)
    domain: Any = sympy.true
    #: what a reader must know before trusting the numbers (a convention that finds nothing to count here)
    notes: tuple[str, ...] = ()
    #: free symbols whose model default follows from other symbols (ViT's S from Hi, Wi), as that expression:
    #: solving for Hi moves S with it, and ``at(Hi=...)`` gives S its new number
    tied: Mapping[sympy.Symbol, sympy.Expr] = field(default_factory=dict, compare=False, repr=False)
    #: why a front that models the step has none here (a traced module fitted at concrete sizes): the refusal's words
    no_step: str | None = field(default=None, compare=False, repr=False)
    #: why some conditions of :attr:`domain` are there (condition -> words: the model's position table), said with
    #: them wherever numbers lie past one (:meth:`at`, :meth:`values`, :meth:`outside`)
    why: Mapping[Any, str] = field(default_factory=dict, compare=False, repr=False)

    # -- the kept view --------------------------------------------------------------------------------
    @cached_property
    def terms(self) -> tuple[Term, ...]:
        """What is kept at the end of the forward pass, the parameter side and transients (see
        :func:`kept_terms`)."""
        return kept_terms(self.storages)

    def storage(self, name: str) -> Storage:
        """The storage called ``name``."""
        for s in self.storages:
            if s.name == name:
                return s
        raise SymmemError(f"{self.model} has no storage {name!r}")

    # -- totals ---------------------------------------------------------------------------------------
    def sum(self, category: str | None = None, group: str | None = None, role: str | None = None
            ) -> sympy.Expr:
        """Bytes of the terms that match every given filter."""
        return fold(sympy.Add(*(t.expr for t in self.terms
                                if (category is None or t.category == category)
                                and (group is None or t.group == group)
                                and (role is None or t.role == role))))

    @cached_property
    def activations(self) -> sympy.Expr:
        """Every kept activation tensor, indices and masks included."""
        return self.sum("activation")

    @cached_property
    def input(self) -> sympy.Expr:
        return self.sum("input")

    @cached_property
    def loss(self) -> sympy.Expr:
        return self.sum("loss")

    @cached_property
    def parameter_memory(self) -> sympy.Expr:
        return self.sum("parameter")

    @cached_property
    def transient(self) -> sympy.Expr:
        """Memory alive only during backward: recomputed layers, CS231n's activation gradients."""
        return self.sum("transient")

    @cached_property
    def total(self) -> sympy.Expr:
        """Kept at the end of the forward pass + the parameter side + transients."""
        return fold(sympy.Add(*(t.expr for t in self.terms)))

    def expression(self, key: str) -> sympy.Expr:
        """The expression for ``activations``, ``parameter_memory``, ``total``, ``input``, ``loss``,
        ``transient``, ``peak``, ``peak_first_step`` or ``parameters`` (a count)."""
        if key not in QUANTITIES:
            raise SymmemError(f"unknown quantity {key!r}; known: {', '.join(QUANTITIES)}")
        return getattr(self, key)

    # -- the peak over a training step ----------------------------------------------------------------
    @property
    def has_peak(self) -> bool:
        """Whether the convention models the training step (``pytorch``), so that there is a peak."""
        return self.step is not None

    def _step(self) -> Step:
        if self.step is None and self.no_step is not None:
            raise SymmemError(f"no peak: {self.no_step}")
        if self.step is None:
            why = "one layer" if self.per_layer else f"the {self.convention} convention (an accounting by role)"
            raise SymmemError(f"no peak for {why}: the peak follows the training step op by op, which the "
                              "pytorch convention models (--convention pytorch)")
        # every step's peak, timeline and allocation is asked for here: an engine that runs otherwise on one rank
        # is refused once for all of them
        refuse_one_rank(self.regime.data_parallel, self.numbers)
        return self.step

    def _peak(self, exact: bool = False) -> Peak:
        step = self._step()
        if exact:
            return exact_peak(step, self.numbers)
        # the step's walks and the peak's algebra, worked out on first use, are many small objects that stay
        # alive: the cycle collector is paused as while the derivation is worked out (graph.paused_gc)
        with paused_gc():
            return step.peak()

    @property
    def peak(self) -> sympy.Expr:
        """The most live memory at any moment of a steady training step (forward, backward, optimizer step,
        zero_grad), in bytes: a ``Max`` over the moments that can be largest (:mod:`symmem.peak`)."""
        return self._peak().expr

    @property
    def peak_first_step(self) -> sympy.Expr:
        """The peak of the first training step, in which the optimizer creates its state."""
        return self._peak().first

    def peak_formula(self, step: Which = "steady") -> sympy.Expr:
        """The peak's formula that holds at the derivation's numbers: :attr:`peak` (or the first step's), or,
        where a layer count lies below that formula's domain, the one written out with that count."""
        return self._peak(exact=True).formula(checked(step))

    def peak_candidates(self, step: Which = "steady") -> int:
        """How many moments of the step can be the largest (the ``Max``'s arguments), at these numbers."""
        return self._peak(exact=True).candidates(checked(step), self.numbers)

    def peak_at(self, step: Which = "steady") -> Moment:
        """Where the peak occurs at the derivation's numbers: a :class:`~symmem.peak.Moment` with the
        phase, the op, the layer and the live bytes by category."""
        return self._peak(exact=True).at(self.numbers, checked(step))

    def timeline(self, step: Which = "steady") -> list[Row]:
        """The training step at the derivation's numbers, op by op: (phase, op, live bytes per category) after
        each op's allocations -- the picture of a memory snapshot, from the formula (``first``: the step that
        creates the optimizer state)."""
        # the step written out at the numbers (every layer) and a row per moment: many small objects that stay
        # alive, which the cycle collector would scan again and again (a third of the time): paused, as in _peak
        with paused_gc():
            return self._step().timeline(checked(step), dict(self.numbers))

    def peak_allocated(self, step: Which = "steady", rank: int | None = None) -> int:
        """The peak at the derivation's numbers as CUDA's caching allocator counts it: every storage rounded up
        to 512 bytes (``torch.cuda.max_memory_allocated`` adds library workspaces on top: see
        :data:`CUDA_WORKSPACES`); the largest rank's, or data-parallel ``rank``'s (ZeRO-1's ranks own different
        parameters).

        >>> from symmem import derive
        >>> d = derive("mlp", widths="64,128,128,10", data_parallel="zero-redundancy", device="cuda",
        ...            loss="cross-entropy", values={"B": 4, "N": 2})
        >>> d.peak_allocated(), d.peak_allocated(rank=0), d.peak_allocated(rank=1)
        (513024, 513024, 434688)
        """
        which = checked(step)
        if rank is None:
            with paused_gc():  # the step written out, as timeline()
                return self._step().allocated(which, dict(self.numbers))
        runs = self._step()
        world = self.numbers.get(symbols.N)
        if self.regime.data_parallel is None or world is None or not hasattr(runs, "allocated_of_rank"):
            raise SymmemError("a rank's allocated peak is modelled for the data-parallel engines of the built-in "
                              "graphs (data_parallel=..., N set); here every rank's is peak_allocated()")
        if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < int(world):
            raise SymmemError(f"rank must be an integer from 0 to N - 1 = {int(world) - 1}, not {rank!r}")
        with paused_gc():
            return runs.allocated_of_rank(which, dict(self.numbers), rank)

    def live_at_peak(self, step: Which = "steady") -> dict[str, int]:
        """Bytes alive at the peak, by category (parameter, optimizer_state, gradient, input, activation, loss,
        activation_grad, temporary), at the derivation's numbers."""
        m = self.peak_at(checked(step))
        return {c: self.evaluate(e) for c, e in m.live.items() if self.evaluate(e)}

    def groups(self) -> dict[str, sympy.Expr]:
        """Bytes per group, in the order the groups first appear (a new dict each call: the caller's to change)."""
        return dict(self._groups)

    @cached_property
    def _groups(self) -> tuple[tuple[str, sympy.Expr], ...]:
        # summed once: a table asks at every width, and every view of the derivation asks again
        parts: dict[str, list[sympy.Expr]] = {}
        for t in self.terms:
            parts.setdefault(t.group, []).append(t.expr)
        return tuple((g, fold(sympy.Add(*e))) for g, e in parts.items())

    # -- numbers --------------------------------------------------------------------------------------
    def evaluate(self, expr: sympy.Expr) -> int:
        """``expr`` at the derivation's numbers (defaults overridden by what was set): exact integer bytes, rounded
        up where the formula has a fraction of a byte.  The expression's evaluator is cached
        (:mod:`symmem.evaluator`: interpreted at its first numbers, compiled from the second), so evaluating it at
        many numbers (``at(...)``) does not rebuild it."""
        f = evaluator(expr)
        numbers = self.numbers
        missing = [s for s in f.symbols if s not in numbers]
        if missing:
            names = ", ".join(sorted(s.name for s in missing))
            raise SymmemError(f"no value for {names}; set one (e.g. --set {sorted(missing, key=str)[0]}=...)")
        return f(*[numbers[s] for s in f.symbols])

    def try_evaluate(self, expr: sympy.Expr) -> int | None:
        """:meth:`evaluate`, or None where a symbol has no value."""
        try:
            return self.evaluate(expr)
        except SymmemError:
            return None

    def value(self, key: str) -> int:
        """Integer bytes of a named quantity (``parameters`` is a count)."""
        if key in ("peak", "peak_first_step"):
            found = self._peak(exact=True)
            step = "steady" if key == "peak" else "first"
            fast = found.value(self.numbers, step) if all(s in self.numbers for s in self.free) else None
            return fast if fast is not None else self.evaluate(found.formula(step))
        return self.evaluate(self.expression(key))

    def values(self, key: str | sympy.Expr = "total", **values: Any) -> Any:
        """A named quantity (or an expression) at many configurations at once, exactly.

        Give arrays (numpy arrays or lists of positive integers) for some of the :attr:`free` symbols; they are
        broadcast together (``B=[1, 2, 4]`` with ``S=[128, 256, 512]`` is three configurations; ``B=b[:, None]``
        with ``S=s[None, :]`` a grid) and every other symbol takes its number.  The result has the broadcast
        shape: an int64 array when no intermediate value can overflow, an object array of Python ints otherwise
        (see :mod:`symmem.evaluator`).

        >>> from symmem import derive
        >>> d = derive("vit-b16", attention="sdpa")
        >>> d.values("total", B=[1, 64]).tolist() == [d.at(B=1).value("total"), d.value("total")]
        True
        >>> d.values("activations", B=[[1], [2]], L=[12, 24]).tolist()
        [[117574312, 233936680], [235148432, 467872976]]

        A size that follows from others moves with them (ViT's S from the image, as :meth:`at` moves it); one given
        where they say otherwise is refused, naming the rule:

        >>> image = derive("vit-b16", attention="sdpa", free=("B", "S", "Hi", "Wi"))
        >>> image.values("activations", Hi=[224, 384], Wi=[224, 384]).tolist()
        [7524743872, 22037705408]
        >>> image.values("activations", S=[197, 577])
        Traceback (most recent call last):
        symmem.errors.SymmemError: S follows from Hi, Wi: S = floor(Hi/16)*floor(Wi/16) + 1, which is 197 at ...
        """

        by_name = self._settable
        for name in values:
            if name not in by_name:
                raise SymmemError(f"{name!r} is not a symbol of this formula (it is in "
                                  f"{', '.join(sorted(by_name)) or 'no symbol'}); derive again with "
                                  f"values={{{name!r}: ...}}")
        values = self._tied_values(values)
        self._warn_outside_values(values)
        if key in ("peak", "peak_first_step"):
            return self._peak_values(key, values)
        return self._expr_values(key, values)

    def _tied_values(self, values: Mapping[str, Any]) -> Mapping[str, Any]:
        """``values`` with each size that follows from others (ViT's S from Hi, Wi) moved with those given, as
        :meth:`at` moves it; one given by hand where they say otherwise is refused in :meth:`at`'s words."""
        import numpy as np

        out = dict(values)
        try:
            np.broadcast_shapes(*(np.shape(v) for v in values.values()))
        except ValueError:
            return out  # the values do not broadcast: the evaluation says so
        for t, e in self.tied.items():
            given = [x for x in e.free_symbols if x.name in values]
            if not given and t.name not in values:
                continue
            f = evaluator(e)
            if not all(x.name in values or x in self.numbers for x in f.symbols):
                continue
            args = [np.asarray(values[x.name]) if x.name in values else self.numbers[x] for x in f.symbols]
            try:
                follows = np.asarray(f.many(*args))
                if t.name not in values:
                    out[t.name] = follows
                    continue
                mine, theirs = np.broadcast_arrays(np.asarray(values[t.name]), follows, *args)[:2]
            except ValueError:
                continue  # the values do not broadcast: the evaluation says so
            wrong = np.argwhere(mine != theirs)
            if len(wrong):
                index = tuple(wrong[0])
                grid = np.broadcast_arrays(np.asarray(values[t.name]), follows, *args)[2:]
                nums = {**self.numbers, **{x: int(g[index]) for x, g in zip(f.symbols, grid, strict=True)}}
                raise self._tied_error(t, nums, int(mine[index]), int(theirs[index]))
        return out

    def _warn_outside_values(self, values: Mapping[str, Any]) -> None:
        """An :class:`~symmem.errors.OutsideDomain` warning, in :meth:`at`'s words, at the first configuration of
        ``values`` outside :attr:`domain` (each condition once): the numbers there are given, as :meth:`at` gives
        them, but never silently (a sequence past a model's position table)."""
        import numpy as np

        conds = [c for c in failing_anywhere(self.domain)
                 if {s.name for s in c.free_symbols} & set(values)]
        if not conds:
            return
        by_name = self._settable
        names = sorted({s.name for c in conds for s in c.free_symbols} & set(values))
        try:
            grid = np.broadcast_arrays(*(np.asarray(values[n]) for n in names))
        except ValueError:
            return  # the values do not broadcast: the evaluation says so
        said: set[Any] = set()
        for combo in np.unique(np.stack([g.ravel() for g in grid], axis=-1), axis=0):
            nums = {**self.numbers, **{by_name[n]: int(v) for n, v in zip(names, combo, strict=True)}}
            new = [c for c in failing(sympy.And(*conds), nums) if c not in said]
            if new:
                said.update(new)
                warn_outside(sympy.And(*new), nums, self.why, stacklevel=3)

    def _expr_values(self, key: str | sympy.Expr, values: Mapping[str, Any]) -> Any:
        """:meth:`values` of a named quantity or an expression (the domain judged by the caller)."""
        import numpy as np

        expr = self.expression(key) if isinstance(key, str) else sympy.sympify(key, strict=True)
        f = evaluator(expr)
        args = []
        for s in f.symbols:
            if s.name in values:
                args.append(values[s.name])
            elif s in self.numbers:
                args.append(self.numbers[s])
            else:
                raise SymmemError(f"no value for {s.name}; set one (e.g. --set {s.name}=...)")
        out = f.many(*args)
        if all(s.name in values for s in f.symbols) and len(values) == len(f.symbols):
            return out  # every array given went into the formula: it has their shape
        try:
            shape = np.broadcast_shapes(out.shape, *(np.shape(v) for v in values.values()))
        except ValueError:  # a ragged list, or shapes that do not broadcast, among values the formula does not use
            raise SymmemError("the values do not broadcast together: " + ", ".join(
                f"{name} = {str(v)[:40]}" for name, v in values.items())) from None
        return out if out.shape == shape else np.broadcast_to(out, shape).copy()

    def _peak_values(self, key: str, values: Mapping[str, Any]) -> Any:
        """:meth:`values` of the peak: its formula where the configurations lie in the formula's domain
        (``L >= 4``), :meth:`value` one configuration at a time where they do not."""
        import numpy as np

        step = self._step()
        limits = sorted({s.name for c in step.domain() for s in c.free_symbols} & set(values))
        if not limits:  # the domain's symbols keep this derivation's numbers: one formula holds for all
            exact = self._peak(exact=True)
            return self._expr_values(exact.expr if key == "peak" else exact.first, values)
        found = self._peak()
        out = self._expr_values(found.expr if key == "peak" else found.first, values)
        grid = {n: np.broadcast_to(np.asarray(v), out.shape) for n, v in values.items()}
        by_name = self._settable
        outside = np.zeros(out.shape, dtype=bool)
        for combo in np.unique(np.stack([grid[n].ravel() for n in limits], axis=-1), axis=0):
            if not step.holds_at({**self.numbers, **{by_name[n]: int(v) for n, v in zip(limits, combo,
                                                                                           strict=True)}}):
                outside |= np.logical_and.reduce([grid[n] == v for n, v in zip(limits, combo, strict=True)])
        if not outside.any():
            return out
        out = out.astype(object)
        with warnings.catch_warnings():  # values() said where the configurations lie outside the domain, once
            warnings.simplefilter("ignore", OutsideDomain)
            for index in np.ndindex(out.shape):
                if outside[index]:
                    out[index] = self.at(**{n: int(g[index]) for n, g in grid.items()}).value(key)
        return out.astype(np.int64) if all(abs(x) <= 2**63 - 1 for x in out.flat) else out

    def size(self, key: str, unit: str = "GiB") -> float:
        """A named quantity in ``unit`` (B, KiB, MiB, GiB, TiB, kB, MB, GB, TB).

        >>> from symmem import derive
        >>> round(derive("resnet50-v1").size("parameter_memory", "MB"), 1)
        408.9
        """
        return to_unit(self.value(key), unit)

    def outside(self, reasons: Mapping[Any, str] | None = None) -> tuple[str, ...]:
        """Where the derivation's numbers lie outside its :attr:`domain`: one sentence per condition that fails
        there (``reasons`` names a condition's origin, e.g. the model's position table); empty inside it.

        >>> import warnings
        >>> from symmem import derive
        >>> d = derive("mlp")
        >>> B = next(s for s in d.free if s.name == "B")
        >>> with warnings.catch_warnings(record=True) as said:   # at() says so too (OutsideDomain)
        ...     warnings.simplefilter("always")
        ...     far = dataclasses.replace(d, domain=B < 16).at(B=64)
        >>> print(*far.outside())
        B = 64 lies outside the formulas' domain (B < 16 fails): they are not known to hold there
        >>> [str(w.message) for w in said] == list(far.outside())
        True
        """
        return outside(self.domain, self.numbers, {**self.why, **dict(reasons or {})})

    def at(self, **values: int) -> Derivation:
        """The same derivation evaluated at other numbers (expressions unchanged).

        >>> from symmem import derive
        >>> d = derive("vit-b16", attention="sdpa").at(B=1)
        >>> d.numbers[d.free[0]]
        1
        """
        nums = dict(self.numbers)
        by_name = self._settable
        for name, v in values.items():
            if name not in by_name:
                # Other symbols were replaced by their values when deriving (F = 4H, S from the image size),
                # so a new number for them would be silently ignored: derive again instead.
                raise SymmemError(f"{name!r} is not a symbol of this formula (it is in "
                                  f"{', '.join(sorted(by_name)) or 'no symbol'}); derive again with "
                                  f"values={{{name!r}: {v!r}}}")
            nums[by_name[name]] = positive_int(name, v)
        if self.tied:
            set_ = {by_name[name] for name in values}
            for t, e in self.tied.items():
                if not (t in set_ or e.free_symbols & set_) or not e.free_symbols <= nums.keys():
                    continue
                follows = int(e.xreplace({x: sympy.Integer(nums[x]) for x in e.free_symbols}))
                if t in set_ and nums[t] != follows:  # S set by hand where the image says otherwise: never mixed
                    raise self._tied_error(t, nums, nums[t], follows)
                if e.free_symbols & set_:
                    nums[t] = follows
        if self.domain is not sympy.true and any(by_name[n] in self.domain.free_symbols for n in values):
            warn_outside(self.domain, nums, self.why, stacklevel=2)  # the caller of at()
        # The expressions do not depend on the numbers: the new derivation keeps the ones already worked out.
        keep = _copied_fields(type(self))
        if keep is None:  # a __post_init__ to run: the constructor
            new = replace(self, numbers=nums)
            new.__dict__.update({k: v for k, v in self.__dict__.items() if k in _NUMBER_FREE})
            return new
        new = object.__new__(type(self))  # a field-by-field copy: a fifth of replace()'s cost, in a loop over sizes
        state = new.__dict__
        for k, v in self.__dict__.items():
            if k in keep:
                state[k] = v
        state["numbers"] = nums
        return new

    @cached_property
    def _settable(self) -> dict[str, sympy.Symbol]:
        """The symbols :meth:`at` and :meth:`values` set, by name: the free ones, and a size the domain alone has
        (a traced Mistral's sliding window ``W`` in ``S <= W - 2``: no formula holds it, so a new number changes
        none of them, only where they are known to hold)."""
        out = {s.name: s for s in self.free}
        if isinstance(self.domain, sympy.Basic) and self.domain is not sympy.true:
            for s in self.domain.free_symbols:
                if s in self.numbers:
                    out.setdefault(s.name, s)
        return out

    def _tied_error(self, t: sympy.Symbol, nums: Mapping[sympy.Symbol, int], given: int, follows: int
                    ) -> SymmemError:
        """The refusal of ``t = given`` where ``t`` follows from other sizes (ViT's S from the image), which give
        ``follows``: the rule, the sizes it was worked at, and which sizes to set instead."""
        e = self.tied[t]
        sources = sorted(e.free_symbols, key=lambda x: x.name)
        names = [x.name for x in sources]
        at = ", ".join(f"{x.name} = {nums[x]:,}" for x in sources)
        sides = _equal_sides(e, sources, given)
        shown = "..." if sides is None else str(sides)
        how = f"at({', '.join(f'{n}={shown}' for n in names)}) moves {t.name} with them" \
            if set(names) <= {x.name for x in self.free} else \
            f"derive again with values={{{', '.join(f'{n!r}: {shown}' for n in names)}}}"
        return SymmemError(f"{t.name} follows from {', '.join(names)}: {t.name} = {e}, which is {follows:,} at {at}, "
                           f"not {given:,}; set {' and '.join(names)} instead of {t.name} ({how}"
                           f"{'' if sides is None else f' for {t.name} = {given:,}'})")

    # -- views ----------------------------------------------------------------------------------------
    def title(self) -> str:
        """The one header every view prints: model, convention, precision (and autocast) and optimizer, scope,
        and what ran: the device whose kernels are followed and the attention kernel, where they apply.

        >>> from symmem import derive
        >>> derive("vit-b16", convention="pytorch").title()
        'ViT-B/16 (vit-b16) — PyTorch autograd (pytorch convention), FP32 + AdamW; on cuda, fused attention (SDPA)'
        """
        from . import names

        scope = f", one layer ({self.layer})" if self.per_layer else ""
        shown = names.model(self.model)
        model = shown if shown == self.model else f"{shown} ({self.model})"
        conv = names.convention(self.convention)
        conv = f"{conv} ({self.convention} convention)" if conv != self.convention else f"{conv} convention"
        # a traced module says how its formula was found: symbolic, retraced (at other sizes) or fitted
        how = f", {self.options['method']} formula" if self.convention == "traced" and "method" in self.options \
            else ""
        regime = self.regime_label()
        ran = [f"on {self.options['device']}"] if self.options.get("device") else []
        if self.options.get("attention"):
            ran.append(names.attention(str(self.options["attention"])))
        layout = self.layout_label()  # the values are one device's of this layout
        ran += [f"per device: {layout}"] if layout else []
        return f"{model} — {conv}, {regime}{scope}{how}" + (f"; {', '.join(ran)}" if ran else "")

    def layout_label(self) -> str:
        """The parallel layout in the command line's words and sizes, empty on one device.

        >>> from symmem import derive
        >>> derive("gpt2", data_parallel="fsdp", values={"N": 8}).layout_label()
        'fsdp N=8'
        >>> derive("llama", pipeline_parallel=True, micro_batches=4, values={"p": 2}).layout_label()
        '1f1b p=2 M=4'
        """
        r, at = self.regime, {s.name: v for s, v in self.numbers.items()}

        def sized(text: str, *names: str) -> str:
            return " ".join([text, *(f"{n}={at[n]}" for n in names if n in at)])

        parts = []
        if r.data_parallel:
            parts.append(sized(r.data_parallel, "N"))
            if r.param_dtype:  # FSDP2's MixedPrecisionPolicy, in its own words
                parts[-1] += f" param_dtype={r.param_dtype} reduce_dtype={r.policy_reduce_dtype}"
        elif r.zero:
            parts.append(sized(f"ZeRO-{r.zero}", "N"))
        if r.tensor_parallel:
            parts.append(sized("sequence parallel" if r.sequence_parallel else "tensor parallel", "t"))
        if r.pipeline_parallel:
            parts.append(f"{sized(r.pipeline_schedule, 'p')} M={r.micro_batches}")
        return ", ".join(parts)

    def regime_label(self) -> str:
        """``FP32 + AdamW``; a traced module cast to another dtype names its own (``bfloat16 weights + AdamW``: the
        regime's ``fp32`` only says no 16-bit copies are added), and autocast says what the forward computes in.

        >>> from symmem import derive
        >>> derive("gpt2").regime_label()
        'FP32 + AdamW'
        """
        from . import names

        dtype = self.options.get("dtype")  # set by trace for a module whose weights are not FP32
        own = bool(dtype) and self.regime.precision == "fp32"
        precision = str(dtype) if own else names.precision(self.regime.precision)
        optimizer = names.optimizer(self.regime.optimizer)
        autocast = self.options.get("autocast")
        if autocast:  # the weights stay as the precision says; the forward computes in the autocast dtype
            return f"{precision} weights under {autocast} autocast + {optimizer}"
        return f"{precision} weights + {optimizer}" if own else f"{precision} + {optimizer}"

    # The views are imported when first asked for, as sympy's ``Printable.__str__`` imports its printer: the
    # core does not need them to derive, and a command line never shows the Jupyter ones.  Each is worked out with
    # the cycle collector paused (graph.paused_gc): printing a peak's formulas makes many short-lived objects, and
    # every collection they trigger scans the derivation's walks and sympy's caches again (a third to half of a
    # view's time with a few derivations alive)
    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (see "JSON output" in docs/reference.md)."""
        from .report.text import to_dict

        with paused_gc():
            return to_dict(self)

    def table(self) -> str:
        """A readable text table in MiB/GiB."""
        from .report.text import summary

        with paused_gc():
            return summary(self)

    def _repr_latex_(self) -> str:
        from .report.jupyter import latex

        with paused_gc():
            return latex(self)

    def _repr_html_(self) -> str:
        from .report.jupyter import html

        with paused_gc():
            return html(self)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        total = self.try_evaluate(self.total)
        size = "?" if total is None else format_bytes(total)
        # the kept memory only: a repr does not run the step (the peak leads every view that shows the table)
        return f"<Derivation {self.title()}: kept after forward + parameters {size}>"


def outside(domain: Any, numbers: Mapping[sympy.Symbol, int], reasons: Mapping[Any, str] | None = None
            ) -> tuple[str, ...]:
    """The one reading of "these numbers lie outside the formulas' domain": a sentence per condition of ``domain``
    (each argument of an ``And``) that is false at ``numbers``; a condition with a symbol without a number is not
    judged.  ``reasons`` (condition -> why it is there) is said with it.

    >>> B = sympy.Symbol("B", positive=True, integer=True)
    >>> outside(sympy.And(B >= 2, B < 16), {B: 64}, {B < 16: "a guard"})
    ("B = 64 lies outside the formulas' domain (B < 16 fails: a guard): they are not known to hold there",)
    >>> outside(sympy.And(B >= 2, B < 16), {B: 8})
    ()
    """
    found = []
    for cond in failing(domain, numbers):
        symbols = sorted(cond.free_symbols, key=lambda s: s.name)
        at = ", ".join(f"{s.name} = {numbers[s]:,}" for s in symbols)
        why = (reasons or {}).get(cond)
        verb = "lies" if len(symbols) == 1 else "lie"
        found.append(f"{at} {verb} outside the formulas' domain ({cond} fails{f': {why}' if why else ''}): they are "
                     "not known to hold there")
    return tuple(found)


def _equal_sides(e: sympy.Expr, sources: list[sympy.Symbol], value: int) -> int | None:
    """The size ``x`` with ``e`` = ``value`` at every source ``x`` (a square image's side for ViT's S), or None
    where there is none; ``e`` grows with its sources (the grid of patches and the class token)."""
    def at(x: int) -> int:
        return int(e.xreplace({s: sympy.Integer(x) for s in sources}))

    if value <= at(1):  # no image gives it (ViT's S = 1: the class token alone)
        return None
    lo, hi = 1, 1
    while at(hi) < value and hi < MAX_SIZE:
        lo, hi = hi, min(2 * hi, MAX_SIZE)
    while lo < hi:  # the smallest x with at(x) >= value
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if at(mid) < value else (lo, mid)
    return lo if at(lo) == value else None


def failing_anywhere(domain: Any) -> list[Any]:
    """The conditions of ``domain`` (each argument of an ``And``) with a symbol in them: those some numbers fail."""
    if domain is sympy.true or not isinstance(domain, sympy.Basic):
        return []
    return [c for c in (domain.args if isinstance(domain, sympy.And) else (domain,)) if c.free_symbols]


def failing(domain: Any, numbers: Mapping[sympy.Symbol, int]) -> list[Any]:
    """The conditions of ``domain`` (each argument of an ``And``) that are false at ``numbers`` (one with a symbol
    without a number is not judged)."""
    if domain is sympy.true or not isinstance(domain, sympy.Basic):
        return []
    out = []
    for cond in domain.args if isinstance(domain, sympy.And) else (domain,):
        symbols = cond.free_symbols
        if symbols and all(s in numbers for s in symbols) \
                and cond.xreplace({s: sympy.Integer(numbers[s]) for s in symbols}) is sympy.false:
            out.append(cond)
    return out


def warn_outside(domain: Any, numbers: Mapping[sympy.Symbol, int], reasons: Mapping[Any, str] | None = None,
                 stacklevel: int = 2) -> None:
    """An :class:`~symmem.errors.OutsideDomain` warning for each condition of ``domain`` false at ``numbers``
    (:func:`outside`): what :func:`symmem.derive`, :func:`symmem.trace`, :meth:`Derivation.at` and the commands
    say where numbers lie outside the formulas' domain (the command line: one line each on standard error)."""
    import warnings

    for text in outside(domain, numbers, reasons):
        warnings.warn(OutsideDomain(text), stacklevel=stacklevel + 1)
