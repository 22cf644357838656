"""The pipeline replays' shortcuts (issue 19 item 5) give what the long way gives.

The values themselves are the engine's, checked against real ``torch.distributed.pipelining`` gloo runs elsewhere
(``tests/test_model_parallel.py``, ``test_ddp_pipeline.py``, ``test_fsdp_pipeline.py``, ``test_tensor_pipeline.py``);
here each shortcut is held against the work it skips: a stage's segment moved from its first walk against every
segment walked op by op, the 1F1B micro-batches in flight against sympy's own ``Min``, a tensor-parallel rank's
storage sizes shared by alike storages against each storage's own, ZeRO-1's whole parameters shared by the batches
against each batch's own.
"""

from __future__ import annotations

import pytest
import sympy

#: small Llama sizes at 8 layers: the step is written out from the 5-layer one (passes/stretch.py)
SMALL = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 8, "V": 64, "F": 64}


def test_micro_batches_in_flight_as_sympy_makes_them() -> None:
    from symmem.passes.model_parallel import in_flight
    from symmem.symbols import p

    for index in (0, 1):
        for m in (1, 2, 3, 4, 7, 8, 64):
            assert sympy.srepr(in_flight(index, m)) == sympy.srepr(sympy.Min(p - index, m))


def _uppers(step, named) -> list:
    """Every stage's lines that no other bounds (steady and first step) read from the packed replay at ``named``
    (whose moments are those that may bound a line: ``model_parallel.bounding``)."""
    b = named["B"]
    return [step._stage_uppers(s, rows, parts, b) for s, (rows, parts) in enumerate(step._batch_moments(named, b))]


#: (model, schedule, derive keywords) of the plain stages' segments moved; the default suite's are
#: :data:`SEGMENTS_KEPT`, the rest under ``-m deep`` (stop 42): Llama under 1F1B runs no line of symmem/ or tests/
#: that Llama under GPipe and GPT-2 under 1F1B do not (line coverage, each row's caches cleared)
SEGMENTS = [("llama", "1f1b", {}), ("llama", "gpipe", {}), ("gpt2", "1f1b", {"dropout": 0.1})]
SEGMENTS_KEPT = (1, 2)


@pytest.mark.parametrize("cases", [
    pytest.param(SEGMENTS_KEPT, id="kept"),
    pytest.param(tuple(k for k in range(len(SEGMENTS)) if k not in SEGMENTS_KEPT), id="more", marks=pytest.mark.deep)])
def test_a_segment_moved_is_the_segment_walked(monkeypatch, cases) -> None:
    """Every stage's moments, in order, and its peak: the replays at numbers (each moment kept); and the lines read
    from the packed one, 1F1B and GPipe, llama and gpt2 with dropout (pass 0 and later passes)."""
    import symmem.passes.model_parallel as mp
    from symmem import derive

    found: dict[str, list] = {}
    walks = []
    walked = mp._Replay._walked
    for label in ("moved", "walked"):
        with monkeypatch.context() as patch:
            if label == "walked":  # every segment walked op by op
                patch.setattr(mp._Replay, "_repeated", lambda self, kind, mb, walk, state: walk(kind, mb))
            else:
                patch.setattr(mp._Replay, "_walked", lambda self, kind, mb: walks.append(1) or walked(self, kind, mb))
            for model, schedule, more in (SEGMENTS[k] for k in cases):
                values = {**SMALL, "L": 4, "p": 2}
                if model == "gpt2":
                    del values["G"]
                d = derive(model, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=4, device="cpu",
                           values=values, **more)
                step = d.step
                named = step._named(None)
                found.setdefault(label, []).append(([(r.moments, r.peak) for r in step._replays(named)],
                                                    _uppers(step, named)))
    assert found["moved"] == found["walked"]
    # each case x 2 (the replays, the packed one) x 2 stages x 8 segments; each stage walks 4 (2 passes x F, B)
    assert len(walks) == len(cases) * 2 * 2 * 4


def test_a_tensor_parallel_size_shared_is_the_storage_own() -> None:
    """TP x pipeline at 8 layers: every storage's size on a rank, found among the storages alike (same size object,
    category, names but for the layer, first layer or not), is the one worked out for the storage itself."""
    from symmem import derive

    d = derive("llama", tensor_parallel=True, pipeline_parallel=True, micro_batches=2, device="cpu",
               values={**SMALL, "t": 2, "p": 2})
    cut = d.step._cut(d.step._named(None))
    sizes = cut.sizes
    shared = [sizes.local(i) for i in range(len(cut.tl.storages))]
    assert len(sizes._alike) < len(shared) / 2  # the layers' copies found among the alike
    assert shared == [sizes._local(i) for i in range(len(cut.tl.storages))]


