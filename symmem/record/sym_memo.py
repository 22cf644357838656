"""PyTorch's symbolic size arithmetic remembered for one fake run.

On fake tensors with symbolic sizes every size computation is a call into Python: PyTorch's C++ meta kernels
(``empty``, ``empty_strided``, ``as_strided``: the contiguous strides, the storage bytes, the size checks of every
tensor they make) and its Python ones (broadcasting, ``_reshape_view_helper``, contiguity) ask ``SymNode.mul``,
``SymNode.eq``, ``SymNode.guard_bool`` ..., each building a sympy expression and a new ``SymNode`` (~50 us).  A
repeated block asks the same questions of the same ``SymNode`` objects: a tensor's sizes are the SymInts its kernel
was given, and a shape-cache hit (:mod:`.shape_cache`) remakes an op's outputs from the first run's SymInts, so the
next layer's operands are the same objects again.  A remake of a cached op asked 10-15 of them a tensor (most of a
hit), a missed op's kernel tens.

:class:`SymMemo` answers those calls from a table while it is :meth:`~SymMemo.active` (the whole recorded run, under a
shape cache): the arithmetic and comparisons by the method and its operands' identity (each operand kept alive by the
table, so an identity is never reused), the integer constants PyTorch wraps (``wrap_int``) by value, and the guards
(``guard_bool``, ``expect_true``, ``guard_or_false``, ``guard_or_true``) and ``maybe_as_int`` by the node.  The answers
are PyTorch's own, computed the first time: a node's expression, hint and type depend on its operands' only (sympy on
symbols whose assumptions never change), and a guard asked again in the same ``ShapeEnv`` finds what its first asking
recorded (or the static answer) and records nothing.  What a ``ShapeEnv`` can change under a remembered node -- its
replacements, which ``SymNode.expr`` applies -- clears the table (``_replacements_version_counter``, read at every
lookup).  ``mod``, ``int_floordiv``, ``truediv`` and ``pow`` (value ranges, which guards narrow) and
``guard_size_oblivious`` are not remembered, nor anything under a proxy (``make_fx``) mode, which records each call.
A PyTorch whose ``ShapeEnv`` keeps no such counter (2.11, the GPU image's) gets no table: nothing there says when a
remembered answer went stale, so every call is PyTorch's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: False: every call is answered anew (for comparisons; the shape cache still remakes its hits in-kernel)
REMEMBER = True

#: the ShapeEnv attribute that counts its replacements' changes (PyTorch 2.11's has none: no table there)
_COUNTER = "_replacements_version_counter"

#: SymNode methods whose answer depends on the operands' expressions, hints and types only
_BINARY = ("add", "sub", "mul", "eq", "ne", "ge", "gt", "le", "lt", "sym_max", "sym_min", "and_", "or_")
#: SymNode guards (file and line name the asker only); a repeated one records nothing new
_GUARDS = ("guard_bool", "expect_true", "guard_or_false", "guard_or_true")


_ORIGINALS: dict[str, Any] = {}


def _originals(node: type) -> dict[str, Any]:
    """PyTorch's own SymNode methods of the names patched, read once (before any patch: only this module patches)."""
    if not _ORIGINALS:
        _ORIGINALS.update((name, node.__dict__[name]) for name in (*_BINARY, *_GUARDS, "maybe_as_int", "wrap_int"))
    return _ORIGINALS


