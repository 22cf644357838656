"""The core path: a built graph under a convention -> a :class:`~symmem.ledger.Ledger`, and any ledger + training
regime -> a :class:`~symmem.derivation.Derivation`.

:func:`ledger_of` is the graph's front: a built :class:`~symmem.graph.Model`, a
:class:`~symmem.conventions.Convention` and a :class:`~symmem.training.Regime` value, with symbol values, give the
storages the convention keeps (the regime's activation side applied) and the graph's parameters.
:func:`derivation_of` is the one back half every front shares: the parameter side, the substitution of the
symbols that are not kept, and the :class:`~symmem.derivation.Derivation` with its training step.
:func:`derivation` is both, for a built graph.  The fronts users call (``derive`` by name, ``trace``, ``show``)
are :mod:`symmem.api`; the checks of every number against what a front holds (:func:`symbol_values`) are here.

>>> from symmem.conventions import convention
>>> from symmem.models import build
>>> d = derivation(build("vit-b16", attention="sdpa"), convention("paper"), Regime(), per_layer=True)
>>> d.activations / 4
9*B*H*S
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Protocol

import sympy

from .conventions import Convention
from .derivation import Derivation, Storage, positive_int
from .errors import NothingCounted, SymmemError
from .evaluator import NotCompilable, exactly, interpret
from .graph import Model, parameter_shapes, paused_gc
from .ledger import Ledger, Parameter
from .passes import branches, regimes, saved
from .shapes import fmt, numel
from .tensor import MAX_SIZE
from .training import Regime

if TYPE_CHECKING:
    from .step import Step

#: One thing whose sizes a front checks: (node, op kind, [(what, shape)], how many times it is repeated).
Sized = tuple[str, str, Sequence[tuple[str, tuple[sympy.Expr, ...]]], sympy.Expr]


class Sizes(Protocol):
    """What a front's numbers are checked against (:func:`symbol_values`): the symbols and their defaults, the
    assumptions the sizes need, what the regime needs, and every size that must be a positive integer."""

    name: str
    defaults: Mapping[sympy.Symbol, sympy.Expr]
    free: tuple[sympy.Symbol, ...]

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]: ...

    def assumptions(self) -> Sequence[tuple[str, sympy.Basic, sympy.Basic | None]]: ...

    def requirements(self, regime: Regime) -> list[tuple[str, sympy.Basic, None]]: ...

    def kind(self, node: str) -> str: ...

    def sized(self) -> Iterable[Sized]: ...


class GraphSizes:
    """:class:`Sizes` of a built model: its graph's nodes, assumptions and repeated blocks."""

    def __init__(self, model: Model) -> None:
        self.model, self.name, self.defaults, self.free = model, model.name, model.defaults, model.free

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        return self.model.symbols

    def assumptions(self) -> Sequence[tuple[str, sympy.Basic, sympy.Basic | None]]:
        return self.model.graph.assumptions

    def requirements(self, regime: Regime) -> list[tuple[str, sympy.Basic, None]]:
        return regimes.requirements(self.model.graph, self.model.symbols, regime)

    def kind(self, node: str) -> str:
        graph = self.model.graph
        return graph.node(node).kind if node in graph else "regime"

    def sized(self) -> Iterable[Sized]:
        graph = self.model.graph
        for name in graph.order():
            node = graph.node(name)
            yield (name, node.kind, [("output", node.out.shape), *((f"parameter {p!r}", s)
                                                                   for p, s in node.params.items())], node.count)


class Acceptor:
    """``accepts(name, value)``: why the model refuses ``value`` for the symbol ``name`` (with ``values`` for the
    others), or None when it accepts it (see :func:`symmem.api.acceptor`).  ``model`` and ``convention`` are what
    it checks for."""

    def __init__(self, model: Model, convention: Convention, regime: Regime, values: Mapping[str, int]) -> None:
        self.model, self.convention, self.regime, self.values = model, convention, regime, dict(values)

    def __call__(self, name: str, value: int) -> str | None:
        try:  # _values names what to set instead of a size that follows from others (ViT's S)
            _values(GraphSizes(self.model), self.regime, {**self.values, name: value})
        except SymmemError as exc:
            return str(exc)
        return None