def test_a_tensor_parallel_size_listed_is_the_storage_own() -> None:
    """TP and SP x pipeline at 8 layers (the step written from its 5-layer template): each storage's size on a rank
    read from the list by index (one per template storage, ``_Sizes.every``) is the storage's own, and the step is
    one that list is made for."""
    from symmem import derive

    for sequence in (False, True):
        d = derive("llama", tensor_parallel=True, sequence_parallel=sequence, pipeline_parallel=True,
                   micro_batches=2, device="cpu", values={**SMALL, "t": 2, "p": 2})
        sizes = d.step._cut(d.step._named(None)).sizes
        listed = sizes.every()
        assert listed is not None and len(listed) == len(sizes.tl.storages)
        assert listed == [sizes._local(i) for i in range(len(sizes.tl.storages))]


@pytest.mark.parametrize("attention, batch, heads", [("sdpa", 2, 2), ("naive", 1, 4)])
def test_sequence_parallel_keepers_of_the_linears_alone(attention, batch, heads) -> None:
    """SP x pipeline: who keeps each saved storage, found from the column-parallel linears alone, is the keepers
    of every op's storages (the long way) less those not column-parallel -- all the gathered copies read."""
    from symmem import derive
    from symmem.passes.saved import kept

    d = derive("llama", tensor_parallel=True, sequence_parallel=True, pipeline_parallel=True, micro_batches=2,
               attention=attention, device="cpu", values={**SMALL, "B": batch, "G": heads, "t": 2, "p": 2})
    step = d.step
    cut = step._cut(step._named(None))
    sizes = cut.sizes
    g = cut.g
    whole = {s.name: tuple(n for n in s.keepers if n in sizes.column)
             for s in kept(g, step.conv, step.options, "float32", list(g.program_order()), False, cut.branch)}
    assert {k: v for k, v in whole.items() if v} == sizes.keepers
    assert any(len(v) > 1 for v in sizes.keepers.values())  # the attention's three projections keep one copy


@pytest.mark.parametrize("attention, batch, mesh, layers, p", [
    ("sdpa", 2, {}, 12, 2), ("naive", 1, {}, 16, 4), ("sdpa", 1, {"data_parallel": "fsdp"}, 12, 4),
    ("naive", 2, {"data_parallel": "fsdp"}, 14, 2)])
def test_sequence_parallel_middle_layers_collectives_repeat(attention, batch, mesh, layers, p) -> None:
    """SP x pipeline (alone and on the 3-D mesh): the collectives at each op of the middle layers 5 to L - 4, taken
    from the first of them in their sweep (``_SequenceSizes._repeats``), are the walk's at every op of the step."""
    from symmem import derive

    # (eager attention at B = 1 with one key/value head a rank is refused: four heads)
    values = {**SMALL, "B": batch, "G": 4, "L": layers, "t": 2, "p": p, **({"N": 2} if mesh else {})}
    d = derive("llama", tensor_parallel=True, sequence_parallel=True, pipeline_parallel=True, micro_batches=p,
               attention=attention, device="cpu", values=values, **mesh)
    step = d.step
    cut = (step._checked_cut(step._named(None))[1] if mesh else step._cut(step._named(None)))
    sizes = cut.sizes
    ops = [k for found in cut.passes for kind in ("F", "B") for k, _ in found[kind]]
    repeats = sizes._repeats()
    assert repeats and {k for a, (b, _) in repeats.items() for k in range(a, b)} <= set(ops)
    shortcut = sizes.extras(ops)
    sizes._repeats = dict  # every op walked
    walked = sizes.extras(ops)
    assert shortcut == walked and len(walked) == len(ops)


def test_zero_1_whole_parameters_shared_by_the_batches() -> None:
    """ZeRO-1 x pipeline: a stage's whole parameters at B + 1 (shared with B: no shape is in B) are those worked out
    at B + 1."""
    from symmem import derive
    from symmem.passes.ddp_pipeline import _whole
    from symmem.passes.model_parallel import _Cut

    d = derive("llama", data_parallel="zero-redundancy", pipeline_parallel=True, micro_batches=2, device="cpu",
               values={**SMALL, "N": 2, "p": 2})
    step = d.step
    named = step._named(None)
    step._cut(named)
    later = {**named, "B": named["B"] + 1}
    cut, whole = step._cut(later)
    fresh = _Cut(step.graph, step.conv, step.options, step.regime, later, {})
    assert whole is step._cut(named)[1]
    assert whole == [_whole(fresh, s) for s in range(cut.p)]


