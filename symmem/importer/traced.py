"""A traced module's front: what :func:`symmem.importer.trace_module` recorded, as a :class:`~symmem.ledger.Ledger`.

The trace ran the module once on fake tensors whose declared sizes are symbols and recorded every storage
autograd keeps.  :func:`ledger_of` lists those storages as they were made (symbolic bytes, dtype, the module that
saved them), the module's parameters, and a repeated block of identical layers folded to ``L`` copies; the back
half (:func:`symmem.engine.derivation_of`) makes it a derivation under the training regime asked for, so every
view works on it: the table, JSON, LaTeX, plots, ``fit``, optimizers, precisions and ZeRO on the parameter side.
:func:`step_of` is its training step, traced on fake tensors op by op (:mod:`symmem.importer.traced_step`).
:func:`symmem.trace` (:func:`symmem.api.trace`) is the front users call.

>>> import pytest; torch = pytest.importorskip("torch")
>>> from symmem.importer import trace_module
>>> from symmem.training import Regime
>>> net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
>>> ledger = ledger_of(trace_module(net, (torch.zeros(2, 784),), {"B": [(0, 0)]}), Regime())
>>> [(s.name, s.expr) for s in ledger.storages]
[('input:0', 3136*B), ('1:relu', 1024*B)]
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

import sympy

from ..derivation import START, Storage
from ..engine import Sized, symbol_values
from ..errors import SymmemError
from ..ledger import Ledger, Parameter
from ..passes import regimes
from ..tensor import DTYPE_BYTES, TensorSpec, dtype_bytes
from ..training import Regime


def _group(module: str) -> str:
    """A storage's group: its module path, two levels deep (``transformer.wte``, ``lm_head``)."""
    parts = [p for p in module.split(".") if p]
    return ".".join(parts[:2]) if parts else "model"


def _spec(storage: Any) -> TensorSpec:
    """The storage's bytes as a tensor spec: the shape first saved from it when that is the whole storage,
    else a flat shape of its elements (a saved view keeps its whole base)."""
    dtype = storage.dtype if storage.dtype in DTYPE_BYTES else None
    if dtype is None:
        raise SymmemError(f"traced storage {storage.name!r} has dtype {storage.dtype!r}, which symmem does not "
                          f"size; known: {', '.join(DTYPE_BYTES)}")
    shape = tuple(sympy.sympify(d, strict=True) for d in storage.shape)
    whole = sympy.expand(sympy.Mul(*shape) - storage.elements) == 0 if shape else storage.elements == 1
    return TensorSpec(shape if whole and shape else (storage.elements,), dtype)


def _one_piece(storages: tuple[Any, ...], at_one: dict[str, Any]) -> dict[str, Any]:
    """Each storage's bytes with every declared size also right at 1: ``Piecewise((at 1, Eq(X, 1)), (bytes, True))``
    where the trace with ``X`` at 1 kept something else (a reshape that copies for ``B >= 2`` is a view at 1),
    by storage name; storages kept only at size 1 under their own names, with 0 elsewhere."""
    out: dict[str, Any] = {s.name: s.bytes for s in storages}
    order = [s.name for s in storages]
    for data in at_one.values():
        one = {s.name: s.bytes for s in data.get("storages", ()) if s.kind != "parameter"}
        sym = data["symbol"]
        for label in list(out):
            general = out[label]
            at1 = one.get(label, sympy.Integer(0))
            if sympy.expand(sympy.sympify(general, strict=True).xreplace({sym: 1}) - at1) != 0:
                out[label] = sympy.Piecewise((at1, sympy.Eq(sym, 1)), (general, True))
        for label, b in one.items():
            if label not in out:
                out[label] = sympy.Piecewise((b, sympy.Eq(sym, 1)), (0, True))
                order.append(label)
    return {label: out[label] for label in order}


@dataclass(frozen=True)
class _Entry:
    """One thing of a trace in the order the step holds it: a kept storage (``kind`` ``traced`` or ``input``) or
    a trainable parameter (``parameter``), named as the formula shows it, with its size."""

    label: str
    kind: str
    spec: TensorSpec
    group: str
    in_block: bool
    count: sympy.Expr
    parameter: Parameter | None = None


