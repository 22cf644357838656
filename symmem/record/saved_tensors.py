"""The saved-tensor recorder: one forward pass, every storage autograd packs for backward, who made it, who keeps it.

The same recorder runs on fake tensors (the symbolic trace, :mod:`symmem.importer`) and on real ones (the
importer's check, and :func:`symmem.record.verify.measure`); only the sizes it reads differ (``nbytes()`` is an ``int``
or a ``SymInt``):

- a :class:`~symmem.record.modules.ModuleTracker` gives the innermost module running;
- a ``TorchFunctionMode`` gives the outermost torch function running (``matmul``, ``layer_norm``);
- a ``TorchDispatchMode`` numbers every aten op in forward order, notes which op created each storage
  (its *birth*), maps autograd sequence numbers to that order, can replace an op's implementation (for
  the fake run only) and records or replays data-dependent scalar reads;
- ``saved_tensors_hooks`` see every packed tensor.  The hook packs ``t.detach()`` (a new tensor object on
  the same storage, no ``grad_fn``): returning ``t`` itself would make ``t -> grad_fn -> t`` cycles that keep
  discarded branches alive.  After the forward the outputs are dropped (their ``grad_fn`` roots kept) and
  only packed tensors still alive count; walking the graph from the roots gives the nodes that keep them.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..errors import SymmemError
from .identity import dtype_name, op_name, storage_key, tensors
from .modules import ModuleTracker
from .shape_cache import ShapeCache


@dataclass
class Packed:
    """One packed tensor, as seen by the pack hook."""

    key: int
    nbytes: Any  # int or SymInt
    shape: tuple[Any, ...]
    dtype: str
    module: str
    op: str
    kind: str
    birth: tuple[int, str, str] | None  # (seq, aten op, module) of the op that created the storage
    label: str | None = None  # the parameter, buffer or input name, for those kinds
    saver: int = -1  # autograd sequence number of the node being built when it was packed
    producer: str | None = None  # the packed tensor's own grad_fn (None for one that needs no gradient)
    device: str = ""  # where its storage lives (``cuda:0``, ``cpu``: a kernel's host scalars)


@dataclass
class Kept:
    """A storage still kept at the end of the forward: its first packed tensor and the nodes that keep it."""

    first: Packed
    savers: list[tuple[int | None, str, int]] = field(default_factory=list)  # (op seq, node name, autograd seq)


@dataclass
class Outcome:
    """What one recorded forward left: kept storages in order of first packing, ops run, scalar reads."""

    kept: list[Kept]
    ops: int
    reads: list[tuple[str, Any]]
    output: Any = None
    op_modules: list[str] = field(default_factory=list)  # the module running each aten op, by sequence number



def _node_names(roots: list[Any]) -> dict[int, str]:
    """Autograd sequence number -> node name for every node reachable from ``roots``."""
    out: dict[int, str] = {}
    seen: set[int] = set()
    todo = list(roots)
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        out[node._sequence_nr()] = node.name()
        todo.extend(fn for fn, _ in node.next_functions)
    return out


#: fake runs compute a repeated op's output shapes once (:mod:`.shape_cache`); False runs every op (for comparisons)
CACHE_SHAPES = True

#: more ops than this in one recorded run and tracing would take many minutes (GPT-2 runs ~40 a layer): refused
#: with the way out, since repeated layers stay symbolic anyway
MAX_OPS = 60_000


class SavedRecorder:
    """One recorded forward.  ``params``/``inputs`` map storage keys of parameters+buffers and of inputs to names.

    ``overrides`` maps an aten op to a replacement implementation (fake run only); ``replay`` is a list of
    scalar reads recorded by a real run of the same code path, answered in order on the fake run
    (``None``: record them); ``default_read`` answers a boolean read when there is nothing to replay
    (None: raise).  ``hold`` keeps every packed tensor alive until the recorder goes (so that no storage is
    freed and its address reused during the pass: one key, one storage, for a record of everything packed).
    ``modules.tag`` also tags each module output's autograd node with the module, for a backward's names.
    """

    def __init__(self, module: Any, *, params: dict[int, str], inputs: dict[int, str],
                 overrides: dict[Any, Callable[..., Any]] | None = None,
                 replay: list[tuple[str, Any]] | None = None, default_read: bool | None = None,
                 shape_env: Any = None, opaque: frozenset[Any] = frozenset(), hold: bool = False) -> None:
        self.module = module
        self.params = params
        self.inputs = inputs
        self.overrides = overrides or {}
        self.replay = replay
        self.default_read = default_read
        self.shape_env = shape_env
        self.opaque = opaque
        self.modules = ModuleTracker(module)
        self.quiet = False  # inside the pack hook: its own ops are not the forward's
        self.failed_at: str | None = None  # where the first error was raised (innermost op)
        self.fn = "?"
        self.aten = "?"
        self.seq = 0
        self.births: dict[int, tuple[int, str, str]] = {}
        self.op_modules: list[str] = []  # the module running each aten op, by op sequence number
        self.autograd_to_op: dict[int, int] = {}
        self.packed: list[tuple[Any, Packed]] = []  # (weakref to the packed tensor, record)
        self.held: list[Any] | None = [] if hold else None
        self.reads: list[tuple[str, Any]] = []
        self.assumed: list[str] = []
        #: called after every counted op with (func, args, kwargs, out): the step's live-bytes recorder
        self.observe: Callable[[Any, Any, Any, Any], None] | None = None
        #: a fake run's ops by their inputs' symbolic metadata: a repeated block's shapes are computed once
        self.shapes: ShapeCache | None = ShapeCache() if shape_env is not None and CACHE_SHAPES else None

    @property
    def where(self) -> str:
        """The module path and op running now (for error messages)."""
        return f"module {self.modules.current or '<top>'!r}, op {self.fn} ({self.aten})"

    @property
    def current(self) -> str:
        """The innermost module running."""
        return self.modules.current

    # --- modes -------------------------------------------------------------------------------------
    def _modes(self) -> tuple[Any, Any]:
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._python_dispatch import TorchDispatchMode

        rec = self
        stack = self.modules.stack  # read inline below: this runs for every op
        local_scalar = torch.ops.aten._local_scalar_dense.default
        peek = torch.autograd._get_sequence_nr
        device_of = _fake_device_answer()

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if rec.quiet:
                    return func(*args, **(kwargs or {}))
                before = rec.fn
                rec.fn = getattr(func, "__name__", str(func))
                try:
                    return func(*args, **(kwargs or {}))
                except Exception:
                    rec.failed_at = rec.failed_at or rec.where
                    raise
                finally:
                    rec.fn = before

        class Ops(TorchDispatchMode):
            @classmethod
            def _should_skip_dynamo(cls) -> bool:
                # PyTorch wraps a mode's __torch_dispatch__ in torch._dynamo.disable unless told not to (a few us of
                # every op): nothing here is compiled
                return False

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
                if func is device_of.op:  # a fake tensor's device: FakeTensorMode's own answer, without the trip
                    found = device_of(args)
                    if found is not None:
                        return found
                kwargs = kwargs or {}
                if rec.quiet or _metadata(func):  # size/device queries are not ops of the forward
                    return func(*args, **kwargs)
                seq = rec.seq
                if seq >= MAX_OPS:
                    raise SymmemError(
                        f"the module runs more than {MAX_OPS:,} ops in one pass (now at {rec.where}); tracing it "
                        "would take many minutes. Trace it with fewer repeated layers (hf: --config n_layer=2 or "
                        "num_hidden_layers=2): the layers that repeat stay symbolic (L), and --set L=N evaluates "
                        "the formula at your count")
                rec.seq += 1
                current = stack[-1] if stack else ""
                rec.op_modules.append(current)
                rec.autograd_to_op.setdefault(peek() - 1, seq)
                rec.aten = name = op_name(func)
                if func is local_scalar:
                    value = rec._scalar(func, args, kwargs)
                    if rec.observe is not None:
                        rec.observe(func, args, kwargs, value)
                    return value
                if func in rec.opaque:
                    raise OpaqueKernel(
                        f"{func} at {rec.where} keeps a oneDNN workspace whose size only oneDNN knows (its fake "
                        "kernel says 0) and which is rounded to 4 KiB pages: no exact formula. Trace (and train) "
                        "under torch.backends.mkldnn.flags(enabled=False), where the CPU LSTM/GRU runs "
                        "PyTorch's own cells and traces exactly")
                impl = rec.overrides.get(func)
                shapes = rec.shapes
                key = shapes.key(func, args, kwargs) if shapes is not None else None
                same = shapes.same_key(func, args, kwargs) if shapes is not None and key is None and impl is None \
                    else None
                try:
                    out = shapes.get(key, args, kwargs) if key is not None else \
                        shapes.same(same, args) if same is not None else None
                    made = out is None  # a hit remakes metadata the cache took only without data-dependent sizes
                    if made:
                        out = impl(*args, **kwargs) if impl is not None else func(*args, **kwargs)
                        if key is not None:
                            shapes.store(func, key, args, kwargs, out)
                        elif same is not None:
                            shapes.store_same(same, args, out)
                except Exception:
                    rec.failed_at = rec.failed_at or rec.where
                    raise
                birth = (seq, name, current)
                if rec.shape_env is not None and made:
                    rec._data_dependent_sizes(func, out)
                for t in tensors(out):
                    try:
                        key = storage_key(t)
                    except (RuntimeError, NotImplementedError):
                        continue
                    if key not in rec.births or not _aliases_input(key, args):
                        rec.births[key] = birth
                if rec.observe is not None:
                    rec.observe(func, args, kwargs, out)
                return out

        return Functions(), Ops()

    def _data_dependent_sizes(self, func: Any, out: Any) -> None:
        """Refuse outputs whose sizes depend on data (``nonzero``, ``masked_select``: unbacked SymInts)."""
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        for t in tensors(out):
            if free_unbacked_symbols(tuple(t.shape)):
                raise SymmemError(f"{func} at {self.where} returns a tensor whose size depends on the data "
                                  f"({tuple(t.shape)}); a formula in the declared sizes cannot say how big it is. "
                                  "method='fit' traces real tensors at concrete sizes (the sizes then come from "
                                  "the example data)")

    def _scalar(self, func: Any, args: Any, kwargs: Any) -> Any:
        """A data-dependent read (``bool(t)``, ``t.item()``): record it, or answer it on the fake run."""
        from torch._subclasses.fake_tensor import DataDependentOutputException

        t = args[0]
        if self.replay is None:  # a real run: read and record
            value = func(*args, **kwargs)
            self.reads.append((dtype_name(t.dtype), value))
            return value
        index = len(self.reads)
        from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

        try:
            value = func(*args, **kwargs)  # a fake tensor with a known constant answers itself
        except (DataDependentOutputException, RuntimeError) as e:
            if isinstance(e, RuntimeError) and "data-dependent" not in str(e).lower() \
                    and "DataDependent" not in type(e).__name__:
                raise
            value = None
        if value is not None and hasattr(value, "node") and free_unbacked_symbols(value.node.expr):
            value = None  # an unbacked symbol: the value is unknown
        if value is None:
            if index < len(self.replay):
                dt, value = self.replay[index]
                if dt != dtype_name(t.dtype):
                    raise SymmemError(f"the traced forward reads a {dtype_name(t.dtype)} value where the real "
                                      f"forward read a {dt} one ({self.where}); the code paths differ")
                if dt != "bool":
                    raise SymmemError(f"the forward reads the value of a {dt} tensor ({self.where}): its sizes may "
                                      "depend on data; trace it with method='fit' (concrete sizes)")
            elif self.default_read is not None and dtype_name(t.dtype) == "bool":
                value = self.default_read
                self.assumed.append(f"{self.where}: a data-dependent bool read answered {value} "
                                    "(no real forward to replay; assumes unpadded, unpacked inputs)")
            else:
                raise SymmemError(f"the forward reads tensor data ({self.where}); fake tensors have none. Trace "
                                  "with real weights (a real forward is replayed) or with method='fit'")
        self.reads.append((dtype_name(t.dtype), value))
        return value

    # --- saved tensors -----------------------------------------------------------------------------
    def _pack(self, t: Any) -> Any:
        # The node that saves t was created just before (autograd numbers nodes as it builds them; nothing
        # below autograd builds one), so the next sequence number minus one is the saver's.
        saver = self._peek() - 1
        self.quiet = True
        try:
            d = t.detach()
        finally:
            self.quiet = False
        st = t.untyped_storage()
        key = st._cdata
        kind = "parameter" if key in self.params else "input" if key in self.inputs else "activation"
        rec = Packed(key, st.nbytes(), tuple(t.shape), dtype_name(t.dtype), self.modules.current, self.fn, kind,
                     self.births.get(key), self.params.get(key) or self.inputs.get(key), saver,
                     t.grad_fn.name() if t.grad_fn is not None else None, str(t.device))
        self.packed.append((weakref.ref(d), rec))
        if self.held is not None:
            self.held.append(d)
        return d

    # --- the run -----------------------------------------------------------------------------------
    @contextmanager
    def recording(self, dispatch: bool = True) -> Iterator[None]:
        """Record what runs inside: modules, torch functions, packed tensors, and with ``dispatch`` every aten op
        (numbered, births noted, overrides and value reads answered)."""
        import torch

        self._peek = torch.autograd._get_sequence_nr
        functions, ops = self._modes()
        with ExitStack() as stack:
            stack.enter_context(self.modules)
            stack.enter_context(functions)
            if dispatch:
                stack.enter_context(ops)
            if self.shapes is not None:  # PyTorch's symbolic size arithmetic remembered for the run (.sym_memo)
                stack.enter_context(self.shapes.memo.active(self.shape_env))
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack, lambda x: x))
            yield

    def run(self, call: Callable[[], Any], keep_output: bool = False) -> Outcome:
        """Run ``call()`` (the forward) under all recorders and return what it kept."""
        # The collection below looks for cycles among the objects the forward made.  What existed before is set
        # aside (``gc.freeze``) so that it walks those only: under the ``symmem`` command's threshold the young
        # generations also hold everything imported and built since start-up (~0.2 s of walking on GPT-2).
        freeze = gc.get_freeze_count() == 0  # a caller's own freeze is left as it is
        if freeze:
            gc.freeze()
        try:
            with self.recording():
                out = self._guarded(call)
            # keep the outputs' grad_fn (the graph a loss would backpropagate through), drop the outputs
            roots = [t.grad_fn for t in tensors(out) if getattr(t, "grad_fn", None) is not None]
            if not keep_output:
                out = None
            gc.collect(1)  # young generations: packed tensors have no cycles; a full collection costs ~0.5 s
        finally:
            if freeze:
                gc.unfreeze()  # into the oldest generation
        names = _node_names(roots)  # autograd sequence number -> grad_fn name, for the live graph
        alive: dict[int, Kept] = {}
        for ref, rec in self.packed:
            if ref() is None or rec.nbytes == 0:
                continue
            kept = alive.setdefault(rec.key, Kept(rec))
            saver = (self.autograd_to_op.get(rec.saver), names.get(rec.saver, "?"), rec.saver)
            if saver not in kept.savers:
                kept.savers.append(saver)
        del roots  # only now: the roots keep the graph, and what it saved, alive
        kept = list(alive.values())
        for k in kept:
            k.savers.sort(key=lambda s: (s[0] if s[0] is not None else -1, s[2]))
        return Outcome(kept, self.seq, list(self.reads), out, self.op_modules)

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """Run the forward; turn what fake tensors cannot do into a SymmemError naming where it happened."""
        try:
            return call()
        except SymmemError:
            raise
        except Exception as e:
            where = self.failed_at or self.where
            name = type(e).__name__
            text = str(e).strip().splitlines()[0] if str(e).strip() else name
            low = text.lower()
            if name in ("DynamicOutputShapeException",):
                raise SymmemError(f"the forward has a data-dependent output shape at {where} ({text}); "
                                  "fake tensors cannot trace it: use method='fit' (concrete sizes)") from e
            if name in ("DataDependentOutputException", "GuardOnDataDependentSymNode",
                        "PendingUnbackedSymbolNotFound") or "data-dependent" in low or "data dependent" in low:
                raise SymmemError(f"the forward depends on tensor data at {where} ({name}: {text}); fake "
                                  "tensors have none: use method='fit' (concrete sizes)") from e
            if "symbolic sizes" in low or "symbolic shapes" in low:
                raise SymbolicSizesUnsupported(
                    f"a kernel cannot run with symbolic sizes at {where} ({text}); method='auto' fits it from "
                    "concrete sizes, or use method='fit'") from e
            if name in ("UnsupportedOperatorException", "UnsupportedFakeTensorException"):
                raise SymmemError(f"the forward runs an op fake tensors do not support at {where} ({text}); "
                                  "use method='fit' (concrete sizes, real tensors)") from e
            raise FakeKernelFailed(f"the forward failed at {where}: {name}: {text}") from e


class FakeKernelFailed(SymmemError):
    """The forward failed inside a kernel on the recorder's tensors (a fake kernel stricter than the real one:
    grouped matmuls' dtypes), where nothing more specific was recognised."""