def test_a_watched_replay_walks_every_segment() -> None:
    """A replay whose moments list is watched (a list subclass whose ``append`` reads what is alive at each moment,
    as the peak's formulas do) walks every segment op by op: each moment appended on its own, with the storages
    alive then, the same moments as the replay with its records."""
    import symmem.passes.model_parallel as mp
    from symmem import derive

    class Watch(list):
        def __init__(self, replay) -> None:
            super().__init__()
            self.replay, self.alive = replay, []

        def append(self, item) -> None:
            super().append(item)
            self.alive.append(len(self.replay.alive))

    d = derive("llama", pipeline_parallel=True, micro_batches=5, device="cpu", values={**SMALL, "p": 4})
    step = d.step
    numbers = step._named(None)
    plain = step._replays(numbers)
    watched = step._make_replays(numbers)
    for r in watched:
        r.moments = Watch(r)
        r.run()
    assert [list(r.moments) for r in watched] == [r.moments for r in plain]
    assert all(len(r.moments.alive) == len(r.moments) for r in watched)
    assert not any(isinstance(r, mp._Replay) and r._records for r in watched)


#: the engines around the stages whose hooks carry state from one segment to the next, and ZeRO-1's ranks: small
#: Llama sizes, 1F1B and GPipe, FSDP's units resharded after forward or not
ENGINES = [
    ("1f1b", 4, {"data_parallel": "fsdp"}, {"N": 2}),
    ("gpipe", 3, {"data_parallel": "fsdp-no-reshard"}, {"N": 3, "V": 63}),
    ("1f1b", 4, {"tensor_parallel": True}, {"t": 2}),
    ("gpipe", 3, {"data_parallel": "fsdp", "tensor_parallel": True}, {"N": 2, "t": 2}),
    ("1f1b", 4, {"data_parallel": "zero-redundancy"}, {"N": 3}),
]
#: the default suite's :data:`ENGINES`, the rest under ``-m deep`` (stop 42): FSDP2 without resharding under GPipe
#: (V = 63) runs no line of symmem/ or tests/ the four kept do not (line coverage, each row's caches cleared)
ENGINES_KEPT = (0, 2, 3, 4)


def _everything(d) -> tuple:
    """A pipeline derivation's peaks and where, the lines read from the packed replay, and each stage's replay at
    the derivation's numbers, moment by moment."""
    step = d.step
    named = step._named(None)
    replays = [(r.moments, r.peak) for r in step._replays(named)]
    packed = _uppers(step, named)
    return (d.value("peak"), d.value("peak_first_step"), d.peak_at().where(), d.peak_at("first").where(), packed,
            replays)


@pytest.mark.parametrize("cases", [
    pytest.param(ENGINES_KEPT, id="kept"),
    pytest.param(tuple(k for k in range(len(ENGINES)) if k not in ENGINES_KEPT), id="more", marks=pytest.mark.deep)])