class _TraceSizes:
    """:class:`~symmem.engine.Sizes` of a trace: its storages' and parameters' shapes, no assumptions (its
    guards are the domain), the folded layers as the one repeated block."""

    def __init__(self, name: str, entries: list[_Entry], defaults: dict[sympy.Symbol, sympy.Expr],
                 free: tuple[sympy.Symbol, ...], block_input: str | None) -> None:
        self.name, self.entries, self.defaults, self.free = name, entries, defaults, free
        self.kinds = {e.label: e.kind for e in entries}
        self.blocks = [] if block_input is None else [(block_input, next(e.count for e in entries if e.in_block))]

    @property
    def symbols(self) -> tuple[sympy.Symbol, ...]:
        found: set[sympy.Symbol] = set(self.defaults)
        for e in self.entries:
            for d in (*e.spec.shape, e.count):
                found |= d.free_symbols
        return tuple(sorted(found, key=lambda s: s.name))

    def assumptions(self) -> list[tuple[str, sympy.Basic, sympy.Basic | None]]:
        return []

    def requirements(self, regime: Regime) -> list[tuple[str, sympy.Basic, None]]:
        # a trace has no op with a role tensor parallelism splits: its own plan splits it (importer/tensor_plan.py)
        return regimes.needs(self.name, lambda: "the module's tensor-parallel plan", self.blocks, self.symbols, regime)

    def kind(self, node: str) -> str:
        return self.kinds.get(node, "regime")

    def sized(self) -> Iterator[Sized]:
        for e in self.entries:
            shapes = [("output", e.spec.shape)]
            if e.parameter is not None:
                shapes.append(("parameter 'value'", e.spec.shape))
            yield e.label, e.kind, shapes, e.count


def _entries(trace: Any, size_one: bool, layers: sympy.Symbol, split: frozenset[str] | None = None
             ) -> tuple[list[_Entry], list[Parameter]]:
    """The kept storages and trainable parameters of ``trace`` in the order the step holds them (parameters
    first, then storages as they were made), the largest run of identical layers folded to its first, counted
    ``layers`` times; and every parameter, frozen ones too.  ``split``: the parameters a tensor-parallel plan splits
    (:func:`~symmem.importer.tensor_plan.split_parameters`; None: no plan)."""
    rep = trace.layers
    pieces: dict[str, Any] = {}
    extra_one: list[Any] = []
    if size_one:
        at_one = trace.extra.get("at_one")
        if not at_one:
            raise SymmemError("size_one needs a trace made with size_one=True (trace_module(..., size_one=True))")
        data = {n: {**v, "symbol": trace.symbol(n)} for n, v in at_one.items()}
        pieces = _one_piece(tuple(s for s in trace.storages if s.kind != "parameter"), data)
        names = {s.name for s in trace.storages}
        by_name = {st.name: st for v in at_one.values() for st in v.get("storages", ())}
        extra_one = [by_name[n] for n in pieces if n not in names]

    def local(label: str) -> str:
        # a folded layer's storage named without the child index: transformer.h.0.attn:mm -> transformer.h.L.attn:mm
        assert rep is not None
        first = rep.children[0]
        return f"{rep.path}.L{label[len(first):]}" if label.startswith(first) else label

    found: list[tuple[float, _Entry]] = []
    for s in [*trace.storages, *extra_one]:
        if s.kind == "parameter":
            continue
        # The model's input is one tensor however many blocks there are: block 0's first op saving it (a Linear,
        # LayerNorm or Conv at the stack's head) does not make it a storage of every layer.
        i = rep.child_of(s) if rep is not None and s.kind != "input" else None
        if i not in (None, 0):
            continue  # another copy of the folded layer
        spec = _spec(s)
        if s.name in pieces and pieces[s.name] is not s.bytes:
            itemsize = DTYPE_BYTES[spec.dtype]
            spec = TensorSpec((sympy.sympify(pieces[s.name], strict=True) / itemsize,), spec.dtype)
        kind = "input" if s.kind == "input" else "traced"
        in_block = i == 0
        group = "layer" if in_block else ("input" if kind == "input" else _group(s.module))
        entry = _Entry(local(s.name) if in_block else s.name, kind,
                       spec.with_(role="input" if kind == "input" else None), group, in_block,
                       layers if in_block else sympy.Integer(1))
        found.append((float(s.born if s.born is not None else s.first_saved), entry))
    parameters: list[Parameter] = []
    for p in trace.parameters:
        i = rep.owns(p.name.rsplit(".", 1)[0]) if rep is not None and "." in p.name else None
        if i not in (None, 0):
            continue  # another copy of the folded layer
        in_block = i == 0
        label = (local(p.name) if in_block else p.name) + ":param"
        shape = tuple(sympy.sympify(d, strict=True) for d in p.shape) or (sympy.Integer(1),)  # symbolic: symbolic_sizes
        if split is not None:
            shape = _as_split(shape, p.name in split)
        count = layers if in_block else sympy.Integer(1)
        param = Parameter(label, "value", shape, count, "layers" if in_block else None,
                          "layer" if in_block else _group(p.name), p.dtype, p.requires_grad)
        parameters.append(param)
        if p.requires_grad:  # a frozen parameter has no gradient: the step holds its weights only
            found.append((-1.0, _Entry(label, "parameter", TensorSpec(shape), param.group, in_block, count, param)))
    return [e for _, e in sorted(found, key=lambda x: x[0])], parameters


