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

from collections.abc import Mapping, Sequence
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
    check_companions(kwargs if kwargs else dict(enumerate(args)), positions)
    for name, size in examples.items():
        if size < min_size:
            raise SymmemError(f"symbol {name} has example size {size}; trace with sizes >= 2 (PyTorch specializes "
                              "sizes 0 and 1; the value at 1 is traced apart with size_one=True)")
    return Inputs(args, kwargs, positions, examples)


def check_companions(inputs: Mapping[Key, Any], positions: Mapping[str, Sequence[tuple[Key, int]]], *,
                     cli: bool = False, follow: Sequence[Key] = ()) -> None:
    """Refuse a symbol declared on a dimension of one tensor input but not on the same dimension of another input
    of the same shape (``labels`` beside ``input_ids``): left at its example size, that input pins the formula to
    where the sizes agree (a causal LM's loss views the logits as ``(B*S, V)`` against ``B*S`` labels, so the
    domain would hold ``Eq(B*S, 16)``).  A dimension given a symbol of its own is declared.  ``cli``: the message
    in ``--dims`` words, which also names ``--dims B,S`` where the inputs missed are ``follow`` (those the
    conventional names apply to).  The one check :func:`check_inputs` (the Python API) and the command line's
    ``--dims`` (:func:`symmem.importer.sources.parse_dims`) make.

    >>> import pytest; torch = pytest.importorskip("torch")
    >>> ids = torch.zeros(2, 8, dtype=torch.long)
    >>> check_companions({"input_ids": ids, "labels": ids}, {"S": [("input_ids", 1)]})
    Traceback (most recent call last):
    symmem.errors.SymmemError: dims: S is dimension 1 of input 'input_ids'; declare it on 'labels' too ...
    """
    import torch

    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
    taken = {(k, d % tensors[k].dim()) for pairs in positions.values() for k, d in pairs if k in tensors}
    for name, pairs in positions.items():
        for key, dim in pairs:
            if key not in tensors:
                continue  # not a tensor: check_inputs says so
            shape, d = tuple(tensors[key].shape), dim % tensors[key].dim()
            missing = [k for k, v in tensors.items() if k != key and tuple(v.shape) == shape and (k, d) not in taken]
            if not missing:
                continue
            named = ", ".join(repr(m) for m in missing)
            if cli:
                alike = ", or write --dims B,S" if all(m in follow for m in missing) else ""
                raise SymmemError(f"--dims: {name} is dimension {d} of {key!r}; declare it on {named} too "
                                  f"({name}={missing[0]}:{d}), which has the same layout{alike}")
            pairs_text = ", ".join(repr(p) for p in (*((k, x) for k, x in pairs), *((m, d) for m in missing)))
            raise SymmemError(f"dims: {name} is dimension {d} of input {key!r}; declare it on {named} too "
                              f"({name!r}: [{pairs_text}]), an input of the same shape {shape}; left at its "
                              "example size it would confine the formula to where their sizes agree")