def symbol_values(sizes: Sizes, regime: Regime, values: Mapping[str, int] | None, free: tuple[str, ...] | None
                  ) -> tuple[set[sympy.Symbol], dict[sympy.Symbol, sympy.Expr], dict[sympy.Symbol, int]]:
    """The symbols formulas keep (``free`` by name; default: the front's and the regime's), every symbol's value
    or expression, and the symbols that have numbers, every number checked (:func:`_values`)."""
    if isinstance(free, str) or (free is not None and not all(isinstance(n, str) for n in free)):
        raise SymmemError(f"free must be a tuple of symbol names (('B', 'S')), got {free!r}")
    by_name, eff, numbers = _values(sizes, regime, values)
    if free is None:
        keep = set(sizes.free) | set(regimes.symbols(regime))
    else:
        unknown = [n for n in free if n not in by_name]
        if unknown:
            raise SymmemError(f"{sizes.name} has no symbol {unknown[0]!r}; it has {', '.join(sorted(by_name))}")
        keep = {by_name[n] for n in free}
    return keep, eff, numbers


def _values(sizes: Sizes, regime: Regime, values: Mapping[str, int] | None
            ) -> tuple[dict[str, sympy.Symbol], dict[sympy.Symbol, sympy.Expr], dict[sympy.Symbol, int]]:
    """Check ``values`` the way :func:`derivation` does: (symbols by name, every symbol's value or expression,
    the symbols that have numbers).  One place checks every value: names, positive integers within PyTorch's
    sizes, the model's assumptions, the regime's requirements and every size of every tensor."""
    by_name = {s.name: s for s in sizes.symbols + regimes.symbols(regime)}
    if values is not None and not isinstance(values, Mapping):
        raise SymmemError(f"values must map symbol names to positive integers ({{'B': 32}}), got {values!r}")
    user: dict[sympy.Symbol, int] = {}
    for name, v in (values or {}).items():
        if name not in by_name:
            raise SymmemError(f"{sizes.name} has no symbol {name!r}; it has {', '.join(sorted(by_name))}"
                              + regimes.hint(name))
        user[by_name[name]] = positive_int(name, v)
    eff = _effective(sizes.defaults, user)
    required = sizes.requirements(regime)
    for s in regimes.symbols(regime):
        if s in user:
            continue
        # A regime size nobody set takes its default (t = 8 ...) or, where the model refuses that (ViT-B's 12
        # heads over t = 8), the largest halving of it the model accepts (t = 4).
        for candidate in _halvings(regimes.DEFAULTS[s]):
            eff[s] = sympy.Integer(candidate)
            try:
                _check_assumptions(sizes, _numbers(eff), [r for r in required if s in r[1].free_symbols])
                break
            except SymmemError:
                continue
        else:
            eff[s] = sympy.Integer(regimes.DEFAULTS[s])
    numbers = _numbers(eff)
    try:
        _check_assumptions(sizes, numbers, required)
        _check_sizes(sizes, numbers)
    except SymmemError as exc:
        tied = [(s, sizes.defaults[s]) for s in user
                if s in sizes.defaults and sizes.defaults[s].free_symbols and s.name in str(exc)]
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
    """The core path of a built graph: its ledger under ``convention`` and ``regime`` (:func:`ledger_of`), with
    the peak of its training step where the convention models the step, through the back half
    (:func:`derivation_of`)."""
    with paused_gc():
        return _derivation(model, convention, regime, values, options=options, per_layer=per_layer, free=free)