def _as_split(shape: tuple[sympy.Expr, ...], split: bool) -> tuple[sympy.Expr, ...]:
    """A parameter's shape as the tensor-parallel rule of the parameter side reads it (matrices split over t,
    vectors whole: :func:`symmem.passes.regimes.parameters`) where a module's own plan says what is split: a split
    vector (a column-parallel bias) as an (n, 1) matrix, a whole matrix (a layer the plan leaves out) as a row of its
    elements; the elements, and so every component's bytes, unchanged."""
    if split and len(shape) < 2:
        return (*shape, sympy.Integer(1))
    if not split and len(shape) >= 2:
        return (sympy.Mul(*shape),)
    return shape


def ledger_of(trace: Any, regime: Regime, *, name: str | None = None, size_one: bool = False,
              values: Mapping[str, int] | None = None, free: tuple[str, ...] | None = None,
              per_layer: bool = False, shown: Mapping[str, Any] | None = None,
              split: frozenset[str] | None = None) -> Ledger:
    """The ledger of a :class:`~symmem.importer.Trace`: the storages it kept in the order they were made, its
    parameters, and the largest run of identical layers folded to one layer that stands for ``L`` (the symbol;
    its default is the run's length).  ``values``, ``free`` and ``per_layer`` are :func:`symmem.api.derive`'s;
    ``shown`` are options the derivation shows besides the trace's own; ``split``: under tensor parallelism, the
    parameters the module's plan splits (:func:`~symmem.importer.tensor_plan.split_parameters`), so the parameter
    side is the rank's.

    With ``size_one`` (a trace made with ``size_one=True``) each storage's bytes are also right where one
    declared size is 1 (PyTorch specializes size 1, so that is a trace of its own): a ``Piecewise`` in
    ``Eq(X, 1)`` where the value differs, and storages kept only at size 1 are storages of their own."""
    from ..symbols import L

    declared = {s.symbol for s in trace.symbols}
    rep = trace.layers
    layers = L if L not in declared else sympy.Symbol("L_layers", positive=True, integer=True)
    entries, parameters = _entries(trace, size_one, layers, split if regime.tensor_parallel else None)
    model = name or trace.module
    defaults: dict[sympy.Symbol, sympy.Expr] = {s.symbol: sympy.Integer(s.example) for s in trace.symbols}
    free_symbols = tuple(s.symbol for s in trace.symbols)
    block = [e for e in entries if e.in_block]
    layer = None
    if rep is not None and any(e.kind != "parameter" for e in block):
        defaults[layers] = sympy.Integer(rep.count)
        free_symbols = (*free_symbols, layers)
        layer = "layers"
    sizes = _TraceSizes(model, entries, defaults, free_symbols, block[0].label if layer else None)
    keep, eff, numbers = symbol_values(sizes, regime, values, free)
    if regime.checkpoint != "none":
        raise SymmemError("a traced module is checkpointed as it is traced: give checkpoint= to symmem.trace, "
                          "not in the regime")
    if per_layer:
        if layer is None:
            raise SymmemError(f"{model} has no repeated layer, so there is no per-layer formula")
        entries = block
        parameters = [replace(p, count=sympy.Integer(1)) for p in parameters if p.block is not None]
    storages = [_kept(e, regime.activation_dtype, per_layer) for e in entries if e.kind != "parameter"]
    if regime.pipeline_parallel and not per_layer:
        in_block = {e.label for e in entries if e.in_block}
        storages = regimes.pipeline(storages, lambda x: layer if x.node in in_block else None)
    # What PyTorch itself kept needs no "the convention cannot see this" note: a module that keeps no activation
    # (a lone Linear keeps only its input) keeps none.
    notes: tuple[str, ...] = ()
    from ..passes.data_parallel import SHARDED
    from ..passes.fsdp1 import FSDP1

    if regime.data_parallel in (*SHARDED, *FSDP1):
        from .traced_engines import policy  # which modules fully_shard wraps: said, as the peak follows it

        notes = (policy(regime, rep),)
    if regime.tensor_parallel:
        notes = (*notes, "tensor parallel: the parameter side is one rank's (" + (
            "the module's plan says which parameters are split over t" if split is not None else
            "every matrix split over t: the module has no plan") + "); the peak is one rank's step, recorded (" + (
            "FSDP2 on the mesh's data-parallel dimension: ranks differ only by its padding" if regime.data_parallel
            else "every rank alike") + ")")
    domain = trace.domain
    if size_one:
        from .guards import domain_of

        for n, v in trace.extra["at_one"].items():
            sym = trace.symbol(n)
            others = [s.symbol for s in trace.symbols if s.symbol != sym]
            domain = sympy.Or(domain, sympy.And(sympy.Eq(sym, 1), domain_of(others, list(v.get("guards", ())))))
    options: dict[str, Any] = {"traced": trace.module, "method": trace.method}
    if size_one:
        options["size_one"] = True
    return Ledger(model, "traced", tuple(storages), tuple(parameters), tuple(sorted(keep, key=lambda s: s.name)),
                  eff, numbers, {**options, **dict(shown or {})}, per_layer, layer if per_layer else None,
                  {layer: layers} if layer else {}, domain, notes)