def test_an_engine_segment_moved_is_the_segment_walked(monkeypatch, cases) -> None:
    """FSDP2's units (resharded after forward or not), DTensor's collectives, both on the 3-D mesh: a stage's
    segment whose hooks begin alike (FSDP's storages held, the units its pre-backwards prefetch) is its first
    walk's record moved, the hooks' state moved with it -- the same moments, peaks and lines as every segment
    walked op by op; and ZeRO-1's ranks' lines moved from the replayed rank's are those read from each rank's
    moments one by one."""
    import symmem.passes.model_parallel as mp
    from symmem import derive
    from symmem.passes.ddp_pipeline import DdpPipelineStep, _Moved
    from symmem.passes.pipeline_step import PipelineStep

    found: dict[str, list] = {}
    walks: list[str] = []
    segments: list[str] = []
    hooked, segment = mp._Replay._hooked, mp._Replay.segment
    for label in ("moved", "walked"):
        with monkeypatch.context() as patch:
            if label == "walked":  # every segment walked op by op, every ZeRO-1 rank's moments read one by one
                patch.setattr(mp._Replay, "_repeated", lambda self, kind, mb, walk, state: walk(kind, mb))
                patch.setattr(DdpPipelineStep, "_stage_uppers", lambda self, s, rows, parts, b: PipelineStep.
                              _stage_uppers(self, s, rows.rows() if isinstance(rows, _Moved) else rows, parts, b))
            else:
                patch.setattr(mp._Replay, "_hooked", lambda self, kind, mb: walks.append(type(self).__name__)
                              or hooked(self, kind, mb))
                patch.setattr(mp._Replay, "segment", lambda self, kind, mb: segments.append(type(self).__name__)
                              or segment(self, kind, mb))
            for schedule, m, engine, more in (ENGINES[k] for k in cases):
                values = {**SMALL, "L": 4, "p": 2, **more}
                d = derive("llama", pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, device="cpu",
                           loss="cross-entropy", values=values, **engine)
                found.setdefault(label, []).append(_everything(d))
    assert found["moved"] == found["walked"]
    # each replay of the cases' engines (FSDP2's, DTensor's, both on the mesh; ZeRO-1's is the plain one) walks each
    # way a segment begins once: not every segment
    replays = {(True, False): "_FsdpReplay", (False, True): "_TensorReplay", (True, True): "_MeshReplay"}
    kinds = {replays.get((e.get("data_parallel", "").startswith("fsdp"), "tensor_parallel" in e))
             for _, _, e, _ in (ENGINES[k] for k in cases)} - {None}
    assert kinds
    for kind in kinds:
        assert 0 < walks.count(kind) < segments.count(kind)


#: the engines whose hooks act at some ops only (FSDP2's units, DTensor's collectives, sequence parallelism's, and
#: the 3-D meshes): small Llama sizes, 1F1B and GPipe
ACTING = [
    ("1f1b", 4, {"data_parallel": "fsdp"}, {"N": 2}),
    ("1f1b", 4, {"tensor_parallel": True}, {"t": 2}),
    ("gpipe", 3, {"tensor_parallel": True, "sequence_parallel": True}, {"t": 2}),
    ("gpipe", 3, {"data_parallel": "fsdp", "tensor_parallel": True}, {"N": 2, "t": 2}),
    ("1f1b", 2, {"data_parallel": "fsdp", "tensor_parallel": True, "sequence_parallel": True}, {"N": 2, "t": 2}),
]


def test_hooks_only_where_they_act_are_hooks_around_every_op(monkeypatch) -> None:
    """A stage's ops where an engine's hooks do nothing (``_Replay._acting``: not a unit's first or last op in
    FSDP2's forward, not a unit's first in its backward, no collective, not the head's backward) walked without
    them give the same moments, peaks and lines as the hooks called around every op; and the hooks are skipped at
    most ops of every engine's plans."""
    from symmem import derive
    from symmem.passes.fsdp_pipeline import _FsdpReplay
    from symmem.passes.fsdp_tensor_pipeline import _MeshReplay
    from symmem.passes.sequence_pipeline import _MeshSequenceReplay, _SequenceReplay
    from symmem.passes.tensor_pipeline import _TensorReplay

    classes = (_FsdpReplay, _TensorReplay, _SequenceReplay, _MeshReplay, _MeshSequenceReplay)
    found: dict[str, list] = {}
    acting: dict[str, list[tuple[int, int]]] = {}  # a class's acting ops and its plan's ops, at each plan
    for label in ("acting", "every op"):
        with monkeypatch.context() as patch:
            for cls in classes:
                if label == "every op":
                    patch.setattr(cls, "_acting", lambda self, pass_, kind: None)
                else:
                    def noted(self, pass_, kind, _own=cls.__dict__["_acting"]):
                        out = _own(self, pass_, kind)
                        acting.setdefault(type(self).__name__, []).append(
                            (len(out), len(self._plan(pass_, kind))))
                        return out

                    patch.setattr(cls, "_acting", noted)
            for schedule, m, engine, more in ACTING:
                values = {**SMALL, "L": 4, "p": 2, **more}
                d = derive("llama", pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, device="cpu",
                           loss="cross-entropy", values=values, **engine)
                found.setdefault(label, []).append(_everything(d))
    assert found["acting"] == found["every op"]
    assert set(acting) == {cls.__name__ for cls in classes}
    for name, sizes in acting.items():
        assert all(0 < n < ops for n, ops in sizes), name
        assert sum(n for n, _ in sizes) < sum(ops for _, ops in sizes) / 2, name


