"""Save rules shared by every family: views and ops whose backward needs no tensor, and linear.

Sources: PyTorch ``tools/autograd/derivatives.yaml``.  ``add``/``sub`` need only sizes; views need only
sizes/strides; ``cat`` needs only sizes; ``addmm``/``mm`` (what ``nn.Linear`` runs) keep the input and
the weight (a parameter, so not an activation).
"""

from __future__ import annotations

from ..conventions import Saved
from . import RuleContext, saves


@saves("input", "parameter", "block_input", "identity", "reshape", "transpose", "permute", "select", "slice",
       "expand", "flatten", "contiguous", "clone", "add", "sub", "concat")
def _nothing(ctx: RuleContext) -> list[Saved]:
    return []


@saves("linear")
def _linear(ctx: RuleContext) -> list[Saved]:
    return [ctx.input(0)]
