"""The shortcuts that make a data-parallel peak cheap (issue 19 item 5), each held against the long way it replaces:

* a walk asks the convention's rules once per op (``Simulation.saves``, ``grads_of``, ``out_size``): a later
  micro-batch's passes and a checkpointed segment's recompute ask the same ops again -- against asking every time;
* a size condition's branches whose rules answer alike (``rule_answers``: Llama's ``h = G``, which no op reads at
  these sizes) are walked, counted and pruned once -- against walking every branch;
* ``prune`` values each total once (moments holding the same storages share one) and ``summarize`` prunes a
  group met again once -- against valuing and pruning each.

Every comparison is of the whole answer: the formulas (structurally equal, so equal as text), the peaks and where
they are, each step's timeline.
"""

from __future__ import annotations

import pytest

from symmem import derive
from symmem.passes import graph_step, schedule
from symmem.peak import Algebra

SMALL = {"llama": {"L": 2, "H": 64, "h": 4, "G": 2, "F": 128, "V": 66, "S": 8, "B": 2},
         "gpt2": {"L": 2, "H": 64, "h": 2, "V": 101, "S": 8, "B": 2}}

#: (model, derive keywords): FSDP2 with the policy, checkpointing and micro-batches (the walk's passes repeat ops),
#: padding (N = 3, V odd), FSDP1, DDP and one device.  Two micro-batches (since stop 39; were 4 and 3): the second
#: micro-batch's passes already ask every op of the first again, which is what the per-op answers shortcut; a third
#: and a fourth ask the same ops a third and fourth time
CASES = [
    ("llama", {"data_parallel": "fsdp", "param_dtype": "bfloat16", "checkpoint": "full", "micro_batches": 2,
               "values": {**SMALL["llama"], "N": 3}}),
    ("gpt2", {"data_parallel": "fsdp-no-reshard", "checkpoint": "every-2", "micro_batches": 2,
              "values": {**SMALL["gpt2"], "L": 4, "N": 3}}),
    ("llama", {"data_parallel": "fsdp", "values": {"N": 8}}),
    ("gpt2", {"data_parallel": "fsdp1", "checkpoint": "full", "values": {**SMALL["gpt2"], "N": 2}}),
    ("llama", {"data_parallel": "ddp", "micro_batches": 2, "values": {**SMALL["llama"], "N": 2}}),
    ("llama", {"checkpoint": "full", "values": SMALL["llama"]}),
    ("llama", {"data_parallel": "fsdp", "device": "cuda", "micro_batches": 2, "values": {**SMALL["llama"], "N": 2}}),
]


def _answer(model: str, kw: dict) -> dict:
    d = derive(model, convention="pytorch", **{"device": "cpu", **kw})
    # the formulas themselves: sympy's == is structural (same tree, so the same text too), and printing two large
    # Max expressions cost more than both walks' peaks
    out = {"steady": d.peak, "first": d.peak_first_step, "values": (d.value("peak"), d.value("peak_first_step"))}
    for which in ("steady", "first"):
        out[f"where {which}"] = (d.peak_at(which).where(), d.live_at_peak(which), d.peak_candidates(which))
        out[f"timeline {which}"] = d.timeline(which)
    return out


@pytest.fixture
def long_way(monkeypatch):
    """Every rule asked where the walk asks, every branch walked and pruned on its own."""
    def without_shortcuts() -> None:
        monkeypatch.setattr(schedule.Simulation, "saves",
                            lambda self, node: self.conv.saved(self.graph, node, self.rule_options))
        monkeypatch.setattr(schedule.Simulation, "grads_of",
                            lambda self, node: self.conv.grads(self.graph, node, self.rule_options))
        monkeypatch.setattr(schedule.Simulation, "out_size", lambda self, n: self.size(self.graph.node(n).out))
        monkeypatch.setattr(graph_step, "rule_answers", lambda *args: None)
        total = Algebra.total  # a mapping of its own for every moment: each valued on its own
        monkeypatch.setattr(Algebra, "total", lambda self, cand: dict(total(self, cand)))
    return without_shortcuts


#: under ``-m deep`` since stop 42: FSDP2 at N = 8 at Llama's own sizes -- every line of symmem/ and tests/ it runs
#: (each case's caches cleared) the other six run: FSDP2 with its policy, checkpointing and two micro-batches (0),
#: on CUDA (6); the open h = G walked once in every other Llama case
DEEP = (2,)


@pytest.mark.parametrize(("model", "kw"), [pytest.param(*case, marks=pytest.mark.deep if i in DEEP else ())
                                           for i, case in enumerate(CASES)],
                         ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_the_shortcuts_give_the_long_ways_answer(model, kw, long_way):
    short = _answer(model, kw)
    long_way()
    assert _answer(model, kw) == short


@pytest.mark.parametrize(("device", "walks"), [("cpu", 2), ("cuda", 4)])
def test_llamas_branches_are_walked_once_where_their_rules_agree(monkeypatch, device, walks):
    """Llama's open condition h = G (the heads repeated or not) is read by no rule on the CPU: one walk per layer
    count (4 and 5 layers), not two; on CUDA the attention's rules read it, and each branch is walked."""
    made = []
    real = schedule.Simulation.__init__

    def counted(self, *args, **kwargs):
        made.append(args[4])
        real(self, *args, **kwargs)

    monkeypatch.setattr(schedule.Simulation, "__init__", counted)
    d = derive("llama", convention="pytorch", device=device, data_parallel="fsdp", values={"N": 8})
    d.peak  # noqa: B018  -- the symbolic peak: both branches
    assert len(d.step.open_) == 1 and len(made) == walks