class SymMemo:
    """Remembered SymNode answers for one ShapeEnv (one fake run)."""

    def __init__(self) -> None:
        from torch.fx.experimental.sym_node import SymNode

        self._node = SymNode
        self.on = False  # answering from the table now (inside :meth:`active`)
        self._installed = 0  # how many :meth:`installed` contexts are open
        self.results: dict[tuple[str, int, int], tuple[Any, Any, Any]] = {}
        self.answers: dict[tuple[str, int], tuple[Any, Any]] = {}
        self.ints: dict[int, Any] = {}
        self.version: tuple[int, int] | None = None  # (id of the ShapeEnv, its replacements' version)
        original = _originals(SymNode)
        self._patches = [(name, self._binary(name, original[name])) for name in _BINARY] + \
            [(name, self._guard(name, original[name])) for name in (*_GUARDS, "maybe_as_int")] + \
            [("wrap_int", self._wrap_int(original["wrap_int"]))]
        self._saved: list[tuple[str, Any]] = []

    def _check(self, env: Any) -> None:
        """Forget everything when the ShapeEnv's replacements changed (``SymNode.expr`` would read them)."""
        version = (id(env), getattr(env, _COUNTER, 0))
        if version != self.version:
            self.results.clear()
            self.answers.clear()
            self.ints.clear()
            self.version = version

    def _binary(self, name: str, impl: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        results = self.results
        memo = self

        def remembered(node: Any, other: Any) -> Any:
            env = node.shape_env
            if not memo.on or env is None:
                return impl(node, other)
            if (id(env), env._replacements_version_counter) != memo.version:
                memo._check(env)
            key = (name, id(node), id(other))
            hit = results.get(key)
            if hit is not None:
                return hit[2]
            out = impl(node, other)
            results[key] = (node, other, out)
            return out

        return remembered

    def _guard(self, name: str, impl: Callable[..., Any]) -> Callable[..., Any]:
        answers = self.answers
        memo = self

        def remembered(node: Any, *where: Any) -> Any:
            if not memo.on or node.shape_env is None:
                return impl(node, *where)
            key = (name, id(node))
            hit = answers.get(key)
            if hit is not None:
                return hit[1]
            out = impl(node, *where)
            memo._check(node.shape_env)  # a guard can add a replacement: what was remembered may read differently
            answers[key] = (node, out)
            return out

        return remembered

    def _wrap_int(self, impl: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
        ints = self.ints
        memo = self

        def remembered(node: Any, num: int) -> Any:
            env = node.shape_env
            if not memo.on or type(num) is not int or env is None:
                return impl(node, num)
            if (id(env), env._replacements_version_counter) != memo.version:
                memo._check(env)  # a constant of another ShapeEnv is not this one's
            hit = ints.get(num)
            if hit is None:
                hit = ints[num] = impl(node, num)
            return hit

        return remembered

    @contextmanager
    def installed(self) -> Iterator[None]:
        """SymNode's methods go through this table inside (answering from it only while :attr:`on`): installed
        once for a fake run, so that each remake only switches it on."""
        node = self._node
        if self._installed == 0:
            self._saved = [(name, node.__dict__[name]) for name, _ in self._patches]  # PyTorch's, or another run's
            for name, patch in self._patches:
                setattr(node, name, patch)
        self._installed += 1
        try:
            yield
        finally:
            self._installed -= 1
            if self._installed == 0:
                for name, original in self._saved:
                    setattr(node, name, original)

    @contextmanager
    def active(self, env: Any) -> Iterator[None]:
        """SymNode's methods answer from the table inside (``env``: the fake run's ShapeEnv).  Where the table is not
        installed yet it is installed for the block (a run that installs it once makes each remake's switch cheap:
        patching a class's methods also drops PyTorch's lookups of SymNode's attributes from Python's type cache)."""
        if not hasattr(env, _COUNTER):  # an older PyTorch: a stale answer could not be told from a fresh one
            yield
            return
        if self._installed == 0:
            with self.installed(), self.active(env):
                yield
            return
        self._check(env)
        before, self.on = self.on, REMEMBER and not _proxy_tracing()
        try:
            yield
        finally:
            self.on = before


@contextmanager
def unseen() -> Iterator[None]:
    """Inside, a guard's source location (torch's first frame outside its ``uninteresting_files()``: symmem's
    :attr:`~symmem.importer.records.Guard.where`) skips this module's frames as torch's own, so that a guard first
    asked through the table names the PyTorch code that asked it (``_refs/__init__.py:4435 in split_with_sizes``)
    as without the table, not :meth:`SymMemo._guard`.  The set torch caches is extended for the block only."""
    from torch.fx.experimental import symbolic_shapes

    files = symbolic_shapes.uninteresting_files()  # cached: the same set every call
    added = __file__ not in files
    if added:
        files.add(__file__)
    try:
        yield
    finally:
        if added:
            files.discard(__file__)


def _proxy_tracing() -> bool:
    """Whether a proxy mode (``make_fx``) is tracing: it records every SymNode call into its graph."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None
