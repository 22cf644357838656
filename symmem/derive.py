"""Graph + convention + training regime -> a :class:`Derivation`: named sympy terms in bytes, with totals.

>>> d = derive("vit-b16", convention="paper", attention="sdpa", per_layer=True)
>>> d.activations / 4
9*B*H*S
>>> d = derive("resnet50-v1")
>>> round(d.value("total") / 2**30, 4)
3.0246
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import sympy

from .branches import fold, holds
from .conventions import Convention, Saved
from .conventions import convention as get_convention
from .errors import SymmemError
from .graph import Model
from .tensor import TensorSpec, dtype_bytes
from .training import Regime

#: ``transient``: memory alive only during part of backward (a recomputed layer, CS231n's x2 for backward).
CATEGORIES = ("activation", "input", "loss", "parameter", "transient")


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


def _converts(graph: nx.DiGraph, node: str, act_dtype: str | None) -> bool:
    """Whether ``node`` is a ``cast`` that changes the dtype (a copy) under the activation dtype ``act_dtype``."""
    data = graph.nodes[node]
    if data["kind"] != "cast" or act_dtype is None:
        return False
    src = graph.nodes[data["inputs"][0]]["out"].dtype
    dst = data["out"].dtype
    return (act_dtype if src == "act" else src) != (act_dtype if dst == "act" else dst)


def _resolve(graph: nx.DiGraph, node: str, steady: bool = False, act_dtype: str | None = None,
             branch: Mapping[sympy.Basic, bool] | None = None) -> list[tuple[str, str]]:
    """The storages behind ``node``'s output, each with the iterations in which it is the one seen.

    Views lead to their base.  A repeated layer's input is the block's source in its first iteration
    (``first``) and the block's own output in the others (``rest``); ``steady`` (one layer on its own)
    keeps only the latter, so that a layer's input is counted once.  A ``cast`` is a view unless it changes
    the dtype under ``act_dtype`` (``x.to(torch.float32)`` returns ``x`` itself in FP32, a copy in 16-bit).
    A view whose ``copy`` attribute is a condition (:mod:`symmem.branches`) is a copy where ``branch`` says
    the condition holds.
    """
    blocks = graph.graph.get("blocks", {})
    found: list[tuple[str, str]] = []
    stack = [(node, "same")]
    seen: set[tuple[str, str]] = set()
    while stack:
        n, mode = stack.pop()
        if (n, mode) in seen:
            continue
        seen.add((n, mode))
        data = graph.nodes[n]
        if data["kind"] == "block_input":
            block = blocks[data["block"]]
            if not steady:
                stack.append((data["inputs"][0], "first"))
            stack.append((block.output, "rest"))
        elif data["view_of"] is not None and not _converts(graph, n, act_dtype) and not holds(
                data["attrs"].get("copy", False), branch):
            stack.append((data["inputs"][data["view_of"]], mode))
        else:
            found.append((n, mode))
    return found


def _multiplicity(graph: nx.DiGraph, storage: str, savers: list[tuple[str, str]]) -> sympy.Expr:
    """How many copies of ``storage`` are alive, given who keeps it and in which iterations."""
    data = graph.nodes[storage]
    count = data["count"]
    full = rest = external = False
    for saver, mode in savers:
        if mode == "rest":
            rest = True
        elif mode == "same" and graph.nodes[saver]["block"] == data["block"]:
            full = True
        else:
            external = True
    if full or (rest and external):
        return count
    return (count - 1 if rest else sympy.Integer(0)) + (1 if external else 0)


def _effective(model: Model, values: Mapping[sympy.Symbol, Any]) -> dict[sympy.Symbol, sympy.Expr]:
    eff = {s: sympy.sympify(v) for s, v in model.defaults.items()}
    eff.update({s: sympy.Integer(v) for s, v in values.items()})
    return eff


def _substitute_all(eff: Mapping[sympy.Symbol, sympy.Expr], keep: set[sympy.Symbol]) -> dict:
    """Resolve every symbol not in ``keep`` to an expression in ``keep`` (defaults may chain)."""
    out: dict[sympy.Symbol, sympy.Expr] = {}
    for sym in eff:
        if sym in keep:
            continue
        e = eff[sym]
        for _ in range(20):
            todo = {s: eff[s] for s in e.free_symbols if s not in keep and s in eff}
            if not todo:
                break
            e = e.xreplace(todo)
        else:
            raise SymmemError(f"the default of {sym} refers back to itself: {eff[sym]}")
        out[sym] = e
    return out


@dataclass(frozen=True)
class Derivation:
    """The memory of one model under one convention and regime: named terms and their totals.

    Expressions are in :attr:`free` symbols; :attr:`numbers` gives every symbol a value for evaluation.
    """

    model: str
    convention: str
    regime: Regime
    terms: tuple[Term, ...]
    free: tuple[sympy.Symbol, ...]
    numbers: Mapping[sympy.Symbol, int]
    parameters: sympy.Expr
    per_layer: bool = False
    layer: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    # -- totals ---------------------------------------------------------------------------------------
    def sum(self, category: str | None = None, group: str | None = None, role: str | None = None
            ) -> sympy.Expr:
        """Bytes of the terms that match every given filter."""
        return fold(sympy.Add(*(t.expr for t in self.terms
                           if (category is None or t.category == category)
                           and (group is None or t.group == group)
                           and (role is None or t.role == role))))

    @property
    def activations(self) -> sympy.Expr:
        """Every kept activation tensor, indices and masks included."""
        return self.sum("activation")

    @property
    def input(self) -> sympy.Expr:
        return self.sum("input")

    @property
    def loss(self) -> sympy.Expr:
        return self.sum("loss")

    @property
    def parameter_memory(self) -> sympy.Expr:
        return self.sum("parameter")

    @property
    def transient(self) -> sympy.Expr:
        """Memory alive only during backward: recomputed layers, CS231n's activation gradients."""
        return self.sum("transient")

    @property
    def total(self) -> sympy.Expr:
        return fold(sympy.Add(*(t.expr for t in self.terms)))

    def expression(self, key: str) -> sympy.Expr:
        """The expression for ``activations``, ``parameter_memory``, ``total``, ``input``, ``loss`` or
        ``parameters`` (a count)."""
        if key not in ("activations", "parameter_memory", "total", "input", "loss", "transient", "parameters"):
            raise SymmemError(f"unknown quantity {key!r}")
        return getattr(self, key)

    def groups(self) -> dict[str, sympy.Expr]:
        """Bytes per group, in the order the groups first appear."""
        parts: dict[str, list[sympy.Expr]] = {}
        for t in self.terms:
            parts.setdefault(t.group, []).append(t.expr)
        return {g: fold(sympy.Add(*e)) for g, e in parts.items()}

    # -- numbers --------------------------------------------------------------------------------------
    def evaluate(self, expr: sympy.Expr) -> int:
        """``expr`` at the derivation's numbers (defaults overridden by what was set)."""
        missing = expr.free_symbols - set(self.numbers)
        if missing:
            names = ", ".join(sorted(s.name for s in missing))
            raise SymmemError(f"no value for {names}; set one (e.g. --set {sorted(missing, key=str)[0]}=...)")
        value = sympy.sympify(expr.xreplace(dict(self.numbers)))
        if not value.is_number:
            raise SymmemError(f"{expr} did not evaluate to a number")
        return int(value) if value.is_integer else int(sympy.ceiling(value))

    def value(self, key: str) -> int:
        """Integer bytes of a named quantity (``parameters`` is a count)."""
        return self.evaluate(self.expression(key))

    def size(self, key: str, unit: str = "GiB") -> float:
        """A named quantity in ``unit`` (B, KiB, MiB, GiB, TiB, kB, MB, GB, TB).

        >>> round(derive("resnet50-v1").size("parameter_memory", "MB"), 1)
        408.9
        """
        from .units import to_unit

        return to_unit(self.value(key), unit)

    def at(self, **values: int) -> Derivation:
        """The same derivation evaluated at other numbers (expressions unchanged).

        >>> d = derive("vit-b16", attention="sdpa").at(B=1)
        >>> d.numbers[d.free[0]]
        1
        """
        nums = dict(self.numbers)
        by_name = {s.name: s for s in self.free}
        for name, v in values.items():
            if name not in by_name:
                # Other symbols were replaced by their values when deriving (F = 4H, S from the image size),
                # so a new number for them would be silently ignored: derive again instead.
                raise SymmemError(f"{name!r} is not a symbol of this formula (it is in "
                                  f"{', '.join(sorted(by_name)) or 'no symbol'}); derive again with "
                                  f"values={{{name!r}: {v!r}}}")
            nums[by_name[name]] = _positive_int(name, v)
        return Derivation(self.model, self.convention, self.regime, self.terms, self.free, nums,
                          self.parameters, self.per_layer, self.layer, self.options)

    # -- views ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON contract (see the README)."""
        from .report.text import to_dict

        return to_dict(self)

    def table(self) -> str:
        """A readable text table in MiB/GiB."""
        from .report.text import table

        return table(self)

    def _repr_latex_(self) -> str:
        from .report.jupyter import latex

        return latex(self)

    def _repr_html_(self) -> str:
        from .report.jupyter import html

        return html(self)

    def __str__(self) -> str:
        return self.table()


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | sympy.Integer):
        raise SymmemError(f"{name} must be a positive integer, got {value!r}")
    if int(value) <= 0:
        raise SymmemError(f"{name} must be a positive integer, got {value}")
    return int(value)


