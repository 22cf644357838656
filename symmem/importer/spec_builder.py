"""A module and its example inputs from a SPEC, as a picklable callable: what a worker process of
:func:`symmem.record.distributed.measure_jobs` builds and trains for a traced module (``Job.builder``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SpecBuilder:
    """A module and its example inputs from a SPEC (:func:`symmem.importer.sources.load`), picklable.  ``config`` is
    hf:'s ``--config``; the module is built in training mode with the seed set.

    >>> SpecBuilder("hf:gpt2", (("n_layer", 2),))
    SpecBuilder(spec='hf:gpt2', config=(('n_layer', 2),), seed=0)
    """

    spec: str
    config: tuple[tuple[str, Any], ...] = ()
    seed: int = 0

    def __call__(self) -> tuple[Any, tuple[Any, ...]]:
        import torch

        from .sources import load

        torch.manual_seed(self.seed)
        loaded = load(self.spec, config=dict(self.config) or None)
        ex = loaded.example_inputs
        return loaded.module.train(), tuple(ex.values()) if isinstance(ex, dict) else tuple(ex)
