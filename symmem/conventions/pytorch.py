"""The ``pytorch`` convention: what eager PyTorch 2.x autograd saves for backward, by the rule of each op kind.

The rules live with the op kinds (:mod:`symmem.ops`): each kind registers, with its shape rule, the tensors its
backward needs (inputs, the output, or new tensors only the op holds: indices, masks, statistics) and what its
backward allocates.  This convention applies them: it counts every storage once, resolves views to their base
storage, and leaves parameters and the input batch apart.  A kind with no rule says why
(:attr:`PytorchConvention.unsupported`).

>>> from symmem.conventions import convention
>>> convention("pytorch").dedup
True
>>> sorted(convention("pytorch").unsupported)
['rotary']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .. import ops
from ..errors import node_error
from . import Convention, Saved, register

if TYPE_CHECKING:
    from ..graph import Graph, Node


class PytorchConvention(Convention):
    name = "pytorch"
    description = ("What eager PyTorch 2.x autograd keeps for backward, op by op, each storage counted once "
                   "(see symmem/ops/ for the rule of every op kind and its source).")
    dedup = True
    options: Mapping[str, Any] = {"device": "cuda"}

    @property
    def unsupported(self) -> Mapping[str, str]:  # type: ignore[override]
        """Op kinds with no save rule, and why."""
        return {k: e.saves.reason for k in ops.kinds() if isinstance((e := ops.entry(k)).saves, ops.Unsupported)}

    def saved(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> list[Saved]:
        rule = ops.entry(node.kind).saves
        if isinstance(rule, ops.Unsupported):  # every other kind has a rule (symmem.ops checks on import)
            raise node_error(node.name, node.kind,
                             f"the pytorch convention has no rule for this op kind: {rule.reason}")
        if options.get("device", "cuda") not in ("cuda", "cpu"):
            raise node_error(node.name, node.kind, f"device {options.get('device')!r} is not 'cuda' or 'cpu'")
        return rule(self._context(graph, node, options))

    def grads(self, graph: Graph, node: Node, options: Mapping[str, Any]) -> ops.Grads:
        """What ``node``'s backward allocates (the gradient rule of its kind, :mod:`symmem.ops.autograd`)."""
        rule = ops.entry(node.kind).grads
        if isinstance(rule, ops.Unsupported):
            raise node_error(node.name, node.kind, "the pytorch convention has no backward rule for this op kind")
        return rule(self._context(graph, node, options))

    @staticmethod
    def _context(graph: Graph, node: Node, options: Mapping[str, Any], _new: Any = object.__new__
                 ) -> ops.RuleContext:
        # ``RuleContext(graph, node, inputs, options)`` without the frozen dataclass's ``__init__`` (each field set
        # through ``object.__setattr__``): the same value, made for every op of every walk of a step
        made = _new(ops.RuleContext)
        made.__dict__.update(graph=graph, node=node, inputs=tuple([graph.node(i).out for i in node.inputs]),
                             options=options)
        return made

    def holds(self, graph: Graph) -> Any:
        """Where the rules give the bytes PyTorch keeps, beyond every size being a positive integer: a condition
        on the sizes (``sympy.true``: everywhere).

        The stride rules take a symbolic size as at least 2 (:mod:`symmem.strides`); B is not a unit size.  At
        B = 1 a batched matmul folds an operand's head view into ``bmm``'s batch without the copy the rule keeps
        (B merges with the heads), and keeps the view's base instead: where the base is not the copy's size
        (GPT-2's eager attention keeps ``c_attn``'s whole (1, S, 3H) output, not a (1, h, S, d) copy), the
        formulas hold for B >= 2 only (docs/pytorch-sequence.md, "Known gaps")."""
        import sympy

        from ..strides import matmul_copies
        from ..symbols import B

        def one(x: Any) -> Any:
            return sympy.sympify(x, strict=True).xreplace({B: 1})

        def at_one(spec: Any) -> tuple[Any, Any]:
            return tuple(one(d) for d in spec.shape), None if spec.strides is None else tuple(map(one, spec.strides))

        def base(name: str) -> Any:
            node = graph.node(name)
            while node.view_of is not None:
                node = graph.node(node.inputs[node.view_of])
            return node.out

        found: list[Any] = []
        for name in graph.order():
            node = graph.node(name)
            copies = node.fact("copy_inputs", ()) if node.kind == "matmul" else ()
            if not copies or B not in {x for i in node.inputs for d in graph.node(i).out.shape
                                       for x in sympy.sympify(d, strict=True).free_symbols}:
                continue
            ins = [graph.node(i).out for i in node.inputs]
            folded = matmul_copies(*(at_one(x) for x in ins))
            for c in copies:
                i, when = c if isinstance(c, tuple) else (c, sympy.true)
                if folded[i] is not False:
                    continue
                copy, kept = one(ins[i].numel), one(base(node.inputs[i]).numel)
                ratio = sympy.cancel(copy / kept)
                if ratio != 1:
                    where = sympy.Or(sympy.Ge(B, 2), sympy.Not(when), sympy.Eq(ratio, 1))
                    found.append(where if when is sympy.true else _logic(where))
        # where a builder knows its copies hold only for some sizes (Llama's eager attention with the cache: from
        # h = 2), it says so itself
        found += list(graph.graph.get("holds_where", ()))
        return sympy.And(*dict.fromkeys(found))

    def finds_nothing(self, graph: Graph) -> str | None:
        # asked only when nothing was kept: a network that trains keeps something for backward
        if any(graph.node(n).role == "activations" for n in graph.order()):
            return ("the pytorch convention follows real ops, and this graph only stands for a network by its "
                    "activation count, so autograd keeps nothing in it; use --convention cs231n (every layer's "
                    "output, twice for backward) or trace the real module (symmem trace)")
        return ("autograd keeps no activation for backward in this graph (no op whose backward needs a "
                "tensor): the formula is the parameter side and the input alone")


def _logic(condition: Any) -> Any:
    """``condition`` simplified as Boolean logic over its relations, each taken as an atom (``Ne(x, 1)`` as
    ``~Eq(x, 1)``): what sympy's ``simplify_logic`` gives without simplifying every relation on the way."""
    import sympy

    relations = condition.atoms(sympy.Eq, sympy.Ne, sympy.Ge, sympy.Gt, sympy.Le, sympy.Lt)
    atoms = {a: sympy.Dummy() for a in {sympy.Eq(*r.args) if isinstance(r, sympy.Ne) else r for r in relations}}
    as_atoms = {r: sympy.Not(atoms[sympy.Eq(*r.args)]) if isinstance(r, sympy.Ne) else atoms[r] for r in relations}
    simple = sympy.simplify_logic(condition.xreplace(as_atoms))
    return simple.xreplace({d: a for a, d in atoms.items()})


register("pytorch", PytorchConvention())
