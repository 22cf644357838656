"""Deterministic release of a collective's tensors under gloo: every free a rank's recorder counts happens on the
recording (main) thread, at a defined op, not whenever gloo's worker thread lets go.

Why: a c10d collective's ``Work`` holds its tensors; gloo's worker thread drops its references after it marks the
work done, so ``Work.wait()`` can return while it still holds them.  Where that reference is the last, the storage is
freed on the worker thread, and the recorder's finalizer (:mod:`symmem.record.live_bytes`) runs there whenever it
gets the GIL -- a few ops later on a quiet machine, later on a busy one.  Counting the references is not enough:
when gloo drops a tensor's second-to-last C++ reference, ``Tensor._use_count()`` reads 1 at once, but the Python
object that C++ kept alive (PyObject preservation) is released by a ``Py_DECREF`` that waits for the GIL on gloo's
thread; if the caller drops the tensor in between, the storage dies there (1 in 3,000 ``all_reduce`` s measured).

How, inside :func:`released`: each collective the engines call through ``torch.distributed`` runs on *aliases*
(``detach()``, made outside every dispatch mode: the same storage, new tensor objects only gloo holds) while the
wrapper keeps the caller's tensors; the ``Work`` it returns (a :class:`HeldWork`, still a c10d ``Work``), after the
real ``wait()``, lets go of the real work and yields the GIL until every alias's Python object is dead (gloo's
pending decref included: a weak reference says so) and every storage's use count is back at most to what it was
before the collective; then it drops the caller's tensors, here.  A synchronous call runs asynchronously and waits
the same way.  Needs ``torch`` with ``torch.distributed`` (imported lazily).
"""

from __future__ import annotations

import inspect
import threading
import time
import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import SymmemError

#: the ``torch.distributed`` functions the engines call (FSDP2, FSDP1, ZeroRedundancyOptimizer, pipelining's
#: ``batch_isend_irecv`` runs ``isend``/``irecv``), wrapped by :func:`released`
WRAPPED = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor",
           "all_reduce", "broadcast", "isend", "irecv")
#: the longest wait for gloo to let go of a finished collective's tensors (it does within microseconds)
PATIENCE = 5.0

_inside = threading.local()  # a wrapped call made from a wrapped call (the deprecated names call the new) passes


def _work_class() -> type:
    import torch.distributed as dist

    base = dist.distributed_c10d.Work

    class HeldWork(base):  # type: ignore[misc, valid-type]
        """A collective's work that, once waited for, releases its tensors on the waiting thread (see the module)."""

        def __init__(self, work: Any, aliases: list[Any], base: dict[int, int], keep: list[Any], name: str) -> None:
            super().__init__()
            self._work, self._aliases, self._base, self._keep, self._name = work, aliases, base, keep, name

        def wait(self, timeout: Any = None) -> bool:
            if self._work is None:
                return True
            ok = self._work.wait() if timeout is None else self._work.wait(timeout)
            self._work = None  # gloo's worker thread holds the rest: let it go
            settle(self._aliases, self._base, self._name)
            self._aliases, self._base, self._keep = [], {}, []  # the caller's tensors, released here
            return bool(ok) if ok is not None else True

        def is_completed(self) -> bool:
            return self._work is None or bool(self._work.is_completed())

        def get_future(self) -> Any:
            if self._work is None:
                raise SymmemError("a released collective's future is gone; take it before wait()")
            return self._work.get_future()

    return HeldWork


def settle(aliases: list[Any], base: dict[int, int], name: str = "a collective") -> None:
    """Yield the GIL until every weakly referenced alias is dead and every storage's use count (by key) is back at
    most to ``base``."""
    import torch

    count = torch._C._storage_Use_Count
    deadline = None
    pause = 0.0
    while any(a() is not None for a in aliases) or any(count(k) > n for k, n in base.items()):
        if deadline is None:
            deadline = time.monotonic() + PATIENCE
        elif time.monotonic() > deadline:
            alive = sum(a() is not None for a in aliases)
            over = [count(k) - n for k, n in base.items() if count(k) > n]
            raise SymmemError(f"gloo held the tensors of a finished {name} for over {PATIENCE:g} s ({alive} of "
                              f"{len(aliases)} aliases alive, storages held {over} times more than before it)")
        # lets gloo's worker thread take the GIL for its pending decref; a yield first, then sleeps growing to 1 ms
        # (on busy cores a spinning yield burns the CPU gloo's thread waits for; the wait's length decides nothing)
        time.sleep(pause)
        pause = min(1e-3, pause * 2 or 2e-5)


def held(fn: Callable[..., Any], work_class: type) -> Callable[..., Any]:
    """``fn`` (a ``torch.distributed`` collective) on aliases, returning a ``work_class`` that releases them (see
    the module); a synchronous call waits before it returns, as ``fn`` does."""
    signature = inspect.signature(fn)
    has_async = "async_op" in signature.parameters

    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(_inside, "depth", 0):
            return fn(*args, **kwargs)
        bound = signature.bind(*args, **kwargs)
        wait = has_async and not bound.arguments.get("async_op", False)
        if has_async:
            bound.arguments["async_op"] = True
        aliases = Aliases()  # every tensor argument, alone or in a list or tuple
        for name, value in list(bound.arguments.items()):
            bound.arguments[name] = aliases.of(value)
        keep, base, refs = aliases.handed()
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            work = fn(*bound.args, **bound.kwargs)
        finally:
            _inside.depth -= 1
        del bound  # this frame holds no alias (a synchronous call waits in it)
        if work is None:  # not in the group: nothing ran
            return None
        out = work_class(work, refs, base, keep, fn.__name__)
        del work, keep  # the work and the caller's tensors are out's to release
        if wait:
            out.wait()
            return None
        return out

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