def _derivation(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None = None,
                *, options: Mapping[str, Any] | None = None, per_layer: bool = False,
                free: tuple[str, ...] | None = None) -> Derivation:
    # a pipeline's stages are cut from the single-device derivation, whose front keeps the same storages before
    # the regime's activation side: what the convention keeps is worked out once for both (_single)
    kept: dict[Any, list[Storage]] | None = {} if regime.pipeline_parallel and not per_layer else None
    front = _front(model, convention, regime, values, options, per_layer, free, kept)
    step = None
    if not per_layer and type(convention).grads is not Convention.grads:
        if regime.pipeline_parallel and not (regime.tensor_parallel or regime.zero):
            step = _pipeline_step(model, convention, regime, values, options, free, front.ledger.numbers, kept)
        elif regime.tensor_parallel and regime.data_parallel and regime.pipeline_parallel:
            step = _tensor_pipeline_step(model, convention, regime, values, options, front.ledger.numbers, kept)
        elif regime.tensor_parallel and regime.data_parallel:
            step = _mesh_step(model, convention, regime, values, options, front.ledger.numbers)
        elif regime.tensor_parallel and regime.pipeline_parallel:
            step = _tensor_pipeline_step(model, convention, regime, values, options, front.ledger.numbers, kept)
        elif regime.tensor_parallel:
            step = _tensor_step(model, convention, regime, values, options, front.ledger.numbers)
        else:
            step = _step(model, convention, front.options, regime, front.subs, front.open, front.decided,
                         front.ledger.numbers)
    return derivation_of(front.ledger, regime, step)


def _pipeline_step(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None,
                   options: Mapping[str, Any] | None, free: tuple[str, ...] | None,
                   numbers: Mapping[sympy.Symbol, int], kept: dict[Any, list[Storage]] | None = None) -> Step:
    """The step of ``model`` split into pipeline stages: the largest stage's peak, cut from the single-device
    derivation (:mod:`symmem.passes.pipeline_step`)."""
    from dataclasses import replace

    from .passes.pipeline_step import PipelineStep

    one = replace(regime, pipeline_parallel=False, pipeline_schedule="1f1b", micro_batches=1, data_parallel=None)
    dropped = ("p", "N") if regime.data_parallel else ("p",)
    single = _single(model, convention, one, {k: v for k, v in (values or {}).items() if k not in dropped},
                     options, None if free is None else tuple(f for f in free if f not in dropped), kept)
    resolved = {k: single.options[k] for k in convention.options if k in single.options}
    if regime.data_parallel:  # an engine on every stage of a p x N mesh: DDP / ZeRO-1 or FSDP2
        from .passes.fsdp_pipeline import refusal
        from .step import Refused

        ddp = regime.data_parallel in ("ddp", "zero-redundancy", "ddp-bucket-view")
        if ddp:  # passes/ddp_pipeline.py
            from .passes.ddp_pipeline import DdpPipelineStep as Meshed
            engine = {"zero": regime.data_parallel == "zero-redundancy",
                      "view": regime.data_parallel == "ddp-bucket-view"}
        else:  # passes/fsdp_pipeline.py
            from .passes.fsdp_pipeline import FsdpPipelineStep as Meshed  # type: ignore[assignment]
            engine = {"reshard": regime.data_parallel == "fsdp"}
        device = str(single.options.get("device", "cpu"))
        why = refusal(model.name, regime, device, "DDP" if ddp else "FSDP")
        if why is not None:
            return Refused(f"no peak: {why}")
        if not ddp and device == "cuda" and one.optimizer_impl == "auto":
            one = replace(one, optimizer_impl="foreach")  # AdamW's default over FSDP2's CUDA DTensors (measured)
        return Meshed(model.graph, convention, resolved, one, single.storages, dict(numbers),
                      regime.pipeline_schedule, regime.micro_batches, **engine)
    return PipelineStep(model.graph, convention, resolved, one, single.storages, dict(numbers),
                        regime.pipeline_schedule, regime.micro_batches)


def _single(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None,
            options: Mapping[str, Any] | None, free: tuple[str, ...] | None = None,
            kept: dict[Any, list[Storage]] | None = None) -> Derivation:
    """The single-device derivation a pipeline's stages are cut from: its storages and options only, so without
    the training step a derivation has (the stages replay their own; making one imported the single-device
    peak's modules, unused).  ``kept``: what the convention keeps per branch, shared with the pipeline
    regime's own front (:func:`_front`)."""
    return derivation_of(_front(model, convention, regime, values, options, False, free, kept).ledger, regime)


