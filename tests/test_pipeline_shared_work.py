"""Work the pipeline peaks share instead of redoing (issue 19 item 5, stop 33) gives what the long way gives.

The values themselves are the engine's, checked against real ``torch.distributed.pipelining`` gloo runs elsewhere
(``tests/test_tensor_pipeline.py`` for sequence parallelism on stages); here each shortcut is held against the
work it skips: the sequence-parallel collectives' formula at each op, made once for all the rule reads, against
the rule run at every op; a node's stage shared by every cut of a step against a fresh cut's; a rank's storage
size keyed by its template storage against the storage's own; the upper lines found by repeated largest-at-1
against a sort of every line.
"""

from __future__ import annotations

import random

#: small Llama sizes at 8 layers: the step is written out from the 5-layer one (passes/stretch.py)
SMALL = {"B": 2, "S": 16, "H": 32, "h": 4, "G": 2, "L": 8, "V": 64, "F": 64}


def test_sequence_parallel_collectives_made_once_are_the_rule_at_every_op(monkeypatch) -> None:
    """SP x pipeline at 8 layers, B = 1 (the all-gathers' second copies) with SDPA and B = 2 with eager attention
    (what it holds until the attention returns): at every op of the step, the formula found by what the rule reads
    there is the one the rule builds there (the same expression), and the step's few formulas are each made once."""
    import symmem.passes.sequence_pipeline as sp
    from symmem import derive

    seen = []
    extras = sp._SequenceSizes.extras

    def checked(self, ops, *numbering):
        found = extras(self, ops, *numbering)
        if numbering:  # each op's formula's number (stop 44) names its formula
            numbered, listed = numbering
            assert numbered.keys() == found.keys()
            assert all(listed[n][1] is found[k] for k, n in numbered.items())
            assert [k for k, _ in listed] == sorted({min(k for k in numbered if numbered[k] == n)
                                                     for n in range(len(listed))})
        tl, alive, wanted = self.tl, set(self.tl.start), set(ops)
        for k, e in enumerate(tl.events):
            alive.update(e.born)
            if k in wanted:
                assert found[k] == self._collectives(e, alive, k), (k, e.node)
            alive.difference_update(e.freed)
        seen.append((len(found), len({id(x) for x in found.values()})))
        return found

    monkeypatch.setattr(sp._SequenceSizes, "extras", checked)
    for b, attention in ((1, "sdpa"), (2, "naive")):
        d = derive("llama", tensor_parallel=True, sequence_parallel=True, pipeline_parallel=True, micro_batches=2,
                   attention=attention, device="cpu", values={**SMALL, "B": b, "t": 2, "p": 2})
        d.value("peak")
    assert len(seen) == 2
    assert all(ops > 1000 and made < 40 for ops, made in seen)


def test_a_stage_shared_by_the_cuts_is_a_fresh_cut_own() -> None:
    """FSDP x TP x pipeline at 8 layers: every cut of the step (the three batches, their packed cut, the rank's)
    reads one node -> stage table, and each node's stage there is a fresh cut's own."""
    from symmem import derive
    from symmem.passes.model_parallel import _Cut

    d = derive("llama", data_parallel="fsdp", tensor_parallel=True, pipeline_parallel=True, micro_batches=2,
               device="cpu", values={**SMALL, "N": 2, "t": 2, "p": 2})
    d.value("peak")
    step = d.step
    named = step._named(None)
    memo = step._memo()
    tables = [v for k, v in memo.items() if isinstance(k, tuple) and k[0] == "stages"]
    assert len(tables) == 1 and len(tables[0]) > 100
    fresh = _Cut(step.graph, step.conv, step.options, step.regime, named, {})
    assert fresh._stage is not tables[0]
    assert {node: fresh._stage_of(node) for node in tables[0]} == tables[0]


def test_a_rank_size_keyed_by_its_template_storage_is_its_own() -> None:
    """TP x pipeline at 8 layers: the storages written from one template storage (stretch's ``origin``) share one
    key, read once; every storage's size on a rank is the one worked out for the storage itself."""
    from symmem import derive

    d = derive("llama", tensor_parallel=True, pipeline_parallel=True, micro_batches=2, device="cpu",
               values={**SMALL, "t": 2, "p": 2})
    cut = d.step._cut(d.step._named(None))
    sizes = cut.sizes
    assert sizes._origin is not None and len(sizes._origin) == len(cut.tl.storages)
    shared = [sizes.local(i) for i in range(len(cut.tl.storages))]
    assert len(sizes._keys) < len(shared) * 3 / 4
    assert shared == [sizes._local(i) for i in range(len(cut.tl.storages))]


def test_upper_lines_are_those_a_sort_keeps() -> None:
    """:func:`~symmem.passes.pipeline_step._upper` against the sort it replaces (every line by its value at B = 1,
    the steeper first, kept where steeper than all kept before), on random lines: the same lines in the same
    order."""
    from symmem.passes.pipeline_step import _upper

    def sorted_upper(lines):
        best = {}
        for k in lines:
            if k[1] not in best or k[0] > best[k[1]][0]:
                best[k[1]] = k
        kept, steepest = {}, None
        for k in sorted(best.values(), key=lambda k: (-(k[0] + k[1]), -k[1])):
            if steepest is None or k[1] > steepest:
                kept[k] = lines[k]
                steepest = k[1]
        return kept

    rng = random.Random(33)
    for _ in range(300):
        lines = {(rng.randint(-50, 50), rng.randint(0, 12), rng.random() < 0.1): rng.random()
                 for _ in range(rng.randint(1, 40))}
        got = _upper(lines)
        assert list(got.items()) == list(sorted_upper(lines).items())