def rank_ledger(ledger: Ledger, step: Any, regime: Regime) -> Ledger:
    """Under tensor parallelism, ``ledger`` with the activations the rank keeps after the forward: those its recorded
    step holds there (:meth:`~symmem.importer.traced_tensor.TensorStepPeak.kept`), the inputs the trace's; where the
    rank's step is not recorded, the one device's, said so in a note."""
    if not regime.tensor_parallel:
        return ledger
    from ..step import Refused
    from .traced_tensor import TensorStepPeak, rank_storages

    why = step.why if isinstance(step, Refused) else "no training step is followed here"
    # the rank's step, or in every size the rank's steps at the fit's configurations (sized_step.TensorSizedStep)
    if isinstance(step, TensorStepPeak) or callable(getattr(step, "kept", None)):
        try:
            kept, domain = rank_storages(step, next(iter(ledger.repeats.values()), None), ledger.per_layer)
        except SymmemError as exc:
            why = str(exc)
        else:
            inputs = tuple(s for s in ledger.storages if s.category == "input")
            return replace(ledger, storages=(*inputs, *kept), domain=sympy.And(ledger.domain, *domain),
                           notes=(*ledger.notes, "tensor parallel: the activations kept after the forward are the "
                                  "rank's, from its recorded step (at the t it was recorded at)"))
    return replace(ledger, notes=(*ledger.notes, "tensor parallel: the activations kept after the forward are one "
                                  f"device's, not the rank's: its step is not recorded ({why})"))


def _kept(entry: _Entry, act_dtype: str, per_layer: bool) -> Storage:
    """The storage of a kept entry: it keeps itself, from its making (the start, for an input) to its backward."""
    spec = entry.spec
    count = sympy.Integer(1) if per_layer else entry.count
    category = "input" if entry.kind == "input" else ("loss" if entry.group == "loss" else "activation")
    one = spec.numel * dtype_bytes(spec.dtype, act_dtype)
    born = START if category == "input" else "forward"
    return Storage(entry.label, "input" if category == "input" else entry.group, category,
                   one if count == 1 else count * one, spec.role, entry.label, spec.dtype, spec.numel, count,
                   (entry.label,), born, "backward")


def split_of(module: Any, regime: Regime) -> frozenset[str] | None:
    """Under tensor parallelism, the parameters ``module``'s plan splits (None: no tensor parallelism, or no plan,
    which the peak's refusal names)."""
    if not regime.tensor_parallel:
        return None
    from .tensor_plan import split_parameters

    try:
        return split_parameters(module, regime.sequence_parallel)
    except SymmemError:
        return None


def checkpoint_option(value: Any) -> Any:
    """``checkpoint=`` of :func:`symmem.api.trace` as :func:`~symmem.importer.trace_module` takes it."""
    if value in (None, "none"):
        return None
    if value == "selective" or (isinstance(value, str) and value.startswith("every-")):
        raise SymmemError(f"checkpoint={value!r} for a traced module: use 'full' (each repeated block under "
                          "torch.utils.checkpoint), a container's path or a list of child paths; selective and "
                          "every-K recomputation are the zoo's")
    return value