def test_zero_1_ranks_read_from_one_replay() -> None:
    """ZeRO-1 x pipeline at N = 3: the ranks differ (each owns other whole parameters), and every rank's stage
    lines are the replayed rank's moved: one set of lines worked out a stage, not one a rank."""
    from symmem import derive
    from symmem.passes.ddp_pipeline import _Moved

    d = derive("llama", data_parallel="zero-redundancy", pipeline_parallel=True, micro_batches=4, device="cpu",
               loss="cross-entropy", values={**SMALL, "L": 4, "p": 2, "N": 3})
    d.value("peak")
    step = d.step
    named = step._named(None)
    groups = step._alike(named)
    assert len(groups) > 1
    for group in groups:
        rows = step.at_rank(group[0])._batch_moments(named, named["B"])
        assert all(isinstance(moved, _Moved) for moved, _ in rows)
    read = [v for k, v in step._memo().items() if isinstance(k, tuple) and k[0] == "zero-1 lines"]
    assert len(read) == 2 and all(v is not None for v in read)  # one a stage, for every rank


#: sequence parallelism on stages at B = 1 (SDPA, eager), alone and on the 3-D mesh, 1F1B and GPipe
SEQUENCE_AT_ONE = [
    ("1f1b", 2, "sdpa", {}, {}),
    ("gpipe", 3, "naive", {}, {"G": 4}),
    ("1f1b", 2, "sdpa", {"data_parallel": "fsdp"}, {"N": 2}),
    ("gpipe", 2, "naive", {"data_parallel": "fsdp"}, {"N": 2, "G": 4, "L": 8}),
]
#: the default suite's :data:`SEQUENCE_AT_ONE`, the rest under ``-m deep`` (stop 42): SDPA alone under 1F1B runs no
#: line of symmem/ or tests/ the three kept do not (line coverage, each row's caches cleared; its configuration's
#: moments are checked in the default suite by ``BOUNDED``'s SP at B = 1 under 1F1B)
SEQUENCE_KEPT = (1, 2, 3)


@pytest.mark.parametrize("cases", [
    pytest.param(SEQUENCE_KEPT, id="kept"),
    pytest.param(tuple(k for k in range(len(SEQUENCE_AT_ONE)) if k not in SEQUENCE_KEPT), id="more",
                 marks=pytest.mark.deep)])
def test_sequence_parallel_at_one_read_alone_at_once(monkeypatch, cases) -> None:
    """Sequence parallelism on stages at B = 1: B = 1 read alone at once, and on the p x t and p x N x t meshes B = 1
    and the lines from B = 2 read from one replay packed at B = 1, 2, 3, 4, give what the long way gives (the lines
    from B = 1 tried first, refused, then B = 1 alone, then the lines from B = 2, each replayed on its own) --
    the peaks, where, every moment with its formula and what it holds at, the domain -- and the long way's lines
    from B = 1 are refused every time (the shortcut's premise)."""
    import symmem.passes.model_parallel as mp
    import symmem.passes.pipeline_step as ps
    from symmem import derive
    from symmem.passes.fsdp_tensor_pipeline import FsdpTensorPipelineStep
    from symmem.passes.sequence_pipeline import FsdpSequencePipelineStep, SequencePipelineStep, with_batch_of_one
    from symmem.passes.tensor_pipeline import TensorPipelineStep

    def everything(d) -> tuple:
        peak = d.step.peak()
        return (d.value("peak"), d.value("peak_first_step"), d.peak_at().where(), d.peak_at("first").where(),
                d.step.rank_peaks(d), [str(c) for c in peak.domain],
                [(m.where(), m.value(d.numbers), str(m.total), m.pinned()) for m in peak.moments])

    found: dict[str, list] = {}
    refused: list[bool] = []
    lines = ps.PipelineStep._lines

    def watched(self, named, b, line, given=None):
        try:
            return lines(self, named, b, line, given)
        except ps._NotALine:
            refused.append(b == 1 and line == 1)
            raise

    four: list[int] = []
    each = mp._unpacked_each
    for label in ("at once", "long way"):
        with monkeypatch.context() as patch:
            if label == "at once":
                patch.setattr(mp, "_unpacked_each", lambda moments, count: four.append(count) or each(moments, count))
            else:
                for step in (FsdpSequencePipelineStep, SequencePipelineStep):
                    patch.setattr(step, "_no_line_from_one", lambda self, named: False)
                patch.setattr(SequencePipelineStep, "_peak", lambda self, named: with_batch_of_one(
                    lambda n: TensorPipelineStep._peak(self, n), named))
                patch.setattr(FsdpSequencePipelineStep, "_peak", lambda self, named: with_batch_of_one(
                    lambda n: FsdpTensorPipelineStep._peak(self, n), named))
                patch.setattr(ps.PipelineStep, "_lines", watched)
            for schedule, m, attention, engine, more in (SEQUENCE_AT_ONE[k] for k in cases):
                d = derive("llama", tensor_parallel=True, sequence_parallel=True, pipeline_parallel=True,
                           pipeline_schedule=schedule, micro_batches=m, attention=attention, device="cpu",
                           values={**SMALL, "B": 1, "L": 4, "p": 2, "t": 2, **more}, **engine)
                found.setdefault(label, []).append(everything(d))
    assert found["at once"] == found["long way"]
    assert refused == [True] * len(cases)
    # every case (the p x t mesh's and the 3-D mesh's, stop 44), two stages each, from one replay at four batches
    assert four == [4] * 2 * len(cases)