def _tensor_step(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None,
                 options: Mapping[str, Any] | None, numbers: Mapping[sympy.Symbol, int]) -> Step:
    """The step of one tensor-parallel rank under DTensor's standard plan, worked out from the single-device
    derivation (:mod:`symmem.passes.tensor_step`); refused, saying why, where it is not modelled."""
    from .passes.tensor_step import TensorStep, refusal, storages_rank

    found = _rank_single(model, convention, regime, values, options, refusal)
    if not isinstance(found, tuple):
        return found
    one, single, resolved = found
    return TensorStep(storages_rank(model.graph, single.storages, one, regime.sequence_parallel), dict(numbers),
                      model.graph, convention, resolved, one, regime.sequence_parallel)


def _tensor_pipeline_step(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None,
                          options: Mapping[str, Any] | None, numbers: Mapping[sympy.Symbol, int],
                          kept: dict[Any, list[Storage]] | None = None) -> Step:
    """The step of every rank of a p x t mesh (DTensor's standard plan on every pipeline stage), replayed from the
    single-device step (:mod:`symmem.passes.tensor_pipeline`); refused, saying why, where it is not modelled."""
    from dataclasses import replace

    from .passes.tensor_pipeline import TensorPipelineStep, refusal
    from .step import Refused

    graph = model.graph
    loss = "cross-entropy" if any(graph.node(n).group == "loss" for n in graph.program_order()) else None
    one = replace(regime, tensor_parallel=False, sequence_parallel=False, pipeline_parallel=False,
                  pipeline_schedule="1f1b", micro_batches=1, data_parallel=None)
    single = _single(model, convention, one, {k: v for k, v in (values or {}).items() if k not in ("t", "p", "N")},
                     options, None, kept)
    device = str(single.options.get("device", "cpu"))
    resolved = {k: single.options[k] for k in convention.options if k in single.options}
    if regime.data_parallel:  # FSDP2 on the 3-D mesh, torchtitan's (passes/fsdp_tensor_pipeline.py)
        from .passes.fsdp_tensor_pipeline import FsdpTensorPipelineStep
        from .passes.fsdp_tensor_pipeline import refusal as mesh_refusal

        why = mesh_refusal(model.name, regime, loss, device)
        if why is not None:
            return Refused(f"no peak: {why}")
        if regime.sequence_parallel:  # torchtitan's sequence-parallel plan on every stage
            from .passes.sequence_pipeline import FsdpSequencePipelineStep as FsdpTensorPipelineStep
        return FsdpTensorPipelineStep(graph, convention, resolved, one, single.storages, dict(numbers),
                                      regime.pipeline_schedule, regime.micro_batches,
                                      reshard=regime.data_parallel == "fsdp")
    why = refusal(model.name, regime, loss, device)
    if why is not None:
        return Refused(f"no peak: {why}")
    if regime.sequence_parallel:  # torchtitan's sequence-parallel plan on every stage
        from .passes.sequence_pipeline import SequencePipelineStep as TensorPipelineStep
    return TensorPipelineStep(graph, convention, resolved, one, single.storages, dict(numbers),
                              regime.pipeline_schedule, regime.micro_batches)


def _mesh_step(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None,
               options: Mapping[str, Any] | None, numbers: Mapping[sympy.Symbol, int]) -> Step:
    """The step of one rank of an N x t mesh (FSDP2 or FSDP1 over DTensor's standard plan), walked from the
    single-device step under FSDP (:mod:`symmem.passes.fsdp_tensor`, :mod:`symmem.passes.fsdp1_tensor`); refused,
    saying why, where it is not modelled."""
    from .passes.fsdp1 import FSDP1
    from .passes.fsdp1_tensor import Mesh1Step
    from .passes.fsdp_tensor import MeshStep, refusal

    found = _rank_single(model, convention, regime, values, options, refusal)
    if not isinstance(found, tuple):
        return found
    one, single, resolved = found
    mesh = Mesh1Step if regime.data_parallel in FSDP1 else MeshStep  # FSDP1's flat shards, or FSDP2's
    return mesh(dict(numbers), model.graph, convention, resolved, one, single.storages, regime.sequence_parallel)