def _category(data: Mapping[str, Any]) -> str:
    # Graph inputs (the batch, a loss target) are reported apart; so is what a loss appended by
    # symmem.loss keeps (its group is "loss").
    if data["kind"] == "input":
        return "input"
    return "loss" if data["group"] == "loss" else "activation"


def _node_terms(graph: nx.DiGraph, conv: Convention, options: Mapping[str, Any], act_dtype: str,
                nodes: list[str], per_layer: bool, branch: Mapping[sympy.Basic, bool] | None = None) -> list[Term]:
    terms: list[Term] = []
    storages: dict[str, list[tuple[str, str, Saved]]] = {}
    order: list[str] = []

    def size(spec: TensorSpec) -> sympy.Expr:
        return spec.numel * dtype_bytes(spec.dtype, act_dtype)

    for node in nodes:
        data = graph.nodes[node]
        count = sympy.Integer(1) if per_layer else data["count"]
        # Rules may depend on the regime's activation dtype (which attention kernel CUDA picks).
        for ref in conv.saved(graph, node, {**options, "activation_dtype": act_dtype, "branch": branch}):
            if ref.source == "new":
                spec = ref.spec
                assert spec is not None
                terms.append(Term(f"{node}.{ref.label}", data["group"],
                                  "loss" if data["group"] == "loss" else "activation", count * size(spec),
                                  ref.role or spec.role, node, spec.dtype, spec.numel, count))
                continue
            target = node if ref.source == "output" else data["inputs"][ref.index]
            if not conv.dedup:
                spec = graph.nodes[target]["out"]
                category = _category(graph.nodes[target])
                name = node if ref.source == "output" else f"{node}.{ref.label or 'input'}"
                terms.append(Term(name, data["group"], category, count * size(spec),
                                  ref.role or spec.role, node, spec.dtype, spec.numel, count))
                continue
            for storage, mode in _resolve(graph, target, per_layer, act_dtype, branch):
                if storage not in storages:
                    storages[storage] = []
                    order.append(storage)
                storages[storage].append((node, mode, ref))
    for storage in order:
        data = graph.nodes[storage]
        if data["kind"] in ("parameter", "buffer"):
            continue
        savers = storages[storage]
        spec = data["out"]
        if per_layer:
            count = sympy.Integer(1)
        else:
            count = _multiplicity(graph, storage, [(s, mode) for s, mode, _ in savers])
            if count == 0:
                continue
        category = _category(data)
        role = next((r.role for _, _, r in savers if r.role), None) or spec.role
        group = "input" if category == "input" else data["group"]
        terms.append(Term(storage, group, category, count * size(spec), role, storage, spec.dtype,
                          spec.numel, count))
    return terms


