"""Faithful PyTorch reference modules of the built-in models, for ``symmem verify`` and the tests.

A reference is an ``nn.Module`` that runs the same ops as the code people train with (torchvision,
timm, Hugging Face), written here because those packages are not dependencies.  Each family module
registers a **factory** for one or more model names::

    register("resnet50", factory)                 # one name
    register(("vgg11", "vgg11_bn"), factory)      # several names

    def factory(numbers: Mapping[str, int], options: Mapping[str, Any]) -> tuple[nn.Module, tuple[Tensor, ...]]

``numbers`` maps every symbol name of the derivation to its value (``{"B": 2, "Hi": 32, "K": 1000, ...}``,
:attr:`symmem.derivation.Derivation.numbers` by name); ``options`` are the derivation's options: the model
builder's (``depth``, ``dropout``, ``attention`` ...) and the convention's (``device``).  The factory
returns the module and the tuple of tensors its forward takes (the batch, built on CPU; the caller moves
both).  :func:`reference` looks a name up, importing the family modules listed in ``_MODULES`` on first
use (a missing module is skipped).  Needs ``torch``.

>>> sorted(n for n in names() if n.startswith("resnet"))[:3]
['resnet101', 'resnet152', 'resnet18']
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import SymmemError

Factory = Callable[[Mapping[str, int], Mapping[str, Any]], tuple[Any, tuple[Any, ...]]]
_FACTORIES: dict[str, Factory] = {}
_MODULES = ("vision_models", "sequence_models")


def register(names: str | Iterable[str], factory: Factory) -> None:
    """Make ``factory`` the reference of the model ``names`` (a name or an iterable of names)."""
    for name in (names,) if isinstance(names, str) else names:
        _FACTORIES[name] = factory


def _load() -> None:
    for module in _MODULES:
        importlib.import_module(f"{__name__}.{module}")


def names() -> tuple[str, ...]:
    """Every model name with a reference module."""
    _load()
    return tuple(_FACTORIES)


def reference(model: str, numbers: Mapping[str, int], options: Mapping[str, Any] | None = None
              ) -> tuple[Any, tuple[Any, ...]]:
    """The reference module of ``model`` at ``numbers`` and the inputs for its forward."""
    _load()
    try:
        factory = _FACTORIES[model]
    except KeyError:
        raise SymmemError(f"no PyTorch reference for model {model!r}; references exist for: "
                          f"{', '.join(sorted(_FACTORIES))}") from None
    return factory(numbers, dict(options or {}))
