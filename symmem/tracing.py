"""``symmem.trace``: the exact training-memory formula of the user's own ``nn.Module``, as a Derivation.

:func:`symmem.importer.trace_module` runs the module once on fake tensors whose declared sizes are symbols and
records every storage autograd keeps.  :func:`model_of` turns that record into a graph like the zoo's -- one
``traced`` node per kept storage (symbolic shape, dtype, the op and module that saved it), one ``parameter``
node per parameter, a repeated block of identical layers folded to ``L`` copies -- and :func:`trace` derives
it under the ``traced`` convention with the training regime asked for, so every view works on it: the table,
JSON, LaTeX, plots, ``fit``, optimizers, precisions and ZeRO on the parameter side.

>>> import pytest; torch = pytest.importorskip("torch")
>>> net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
>>> d = trace(net, (torch.zeros(2, 784),), {"B": [(0, 0)]}, optimizer="adam", loss="cross-entropy")
>>> d.activations, d.input, d.value("parameters")
(1024*B, 3136*B, 203530)

The peak is the module's own training step, traced on fake tensors op by op (:mod:`symmem.importer.peak`):

>>> d.peak      # Adam's for-loop step: sqrt and its division of the largest weight, alive together
Max(3144*B + 4862128, 6216*B + 2452664)
>>> d.at(B=1024).peak_at().where()
'backward aten.threshold_backward.default (ReluBackward0) in 1, steady step'
"""

from __future__ import annotations

from typing import Any

import sympy

from .errors import SymmemError
from .graph import Block, Graph, Model, Node, lint
from .tensor import DTYPE_BYTES, TensorSpec


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


def model_of(trace: Any, name: str | None = None, size_one: bool = False) -> Model:
    """The graph of a :class:`~symmem.importer.Trace`: kept storages as ``traced`` and ``input`` nodes in
    the order they were made, parameters as ``parameter`` nodes, and the largest run of identical layers
    folded to one layer that stands for ``L`` (the symbol; its default is the run's length).

    With ``size_one`` (a trace made with ``size_one=True``) each storage's bytes are also right where one
    declared size is 1 (PyTorch specializes size 1, so that is a trace of its own): a ``Piecewise`` in
    ``Eq(X, 1)`` where the value differs, and storages kept only at size 1 are nodes of their own."""
    from .symbols import L

    declared = {s.symbol for s in trace.symbols}
    rep = trace.layers
    layers = L if L not in declared else sympy.Symbol("L_layers", positive=True, integer=True)
    graph = Graph(name=name or trace.module)
    nodes: list[tuple[float, Node]] = []
    block_nodes: list[str] = []
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

    def child(module: str) -> int | None:
        return rep.owns(module) if rep is not None else None

    def local(label: str, module: str) -> str:
        # a folded layer's storage named without the child index: transformer.h.0.attn:mm -> transformer.h.L.attn:mm
        assert rep is not None
        first = rep.children[0]
        return f"{rep.path}.L{label[len(first):]}" if label.startswith(first) else label

    for s in [*trace.storages, *extra_one]:
        if s.kind == "parameter":
            continue
        i = rep.child_of(s) if rep is not None else None
        if i not in (None, 0):
            continue  # another copy of the folded layer
        spec = _spec(s)
        if s.name in pieces and pieces[s.name] is not s.bytes:
            itemsize = DTYPE_BYTES[spec.dtype]
            spec = TensorSpec((sympy.sympify(pieces[s.name], strict=True) / itemsize,), spec.dtype)
        when = float(s.born if s.born is not None else s.first_saved)
        in_block = i == 0
        label = local(s.name, s.module) if in_block else s.name
        attrs = {"shape": spec.shape, "dtype": spec.dtype, "op": s.op, "module": s.module,
                 "seen": tuple(str(d) for d in s.shape)}
        kind = "input" if s.kind == "input" else "traced"
        if kind == "input":
            attrs = {"shape": spec.shape, "dtype": spec.dtype}
        node = Node(label, kind, (), attrs, spec.with_(role="input" if kind == "input" else None),
                    group="layer" if in_block else ("input" if kind == "input" else _group(s.module)),
                    block="layers" if in_block else None, count=layers if in_block else sympy.Integer(1))
        nodes.append((when, node))
        if in_block:
            block_nodes.append(label)
    for p in trace.parameters:
        i = child(p.name.rsplit(".", 1)[0]) if "." in p.name else None
        if i not in (None, 0) or not p.requires_grad:
            continue
        in_block = i == 0
        label = (local(p.name, p.name) if in_block else p.name) + ":param"
        shape = tuple(sympy.Integer(d) for d in p.shape) or (sympy.Integer(1),)
        node = Node(label, "parameter", (), {"shape": shape}, TensorSpec(shape), {"value": shape},
                    group="layer" if in_block else _group(p.name), block="layers" if in_block else None,
                    count=layers if in_block else sympy.Integer(1))
        nodes.append((-1.0, node))
    for _, node in sorted(nodes, key=lambda x: x[0]):
        graph.add(node)
    defaults: dict[sympy.Symbol, Any] = {s.symbol: s.example for s in trace.symbols}
    free = tuple(s.symbol for s in trace.symbols)
    layer = None
    if rep is not None and block_nodes:
        members = [n for n in graph.program_order() if graph.node(n).block == "layers"]
        graph.blocks["layers"] = Block("layers", layers, members[0], members[-1], members[0])
        defaults[layers] = rep.count
        free = (*free, layers)
        layer = "layers"
    domain = trace.domain
    if size_one:
        from .importer.guards import domain_of

        for n, v in trace.extra["at_one"].items():
            sym = trace.symbol(n)
            others = [s.symbol for s in trace.symbols if s.symbol != sym]
            domain = sympy.Or(domain, sympy.And(sympy.Eq(sym, 1), domain_of(others, list(v.get("guards", ())))))
    graph.graph["domain"] = domain
    lint(graph)
    graph.graph["trace"] = {"method": trace.method, "module": trace.module, "device": trace.device,
                            "layers": rep.path if rep is not None else None, "notes": trace.notes}
    options = {"traced": trace.module, "method": trace.method}
    if size_one:
        options["size_one"] = True
    return Model(name or trace.module, graph, defaults, free, f"{trace.module}, traced ({trace.method})",
                 layer=layer, options=options)


