"""The ``torch.optim`` optimizers a recorded step runs, built one way for real and fake steps alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import SymmemError
from .identity import require_torch

OPTIMIZERS: tuple[str, ...] = ("sgd", "sgd-momentum", "adam", "adamw")
IMPLS: tuple[str, ...] = ("for-loop", "foreach", "fused")


def make_optimizer(params: Sequence[Any], optimizer: str, impl: str = "for-loop", lr: float = 1e-3) -> Any:
    """The ``torch.optim`` optimizer ``optimizer`` with implementation ``impl`` (``foreach=False``,
    ``foreach=True`` or ``fused=True``); SGD with momentum 0.9, AdamW with weight decay 0.01, else defaults.

    >>> torch = getattr(__import__("pytest"), "importorskip")("torch")
    >>> make_optimizer([torch.nn.Parameter(torch.zeros(2))], "adamw", "foreach").defaults["weight_decay"]
    0.01
    """
    torch = require_torch()
    if impl not in IMPLS:
        raise SymmemError(f"unknown optimizer implementation {impl!r}; choose from {', '.join(IMPLS)}")
    flags: dict[str, Any] = {"foreach": impl == "foreach"}
    if impl == "fused":
        flags = {"fused": True}
    params = list(params)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, **flags)
    if optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, **flags)
    if optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, **flags)
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, **flags)
    raise SymmemError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")


def state_tensors(opt: Any) -> list[Any]:
    """Every tensor of an optimizer's state (momentum buffers, Adam's moments and step counts)."""
    import torch

    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
