"""What eager PyTorch 2.x autograd does with an op in a training step: the vocabulary of the save and gradient
rules every op kind registers with its shape rule (:func:`symmem.ops.registry.op`).

A **save rule** reads one node (:class:`RuleContext`) and returns the tensors its backward keeps
(:class:`Saved`): inputs, the output, or new tensors only the op holds (indices, masks, statistics).  Sources:
``tools/autograd/derivatives.yaml``, which names the tensors each backward formula reads; the autograd code
generator saves an input only when the gradient that needs it is wanted (:meth:`RuleContext.requires_grad`).

A **gradient rule** says what the op's backward allocates (:class:`Grads`), for the peak of a training step:
for every input that requires grad, whether the backward makes a **new** gradient tensor the size of that input
(``mm`` for a linear's input, ``threshold_backward`` for a ReLU's, ``zeros`` + copy for a slice's), passes the
gradient it received on as an **alias** (a view of the same storage: ``add``, views, ``clone``), and which
**temporaries** it allocates and frees inside (``pow``'s ``x^(c-1)``).  Parameters always receive a new gradient
of their own size.  Sources: ``derivatives.yaml`` and the measured timelines of :mod:`symmem.record.steps`
(docs/peak.md).

Two facts of the autograd engine apply to every op (measured with torch 2.13 on CPU): a value used by several
ops receives one gradient per use, summed **out of place** (``aten.add``: a new tensor the size of the value,
after which both addends are freed), and the gradient an op received is freed once its backward has run,
unless an alias of it is still waiting.

Which node outputs require grad (:func:`requires_grad`): parameters do; inputs, constants, buffers and integer
tensors do not; any other op does if one of its inputs does or it owns parameters.  A graph-only fact, kept in
``node.meta``.

>>> from symmem.models import build
>>> g = build("gpt2").graph
>>> requires_grad(g, "position_ids"), requires_grad(g, "h.attn.c_attn")
(False, True)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import sympy

from .. import roles
from ..errors import SymmemError
from ..tensor import TensorSpec
from .registry import known

if TYPE_CHECKING:
    from ..graph import Graph, Node


@dataclass(frozen=True)
class Saved:
    """One tensor an op keeps: ``source`` is ``"input"`` (with ``index``), ``"output"`` or ``"new"``.

    ``new`` tensors are storages only this op holds; ``spec`` gives their shape and dtype, ``label`` names
    them (``indices``, ``mask``, ``mean`` ...).  ``role`` overrides the role shown in breakdowns.  ``host``
    marks a new tensor a CUDA kernel keeps in host memory (the memory-efficient attention's Philox seed and
    offset): it is counted as kept, but not in what CUDA's allocator holds (``Derivation.peak_allocated``).
    """

    source: str
    index: int = 0
    label: str = ""
    spec: TensorSpec | None = None
    role: str | None = None
    host: bool = False

    def __post_init__(self) -> None:
        if self.source not in ("input", "output", "new"):
            raise SymmemError(f"a saved tensor's source is 'input', 'output' or 'new', not {self.source!r}")
        if self.source == "new" and self.spec is None:
            raise SymmemError(f"the new saved tensor {self.label!r} needs a spec (its shape and dtype)")
        if not known(self.role):  # a layer without a role may be shown by its op kind
            roles.check(self.role)


@dataclass(frozen=True)
class RuleContext:
    """What a save rule sees: the node, its input and output specs, its attributes and the options."""

    graph: Graph
    node: Node
    inputs: tuple[TensorSpec, ...]
    options: Mapping[str, Any]

    @property
    def kind(self) -> str:
        return self.node.kind

    @property
    def out(self) -> TensorSpec:
        return self.node.out

    @property
    def attrs(self) -> Mapping[str, Any]:
        return self.node.attrs

    def input(self, i: int = 0, role: str | None = None) -> Saved:
        return Saved("input", index=i, role=role)

    def output(self, role: str | None = None) -> Saved:
        return Saved("output", role=role)

    def new(self, label: str, shape: tuple[Any, ...], dtype: str, role: str | None = None, host: bool = False
            ) -> Saved:
        return Saved("new", label=label, spec=TensorSpec(tuple(sympy.sympify(d, strict=True) for d in shape), dtype,
                                                         role or label), role=role or label, host=host)

    @property
    def device(self) -> str:
        return str(self.options.get("device", "cuda"))

    def requires_grad(self, i: int) -> bool:
        """Whether input ``i`` requires grad (autograd saves for a gradient only when it is wanted)."""
        return requires_grad(self.graph, self.node.inputs[i])


SaveRule = Callable[[RuleContext], list[Saved]]

NEW, ALIAS = "new", "alias"


@dataclass(frozen=True)
class Grads:
    """What one op's backward allocates: per input index ``new`` or ``alias`` (inputs that need no gradient
    are skipped whatever is said here; an input not named is ``new``), and temporaries that live only while
    the op's backward runs."""

    inputs: Mapping[int, str] = field(default_factory=dict)
    temps: tuple[TensorSpec, ...] = ()

    def of(self, i: int) -> str:
        return self.inputs.get(i, NEW)