def no_step(recorded: Any, regime: Regime) -> str | None:
    """Why a traced module has no training step to follow (None where it has one)."""
    from .recording import OPTIMIZERS

    if recorded.method == "fitted":
        return ("the formula was fitted from traces at concrete sizes (method='fit', or 'auto' where fake tensors "
                "could not run the module), and the training step is recorded only by a symbolic trace")
    if not recorded.training:
        return "the module was traced in eval mode (training=False): there is no training step to follow"
    if regime.optimizer not in OPTIMIZERS:
        return (f"the traced step runs torch.optim's {', '.join(OPTIMIZERS)}; optimizer={regime.optimizer!r} is "
                "not among them (its parameter side is counted)")
    return None


def step_of(module: Any, recorded: Any, regime: Regime, numbers: Mapping[sympy.Symbol, int], example_inputs: Any,
            dims: Any, loss: Any, autocast: Any, multiple_of: Any, device: str, free: tuple[str, ...] | None) -> Any:
    """The derivation's ``step``: the peak of the module's training step (None where it cannot be traced)."""
    from .inputs import check_inputs
    from .recording import StepOptions
    from .traced_step import StepPeak

    if no_step(recorded, regime) is not None:
        return None
    why = None
    if regime.tensor_parallel and (regime.data_parallel not in (None, "fsdp", "fsdp-no-reshard") or regime.zero
                                   or regime.pipeline_parallel):  # FSDP2 x TP: importer/traced_fsdp_tensor.py
        why = ("the peak of a traced module under tensor parallelism is followed alone or with FSDP2 (fsdp, "
               "fsdp-no-reshard): with another data-parallel engine, pipeline parallelism or ZeRO it is not")
    elif regime.precision != "fp32":
        why = (f"precision={regime.precision!r} sets the parameter side only; the traced step runs the module's own "
               "dtypes: trace a bfloat16 module, or give autocast='bfloat16'")
    if why is not None:
        from ..step import Refused

        return Refused(why)
    impl = regime.optimizer_impl if regime.optimizer_impl != "auto" else (
        "foreach" if device.startswith("cuda") else "for-loop")
    step_options = StepOptions(loss=loss, optimizer=regime.optimizer, impl=impl, keep_output=regime.keep_logits,
                               micro_batches=regime.micro_batches, autocast=autocast,
                               checkpoint=tuple(recorded.extra.get("checkpoint", ())))
    inputs = check_inputs(example_inputs, dims)
    symbols = {s.name: s.symbol for s in recorded.symbols}
    rep = recorded.layers
    sym = None
    if rep is not None:
        from ..symbols import L

        sym = L if L not in set(symbols.values()) else sympy.Symbol("L_layers", positive=True, integer=True)
        sym = sym if sym in numbers else None
    subs = {} if free is None else {s: numbers[s] for n, s in symbols.items() if n not in free and s in numbers}
    step = StepPeak(module, inputs, symbols, dict(recorded.values), step_options, device, multiple_of,
                    recorded.extra.get("reads"), (rep.path, rep.children) if rep is not None else None, sym, subs,
                    dict(numbers))
    if regime.tensor_parallel:  # one rank's step recorded on fake DTensors (importer/traced_tensor.py)
        from .traced_tensor import TensorStepPeak, tensor_step

        found = tensor_step(step, regime)
        if not regime.data_parallel or not isinstance(found, TensorStepPeak):
            return found
        from .traced_engines import refusal as engine_refusal  # FSDP2 on the mesh's data-parallel dimension
        from .traced_fsdp_tensor import fsdp_tensor_step

        why = engine_refusal(regime, step)
        if why is not None:
            from ..step import Refused

            return Refused(why)
        return fsdp_tensor_step(found, regime.data_parallel)
    if regime.pipeline_parallel and regime.data_parallel:
        from .traced_ddp_pipeline import ENGINES, ddp_pipeline_step

        if regime.data_parallel in ENGINES:  # DDP / ZeRO-1 on every stage (importer/traced_ddp_pipeline.py)
            return ddp_pipeline_step(step, regime, numbers)
        from .traced_fsdp_pipeline import fsdp_pipeline_step  # FSDP2 on every stage

        return fsdp_pipeline_step(step, regime, numbers)
    if regime.pipeline_parallel:  # every stage's step: the recorded step cut by stage and replayed
        from .traced_pipeline import pipeline_step

        return pipeline_step(step, regime, numbers)
    step.seed(recorded.extra.get("fake_world"))  # the trace's fake world, where it is the step's
    from .traced_engines import under_engine  # a data-parallel engine or ZeRO's accounting: the step rewritten

    return under_engine(step, regime)
