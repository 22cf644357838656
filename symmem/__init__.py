"""symmem: closed-form formulas for the memory a neural network needs to train.

>>> import symmem
>>> d = symmem.derive("vit-b16", attention="naive", per_layer=True)    # what PyTorch autograd keeps
>>> d.activations / 4
16*B*H*S + B*S**2*h + 4*B*S
>>> symmem.derive("vit-b16", convention="paper", attention="naive", per_layer=True).activations / 4
9*B*H*S + B*S**2*h

The public names are imported on first use, so that ``import symmem`` (and ``symmem --help``) stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from .errors import SymmemError

__version__ = "0.1.0"

#: public name -> (module, attribute)
_PUBLIC = {
    "Derivation": ("derivation", "Derivation"),
    "Storage": ("derivation", "Storage"),
    "Term": ("derivation", "Term"),
    "derive": ("api", "derive"),
    "trace": ("api", "trace"),
    "Regime": ("training", "Regime"),
    "GraphBuilder": ("graph", "GraphBuilder"),
    "Model": ("graph", "Model"),
    "build": ("models", "build"),
    "available_models": ("models", "available"),
    "show": ("api", "show"),
    "symbol": ("symbols", "symbol"),
    "TensorSpec": ("tensor", "TensorSpec"),
    "format_bytes": ("units", "format_bytes"),
    "parse_size": ("units", "parse_size"),
}

__all__ = ["SymmemError", "__version__", *sorted(_PUBLIC)]


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        module, attr = _PUBLIC[name]
        value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'symmem' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
