"""A table the traced forward looks up at positions (``arange`` over a traced size) caps that size: no config needed.

tests/test_position_tables.py holds the tables a transformers config names; a plain module with its own
``nn.Embedding(R, H)`` looked up at ``torch.arange(S)`` has none, and the fake run checks no index values, so before
stop 44 ``symmem.trace`` (and ``symmem trace ... --set S=100``) printed a formula past the table's rows where
PyTorch raises an IndexError.  The fake run now follows the tensors whose values it can tell
(:mod:`symmem.importer.index_ranges`).  One table of small modules (tests/position_modules.py): the plain
embedding, Hugging Face's ``position_ids`` buffer sliced (and a buffer longer than the table), OPT's shift by 2 and its
count of a mask of ones, the positions after a cache of P tokens (``P + S <= R``), a buffer read with
``index_select``, a parameter indexed.
Truth: real PyTorch -- at the limit the module runs and symmem's kept bytes equal what one real forward saves (the
saved-tensor hooks); one past it the module raises an IndexError and symmem says so, naming the table and its rows.
Where the positions cannot be told (token ids, ``% R``, a clamp) every size runs and nothing is said.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import position_modules as pm  # noqa: E402
from trace_helpers import saved_bytes  # noqa: E402

import symmem  # noqa: E402
from symmem.cli import main  # noqa: E402
from symmem.errors import OutsideDomain, SymmemError  # noqa: E402
from symmem.record.steps import track_step  # noqa: E402

TOKENS = {"B": [(0, 0)], "S": [(0, 1)]}
CACHED = {"B": [(0, 0), (1, 0)], "S": [(0, 1)], "P": [(1, 1)]}
B = 2


def saved(module: Any, inputs: tuple[Any, ...]) -> int:
    """Every byte one real forward saves for backward, parameters and buffers apart (the inputs it saves too)."""
    return saved_bytes(module, *inputs)


def said(f: Any) -> tuple[Any, list[str]]:
    """``f()`` and the OutsideDomain warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = f()
    return out, [str(w.message) for w in caught if issubclass(w.category, OutsideDomain)]


def tokens(s: int, p: int = 0) -> tuple[Any, ...]:
    return (pm.ids(B, s),)


def cached(s: int, p: int) -> tuple[Any, ...]:
    return pm.ids(B, s), torch.randn(B, p, pm.H)