class Aliases:
    """Aliases of a collective's tensor arguments, for :func:`held` (``torch.distributed``'s named arguments) and
    :class:`FuncolRelease` (funcol's ``args, kwargs``) alike: :meth:`of` gives a pytree with each tensor replaced by
    an alias (``detach()``, made outside every dispatch mode: no op of the step; one alias per tensor object), noting
    the storage's use count before the collective; :meth:`handed` gives the caller's tensors to keep, those counts and
    weak references to the aliases, and lets go of both."""

    def __init__(self) -> None:
        #: storage key -> its use count before the collective
        self.base: dict[int, int] = {}
        #: id(the caller's tensor) -> (it, its alias)
        self.given: dict[int, tuple[Any, Any]] = {}

    def of(self, tree: Any) -> Any:
        import torch
        from torch.utils._pytree import tree_map_only

        return tree_map_only(torch.Tensor, self._alias, tree)

    def _alias(self, t: Any) -> Any:
        import torch
        from torch.utils._python_dispatch import _disable_current_modes

        if id(t) not in self.given:
            key = t.untyped_storage()._cdata
            self.base.setdefault(key, torch._C._storage_Use_Count(key))
            with _disable_current_modes(), torch.no_grad():  # no op of the step: a handle on its memory
                self.given[id(t)] = (t, t.detach())
        return self.given[id(t)][1]

    def back(self) -> dict[int, Any]:
        """id(alias) -> the caller's tensor (an in-place collective returns the alias it was given)."""
        return {id(a): t for t, a in self.given.values()}

    def handed(self) -> tuple[list[Any], dict[int, int], list[Any]]:
        """(the caller's tensors, the use counts before, weak references to the aliases); this holds neither
        after."""
        keep = [t for t, _ in self.given.values()]
        refs = [weakref.ref(a) for _, a in self.given.values()]
        self.given.clear()
        return keep, self.base, refs


@contextmanager
def released(leave: Collection[str] = ()) -> Iterator[None]:
    """Inside, the collectives of :data:`WRAPPED` (less those named in ``leave``, which stay c10d's own) release
    their tensors on the calling thread (see the module)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    work_class = _work_class()
    # an older torch lacks some of the names (2.11 has no `all_gather_single`): none of its engines calls them
    saved = {name: getattr(c10d, name) for name in WRAPPED if name not in leave and hasattr(c10d, name)}
    wrapped = {name: held(fn, work_class) for name, fn in saved.items()}
    # P2POp checks its op against c10d's isend/irecv (and batch_isend_irecv names a send by `is isend`): both
    # modules name the wrapper
    for module in (c10d, dist):
        for name, fn in wrapped.items():
            setattr(module, name, fn)
    try:
        yield
    finally:
        for module in (c10d, dist):
            for name, fn in saved.items():
                setattr(module, name, fn)



#: funcol's collectives (``torch.ops._c10d_functional``; the in-place, ``_out`` and coalesced ones by these names'
#: starts), run by :class:`FuncolRelease`
FUNCOL = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "isend", "irecv", "batch_p2p")


class FuncolRelease:
    """The same deterministic release for funcol's collectives (``torch.ops._c10d_functional.*``: DTensor's and
    tensor parallelism's), which run from C++ -- no Python function to wrap -- and are waited for by
    ``_c10d_functional.wait_tensor``: a recorder's dispatch mode hands each such op to :meth:`run`
    (:class:`symmem.record.sharded.ShardTracker` does).

    A collective runs on aliases of its tensor arguments (the work holds those) while this keeps the caller's, and
    is waited for at once, inside the op (funcol's own ``wait_tensor`` on each output: the caller's later wait finds
    nothing left to wait for); :func:`settle` then waits until gloo let go of every alias and of every tensor the
    op made (their Python objects dead, the arguments' storages back at their use counts before it, each output's
    storage held by the caller's alias alone), and each output goes back to the caller as an alias of the work's.
    So gloo holds nothing once the op returns: every free of the collective's tensors runs on the recording thread,
    where the caller lets go -- the moment each repeat's fewest bytes took it at (gloo done at once), in every step
    alike."""

    def run(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``func`` (an op of ``_c10d_functional``) run as the class says; its output.  Its other ops
        (``wait_tensor``, ``_wrap_tensor_autograd``: no collective) run as they are."""
        if not func.__name__.startswith(FUNCOL):
            return func(*args, **kwargs)
        import torch
        from torch.utils._python_dispatch import _disable_current_modes
        from torch.utils._pytree import tree_leaves, tree_map_only

        aliases = Aliases()
        aliased = aliases.of((args, kwargs))
        out = func(*aliased[0], **aliased[1])
        del aliased
        wait, made = torch.ops._c10d_functional.wait_tensor.default, None
        for made in tree_leaves(out):
            if isinstance(made, torch.Tensor):
                wait(made)
        del made  # this frame holds no output of the work's
        back = aliases.back()
        base = aliases.base
        outputs: list[Any] = []  # weak references to the work's own outputs

        def returned(o: Any) -> Any:
            if id(o) in back:  # in place: the caller's own tensor
                return back[id(o)]
            outputs.append(weakref.ref(o))  # the work's: dead once gloo lets go
            key = o.untyped_storage()._cdata
            # gloo holds views of its own on the storage (an all-gather's chunks): once it lets go, the storage's
            # Python object (just made, kept as long as the storage) and the alias below are all that hold it
            base[key] = base.get(key, 1) + 1
            with _disable_current_modes(), torch.no_grad():
                return o.detach()

        result = tree_map_only(torch.Tensor, returned, out)
        keep, _, refs = aliases.handed()  # the caller's tensors, held past gloo's hold on their aliases
        back.clear()
        del out
        settle([*refs, *outputs], base, func.__name__)
        del keep
        return result
