"""Make Hugging Face transformers take its eager code path on fake tensors.

transformers (5.23) asks ``transformers.utils.import_utils.is_tracing(tensor)`` before it reads mask and
position values: ``is_tracing`` is true under dynamo, ``torch.jit`` tracing, CUDA/XPU graph capture, for
``torch.fx`` proxies and for *fake tensors* (``is_fake_tensor``).  When it is true the library cannot rule out
padding or packed sequences and takes the general path: ``masking_utils.find_packed_sequence_indices``
returns a packed-sequence mask, ``_ignore_causal_mask_sdpa`` / ``_ignore_bidirectional_mask_sdpa`` refuse to
skip the mask, so a (B, 1, S, S) boolean mask is built and SDPA keeps it (and Llama's grouped-query
attention switches from ``enable_gqa`` to ``repeat_kv``).  A real eager forward reads the values instead
and skips all of it.

During a trace ``is_fake_tensor`` answers False (every other reason for ``is_tracing`` is left alone, and
``is_torchdynamo_compiling`` / ``torch.jit.is_tracing`` are already false outside a compiler).  The value
reads that follow (``fast_all(padding_mask)``, ``(packed_sequence_mask[:, -1] == 0).all()``,
``torch.all(attention_mask == 1)``) are data-dependent boolean reads on fake tensors: the recorder answers
them with the values a real forward at the example sizes read, in the same order, or — with no real
forward possible (weights on ``meta``) — True, the unpadded, unpacked case, recorded in ``Trace.notes``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


def _false(x: object) -> bool:
    return False


@contextmanager
def eager_predicates() -> Iterator[None]:
    """While active, transformers does not treat fake tensors as a sign of tracing (no-op without transformers)."""
    mod = sys.modules.get("transformers.utils.import_utils")
    if mod is None or not hasattr(mod, "is_fake_tensor"):
        yield
        return
    original = mod.is_fake_tensor
    mod.is_fake_tensor = _false
    try:
        yield
    finally:
        mod.is_fake_tensor = original
