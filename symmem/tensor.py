"""Tensor specifications with symbolic shapes, and the byte size of each dtype.

A tensor's dtype is either a concrete dtype (``float32``, ``int64``, ``bool`` ...) or ``"act"``: the
activation dtype of the training regime, resolved only when bytes are counted.  That keeps one graph valid
for FP32 and for 16-bit training.

>>> from symmem.symbols import B, S, H
>>> t = TensorSpec((B, S, H))
>>> t.numel
B*H*S
>>> t.nbytes()
4*B*H*S
>>> TensorSpec((B, S), "int64").nbytes()
8*B*S

``strides`` is the memory layout, in elements per dimension; None is contiguous row-major, the layout of
every new tensor.  View rules set it (:mod:`symmem.strides`), and storage decisions follow from it.

>>> TensorSpec((S, B), strides=(1, S)) == TensorSpec((S, B))     # a transposed (B, S) tensor
False
>>> TensorSpec((B, S), strides=(S, 1)).strides is None          # contiguous strides are stored as None
True
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import sympy

from .errors import SymmemError
from .shapes import numel
from .strides import contiguous
from .units import MAX_SIZE as _MAX_SIZE

#: Bytes per element.  ``act`` is the regime's activation dtype and is resolved by :func:`dtype_bytes`.
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "tf32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

ACT = "act"
#: The largest size a dimension (or any symbol's value) may have: PyTorch sizes are int64 (in :mod:`symmem.units`,
#: which the command line reads without importing sympy).
MAX_SIZE = _MAX_SIZE


def dtype_bytes(dtype: str, activation_dtype: str = "float32") -> int:
    """Bytes per element of ``dtype``; ``"act"`` means ``activation_dtype``.

    >>> dtype_bytes("act", "bfloat16"), dtype_bytes("int64")
    (2, 8)
    """
    name = activation_dtype if dtype == ACT else dtype
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise SymmemError(f"unknown dtype {name!r}; known: {', '.join(DTYPE_BYTES)}") from None


def as_shape(shape: Iterable[object]) -> tuple[sympy.Expr, ...]:
    """A shape as a tuple of sympy expressions; ints and symbols are accepted, strings are not."""
    if isinstance(shape, str) or not isinstance(shape, Iterable):
        raise SymmemError(f"a shape is a tuple of sizes (ints or sympy expressions), not {shape!r}")
    out = []
    for d in shape:
        if isinstance(d, str):
            raise SymmemError(f"shape entries must be ints or sympy expressions, not the string {d!r}")
        try:
            e = sympy.sympify(d, strict=True)
        except sympy.SympifyError:
            raise SymmemError(f"shape entries must be ints or sympy expressions, not {d!r}") from None
        if not isinstance(e, sympy.Expr) or isinstance(d, bool):
            raise SymmemError(f"shape entries must be ints or sympy expressions, not {d!r}")
        if e.is_number and not (e.is_integer and e.is_positive):
            raise SymmemError(f"shape {tuple(shape)} has a dimension {e} that is not a positive integer")
        out.append(e)
    return tuple(out)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor: symbolic shape, dtype, a role that conventions may key on, and its strides (None: contiguous)."""

    shape: tuple[sympy.Expr, ...]
    dtype: str = ACT
    role: str | None = None
    strides: tuple[sympy.Expr, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", as_shape(self.shape))
        if self.dtype != ACT and self.dtype not in DTYPE_BYTES:
            raise SymmemError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")
        if self.strides is not None:
            if isinstance(self.strides, str) or not isinstance(self.strides, Iterable):
                raise SymmemError(f"strides are a tuple (one per dimension) or None, not {self.strides!r}")
            strides = tuple(sympy.sympify(st, strict=True) for st in self.strides)
            if len(strides) != len(self.shape):
                raise SymmemError(f"strides {strides} do not fit the shape {self.shape}")
            # one spelling per layout, so that equal tensors compare equal: contiguous is None
            object.__setattr__(self, "strides", None if strides == contiguous(self.shape) else strides)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> sympy.Expr:
        # kept on the spec (a cache on a frozen value; not a field: equality and hashing are the fields'): every
        # walk of a step asks each output's and saved tensor's size, a sympy product through sympy's cache each time
        found = self.__dict__.get("_numel")
        if found is None:
            found = numel(self.shape)
            object.__setattr__(self, "_numel", found)
        return found

    def nbytes(self, activation_dtype: str = "float32") -> sympy.Expr:
        return self.numel * dtype_bytes(self.dtype, activation_dtype)

    def with_(self, **changes: object) -> TensorSpec:
        """A copy with some fields changed."""
        if changes.keys() == {"role"} and (changes["role"] is None or isinstance(changes["role"], str)):
            # only the role: the shape and dtype are checked already (every op's output is made this way)
            spec = object.__new__(TensorSpec)
            object.__setattr__(spec, "shape", self.shape)
            object.__setattr__(spec, "dtype", self.dtype)
            object.__setattr__(spec, "role", changes["role"])
            object.__setattr__(spec, "strides", self.strides)
            return spec
        fields = {"shape": self.shape, "dtype": self.dtype, "role": self.role, "strides": self.strides}
        fields.update(changes)
        return TensorSpec(**fields)  # type: ignore[arg-type]

    def __str__(self) -> str:
        dims = ", ".join(str(d) for d in self.shape)
        return f"({dims}):{self.dtype}"
