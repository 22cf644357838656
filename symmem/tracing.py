"""``symmem.trace``: the exact training-memory formula of the user's own ``nn.Module``, as a Derivation.

:func:`symmem.importer.trace_module` runs the module once on fake tensors whose declared sizes are symbols and
records every storage autograd keeps.  :func:`model_of` turns that record into a graph like the zoo's -- one
``traced`` node per kept storage (symbolic shape, dtype, the op and module that saved it), one ``parameter``
node per parameter, a repeated block of identical layers folded to ``L`` copies -- and :func:`trace` derives
it under the ``traced`` convention with the training regime asked for, so every view works on it: the table,
JSON, LaTeX, plots, ``fit``, optimizers, precisions and ZeRO on the parameter side.

>>> import pytest; torch = pytest.importorskip("torch")
>>> net = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
>>> d = trace(net, (torch.zeros(2, 784),), {"B": [(0, 0)]}, optimizer="adam")
>>> d.activations, d.input, d.value("parameters")
(1024*B, 3136*B, 203530)
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


def model_of(trace: Any, name: str | None = None) -> Model:
    """The graph of a :class:`~symmem.importer.Trace`: kept storages as ``traced`` and ``input`` nodes in
    the order they were made, parameters as ``parameter`` nodes, and the largest run of identical layers
    folded to one layer that stands for ``L`` (the symbol; its default is the run's length)."""
    from .symbols import L

    declared = {s.symbol for s in trace.symbols}
    rep = trace.layers
    layers = L if L not in declared else sympy.Symbol("L_layers", positive=True, integer=True)
    graph = Graph(name=name or trace.module)
    nodes: list[tuple[float, Node]] = []
    block_nodes: list[str] = []

    def child(module: str) -> int | None:
        return rep.owns(module) if rep is not None else None

    def local(label: str, module: str) -> str:
        # a folded layer's storage named without the child index: transformer.h.0.attn:mm -> transformer.h.L.attn:mm
        assert rep is not None
        first = rep.children[0]
        return f"{rep.path}.L{label[len(first):]}" if label.startswith(first) else label

    for s in trace.storages:
        if s.kind == "parameter":
            continue
        i = rep.child_of(s) if rep is not None else None
        if i not in (None, 0):
            continue  # another copy of the folded layer
        spec = _spec(s)
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
    graph.graph["domain"] = trace.domain
    lint(graph)
    graph.graph["trace"] = {"method": trace.method, "module": trace.module, "device": trace.device,
                            "layers": rep.path if rep is not None else None, "notes": trace.notes}
    options = {"traced": trace.module, "method": trace.method}
    return Model(name or trace.module, graph, defaults, free, f"{trace.module}, traced ({trace.method})",
                 layer=layer, options=options)


def trace(module: Any, example_inputs: Any, dims: dict[str, Any], *, method: str = "auto", check: bool = True,
          multiple_of: dict[str, int] | None = None, device: str = "cpu", training: bool = True,
          name: str | None = None, **options: Any) -> Any:
    """The training memory of ``module`` as a :class:`~symmem.derivation.Derivation`, its formula in the
    declared symbols (see :func:`symmem.importer.trace_module` for ``example_inputs``, ``dims``, ``method``,
    ``check`` and ``multiple_of``).  Keywords go to :func:`symmem.engine.derive`: the training regime
    (``optimizer``, ``precision``, ``zero`` ...), ``values`` (sizes to evaluate at; default: the examples)
    and ``free``.  Precision of the activations is the module's: trace a ``bfloat16`` module for 16-bit ones.
    """
    from .conventions import convention
    from .engine import derive
    from .importer import trace_module

    if "convention" in options:
        raise SymmemError("a traced module is derived under the traced convention: what PyTorch itself kept")
    if options.get("checkpoint", "none") != "none":
        raise SymmemError("checkpointing of a traced module is traced, not derived: wrap its layers in "
                          "torch.utils.checkpoint and trace that")
    recorded = trace_module(module, example_inputs, dims, device=device, training=training, method=method,
                            check=check, multiple_of=multiple_of)
    return derive(model_of(recorded, name), convention("traced"), **options)
