"""One process's traces of a module built from sizes, shared between the symbolic-size fits of the tests.

A fit (:func:`symmem.importer.symbolic_sizes.fit_sizes`) traces the module at small configurations, each trace a
pure function of what is built and how it is traced: the same ``hf:`` model at the same config (Hugging Face GPT-2
with its vocabulary symbolic, made by ``symmem trace``, ``paper`` and ``fit`` in three files, and by the peak's
test) or the same build callable at the same sizes (the grouped-query module fitted at G < h and at G = h, whose
fits trace the same configurations at h/G >= 2) is traced once a process.  The fixture ``shared_traces`` puts the
shared ``trace_at`` in place for one test; the fits, their checks, the CLI and the real PyTorch each test measures
all run as before.  Tests that share traces are one ``xdist_group`` (:data:`GROUP`), so one worker makes them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from symmem.importer import symbolic_sizes
from symmem.importer.hf_sizes import HfSizes

#: the xdist group of the tests that share traces: one worker, so each trace is made once
GROUP = "symbolic_traces"
_ORIGINAL = symbolic_sizes.trace_at
_MADE: dict[tuple[Any, ...], Any] = {}


def _key(build: Callable[..., Any], sizes: dict[str, int], dims: dict[str, Any], options: dict[str, Any]
         ) -> tuple[Any, ...]:
    """What decides a trace: for an ``hf:`` model, its spec, loss and the config it is built with at ``sizes``
    (HfSizes.load's); for another callable, itself and the sizes; then the input dims and the trace options."""
    owner = getattr(build, "__self__", None)
    if isinstance(owner, HfSizes):
        import transformers

        keyed = {k: v for s, v in sizes.items() for k in owner.keys[s].split("|")}
        # a key's alias is the key (gpt2's num_hidden_layers is n_layer), as the config the model is built from
        model_type = owner.spec.partition(":")[2]
        mapping = transformers.CONFIG_MAPPING
        alias = getattr(mapping[model_type], "attribute_map", {}) if model_type in mapping else {}
        config = {alias.get(k, k): v for k, v in {**owner.config, **keyed}.items()}
        what: Any = ("hf", owner.spec, owner.loss, repr(sorted(config.items())))
    else:
        what = (build, repr(sorted(sizes.items())))
    return (what, repr(dims), repr(sorted(options.items())))


def _trace_at(build: Callable[..., Any], sizes: dict[str, int], dims: dict[str, Any], options: dict[str, Any],
              world: Any = None) -> Any:
    key = _key(build, sizes, dims, options)  # a trace in a fit's shared world is the fresh world's (fit_world)
    if key not in _MADE:
        _MADE[key] = _ORIGINAL(build, sizes, dims, options, world=world)
    return _MADE[key]


@pytest.fixture
def shared_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(symbolic_sizes, "trace_at", _trace_at)


def made() -> int:
    """How many traces this process made through the shared ``trace_at``."""
    return len(_MADE)
