"""Shape propagation once per repeated block: a fake op's outputs by the op and its inputs' symbolic metadata.

On fake tensors with symbolic sizes an aten op costs 0.3-100 ms of CPU (PyTorch's meta kernels compute every
size, stride and contiguity test with SymInts; ``native_layer_norm``, ``_safe_softmax`` and ``tril`` run whole
Python decompositions), against microseconds for a real op of the sizes these traces use.  The blocks of a
transformer repeat the same ops on the same symbolic shapes, layer after layer and in every layer count of the
step's fold, so most ops of a trace were already computed once in the same ``ShapeEnv``.

:class:`ShapeCache` keys an op by its overload and, for every argument, the sympy expressions of a fake tensor's
sizes, strides and storage offset with its dtype and device (plain values as they are, typed: ``True`` is not
``1``).  An op is cached only where its outputs are tensors on fresh storages that ``torch.empty(size)`` or
``torch.empty_strided(size, stride)`` remakes exactly (the same stride and storage-bytes expressions, no offset, no
constant value, every size backed): a view, an in-place op, an op whose storage is larger than its tensor
(``_embedding_bag``'s ``offset2bag``) or any op whose outputs alias an input is run every time.  A hit makes fresh
fake tensors of the cached metadata; the ShapeEnv already holds every guard the first run added (the same
expressions in the same environment: a repeat adds none), so what the recorders see -- new storages with the same
symbolic bytes -- is what the op would have made.  The cache lives as long as one fake run (one ShapeEnv).
"""

from __future__ import annotations

from typing import Any

#: plain argument types that key as themselves (with their type)
_PLAIN = (int, float, bool, str, type(None))


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
        self.never: set[Any] = set()  # ops whose outputs aliased an input once: not keyed again
        self.hits = 0
        self.misses = 0

    def _part(self, x: Any) -> Any:
        """The key of one argument, or None where it cannot be keyed (a real tensor, a constant, an object)."""
        if isinstance(x, self._fake):
            if x.constant is not None or x.layout != self._torch.strided:
                return None
            return ("T", tuple(_expr(d) for d in x.shape), tuple(_expr(s) for s in x.stride()),
                    _expr(x.storage_offset()), x.dtype, x.device)
        if isinstance(x, self._torch.Tensor):
            return None
        if isinstance(x, self._symbolic):
            return ("S", type(x).__name__, x.node.expr)
        if isinstance(x, _PLAIN) or isinstance(x, self._plain_torch):
            return (type(x).__name__, x)
        if isinstance(x, list | tuple):
            parts = tuple(self._part(v) for v in x)
            return None if any(p is None for p in parts) else (type(x).__name__, parts)
        return None

    def key(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The cache key of ``func(*args, **kwargs)``, or None (not cacheable)."""
        if func in self.never:
            return None
        parts = self._part(args)
        if parts is None:
            return None
        named = tuple((k, self._part(v)) for k, v in sorted(kwargs.items()))
        if any(p is None for _, p in named):
            return None
        return (func, parts, named)

    def get(self, key: Any) -> Any:
        """The outputs made anew from the cached metadata, or None (not seen, or not cacheable)."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.hits += 1
        wrap, specs = entry
        made = [None if s is None else _make(self._torch, s) for s in specs]
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
        inputs = {_storage(t) for t in _tensors((args, kwargs), self._torch.Tensor)}
        seen: set[Any] = set()
        specs = []
        for o in outs:
            if o is None:
                specs.append(None)
                continue
            st = _storage(o)
            if st is None or st in inputs or st in seen:
                self.never.add(func)  # a view or an in-place op: its outputs are its inputs' storages
                return
            seen.add(st)
            spec = self._spec(o)
            if spec is None:
                return
            specs.append(spec)
        self.entries[key] = (wrap, tuple(specs))

    def _spec(self, o: Any) -> tuple[Any, ...] | None:
        """(size, stride or None, dtype, device) of a fresh output that ``empty`` (stride None: contiguous) or
        ``empty_strided`` remakes with the same strides and the same storage bytes, to the expression."""
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        if not isinstance(o, self._fake) or o.constant is not None or o.layout != self._torch.strided:
            return None
        size, stride = tuple(o.shape), tuple(o.stride())
        if free_unbacked_symbols(size + stride) or _expr(o.storage_offset()) != 0:
            return None
        want = (tuple(_expr(s) for s in stride), _expr(o.untyped_storage().nbytes()))
        for spec in ((size, None, o.dtype, o.device), (size, stride, o.dtype, o.device)):
            probe = _make(self._torch, spec)
            if (tuple(_expr(s) for s in probe.stride()), _expr(probe.untyped_storage().nbytes())) == want:
                return spec
        return None  # e.g. a storage larger than its tensor: remade, it would be smaller


def _make(torch: Any, spec: tuple[Any, ...]) -> Any:
    size, stride, dtype, device = spec
    if stride is None:
        return torch.empty(size, dtype=dtype, device=device)
    return torch.empty_strided(size, stride, dtype=dtype, device=device)


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
