"""The cyclic garbage collector while ``symmem trace`` runs: no young-generation passes.

A trace imports ``transformers`` and the model's code, builds the module, and records the step on fake tensors: some
millions of objects, nearly all alive until the command ends.  The collector's young passes (every 200,000 net
allocations under the ``symmem`` command, :func:`symmem.cli.entry`) walk them again and again and find almost no
garbage: 0.3-0.4 s of ``symmem trace hf:gpt2`` (6 layers) with its peak, about 6 % of the process.  What the
recorders need from the collector they ask for themselves (:meth:`symmem.record.saved_tensors.SavedRecorder.run`
collects the cycles a forward made), and they never depend on when a pass runs: a storage kept by a cycle is freed by
that explicit collection, not by a pass at some allocation count.

:func:`no_young_passes` switches the automatic passes off for the block and, after it, moves everything the block
left into the oldest generation without walking it (``gc.freeze`` then ``gc.unfreeze``); cyclic garbage made inside
is found by the next full collection, as it would be after a young pass promoted it.  A collector the caller switched
off, or objects the caller froze, are left as they are.

>>> import gc
>>> with no_young_passes():
...     gc.isenabled()
False
>>> gc.isenabled()
True
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

from ..graph import paused_gc


@contextmanager
def no_young_passes() -> Iterator[None]:
    """No automatic collection inside (:func:`symmem.graph.paused_gc`); afterwards what the block left is in the
    oldest generation, unwalked."""
    enabled = gc.isenabled()
    with paused_gc():
        try:
            yield
        finally:
            if enabled and gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