#: (model, schedule, M, derive keywords, sizes) for the moments left out of the packed replay: the stage alone and
#: every engine around it, at 2 to 4 stages of 2 to 4 layers (no middle layer, one and several alike).  The default
#: suite checks :data:`BOUNDED_KEPT`, the rest under ``-m deep``: each kept case runs lines of the replays (passes/
#: model_parallel.py, pipeline_step.py and the engines' fsdp_, tensor_, fsdp_tensor_, ddp_ and sequence_pipeline.py)
#: that no other kept case runs; each one moved runs none that the kept ones do not (line coverage of every case,
#: stop 39, docs/testing.md)
BOUNDED = [
    ("llama", "1f1b", 4, {}, {"L": 8, "p": 4}),
    ("llama", "gpipe", 3, {}, {"L": 8, "p": 2}),
    ("llama", "1f1b", 8, {}, {"L": 12, "p": 3}),
    ("llama", "1f1b", 4, {"checkpoint": "full"}, {"L": 8, "p": 2}),
    ("llama", "gpipe", 4, {"checkpoint": "every-2"}, {"L": 8, "p": 2}),
    ("gpt2", "1f1b", 2, {"dropout": 0.1}, {"L": 4, "p": 2}),
    ("gpt2", "gpipe", 4, {"loss": "cross-entropy"}, {"L": 6, "p": 3}),
    ("llama", "1f1b", 4, {"data_parallel": "ddp"}, {"N": 2, "L": 8, "p": 2}),
    ("llama", "gpipe", 3, {"data_parallel": "ddp-bucket-view"}, {"N": 2, "L": 4, "p": 2}),
    ("llama", "1f1b", 4, {"data_parallel": "zero-redundancy"}, {"N": 3, "L": 8, "p": 2}),
    ("llama", "1f1b", 4, {"data_parallel": "fsdp"}, {"N": 2, "L": 8, "p": 2}),
    ("llama", "gpipe", 3, {"data_parallel": "fsdp-no-reshard"}, {"N": 3, "V": 63, "L": 4, "p": 2}),
    ("llama", "1f1b", 4, {"tensor_parallel": True}, {"t": 2, "L": 8, "p": 2}),
    ("llama", "1f1b", 4, {"tensor_parallel": True, "sequence_parallel": True}, {"t": 2, "L": 8, "p": 2}),
    ("llama", "gpipe", 3, {"data_parallel": "fsdp", "tensor_parallel": True}, {"N": 2, "t": 2, "L": 4, "p": 2}),
    # sequence parallelism at B = 1: B = 1 read alone and the lines from B = 2, from one replay at four batches
    ("llama", "1f1b", 2, {"tensor_parallel": True, "sequence_parallel": True, "attention": "sdpa"},
     {"t": 2, "B": 1, "L": 4, "p": 2}),
    ("llama", "gpipe", 3, {"tensor_parallel": True, "sequence_parallel": True, "attention": "naive"},
     {"t": 2, "B": 1, "G": 4, "L": 8, "p": 2}),
]
#: GPipe with every-2 checkpointing (a stage's recomputation every other layer), GPT-2 with dropout (its masks) and
#: under GPipe on three stages (a middle stage, GPT-2's loss), DDP, its bucket view, ZeRO-1 (the moved ranks'
#: lines), FSDP2 resharding, TP, TP + SP, FSDP2 x TP on the 3-D mesh, SP at B = 1 under 1F1B (B = 1 read alone and
#: the lines from B = 2: ``bounding``'s count 4); moved to ``deep``: the stage alone at 4 and 3 stages and under
#: GPipe, full checkpointing, FSDP2 without resharding, SP at B = 1 under GPipe
BOUNDED_KEPT = (4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15)


