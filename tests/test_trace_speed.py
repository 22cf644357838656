"""What makes ``symmem trace`` with its peak cheaper (issue 23 item 1) changes no value and no caller's state.

- In-place ops (``add_``, ``lerp_``, ``addcmul_`` ...: the optimizer step's) of a key already run answer their input
  itself (:meth:`symmem.record.shape_cache.ShapeCache.same`).  Oracle: PyTorch's own kernel, which returns its input
  with the metadata it came with; ops that reshape or re-store a tensor in place, and ops that write another
  argument, are never answered.  (``tests/test_shape_cache.py`` checks whole traces and steps equal with the cache
  off, where every op runs through PyTorch's fake kernels.)
- The collection after a recorded forward walks only what the forward made (``gc.freeze`` around it).  Oracle: the
  packed tensors PyTorch itself still holds after a full collection of everything the test made (the heap of the tests
  before it set aside); a caller's frozen objects stay frozen.
- ``symmem trace`` runs without the collector's young passes (:mod:`symmem.importer.collector`).  Oracle:
  ``gc.callbacks``, which sees every pass; the collector is enabled again afterwards.
- A fake tensor's ``prim.device`` (asked by autograd's C++ of every node's tensors) is answered by the recorder's
  mode itself.  Oracle: PyTorch's fake mode answering the same query; anything another mode would see is left to it.
"""

from __future__ import annotations

import gc
import weakref

import pytest

torch = pytest.importorskip("torch")

from symmem.record.saved_tensors import SavedRecorder  # noqa: E402
from symmem.record.shape_cache import ShapeCache  # noqa: E402


def test_in_place_ops_answer_their_input_and_reshaping_ones_always_run() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    aten = torch.ops.aten
    with FakeTensorMode(shape_env=ShapeEnv()):
        x, g = torch.empty(4, 6), torch.empty(4, 6)
        cache = ShapeCache()
        for op, args in ((aten.add_.Tensor, (x, g)), (aten.lerp_.Scalar, (x, g, 0.1)),
                         (aten.addcmul_.default, (x, g, g)), (aten.mul_.Scalar, (x, 0.9))):
            key = cache.same_key(op, args, {})
            assert key is not None and cache.same(key, args) is None  # not run yet
            out = op(*args)  # oracle: PyTorch's kernel returns its input, metadata as it came
            assert out is x and (out.shape, out.stride()) == ((4, 6), (6, 1))
            cache.store_same(key, args, out)
            other = torch.empty(4, 6)
            again = (other, *args[1:])
            assert cache.same_key(op, again, {}) == key and cache.same(key, again) is other
            # another shape or scalar is another key
            assert cache.same_key(op, (torch.empty(6, 4), *[a if not isinstance(a, torch.Tensor) else
                                                             torch.empty(6, 4) for a in args[1:]]), {}) != key
        assert cache.same_key(aten.mul_.Scalar, (x, 0.9), {}) != cache.same_key(aten.mul_.Scalar, (x, 0.8), {})
        # ops that change a tensor's sizes or storage in place, or write another argument: never answered
        for op, args, kwargs in ((aten.resize_.default, (x, [8]), {}), (aten.squeeze_.default, (x,), {}),
                                 (aten.unsqueeze_.default, (x, 0), {}), (aten.t_.default, (x,), {}),
                                 (aten.as_strided_.default, (x, [2], [1]), {}),
                                 (aten.add.out, (x, g), {"out": torch.empty(4, 6)}),
                                 (aten.add.Tensor, (x, g), {})):
            assert cache.same_key(op, args, kwargs) is None, op
        # an in-place op whose metadata came back changed is not remembered (squeeze_ is refused before; the check
        # stands for any other): the answer would be its input as it was
        y = torch.empty(1, 3)
        key = cache.same_key(aten.add_.Tensor, (y, y), {})
        cache.store_same(key, (y, y), y.squeeze(0))  # not the input itself
        assert cache.same(key, (y, y)) is None


def _kept_by_pytorch(module: torch.nn.Module, x: torch.Tensor) -> set[int]:
    """The storages of the tensors autograd packed that are still alive after a full collection (the oracle).

    The collection is a full one (every generation) of the objects made since the caller's ``gc.freeze``: the module,
    its input and everything the forward made.  Objects older than the test are set aside: a garbage cycle needs
    every one of its objects unreachable, and none made before the test can join one the forward made.  Without the
    freeze the collection would also walk the worker's whole heap and free the cyclic garbage every earlier test left
    (the suite's threshold makes full passes rare): 5.7 CPU-s late in the suite, against ~0.01 s here."""
    packed: list[weakref.ref] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        d = t.detach()
        packed.append(weakref.ref(d))
        return d

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    roots = out.grad_fn
    del out
    gc.collect()
    alive = {r().untyped_storage()._cdata for r in packed if r() is not None}
    del roots
    return alive