class OpaqueKernel(SymmemError):
    """An op whose fake kernel cannot know what the real one saves (oneDNN's RNN workspace)."""


class SymbolicSizesUnsupported(SymmemError):
    """A kernel reads concrete sizes (``numel()`` in C++): the trace needs concrete sizes."""


class _FakeDevice:
    """``prim.device`` of one fake tensor answered as the fake world answers it, without dispatching on.

    On fake tensors ``Tensor.device`` is asked of Python (``prim.device``): autograd's C++ asks it of every input and
    output of every node it builds and runs -- about half the ops a recorder sees (2,385 of 5,003 in a 5-layer tiny
    Llama step).  Dispatched on, each goes through FakeTensorMode's wrappers (``torch._dynamo``'s disable, its call
    counter, a debug log under ``no_dispatch``) to ``fake_tensor._device_handler``: ``meta`` inside a kernel, else the
    tensor's ``fake_device``.  The recorder gives that answer itself where nothing else would see the query: the
    argument one ``FakeTensor`` and no dispatch mode left below the recorder's but the fake mode itself.  Anything
    else (a real tensor, another mode below, a subclass) is dispatched on as before (None)."""

    def __init__(self) -> None:
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        self.op = torch.ops.prim.device.default
        self._fake = FakeTensor
        self._meta = torch.device("meta")
        self._depth = torch._C._len_torch_dispatch_stack
        self._mode = torch._C._get_dispatch_mode
        self._key = torch._C._TorchDispatchModeKey.FAKE

    def __call__(self, args: Any) -> Any:
        if len(args) != 1 or type(args[0]) is not self._fake:
            return None
        depth = self._depth()  # the modes still below this one (the fake mode counts as one)
        if depth > 1 or (depth == 1 and self._mode(self._key) is None):
            return None
        t = args[0]
        return self._meta if t.fake_mode.in_kernel_invocation else t.fake_device


_FAKE_DEVICE: list[_FakeDevice] = []


def _fake_device_answer() -> _FakeDevice:
    if not _FAKE_DEVICE:
        _FAKE_DEVICE.append(_FakeDevice())
    return _FAKE_DEVICE[0]


_METADATA = frozenset({"is_contiguous", "is_strides_like_format", "is_non_overlapping_and_dense", "size", "stride",
                       "numel", "dim", "storage_offset"})


#: per op overload, whether it asks about metadata only (read for every op)
_IS_METADATA: dict[Any, bool] = {}


def _metadata(func: Any) -> bool:
    """Whether an op only asks about metadata (``prim.device``, ``aten.sym_size`` …)."""
    known = _IS_METADATA.get(func)
    if known is None:
        name = func.__name__.split(".")[0]
        known = _IS_METADATA[func] = func.namespace == "prim" or name.startswith("sym_") or name in _METADATA
    return known


def _aliases_input(key: int, args: Any) -> bool:
    """Whether ``key`` is the storage of one of the op's inputs (a view or in-place result: not a new birth)."""
    for t in tensors(args):
        try:
            if storage_key(t) == key:
                return True
        except (RuntimeError, NotImplementedError):
            continue
    return False
