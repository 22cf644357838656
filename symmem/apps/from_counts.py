"""Training memory from counts alone: the CS231n memory rule, and a Q&A about CS231n estimates reproduced.

A Q&A about CS231n estimates asks: "my network has 532,752 activations and 19,072,984 parameters, a 180x50x1
input and a batch of 128 - how much memory does training take?"  :func:`from_counts` derives the model given
by such counts (:mod:`symmem.models.counts`) under the ``cs231n`` convention and shows three accountings:

* **one image** (:attr:`CountsReport.one_image`): the CS231n recipe as the question applies it - activations
  for one image (the batch is left out), parameters x3, the input batch: the question's 224.69 "MB";
* **x2 x batch** (:attr:`CountsReport.per_batch`): activations x2 for backward x batch, parameters x3, the
  input batch: the answer's 742.34 "MB", with 4.0645 rounded to 4.06 before multiplying by 128 (unrounded:
  742.92);
* **exact** (:attr:`CountsReport.correct`): an FP32 Adam accounting from the engine: every activation of every
  image kept for backward, the input counted as CS231n counts it (an activation volume), CS231n's x2 for
  backward as its own term, and 16 bytes per parameter (weights, gradients, two Adam moments) instead of 12.

All three "MB" are MiB (bytes / 1024^2); the decimal megabytes are shown too.  With other numbers the report
speaks of your network and words the first two neutrally (the CS231n recipe, rounded step by step).

>>> r = from_counts(activations=532_752, parameters=19_072_984, input_shape=(180, 50, 1), batch=128)
>>> r.one_image.printed, r.per_batch.printed, r.reproduces_qa
(224.69, 742.34, True)
>>> round(r.correct.total / 2**20, 2)
820.09
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SymmemError
from ..units import UNITS

MiB = UNITS["MiB"]


#: The numbers of the Q&A about CS231n estimates: its network, input and batch.
QA = {"activations": 532_752, "parameters": 19_072_984, "input_shape": (180, 50, 1), "batch": 128}


@dataclass(frozen=True)
class Accounting:
    """One way of adding the memory up: labelled parts in bytes, and the figure as printed after rounding each
    step to 0.01 (the Q&A's arithmetic; None where nothing is rounded)."""

    name: str
    parts: tuple[tuple[str, int], ...]
    printed: float | None
    note: str

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)


@dataclass(frozen=True)
class CountsReport:
    """Three accountings of a network given by counts: the CS231n recipe for one image, the recipe with x2 for
    backward times the batch, and the engine's exact FP32 + Adam accounting."""

    one_image: Accounting
    per_batch: Accounting
    correct: Accounting
    lower_bound: int
    differences: tuple[str, ...]
    #: one line naming the network: yours, or the Q&A's when the numbers are its numbers
    network: str = ""
    #: whether the numbers are the Q&A's (then the first two accountings are its question and its answer)
    reproduces_qa: bool = False

    @property
    def asker(self) -> Accounting:
        """Former name of :attr:`one_image`."""
        return self.one_image

    @property
    def answer(self) -> Accounting:
        """Former name of :attr:`per_batch`."""
        return self.per_batch

    def text(self) -> str:
        """The three accountings and what separates them, as printed by ``symmem counts``."""
        lines = [self.network] if self.network else []
        label = "printed: {:.2f} 'MB'" if self.reproduces_qa else "rounded step by step: {:.2f} MiB"
        for acc in (self.one_image, self.per_batch, self.correct):
            lines.append(f"{acc.name}: {acc.total / MiB:.2f} MiB = {acc.total / 10**6:.2f} MB"
                         + (f"   ({label.format(acc.printed)})" if acc.printed is not None else ""))
            for part, b in acc.parts:
                lines.append(f"    {part:<58} {b / MiB:10.2f} MiB")
            lines.append(f"    {acc.note}")
        lines.append(f"without the x2 for backward (only what is kept): {self.lower_bound / MiB:.2f} MiB")
        lines.append("differences:")
        lines += [f"  - {d}" for d in self.differences]
        return "\n".join(lines)


def _r2(x: float) -> float:
    return round(x, 2)


