"""Tensors a CUDA kernel allocates and frees inside one aten op, below every dispatch mode.

A recorded step (:mod:`.recording`) sees the storages an op returns; a kernel's own scratch never reaches a
dispatch mode.  On the GPU such a tensor still counts: the caching allocator holds it beside the op's inputs and
outputs while the kernel runs, and where that moment is the step's peak, ``torch.cuda.max_memory_allocated`` says
so.  The built-in graphs count the same tensors as their ops' backward temporaries (``ops/tensors._softmax_grads``);
this is the traced step's side of the one rule.

One such kernel is known and measured: CUDA's softmax backward (``structured_softmax_backward_cuda_out::impl``,
aten/src/ATen/native/cuda/SoftMax.cu) first computes ``Tensor tmp = grad * output;`` and only then writes the
gradient input it was handed, so ``tmp`` -- one tensor the size of the softmax output -- is alive with the incoming
gradient, the saved output and the new gradient.  The allocator's history on an H200 put eager attention's peak
there (docs/cuda.md, "Eager attention on the GPU").  Log-softmax's CUDA backward
(``_log_softmax_backward_data``) makes none; neither does the CPU's softmax backward.

The other: cuBLAS takes a matrix whose strides it can name, and ``prepare_matrix_for_cublas``
(aten/src/ATen/native/cuda/Blas.cpp) clones any other operand of ``mm`` / ``addmm`` dense first, freed when the
product is written.  A training step meets this where a loss ``.sum()`` (or ``.mean()``) hands the logits its 0-dim
gradient expanded with strides 0: each ``mm`` of the head's backward clones it (the allocator's history with C++
frames on an H200, docs/cuda.md, "Pipeline stages on one GPU").  The CPU's ``addmm`` clones it too, inside the
kernel; the CPU's recorded step, checked against a dispatcher-level tracker, leaves it out as that tracker does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..record.identity import dtype_name

#: the aten op whose CUDA kernel makes ``tmp = grad * output`` (``_softmax_backward_data(grad, output, dim, dtype)``)
SOFTMAX_BACKWARD = "aten._softmax_backward_data.default"
#: the matrix products whose operands cuBLAS needs dense or transposed-dense: op -> the operands' positions
MATRIX_PRODUCTS = {"aten.mm.default": (0, 1), "aten.addmm.default": (1, 2)}
#: the devices whose kernels make these temporaries: the tensors' device decides which kernel runs.  (A CPU-only
#: test adds ``cpu`` to run the rule on CPU fakes, whose recorded step is otherwise a fake CUDA step's.)
DEVICES: tuple[str, ...] = ("cuda",)


@dataclass(frozen=True)
class KernelTemporary:
    """One tensor a kernel makes and frees while it runs: its bytes (an int, or the size expression of a fake
    tensor's ``SymInt``), dtype and shape."""

    nbytes: Any
    dtype: str
    shape: tuple[Any, ...]


def _expr(n: Any) -> Any:
    return n.node.expr if hasattr(n, "node") else int(n)


def cuda_temporaries(op: str, args: Sequence[Any]) -> tuple[KernelTemporary, ...]:
    """What the CUDA kernel of aten op ``op`` (its overload's name) allocates for itself while it runs, given the
    op's positional arguments; nothing for an op on other devices, or with no such kernel.

    >>> import pytest; torch = pytest.importorskip("torch")
    >>> from types import SimpleNamespace
    >>> out = SimpleNamespace(dtype=torch.float32, shape=(2, 4, 64, 64), device=torch.device("cuda"),
    ...                       numel=lambda: 2 * 4 * 64 * 64)  # the softmax output: a CUDA tensor's metadata
    >>> cuda_temporaries(SOFTMAX_BACKWARD, (out, out, -1, torch.float32))
    (KernelTemporary(nbytes=131072, dtype='float32', shape=(2, 4, 64, 64)),)
    >>> cuda_temporaries("aten._log_softmax_backward_data.default", (out, out, -1, torch.float32))
    ()
    """
    if op in MATRIX_PRODUCTS:
        return _cublas_copies(op, args)
    if op != SOFTMAX_BACKWARD or len(args) < 2:
        return ()
    import torch

    grad, output = args[0], args[1]
    if not isinstance(getattr(output, "device", None), torch.device) or output.device.type not in DEVICES:
        return ()
    dtype = torch.promote_types(grad.dtype, output.dtype)  # ``grad * output``: the softmax output's size
    return (KernelTemporary(_expr(output.numel() * dtype.itemsize), dtype_name(dtype), tuple(output.shape)),)


def _cublas_copies(op: str, args: Sequence[Any]) -> tuple[KernelTemporary, ...]:
    """The dense clones ``prepare_matrix_for_cublas`` makes of ``op``'s operands that are broadcast (a stride 0 along
    a dimension longer than one: an expanded gradient) -- one at a time, each while its product runs.

    >>> import pytest; torch = pytest.importorskip("torch")
    >>> from types import SimpleNamespace
    >>> grad = SimpleNamespace(dtype=torch.float32, shape=(32, 64), device=torch.device("cuda"),
    ...                        stride=lambda: (0, 0), numel=lambda: 32 * 64)   # ones expanded to (B*S, V)
    >>> weight = SimpleNamespace(dtype=torch.float32, shape=(64, 16), device=torch.device("cuda"),
    ...                          stride=lambda: (16, 1), numel=lambda: 64 * 16)
    >>> cuda_temporaries("aten.mm.default", (grad, weight))
    (KernelTemporary(nbytes=8192, dtype='float32', shape=(32, 64)),)
    >>> cuda_temporaries("aten.mm.default", (weight, weight))
    ()
    """
    import torch

    found = []
    for i in MATRIX_PRODUCTS[op]:
        x = args[i] if i < len(args) else None
        if not isinstance(getattr(x, "device", None), torch.device) or x.device.type not in DEVICES:
            continue
        broadcast = any(isinstance(st, int) and st == 0 and not (isinstance(n, int) and n == 1)
                        for st, n in zip(x.stride(), x.shape, strict=False))
        if broadcast:
            found.append(KernelTemporary(_expr(x.numel() * x.dtype.itemsize), dtype_name(x.dtype), tuple(x.shape)))
    return tuple(found)
