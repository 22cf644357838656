"""Metadata-only fake kernels for batch norm and ``threshold_backward``: what their decompositions make, made directly.

With symbolic sizes, ``FakeTensorMode`` runs ``native_batch_norm``, ``native_batch_norm_backward`` and
``threshold_backward`` as Python decompositions (``torch._decomp``: their C++ meta kernels do not take SymInts): a
dozen symbolic elementwise ops and reductions each, 2-7 ms of CPU for one op whose outputs are a fresh tensor the
input's size and two of the channel count.  ResNet-50 runs 12 distinct shapes of each (53 batch norms): ~0.2 s of a
traced step.  A recorder sees only the op's outputs (the decomposition's temporaries run below its dispatch mode), so
making those outputs directly -- same sizes, strides, storage bytes, dtypes and devices, and no guard -- records the
same step.

Only the case whose outputs are plain to read off is taken: training, CPU, float32 or float64 throughout, the inputs'
strides the contiguous strides of their sizes (expression by expression, so that asking adds no guard); everything
else runs the decomposition as before.  There the decomposition's outputs are contiguous tensors of the input's size
(elementwise ops of contiguous operands), its per-channel results ``(C,)`` in the input's dtype, and
``native_batch_norm_backward`` returns the input's gradient even where ``output_mask[0]`` is False (as the
decomposition does; the real kernel returns none).  ``tests/test_trace_speed.py`` compares them with the
decompositions' outputs and guards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..record.shape_cache import fresh

#: the fast kernels are used (False: PyTorch's decompositions run, for comparisons)
FAST = True

#: dtypes whose computation dtype is themselves (the decompositions upcast 16-bit inputs to float32)
_FLOATS = ("float32", "float64")


def _expr(x: Any) -> Any:
    node = getattr(x, "node", None)
    return node.expr if node is not None else int(x)


def plain(t: Any) -> bool:
    """Whether ``t`` is a strided CPU tensor in float32/float64 whose strides are the contiguous strides of its sizes
    (each expression equal; no guard asked), with at least 2 dimensions and no known value.

    >>> import pytest; torch = pytest.importorskip("torch")
    >>> x = torch.empty(2, 3, 4)
    >>> plain(x), plain(x.transpose(1, 2)), plain(x.half()), plain(x[0, 0])
    (True, False, False, False)
    """
    import torch

    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.device.type != "cpu" or t.dim() < 2 \
            or str(t.dtype).split(".")[-1] not in _FLOATS or getattr(t, "constant", None) is not None:
        return False  # (a fake tensor with a known value: the decomposition would propagate it)
    expected: Any = 1
    for size, stride in zip(reversed(tuple(t.shape)), reversed(t.stride()), strict=True):
        if _expr(stride) != _expr(expected):
            return False
        expected = expected * size
    return True


def _alike(t: Any, *others: Any) -> bool:
    """Whether ``others`` (None allowed) share ``t``'s dtype and device."""
    return all(o is None or (o.dtype == t.dtype and o.device == t.device) for o in others)


def _same_sizes(a: Any, b: Any) -> bool:
    return tuple(_expr(d) for d in a.shape) == tuple(_expr(d) for d in b.shape)


def batch_norm(op: Callable[..., Any]) -> Callable[..., Any]:
    """``native_batch_norm`` whose training run on a plain input makes its three outputs directly (see the module
    docstring); anything else runs ``op``."""
    def impl(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 8:
            return op(*args, **kwargs)
        x, weight, bias, mean, var, training = args[:6]
        if training is not True or not plain(x) or not _alike(x, weight, bias, mean, var):
            return op(*args, **kwargs)
        channels = (x.shape[1],)
        return fresh(tuple(x.shape), x.dtype, x.device), fresh(channels, x.dtype, x.device), \
            fresh(channels, x.dtype, x.device)

    return impl


def batch_norm_backward(op: Callable[..., Any]) -> Callable[..., Any]:
    """``native_batch_norm_backward`` of a training run on plain gradient and input: the input's gradient (always, as
    the decomposition), the weight's and bias's where ``output_mask`` asks."""
    def impl(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 10:
            return op(*args, **kwargs)
        grad, x, weight, mean, var, save_mean, save_invstd, train, _, mask = args
        if train is not True or not plain(grad) or not plain(x) or not _same_sizes(grad, x) \
                or not _alike(x, grad, weight, mean, var, save_mean, save_invstd) or save_mean is None \
                or save_invstd is None or len(mask) != 3:
            return op(*args, **kwargs)
        channels = (x.shape[1],)
        return (fresh(tuple(x.shape), x.dtype, x.device), fresh(channels, x.dtype, x.device) if mask[1] else None,
                fresh(channels, x.dtype, x.device) if mask[2] else None)

    return impl


def threshold_backward(op: Callable[..., Any]) -> Callable[..., Any]:
    """``threshold_backward`` of plain gradient and input of the same sizes and dtype: a fresh tensor like the
    gradient (the decomposition's ``where(x <= threshold, 0, grad)``)."""
    def impl(*args: Any, **kwargs: Any) -> Any:
        if kwargs or len(args) != 3:
            return op(*args, **kwargs)
        grad, x, _ = args
        if not plain(grad) or not plain(x) or not _same_sizes(grad, x) or not _alike(grad, x):
            return op(*args, **kwargs)
        return fresh(tuple(grad.shape), grad.dtype, grad.device)

    return impl