GradRule = Callable[[RuleContext], Grads]

#: Op kinds whose output never requires grad, whatever their inputs.
NO_GRAD = frozenset({"input", "constant", "buffer", "rope_table"})
INT_DTYPES = frozenset({"bool", "int64", "int32", "int16", "int8", "uint8"})


def requires_grad(graph: Graph, name: str) -> bool:
    """Whether ``name``'s output requires grad (computed once per node, iteratively: deep graphs are fine)."""
    # asked for every input of every op in each walk of a step: once known, one lookup (not the walk's setup)
    found = graph.node(name).meta.get("requires_grad")
    if found is not None:
        return found
    stack = [name]
    while stack:
        node = graph.node(stack[-1])
        if "requires_grad" in node.meta:
            stack.pop()
            continue
        if node.kind == "parameter":
            node.meta["requires_grad"] = True
        elif node.kind in NO_GRAD or node.out.dtype in INT_DTYPES:
            node.meta["requires_grad"] = False
        else:
            todo = [i for i in node.inputs if "requires_grad" not in graph.node(i).meta]
            if todo:
                stack.extend(todo)
                continue
            node.meta["requires_grad"] = bool(node.params) or any(
                graph.node(i).meta["requires_grad"] for i in node.inputs)
        stack.pop()
    return graph.node(name).meta["requires_grad"]


# -- rules many op kinds share ---------------------------------------------------------------------------
def keeps_nothing(ctx: RuleContext) -> list[Saved]:
    """The backward needs no tensor: views (sizes and strides), ``add``/``sub``/``cat`` (sizes), scalar
    arithmetic, casts, reductions to a mean, and tensors made without gradient."""
    return []


def keeps_input(ctx: RuleContext) -> list[Saved]:
    """The backward differentiates from the first input (``gelu``, ``silu``, ``pow(x, c)``; ``addmm``/``mm``,
    what ``nn.Linear`` runs, keep the input and the weight, a parameter)."""
    return [ctx.input(0)]


def keeps_output(ctx: RuleContext) -> list[Saved]:
    """The backward differentiates from the result (derivatives.yaml uses ``result``)."""
    return [ctx.output()]


def no_backward(ctx: RuleContext) -> Grads:
    """Leaves: nothing runs backward."""
    return Grads()


def passes_on(ctx: RuleContext) -> Grads:
    """Views, copies and ``+ c`` pass the gradient on: ``view``/``permute`` of it, ``clone``'s and ``cat``'s
    backward hand it (or narrow views of it) to their inputs."""
    return Grads({i: ALIAS for i in range(len(ctx.inputs))})


def new_grads(ctx: RuleContext) -> Grads:
    """One new gradient per input that requires grad (the formulas of derivatives.yaml write fresh tensors)."""
    return Grads()