def _checkpoint_option(value: Any) -> Any:
    """``checkpoint=`` of :func:`trace` as :func:`~symmem.importer.trace_module` takes it."""
    if value in (None, "none"):
        return None
    if value == "selective" or (isinstance(value, str) and value.startswith("every-")):
        raise SymmemError(f"checkpoint={value!r} for a traced module: use 'full' (each repeated block under "
                          "torch.utils.checkpoint), a container's path or a list of child paths; selective and "
                          "every-K recomputation are the zoo's")
    return value


def trace(module: Any, example_inputs: Any, dims: dict[str, Any], *, method: str = "auto", check: bool = True,
          multiple_of: dict[str, int] | None = None, device: str = "cpu", training: bool = True,
          name: str | None = None, loss: Any = "sum", autocast: str | None = None, size_one: bool = False,
          **options: Any) -> Any:
    """The training memory of ``module`` as a :class:`~symmem.derivation.Derivation`, its formula in the
    declared symbols (see :func:`symmem.importer.trace_module` for ``example_inputs``, ``dims``, ``method``,
    ``check`` and ``multiple_of``).  Keywords go to :func:`symmem.engine.derive`: the training regime
    (``optimizer``, ``precision``, ``zero``, ``optimizer_impl``, ``keep_logits``, ``micro_batches`` ...),
    ``values`` (sizes to evaluate at; default: the examples) and ``free``.  Precision of the activations is
    the module's: trace a ``bfloat16`` module for 16-bit ones, or give ``autocast="bfloat16"``
    (``torch.autocast`` around the forward and the loss).  ``checkpoint="full"`` runs each repeated block
    under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (or name the children: a
    container's path or a list of paths); the kept storages and the peak then show it.

    The derivation's :attr:`~symmem.derivation.Derivation.peak` is the peak of the module's real training step,
    traced on fake tensors (:mod:`symmem.importer.peak`): the forward, the ``loss`` (``"sum"`` of the output,
    ``"cross-entropy"`` against a drawn target over the last dimension, ``"output"``: the module's own, e.g. a
    Hugging Face model given ``labels``, or a callable of the output), ``backward()``, ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``.  ``size_one=True`` also traces every size at 1 and makes the formulas
    exact there (a ``Piecewise`` in ``Eq(X, 1)`` where the value differs).
    """
    import dataclasses

    from .conventions import convention
    from .engine import derive
    from .importer import trace_module

    if "convention" in options:
        raise SymmemError("a traced module is derived under the traced convention: what PyTorch itself kept")
    checkpoint = _checkpoint_option(options.pop("checkpoint", "none"))
    recorded = trace_module(module, example_inputs, dims, device=device, training=training, method=method,
                            check=check, multiple_of=multiple_of, autocast=autocast, checkpoint=checkpoint,
                            size_one=size_one)
    model = model_of(recorded, name, size_one=size_one)
    d = derive(model, convention("traced"), **options)
    extra: dict[str, Any] = {}
    if recorded.extra.get("checkpoint"):
        extra["checkpoint"] = ", ".join(recorded.extra["checkpoint"])
    if autocast is not None:
        extra["autocast"] = autocast
    extra["loss"] = loss if isinstance(loss, str) else getattr(loss, "__name__", "callable")
    extra["device"] = recorded.device  # whose kernels the formula follows (verify measures there)
    step = _step(module, recorded, d, example_inputs, dims, loss, autocast, multiple_of, device, options)
    return dataclasses.replace(d, step=step, options={**dict(d.options), **extra})


def _step(module: Any, recorded: Any, d: Any, example_inputs: Any, dims: Any, loss: Any, autocast: Any,
          multiple_of: Any, device: str, options: dict[str, Any]) -> Any:
    """The derivation's ``step``: the peak of the module's training step (None where it cannot be traced)."""
    from .importer.inputs import check_inputs
    from .importer.peak import StepPeak
    from .importer.step import OPTIMIZERS, StepOptions

    regime = d.regime
    if recorded.method == "fitted" or not recorded.training:
        return None  # concrete traces only (or no training step): no symbolic step to follow
    if regime.optimizer not in OPTIMIZERS:
        return None
    why = None
    if regime.zero or regime.tensor_parallel or regime.pipeline_parallel:
        why = ("the peak follows one device's training step op by op; ZeRO and tensor and pipeline parallelism "
               "are not traced (the kept memory and total are)")
    elif regime.precision != "fp32":
        why = (f"precision={regime.precision!r} sets the parameter side only; the traced step runs the module's own "
               "dtypes: trace a bfloat16 module, or give autocast='bfloat16'")
    if why is not None:
        from .step import Refused

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
        from .symbols import L

        sym = L if L not in set(symbols.values()) else sympy.Symbol("L_layers", positive=True, integer=True)
        sym = sym if sym in d.numbers else None
    free = options.get("free")
    subs = {} if free is None else {s: d.numbers[s] for n, s in symbols.items() if n not in free and s in d.numbers}
    return StepPeak(module, inputs, symbols, dict(recorded.values), step_options, device, multiple_of,
                    recorded.extra.get("reads"), (rep.path, rep.children) if rep is not None else None, sym, subs,
                    dict(d.numbers))
