"""Shape propagation once per repeated block: a fake op's outputs by the op and its inputs' symbolic metadata.

On fake tensors with symbolic sizes an aten op costs 0.3-100 ms of CPU (PyTorch's meta kernels compute every
size, stride and contiguity test with SymInts; ``native_layer_norm``, ``_safe_softmax`` and ``tril`` run whole
Python decompositions), against microseconds for a real op of the sizes these traces use.  The blocks of a
transformer repeat the same ops on the same symbolic shapes, layer after layer and in every layer count of the
step's fold, so most ops of a trace were already computed once in the same ``ShapeEnv``.

:class:`ShapeCache` keys an op by its overload and, for every argument, the sympy expressions of a fake tensor's
sizes, strides and storage offset with its dtype and device (plain values as they are, typed: ``True`` is not
``1``; an empty constant, whose value nothing can read, by its metadata).  An op is cached only where its outputs are
tensors on fresh storages that ``torch.empty(size)``, ``torch.empty_strided(size, stride)`` or
``torch.empty_permuted(size, layout)`` remakes exactly (the same stride and storage-bytes expressions, no offset, no
constant value, every size backed), or views of the op's one tensor input that ``as_strided`` remakes exactly (the same
size, stride and offset expressions and dtype: ``view``, ``_unsafe_view``, ``transpose``, ``expand``, ``split`` ...,
whose PyTorch meta kernels -- ``_reshape_view_helper`` -- cost ~1 ms each, ``as_strided`` ~0.2 ms).  An in-place op or
one that returns an input itself (a mutable schema, the same object), an op whose storage is larger than its tensor
(``_embedding_bag``'s ``offset2bag``), and an op with several tensor inputs whose outputs alias one of them are run
every time.  A hit makes fresh fake tensors (and views of the current input) of the cached metadata; the ShapeEnv
already holds every guard the first run added (the same expressions in the same environment: a repeat adds none), so
what the recorders see -- new storages with the same symbolic bytes, views on the same storage -- is what the op
would have made.  The cache lives as long as one fake run (one ShapeEnv).  Its remakes run PyTorch's meta kernels
in-kernel (:func:`fresh`, :func:`_view`: no fake-mode dispatch around them), and the size arithmetic those kernels
ask of the cached SymInts is answered from :mod:`.sym_memo`'s table after the first time.

In-place ops are remembered apart (:meth:`ShapeCache.same`): an op whose schema writes its first argument only and
returns it (``add_``, ``mul_``, ``lerp_``, ``addcmul_``: a third of a training step's ops, most of them the optimizer
step's), that returned its input with the metadata it came with, returns the input itself again when it
runs on inputs of the same key -- no fake kernel (a meta kernel only checks what the key fixes; the version counter
is bumped before any dispatch mode runs).  Ops that can change a tensor's size or storage in place (``resize_``,
``set_``, ``as_strided_``, ``squeeze_`` ...) are never remembered.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from .sym_memo import SymMemo

#: plain argument types that key as themselves (with their type; exact types: a subclass goes the long way)
_PLAIN = frozenset({int, float, bool, str, type(None)})


class ShapeCache:
    """Fake outputs' metadata by (op, inputs' metadata), for one fake run (see the module docstring)."""

    def __init__(self) -> None:
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        self._torch = torch
        self._fake = FakeTensor
        self._symbolic = (torch.SymInt, torch.SymFloat, torch.SymBool)
        self._plain_torch = (torch.dtype, torch.device, torch.layout, torch.memory_format)
        self.entries: dict[Any, Any] = {}
        aten = torch.ops.aten
        # ops whose outputs aliased an input in place once, and views cheaper to run than to key and remake (detach
        # ~50 us; keying its input and ``as_strided`` ~200 us): not keyed
        self.never: set[Any] = {aten.detach.default, aten.alias.default}
        self.hits = 0
        self.misses = 0
        #: in-place ops by key (:meth:`same`): True once a run returned its input unchanged in metadata and bytes
        self.in_place: dict[Any, bool] = {}
        self._writes_self: dict[Any, bool] = {}  # op -> whether its schema writes its first argument only
        #: PyTorch's symbolic size arithmetic of the remakes, remembered for this run's ShapeEnv (:mod:`.sym_memo`)
        self.memo = SymMemo()

    def _part(self, x: Any, empty: bool = True) -> Any:
        """The key of one argument, or None where it cannot be keyed (a real tensor, a constant, an object).  An empty
        constant (``empty``; transformers' ``DynamicCache`` starts each layer's keys and values as ``torch.tensor([])``
        and concatenates onto it) has no value an op could read: it keys by its metadata, as its own kind."""
        kind = type(x)
        if kind in _PLAIN:  # most arguments: ints, floats, bools
            return (kind.__name__, x)
        if isinstance(x, self._fake):
            if x.layout != self._torch.strided:
                return None
            if x.constant is not None:
                if not empty or x.constant.numel() != 0:
                    return None
                return ("C", tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.device)
            if not x._has_symbolic_sizes_strides:  # plain ints already (a parameter, the optimizer's state)
                return ("T", tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device)
            return ("T", tuple(_expr(d) for d in x.shape), tuple(_expr(s) for s in x.stride()),
                    _expr(x.storage_offset()), x.dtype, x.device)
        if isinstance(x, self._torch.Tensor):
            return None
        if isinstance(x, self._symbolic):
            return ("S", type(x).__name__, x.node.expr)
        if isinstance(x, tuple(_PLAIN)) or isinstance(x, self._plain_torch):
            return (type(x).__name__, x)
        if isinstance(x, list | tuple):
            parts = tuple(self._part(v, empty) for v in x)
            return None if any(p is None for p in parts) else (type(x).__name__, parts)
        return None

    def key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The cache key of ``func(*args, **kwargs)``, or None (not cacheable)."""
        if func in self.never:
            return None
        return self._key(func, args, kwargs)

    def _key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], empty: bool = True) -> Any:
        parts = self._part(args, empty)
        if parts is None:
            return None
        named = tuple((k, self._part(v, empty)) for k, v in sorted(kwargs.items()))
        if any(p is None for _, p in named):
            return None
        return (func, parts, named)

    def same_key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The key of an in-place op that writes its first argument only (see the module docstring), or None."""
        writes = self._writes_self.get(func)
        if writes is None:
            writes = self._writes_self[func] = _writes_self_only(func)
        if not writes or not args:
            return None
        return self._key(func, args, kwargs, empty=False)  # an in-place op on a constant updates its value

    def same(self, key: Any, args: tuple[Any, ...]) -> Any:
        """The op's input itself where a run of the in-place op of ``key`` returned it unchanged, else None."""
        if key is None or not self.in_place.get(key):
            return None
        self.hits += 1
        return args[0]

    def store_same(self, key: Any, args: tuple[Any, ...], out: Any) -> None:
        """Remember the in-place op of ``key`` if it returned its first argument with the metadata it came with (the
        key's); the ops that could grow its storage are not in-place ops here (:func:`_writes_self_only`)."""
        if key is None or key in self.in_place:
            return
        self.misses += 1
        self.in_place[key] = out is args[0] and self._part(out) == key[1][1][0]

    def get(self, key: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """The outputs made anew from the cached metadata (views of the one tensor in ``args``/``kwargs``), or None
        (not seen, or not cacheable)."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.hits += 1
        wrap, specs, env = entry
        base = None
        if any(s is not None and s[0] == "V" for s in specs):
            base = _tensors((args, kwargs or {}), self._torch.Tensor)[0]
        # plain sizes (env None): no symbolic arithmetic to remember
        with nullcontext() if env is None else self.memo.active(env):
            made = [None if s is None else _view(self._torch, base, s) if s[0] == "V" else _make(self._torch, s)
                    for s in specs]
        return made[0] if wrap is None else wrap(made)

    def store(self, func: Any, key: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Remember ``out``'s metadata under ``key`` where ``empty_strided`` remakes it exactly."""
        self.misses += 1
        if key in self.entries:
            return
        self.entries[key] = None
        if isinstance(out, self._torch.Tensor):
            wrap, outs = None, [out]
        elif isinstance(out, tuple | list) and out and all(o is None or isinstance(o, self._torch.Tensor)
                                                          for o in out):
            wrap, outs = type(out), list(out)
        else:
            return
        given = _tensors((args, kwargs), self._torch.Tensor)
        inputs = {_storage(t) for t in given}
        seen: set[Any] = set()
        specs = []
        for o in outs:
            if o is None:
                specs.append(None)
                continue
            st = _storage(o)
            if st is not None and st in inputs:
                spec = self._view_spec(func, given, o)
                if spec is None:
                    self.never.add(func)  # an in-place op, or an alias of one of several inputs
                    return
            elif st is None or st in seen:
                self.never.add(func)
                return
            else:
                seen.add(st)
                spec = self._spec(o)
            if spec is None:
                return
            specs.append(spec)
        self.entries[key] = (wrap, tuple(specs), _shape_env(specs))

    def _view_spec(self, func: Any, given: list[Any], o: Any) -> tuple[Any, ...] | None:
        """("V", size, stride, offset) of an output on the storage of the op's one tensor input that ``as_strided``
        remakes to the expression, or None (an in-place op, several tensor inputs, another dtype)."""
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        schema = getattr(func, "_schema", None)
        if schema is None or schema.is_mutable or len(given) != 1 or any(o is t for t in given):
            return None
        base = given[0]
        if not isinstance(o, self._fake) or o.constant is not None or o.layout != self._torch.strided \
                or o.dtype != base.dtype or o.device != base.device:
            return None
        spec = ("V", tuple(o.shape), tuple(o.stride()), o.storage_offset())
        if free_unbacked_symbols(spec[1] + spec[2] + (spec[3],)):
            return None
        probe = _view(self._torch, base, spec)
        if _meta(probe) != _meta(o) or _storage(probe) != _storage(o):
            return None
        return spec

    def _spec(self, o: Any) -> tuple[Any, ...] | None:
        """("E", size, stride or None, dtype, device) of a fresh output that ``empty`` (stride None: contiguous) or
        ``empty_strided`` remakes with the same strides and the same storage bytes, to the expression."""
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        if not isinstance(o, self._fake) or o.constant is not None or o.layout != self._torch.strided:
            return None
        size, stride = tuple(o.shape), tuple(o.stride())
        if free_unbacked_symbols(size + stride) or _expr(o.storage_offset()) != 0:
            return None
        want = (tuple(_expr(s) for s in stride), _expr(o.untyped_storage().nbytes()))
        # an elementwise op on a transposed input keeps its layout: PyTorch makes it with ``empty_permuted``, whose
        # storage bytes read 1024*B*S where ``empty_strided`` of the same strides writes 1024*S*(B - 1) + 1024*S
        for spec in ((size, None, o.dtype, o.device), (size, stride, o.dtype, o.device),
                     (size, _Permuted(_layout(stride)), o.dtype, o.device)):
            probe = _make(self._torch, spec)
            if (tuple(_expr(s) for s in probe.stride()), _expr(probe.untyped_storage().nbytes())) == want:
                return ("E", *spec)
        return None  # e.g. a storage larger than its tensor: remade, it would be smaller


class _Permuted(tuple):
    """The dimensions of a layout from the outermost to the innermost (``torch.empty_permuted``'s order)."""


def _layout(stride: tuple[Any, ...]) -> tuple[int, ...]:
    """The dimensions by decreasing stride at the example sizes (no guard is asked: the remade tensor is compared
    with the original expression by expression)."""
    def hint(x: Any) -> int:
        node = getattr(x, "node", None)
        return int(node.hint) if node is not None and node.hint is not None else int(x) if node is None else 0

    return tuple(sorted(range(len(stride)), key=lambda d: (-hint(stride[d]), d)))


def _make(torch: Any, spec: tuple[Any, ...]) -> Any:
    size, stride, dtype, device = spec[-4:]
    return fresh(size, dtype, device, stride)


def fresh(size: Any, dtype: Any, device: Any, stride: Any = None) -> Any:
    """A new tensor of ``size`` (contiguous; with ``stride``, those strides, or a :class:`_Permuted` layout) in the
    active fake mode, made as the mode makes it: the meta kernel's tensor under ``in_kernel_invocation_manager``,
    wrapped in a ``FakeTensor`` -- what ``torch.empty`` under the mode does (``fake_impls.constructors``) without the
    dispatch and argument normalization around it (~85 instead of ~175 us with symbolic sizes, ~12 instead of
    ~75 us without).  Outside a fake mode, ``torch.empty`` and its kin.

    >>> import pytest; torch = pytest.importorskip("torch")
    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():
    ...     t = fresh((2, 3), torch.float32, torch.device("cpu"))
    >>> type(t).__name__, tuple(t.shape), t.stride(), t.device.type
    ('FakeTensor', (2, 3), (3, 1), 'cpu')
    """
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    aten = torch.ops.aten
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None:
        if stride is None:
            return torch.empty(size, dtype=dtype, device=device)
        if isinstance(stride, _Permuted):
            return torch.empty_permuted(size, stride, dtype=dtype, device=device)
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    with in_kernel_invocation_manager(mode), torch._C.DisableTorchFunction():
        if stride is None:
            meta = aten.empty.memory_format(size, dtype=dtype, device=_META)
        elif isinstance(stride, _Permuted):
            meta = aten.empty_permuted.default(size, list(stride), dtype=dtype, device=_META)
        else:
            meta = aten.empty_strided.default(size, stride, dtype=dtype, device=_META)
    return FakeTensor(mode, meta, torch.device(device))


_META = "meta"


def _view(torch: Any, base: Any, spec: tuple[Any, ...]) -> Any:
    """``as_strided(base, size, stride, offset)`` as the active fake mode makes it: its C++ meta kernel on ``base``
    under ``in_kernel_invocation_manager``, the view wrapped in a ``FakeTensor`` on ``base``'s device (the storage is
    ``base``'s) -- without the mode's dispatch, whose argument checks cost ~50 symbolic size operations where the
    kernel asks one.  Outside a fake mode, or on a tensor of another mode, ``aten.as_strided`` itself."""
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    _, size, stride, offset = spec
    mode = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)
    if mode is None or not isinstance(base, FakeTensor) or base.fake_mode is not mode or base.constant is not None:
        return torch.ops.aten.as_strided.default(base, size, stride, offset)
    with in_kernel_invocation_manager(mode), torch._C.DisableTorchFunction():
        meta = torch.ops.aten.as_strided.default(base, size, stride, offset)
    return FakeTensor(mode, meta, base.fake_device)


