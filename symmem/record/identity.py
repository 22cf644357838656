"""What a recorder reads off a tensor: its storage's identity and size, its dtype's name, the tensors inside an
output.  The identity holds for real and fake tensors; the size is where the two differ (:func:`concrete_nbytes`,
:func:`symbolic_nbytes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import SymmemError


def storage_key(t: Any) -> int:
    """Identity of a tensor's storage: the address of its ``StorageImpl``, shared by every view and unique while
    the storage lives (real tensors, and fake ones, whose storages are real ``StorageImpl`` objects on meta).
    Raises ``RuntimeError``/``NotImplementedError`` for a tensor without a storage (sparse, nested)."""
    return t.untyped_storage()._cdata


def concrete_nbytes(storage: Any) -> int:
    """The bytes of a real storage."""
    return int(storage.nbytes())


def symbolic_nbytes(storage: Any) -> Any:
    """The bytes of a fake storage: the sympy expression behind its ``SymInt`` (in the ShapeEnv's symbols), or an
    ``int`` where the size is concrete."""
    n = storage.nbytes()
    return n.node.expr if hasattr(n, "node") else int(n)


_OP_NAMES: dict[Any, str] = {}


def op_name(func: Any) -> str:
    """``str(func)`` of an op overload (``aten.mm.default``), worked out once per overload: recorders read it for
    every op."""
    name = _OP_NAMES.get(func)
    if name is None:
        name = _OP_NAMES[func] = str(func)
    return name


def dtype_name(dtype: Any) -> str:
    """``torch.float32`` -> ``float32``: symmem's own dtype names."""
    return str(dtype).removeprefix("torch.")


def tensors(obj: Any, seen: set[int] | None = None) -> Iterator[Any]:
    """Tensors inside nested tuples, lists, dicts and dataclass-like outputs (Hugging Face ``ModelOutput``), each
    once.

    >>> import pytest; torch = pytest.importorskip("torch")
    >>> t, u = torch.zeros(1), torch.ones(2)
    >>> [x.numel() for x in tensors([t, (u, 3, {"a": t}), None])]
    [1, 2]
    """
    import torch

    seen = set() if seen is None else seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, list | tuple) else None
    if items is None:
        if hasattr(obj, "to_tuple"):
            yield from tensors(obj.to_tuple(), seen)
        return
    # every aten op's arguments and outputs pass here: tensors and plain values inside are read without a generator
    for v in items:
        if isinstance(v, torch.Tensor):
            if id(v) not in seen:
                seen.add(id(v))
                yield v
        elif isinstance(v, dict | list | tuple) or hasattr(v, "to_tuple"):
            yield from tensors(v, seen)


def first_tensor(out: Any) -> Any:
    """The tensor a loss reduces: the output itself, or the first tensor of a tuple, list or mapping (a Hugging
    Face ``ModelOutput``'s logits or last hidden state)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            return item
    raise SymmemError(f"the module returns {type(out).__name__}, with no tensor to reduce for the loss: pass "
                      "loss= a callable taking the output, or 'output' for a module that returns its loss")


def require_torch() -> Any:
    """``torch``, or the error saying how to install it."""
    try:
        import torch
    except ImportError:
        raise SymmemError("tracking runs PyTorch, which is not installed: pip install torch==2.13.0 "
                          "(the CPU build), or pip install 'symmem[torch]'") from None
    return torch
