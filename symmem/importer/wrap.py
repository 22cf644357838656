"""Run a module the way it is trained: autocast, activation checkpointing of its repeated blocks, a layer count.

The same wrappers apply to every run of a trace (the real check, the fake forward, the fake training step) and
can be applied by hand to a real module, so that a measurement sees the same code path:

>>> import pytest; torch = pytest.importorskip("torch")
>>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
>>> find_repeat(net)
('', ('0', '1', '2'))
>>> with checkpointed(net, ["1", "2"]):
...     wrapped = "forward" in vars(net[1])
>>> wrapped, "forward" in vars(net[1])
(True, False)

- :func:`autocasting`: ``torch.autocast(device, dtype)`` around the forward and the loss (``"bfloat16"`` on
  CPU; ``"float16"`` where the device supports it);
- :func:`checkpointed`: each named child's ``forward`` runs under
  ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: it keeps only what the checkpoint saves (its
  inputs) and is recomputed when its backward starts;
- :func:`with_layers`: a run of identical children (a repeat) written out ``count`` times: the first ``count``
  of them, or all of them and copies of the last (copies hold ``meta`` parameters, which a fake run replaces;
  an integer attribute ``layer_idx`` is renumbered, as Hugging Face caches index layers by it, and a
  ``config.num_hidden_layers`` equal to the container's length follows it).
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ..errors import SymmemError

AUTOCAST = ("bfloat16", "float16")
#: attributes that number a layer inside its stack (Hugging Face attention modules index their cache by it)
LAYER_INDEX = ("layer_idx",)
#: configuration attributes that count the layers (Hugging Face caches make one slot per layer)
LAYER_COUNT = ("num_hidden_layers", "n_layer", "num_layers")
#: configuration attributes that hold one entry per layer, read by layer index in the model's forward (Qwen2's,
#: Mistral's, Gemma's ``layer_types``: ``config.layer_types[i]`` picks layer i's attention mask)
LAYER_LISTS = ("layer_types",)


def autocast_dtype(name: str | None) -> Any:
    """The torch dtype of an ``autocast=`` option (None: no autocast)."""
    if name is None or name in ("none", "off", False):
        return None
    import torch

    if name not in AUTOCAST:
        raise SymmemError(f"autocast must be one of {', '.join(AUTOCAST)} (or None), got {name!r}")
    return getattr(torch, name)


@contextmanager
def autocasting(name: str | None, device: str = "cpu") -> Iterator[None]:
    """``torch.autocast(device, dtype=name)`` while active (nothing for None)."""
    dtype = autocast_dtype(name)
    if dtype is None:
        yield
        return
    import torch

    with torch.autocast(device_type=device.split(":")[0], dtype=dtype):
        yield


def _checkpoint(fn: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, *args, use_reentrant=False, **kwargs)


@contextmanager
def checkpointed(module: Any, children: Sequence[str]) -> Iterator[None]:
    """Run each named submodule under non-reentrant activation checkpointing while active."""
    subs = []
    for path in children:
        try:
            sub = module.get_submodule(path)
        except AttributeError:
            raise SymmemError(f"checkpoint: {type(module).__name__} has no submodule {path!r}") from None
        if "forward" in vars(sub):
            raise SymmemError(f"checkpoint: {path!r} already has its own forward attribute")
        subs.append(sub)
    try:
        for sub in subs:
            sub.forward = functools.partial(_checkpoint, type(sub).forward.__get__(sub))
        yield
    finally:
        for sub in subs:
            vars(sub).pop("forward", None)


def _signature(child: Any) -> tuple[Any, ...]:
    return (type(child), tuple((n, tuple(p.shape), p.dtype) for n, p in child.named_parameters()))


def find_repeat(module: Any) -> tuple[str, tuple[str, ...]]:
    """The longest run of consecutive children of one ``ModuleList``/``Sequential`` with the same class and
    parameter shapes (the most parameters on a tie): ``(container path, child paths)``.  A traced module's
    repeated blocks (what ``checkpoint="full"`` wraps) are found this way, before tracing."""
    import torch

    best: tuple[int, int, str, tuple[str, ...]] | None = None
    for path, container in module.named_modules():
        if not isinstance(container, torch.nn.ModuleList | torch.nn.Sequential) or len(container) < 2:
            continue
        names = [n for n, _ in container.named_children()]
        sigs = [_signature(c) for _, c in container.named_children()]
        i = 0
        while i < len(names):
            j = i + 1
            while j < len(names) and sigs[j] == sigs[i]:
                j += 1
            if j - i >= 2:
                child = container.get_submodule(names[i])
                size = sum(p.numel() for p in child.parameters()) * (j - i)
                run = tuple(f"{path}.{n}" if path else n for n in names[i:j])
                key = (j - i, size, path, run)
                if best is None or key[:2] > best[:2]:
                    best = key
            i = j
    if best is None:
        raise SymmemError(f"{type(module).__name__} has no run of identical children in a ModuleList or "
                          "Sequential to checkpoint; name the children: checkpoint=['layers.0', ...]")
    return best[2], best[3]


def _copy(child: Any) -> Any:
    """A copy of ``child`` whose parameters and buffers are ``meta`` tensors (no memory is copied)."""
    import torch

    memo: dict[int, Any] = {}
    for p in child.parameters():
        memo[id(p)] = torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in child.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(child, memo)


@contextmanager
def with_layers(module: Any, container: str, children: Sequence[str], count: int) -> Iterator[dict[str, int]]:
    """The run ``children`` of ``container`` written out ``count`` times while active; yields new child path ->
    index in the run.  Children outside the run stay where they are."""
    import torch

    parent = module.get_submodule(container) if container else module
    if not isinstance(parent, torch.nn.ModuleList | torch.nn.Sequential):
        raise SymmemError(f"{container!r} is not a ModuleList or Sequential")
    names = [n for n, _ in parent.named_children()]
    local = [c[len(container) + 1:] if container else c for c in children]
    if any(n not in names for n in local):
        raise SymmemError(f"{', '.join(n for n in local if n not in names)} are not children of {container!r}")
    first, last = names.index(local[0]), names.index(local[-1])
    originals = [parent._modules[n] for n in names]
    run = originals[first:last + 1]
    if count <= len(run):
        new_run = run[:count]
    else:
        new_run = list(run) + [_copy(run[-1]) for _ in range(count - len(run))]
        base = _index(run[-1])
        for k, child in enumerate(new_run[len(run):], start=1):
            if base is not None:
                _renumber(child, base + k)
    layers = originals[:first] + new_run + originals[last + 1:]
    new_names = _run_names(names, first, last, count, container)
    saved = dict(parent._modules)
    configs = _layer_counts(module, len(originals))
    # grown only: where the run is cut (count <= its length) the lists stay as they were (indexes stay inside)
    lists = _layer_lists([cfg for cfg, _ in configs], len(originals)) if count > len(run) else []
    parent._modules.clear()
    for n, m in zip(new_names, layers, strict=True):
        parent._modules[n] = m
    for cfg, attr in configs:
        setattr(cfg, attr, len(layers))
    for cfg, attr, entries in lists:  # a copy of the run's last layer is of its kind (its entry)
        setattr(cfg, attr, type(entries)([*entries[:first], *entries[first:last + 1],
                                          *[entries[last]] * (count - len(run)), *entries[last + 1:]]))
    prefix = f"{container}." if container else ""
    try:
        yield {f"{prefix}{new_names[first + k]}": k for k in range(len(new_run))}
    finally:
        parent._modules.clear()
        parent._modules.update(saved)
        for cfg, attr in configs:
            setattr(cfg, attr, len(originals))
        for cfg, attr, entries in lists:
            setattr(cfg, attr, entries)


def _run_names(names: list[str], first: int, last: int, count: int, container: str) -> list[str]:
    """The children's names with the run ``names[first:last + 1]`` written out ``count`` times: numbered children
    (a ModuleList's, a plain Sequential's) renumbered in order; named ones (torchvision's ``encoder_layer_0`` ...)
    keep their names, the run's continuing its numbering."""
    if all(n.isdigit() for n in names):
        return [str(i) for i in range(len(names) - (last + 1 - first) + count)]
    run = [re.fullmatch(r"(.*?)(\d+)", n) for n in names[first:last + 1]]
    if not all(run) or len({m.group(1) for m in run}) != 1:  # type: ignore[union-attr]
        raise SymmemError(f"the children of {container!r} in the repeated run are not numbered "
                          f"({', '.join(names[first:last + 1][:3])} ...): its layer count cannot be changed")
    stem, start = run[0].group(1), int(run[0].group(2))  # type: ignore[union-attr]
    written = [f"{stem}{start + k}" for k in range(count)]
    taken = set(names[:first] + names[last + 1:])
    if taken & set(written):
        raise SymmemError(f"{container!r}: writing its run out {count} times would reuse a sibling's name")
    return names[:first] + written + names[last + 1:]


def _layer_counts(module: Any, count: int) -> list[tuple[Any, str]]:
    """(config, attribute) pairs that hold the number of layers (a Hugging Face ``config.num_hidden_layers``:
    its caches make one slot per layer), where they equal ``count``."""
    found: list[tuple[Any, str]] = []
    seen: set[int] = set()
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        for attr in LAYER_COUNT:
            if getattr(cfg, attr, None) == count and isinstance(getattr(cfg, attr), int):
                found.append((cfg, attr))
                break
    return found


def _layer_lists(configs: list[Any], count: int) -> list[tuple[Any, str, Any]]:
    """(config, attribute, entries) of the per-layer lists (:data:`LAYER_LISTS`) of ``configs`` that hold ``count``
    entries: written out with the run, or a model traced with fewer layers than the fold's counts indexes past their
    end (Qwen2 traced at 2 layers: ``layer_types[4]``)."""
    found = []
    for cfg in configs:
        for attr in LAYER_LISTS:
            entries = getattr(cfg, attr, None)
            if isinstance(entries, list | tuple) and len(entries) == count:
                found.append((cfg, attr, entries))
    return found


def _index(child: Any) -> int | None:
    for m in child.modules():
        for attr in LAYER_INDEX:
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
    return None


def _renumber(child: Any, index: int) -> None:
    for m in child.modules():
        for attr in LAYER_INDEX:
            v = getattr(m, attr, None)
            if isinstance(v, int) and not isinstance(v, bool):
                setattr(m, attr, index)