@pytest.mark.parametrize("cases", [
    pytest.param(BOUNDED_KEPT, id="kept"),
    pytest.param(tuple(k for k in range(len(BOUNDED)) if k not in BOUNDED_KEPT), id="more", marks=pytest.mark.deep)])
def test_moments_bounding_no_line_left_out(monkeypatch, cases) -> None:
    """The packed replay keeps of each segment the moments that may bound a line (``model_parallel.bounding``): the
    peaks, where, every stage's peak, every moment of the peak (where, bytes) and each stage's largest, steady and
    first step, with its formula and what it holds at, are those read with every moment kept, for the stage alone
    and every engine around it (``BOUNDED``, those of ``cases``); and moments are left out."""
    import symmem.passes.model_parallel as mp
    from symmem import derive

    found: dict[str, list] = {}
    left: list[int] = []
    bounding = mp.bounding

    def counted(deltas, b, count=3):
        kept = bounding(deltas, b, count)
        left.append(len(deltas) - (len(deltas) if kept is None else len(kept)))
        return kept

    for label in ("bounded", "every moment"):
        with monkeypatch.context() as patch:
            patch.setattr(mp, "bounding", counted if label == "bounded" else lambda deltas, b, count=3: None)
            for model, schedule, m, engine, more in (BOUNDED[k] for k in cases):
                values = {**SMALL, **more}
                if model == "gpt2":
                    del values["G"]
                d = derive(model, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=m, device="cpu",
                           values=values, **engine)
                step = d.step
                found.setdefault(label, []).append((
                    d.value("peak"), d.value("peak_first_step"), d.peak_at().where(), d.peak_at("first").where(),
                    step.per_stage(d.numbers), [(m.where(), m.value(d.numbers)) for m in step.peak().moments],
                    [(m.where(), str(m.total), m.pinned()) for which in ("steady", "first")
                     for m in step.stage_moments(d.numbers, which)]))
    assert found["bounded"] == found["every moment"]
    assert sum(left) > 0


#: (model, derive keywords, sizes) whose steps repeat moments (later micro-batches, checkpointed recomputation)
REPEATS = [
    ("llama", {"data_parallel": "fsdp", "param_dtype": "bfloat16", "checkpoint": "full", "micro_batches": 4},
     {"N": 2}),
    ("llama", {"data_parallel": "fsdp", "micro_batches": 3}, {"N": 2}),
    ("llama", {"data_parallel": "fsdp1", "checkpoint": "full"}, {"N": 2}),
    ("llama", {"data_parallel": "ddp", "micro_batches": 2}, {"N": 2}),
    ("llama", {"checkpoint": "every-2", "micro_batches": 3}, {}),
    ("gpt2", {"micro_batches": 4, "dropout": 0.1}, {}),
    ("gpt2", {"zero": 3}, {"N": 4}),
    # rows 0 and 4 at two micro-batches (stop 42): each runs every line of symmem/ and tests/ its four- or
    # three-micro-batch row runs, no other (line coverage, caches cleared), at about two thirds of its CPU
    ("llama", {"data_parallel": "fsdp", "param_dtype": "bfloat16", "checkpoint": "full", "micro_batches": 2},
     {"N": 2}),
    ("llama", {"checkpoint": "every-2", "micro_batches": 2}, {}),
]
#: the default suite's :data:`REPEATS`, the rest under ``-m deep``: FSDP2 with bf16 parameters, full checkpointing
#: and micro-batches (both kinds of repeats; every line of peak.py's pruning the others run but two), FSDP1's
#: flat parameters with full checkpointing, every-2 checkpointing (peak.py's constant parts), GPT-2 with dropout
#: (peak.py's branches of one group); moved: FSDP2 over three micro-batches (later micro-batches' repeats, as the
#: first's), DDP (its buckets, made at the start, repeat nothing), ZeRO-3 (no line of its own); since stop 42 the
#: first and the every-2 rows at two micro-batches (7, 8), their four and three (0, 4) moved
REPEATS_KEPT = (7, 2, 8, 5)


