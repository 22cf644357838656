"""symmem: closed-form formulas for the memory a neural network needs to train.

>>> import symmem
>>> d = symmem.derive("vit-b16", attention="naive", per_layer=True)
>>> d.activations / 4
9*B*H*S + B*S**2*h
"""

from .derive import Derivation, Term, derive
from .errors import SymmemError
from .graph import GraphBuilder, Model
from .models import available as models
from .models import build
from .report.jupyter import show
from .symbols import symbol
from .tensor import TensorSpec
from .units import format_bytes, parse_size

__version__ = "0.1.0"

__all__ = [
    "Derivation", "GraphBuilder", "Model", "SymmemError", "TensorSpec", "Term", "__version__", "build",
    "derive", "format_bytes", "models", "parse_size", "show", "symbol",
]