class _Branches(torch.nn.Module):
    """A forward that keeps ``sin``'s input and drops a branch whose graph a reference cycle holds."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * 2).sin()
        junk = [(x * 3).exp()]  # exp saves its output; the branch is dropped, but the list refers to itself
        junk.append(junk)
        return y


def test_the_forwards_cycles_are_collected_and_a_callers_freeze_stays() -> None:
    gc.freeze()  # the oracle's collection walks what this test makes, not the heap of the tests before it
    try:
        torch.manual_seed(0)
        module, x = _Branches(), torch.randn(5, 7, requires_grad=True)
        truth = len(_kept_by_pytorch(module, x))
    finally:
        gc.unfreeze()
    assert truth == 1  # sin's input x*2; exp's output went with the dropped branch's cycle (x*2 and x*3 save nothing)

    def kept() -> int:
        rec = SavedRecorder(module, params={}, inputs={x.untyped_storage()._cdata: "input:0"})
        return len(rec.run(lambda: module(x)).kept)

    assert gc.get_freeze_count() == 0
    assert kept() == truth and gc.get_freeze_count() == 0
    callers = [[]]  # one of the caller's own objects, held here so that it outlives the recording
    gc.freeze()  # a caller's own frozen objects stay frozen, and the forward's cycles are still found
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0 and kept() == truth
        # The count alone cannot say it: a frozen object that its last reference leaves during the recording (a
        # cache another test filled) is freed and leaves the count, so a run after other tests sees it drop.
        assert gc.get_freeze_count() <= frozen and not any(o is callers for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_symmem_trace_runs_no_young_collection(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from symmem.cli import main

    passes: list[int] = []
    runs: list[int] = []
    inner = SavedRecorder.run

    def counted(self: SavedRecorder, *args: object, **kwargs: object) -> object:
        runs.append(gc.isenabled())
        return inner(self, *args, **kwargs)

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "start" and not gc.isenabled():  # inside the command (parsing the arguments is outside)
            passes.append(info["generation"])

    monkeypatch.setattr(SavedRecorder, "run", counted)
    gc.callbacks.append(seen)
    try:
        code = main(["trace", "tests.trace_helpers:mlp_with_inputs", "--dims", "B"])
    finally:
        gc.callbacks.remove(seen)
    out = capsys.readouterr().out
    assert code == 0 and "peak" in out
    # every recorded forward ran without automatic passes, and the collections inside are the recorders' own (one
    # young collection after each forward)
    assert runs == [False] * len(runs) and len(runs) >= 2 and passes == [1] * len(runs)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_empty_constants_and_permuted_layouts_are_remade_as_pytorch_makes_them() -> None:
    """Two more kinds of op the cache answers (GPT-2's DynamicCache concatenates onto ``torch.tensor([])``; an
    elementwise op on a transposed input keeps its layout): a hit remakes what PyTorch's own kernel made -- the same
    sizes, strides and storage bytes to the expression, on a fresh storage."""
    from symmem.importer.fake import make_world
    from symmem.record.shape_cache import _expr

    aten = torch.ops.aten
    world = make_world({"B": 2, "S": 8})
    b, s = world.sizes["B"], world.sizes["S"]

    def meta(t: torch.Tensor) -> tuple[object, ...]:
        return (tuple(_expr(d) for d in t.shape), tuple(_expr(d) for d in t.stride()),
                _expr(t.untyped_storage().nbytes()), t.dtype)

    with world.mode:
        cache = ShapeCache()
        empty = torch.tensor([])  # a constant: its value is known (and empty)
        full = torch.tensor([1.0])
        x = torch.empty(b, 4, s, 16)
        for op, args in ((aten.cat.default, ([empty, x], -2)), (aten.mul.Scalar, (x.transpose(1, 2), 0.5))):
            made = op(*args)  # oracle: PyTorch's kernel
            key = cache.key(op, args, {})
            assert key is not None
            cache.store(op, key, args, {}, made)
            again = cache.get(key, args, {})
            assert meta(again) == meta(made) and again.untyped_storage()._cdata != made.untyped_storage()._cdata
        assert _expr(made.untyped_storage().nbytes()) == 256 * b.node.expr * s.node.expr  # empty_permuted's form
        assert cache.key(aten.cat.default, ([full, full], 0), {}) is None  # a constant with a value
        assert cache.same_key(aten.add_.Tensor, (empty, empty), {}) is None  # in place on a constant: run


def _metadata(t: object) -> object:
    """Sizes, strides and storage bytes (expressions), offset, dtype and device of a tensor; None stays None."""
    from symmem.record.shape_cache import _expr

    if t is None:
        return None
    assert isinstance(t, torch.Tensor)
    return (tuple(_expr(d) for d in t.shape), tuple(_expr(d) for d in t.stride()), _expr(t.untyped_storage().nbytes()),
            _expr(t.storage_offset()), t.dtype, t.device)


def test_fast_batch_norm_kernels_make_what_the_decompositions_make() -> None:
    """``symmem.importer.fake_kernels``: each output's metadata and the guards equal those of the op PyTorch runs on
    fake tensors with symbolic sizes (its decomposition, the oracle), and every case outside the fast one runs it."""
    from symmem.importer import fake_kernels
    from symmem.importer.fake import make_world
    from symmem.record.shape_cache import _Permuted, fresh

    aten = torch.ops.aten
    world = make_world({"B": 2, "Hi": 8})
    b, h = world.sizes["B"], world.sizes["Hi"]
    calls: list[str] = []

    def spy(op: object) -> object:
        def run(*args: object) -> object:
            calls.append(str(op))
            return op(*args)  # type: ignore[operator]
        return run

    bn = fake_kernels.batch_norm(spy(aten.native_batch_norm.default))
    bn_back = fake_kernels.batch_norm_backward(spy(aten.native_batch_norm_backward.default))
    thr = fake_kernels.threshold_backward(spy(aten.threshold_backward.default))
    with world.mode:
        for shape, dtype in (((b, 6, h, h), torch.float32), ((b, 6), torch.float32), ((b, 6, h), torch.float64),
                             ((b, 6, 1, 1), torch.float32), ((b, 4, 2, h, 3), torch.float32)):
            x, g = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            for affine, stats in ((True, True), (False, False), (True, False)):
                w = torch.empty(6 if len(shape) != 5 else 4, dtype=dtype)
                args = (x, w if affine else None, w if affine else None, w if stats else None, w if stats else None,
                        True, 0.1, 1e-5)
                before = len(world.env.guards)
                truth = aten.native_batch_norm.default(*args)
                assert len(world.env.guards) == before  # the decomposition asks no guard here: nor may the kernel
                fast = bn(*args)
                assert [_metadata(t) for t in fast] == [_metadata(t) for t in truth]
                for mask in ([True, True, True], [False, True, False]):
                    back = (g, x, args[1], args[3], args[4], truth[1], truth[2], True, 1e-5, mask)
                    assert [_metadata(t) for t in bn_back(*back)] == \
                        [_metadata(t) for t in aten.native_batch_norm_backward.default(*back)]
            assert _metadata(thr(g, x, 0.0)) == _metadata(aten.threshold_backward.default(g, x, 0.0))
        assert calls == []  # all of these were the fast case
        assert len(world.env.guards) == 0
        # not the fast case: a channels-last input, evaluation, 16-bit, a gradient of another layout
        x = torch.empty(b, 6, h, h)
        last, w = x.contiguous(memory_format=torch.channels_last), torch.empty(6)
        for args in ((last, w, w, w, w, True, 0.1, 1e-5), (x, w, w, w, w, False, 0.1, 1e-5),
                     (x.to(torch.bfloat16), w, w, w, w, True, 0.1, 1e-5)):
            assert [_metadata(t) for t in bn(*args)] == [_metadata(t) for t in aten.native_batch_norm.default(*args)]
        thr(last, x, 0.0)
        assert calls == ["aten.native_batch_norm.default"] * 3 + ["aten.threshold_backward.default"]
        # fresh() makes what torch.empty, empty_strided and empty_permuted make under the mode
        for stride in (None, (1, 6 * h * h, 6 * h, 6), _Permuted((0, 2, 3, 1))):
            made = fresh((b, 6, h, h), torch.float32, torch.device("cpu"), stride)
            truth = torch.empty(b, 6, h, h) if stride is None else torch.empty_permuted(
                (b, 6, h, h), stride) if isinstance(stride, _Permuted) else torch.empty_strided((b, 6, h, h), stride)
            assert _metadata(made) == _metadata(truth) and type(made) is type(truth) and made.fake_mode is world.mode


def test_fast_kernels_change_no_trace_and_no_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A conv, batch norm and ReLU net traced in B, Hi and Wi with its training step: everything equal with the fast
    kernels off, where PyTorch's decompositions run (whose results the importer and traced-peak tests check against
    real PyTorch)."""
    from trace_helpers import cnn

    import symmem
    from symmem.importer import fake_kernels

    def everything(fast: bool) -> tuple[object, ...]:
        monkeypatch.setattr(fake_kernels, "FAST", fast)
        torch.manual_seed(0)
        d = symmem.trace(cnn(2), (torch.randn(2, 3, 8, 8),), {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]},
                         optimizer="adamw")
        rec = d.step.record()
        return (d.expression("activations"), d.expression("total"), d.domain, d.value("peak"),
                [(s.sid, s.nbytes, s.category, s.dtype, s.op, s.where, s.module, s.phase) for s in rec.storages],
                [(o.phase, o.op, o.where, o.born, o.freed) for o in rec.ops], [g.expr for g in rec.guards],
                d.table())

    used: list[int] = []
    inner = fake_kernels.plain
    monkeypatch.setattr(fake_kernels, "plain", lambda t: used.append(1) or inner(t))
    fast = everything(True)
    assert len(used) > 3  # the fast kernels ran
    assert fast == everything(False)


