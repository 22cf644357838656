"""The torch files a symbolic-shape guard's source location skips, found without importing ``torch.export``.

Every ``ShapeEnv.create_symbol`` and every guard asks ``symbolic_shapes.uninteresting_files()`` which frames are
torch's own, to name the first user frame (a guard's ``sloc``, symmem's :attr:`Guard.where`).  torch builds that set
by *importing* ``torch.export._trace``, ``torch._inductor.sizevars`` and ``torch._dynamo.guards`` for their file
names: ~400 modules (``networkx`` among them), about 0.3 s of CPU on the first symbol of a process that never
exports or compiles -- 4 % of ``symmem trace hf:gpt2`` with its peak.  :func:`uninteresting_files` gives the same
set of file names, reading a module's file from its import spec where it is not loaded yet (a spec's ``origin`` is
what ``inspect.getfile`` returns once the module is imported); :func:`install` puts it in torch's place (once,
cached as torch caches its own).  ``tests/test_shape_cache.py`` checks the set equals torch's own.

>>> import torch
>>> paths = uninteresting_files()
>>> "<string>" in paths and torch.__file__ in paths
True
"""

from __future__ import annotations

import functools
from typing import Any

#: the torch versions whose ``symbolic_shapes.uninteresting_files`` is written out below (others keep torch's own)
VERSIONS = ("2.13.",)
#: the modules torch's own ``symbolic_shapes.uninteresting_files`` names
MODULES = (
    "torch.fx.experimental.symbolic_shapes",
    "torch.export._trace",
    "torch.fx.experimental.recording",
    "torch.fx.experimental.sym_node",
    "torch.fx.interpreter",
    "torch.fx._symbolic_trace",
    "torch",
    "torch._compile",
    "torch._dynamo.eval_frame",
    "torch._inductor.sizevars",
    "torch._library.custom_ops",
    "torch._library.fake_impl",
    "torch._subclasses.meta_utils",
    "torch._subclasses.fake_tensor",
    "torch._logging._internal",
    "torch._logging.structured",
)


def _file(name: str) -> str:
    """A module's file: ``inspect.getfile`` of the loaded module, else its import spec's origin (parents are
    imported, the module itself is not run)."""
    import importlib.util
    import inspect
    import sys

    module = sys.modules.get(name)
    if module is not None:
        return inspect.getfile(module)
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ImportError(name)
    return spec.origin


def uninteresting_files() -> set[str]:
    """torch's ``symbolic_shapes.uninteresting_files()``, without running the modules it names."""
    import glob
    import inspect
    import os

    import torch._dynamo.external_utils
    import torch._dynamo.polyfills
    import torch._higher_order_ops
    from torch._dynamo.polyfills.loader import POLYFILLED_MODULES

    files = {_file(name) for name in MODULES}
    hop = set(glob.glob(os.path.join(os.path.dirname(torch._higher_order_ops.__file__), "*.py")))
    # torch._dynamo.guards.uninteresting_files(), whose import alone costs more than the rest
    dynamo = {inspect.getfile(m) for m in (torch._dynamo.external_utils, torch._dynamo.polyfills, *POLYFILLED_MODULES)}
    return files | hop | dynamo | {"<string>"}


def install() -> None:
    """Put :func:`uninteresting_files` (cached) in place of torch's own, once; under another torch version than
    :data:`VERSIONS`, or where a module cannot be found, torch's stays."""
    import torch
    from torch.fx.experimental import symbolic_shapes

    if not torch.__version__.startswith(VERSIONS):
        return

    current: Any = symbolic_shapes.uninteresting_files
    if getattr(current, "symmem", False) or getattr(current, "__qualname__", "") != "uninteresting_files":
        return
    if getattr(current, "__module__", "") != symbolic_shapes.__name__ or current.cache_info().currsize:
        return  # torch's set is computed already: nothing left to save
    try:
        files = uninteresting_files()
    except ImportError:
        return

    @functools.lru_cache(None)
    def cached() -> set[str]:
        return files

    cached.symmem = True  # type: ignore[attr-defined]
    cached.torch = current  # type: ignore[attr-defined]  # torch's own, for tests/test_shape_cache.py
    symbolic_shapes.uninteresting_files = cached  # type: ignore[assignment]
