"""The fake runs' shape cache (symmem.record.shape_cache) changes nothing a trace or a recorded step gives; nor does
PyTorch's fake-op cache in the optimizer step (symmem.importer.recording.CACHE_STEP), nor the file set that names a
guard's source location without importing torch.export (symmem.importer.torch_files: equal to torch's own).

Oracle: the same trace and step recorded with every op run through PyTorch's fake kernels (the cache off), whose
results the importer and traced-peak tests check against real PyTorch.  The cache must also be used (hits), and
remake views as views of the current input, and refuse what it cannot remake: in-place ops (the input itself), a view
in another dtype, a storage larger than its tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import trace_helpers as th  # noqa: E402

import symmem  # noqa: E402
from symmem.importer import recording, torch_files  # noqa: E402
from symmem.record import saved_tensors  # noqa: E402
from symmem.record.shape_cache import ShapeCache  # noqa: E402

SEQ = {"B": [("input_ids", 0)], "S": [("input_ids", 1)]}


def _everything(cache: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple[object, ...], object]:
    """Every value a trace and its step give (with the derivation), the shape cache and the step's fake-op cache on
    or off."""
    monkeypatch.setattr(saved_tensors, "CACHE_SHAPES", cache)
    monkeypatch.setattr(recording, "CACHE_STEP", cache)
    torch.manual_seed(0)
    module = th.gpt2("eager", 0.1)
    ids = torch.randint(0, th.VOCAB, (2, 8))
    d = symmem.trace(module, {"input_ids": ids}, SEQ)
    step = d.step
    rec = step.record(step.count)
    return (d.expression("activations"), d.expression("total"), d.domain, step.peak({step.symbol: step.count}).expr,
            [(s.sid, s.nbytes, s.category, s.dtype, s.op, s.where, s.module, s.phase) for s in rec.storages],
            [(o.phase, o.op, o.where, o.born, o.freed) for o in rec.ops], [g.expr for g in rec.guards],
            d.table(), rec.as_timeline("steady"), rec.as_timeline("first"), [g.where for g in rec.guards]), d


@pytest.fixture(scope="module")
def cached() -> tuple[tuple[object, ...], list[bool], object]:
    """GPT-2 traced with the caches on (as symmem runs): its values, whether each shape-cache lookup hit, and the
    derivation -- made once for the module (the folds test records its step's layer counts in the same world)."""
    hits: list[bool] = []
    inner = ShapeCache.get

    def counted(self: ShapeCache, key: object, *args: object) -> object:
        out = inner(self, key, *args)
        hits.append(out is not None)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ShapeCache, "get", counted)
        values, d = _everything(True, mp)
    return values, hits, d


def test_cache_changes_no_value(cached: tuple[tuple[object, ...], list[bool], object],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    with_cache, hits, _ = cached
    assert sum(hits) > 100  # the second layer and the step's layer counts reuse the first's shapes
    without, _ = _everything(False, monkeypatch)
    for a, b in zip(with_cache, without, strict=True):
        assert a == b


def test_cache_remakes_views_and_refuses_in_place_ops_and_larger_storages() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv())
    aten = torch.ops.aten
    with mode:
        x = torch.empty(4, 6)
        cache = ShapeCache()
        for op, args in ((aten.view.default, [3, 8]), (aten.transpose.int, 0), (aten.select.int, 1)):
            full = (x, args, 1) if op is not aten.view.default else (x, args)
            made = op(*full)  # oracle: PyTorch's own kernel
            key = cache.key(op, full, {})
            cache.store(op, key, full, {}, made)
            other = torch.empty(4, 6)  # another tensor of the same metadata: its own view
            again = cache.get(key, (other, *full[1:]), {})
            assert (again.shape, again.stride(), again.storage_offset(), again.dtype) == \
                (made.shape, made.stride(), made.storage_offset(), made.dtype)
            assert again.untyped_storage()._cdata == other.untyped_storage()._cdata != x.untyped_storage()._cdata
        added = aten.add_.Tensor(x, x)  # in place: the input itself, never cached
        key = cache.key(aten.add_.Tensor, (x, x), {})
        cache.store(aten.add_.Tensor, key, (x, x), {}, added)
        assert cache.get(key, (x, x), {}) is None and cache.key(aten.add_.Tensor, (x, x), {}) is None
        alias = aten.view.dtype(x, torch.int32)  # another dtype: as_strided cannot remake it
        key = cache.key(aten.view.dtype, (x, torch.int32), {})
        cache.store(aten.view.dtype, key, (x, torch.int32), {}, alias)
        assert cache.get(key, (x, torch.int32), {}) is None
        big = torch.empty(8)[:3]  # a storage of 8 elements under a tensor of 3
        key = cache.key(aten.clone.default, (x,), {})
        cache.store(aten.clone.default, key, (x,), {}, big)
        assert cache.get(key) is None
        y = aten.mul.Tensor(x, x)
        key = cache.key(aten.mul.Tensor, (x, x), {})
        cache.store(aten.mul.Tensor, key, (x, x), {}, y)
        again = cache.get(key)
        assert again.shape == y.shape and again.stride() == y.stride() and again.dtype == y.dtype
        assert again.untyped_storage()._cdata != y.untyped_storage()._cdata
        assert cache.key(aten.mul.Tensor, (x, True), {}) != cache.key(aten.mul.Tensor, (x, 1), {})