def from_counts(activations: int, parameters: int, input_shape: tuple[int, ...], batch: int) -> CountsReport:
    """Three accountings of a network given by counts (``input_shape`` as width x height x depth).

    The engine derives the ``counts`` model under the ``cs231n`` convention twice: with ``sgd-momentum``
    (CS231n's "parameters x3") for the two recipe figures, with ``adam`` for the exact one.  When the numbers
    are those of the Q&A about CS231n estimates (:data:`QA`), the first two figures are its question's and its
    answer's, and the report says so; otherwise it speaks of your network.
    """
    from ..api import derive

    for name, v in (("activations", activations), ("parameters", parameters), ("batch", batch)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SymmemError(f"{name} must be a positive integer, got {v!r}")
    if len(input_shape) != 3 or any(not isinstance(d, int) or d <= 0 for d in input_shape):
        raise SymmemError(f"input_shape must be three positive integers (width, height, depth), got {input_shape}")
    width, height, depth = input_shape
    qa = (activations, parameters, tuple(input_shape), batch) == (QA["activations"], QA["parameters"],
                                                                  QA["input_shape"], QA["batch"])
    options = {"activations": activations, "parameters": parameters, "input": (depth, height, width)}
    cs = derive("counts", convention="cs231n", optimizer="sgd-momentum", values={"B": batch}, **options)
    one = cs.at(B=1)
    acts = cs.sum(role="activations")
    image = cs.sum(role="input")
    params3 = cs.value("parameter_memory")
    act1, act_b, img_b = one.evaluate(acts), cs.evaluate(acts), cs.evaluate(image)
    twice = _r2(2 * act1 / MiB)

    first = ("the question's figure (CS231n recipe, batch left out)" if qa
             else "CS231n recipe, activations of one image (batch left out)")
    one_image = Accounting(
        first,
        (("activations of one image x4 B", act1), ("parameters x3 (weights, gradients, cache) x4 B", params3),
         (f"input batch ({batch} images) x4 B", img_b)),
        _r2(_r2(act1 / MiB) + _r2(params3 / MiB) + _r2(img_b / MiB)),
        ("the printed figure adds the rounded parts; 'MB' is MiB" if qa
         else "rounded step by step, the parts are added after rounding each to 0.01 MiB"))
    second = ("the answer's figure (activations x2 x batch)" if qa
              else "CS231n recipe, activations x2 (backward) x batch")
    per_batch = Accounting(
        second,
        (("activations x2 (forward + backward) x batch x4 B", 2 * act_b), ("parameters x3 x4 B", params3),
         ("input batch x4 B", img_b)),
        _r2(twice * batch + _r2(params3 / MiB) + _r2(img_b / MiB)),
        f"{'the printed figure' if qa else 'rounded step by step, the figure'} multiplies the rounded "
        f"{2 * act1 / MiB:.4f} -> {twice} MiB by {batch}; unrounded it is {(2 * act_b + params3 + img_b) / MiB:.2f} "
        "MiB")

    ad = derive("counts", convention="cs231n", optimizer="adam", values={"B": batch}, **options)
    parts = [(f"kept activations, {batch} images x4 B", ad.evaluate(ad.sum(role="activations"))),
             ("input batch (an activation volume in CS231n) x4 B", ad.evaluate(ad.sum(role="input"))),
             ("backward: gradients of the activations (CS231n's x2)", ad.value("transient"))]
    parts += [(f"{t.name} ({t.expr / ad.parameters} B per parameter)", ad.evaluate(t.expr))
              for t in ad.terms if t.category == "parameter"]
    correct = Accounting("exact: FP32 + Adam under the CS231n rule (engine)", tuple(parts), None,
                         "an upper bound: a framework frees most activation gradients as backward proceeds; "
                         "workspaces and allocator overhead are not counted")
    lower = correct.total - ad.value("transient")
    who = "the question" if qa else "the one-image figure"
    which = "the answer" if qa else "the x2 x batch figure, rounded step by step,"
    shape = "x".join(str(d) for d in input_shape)
    network = (f"{'the network of a Q&A about CS231n estimates' if qa else 'your network'}: {activations:,} "
               f"activation values per image, {parameters:,} parameters, a {shape} input (width x height x depth), "
               f"a batch of {batch}, FP32 (4 bytes per value)")
    whose = "its" if qa else "your network's"
    differences = (
        f"{who} counts {whose} activations for one image; memory for "
        f"activations grows with the batch: x{batch} ({act1 / MiB:.2f} -> {act_b / MiB:.2f} MiB)"
        + (" - the question's own guess of 'another 260.13 MB'" if qa else ""),
        f"{who} leaves out the backward pass; CS231n doubles the activations for their gradients",
        "parameters x3 assumes one optimizer cache (momentum); Adam keeps two moments: 16 bytes per "
        f"parameter, {params3 / MiB:.2f} -> {ad.value('parameter_memory') / MiB:.2f} MiB",
        f"{which} rounds 2 x activations to {twice} MiB before multiplying by {batch}: "
        f"{per_batch.printed} instead of {per_batch.total / MiB:.2f}",
        f"{'the answer' if qa else 'the recipe'} counts the input once, outside the activations; CS231n counts the "
        "input volume as an activation (so it is doubled too)",
        (f"both 'MB' are MiB (divided by 1024^2): {per_batch.printed} 'MB' is {per_batch.total / 10**6:.2f} MB"
         if qa else f"a MiB is 1024^2 bytes, a MB 10^6: {per_batch.total / MiB:.2f} MiB is "
         f"{per_batch.total / 10**6:.2f} MB"),
    )
    return CountsReport(one_image, per_batch, correct, lower, differences, network, qa)


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
