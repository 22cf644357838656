"""Fake tensors with symbolic sizes: the ShapeEnv, the fake inputs, parameters and buffers, op overrides.

One ``ShapeEnv(duck_shape=False)`` (with duck shaping, B and S with equal example values would merge into
one symbol) and one ``FakeTensorMode`` on it.  Every declared symbol gets one backed SymInt (hint = its
example value); every input tensor is rebuilt as a contiguous fake tensor whose declared dimensions are
those SymInts, so all positions of a symbol share it.  Parameters and buffers become fake tensors of the
same shape, stride and dtype (``empty_strided`` under the mode: nothing is allocated, a module built on
``meta`` works the same).

Op overrides, for the fake run only (eager and the real check are untouched): ``aten.constant_pad_nd``'s
fake kernel runs C++ that reads concrete sizes and adds guards such as ``Eq(B, 2)``; it is routed to its
Python decomposition (``torch._refs``), which keeps the sizes symbolic.  Layer, group and batch norm with a
16-bit input and float32 weights (autocast) save float32 statistics on CPU; their meta kernels say 16-bit, so
the outputs are remade in float32.  The CPU ``_embedding_bag`` keeps one element more of ``offset2bag`` (and of
``bag_size`` with ``include_last_offset``) in its storages than its meta kernel makes.  The Python dispatcher is *not*
switched on globally: that would swap eager's C++ decompositions (``matmul``, SDPA) and change what is saved.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..errors import SymmemError
from .inputs import Inputs, Key


def check_device(device: str) -> str:
    """``cpu`` or ``cuda`` (``cuda:0`` …); CUDA fake tensors need a CUDA build of torch."""
    import torch

    kind = str(device).split(":")[0]
    if kind == "cpu":
        return "cpu"
    if kind == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise SymmemError(f"device={device!r}: fake CUDA tracing needs a CUDA build of torch; this torch "
                              f"({torch.__version__}) is CPU-only. Trace with device='cpu' or install a CUDA build")
        return str(device)
    raise SymmemError(f"device must be 'cpu' or 'cuda', got {device!r}")


def overrides() -> dict[Any, Any]:
    """aten op -> Python implementation, used for fake tensors only."""
    import torch
    import torch._refs

    from . import fake_kernels

    aten = torch.ops.aten
    fast = fake_kernels.FAST
    batch_norm = fake_kernels.batch_norm(aten.native_batch_norm.default) if fast else aten.native_batch_norm.default
    out = {aten.constant_pad_nd.default: torch._refs.constant_pad_nd,
           aten.native_layer_norm.default: _mixed(aten.native_layer_norm.default, (2, 3)),
           aten.native_group_norm.default: _mixed(aten.native_group_norm.default, (1, 2)),
           aten.native_batch_norm.default: _mixed(batch_norm, (1, 2, 3, 4)),
           aten._embedding_bag.default: _embedding_bag_cpu(aten._embedding_bag.default)}
    if fast:  # metadata-only kernels where PyTorch would run a decomposition (fake_kernels)
        out[aten.native_batch_norm_backward.default] = fake_kernels.batch_norm_backward(
            aten.native_batch_norm_backward.default)
        out[aten.threshold_backward.default] = fake_kernels.threshold_backward(aten.threshold_backward.default)
    return out


def _mixed(op: Any, params: tuple[int, ...]) -> Any:
    """``op`` (a normalization returning ``(out, mean, rstd)``) with the CPU kernels' mixed-type rule: a 16-bit
    input with float32 weights (autocast keeps normalizations' parameters in float32) saves its statistics in
    float32 -- the meta kernels make them 16-bit, half the bytes."""
    import torch

    def impl(*args: Any, **kwargs: Any) -> Any:
        out = op(*args, **kwargs)
        x = args[0]
        p = next((args[i] for i in params if i < len(args) and isinstance(args[i], torch.Tensor)), None)
        if (p is not None and x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16)
                and p.dtype == torch.float32):
            return (out[0], *(t.new_empty(t.shape, dtype=p.dtype) for t in out[1:3]), *out[3:])
        return out

    return impl


def _embedding_bag_cpu(op: Any) -> Any:
    """``_embedding_bag`` with the CPU kernel's storages (``EmbeddingBag.cpp``): ``make_offset2bag`` sizes
    ``offset2bag`` for one element more than the indices and then narrows the tensor, not its storage (numel + 1
    elements kept for backward); with ``include_last_offset`` the ``bag_size`` storage has one element per offset
    (bags + 1).  The meta kernel sizes both exactly, 8 bytes short each."""
    def impl(*args: Any, **kwargs: Any) -> Any:
        out = op(*args, **kwargs)
        weight, offsets = args[0], args[2]
        if weight.device.type != "cpu":
            return out
        last = args[7] if len(args) > 7 else kwargs.get("include_last_offset", False)
        o2b, bag = out[1], out[2]
        n = o2b.shape[0]
        if not (isinstance(n, int) and n == 0):  # mode sum without padding keeps no offset2bag at all
            o2b = o2b.new_empty((n + 1,))[:n]
        if last:
            bag = bag.new_empty((offsets.shape[0],))[:bag.shape[0]]
        return (out[0], o2b, bag, *out[3:])

    return impl


@contextmanager
def quiet_meta_errors() -> Iterator[None]:
    """PyTorch logs every exception a meta kernel raises (``log.exception`` in ``fake_tensor.py``) before raising
    it; symmem reports it in one line (or falls back to real traces), so the log is only noise on stderr."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def opaque_ops() -> frozenset[Any]:
    """aten ops whose fake kernels do not know what the real kernel saves: oneDNN's RNN layer (CPU LSTM/GRU)
    returns a workspace whose size oneDNN decides at run time; its meta kernel returns an empty one."""
    import torch

    packet = getattr(torch.ops.aten, "mkldnn_rnn_layer", None)
    return frozenset({packet.default}) if packet is not None else frozenset()


@dataclass
class FakeWorld:
    """The mode, its ShapeEnv, and how its symbols stand for the declared ones.

    A declared size ``Hi`` with ``multiple_of={"Hi": 32}`` is traced as ``32 * k`` for a ShapeEnv symbol
    ``k``: floor divisions by the strides then stay exact polynomials.
    """

    mode: Any
    env: Any
    sizes: dict[str, Any]  # name -> SymInt (or int for a concrete trace)
    env_symbols: dict[Any, str]  # ShapeEnv sympy symbol -> declared name
    scale: dict[str, int]  # declared name -> the multiple it is traced as (1 by default)

    def mapping(self, symbols: dict[str, Any]) -> dict[Any, Any]:
        """ShapeEnv symbol -> the expression in declared symbols it stands for (``Hi/32``)."""
        return {s: symbols[n] / self.scale.get(n, 1) for s, n in self.env_symbols.items()}


def make_world(examples: dict[str, int], symbolic: bool = True, multiple_of: dict[str, int] | None = None,
               concrete: tuple[str, ...] = ()) -> FakeWorld:
    """A FakeTensorMode on a fresh ShapeEnv and one SymInt per declared symbol (plain ints for ``concrete``
    names, or all of them if not ``symbolic``)."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    from .torch_files import install

    install()  # the first symbol would import torch.export (~400 modules) for file names only
    env = ShapeEnv(duck_shape=False, assume_static_by_default=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    # The dispatch cache pays off over many runs of the same graph; one trace with symbolic sizes mostly misses, and
    # building and replaying its entries costs symbolic arithmetic: without it a trace runs ~1.8x faster.
    mode.cache_enabled = False
    sizes: dict[str, Any] = {}
    env_symbols: dict[Any, str] = {}
    scale = dict(multiple_of or {})
    for name, value in examples.items():
        if not symbolic or name in concrete:
            sizes[name] = value
            continue
        m = scale.get(name, 1)
        source = ConstantSource(f"symmem_{name}")
        sym = env.create_symbol(value // m, source, dynamic_dim=DimDynamic.DYNAMIC)
        k = env.create_symintnode(sym, hint=value // m, source=source)
        sizes[name] = k * m if m != 1 else k
        env_symbols[sym] = name
    return FakeWorld(mode, env, sizes, env_symbols, scale)


def fake_like(t: Any, sizes: list[Any], device: str) -> Any:
    """A fresh contiguous fake tensor (call under the mode) with ``t``'s dtype and requires_grad."""
    import torch

    out = torch.empty(sizes, dtype=t.dtype, device=device)
    if t.requires_grad:
        out.requires_grad_(True)
    return out


def fake_inputs(world: FakeWorld, inputs: Inputs, device: str) -> dict[Key, Any]:
    """Fake versions of the tensor inputs (under the mode), declared dimensions symbolic."""
    import torch

    out: dict[Key, Any] = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor):
            where = inputs.sizes_at(key)
            sizes = [world.sizes[where[d]] if d in where else int(n) for d, n in enumerate(value.shape)]
            out[key] = fake_like(value, sizes, device)
        else:
            out[key] = _fake_nested(value, device)
    return out