def derive(model: Model | str, convention: str | Convention = "paper", optimizer: str = "adamw",
           precision: str = "fp32", per_layer: bool = False, values: Mapping[str, int] | None = None,
           free: tuple[str, ...] | None = None, options: Mapping[str, Any] | None = None,
           checkpoint: str = "none", zero: int = 0, tensor_parallel: bool = False,
           sequence_parallel: bool = False, pipeline_parallel: bool = False, loss: str | None = None,
           **model_options: Any) -> Derivation:
    """Derive the training memory of ``model``.

    ``model`` is a :class:`~symmem.graph.Model` or a built-in name (``model_options`` go to its builder,
    e.g. ``attention="naive"``).  ``values`` override symbol values for evaluation (``{"B": 32}``);
    ``free`` names the symbols to keep in the formula (default: the model's).  ``options`` go to the
    convention (``{"device": "cpu"}``).  ``checkpoint`` (none, full, selective, every-K), ``zero`` (0-3) and
    the parallel flags set the training regime (see :mod:`symmem.regimes`; sizes N, t, p stay symbols).
    ``loss`` (``"cross-entropy"``) appends a loss after the model's output, as its own group; its kept tensors
    are the category ``loss``.
    """
    from . import branches, regimes
    from .models import build

    if isinstance(model, str):
        model = build(model, **model_options)
    elif model_options:
        raise SymmemError(f"builder options {sorted(model_options)} need a model name, not a built model")
    if loss is not None:
        from .loss import with_loss

        model = with_loss(model, loss)
    conv = get_convention(convention)
    regime = Regime(precision, optimizer, checkpoint, zero, tensor_parallel, sequence_parallel,
                    pipeline_parallel)
    conv_options = dict(conv.options)
    for key, v in (options or {}).items():
        if key not in conv_options:
            raise SymmemError(f"convention {conv.name!r} has no option {key!r}; it has "
                              f"{', '.join(sorted(conv_options)) or 'none'}")
        conv_options[key] = v

    by_name = {s.name: s for s in model.symbols + regimes.symbols(regime)}
    user: dict[sympy.Symbol, int] = {}
    for name, v in (values or {}).items():
        if name not in by_name:
            raise SymmemError(f"{model.name} has no symbol {name!r}; it has {', '.join(sorted(by_name))}"
                              + regimes.hint(name))
        user[by_name[name]] = _positive_int(name, v)
    if free is None:
        keep = set(model.free) | set(regimes.symbols(regime))
    else:
        unknown = [n for n in free if n not in by_name]
        if unknown:
            raise SymmemError(f"{model.name} has no symbol {unknown[0]!r}; it has {', '.join(sorted(by_name))}")
        keep = {by_name[n] for n in free}
    eff = _effective(model, user)
    for s in regimes.symbols(regime):
        eff.setdefault(s, sympy.Integer(regimes.DEFAULTS[s]))
    subs = _substitute_all(eff, keep)
    numbers = _numbers(model, eff)
    _check_assumptions(model, numbers)

    graph = model.graph
    layer = None
    nodes = list(nx.topological_sort(graph))
    if per_layer:
        layer = _pick_layer(model)
        nodes = [n for n in nodes if graph.nodes[n]["block"] == layer]
    # Views that copy for some sizes only (symmem.branches): the kept storages once per truth assignment.
    open_, decided = branches.conditions(graph, nodes, subs)
    results = []
    for branch in branches.assignments(open_, decided):
        act = _node_terms(graph, conv, conv_options, regime.activation_dtype, nodes, per_layer, branch)
        act = regimes.activations(graph, act, regime, regime.activation_dtype, per_layer, conv.dedup)
        act += conv.extra_terms(act, conv_options)
        results.append((branch, act))
    act = branches.merge(open_, results)
    shapes = []
    for n in nodes:
        c = sympy.Integer(1) if per_layer else graph.nodes[n]["count"]
        for shape in graph.nodes[n]["params"].values():
            shapes.append((c, shape))
    param_count = sympy.Add(*(c * sympy.Mul(*s) for c, s in shapes))
    par = regimes.parameters(regime, regimes.parameter_shapes(graph, nodes, regime, per_layer))
    terms = tuple(
        Term(t.name, t.group, t.category, t.expr.xreplace(subs), t.role, t.node, t.dtype,
             None if t.elements is None else t.elements.xreplace(subs), t.count.xreplace(subs))
        for t in act + par
    )
    kept = tuple(s for s in sorted(keep, key=lambda s: s.name) if any(
        s in t.expr.free_symbols for t in terms)) or tuple(sorted(keep, key=lambda s: s.name))
    return Derivation(model.name, conv.name, regime, terms, kept, numbers, param_count.xreplace(subs),
                      per_layer, layer, {**dict(model.options), **conv_options})


