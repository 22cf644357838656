"""Graph + convention + training regime -> a :class:`~symmem.derivation.Derivation`.

:func:`derivation` is the core: a built :class:`~symmem.graph.Model`, a :class:`~symmem.conventions.Convention`
and a :class:`~symmem.training.Regime` value, with symbol values.  :func:`derive` is the front users and the
command line call: a model by name with its builder options, the regime's fields and the convention's options
as keywords.

>>> d = derive("vit-b16", convention="paper", attention="sdpa", per_layer=True)
>>> d.activations / 4
9*B*H*S
>>> d = derive("resnet50-v1")
>>> round(d.value("total") / 2**30, 4)
3.0246
>>> derive("resnet18", convention="pytorch", device="cpu").options["device"]
'cpu'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import sympy

from .conventions import Convention
from .conventions import convention as get_convention
from .derivation import Derivation, Storage, positive_int
from .errors import SymmemError
from .evaluator import Unsupported, interpret
from .graph import Model, parameter_count, paused_gc
from .passes import branches, regimes, saved
from .training import Regime

#: The regime's fields, which :func:`derive` takes as keywords.
REGIME_FIELDS = tuple(f.name for f in dataclasses.fields(Regime))


def derive(model: Model | str, convention: str | Convention = "paper", regime: Regime | None = None,
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
    conv = get_convention(convention)
    regime_options = {k: keywords.pop(k) for k in REGIME_FIELDS if k in keywords}
    if regime is None:
        regime = Regime(**regime_options)
    elif not isinstance(regime, Regime):
        raise SymmemError(f"regime must be a symmem Regime, got {regime!r}; give optimizer=... as a keyword")
    elif regime_options:
        raise SymmemError(f"give the regime once: as regime=... or as {', '.join(sorted(regime_options))}")
    conv_options = dict(options or {})
    conv_options.update({k: keywords.pop(k) for k in list(keywords) if k in conv.options})
    if isinstance(model, str):
        from .models import build

        model = build(model, **keywords)
    elif keywords:
        raise SymmemError(f"unknown options {sorted(keywords)}: not a regime field ({', '.join(REGIME_FIELDS)}), "
                          f"not an option of the {conv.name} convention, and builder options need a model name")
    if loss is not None:
        from .loss import with_loss

        model = with_loss(model, loss)
    return derivation(model, conv, regime, values, options=conv_options, per_layer=per_layer, free=free)


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

    by_name = {s.name: s for s in model.symbols + regimes.symbols(regime)}
    user: dict[sympy.Symbol, int] = {}
    for name, v in (values or {}).items():
        if name not in by_name:
            raise SymmemError(f"{model.name} has no symbol {name!r}; it has {', '.join(sorted(by_name))}"
                              + regimes.hint(name))
        user[by_name[name]] = positive_int(name, v)
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
    numbers = _numbers(eff)
    _check_assumptions(model, numbers)

    graph = model.graph
    layer = None
    nodes = list(graph.order())
    if per_layer:
        layer = _pick_layer(model)
        nodes = [n for n in nodes if graph.node(n).block == layer]
    act_dtype = regime.activation_dtype
    # Views that copy for some sizes only (symmem.branches): the kept storages once per truth assignment.
    open_, decided = branches.conditions(graph, nodes, subs)
    results = []
    for branch in branches.assignments(open_, decided):
        kept = saved.kept(graph, conv, conv_options, act_dtype, nodes, per_layer, branch)
        kept = regimes.activations(graph, kept, regime, act_dtype, per_layer, conv.dedup)
        kept += conv.extra_storages(kept, conv_options)
        results.append((branch, kept))
    storages = branches.merge(open_, results) + regimes.parameters(graph, nodes, regime, per_layer)
    if subs:
        done: dict[sympy.Expr, sympy.Expr] = {}  # storages repeat their expressions: substitute each once
        storages = [_substituted(s, subs, done) for s in storages]
    step = None
    if not per_layer and type(conv).grads is not Convention.grads:
        step = _step(model, conv, conv_options, regime, subs, open_, [b for b, _ in results], numbers)
    param_count = parameter_count(graph, nodes, per_layer)
    kept_symbols = tuple(s for s in sorted(keep, key=lambda s: s.name) if any(
        s in x.expr.free_symbols for x in storages)) or tuple(sorted(keep, key=lambda s: s.name))
    domain = model.graph.graph.get("domain", sympy.true)
    return Derivation(model.name, conv.name, regime, tuple(storages), kept_symbols, numbers,
                      param_count.xreplace(subs), per_layer, layer, {**dict(model.options), **conv_options}, step,
                      domain.xreplace(subs) if isinstance(domain, sympy.Basic) else domain)


def _step(model: Model, conv: Convention, options: Mapping[str, Any], regime: Regime,
          subs: Mapping[sympy.Symbol, sympy.Expr], open_: list, assignments: list,
          numbers: Mapping[sympy.Symbol, int]) -> Any:
    """The peak of the training step, computed on first use (once per derivation and its ``at`` copies)."""
    from .passes import peak

    cache: dict[Any, Any] = {}

    def compute(at: Mapping[sympy.Symbol, int] | None = None, timeline: str | None = None) -> Any:
        # ``at``: numbers for the layer counts, when they lie outside the symbolic formula's domain;
        # ``timeline`` ("first" or "steady"): the step written out at ``at`` (every symbol a number), op by op
        if timeline is not None:
            assert at is not None
            if timeline.startswith("allocated"):
                return peak.allocated(model.graph, conv, options, regime, subs, at, assignments,
                                      timeline.endswith("first"))
            return peak.timeline(model.graph, conv, options, regime, subs, at, assignments, timeline == "first")
        key = None if at is None else tuple(sorted((s.name, v) for s, v in at.items()))
        if key not in cache:
            fixed = dict(subs)
            if at is not None:
                fixed.update({s: sympy.Integer(v) for s, v in at.items()})
            join = branches.joiner(open_, assignments) if len(assignments) > 1 else None
            cache[key] = peak.peak(model.graph, conv, options, regime, fixed, assignments, join, numbers)
        return cache[key]

    return compute


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
            out[s] = int(e)
    return out


def _check_assumptions(model: Model, numbers: Mapping[sympy.Symbol, int]) -> None:
    for node, lhs, rhs in model.graph.assumptions:
        a, b = _number(lhs, numbers), _number(rhs, numbers)
        if a is None or b is None:
            # sympify: a bare symbol replaced by a Python int is an int, not a sympy number
            a, b = (sympy.sympify(e.xreplace(dict(numbers))) for e in (lhs, rhs))
            if not (a.is_number and b.is_number):
                continue
        if a != b:
            kind = model.graph.node(node).kind
            raise SymmemError(f"node {node!r} ({kind}): the shapes need {lhs} = {rhs}, but the values give "
                              f"{a} != {b}; set the symbols consistently")


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
