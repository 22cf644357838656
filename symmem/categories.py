"""The vocabularies of memory, in one place: what a training step's timeline shows, what a recorder sees on real or
fake tensors, and the phases of a recorded step.

>>> RECORDED_TO_STEP["saved"], RECORDED_TO_STEP["buffer"]
('activation', 'parameter')
>>> set(RECORDED_TO_STEP.values()) <= set(STEP)
True
"""

from __future__ import annotations

#: Categories of live memory over a training step, in the order breakdowns list them.
STEP: tuple[str, ...] = ("parameter", "optimizer_state", "gradient", "input", "activation", "loss",
                         "activation_grad", "temporary")

#: What a live-bytes recorder calls a storage, in priority order (a storage takes the first that applies).
RECORDED: tuple[str, ...] = ("parameter", "buffer", "input", "optimizer_state", "gradient", "saved", "output",
                             "activation_grad", "temporary", "external")

#: A recorded category -> the step's: a buffer counts as a parameter, a saved tensor as an activation, the
#: output (the loss and what the training loop holds) as the loss, what came from outside as a temporary.
RECORDED_TO_STEP: dict[str, str] = {
    "parameter": "parameter", "buffer": "parameter", "input": "input", "optimizer_state": "optimizer_state",
    "gradient": "gradient", "saved": "activation", "output": "loss", "activation_grad": "activation_grad",
    "temporary": "temporary", "external": "temporary"}

#: The phases of one recorded training step, in order.
RECORDED_PHASES: tuple[str, ...] = ("forward", "loss", "backward", "step", "zero_grad")