def _numbers(model: Model, eff: Mapping[sympy.Symbol, sympy.Expr]) -> dict[sympy.Symbol, int]:
    resolved = _substitute_all(eff, set())
    out: dict[sympy.Symbol, int] = {}
    for s, e in resolved.items():
        if e.is_number:
            if not (e.is_integer and e > 0):
                raise SymmemError(f"{s} evaluates to {e}, which is not a positive integer")
            out[s] = int(e)
    return out


def _check_assumptions(model: Model, numbers: Mapping[sympy.Symbol, int]) -> None:
    for node, lhs, rhs in model.graph.graph.get("assumptions", ()):
        # sympify: a bare symbol replaced by a Python int is an int, not a sympy number
        a, b = (sympy.sympify(e.xreplace(dict(numbers))) for e in (lhs, rhs))
        if a.is_number and b.is_number and a != b:
            kind = model.graph.nodes[node]["kind"]
            raise SymmemError(f"node {node!r} ({kind}): the shapes need {lhs} = {rhs}, but the values give "
                              f"{a} != {b}; set the symbols consistently")


def _pick_layer(model: Model) -> str:
    blocks = model.graph.graph.get("blocks", {})
    if model.layer is not None:
        return model.layer
    if len(blocks) == 1:
        return next(iter(blocks))
    if not blocks:
        raise SymmemError(f"{model.name} has no repeated layer, so there is no per-layer formula")
    raise SymmemError(f"{model.name} has several repeated blocks ({', '.join(blocks)}); no single layer")