@pytest.mark.parametrize("cases", [
    pytest.param(REPEATS_KEPT, id="kept"),
    pytest.param(tuple(k for k in range(len(REPEATS)) if k not in REPEATS_KEPT), id="more", marks=pytest.mark.deep)])
def test_repeated_moments_left_out_before_pruning(monkeypatch, cases) -> None:
    """``peak.first_of_each``: the candidates that repeat an earlier one's storages are left out before the
    comparisons, and the peak -- its bytes, where and formula, steady and first step, every moment kept with its
    bytes -- is the one that compares every candidate (``REPEATS``, those of ``cases``), and repeats were left
    out."""
    import symmem.peak as pk
    from symmem import derive

    found: dict[str, list] = {}
    left: list[int] = []
    first_of_each = pk.first_of_each
    for label in ("repeats left out", "every candidate"):
        with monkeypatch.context() as patch:
            patch.setattr(pk, "first_of_each", (lambda c, t: left.append(len(c) - len(first_of_each(c, t)))
                                                or first_of_each(c, t)) if label == "repeats left out"
                          else lambda cands, totals: cands)
            for model, keywords, more in (REPEATS[k] for k in cases):
                values = {**SMALL, **more}
                if model == "gpt2":
                    del values["G"]
                d = derive(model, device="cpu", values=values, **keywords)
                found.setdefault(label, []).append((
                    d.value("peak"), d.value("peak_first_step"), d.peak_at().where(), d.peak_at("first").where(),
                    str(d.peak_at().total), str(d.peak_at("first").total),
                    [(m.where(), m.value(d.numbers)) for m in d.step.peak().moments]))
    assert found["repeats left out"] == found["every candidate"]
    assert sum(left) > 0


#: (derive keywords, sizes) whose storage sizes and stage parts hold ceilings, fractions of N, t and p, a Max of the
#: optimizer step's temporaries and a Piecewise at L >= 2 (Llama at small sizes)
EXACT = [
    ({"data_parallel": "fsdp"}, {"N": 3, "V": 63, "L": 8, "p": 4}),
    ({"tensor_parallel": True, "sequence_parallel": True}, {"t": 2, "B": 1, "L": 4, "p": 2}),
]


def test_exact_values_are_sympy_substitution() -> None:
    """A stage's parts and a storage's bytes at numbers are read by one walk over the formula
    (``model_parallel._exact``): every storage size of the cut at three batches, every part of the three stages at
    three batches and at each alone (``at_each``, ``at``) are sympy's substitution rounded up (the long way,
    ``_at_each``); where the walk gives no value (a float, a symbol without a number) sympy decides, refusal
    included."""
    import pytest

    import symmem.passes.model_parallel as mp
    from symmem import derive
    from symmem.errors import SymmemError
    from symmem.symbols import B, S

    names = [*(f.name for f in mp.fields(mp.StageMemory) if f.name not in ("name", "module_buffers")), "at_rest",
             "step_peak", "held"]
    sizes = 0
    for engine, more in EXACT:
        step = derive("llama", pipeline_parallel=True, micro_batches=4, device="cpu", values={**SMALL, **more},
                      **engine).step
        named = step._named(None)
        batches = [{**named, "B": named["B"] + k} for k in range(3)]
        for stage in step._stages():
            assert stage.at_each(batches, names) == stage._at_each(batches, names)
            assert [stage.at(n) for n in batches] == stage._at_each(batches, names)
        memo: dict = {}
        for n in batches:
            cut = mp._Cut(step.graph, step.conv, step.options, step.regime, n, memo)
            # each size once (the layers written out share their template's size objects)
            for e, name in {id(st.nbytes): (sympy.sympify(st.nbytes), st.name) for st in cut.tl.storages}.values():
                assert mp._integer(e, cut.subs, name) == mp._rounded(e.xreplace(cut.subs), name)
                sizes += 1
    assert sizes > 100
    subs = {B: sympy.Integer(3)}
    assert mp._integer(B * sympy.Rational(7, 2), subs, "x") == 11  # a fraction of a byte is a byte
    assert mp._exact(B * sympy.Float(1.5), {B: 3}) is None  # a float: sympy's substitution decides
    assert mp._integer(B * sympy.Float(1.5), subs, "x") == 5
    with pytest.raises(SymmemError, match="the stage's x needs values for S"):
        mp._integer(B * S, subs, "x")
