"""What keeps the pipeline peak cheap (issue 19 item 5): the single-device step the replays cut by stage is simulated
once per derivation, not once per batch the peak's lines are read at (B, B + 1, B + 2) nor once per rank.

The values are the engine's: the FSDP x pipeline case is ``symmem.passes.fsdp_pipeline``'s example, every rank
equal to real gloo ranks in ``tests/test_fsdp_pipeline.py``; the plain pipeline's stages are checked against
``torch.distributed.pipelining`` in ``tests/test_model_parallel.py``.
"""

from __future__ import annotations

import pytest

LLAMA = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 2, "V": 63, "F": 64, "p": 2, "N": 2}


@pytest.fixture
def simulations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Each call of the simulation the replays share, counted."""
    import symmem.passes.model_parallel as mp

    calls: list[int] = []
    real = mp._simulated

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(mp, "_simulated", counted)
    return calls


def test_one_simulated_step_for_every_batch_and_rank(simulations: list[int]) -> None:
    from symmem import derive

    d = derive("llama", data_parallel="fsdp-no-reshard", pipeline_parallel=True, pipeline_schedule="gpipe",
               micro_batches=2, loss="cross-entropy", attention="sdpa", device="cpu", values=LLAMA)
    # the real ranks' (tests/test_fsdp_pipeline.py): rank 1 of each stage holds 31 of the 32 padded rows
    assert d.step.rank_peaks(d) == {0: (252320, 297672), 1: (252320, 297416), 2: (285296, 330780),
                                    3: (285296, 330524)}
    assert d.value("peak") == 330780
    assert len(simulations) == 1


def test_one_simulated_step_for_the_plain_pipeline(simulations: list[int]) -> None:
    """GPT-2 and Llama 1F1B, B = 1 (the lines read at 1, 2, 3) and B = 2: one simulation each."""
    from symmem import derive

    for model, more in (("gpt2", {}), ("llama", {"G": 2})):
        for b in (1, 2):
            simulations.clear()
            d = derive(model, pipeline_parallel=True, micro_batches=3, device="cpu",
                       values={"S": 32, "H": 64, "h": 4, "L": 2, "p": 2, "B": b, **more})
            d.value("peak")
            assert len(simulations) == 1


def test_one_replay_for_the_three_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak's lines (read at B, B + 1, B + 2) come from one replay a stage, the three batches' bytes packed in
    one integer; each line read at B + 1 and B + 2 (and B + 5, past the reads) is the largest stage's peak that
    stage's own replay at those numbers gives (``per_stage``: the replays checked against torch.distributed.pipelining
    in tests/test_model_parallel.py, with FSDP2 against gloo ranks in tests/test_fsdp_pipeline.py).  GPT-2 and
    Llama, 1F1B and GPipe, alone and under FSDP2."""
    import sympy

    import symmem.passes.model_parallel as mp
    from symmem import derive

    runs: list[int] = []
    real = mp._Replay.run

    def counted(self):
        runs.append(self.s)
        return real(self)

    monkeypatch.setattr(mp._Replay, "run", counted)
    for model, more, schedule, engine in (("gpt2", {}, "1f1b", None), ("llama", {"G": 2}, "gpipe", None),
                                          ("llama", {"G": 2, "N": 2}, "1f1b", "fsdp")):
        d = derive(model, pipeline_parallel=True, pipeline_schedule=schedule, micro_batches=4, device="cpu",
                   data_parallel=engine, values={"S": 32, "H": 64, "h": 4, "L": 4, "p": 4, "B": 2, **more})
        runs.clear()
        d.value("peak"), d.value("peak_first_step")
        assert sorted(runs) == [0, 1, 2, 3]  # one replay a stage, not three
        peak = d.step.peak()
        for b in (3, 4, 7):
            at = {**d.numbers, sympy.Symbol("B", positive=True, integer=True): b}
            each = d.step.per_stage(at)  # each stage replayed at B = b on its own
            assert int(peak.formula("steady").xreplace(at)) == max(each["peak_per_stage"])
            assert int(peak.formula("first").xreplace(at)) == max(each["peak_first_step_per_stage"])


def test_packed_bytes_round_trip() -> None:
    """Three integers in one, back exactly (negative sums too); a size past the digits' bound is refused, and the
    replays then run one by one."""
    from symmem.passes.model_parallel import _BOUND, _pack, _unpack, _Unpackable

    values = [[0, 0, 0], [1, -1, 0], [_BOUND - 1, -(_BOUND - 1), 12345], [-7, 2**40, -(2**63)]]
    assert [_unpack(_pack(v)) for v in values] == values
    total = sum(_pack(v) for v in values) - _pack([5, 6, 7])
    assert _unpack(total) == [a - b for a, b in zip([sum(c) for c in zip(*values, strict=True)], [5, 6, 7],
                                                     strict=True)]
    with pytest.raises(_Unpackable):
        _pack([_BOUND, 0, 0])


@pytest.mark.parametrize("model, options", [
    ("llama", {"device": "cpu", "B": 2}), ("llama", {"device": "cpu", "attention": "naive", "B": 1}),
    ("llama", {"device": "cuda", "B": 2}), ("gpt2", {"device": "cpu", "loss": "cross-entropy", "B": 1}),
    ("gpt2", {"device": "cpu", "attention": "naive", "dropout": 0.1, "B": 2})])
def test_the_step_at_l_layers_written_from_five_is_the_simulated_one(model: str, options: dict) -> None:
    """The replays' single-device step at L = 8 layers, written from the step simulated at 5 (passes/stretch.py),
    is the step simulated on all 8 layers (``_simulation``: the one the replays are checked against
    torch.distributed.pipelining with): every storage (name, category, bytes, node), what lives at the start, and
    every op with what it makes and frees (a set: the simulation's own order within an op), in order."""
    import symmem.passes.model_parallel as mp
    from symmem import derive
    from symmem.passes.stretch import passes, stretch

    values = {"S": 16, "H": 32, "h": 2, "V": 64, "F": 64, "L": 8, "p": 4, "B": options.pop("B"),
              **({"G": 2} if model == "llama" else {})}
    d = derive(model, pipeline_parallel=True, micro_batches=4, values=values, **options)
    step = d.step
    cut = mp._Cut(step.graph, step.conv, step.options, step.regime, step._named(None), {})
    full = passes(mp._simulation(cut.g, step.conv, step.options, step.regime, cut.branch))

    def ops(tl):
        return [(e.phase, e.node, e.born, frozenset(e.freed), e.resized, e.moment) for e in tl.events]

    assert cut.tl.storages == full.storages and cut.tl.start == full.start
    assert ops(cut.tl) == ops(full) and len(full.events) > 1000
    assert stretch(full, 8) is None  # only a step of 5 layers is a template


def test_a_template_without_alike_layers_is_not_stretched() -> None:
    """A middle layer unlike its neighbours (here one op more): no stretched step, the caller simulates."""
    import sympy

    from symmem.passes.stretch import stretch
    from symmem.timeline import Event, Live, Timeline

    storages = tuple(Live(f"x#{k}", "activation", sympy.Integer(4)) for k in range(1, 6))
    events = [Event("forward", f"f#{k}", (k - 1,), ()) for k in range(1, 6)]
    assert stretch(Timeline(storages, (), tuple(events)), 9) is not None
    odd = events[:3] + [Event("forward", "g#3", (), ())] + events[3:]
    assert stretch(Timeline(storages, (), tuple(odd)), 9) is None
