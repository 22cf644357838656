"""Every notebook in notebooks/ runs top to bottom in a python3 kernel, its namespace empty (and is stored without
outputs).

The kernel is a subprocess: it gets this checkout on its PYTHONPATH so that it imports the symmem under test.  One
kernel runs the notebooks in turn (the module runs on one worker: conftest.WHOLE), each after ``%reset -f``: a
notebook still defines and imports every name it uses, but torch, sympy, matplotlib and symmem are imported once
(a kernel's start and those imports: ~1.7 and ~4.5 CPU-s, of the ~42 CPU-s of six kernels).  What a fresh kernel
would check besides -- that nothing a notebook relies on survives in the modules' state -- the first notebook
still meets, and the others' own asserts compare with real steps and printed figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        KernelSpecManager().get_kernel_spec("python3")
    except NoSuchKernel:
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user"], check=True,
                       capture_output=True)
    old = {k: os.environ.get(k) for k in ("PYTHONPATH", "MPLBACKEND", "IPYTHONDIR")}
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), old["PYTHONPATH"]) if p)
    os.environ["MPLBACKEND"] = "Agg"
    # the kernel runs its startup file first: the cyclic collector's threshold of the test processes (conftest.py),
    # which the kernels' torch, sympy and symmem work does not depend on -- ~10% less CPU in these tests
    startup = tmp_path_factory.mktemp("ipython") / "profile_default" / "startup"
    startup.mkdir(parents=True)
    (startup / "00-gc.py").write_text("import gc\ngc.set_threshold(200_000, 30, 30)\n")
    os.environ["IPYTHONDIR"] = str(startup.parent.parent)
    yield
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def test_there_are_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS][:5] == ["01", "02", "03", "04", "05"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_names_sources_by_what_they_are(path):
    """Sources are named by what they are (the FP32 analysis of ResNet-50 and ViT-B/16, a Q&A about CS231n
    estimates), never by the project's file names for them."""
    text = "\n".join("".join(c.source) for c in nbformat.read(path, as_version=4).cells).lower()
    for word in ("seed 00", "seed's", "the seed", "asker"):
        assert word not in text, f"{path.name}: {word!r}"


def test_tells_one_story():
    """Notebook 04 traces a module of the user's own and sizes its batch from the traced peak, checked against a
    real step (its own assert, run by test_runs); no leftover cell for a feature 'not available yet'; no sweep of
    GPT-2 past its 1,024 positions."""
    texts = {p.name[:2]: "\n".join("".join(c.source) for c in nbformat.read(p, as_version=4).cells) for p in NOTEBOOKS}
    assert "symmem.trace(" in texts["04"] and "track_step(" in texts["04"] and 'convention="paper"' not in texts["04"]
    assert all("not available yet" not in t for t in texts.values())
    assert "4097" not in texts["03"] and "range(64, 1025" in texts["03"]
    assert '"paper convention' not in texts["05"] or 'convention": "paper"' in texts["05"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip the outputs"


@pytest.fixture(scope="module")
def kernel(kernel_env):
    """One kernel for the module's notebooks, started by the first (in notebooks/), shut down at the end."""
    from jupyter_client.manager import AsyncKernelManager
    from nbclient.util import run_sync

    km = AsyncKernelManager(kernel_name="python3")
    yield km
    if km.has_kernel:
        run_sync(km.shutdown_kernel)(now=True)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs(path, kernel):
    nb = nbformat.read(path, as_version=4)
    # a cell first: the namespace the previous notebook left, emptied (%reset -f: names, not imported modules)
    nb.cells.insert(0, nbformat.v4.new_code_cell("%reset -f"))
    # One more cell at the end: the kernel must have imported this checkout's symmem.
    nb.cells.append(nbformat.v4.new_code_cell("import symmem, pathlib; print(pathlib.Path(symmem.__file__).parent)"))
    nbclient.NotebookClient(nb, km=kernel, kernel_name="python3", timeout=180,
                            resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert nb.cells[-1].outputs[0]["text"].strip() == str(ROOT / "symmem")