def _rank_single(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None,
                 options: Mapping[str, Any] | None, refusal: Any) -> Any:
    """What a tensor-parallel rank's step is walked from: the regime without tensor parallelism, the single-device
    derivation under it (``t`` left out) and its convention options; or the step refused, saying why
    (``refusal(model, regime, loss, device)``)."""
    from dataclasses import replace

    from .step import Refused

    graph = model.graph
    loss = "cross-entropy" if any(graph.node(n).group == "loss" for n in graph.program_order()) else None
    one = replace(regime, tensor_parallel=False, sequence_parallel=False)
    single = _derivation(model, convention, one, {k: v for k, v in (values or {}).items() if k != "t"},
                         options=options)
    why = refusal(model.name, regime, loss, str(single.options.get("device", "cpu")))
    if why is not None:
        return Refused(f"no peak: {why}")
    return one, single, {k: single.options[k] for k in convention.options if k in single.options}


def ledger_of(model: Model, convention: Convention, regime: Regime, values: Mapping[str, int] | None = None,
              *, options: Mapping[str, Any] | None = None, per_layer: bool = False,
              free: tuple[str, ...] | None = None) -> Ledger:
    """The ledger of a built graph: the storages ``convention`` keeps for ``model`` under ``regime`` (its
    checkpointing, tensor and pipeline parallelism applied), with their lifetimes, and the graph's parameters.

    >>> from symmem.conventions import convention
    >>> from symmem.models import build
    >>> ledger = ledger_of(build("mlp"), convention("pytorch"), Regime(), options={"device": "cpu"})
    >>> [s.name for s in ledger.storages], [f"{p.owner}.{p.name}" for p in ledger.parameters][:2]
    (['x', 'act1', 'act2'], ['fc1.weight', 'fc1.bias'])
    """
    with paused_gc():
        return _front(model, convention, regime, values, options, per_layer, free).ledger


@dataclass(frozen=True)
class _Front:
    """A graph's ledger with what its training step is worked out from: the convention's options, the
    substitution of the symbols not kept, and the size conditions still open and those decided."""

    ledger: Ledger
    options: dict[str, Any]
    subs: dict[sympy.Symbol, sympy.Expr]
    open: list[Any]
    decided: dict[sympy.Basic, bool]


def _front(model: Model, conv: Convention, regime: Regime, values: Mapping[str, int] | None,
           options: Mapping[str, Any] | None, per_layer: bool, free: tuple[str, ...] | None,
           shared: dict[Any, list[Storage]] | None = None) -> _Front:
    """``shared``: what the convention keeps (``saved.kept``) by branch, the activation dtype and the options, for
    fronts of one model and convention under regimes that differ in their activation side only (a pipeline's and
    the single-device front its stages are cut from): the same storages, worked out once."""
    conv_options = dict(conv.options)
    for key, v in (options or {}).items():
        if key not in conv_options:
            raise SymmemError(f"convention {conv.name!r} has no option {key!r}; it has "
                              f"{', '.join(sorted(conv_options)) or 'none'}")
        conv_options[key] = v
    keep, eff, numbers = symbol_values(GraphSizes(model), regime, values, free)
    subs = substitute_all(eff, keep)

    graph = model.graph
    layer = None
    nodes = list(graph.order())
    if per_layer:
        layer = _pick_layer(model)
        nodes = [n for n in nodes if graph.node(n).block == layer]
    act_dtype = regime.activation_dtype
    # Views that copy for some sizes only (symmem.conditions): the kept storages per truth assignment of the
    # conditions that interact, merged into Piecewise expressions.
    open_, decided = branches.conditions(graph, nodes, subs)

    def run(branch: Mapping[sympy.Basic, bool]) -> list[Storage]:
        key = None if shared is None else (frozenset(branch.items()), act_dtype, per_layer, tuple(nodes),
                                           repr(sorted(conv_options.items())))
        if key is not None and key in shared:
            kept = list(shared[key])
        else:
            kept = saved.kept(graph, conv, conv_options, act_dtype, nodes, per_layer, branch)
            if key is not None:
                shared[key] = list(kept)
        kept = regimes.activations(graph, kept, regime, act_dtype, per_layer, conv.dedup)
        return kept + conv.extra_storages(kept, conv_options)

    storages = _in_graph_order(graph, branches.combine(graph, nodes, open_, decided, run))
    notes: tuple[str, ...] = ()
    seen = any(s.category == "activation" and s.expr.xreplace(subs) != 0 for s in storages)
    why = None if seen else conv.finds_nothing(graph)
    if why is not None:
        # a 0 that means "this convention cannot see the graph", not "nothing is kept": say so wherever it shows
        notes = (f"{model.name}: {why}",)
        warnings.warn(notes[0], NothingCounted, stacklevel=5)
    parameters = tuple(Parameter(node.name, pname, shape, count, node.block, node.group)
                       for node, pname, count, shape in parameter_shapes(graph, nodes, per_layer))
    domain = graph.graph.get("domain", sympy.true)
    ledger = Ledger(model.name, conv.name, tuple(storages), parameters, tuple(sorted(keep, key=lambda s: s.name)),
                    eff, numbers, {**dict(model.options), **conv_options}, per_layer, layer,
                    {b.name: b.count for b in graph.blocks.values()}, domain, notes)
    return _Front(ledger, conv_options, subs, open_, decided)