@pytest.mark.parametrize("counter", [True, False], ids=["counted", "uncounted"])
def test_remembered_size_arithmetic_remakes_what_pytorch_makes(counter: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shape cache's remakes (``fresh``: contiguous, strided, permuted; ``_view``) with PyTorch's symbolic size
    arithmetic remembered (symmem.record.sym_memo) give the tensors PyTorch's own arithmetic gives: the same size,
    stride, offset and storage-bytes expressions, the same storage (a view's is its input's), and no guard the first
    asking did not add; SymNode's methods are PyTorch's again afterwards.  Where the ShapeEnv counts no replacements
    (``uncounted``: PyTorch 2.11's, which the GPU image runs; there the table read a missing attribute and every fake
    trace failed) nothing is remembered and the same calls still give PyTorch's tensors.  Oracle: the same calls with
    no table (PyTorch's arithmetic itself), asked first."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.sym_node import SymNode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from symmem.record import shape_cache, sym_memo

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    dims = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.DYNAMIC, DimDynamic.STATIC])
    x = mode.from_tensor(torch.empty(2, 8, 64), symbolic_context=dims)
    b, s = x.shape[0], x.shape[1]
    cpu = torch.device("cpu")
    specs = [("E", (b, s, 64), None, torch.float32, cpu), ("E", (s, b, 64), (64, 64 * s, 1), torch.bfloat16, cpu),
             ("E", (b, s, 64), shape_cache._Permuted((1, 0, 2)), torch.float32, cpu),
             ("E", (b * s, 64), None, torch.int64, cpu), ("V", (s, b, 64), (64, 64 * s, 1), 0),
             ("V", (b, 4, s, 16), (64 * s, 16, 64, 1), 0), ("V", (b, s, 32), (64 * s, 64, 1), 32)]

    def made(spec: tuple[object, ...]) -> tuple[object, ...]:
        t = shape_cache._view(torch, x, spec) if spec[0] == "V" else shape_cache._make(torch, spec)
        same = t.untyped_storage()._cdata == x.untyped_storage()._cdata
        return (*shape_cache._meta(t), shape_cache._expr(t.untyped_storage().nbytes()), same, type(t).__name__)

    original = {n: SymNode.__dict__[n] for n in ("mul", "eq", "guard_bool", "wrap_int", "maybe_as_int")}
    if not counter:
        monkeypatch.setattr(sym_memo, "_COUNTER", "_a_counter_this_torch_lacks")
    memo = sym_memo.SymMemo()
    with mode:
        want = [made(spec) for spec in specs]
        guards = len(env.guards)
        for _ in range(2):  # the second time every call is answered from the table
            with memo.active(env):
                assert [made(spec) for spec in specs] == want
        assert len(env.guards) == guards and bool(memo.results) == bool(memo.answers) == counter
    assert {n: SymNode.__dict__[n] for n in original} == original
    assert [w[-2:] for w in want] == [(False, "FakeTensor")] * 4 + [(True, "FakeTensor")] * 3


def test_guard_locations_skip_the_same_torch_files_as_torch() -> None:
    """torch_files' set equals torch's own symbolic_shapes.uninteresting_files() (which imports torch.export): every
    guard's source location is the one torch would name."""
    from torch.fx.experimental import symbolic_shapes

    torch_files.install()
    current = symbolic_shapes.uninteresting_files
    theirs = getattr(current, "torch", current)()
    if torch.__version__.startswith(torch_files.VERSIONS):
        assert torch_files.uninteresting_files() == theirs and len(theirs) > 20
        assert current() == theirs
    else:  # another torch: its own function stays
        assert not getattr(current, "symmem", False)


