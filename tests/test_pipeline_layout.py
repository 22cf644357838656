"""The plain pipeline's stage plans read from the 5-layer template (``passes/pipeline_layout.py``) are the ones read
from the step written out at ``L`` layers (issue 19 item 5: the write-out was a third of the peak's time).

The values themselves are the engine's, checked against real ``torch.distributed.pipelining`` gloo runs elsewhere
(``tests/test_model_parallel.py``); the written step against the step simulated on all ``L`` layers in
``tests/test_pipeline_replay.py``.  Here each stage's plan of every pass (each op's name, what it makes with its
bytes and fate, what it frees), what the plan touches, and each storage's sends are held against the ones
``_Replay._plan`` and ``_sent_on`` / ``_sent_back`` read from the written step: Llama (SDPA, CUDA's kernels, eager
attention), GPT-2 with dropout and full checkpointing, at B = 1 (a view, not a copy: another step) and B = 2, stages
of one to eight layers.
"""

from __future__ import annotations

import pytest

SMALL = {"S": 16, "H": 32, "h": 2, "V": 64, "F": 64}

CASES = [
    ("llama", {"values": {**SMALL, "G": 2, "L": 8, "p": 4, "B": 2}}),
    ("llama", {"device": "cuda", "values": {**SMALL, "G": 2, "L": 16, "p": 2, "B": 1}}),
    ("llama", {"attention": "naive", "checkpoint": "full", "pipeline_schedule": "gpipe",
               "values": {**SMALL, "G": 2, "L": 7, "p": 7, "B": 2}}),
    ("gpt2", {"dropout": 0.1, "checkpoint": "full", "values": {**SMALL, "L": 12, "p": 4, "B": 1}}),
    ("gpt2", {"loss": "cross-entropy", "values": {**SMALL, "L": 9, "p": 3, "B": 2}}),
]


@pytest.mark.parametrize("model, options", CASES, ids=[f"{m}-{k}" for k, (m, _) in enumerate(CASES)])
def test_plans_from_the_template_are_the_written_step_plans(model: str, options: dict) -> None:
    import symmem.passes.model_parallel as mp
    from symmem import derive

    options = {"device": "cpu", **options}
    d = derive(model, pipeline_parallel=True, micro_batches=4, **options)
    step = d.step
    named = step._named(None)
    d.value("peak")
    # the plain peak read the plans from the template: the step was not written out
    assert all(v._tl is None for k, v in step._memo().items() if isinstance(k, tuple) and k[0] == "step")
    cut = mp._Cut(step.graph, step.conv, step.options, step.regime, named, {})
    assert cut.layout is not None
    found = step._stages()
    for s in range(cut.p):
        at = mp.memory_of(found, s, cut.p).at(named)
        read = mp._Replay(cut, s, at, step.schedule, step.micro_batches)
        written = mp._Replay(cut, s, at, step.schedule, step.micro_batches)
        written.__dict__["_layout_stage"] = None  # the long way: the step written out, sorted and planned
        assert read._layout() is not None
        for pass_ in (0, 1):
            for kind in "FB":
                assert read._plan(pass_, kind) == written._plan(pass_, kind)
                assert read._touched(pass_, kind) == written._touched(pass_, kind)
        for sid in range(len(cut.tl.storages)):
            for on in (True, False):
                assert read._sent(sid, on) == written._sent(sid, on)
