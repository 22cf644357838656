"""A per-process cache of recorded training steps: the same step of the same module at the same sizes is recorded once.

:func:`~symmem.importer.recording.record_step` costs seconds (tiny GPT-2: ~2.5 CPU-s a record; a fold needs 3 or 4),
and a process often records the same step again: ``symmem derive`` then ``symmem verify`` of one module, a test
module's cases that differ only in what they ask of the peak, an engine's step that records the module's plain step
inside it.  A record is a function of what it is recorded from: the module's classes, structure, attributes and
parameters' metadata (the step runs on fake tensors: parameter values are never read), the example inputs'
metadata, the sizes and symbols, the options, the device, the replayed value reads, and the fake world it runs in.

The fake world is shared by the records of one :class:`~symmem.importer.traced_step.StepPeak` at one set of sizes
(:class:`~symmem.importer.recording.SharedWorld`): its ShapeEnv then holds every earlier record's guards, which each
record reports. So a record's key holds the world's history -- where the world came from (``fresh``, or the forward
trace of the same module: ``trace``) and the keys of the records made in it before -- and a chain of records is
answered from the cache only in the order it was made. Each step's world stays its own: where the cache lacks a
record, the records the cache answered before it are made again in that world first, then the record. Values are
therefore those of a run without the cache (``tests/test_shape_cache.py::test_the_step_cache_changes_no_record``).

What cannot be keyed (an attribute that is neither plain data, a config, a tensor, nor a function, class or
module) is keyed by identity: the cache then only helps the same object.  It is OFF unless ``SYMMEM_STEP_CACHE=1``
(or ``ENABLED = True``): state outside the key -- a function a forward reads from a global and a user patches
between two traces, torch's attention-kernel switches (``sdpa_kernel``) on CUDA fakes -- would give a stale record
silently, so users opt in; the test suite turns it on (tests/conftest.py), where its records are checked equal to
uncached ones. It holds at most :data:`MAX_RECORDS` records (least recently used dropped).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: whether records are cached at all (off unless the environment's SYMMEM_STEP_CACHE=1: see the module)
ENABLED = os.environ.get("SYMMEM_STEP_CACHE", "0") == "1"
#: how many records the cache holds (a tiny GPT-2 record with its timelines: ~1.7 MiB)
MAX_RECORDS = 32
#: a real tensor attribute up to this many bytes is keyed by its values (a larger one by identity)
HASHED_BYTES = 1 << 22

_CONFIGS = frozenset({"PretrainedConfig", "PreTrainedConfig", "GenerationConfig"})
_ATOMS = (type(None), bool, int, float, complex, str, bytes)
#: a module's own bookkeeping, keyed separately (parameters, buffers, children) or not read by a step
_SKIPPED = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                      "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                      "_load_state_dict_post_hooks"})


class _Ident:
    """An object keyed by identity (held, so its id is not reused while the key lives)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ident) and other.obj is self.obj


def value_key(v: Any, _depth: int = 0) -> Any:
    """A hashable key of ``v``: equal keys for values a step cannot tell apart (identity where unsure)."""
    import torch

    if isinstance(v, _ATOMS):
        return (type(v).__name__, v)
    if _depth > 8:
        return _Ident(v)
    if isinstance(v, enum.Enum | torch.dtype | torch.device | torch.layout | torch.memory_format):
        return ("torch", type(v).__name__, str(v))
    if isinstance(v, torch.Size):
        return ("size", tuple(v))
    if isinstance(v, torch.Tensor):
        return _tensor_key(v)
    if isinstance(v, tuple | list):
        return (type(v).__name__, tuple(value_key(x, _depth + 1) for x in v))
    if isinstance(v, dict):  # insertion order kept: a module may iterate it
        return ("dict", type(v), tuple((value_key(k, _depth + 1), value_key(x, _depth + 1)) for k, x in v.items()))
    if isinstance(v, set | frozenset):
        return ("set", frozenset(value_key(x, _depth + 1) for x in v))
    if isinstance(v, functools.partial):
        return ("partial", value_key(v.func, _depth + 1), value_key(v.args, _depth + 1),
                value_key(v.keywords, _depth + 1))
    if isinstance(v, types.MethodType):
        owner = v.__self__
        return ("method", _Ident(v.__func__), type(owner) if isinstance(owner, torch.nn.Module) else _Ident(owner))
    if _is_config(v):
        return ("config", type(v), value_key(vars(v), _depth + 1))
    if dataclasses.is_dataclass(v) and not isinstance(v, type) and v.__dataclass_params__.frozen:
        return ("dataclass", type(v), tuple(value_key(getattr(v, f.name), _depth + 1) for f in dataclasses.fields(v)))
    try:
        import sympy

        if isinstance(v, sympy.Basic):
            return ("sympy", v)
    except ImportError:  # pragma: no cover - sympy is a dependency
        pass
    return _Ident(v)  # functions, classes, modules and anything else: the same object only


