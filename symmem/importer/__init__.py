"""Trace a user's ``torch.nn.Module`` into exact symbolic formulas of what training keeps (issue 9).

:func:`trace_module` runs the module once on fake tensors whose batch/sequence/image sizes are symbols and
returns a :class:`Trace`: every storage autograd keeps for backward with its byte formula, the guards
PyTorch assumed (the formula's domain), the parameters, and the repeated blocks folded.  Needs ``torch``.

The whole training step (forward, loss, backward, optimizer step, ``zero_grad``) runs on fake tensors too:
:mod:`.recording` records the live bytes after every op, :mod:`.traced_step` turns them into the peak's formula
(what :func:`symmem.trace` attaches to its derivation), :mod:`.wrap` runs a module under autocast, activation
checkpointing or another layer count.  :mod:`.traced` makes the traced module's ledger, :mod:`.sources` loads a
module from a SPEC (``hf:gpt2``, ``pkg.mod:fn``).
"""

from .records import Check, Guard, Repeat, Save, Trace, TracedParameter, TracedStorage, TracedSymbol
from .trace import trace_module

__all__ = ["Check", "Guard", "Repeat", "Save", "Trace", "TracedParameter", "TracedStorage", "TracedSymbol",
           "trace_module"]