def test_candidates_with_the_same_live_storages_are_given_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak from the step's distinct candidate moments equals the peak from all of them (what the peak algebra
    keeps, their names and formulas, first and steady), and about half of a step's moments repeat another's."""
    from trace_helpers import cnn

    import symmem
    from symmem.importer import traced_step

    torch.manual_seed(0)
    d = symmem.trace(cnn(2), (torch.randn(2, 3, 8, 8),), {"B": [(0, 0)], "Hi": [(0, 2)], "Wi": [(0, 3)]},
                     optimizer="adamw")
    rec = d.step.record()
    given: list[int] = []
    inner = traced_step.summarize

    def counted(groups: list[tuple[list[object], list[object]]], *args: object, **kwargs: object) -> object:
        given.extend(len(c) for c in groups[0])
        return inner(groups, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(traced_step, "summarize", counted)
    fewer = traced_step.peak_of(rec)
    monkeypatch.setattr(traced_step, "DISTINCT", False)
    every = traced_step.peak_of(rec)
    assert given[0] < given[2] and given[1] < given[3]  # steady, first: fewer moments than every candidate
    assert (fewer.expr, fewer.first) == (every.expr, every.first)
    assert [(m.phase, m.node, m.total) for m in fewer.moments] == [(m.phase, m.node, m.total) for m in every.moments]


def test_a_fake_tensors_device_is_answered_as_the_fake_mode_answers_it() -> None:
    """The recorder answers ``prim.device`` of a fake tensor itself (autograd's C++ asks it of every node's inputs and
    outputs).  Oracle: the same query dispatched to PyTorch's fake mode with no recorder -- on the CPU, on a fake CUDA
    device, inside a kernel (``meta``); a real tensor and a query with another mode below the recorder's are left to
    dispatch (None), and the answers through the recorder's mode equal PyTorch's."""
    from torch._subclasses.fake_tensor import FakeTensorMode, in_kernel_invocation_manager
    from torch.utils._python_dispatch import TorchDispatchMode

    from symmem.record.saved_tensors import _fake_device_answer

    device_of = _fake_device_answer()
    op = torch.ops.prim.device.default
    mode = FakeTensorMode()
    with mode:
        cpu, cuda = torch.empty(2, 3), torch.empty(2, 3, device="cuda")
    with mode:
        truth = [op(cpu), op(cuda)]  # PyTorch's answers
        assert [device_of((cpu,)), device_of((cuda,))] == truth == [torch.device("cpu"), torch.device("cuda", 0)]
    with in_kernel_invocation_manager(mode):
        assert device_of((cpu,)) == cpu.device == torch.device("meta")
    assert device_of((torch.empty(1),)) is None  # a real tensor dispatches on

    class Below(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    rec = SavedRecorder(torch.nn.Linear(2, 2), params={}, inputs={})
    seen: list[object] = []
    with Below(), mode:
        seen.append(device_of((cpu,)))  # a mode below would see the query: left to it
        with rec.recording():
            seen += [op(cpu), op(cuda), cpu.device, cuda.device]
    with mode, rec.recording():  # the fake mode alone below: the recorder answers
        seen += [op(cpu), op(cuda), cpu.device, cuda.device]
    assert seen == [None, *truth, *truth, *truth, *truth]
