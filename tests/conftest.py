"""Settings of the test session.

* PyTorch's CPU ops run on one thread.  The PyTorch-backed tests run thousands of tiny ops (32x32 images,
  batches of 2-8); on a 2-core machine that is also doing other work, two OpenMP threads spin against each other
  and the same tests take 3-6x longer (tests/test_verify.py's zoo: 12-19 s against 3 s).  What they measure (the
  bytes autograd keeps, the live bytes op by op) does not depend on the thread count.  Set ``OMP_NUM_THREADS``
  to choose otherwise.
* End-to-end runs -- real PyTorch training steps and measurements, Jupyter kernels, LaTeX -- are marked ``slow``.
  CI runs everything; ``python -m pytest -m "not slow"`` leaves them out while iterating.
"""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

#: test modules that run PyTorch, a Jupyter kernel or LaTeX end to end
SLOW = {"test_importer.py", "test_lm_loss.py", "test_notebooks.py", "test_paper.py", "test_peak.py",
        "test_pytorch_sequence.py", "test_pytorch_vision.py", "test_trace_derivation.py", "test_trace_peak.py",
        "test_tracker.py", "test_verify.py"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: an end-to-end run (real PyTorch, a Jupyter kernel, LaTeX); CI runs it")
    torch = sys.modules.get("torch")  # imported before this file (a plugin): set its thread count directly
    if torch is not None and os.environ["OMP_NUM_THREADS"] == "1":
        torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW:
            item.add_marker(pytest.mark.slow)