CASES = {
    # id: (the module, its inputs at (S, P), dims, {symbol: number} at the limit (S last), the words past it)
    "plain": (pm.Plain, tokens, TOKENS, {"S": 12}, "S <= 12 fails: past the model's position table: pos has 12 rows"),
    "learned-buffer": (pm.Learned, tokens, TOKENS, {"S": 16},
                       "S <= 16 fails: past the model's position table: pos has 16 rows"),
    "buffer-longer-than-table": (lambda: pm.Learned(10, ids=40), tokens, TOKENS, {"S": 10},
                                 "S <= 10 fails: past the model's position table: pos has 10 rows"),
    "offset": (pm.Offset, tokens, TOKENS, {"S": 12}, "S <= 12 fails: past the model's position table: pos has 14 "
               "rows (looked up at positions up to S + 1)"),
    "counted-mask": (pm.Counted, tokens, TOKENS, {"S": 12},
                     "S <= 12 fails: past the model's position table: pos has 12 rows"),
    "after-a-cache": (pm.Past, cached, CACHED, {"P": 5, "S": 11}, "P + S <= 16 fails: past the model's position "
                      "table: pos has 16 rows (looked up at positions up to P + S - 1)"),
    "index-select-buffer": (pm.Fixed, tokens, TOKENS, {"S": 20},
                            "S <= 20 fails: past the model's position table: pe has 20 rows"),
    "indexed-parameter": (pm.Indexed, tokens, TOKENS, {"S": 18},
                          "S <= 18 fails: past the model's position table: table has 18 rows"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_at_the_table_symmem_equals_pytorch_and_one_past_it_both_refuse(case):
    make, inputs, dims, limit, words = CASES[case]
    module = make()
    d = symmem.trace(module, inputs(6, 3), dims)
    sizes = {"B": B, **limit}
    s, p = limit["S"], limit.get("P", 0)
    inside, warned = said(lambda: d.at(**sizes))
    assert warned == []
    assert inside.evaluate(d.activations + d.input + d.loss) == saved(module, inputs(s, p))
    if case == "plain":  # and the peak of two real steps (AdamW, symmem.trace's default) at the limit
        assert inside.value("peak") == track_step(module, inputs(s, p)).steady.bytes
    # one past: the real module indexes past the table's rows (IndexError), or its position ids, a slice of a buffer
    # as long as the table, are one short of the tokens (RuntimeError)
    with pytest.raises(IndexError if case != "learned-buffer" else RuntimeError):
        module(*inputs(s + 1, p))
    _, warned = said(lambda: d.at(**{**sizes, "S": s + 1}))
    assert len(warned) == 1 and words in warned[0], warned
    _, warned = said(lambda: d.values("total", **{**{k: [v, v] for k, v in sizes.items()}, "S": [s, s + 1]}))
    assert len(warned) == 1 and words in warned[0], warned


def test_positions_it_cannot_tell_say_nothing():
    """Token ids, positions wrapped ``% R`` or clamped: the real module runs at 3R tokens, and symmem says nothing
    there (no false alarm)."""
    module = pm.Wrapped()
    d = symmem.trace(module, tokens(6), TOKENS)
    assert d.why == {} and "12" not in str(d.domain)
    inside, warned = said(lambda: d.at(B=B, S=36))
    assert warned == []
    assert inside.evaluate(d.activations + d.input + d.loss) == saved(module, tokens(36))


def test_rows_a_size_of_the_module_bound_the_tokens_by_that_size():
    """``sizes=`` with the rows a size of the module (``R``): the fit writes the bound in it, ``S <= R``; its peak in
    every size equals two real steps' at the limit and is refused one past it."""
    d = symmem.trace(pm.sized, dims=TOKENS, sizes={"R": 12}, peak=True, optimizer="sgd")
    words = "S <= R fails: past the model's position table: pos has R rows"
    assert {str(c): why for c, why in d.why.items()} == {"S <= R": "past the model's position table: pos has R rows"}
    inside, warned = said(lambda: d.at(B=B, S=12, R=12))
    assert warned == []
    module, _ = pm.sized(12)
    assert inside.evaluate(d.activations + d.input + d.loss) == saved(module, tokens(12))
    assert inside.value("peak") == track_step(module, tokens(12), optimizer="sgd").steady.bytes
    with pytest.raises(IndexError):
        module(*tokens(13))
    past, warned = said(lambda: d.at(B=B, S=13, R=12))
    assert len(warned) == 1 and words in warned[0]
    with pytest.raises(SymmemError, match=words):  # the peak in every size is refused there, in the same words
        past.value("peak")


def test_the_command_line_says_the_table_and_caps_the_fit(capsys):
    """``symmem trace ... --set S=13`` past the 12 rows is one warning line naming the table (the tree before printed
    the numbers silently); ``fit --solve S`` caps at 12 (before: S = 4,970,970 at 1 GiB)."""
    spec = "tests/position_modules.py:plain"
    assert main(["trace", spec, "--dims", "B,S", "--set", "S=13"]) == 0
    _, err = capsys.readouterr()
    assert "symmem: warning: S = 13 lies outside the formulas' domain (S <= 12 fails: past the model's position " \
           "table: pos has 12 rows)" in err
    assert main(["fit", spec, "--dims", "B,S", "--solve", "S", "--set", "B=2", "--budget", "1GiB"]) == 0
    out, _ = capsys.readouterr()
    assert "largest S = 12 " in out and "capped at S = 12" in out and "pos has 12 rows" in out
    module, _ = pm.plain()
    module(*tokens(12))
    with pytest.raises(IndexError):
        module(*tokens(13))