def _fake_nested(value: Any, device: str) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return fake_like(value, list(value.shape), device)
    if isinstance(value, list | tuple) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(_fake_nested(v, device) for v in value)
    return value


def fake_state(module: Any, device: str, untie: tuple[tuple[str, ...], ...] = ()
               ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fake parameters and buffers (call under the mode), by name; tied ones appear once, except each group of a
    tied parameter's names in ``untie`` (as ``named_parameters(remove_duplicate=False)`` lists them), which gets a
    parameter of its own under its first name (a pipeline stage's copy; :func:`every_parameter` maps the names)."""
    import torch

    own = {group[0] for group in untie}
    params: dict[str, Any] = {}
    seen: set[int] = set()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in seen and name not in own:
            continue  # tied: its first name's parameter, or its group's (every_parameter)
        seen.add(id(p))
        f = torch.empty_strided(tuple(p.shape), tuple(p.stride()), dtype=p.dtype, device=device)
        params[name] = f.requires_grad_(p.requires_grad)
    buffers: dict[str, Any] = {}
    for name, b in module.named_buffers():
        buffers[name] = torch.empty_strided(tuple(b.shape), tuple(b.stride()), dtype=b.dtype, device=device)
    return params, buffers


def every_parameter(module: Any, params: dict[str, Any], untie: tuple[tuple[str, ...], ...]) -> dict[str, Any]:
    """Every name of ``module``'s parameters, tied ones included, -> its fake in ``params`` (:func:`fake_state`'s
    with ``untie``): a name in a group of ``untie`` the group's own, any other tied name its first name's."""
    group_of = {name: group[0] for group in untie for name in group}
    first: dict[int, str] = {}
    out: dict[str, Any] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = params[group_of.get(name, first.setdefault(id(p), name))]
    return out