def derivation_of(ledger: Ledger, regime: Regime, step: Callable[..., Any] | None = None,
                  no_step: str | None = None) -> Derivation:
    """The back half every front shares: a ledger's storages with the parameter side of its trainable parameters
    under ``regime`` (:func:`symmem.passes.regimes.parameters`), every symbol the ledger does not keep replaced by
    its value, as the :class:`~symmem.derivation.Derivation` whose training step is ``step`` (``no_step``: why
    there is none, where the front models one)."""
    keep = tuple(sorted(ledger.free, key=lambda s: s.name))
    subs = substitute_all(ledger.defaults, set(keep))
    storages = [*ledger.storages, *regimes.parameters(ledger.parameters, regime, ledger.per_layer)]
    if subs:
        # storages repeat their expressions: substitute each once, and once for every derivation with the same
        # substitutions (a model under each convention, optimizer and device: xreplace walks each tree anew)
        done = _substitutions(subs)
        storages = [_substituted(s, subs, done) for s in storages]
    kept_symbols = tuple(s for s in keep if any(s in x.expr.free_symbols for x in storages)) or keep
    base = {x for x, e in ledger.defaults.items() if e.is_number}
    resolved = substitute_all(ledger.defaults, base)
    tied = {x: resolved[x] for x in kept_symbols if x in resolved and resolved[x].free_symbols}
    domain = ledger.domain
    return Derivation(ledger.model, ledger.convention, regime, tuple(storages), kept_symbols, ledger.numbers,
                      ledger.parameter_count.xreplace(subs), ledger.per_layer, ledger.layer, dict(ledger.options),
                      step, domain.xreplace(subs) if isinstance(domain, sympy.Basic) else domain, ledger.notes, tied,
                      no_step)


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
    from .passes.graph_step import GraphStep

    return GraphStep(model.graph, conv, options, regime, subs, open_, decided, numbers,
                     every=len(open_) <= PEAK_CONDITIONS)




#: each set of substitutions' results so far (:func:`_substitutions`), a few sets kept
_SUBSTITUTED: dict[frozenset, dict[sympy.Expr, sympy.Expr]] = {}


def _substitutions(subs: Mapping[sympy.Symbol, sympy.Expr]) -> dict[sympy.Expr, sympy.Expr]:
    """The memo of ``expr.xreplace(subs)`` for these ``subs`` (a pure function of both: sympy's values do not
    change), shared by the derivations that substitute the same; bounded, as sympy's own cache is."""
    key = frozenset((k, type(v), v) for k, v in subs.items())  # (a float equal to an integer is not the same)
    found = _SUBSTITUTED.get(key)
    if found is None:
        if len(_SUBSTITUTED) >= 16:
            _SUBSTITUTED.clear()
        found = _SUBSTITUTED[key] = {}
    elif len(found) > 65536:
        found.clear()
    return found


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


