"""The two recorders, on real or fake tensors alike: what autograd saves in a forward (:mod:`.saved_tensors`) and
the live bytes of a training step op by op (:mod:`.live_bytes`, whole steps in :mod:`.steps`); and the truth they
give for a derivation (:mod:`.verify`).

Both read a tensor through :mod:`.identity` (one storage identity; the byte reader -- an ``int`` for a real
storage, a sympy size for a fake one -- is the only thing that differs between real and fake runs) and know the
running module through :mod:`.modules`.  Like PyTorch's ``torch/distributed/_tools/mem_tracker.py``, the same
code gives the truth (real tensors) and the formula (fake tensors with symbolic sizes, :mod:`symmem.importer`).
Nothing here imports torch at import time.
"""