def test_the_checks_real_forward_runs_on_one_thread_and_restores_the_count() -> None:
    """The real forward of the check runs on one CPU thread (importer.runs.real_run) and the caller's thread count
    is back afterwards, also where the forward raises.  Oracle: torch.get_num_threads() read inside the forward."""
    from symmem.importer.inputs import check_inputs
    from symmem.importer.runs import real_run

    seen: list[int] = []

    class Probe(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            if x.shape[0] == 3:
                raise ValueError("boom")
            return super().forward(x)

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        probe = Probe(4, 3)
        out = real_run(probe, check_inputs((torch.zeros(2, 4),), {"B": [(0, 0)]}))
        assert seen == [1] and torch.get_num_threads() == 2 and [k.first.label for k in out.kept] == ["input:0"]
        with pytest.raises(ValueError, match="boom"):
            real_run(probe, check_inputs((torch.zeros(3, 4),), {"B": [(0, 0)]}))
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.deep  # six step records; the shared world is in every traced peak checked against real steps
def test_the_folds_records_in_one_shared_world_equal_records_in_fresh_worlds(
        cached: tuple[tuple[object, ...], list[bool], object]) -> None:
    """The records at 4, 5 and 6 layers of the fold share one fake world and shape cache
    (importer.recording.SharedWorld); each equals the same step recorded alone in a fresh world (what the importer
    and traced-peak tests check against real PyTorch): storages, ops, what each frees, and the guards (the shared log
    holds the same ones)."""
    from symmem.importer.recording import record_step
    from symmem.importer.traced_step import COUNTS

    step = cached[2].step  # GPT-2 traced with the caches on; its peak recorded every count of the fold

    def facts(rec: recording.StepRecord) -> tuple[object, ...]:
        return ([(s.nbytes, s.category, s.dtype, s.op, s.where, s.phase) for s in rec.storages], rec.start,
                [(o.phase, o.op, o.where, o.born, o.freed, o.resized) for o in rec.ops],
                sorted({str(g.expr) for g in rec.guards}), rec.layers)

    for n in COUNTS:
        shared = step.record(n)
        alone = record_step(step.module, step.inputs, step.values, step.symbols, step.options, device=step.device,
                            replay=step.replay, layers=(step.repeat[0], step.repeat[1], n))
        assert facts(shared) == facts(alone)
    assert len(step._shared) == 1 and step._shared[()].shapes.hits > 500  # one world; later records hit its cache


class _Block(torch.nn.Module):
    """One repeated block: linear, ReLU, dropout (a ``twice`` attribute doubles its activations)."""

    def __init__(self, width: int, p: float) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.drop = torch.nn.Dropout(p)
        self.twice = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(torch.relu(self.fc(x)))
        return torch.cat([y, y], 0)[: x.shape[0]] * 2 if self.twice else y


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 3, p: float = 0.5) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width, p) for _ in range(depth))
        self.head = torch.nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _twice(m: _Stack) -> _Stack:
    m.blocks[0].twice = True
    return m


def _frozen(m: _Stack) -> _Stack:
    m.blocks[0].fc.weight.requires_grad_(False)
    return m


def _eval_dropout(m: _Stack) -> _Stack:
    m.blocks[1].drop.eval()
    return m


#: (name, module, trace keywords; the repeated run is blocks.1 and .2): each differs from the first in one thing a
#: recorded step reads -- a size, an attribute, a submodule's mode, requires_grad, the dtype, the optimizer, the
#: loss, checkpointing, micro-batches -- and the first comes three times (fresh modules: the repeats are answered
#: from the cache)
_STEPS = [
    ("plain", lambda: _Stack(), {}),
    ("plain again", lambda: _Stack(), {}),
    ("wider", lambda: _Stack(width=12), {}),
    ("attribute", lambda: _twice(_Stack()), {}),
    ("eval dropout", lambda: _eval_dropout(_Stack()), {}),
    ("no dropout", lambda: _Stack(p=0.0), {}),
    ("frozen", lambda: _frozen(_Stack()), {}),
    ("bfloat16", lambda: _Stack().to(torch.bfloat16), {}),
    ("adam", lambda: _Stack(), {"optimizer": "adam"}),
    ("cross-entropy", lambda: _Stack(), {"loss": "cross-entropy"}),
    ("checkpoint", lambda: _Stack(), {"checkpoint": "full"}),
    ("micro-batches", lambda: _Stack(), {"micro_batches": 2}),
    ("plain, third", lambda: _Stack(), {}),
]