def _meta(t: Any) -> tuple[Any, ...]:
    """A tensor's size, stride and offset expressions, dtype and device."""
    return (tuple(_expr(d) for d in t.shape), tuple(_expr(s) for s in t.stride()), _expr(t.storage_offset()), t.dtype,
            t.device)


def _shape_env(specs: list[Any]) -> Any:
    """The ShapeEnv of the first symbolic size or stride in ``specs``, or None (plain ints only)."""
    for spec in specs:
        if spec is None:
            continue
        for part in spec[1:3]:
            for x in part or ():
                node = getattr(x, "node", None)
                if node is not None and getattr(node, "shape_env", None) is not None:
                    return node.shape_env
    return None


def _expr(x: Any) -> Any:
    """A size as a hashable value: the sympy expression behind a SymInt, or the int."""
    node = getattr(x, "node", None)
    return node.expr if node is not None else int(x)


def _storage(t: Any) -> Any:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _tensors(obj: Any, kind: type) -> list[Any]:
    if isinstance(obj, kind):
        return [obj]
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v, kind)]
    return []


#: in-place ops that can change a tensor's sizes, strides or storage: never answered with their input
_RESHAPING = ("resize", "set_", "as_strided_", "squeeze_", "unsqueeze_", "transpose_", "t_", "swapdims_", "swapaxes_",
              "detach_", "unfold_", "_coalesced_")


def _writes_self_only(func: Any) -> bool:
    """Whether ``func``'s schema writes its first argument, no other, and returns that argument alone."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.arguments or len(schema.returns) != 1:
        return False
    name = schema.name.split("::")[-1]
    if any(name.startswith(r) or r in name for r in _RESHAPING):
        return False
    writes = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
    ret = schema.returns[0].alias_info
    first = schema.arguments[0].alias_info
    return (writes[0] and sum(writes) == 1 and ret is not None and ret.is_write and first is not None
            and set(ret.before_set) == set(first.before_set))
