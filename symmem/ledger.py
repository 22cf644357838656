"""What every front produces: the kept storages, the parameters, the repeated block, the symbols' values and the
domain -- one :class:`Ledger`, which one back half (:func:`symmem.engine.derivation_of`) turns into a
:class:`~symmem.derivation.Derivation`.

Two fronts make ledgers: a built graph under a convention (:func:`symmem.engine.ledger_of`: the convention's kept
storages, with the regime's activation side -- checkpointing, tensor and pipeline parallelism -- applied per
branch of the sizes), and a traced module (:func:`symmem.importer.traced.ledger_of`: what PyTorch itself kept, recorded
on fake tensors).  The parameter side is the back half's: it reads :attr:`Ledger.parameters`, never a graph.

>>> import sympy
>>> from symmem.derivation import Storage
>>> from symmem.symbols import B, H
>>> x = Storage("x", "input", "input", 4 * B * H, "input", "x", "float32", B * H, keepers=("fc",),
...             dies="backward")
>>> ledger = Ledger("toy", "pytorch", (x,), (Parameter("fc", "weight", (H, H)),), (B, H),
...                 {B: sympy.Integer(2), H: sympy.Integer(8)}, {B: 2, H: 8})
>>> ledger.trainable[0].elements
H**2
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy

from .derivation import Storage
from .shapes import numel


@dataclass(frozen=True)
class Parameter:
    """One parameter tensor (or ``count`` identical ones, one per layer of a repeated block).

    The parameter side names its storages ``{owner}.{name}.{component}`` (``fc1.weight.weights``) and lets a
    gradient be born when ``owner`` runs backward.  ``block`` is the repeated block it belongs to (pipeline
    parallelism splits those), ``trainable`` says whether it gets a gradient and optimizer state: the parameter
    side counts a frozen parameter's weights only.  ``tied`` names the other parameters that share its storage
    (counted once, here).
    """

    owner: str
    name: str
    shape: tuple[sympy.Expr, ...]
    count: sympy.Expr = sympy.Integer(1)
    block: str | None = None
    group: str = "parameters"
    dtype: str | None = None
    trainable: bool = True
    tied: tuple[str, ...] = ()

    @property
    def elements(self) -> sympy.Expr:
        """Elements of one copy."""
        return numel(self.shape)


@dataclass(frozen=True)
class Ledger:
    """What a front found: the storages kept for backward and the parameters, in the symbols' terms.

    ``storages`` are what the training step keeps besides the parameter side (activations, inputs, what a loss
    keeps, transients of recomputation or of an accounting), in the order the model runs, with sizes as
    sympy expressions in every symbol (not yet substituted), under the regime's activation side: a graph's
    front applies checkpointing and tensor and pipeline parallelism per branch of the sizes (they change what
    is kept), a traced module was traced checkpointed.  ``free`` are the symbols formulas keep,
    ``defaults`` every symbol's value or expression (the model's defaults with what was set), ``numbers`` the
    symbols that have numbers.  ``repeats`` maps each repeated block to its count, ``layer`` is the block a
    per-layer ledger describes.  ``options`` are what the derivation shows it was made with; ``notes`` what a
    reader must know (a convention that finds nothing to count); ``domain`` where the sizes hold beyond being
    positive integers.
    """

    model: str
    convention: str
    storages: tuple[Storage, ...]
    parameters: tuple[Parameter, ...]
    free: tuple[sympy.Symbol, ...]
    defaults: Mapping[sympy.Symbol, sympy.Expr]
    numbers: Mapping[sympy.Symbol, int]
    options: Mapping[str, Any] = field(default_factory=dict)
    per_layer: bool = False
    layer: str | None = None
    repeats: Mapping[str, sympy.Expr] = field(default_factory=dict)
    domain: Any = sympy.true
    notes: tuple[str, ...] = ()

    @property
    def trainable(self) -> tuple[Parameter, ...]:
        """The parameters that get gradients and optimizer state."""
        return tuple(p for p in self.parameters if p.trainable)

    @property
    def parameter_count(self) -> sympy.Expr:
        """Elements of the trainable parameters, all copies."""
        # grouped by (count, shape): a graph of many layers has few shapes, and sympy sums k equal terms as k * term
        groups: dict[tuple[sympy.Expr, tuple[sympy.Expr, ...]], int] = {}
        for p in self.trainable:
            groups[(p.count, p.shape)] = groups.get((p.count, p.shape), 0) + 1
        return sympy.Add(*(k * c * numel(s) for (c, s), k in groups.items()))