def _step_facts(steps: list[tuple[str, Any, dict[str, Any]]], enabled: bool,
                monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """Every record of every step in _STEPS (its fold's three and one at the module's own count), and its peak, in one
    process, the step cache on or off."""
    from symmem.importer import step_cache
    from symmem.importer.traced_step import COUNTS

    monkeypatch.setattr(step_cache, "ENABLED", enabled)
    out: list[object] = []
    for name, build, kw in steps:
        torch.manual_seed(0)
        module = build()
        x = torch.randn(4, module.head.in_features, dtype=module.head.weight.dtype)
        d = symmem.trace(module, (x,), {"B": [(0, 0)]}, **kw)
        step = d.step
        peak = step.peak()
        for n in (*COUNTS, step.count):
            rec = step.record(n)
            out.append((name, n, [dataclasses.astuple(s) for s in rec.storages], rec.start, rec.freed_first,
                        [dataclasses.astuple(o) for o in rec.ops], [str(g.expr) for g in rec.guards],
                        [g.where for g in rec.guards], rec.layers, rec.count, rec.notes))
        out.append((name, peak.expr, step.peak({step.symbol: 3}).expr, d.expression("total")))
    return out


def _by_name(facts: list[object]) -> dict[str, list[object]]:
    by_name: dict[str, list[object]] = {}
    for fact in facts:
        by_name.setdefault(str(fact[0]), []).append(fact[1:])  # type: ignore[index]
    return by_name


def _same_with_and_without_the_cache(steps: list[tuple[str, Any, dict[str, Any]]],
                                     monkeypatch: pytest.MonkeyPatch, every: bool = True) -> None:
    """The records of ``steps`` with the step cache on equal those made without it: of every step (``every``), or
    of the plain stack alone, which its repeats' records (the cache's answers) must equal too."""
    from symmem.importer import step_cache

    step_cache.clear()
    before = step_cache.STATS.hits
    cached = _step_facts(steps, True, monkeypatch)
    assert step_cache.STATS.hits - before >= 4  # "plain again"'s four records (later repeats may find them dropped)
    by_name = _by_name(cached)
    plain = by_name.pop("plain")
    assert all(by_name.pop(n) == plain for n in list(by_name) if n.startswith("plain"))  # the repeats
    assert all(facts != plain for facts in by_name.values())  # each change shows: a key without it would be caught
    step_cache.clear()
    if every:
        assert _step_facts(steps, False, monkeypatch) == cached
    else:  # the cache's answers (the repeats) and its misses, which record as the cache off does (step_cache.recorded)
        assert _by_name(_step_facts(steps[:1], False, monkeypatch)) == {"plain": plain}


def test_the_step_cache_changes_no_record(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-process cache of recorded steps (symmem.importer.step_cache) gives every record byte-identical to one
    made without it -- storages, ops, guards, notes -- over 4 traced steps of 4 records each (their folds at 4, 5 and
    6 layers and their own 2) made one after the other in one process: the plain stack twice (the repeat answered
    from the cache), an attribute its forward reads, Adam.  Oracle: the plain stack recorded with the cache off (the
    records the traced-peak tests check against real PyTorch), which the plain stack's records and its repeat's (the
    cache's answers) equal; the attribute's and Adam's are cache misses, each differing from the plain one's (a key
    without the change would answer the plain records), made by the same call as with the cache off
    (``step_cache.recorded``).  All 13 steps of _STEPS, each against its own records with the cache off: the deep
    test below."""
    _same_with_and_without_the_cache([s for s in _STEPS if s[0] in ("plain", "plain again", "attribute", "adam")],
                                     monkeypatch, every=False)


@pytest.mark.deep  # 26 traces, ~23 CPU-s; the default test above keeps the same check on 4 of the 13 steps
def test_the_step_cache_changes_no_record_over_every_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """As above over all 13 steps of _STEPS (52 records): each differs from the first in one thing a step reads."""
    _same_with_and_without_the_cache(_STEPS, monkeypatch)
