"""What every view leads with: the peak of a training step, the number that must fit, or the one line saying why
there is none; and the names the views give the totals (the JSON keeps the quantities' names).

>>> from symmem import derive
>>> name_of("total"), peak_state(derive("gpt2", tensor_parallel=True))[1][:60]
('kept after forward + parameters', "no peak: the tensor-parallel peak follows DTensor's standard")
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import SymmemError

if TYPE_CHECKING:
    from ..derivation import Derivation

#: What each total is, as the views name it (the JSON keys stay the quantities' names): ``total`` is what is kept
#: at the end of the forward pass plus the parameter side, not what must fit (the peak is; it can be larger or
#: smaller: ViT-B/16's is smaller).
LABELS = {"total": "kept after forward + parameters"}
#: the same, where the text table is too narrow for them
SHORT_LABELS = {"total": "kept + parameters"}
#: What the headline of every view says of the peak (it is the number that must fit on the device).
PEAK_LABEL = "peak of a training step (what must fit)"


def papers_stage(d: Derivation) -> bool:
    """Whether ``total`` is the papers' accounting of a pipeline stage (Korthikanti et al.: L/p layers, the
    micro-batches in flight, the embedding and the head both), which no stage holds: the peak per stage is each
    device's, and can be below it."""
    regime = getattr(d, "regime", None)
    return bool(getattr(regime, "pipeline_parallel", False))


#: the plot's and the table's words for ``total`` under pipeline parallelism (:func:`papers_stage`)
PAPERS_STAGE = "the papers' stage (embedding and head both): kept + parameters"


def name_of(key: str, short: bool = False) -> str:
    """The name a view gives a total: ``total`` -> ``kept after forward + parameters`` (``short``: ``kept +
    parameters``); others as they are."""
    return (SHORT_LABELS if short else LABELS).get(key, key)


def peak_state(d: Derivation) -> tuple[list[tuple[str, int, Any]], str | None]:
    """:func:`step_peaks` and None, or nothing and the one line every view prints where there is no peak
    (``no peak: ...``: a convention counting by role, tensor parallel, a fitted trace, a loss that cannot be run ...).

    >>> from symmem import derive
    >>> peak_state(derive("gpt2", tensor_parallel=True))[1]
    "no peak: the tensor-parallel peak follows DTensor's standard plan, which is Llama's; not gpt2"
    """
    try:
        return [(key, d.value(key), d.peak_at(step)) for key, step in (("peak", "steady"),
                                                                        ("peak_first_step", "first"))], None
    except SymmemError as e:
        why = " ".join(str(e).split())
        if "grad can be implicitly created only for scalar outputs" in why:
            # backward() of a loss that is not a number: say what to change rather than where autograd failed
            why = (f"loss={d.options.get('loss', '?')!r} is not a scalar here, so backward() cannot run: give "
                   "loss='sum' or 'cross-entropy', or a module that returns its loss")
        return [], why if why.startswith("no peak") else f"no peak: {why}"


def per_device(d: Derivation) -> dict[str, Any] | None:
    """What a step split over devices says per device at the derivation's numbers (pipeline parallelism: each
    stage's steady-step peak, ``peak_per_stage``, and the largest stage, ``peak_stage``); None for one device."""
    each = getattr(d.step, "per_stage", None)
    if each is None:
        return None
    try:
        return each(d.numbers)
    except SymmemError:
        return None  # the peak line says why