def _effective(defaults: Mapping[sympy.Symbol, sympy.Expr], values: Mapping[sympy.Symbol, int]
               ) -> dict[sympy.Symbol, sympy.Expr]:
    eff = dict(defaults)
    eff.update({s: sympy.Integer(v) for s, v in values.items()})
    return eff


def substitute_all(eff: Mapping[sympy.Symbol, sympy.Expr], keep: set[sympy.Symbol]) -> dict:
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
    resolved = substitute_all(eff, set())
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


def _check_assumptions(sizes: Sizes, numbers: Mapping[sympy.Symbol, int],
                       requirements: Sequence[tuple[str, sympy.Basic, sympy.Basic | None]] = ()) -> None:
    """Every assumption of the front (``(node, lhs, rhs)``: lhs = rhs; ``(node, condition, None)``) and every
    requirement of the regime, checked at the numbers: a :class:`SymmemError` names the node and the values."""
    subs = dict(numbers)
    for node, lhs, rhs in [*sizes.assumptions(), *requirements]:
        kind = sizes.kind(node)
        if rhs is None:
            # exactly, without sympy where every symbol has a number (a sweep checks 200 sizes: most of a batch
            # plot's time otherwise); sympify: a bare symbol replaced by a Python int is an int, not a sympy number
            fast = _truth(lhs, numbers)
            verdict = sympy.sympify(lhs.xreplace(subs), strict=True) if fast is None \
                else (sympy.true if fast else sympy.false)
            if verdict is sympy.false:
                raise SymmemError(f"node {node!r} ({kind}): needs {_describe(lhs)}, which fails at "
                                  f"{_given((lhs,), numbers)}; set the symbols consistently")
            continue
        if isinstance(lhs, sympy.Mod) and rhs == 0:
            fast = _truth(sympy.Eq(lhs, 0, evaluate=False), numbers)
            verdict = sympy.sympify(sympy.Eq(lhs, 0).xreplace(subs), strict=True) if fast is None \
                else (sympy.true if fast else sympy.false)
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


def _check_sizes(sizes: Sizes, numbers: Mapping[sympy.Symbol, int]) -> None:
    """Every size of every tensor, parameter and repeat count must be a positive integer at the numbers: an image
    too small for the network, heads that do not divide the hidden size or a slice past its end is an error
    naming the node, not a formula with a zero, negative or fractional size."""
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

    for name, kind, shapes, count in sizes.sized():
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
                    raise SymmemError(f"node {name!r} ({kind}): its {what} {fmt(shape)} has a size {d} = {v} "
                                      f"at {_given((d,), numbers)}, not a positive integer{hint}")
            n = numel(shape)
            if n not in elements:
                found = _number(n, numbers) if n.free_symbols <= known else 0
                if found is None:
                    found = sympy.sympify(n.xreplace(subs), strict=True)
                elements[n] = int(found)
            if elements[n] > MAX_SIZE:
                raise SymmemError(f"node {name!r} ({kind}): its {what} {fmt(shape)} holds {elements[n]:,} "
                                  f"elements at {_given((n,), numbers) or 'these sizes'}, more than PyTorch allows in "
                                  "one tensor (2**63 - 1)")
        if count != 1 and bad(count) is not None:
            raise SymmemError(f"node {name!r} ({kind}): its block is repeated {count} = "
                              f"{bad(count)} times at {_given((count,), numbers)}, not a positive number "
                              "of times")


def _truth(cond: sympy.Basic, numbers: Mapping[sympy.Symbol, int]) -> bool | None:
    """A condition at ``numbers`` (True or False), exactly, without building sympy objects; None when a symbol has
    no number or the interpreter does not know a part of it (then sympy decides)."""
    found = exactly(cond, numbers)  # no free_symbols walk first: it costs as much as the walk
    return found if isinstance(found, bool) else None


def _number(e: sympy.Expr, numbers: Mapping[sympy.Symbol, int]) -> Any:
    """``e`` at ``numbers``, exactly, without building sympy objects; None when a symbol has no number or ``e``
    has a part the interpreter does not know (then sympy decides)."""
    if not e.free_symbols <= numbers.keys():
        return None
    try:
        return interpret(e, numbers)
    except (NotCompilable, ZeroDivisionError, TypeError):
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
