"""Training memory from counts alone, and seed 001's question answered three ways.

Seed 001 asks, following CS231n: "532,752 activations and 19,072,984 parameters, a 180x50x1 input, a batch of
128 - how much memory does training take?"  :func:`from_counts` derives the model given by those counts
(:mod:`symmem.models.counts`) under the ``cs231n`` convention and shows

* the **asker's** 224.69 "MB": activations for one image (the batch is forgotten), parameters x3, the
  input batch;
* the **answer's** 742.34 "MB": activations x2 x batch, parameters x3, the input batch - with 4.0645 rounded
  to 4.06 before multiplying by 128 (unrounded: 742.92);
* a **correct FP32 Adam accounting** from the engine: every activation of every image kept for backward,
  the input counted as CS231n counts it (an activation volume), CS231n's x2 for backward as its own term, and
  16 bytes per parameter (weights, gradients, two Adam moments) instead of 12.

All three "MB" are MiB (bytes / 1024^2); the decimal megabytes are shown too.

>>> r = from_counts(activations=532_752, parameters=19_072_984, input_shape=(180, 50, 1), batch=128)
>>> r.asker.printed, r.answer.printed
(224.69, 742.34)
>>> round(r.correct.total / 2**20, 2)
820.09
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import SymmemError
from .units import UNITS

MiB = UNITS["MiB"]


@dataclass(frozen=True)
class Accounting:
    """One way of adding the memory up: labelled parts in bytes, and the figure as its author printed it."""

    name: str
    parts: tuple[tuple[str, int], ...]
    printed: float | None
    note: str

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)


@dataclass(frozen=True)
class CountsReport:
    """The asker's, the answer's and the engine's accounting of a model given by counts."""

    asker: Accounting
    answer: Accounting
    correct: Accounting
    lower_bound: int
    differences: tuple[str, ...]

    def text(self) -> str:
        """The three accountings and what separates them, as printed by ``symmem counts``."""
        lines = []
        for acc in (self.asker, self.answer, self.correct):
            lines.append(f"{acc.name}: {acc.total / MiB:.2f} MiB = {acc.total / 10**6:.2f} MB"
                         + (f"   (printed: {acc.printed:.2f} 'MB')" if acc.printed is not None else ""))
            for label, b in acc.parts:
                lines.append(f"    {label:<58} {b / MiB:10.2f} MiB")
            lines.append(f"    {acc.note}")
        lines.append(f"without the x2 for backward (only what is kept): {self.lower_bound / MiB:.2f} MiB")
        lines.append("differences:")
        lines += [f"  - {d}" for d in self.differences]
        return "\n".join(lines)


def _r2(x: float) -> float:
    return round(x, 2)


def from_counts(activations: int, parameters: int, input_shape: tuple[int, ...], batch: int) -> CountsReport:
    """Seed 001's three accountings for a network given by counts (``input_shape`` as width x height x depth).

    The engine derives the ``counts`` model under the ``cs231n`` convention twice: with ``sgd-momentum``
    (CS231n's "parameters x3") for the asker's and the answer's figures, with ``adam`` for the correct one.
    """
    from .engine import derive

    for name, v in (("activations", activations), ("parameters", parameters), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SymmemError(f"{name} must be a positive integer, got {v!r}")
    if len(input_shape) != 3 or any(not isinstance(d, int) or d <= 0 for d in input_shape):
        raise SymmemError(f"input_shape must be three positive integers (width, height, depth), got {input_shape}")
    width, height, depth = input_shape
    options = {"activations": activations, "parameters": parameters, "input": (depth, height, width)}
    cs = derive("counts", convention="cs231n", optimizer="sgd-momentum", values={"B": batch}, **options)
    one = cs.at(B=1)
    acts = cs.sum(role="activations")
    image = cs.sum(role="input")
    params3 = cs.value("parameter_memory")
    act1, act_b, img_b = one.evaluate(acts), cs.evaluate(acts), cs.evaluate(image)

    asker = Accounting(
        "asker (CS231n recipe, batch forgotten)",
        (("activations of one image x4 B", act1), ("parameters x3 (weights, gradients, cache) x4 B", params3),
         (f"input batch ({batch} images) x4 B", img_b)),
        _r2(_r2(act1 / MiB) + _r2(params3 / MiB) + _r2(img_b / MiB)),
        "the printed figure adds the rounded parts; 'MB' is MiB")
    answer = Accounting(
        "answer (activations x2 x batch)",
        (("activations x2 (forward + backward) x batch x4 B", 2 * act_b), ("parameters x3 x4 B", params3),
         ("input batch x4 B", img_b)),
        _r2(_r2(2 * act1 / MiB) * batch + _r2(params3 / MiB) + _r2(img_b / MiB)),
        f"the printed figure multiplies the rounded {2 * act1 / MiB:.4f} -> {_r2(2 * act1 / MiB)} MiB by "
        f"{batch}; unrounded it is {(2 * act_b + params3 + img_b) / MiB:.2f} MiB")

    ad = derive("counts", convention="cs231n", optimizer="adam", values={"B": batch}, **options)
    parts = [(f"kept activations, {batch} images x4 B", ad.evaluate(ad.sum(role="activations"))),
             ("input batch (an activation volume in CS231n) x4 B", ad.evaluate(ad.sum(role="input"))),
             ("backward: gradients of the activations (CS231n's x2)", ad.value("transient"))]
    parts += [(f"{t.name} ({t.expr / ad.parameters} B per parameter)", ad.evaluate(t.expr))
              for t in ad.terms if t.category == "parameter"]
    correct = Accounting("engine: FP32 + Adam under the cs231n convention", tuple(parts), None,
                         "an upper bound: a framework frees most activation gradients as backward proceeds; "
                         "workspaces and allocator overhead are not counted")
    lower = correct.total - ad.value("transient")
    differences = (
        f"the asker counts activations for one image; memory for activations grows with the batch: x{batch} "
        f"({act1 / MiB:.2f} -> {act_b / MiB:.2f} MiB)",
        "the asker leaves out the backward pass; CS231n doubles the activations for their gradients",
        "parameters x3 assumes one optimizer cache (momentum); Adam keeps two moments: 16 bytes per "
        f"parameter, {params3 / MiB:.2f} -> {ad.value('parameter_memory') / MiB:.2f} MiB",
        f"the answer rounds 2 x activations to {_r2(2 * act1 / MiB)} MiB before multiplying by {batch}: "
        f"{answer.printed} instead of {answer.total / MiB:.2f}",
        "the answer counts the input once, outside the activations; CS231n counts the input volume as an "
        "activation (so it is doubled too)",
        f"both 'MB' are MiB (divided by 1024^2): {answer.printed} 'MB' is {answer.total / 10**6:.2f} MB",
    )
    return CountsReport(asker, answer, correct, lower, differences)


_SHAPE = re.compile(r"^\s*([1-9][0-9]{0,17})\s*[xX*]\s*([1-9][0-9]{0,17})\s*[xX*]\s*([1-9][0-9]{0,17})\s*$")


def parse_shape(text: str) -> tuple[int, int, int]:
    """``180x50x1`` -> (180, 50, 1).

    >>> parse_shape("180x50x1")
    (180, 50, 1)
    """
    m = _SHAPE.match(text)
    if not m:
        raise SymmemError(f"--input {text!r}: expected WIDTHxHEIGHTxDEPTH, e.g. 180x50x1")
    a, b, c = (int(g) for g in m.groups())
    return a, b, c
