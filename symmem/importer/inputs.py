"""Example inputs and declared sizes: check them, and name the symbols.

``example_inputs`` is a tuple (positional arguments) or a dict (keyword arguments) of tensors and plain
values; ``dims`` maps a symbol name to the (input position or keyword, dimension) pairs where it appears.
Names symmem knows (``B``, ``S``, ``Hi``, ``Wi`` …) become symmem's own symbols; others a positive integer
``sympy.Symbol``.

>>> sym_for("B") is __import__("symmem").symbols.B
True
>>> sym_for("T").is_integer and sym_for("T").is_positive
True
>>> normalize_dims({"B": (0, 0), "S": [(0, 1)]})
{'B': ((0, 0),), 'S': ((0, 1),)}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sympy

from ..errors import SymmemError
from ..symbols import symbol

Key = int | str


def sym_for(name: str) -> sympy.Symbol:
    """symmem's symbol called ``name`` when it has one, else a fresh positive-integer symbol."""
    if not isinstance(name, str) or not name.isidentifier():
        raise SymmemError(f"a symbol name must be an identifier, got {name!r}")
    try:
        return symbol(name)
    except SymmemError:
        return sympy.Symbol(name, positive=True, integer=True)


def normalize_dims(dims: Any) -> dict[str, tuple[tuple[Key, int], ...]]:
    """``{"B": [(0, 0)], ...}`` with a lone pair also accepted (``{"B": (0, 0)}``)."""
    if not isinstance(dims, dict):
        raise SymmemError(f"dims must map a symbol name to (input, dimension) pairs, got {type(dims).__name__}")
    out: dict[str, tuple[tuple[Key, int], ...]] = {}
    for name, where in dims.items():
        sym_for(name)
        if isinstance(where, tuple) and len(where) == 2 and isinstance(where[1], int) \
                and isinstance(where[0], int | str):
            where = [where]
        pairs = []
        try:
            items = list(where)
        except TypeError:
            raise SymmemError(f"dims[{name!r}] must be a list of (input, dimension) pairs, got {where!r}") from None
        if not items:
            raise SymmemError(f"dims[{name!r}] names no (input, dimension) pair")
        for pair in items:
            if not (isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], int | str)
                    and isinstance(pair[1], int) and not isinstance(pair[1], bool)):
                raise SymmemError(f"dims[{name!r}]: {pair!r} is not an (input position or keyword, dimension) pair")
            pairs.append((pair[0], pair[1]))
        out[name] = tuple(pairs)
    return out


@dataclass(frozen=True)
class Inputs:
    """Checked example inputs: how they were given, and where every declared symbol sits."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    positions: dict[str, tuple[tuple[Key, int], ...]]  # symbol name -> (key, dim >= 0) pairs
    examples: dict[str, int]  # symbol name -> example size

    def items(self) -> list[tuple[Key, Any]]:
        return [*enumerate(self.args), *self.kwargs.items()]

    def get(self, key: Key) -> Any:
        return self.args[key] if isinstance(key, int) else self.kwargs[key]

    def sizes_at(self, key: Key) -> dict[int, str]:
        """dimension -> symbol name for one input."""
        return {d: name for name, pairs in self.positions.items() for k, d in pairs if k == key}

    def rebuild(self, values: dict[Key, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword arguments with the given inputs replaced."""
        args = tuple(values.get(i, a) for i, a in enumerate(self.args))
        kwargs = {k: values.get(k, v) for k, v in self.kwargs.items()}
        return args, kwargs


def check_inputs(example_inputs: Any, dims: Any, *, min_size: int = 2) -> Inputs:
    """Check the example inputs against the declared sizes; a :class:`SymmemError` says what is wrong."""
    import torch

    if isinstance(example_inputs, dict):
        if not all(isinstance(k, str) for k in example_inputs):
            raise SymmemError("keyword example inputs need string keys")
        args: tuple[Any, ...] = ()
        kwargs = dict(example_inputs)
    elif isinstance(example_inputs, tuple | list):
        args, kwargs = tuple(example_inputs), {}
    elif isinstance(example_inputs, torch.Tensor):
        args, kwargs = (example_inputs,), {}
    else:
        raise SymmemError("example_inputs must be a tuple (positional) or a dict (keyword) of tensors and values, "
                          f"got {type(example_inputs).__name__}")
    norm = normalize_dims(dims)
    positions: dict[str, tuple[tuple[Key, int], ...]] = {}
    examples: dict[str, int] = {}
    taken: dict[tuple[Key, int], str] = {}
    for name, pairs in norm.items():
        fixed = []
        for key, dim in pairs:
            if isinstance(key, int):
                if not 0 <= key < len(args):
                    given = f"{len(args)} positional input{'s' * (len(args) != 1)}" if args else \
                        f"keyword inputs {sorted(kwargs)}"
                    raise SymmemError(f"symbol {name}: input position {key} does not exist; there are {given}")
                value = args[key]
            else:
                if key not in kwargs:
                    known = ", ".join(sorted(kwargs)) if kwargs else f"none (inputs are positional: 0..{len(args) - 1})"
                    raise SymmemError(f"symbol {name}: unknown input {key!r}; keyword inputs: {known}")
                value = kwargs[key]
            if not isinstance(value, torch.Tensor):
                raise SymmemError(f"symbol {name}: input {key!r} is a {type(value).__name__}, not a tensor")
            nd = value.dim()
            if not -nd <= dim < nd:
                raise SymmemError(f"symbol {name}: input {key!r} has {nd} dimension{'s' * (nd != 1)} "
                                  f"(shape {tuple(value.shape)}); dimension {dim} is out of range")
            dim = dim % nd
            if (key, dim) in taken and taken[(key, dim)] != name:
                raise SymmemError(f"input {key!r} dimension {dim} is declared as both {taken[(key, dim)]} and {name}")
            taken[(key, dim)] = name
            size = int(value.shape[dim])
            if name in examples and examples[name] != size:
                first = fixed[0] if fixed else positions[name][0]
                raise SymmemError(f"symbol {name} is {examples[name]} at input {first[0]!r} dimension {first[1]} but "
                                  f"{size} at input {key!r} dimension {dim}: its positions must agree in size")
            examples[name] = size
            fixed.append((key, dim))
        positions[name] = tuple(fixed)
    for name, size in examples.items():
        if size < min_size:
            raise SymmemError(f"symbol {name} has example size {size}; trace with sizes >= 2 (PyTorch specializes "
                              "sizes 0 and 1; the value at 1 is traced apart with size_one=True)")
    return Inputs(args, kwargs, positions, examples)
