"""Settings of the test session.

* PyTorch's CPU ops run on one thread.  The PyTorch-backed tests run thousands of tiny ops (32x32 images,
  batches of 2-8); on a 2-core machine that is also doing other work, two OpenMP threads spin against each other
  and the same tests take 3-6x longer (tests/test_verify.py's zoo: 12-19 s against 3 s).  What they measure (the
  bytes autograd keeps, the live bytes op by op) does not depend on the thread count.  Set ``OMP_NUM_THREADS``
  to choose otherwise.
* End-to-end runs -- real PyTorch training steps and measurements, the notebooks, LaTeX -- are marked ``slow``.
  CI runs everything; ``python -m pytest -m "not slow"`` leaves them out while iterating.
* A real run whose path (engine, mesh, schedule, model, traced or built-in, size parity) another case of the
  default suite already covers is marked ``deep``: left out unless ``-m`` names it (``python -m pytest -m deep``
  runs them alone; docs/testing.md).  Done here rather than by ``-m "not deep"`` in pyproject's options, so that
  ``-m "not slow"`` still leaves them out.
* The longest tests are collected first (:data:`LONG`), so that pytest-xdist starts them first and the short ones
  fill in around them, rather than one worker finishing a 20 s test alone at the end.  The real ``torch.distributed``
  runs are one ``xdist_group`` (``--dist loadgroup``, pyproject.toml): one worker runs them in turn, its ranks
  forked from the worker itself, which imports what they need once (tests/gloo_store.START; docs/testing.md, "Stop
  41: gloo41"); so is each module
  whose module-scoped fixtures are costly (:data:`WHOLE`), so that only one worker makes them.
* The cyclic collector runs its young pass every 200,000 net allocations, not every 700 (the ``symmem`` command's
  own setting, symmem.cli.entry): sympy, the tracer and the real steps make millions of small objects, almost none
  in cycles, and the default spent 13% of a 4-module subset's CPU walking them.  The measured steps free their
  tensors by reference counting, and the recorder collects where it needs to (symmem.record.saved_tensors): every
  byte-exact assertion holds under either setting.  Forked gloo ranks inherit it; those a deep test still forks
  from a forkserver (a fresh interpreter) get it through the server's preload (tests/forkserver_gc.py).
* At the session's end every object is frozen out of the cyclic collector (:func:`pytest_unconfigure`): the
  collections that pytest's own clean-up and the interpreter's exit make would walk each process's whole heap.
"""

from __future__ import annotations

import gc
import os
import sys

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
# the recorded-step cache (off for users: symmem/importer/step_cache.py): a test's records equal uncached ones
# (test_shape_cache.py), and the traced tests record the same steps again
os.environ.setdefault("SYMMEM_STEP_CACHE", "1")

#: test modules that run PyTorch, the notebooks or LaTeX end to end
SLOW = {"test_importer.py", "test_lm_loss.py", "test_notebooks.py", "test_paper.py", "test_peak.py",
        "test_pytorch_sequence.py", "test_pytorch_vision.py", "test_trace_derivation.py", "test_trace_peak.py",
        "test_tracker.py", "test_verify.py"}


def pytest_configure(config: pytest.Config) -> None:
    gc.set_threshold(200_000, 30, 30)
    from tests.precompiled import write_once

    write_once(config)  # the controller, before its workers start: symmem's bytecode and the rewritten tests
    _forkserver_inherits_the_threshold()
    config.addinivalue_line("markers", "slow: an end-to-end run (real PyTorch, the notebooks, LaTeX); CI runs it")
    config.addinivalue_line("markers", "deep: a real run whose path another case of the default suite covers; left out "
                            "unless -m names deep (python -m pytest -m deep)")
    torch = sys.modules.get("torch")  # imported before this file (a plugin): set its thread count directly
    if torch is not None and os.environ["OMP_NUM_THREADS"] == "1":
        torch.set_num_threads(1)


def _forkserver_inherits_the_threshold() -> None:
    """Every forkserver preload list (symmem.record.distributed.PRELOAD, the pipeline mesh runs' own) gets
    tests/forkserver_gc.py first, which sets the same threshold in the server, so the ranks it forks inherit it.  The
    server imports by name from the directory pytest runs in (Python 3.11's forkserver ignores the parent's
    sys.path); where that fails the import is skipped, and the ranks keep the default threshold."""
    import multiprocessing.forkserver as forkserver

    original = forkserver.set_forkserver_preload
    if getattr(original, "adds_gc", False):
        return

    def set_forkserver_preload(module_names: list[str]) -> None:
        original(["tests.forkserver_gc", *module_names])  # first: the server's own imports run under it too

    set_forkserver_preload.adds_gc = True  # type: ignore[attr-defined]
    forkserver.set_forkserver_preload = set_forkserver_preload


@pytest.hookimpl(tryfirst=True)
def pytest_unconfigure() -> None:
    """No test runs after this: the objects the session made need no more cyclic collection.  Without the freeze
    pytest's clean-up (its unraisable-exception check collects) and the interpreter's exit walk every one of them,
    seconds in each test worker's process, which the controller waits for."""
    gc.freeze()


#: the longest tests outside the gloo group (5-16 s each on 2 busy cores), by node id prefix, longest first
LONG = ("tests/test_lora.py::test_the_fine_tuning_page_runs",
        "tests/test_trace_peak.py::test_a_cache_made_per_layer_outside_the_blocks_folds_in_L",
        "tests/test_notebooks.py::test_runs[04_",
        "tests/test_symbolic_checks.py::test_verify_symbolic_checks_the_formula_where_it_was_not_fitted",
        "tests/test_model_parallel.py::test_against_the_engines",
        "tests/test_fsdp_tensor.py::test_every_rank_of_a_2x2_mesh_against_the_engine",
        "tests/test_trace_peak.py::test_a_stack_with_per_layer_types_folds_in_L",
        "tests/test_notebooks.py::test_runs[06_",
        "tests/test_regimes.py::test_zero_peak_is_the_papers_accounting_of_one_devices_step",
        "tests/test_symbolic_sizes.py::test_zoo_and_trace_agree_in_every_size")


def _first(item: pytest.Item) -> int:
    """Where ``item`` goes in the run order: its place in :data:`LONG`, else after all of them."""
    return next((i for i, prefix in enumerate(LONG) if item.nodeid.startswith(prefix)), len(LONG))


#: test modules whose module-scoped fixtures trace or measure models (2-9 s each): each runs on one worker
#: (``xdist_group``), so the fixture is made once, not once on each worker that gets one of the module's tests
WHOLE = {"test_hub.py", "test_importer.py", "test_lora.py", "test_notebooks.py", "test_paper.py",
         "test_symbolic_sizes.py", "test_trace_cli.py", "test_trace_peak.py", "test_verify.py", "test_zoo_drift.py",
         "test_cuda_stop37_measured.py",
         # its tests share 150 derivations (~4.5 CPU-s), made on first use and cached in the process
         "test_evaluator.py"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "deep" not in (config.getoption("markexpr") or ""):  # the deep runs only where -m asks for them
        deep = [item for item in items if item.get_closest_marker("deep")]
        if deep:
            config.hook.pytest_deselected(items=deep)
            items[:] = [item for item in items if not item.get_closest_marker("deep")]
    for item in items:
        if item.path.name in SLOW:
            item.add_marker(pytest.mark.slow)
        if item.path.name in WHOLE:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    items.sort(key=_first)  # stable: every other test keeps its place