def _is_config(v: Any) -> bool:
    """A transformers ``PretrainedConfig`` or ``GenerationConfig`` (plain data in its ``__dict__``, private fields
    included)."""
    return any(c.__name__ in _CONFIGS and c.__module__.startswith("transformers.") for c in type(v).__mro__)


def _tensor_key(t: Any) -> Any:
    meta = (tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device), t.requires_grad, type(t))
    if t.device.type == "meta":  # no values to tell apart
        return ("meta", *meta)
    if t.device.type == "cpu" and type(t) in _PLAIN_TENSORS() and t.untyped_storage().nbytes() <= HASHED_BYTES \
            and not t.is_sparse:
        data = t.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes() \
            if t.numel() else b""
        return ("tensor", *meta, hashlib.blake2b(data, digest_size=16).digest())
    return ("object", *meta, _Ident(t))


@functools.cache
def _PLAIN_TENSORS() -> tuple[type, ...]:  # noqa: N802 - a constant computed once torch is imported
    import torch

    return (torch.Tensor, torch.nn.Parameter, torch.nn.Buffer) if hasattr(torch.nn, "Buffer") else \
        (torch.Tensor, torch.nn.Parameter)


def module_key(module: Any) -> Any:
    """What a step on fake tensors reads of ``module``: every submodule's class, mode and attributes, and every
    parameter's and buffer's metadata with its ties (which names share one tensor)."""
    subs = []
    for name, m in module.named_modules(remove_duplicate=False):
        attrs = tuple((k, _attr_key(v)) for k, v in vars(m).items() if k not in _SKIPPED)
        subs.append((name, type(m), m.training, attrs))
    first: dict[int, int] = {}
    params = []
    for i, (name, p) in enumerate(module.named_parameters(remove_duplicate=False)):
        params.append((name, type(p), tuple(p.shape), tuple(p.stride()), str(p.dtype), str(p.device),
                       p.requires_grad, first.setdefault(id(p), i)))
    buffers = tuple((name, type(b), tuple(b.shape), tuple(b.stride()), str(b.dtype), str(b.device))
                    for name, b in module.named_buffers(remove_duplicate=False))
    return (tuple(subs), tuple(params), buffers)


def _attr_key(v: Any) -> Any:
    import torch

    if isinstance(v, torch.nn.Module):  # a module held outside _modules: the same object only
        return _Ident(v)
    return value_key(v)


def _state_key() -> Any:
    """Global settings a recorded step depends on (flags tests switch, torch's defaults)."""
    import torch

    from ..record import saved_tensors
    from . import fake_kernels, kernel_temporaries, recording

    return (recording.CACHE_STEP, saved_tensors.CACHE_SHAPES, tuple(kernel_temporaries.DEVICES), fake_kernels.FAST,
            str(torch.get_default_dtype()), torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled())


def step_key(module: Any, inputs: Any, values: dict[str, int], symbols: dict[str, Any], options: Any, device: str,
             replay: Any, multiple_of: Any, concrete: tuple[str, ...], layers: Any) -> Any:
    """The key of one :func:`~symmem.importer.recording.record_step` call (its world's history aside)."""
    return (module_key(module), value_key(inputs.args), value_key(inputs.kwargs), value_key(inputs.positions),
            value_key(inputs.examples), tuple(values.items()), tuple(symbols.items()), value_key(options),
            str(device), value_key(replay), value_key(dict(multiple_of or {})), tuple(concrete), value_key(layers),
            _state_key())


@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    replayed: int = 0  # records made again to bring a world to the history of a record the cache lacks


_CACHE: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
STATS = Stats()


def clear() -> None:
    """Forget every cached record."""
    _CACHE.clear()


@dataclass
class Chain:
    """The records of one fake world (the :class:`~symmem.importer.recording.SharedWorld` that holds it, shared by
    whichever steps share that world): the history its records are keyed by (where the world came from, then each
    record's key), and the calls that make the records the cache answered since the world last ran one."""

    world: Any
    history: tuple[Any, ...]
    pending: list[Callable[[Any], Any]] = dataclasses.field(default_factory=list)


def recorded(chain: Chain, key: Any, make: Callable[[Any], Any]) -> Any:
    """The record of ``key`` (:func:`step_key`) next in ``chain``'s world: ``make(world)`` records it, called only
    where the cache lacks it (and then first for every record the cache answered before, in order, so that the
    world holds what it would hold without the cache)."""
    full = (*chain.history, key)
    if not ENABLED:
        chain.history = full
        return make(chain.world)
    record = _CACHE.get(full)
    if record is not None:
        _CACHE.move_to_end(full)
        STATS.hits += 1
        chain.history = full
        chain.pending.append(make)
        return record
    for again in chain.pending:
        again(chain.world)
        STATS.replayed += 1
    chain.pending.clear()
    STATS.misses += 1
    record = make(chain.world)
    chain.history = full
    _CACHE[full] = record
    while len(_CACHE) > MAX_RECORDS:
        _CACHE.popitem(last=False)
    return record
