"""Every notebook in notebooks/ runs top to bottom in IPython's shell, its namespace empty (and is stored without
outputs).

The shell is the one a Jupyter kernel runs each cell in (``ipykernel``'s shell is IPython's ``InteractiveShell``
behind ZeroMQ): each code cell through ``run_cell`` -- its magics, its last expression displayed in every format
(a derivation's HTML, LaTeX and text, as a kernel sends them), matplotlib's Agg backend as the kernel had it -- each
notebook after ``%reset -f`` and from its own folder, in the test process.  That process has imported torch, sympy
and symmem already (the suite's collection), so the kernel's start and its own imports of them (~1.7 and ~4.5
CPU-s) are not paid; what the kernel added besides is the transport of the messages, which a notebook's code
never sees.  The notebooks' own asserts compare with real steps and printed figures, as before.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import gc
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _read(path: Path):
    """The notebook, by nbformat (imported here, not at collection: only the worker that runs this module needs
    it, or IPython)."""
    return pytest.importorskip("nbformat").read(path, as_version=4)


def test_there_are_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS][:5] == ["01", "02", "03", "04", "05"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_names_sources_by_what_they_are(path):
    """Sources are named by what they are (the FP32 analysis of ResNet-50 and ViT-B/16, a Q&A about CS231n
    estimates), never by the project's file names for them."""
    text = "\n".join("".join(c.source) for c in _read(path).cells).lower()
    for word in ("seed 00", "seed's", "the seed", "asker"):
        assert word not in text, f"{path.name}: {word!r}"


def test_tells_one_story():
    """Notebook 04 traces a module of the user's own and sizes its batch from the traced peak, checked against a
    real step (its own assert, run by test_runs); no leftover cell for a feature 'not available yet'; no sweep of
    GPT-2 past its 1,024 positions."""
    texts = {p.name[:2]: "\n".join("".join(c.source) for c in _read(p).cells) for p in NOTEBOOKS}
    assert "symmem.trace(" in texts["04"] and "track_step(" in texts["04"] and 'convention="paper"' not in texts["04"]
    assert all("not available yet" not in t for t in texts.values())
    assert "4097" not in texts["03"] and "range(64, 1025" in texts["03"]
    assert '"paper convention' not in texts["05"] or 'convention": "paper"' in texts["05"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = _read(path)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip the outputs"


@contextlib.contextmanager
def _no_full_collection():
    """IPython's reset (``%reset -f``, ``InteractiveShell.reset``) ends in ``gc.collect()`` twice: a walk of every
    object of the process, which in a kernel's small heap is cheap and in a test worker's (torch, transformers,
    sympy and every earlier test's objects: 0.3-1 CPU-s a walk) was most of what the notebooks' test cost more in the
    suite than alone.  Nothing a notebook runs waits for that collection: the names are gone from the namespace as
    before, the garbage in cycles goes at the collector's next automatic pass.  The shell's last reset, when the
    module ends, keeps its one walk: the worker's later tests start with the notebooks' garbage freed, as before
    (without it, test_readme after them read 1.3-2.1 CPU-s more in two paired runs)."""
    collect = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = collect


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """IPython's shell, the one a Jupyter kernel runs cells in, here in the test process (which has imported torch,
    sympy and symmem already), with a profile of its own and matplotlib's Agg backend; its hold on ``sys`` (the
    ``__main__`` module, the display hook) given back at the end."""
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False  # a kernel's history database: nothing a notebook reads
    old, names = os.environ.get("MPLBACKEND"), set(vars(builtins))
    os.environ["MPLBACKEND"] = "Agg"
    shell = InteractiveShell(config=config, ipython_dir=str(tmp_path_factory.mktemp("ipython")))
    try:
        yield shell
    finally:
        shell.reset(new_session=False)  # the last notebook's objects: not held for the worker's other tests
        atexit.unregister(shell.atexit_operations)
        shell.restore_sys_module_state()
        for name in set(vars(builtins)) - names:  # __IPYTHON__ and display: the tests after these are not in IPython
            delattr(builtins, name)
        import matplotlib.pyplot as plt

        plt.close("all")
        if old is None:
            os.environ.pop("MPLBACKEND", None)
        else:
            os.environ["MPLBACKEND"] = old


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs(path, shell, monkeypatch):
    """Each code cell in turn, as a kernel runs it (``run_cell``: magics, the display of the last expression in
    every format a notebook shows), from the notebook's folder, after ``%reset -f``."""
    import matplotlib.pyplot as plt

    monkeypatch.chdir(path.parent)
    nb = _read(path)
    with _no_full_collection():
        shell.run_cell("%reset -f")
    try:
        for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
            result = shell.run_cell("".join(cell.source), store_history=True)
            error = result.error_before_exec or result.error_in_exec
            assert result.success, f"{path.name}: code cell {i + 1}: {error!r}"
    finally:
        plt.close("all")
    assert Path(sys.modules["symmem"].__file__).parent == ROOT / "symmem"


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    """A real python3 Jupyter kernel (a subprocess on this checkout's PYTHONPATH, matplotlib's Agg backend) for the
    deep twin of test_runs; shut down at the end."""
    pytest.importorskip("nbclient")
    import subprocess

    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
    from jupyter_client.manager import AsyncKernelManager
    from nbclient.util import run_sync

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user"], check=True, capture_output=True)
    old = {k: os.environ.get(k) for k in ("PYTHONPATH", "MPLBACKEND")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old["PYTHONPATH"]) if p)
    os.environ["MPLBACKEND"] = "Agg"
    km = AsyncKernelManager(kernel_name="python3")
    try:
        yield km
    finally:
        if km.has_kernel:
            run_sync(km.shutdown_kernel)(now=True)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.mark.deep
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_in_a_jupyter_kernel(path, kernel):
    """The deep twin of test_runs: each notebook through nbclient in a real kernel (its process and message
    transport, which the default test leaves out), after ``%reset -f``; the kernel imported this checkout."""
    import nbclient
    import nbformat

    nb = _read(path)
    nb.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))
    nb.cells.append(nbformat.v4.new_code_cell("import symmem, pathlib; print(pathlib.Path(symmem.__file__).parent)"))
    nbclient.NotebookClient(nb, km=kernel, kernel_name="python3", timeout=180,
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    assert nb.cells[-1].outputs[0]["text"].strip() == str(ROOT / "symmem")
