"""symmem's bytecode and the test modules' rewritten bytecode, written once by the xdist controller before its
workers start.

Under ``PYTHONDONTWRITEBYTECODE`` (set on the project's machines and on CI) no process writes bytecode, so every
process compiles what it imports from source: each test worker symmem's ~170 modules (its doctests import all of
them) and pytest's assertion rewriting of every test module; each gloo forkserver, notebook kernel and ``symmem``
subprocess the symmem modules it imports.  Python and pytest still *read* bytecode that is there (``__pycache__``,
checked against the source's mtime and size), so the controller -- which imports no test module itself -- writes
it once, and the workers and their subprocesses find it.  Nothing is written where bytecode is written anyway
(the variable unset) or where the directories are read-only (then every process compiles, as before).
"""

from __future__ import annotations

import compileall
import importlib.util
import sys
from pathlib import Path

import pytest


def write_once(config: pytest.Config) -> None:
    """In the xdist controller of a run with workers: compile symmem (the copy the workers import) and rewrite the
    test modules into their ``__pycache__``."""
    if not sys.dont_write_bytecode or hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", 0):
        return
    spec = importlib.util.find_spec("symmem")  # where it is found, without importing it
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            compileall.compile_dir(location, quiet=2, workers=1)
    _rewrite_tests(config, _named(config, Path(__file__).parent))


def _named(config: pytest.Config, folder: Path) -> list[Path]:
    """The test modules of ``folder`` the run's arguments name: all where an argument is a folder holding them
    (the default run: pyproject's testpaths), else the files named (``tests/test_x.py::test_y``)."""
    everything = sorted(folder.glob("test_*.py"))
    named: set[Path] = set()
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path.is_dir() and (path == folder or path in folder.parents):
            return everything
        if path.parent == folder and path.name.startswith("test_") and path.suffix == ".py":
            named.add(path)
    return sorted(named)


def _rewrite_tests(config: pytest.Config, modules: list[Path]) -> None:
    """What pytest's assertion rewriter caches where it may write: each ``test_*.py``'s rewritten code, under the
    name and in the format its reader checks (``_read_pyc``).  Those are pytest's internals: where they differ
    from what this expects nothing is written and each worker rewrites, as before."""
    if config.getoption("assertmode") != "rewrite":
        return
    try:
        from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _rewrite_test, _write_pyc, get_cache_dir
    except ImportError:
        return
    for fn in modules:
        cache = get_cache_dir(fn)
        pyc = cache / (fn.name[:-3] + PYC_TAIL)
        if _read_pyc(fn, pyc) is not None:
            continue
        try:
            cache.mkdir(exist_ok=True)
            stat, co = _rewrite_test(fn, config)
        except (OSError, SyntaxError):
            continue  # a worker meets the same error where it matters
        _write_pyc(_Quiet(), co, stat, pyc)


class _Quiet:
    """The assertion state's ``trace`` that ``_write_pyc`` calls on a failed write: nothing to say here."""

    @staticmethod
    def trace(message: str) -> None:
        del message
