"""The documents quote the engine: the headline rows of docs/pytorch-vs-seed.md are re-derived here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from symmem import derive

DOC = (Path(__file__).resolve().parents[1] / "docs" / "pytorch-vs-seed.md").read_text()
ROW = re.compile(r"^\| (?P<model>[\w-]+)(?: \((?P<att>naive|sdpa|analysis geometry|torchvision)\))? \| "
                 r"(?P<conv>paper|pytorch, cuda|pytorch, cpu) \| (?P<mib>[\d,]+\.\d\d) \|", re.M)
ROWS = [m.groupdict() for m in ROW.finditer(DOC)]


def test_table_is_there():
    assert len(ROWS) >= 12


@pytest.mark.parametrize("row", ROWS, ids=[f"{r['model']}-{r['att']}-{r['conv']}" for r in ROWS])
def test_row_is_what_the_engine_says(row):
    options = {"attention": row["att"]} if row["att"] in ("naive", "sdpa") else {}
    convention, _, device = row["conv"].partition(", ")
    d = derive(row["model"], convention=convention, options={"device": device} if device else None, **options)
    assert f"{d.value('activations') / 2**20:,.2f}" == row["mib"]
