"""Training regimes as data: bytes per parameter for each precision and optimizer.

A :class:`Regime` is a precision (what the weights and gradients cost, and the activation dtype) plus an
optimizer (what state it keeps per parameter).  Every number lives in the two tables below.

>>> r = Regime("fp32", "adamw")
>>> r.bytes_per_parameter
16
>>> [c for c, _ in r.components()]
['weights', 'gradients', 'exp_avg', 'exp_avg_sq']
>>> Regime("fp32", "sgd-momentum").bytes_per_parameter
12
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from .errors import SymmemError


@dataclass(frozen=True)
class Precision:
    """Per-parameter bytes of the weight and gradient copies, and the dtype activations are kept in."""

    name: str
    activation_dtype: str
    components: tuple[tuple[str, int], ...]
    description: str


@dataclass(frozen=True)
class Optimizer:
    """Per-parameter bytes of each optimizer state tensor (FP32 unless the optimizer says otherwise)."""

    name: str
    states: tuple[tuple[str, int], ...]
    description: str

    def state_bytes(self, shape: tuple[sympy.Expr, ...]) -> list[tuple[str, sympy.Expr]]:
        """Bytes of each state tensor for one parameter of ``shape``."""
        n = sympy.Mul(*shape) if shape else sympy.Integer(1)
        return [(name, n * b) for name, b in self.states]


PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", "float32", (("weights", 4), ("gradients", 4)),
                      "FP32 weights and gradients, FP32 activations"),
}

OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": Optimizer("sgd", (), "plain SGD: no state"),
    "sgd-momentum": Optimizer("sgd-momentum", (("momentum", 4),), "SGD with a momentum buffer"),
    "adam": Optimizer("adam", (("exp_avg", 4), ("exp_avg_sq", 4)), "Adam: first and second moments"),
    "adamw": Optimizer("adamw", (("exp_avg", 4), ("exp_avg_sq", 4)),
                       "AdamW: first and second moments (decoupled weight decay costs no memory)"),
}


def _lookup(table: dict, name: str, what: str):  # type: ignore[no-untyped-def]
    try:
        return table[name]
    except KeyError:
        raise SymmemError(f"unknown {what} {name!r}; known: {', '.join(table)}") from None


@dataclass(frozen=True)
class Regime:
    """A precision and an optimizer."""

    precision: str = "fp32"
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        _lookup(PRECISIONS, self.precision, "precision")
        _lookup(OPTIMIZERS, self.optimizer, "optimizer")

    @property
    def precision_spec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def optimizer_spec(self) -> Optimizer:
        return OPTIMIZERS[self.optimizer]

    @property
    def activation_dtype(self) -> str:
        return self.precision_spec.activation_dtype

    def components(self) -> list[tuple[str, int]]:
        """(name, bytes per parameter) for every per-parameter component, for elementwise optimizers."""
        return list(self.precision_spec.components) + list(self.optimizer_spec.states)

    @property
    def bytes_per_parameter(self) -> int:
        return sum(b for _, b in self.components())

    def parameter_terms(self, shapes: list[tuple[sympy.Expr, tuple[sympy.Expr, ...]]]
                        ) -> list[tuple[str, sympy.Expr]]:
        """Bytes per component, summed over parameters given as (count, shape) pairs."""
        totals: dict[str, list[sympy.Expr]] = {}
        for count, shape in shapes:
            n = sympy.Mul(*shape) if shape else sympy.Integer(1)
            for name, b in self.precision_spec.components:
                totals.setdefault(name, []).append(count * n * b)
            for name, e in self.optimizer_spec.state_bytes(shape):
                totals.setdefault(name, []).append(count * e)
        return [(name, sympy.Add(*parts)) for name, parts in totals.items()]
