"""Graph + convention + training regime -> a :class:`~symmem.derivation.Derivation`.

:func:`derivation` is the core: a built :class:`~symmem.graph.Model`, a :class:`~symmem.conventions.Convention`
and a :class:`~symmem.training.Regime` value, with symbol values.  :func:`derive` is the front users and the
command line call: a model by name with its builder options, the regime's fields and the convention's options
as keywords.

>>> d = derive("vit-b16", convention="paper", attention="sdpa", per_layer=True)
>>> d.activations / 4
9*B*H*S
>>> round(derive("resnet50-v1", convention="paper").value("total") / 2**30, 4)
3.0246
>>> derive("resnet50-v1").convention                   # the default: what PyTorch autograd keeps
'pytorch'
>>> derive("resnet18", convention="pytorch", device="cpu").options["device"]
'cpu'
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import sympy

from .conventions import Convention
from .conventions import convention as get_convention
from .derivation import Derivation, Storage, positive_int
from .errors import NothingCounted, SymmemError
from .evaluator import Unsupported, interpret
from .graph import Model, parameter_count, paused_gc
from .passes import branches, regimes, saved
from .shapes import fmt, numel
from .tensor import MAX_SIZE
from .training import Regime

if TYPE_CHECKING:
    from .step import Step

#: The regime's fields, which :func:`derive` takes as keywords.
REGIME_FIELDS = tuple(f.name for f in dataclasses.fields(Regime))


def derive(model: Model | str, convention: str | Convention = "pytorch", regime: Regime | None = None,
           values: Mapping[str, int] | None = None, *, per_layer: bool = False,
           free: tuple[str, ...] | None = None, options: Mapping[str, Any] | None = None,
           loss: str | None = None, **keywords: Any) -> Derivation:
    """Derive the training memory of ``model``.

    ``model`` is a :class:`~symmem.graph.Model` or a built-in name.  Keywords are, by name: a field of the
    training regime (``optimizer``, ``precision``, ``checkpoint`` (none, full, selective, every-K), ``zero``
    (0-3), ``tensor_parallel`` ...; see :class:`~symmem.training.Regime`), an option of the convention
    (``device="cpu"``), or an option of the model's builder (``attention="naive"``).  ``regime`` gives the
    regime as one value instead.  ``values`` override symbol values for evaluation (``{"B": 32}``); ``free``
    names the symbols to keep in the formula (default: the model's).  ``options`` are convention options as
    a mapping.  ``loss`` (``"cross-entropy"``) appends a loss after the model's output, as its own group; its
    kept tensors are the category ``loss``.
    """
    model, conv, regime, conv_options = _setup(model, convention, regime, options, loss, keywords)
    return derivation(model, conv, regime, values, options=conv_options, per_layer=per_layer, free=free)


def _setup(model: Model | str, convention: str | Convention, regime: Regime | None,
           options: Mapping[str, Any] | None, loss: str | None, keywords: dict[str, Any]
           ) -> tuple[Model, Convention, Regime, dict[str, Any]]:
    """What :func:`derive`'s arguments name: the model (built, with its loss), the convention, the regime and
    the convention's options."""
    conv = get_convention(convention)
    regime_options = {k: keywords.pop(k) for k in REGIME_FIELDS if k in keywords}
    if regime is None:
        regime = Regime(**regime_options)
    elif not isinstance(regime, Regime):
        raise SymmemError(f"regime must be a symmem Regime, got {regime!r}; give optimizer=... as a keyword")
    elif regime_options:
        raise SymmemError(f"give the regime once: as regime=... or as {', '.join(sorted(regime_options))}")
    if options is not None and not isinstance(options, Mapping):
        raise SymmemError(f"options must map convention options to values, got {options!r}")
    conv_options = dict(options or {})
    conv_options.update({k: keywords.pop(k) for k in list(keywords) if k in conv.options})
    if isinstance(model, str):
        from .models import build

        model = build(model, **keywords)
    elif not isinstance(model, Model):
        raise SymmemError(f"model must be a built-in model's name or a symmem Model, got {type(model).__name__}")
    elif keywords:
        raise SymmemError(f"unknown options {sorted(keywords)}: not a regime field ({', '.join(REGIME_FIELDS)}), "
                          f"not an option of the {conv.name} convention, and builder options need a model name")
    if loss is not None:
        from .loss import with_loss

        model = with_loss(model, loss)
    return model, conv, regime, conv_options


class Acceptor:
    """``accepts(name, value)``: why the model refuses ``value`` for the symbol ``name`` (with ``values`` for the
    others), or None when it accepts it (see :func:`acceptor`).  ``model`` and ``convention`` are what it
    checks for."""

    def __init__(self, model: Model, convention: Convention, regime: Regime, values: Mapping[str, int]) -> None:
        self.model, self.convention, self.regime, self.values = model, convention, regime, dict(values)

    def __call__(self, name: str, value: int) -> str | None:
        try:  # _values names what to set instead of a size that follows from others (ViT's S)
            _values(self.model, self.regime, {**self.values, name: value})
        except SymmemError as exc:
            return str(exc)
        return None



def acceptor(model: Model | str, values: Mapping[str, int] | None = None, *, regime: Regime | None = None,
             loss: str | None = None, convention: str | Convention = "pytorch", **keywords: Any) -> Acceptor:
    """A function ``accepts(name, value)`` saying why the model refuses ``value`` for the symbol ``name`` (with
    ``values`` for the others), or None when it accepts it: the checks :func:`derive` makes of numbers, without
    deriving.  Arguments are :func:`derive`'s.  :func:`symmem.fit.largest` uses it to answer only with values
    the model accepts.

    >>> accepts = acceptor("gpt2")
    >>> accepts("h", 12) is None
    True
    >>> print(accepts("h", 13))
    node 'h.attn.query_split' (reshape): needs h to divide H (Mod(H, h) = 0), which fails at H=768, h=13; ...
    """
    model, conv, regime, _ = _setup(model, convention, regime, None, loss, dict(keywords))
    if values is not None and not isinstance(values, Mapping):
        raise SymmemError(f"values must map symbol names to positive integers ({{'B': 32}}), got {values!r}")
    return Acceptor(model, conv, regime, values or {})


def _values(model: Model, regime: Regime, values: Mapping[str, int] | None
            ) -> tuple[dict[str, sympy.Symbol], dict[sympy.Symbol, sympy.Expr], dict[sympy.Symbol, int]]:
    """Check ``values`` the way :func:`derivation` does: (symbols by name, every symbol's value or expression,
    the symbols that have numbers).  One place checks every value: names, positive integers within PyTorch's
    sizes, the model's assumptions, the regime's requirements and every size of every tensor."""
    by_name = {s.name: s for s in model.symbols + regimes.symbols(regime)}
    if values is not None and not isinstance(values, Mapping):
        raise SymmemError(f"values must map symbol names to positive integers ({{'B': 32}}), got {values!r}")
    user: dict[sympy.Symbol, int] = {}
    for name, v in (values or {}).items():
        if name not in by_name:
            raise SymmemError(f"{model.name} has no symbol {name!r}; it has {', '.join(sorted(by_name))}"
                              + regimes.hint(name))
        user[by_name[name]] = positive_int(name, v)
    eff = _effective(model, user)
    required = regimes.requirements(model.graph, model.symbols, regime)
    for s in regimes.symbols(regime):
        if s in user:
            continue
        # A regime size nobody set takes its default (t = 8 ...) or, where the model refuses that (ViT-B's 12
        # heads over t = 8), the largest halving of it the model accepts (t = 4).
        for candidate in _halvings(regimes.DEFAULTS[s]):
            eff[s] = sympy.Integer(candidate)
            try:
                _check_assumptions(model, _numbers(eff), [r for r in required if s in r[1].free_symbols])
                break
            except SymmemError:
                continue
        else:
            eff[s] = sympy.Integer(regimes.DEFAULTS[s])
    numbers = _numbers(eff)
    try:
        _check_assumptions(model, numbers, required)
        _check_sizes(model, numbers)
    except SymmemError as exc:
        tied = [(s, model.defaults[s]) for s in user
                if s in model.defaults and model.defaults[s].free_symbols and s.name in str(exc)]
        if not tied:
            raise
        # a size set by hand that the model derives from others (ViT's S from the image): name what to set
        s, default = tied[0]
        sources = sorted(str(x) for x in default.free_symbols)
        raise SymmemError(f"{s} follows from {', '.join(sources)} (its default is {default}): set "
                          f"{' and '.join(sources)} instead of {s}; {exc}") from None
    return by_name, eff, numbers


def _halvings(n: int) -> list[int]:
    """``n``, ``n // 2``, ... down to 1.

    >>> _halvings(8)
    [8, 4, 2, 1]
    """
    out = [n]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def derivation(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None = None,
               *, options: Mapping[str, Any] | None = None, per_layer: bool = False,
               free: tuple[str, ...] | None = None) -> Derivation:
    """The core: the storages ``convention`` keeps for ``model`` under ``regime``, with their lifetimes."""
    with paused_gc():
        return _derivation(model, convention, regime, values, options=options, per_layer=per_layer, free=free)


def _derivation(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None = None,
                *, options: Mapping[str, Any] | None = None, per_layer: bool = False,
                free: tuple[str, ...] | None = None) -> Derivation:
    conv = convention
    conv_options = dict(conv.options)
    for key, v in (options or {}).items():
        if key not in conv_options:
            raise SymmemError(f"convention {conv.name!r} has no option {key!r}; it has "
                              f"{', '.join(sorted(conv_options)) or 'none'}")
        conv_options[key] = v

    if isinstance(free, str) or (free is not None and not all(isinstance(n, str) for n in free)):
        raise SymmemError(f"free must be a tuple of symbol names (('B', 'S')), got {free!r}")
    by_name, eff, numbers = _values(model, regime, values)
    if free is None:
        keep = set(model.free) | set(regimes.symbols(regime))
    else:
        unknown = [n for n in free if n not in by_name]
        if unknown:
            raise SymmemError(f"{model.name} has no symbol {unknown[0]!r}; it has {', '.join(sorted(by_name))}")
        keep = {by_name[n] for n in free}
    subs = _substitute_all(eff, keep)

    graph = model.graph
    layer = None
    nodes = list(graph.order())
    if per_layer:
        layer = _pick_layer(model)
        nodes = [n for n in nodes if graph.node(n).block == layer]
    act_dtype = regime.activation_dtype
    # Views that copy for some sizes only (symmem.branches): the kept storages per truth assignment of the
    # conditions that interact, merged into Piecewise expressions.
    open_, decided = branches.conditions(graph, nodes, subs)

    def run(branch: Mapping[sympy.Basic, bool]) -> list[Storage]:
        kept = saved.kept(graph, conv, conv_options, act_dtype, nodes, per_layer, branch)
        kept = regimes.activations(graph, kept, regime, act_dtype, per_layer, conv.dedup)
        return kept + conv.extra_storages(kept, conv_options)

    storages = _in_graph_order(graph, branches.combine(graph, nodes, open_, decided, run))
    storages += regimes.parameters(graph, nodes, regime, per_layer)
    if subs:
        done: dict[sympy.Expr, sympy.Expr] = {}  # storages repeat their expressions: substitute each once
        storages = [_substituted(s, subs, done) for s in storages]
    step = None
    if not per_layer and type(conv).grads is not Convention.grads:
        step = _step(model, conv, conv_options, regime, subs, open_, decided, numbers)
    param_count = parameter_count(graph, nodes, per_layer)
    kept_symbols = tuple(s for s in sorted(keep, key=lambda s: s.name) if any(
        s in x.expr.free_symbols for x in storages)) or tuple(sorted(keep, key=lambda s: s.name))
    base = {x for x, e in eff.items() if e.is_number}
    resolved = _substitute_all(eff, base)
    tied = {x: resolved[x] for x in kept_symbols if x in resolved and resolved[x].free_symbols}
    domain = model.graph.graph.get("domain", sympy.true)
    notes: tuple[str, ...] = ()
    why = None if any(s.category == "activation" and s.expr != 0 for s in storages) else conv.finds_nothing(graph)
    if why is not None:
        # a 0 that means "this convention cannot see the graph", not "nothing is kept": say so wherever it shows
        notes = (f"{model.name}: {why}",)
        warnings.warn(notes[0], NothingCounted, stacklevel=4)
    return Derivation(model.name, conv.name, regime, tuple(storages), kept_symbols, numbers,
                      param_count.xreplace(subs), per_layer, layer, {**dict(model.options), **conv_options}, step,
                      domain.xreplace(subs) if isinstance(domain, sympy.Basic) else domain, notes, tied)


def _in_graph_order(graph: Any, storages: list[Storage]) -> list[Storage]:
    """Storages in the order their nodes run (a node's own output before what it saves beside it), so that
    every view lists them as the model reads; conventions append their extras wherever they find them."""
    index = {n: i for i, n in enumerate(graph.order())}

    def key(s: Storage) -> tuple[int, bool]:
        return index.get(s.node, -1 if s.category == "input" else len(index)), s.name != s.node

    return sorted(storages, key=key)


#: Up to this many size conditions (a view that copies unless a size is 1) the peak is one formula over every
#: truth assignment (2**k steps); beyond, it is the step of the assignment the numbers select, and its domain
#: says where that holds (other numbers derive that step's own formula).
PEAK_CONDITIONS = 3


def _step(model: Model, conv: Convention, options: Mapping[str, Any], regime: Regime,
          subs: Mapping[sympy.Symbol, sympy.Expr], open_: list, decided: Mapping[sympy.Basic, bool],
          numbers: Mapping[sympy.Symbol, int]) -> Step:
    """The training step of the built graph (its peak computed on first use, once per derivation and its ``at``
    copies)."""
    from .passes.step import GraphStep

    return GraphStep(model.graph, conv, options, regime, subs, open_, decided, numbers,
                     every=len(open_) <= PEAK_CONDITIONS)


def _substituted(s: Storage, subs: Mapping[sympy.Symbol, sympy.Expr], done: dict[sympy.Expr, sympy.Expr]
                 ) -> Storage:
    def sub(e: sympy.Expr) -> sympy.Expr:
        found = done.get(e)
        if found is None:
            found = done[e] = e.xreplace(subs)
        return found

    expr, count, shards = sub(s.expr), sub(s.count), sub(s.shards)
    elements = None if s.elements is None else sub(s.elements)
    if expr is s.expr and count is s.count and shards is s.shards and elements is s.elements:
        return s
    return s.with_(expr=expr, count=count, shards=shards, elements=elements)


def _effective(model: Model, values: Mapping[sympy.Symbol, int]) -> dict[sympy.Symbol, sympy.Expr]:
    eff = dict(model.defaults)
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


def _numbers(eff: Mapping[sympy.Symbol, sympy.Expr]) -> dict[sympy.Symbol, int]:
    resolved = _substitute_all(eff, set())
    out: dict[sympy.Symbol, int] = {}
    for s, e in resolved.items():
        if e.is_number:
            if not (e.is_integer and e > 0):
                raise SymmemError(f"{s} evaluates to {e}, which is not a positive integer")
            out[s] = positive_int(str(s), int(e))  # defaults too stay within PyTorch's sizes
    return out


def _given(exprs: tuple[sympy.Basic, ...], numbers: Mapping[sympy.Symbol, int]) -> str:
    """The values of the symbols in ``exprs``, for a message: ``H=768, h=5``."""
    syms = sorted(set().union(*(e.free_symbols for e in exprs)), key=lambda x: x.name)
    return ", ".join(f"{x}={numbers[x]}" for x in syms if x in numbers)


def _describe(cond: sympy.Basic) -> str:
    """A condition as a person writes it: ``h divides H`` for ``Eq(Mod(H, h), 0)``."""
    if isinstance(cond, sympy.Eq) and cond.rhs == 0 and isinstance(cond.lhs, sympy.Mod):
        return f"{cond.lhs.args[1]} to divide {cond.lhs.args[0]} ({cond.lhs} = 0)"
    return str(cond)


def _check_assumptions(model: Model, numbers: Mapping[sympy.Symbol, int],
                       requirements: Sequence[tuple[str, sympy.Basic, sympy.Basic | None]] = ()) -> None:
    """Every assumption of the graph (``(node, lhs, rhs)``: lhs = rhs; ``(node, condition, None)``) and every
    requirement of the regime, checked at the numbers: a :class:`SymmemError` names the node and the values."""
    graph = model.graph
    subs = dict(numbers)
    for node, lhs, rhs in [*graph.assumptions, *requirements]:
        kind = graph.node(node).kind if node in graph else "regime"
        if rhs is None:
            # sympify: a bare symbol replaced by a Python int is an int, not a sympy number
            verdict = sympy.sympify(lhs.xreplace(subs), strict=True)
            if verdict is sympy.false:
                raise SymmemError(f"node {node!r} ({kind}): needs {_describe(lhs)}, which fails at "
                                  f"{_given((lhs,), numbers)}; set the symbols consistently")
            continue
        if isinstance(lhs, sympy.Mod) and rhs == 0:
            verdict = sympy.sympify(sympy.Eq(lhs, 0).xreplace(subs), strict=True)
            if verdict is sympy.false:
                raise SymmemError(f"node {node!r} ({kind}): needs {_describe(sympy.Eq(lhs, 0))}, which fails at "
                                  f"{_given((lhs,), numbers)}; set the symbols consistently")
            continue
        a, b = _number(lhs, numbers), _number(rhs, numbers)
        if a is None or b is None:
            a, b = (sympy.sympify(e.xreplace(subs), strict=True) for e in (lhs, rhs))
            if not (a.is_number and b.is_number):
                continue
        if a != b:
            raise SymmemError(f"node {node!r} ({kind}): the shapes need {lhs} = {rhs}, but "
                              f"{_given((lhs, rhs), numbers)} give {a} != {b}; set the symbols consistently")


def _check_sizes(model: Model, numbers: Mapping[sympy.Symbol, int]) -> None:
    """Every size of every tensor, parameter and repeat count must be a positive integer at the numbers: an image
    too small for the network, heads that do not divide the hidden size or a slice past its end is an error
    naming the node, not a formula with a zero, negative or fractional size."""
    graph = model.graph
    subs = dict(numbers)
    known = set(numbers)
    verdicts: dict[sympy.Expr, Any] = {}
    elements: dict[sympy.Expr, int] = {}

    def bad(d: sympy.Expr) -> Any:
        if d not in verdicts:
            v: Any = None
            if d.free_symbols <= known:
                v = _number(d, numbers)
                if v is None:
                    v = sympy.sympify(d.xreplace(subs), strict=True)
                    v = None if v.is_integer and v > 0 else v
                elif isinstance(v, int | Fraction) and v == int(v) and v > 0:
                    v = None
            verdicts[d] = v
        return verdicts[d]

    for name in graph.order():
        node = graph.node(name)
        shapes = [("output", node.out.shape), *((f"parameter {p!r}", s) for p, s in node.params.items())]
        for what, shape in shapes:
            for d in shape:
                if d.is_Integer or d.is_Symbol:
                    continue
                v = bad(d)
                if v is not None and v == 0 and d.has(sympy.Piecewise):
                    continue  # a storage that exists for some sizes only (a traced module's size-one branch)
                if v is not None:
                    small = isinstance(v, int | Fraction) or getattr(v, "is_number", False)
                    hint = (" (the input is too small for this op)" if small and v <= 0
                            else " (a size that does not divide, such as heads that do not divide the hidden size)")
                    raise SymmemError(f"node {name!r} ({node.kind}): its {what} {fmt(shape)} has a size {d} = {v} "
                                      f"at {_given((d,), numbers)}, not a positive integer{hint}")
            n = numel(shape)
            if n not in elements:
                found = _number(n, numbers) if n.free_symbols <= known else 0
                if found is None:
                    found = sympy.sympify(n.xreplace(subs), strict=True)
                elements[n] = int(found)
            if elements[n] > MAX_SIZE:
                raise SymmemError(f"node {name!r} ({node.kind}): its {what} {fmt(shape)} holds {elements[n]:,} "
                                  f"elements at {_given((n,), numbers) or 'these sizes'}, more than PyTorch allows in "
                                  "one tensor (2**63 - 1)")
        if node.count != 1 and bad(node.count) is not None:
            raise SymmemError(f"node {name!r} ({node.kind}): its block is repeated {node.count} = "
                              f"{bad(node.count)} times at {_given((node.count,), numbers)}, not a positive number "
                              "of times")


def _number(e: sympy.Expr, numbers: Mapping[sympy.Symbol, int]) -> Any:
    """``e`` at ``numbers``, exactly, without building sympy objects; None when a symbol has no number or ``e``
    has a part the interpreter does not know (then sympy decides)."""
    if not e.free_symbols <= numbers.keys():
        return None
    try:
        return interpret(e, numbers)
    except (Unsupported, ZeroDivisionError, TypeError):
        return None


def _pick_layer(model: Model) -> str:
    blocks = model.graph.blocks
    if model.layer is not None:
        return model.layer
    if len(blocks) == 1:
        return next(iter(blocks))
    if not blocks:
        raise SymmemError(f"{model.name} has no repeated layer, so there is no per-layer formula")
    raise SymmemError(f"{model.name} has several repeated blocks ({', '.join(blocks)}); no single layer")
