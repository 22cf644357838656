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


PEAK = Path(__file__).resolve().parents[1] / "docs" / "peak.md"
PEAK_ROW = re.compile(r"^\| (?P<model>ResNet-50|ViT-B/16, SDPA|GPT-2 small with the LM loss) \| (?P<total>[\d.]+) GiB "
                      r"\| (?P<peak>[\d.]+) GiB \| (?P<first>[\d.]+) GiB \| (?P<ratio>[\d.]+) \|", re.M)
PEAK_CASES = {"ResNet-50": ("resnet50", {}), "ViT-B/16, SDPA": ("vit-b16", {"attention": "sdpa"}),
              "GPT-2 small with the LM loss": ("gpt2", {"loss": "cross-entropy"})}


def test_peak_doc_examples_run():
    import doctest

    result = doctest.testfile(str(PEAK), module_relative=False)
    assert result.attempted >= 3 and result.failed == 0


@pytest.mark.parametrize("row", [m.groupdict() for m in PEAK_ROW.finditer(PEAK.read_text())],
                         ids=lambda r: r["model"])
def test_peak_table_is_what_the_engine_says(row):
    name, options = PEAK_CASES[row["model"]]
    d = derive(name, convention="pytorch", device="cpu", optimizer="adamw", **options)
    total, peak, first = d.value("total"), d.value("peak"), d.value("peak_first_step")
    assert (f"{total / 2**30:.3f}", f"{peak / 2**30:.3f}", f"{first / 2**30:.3f}", f"{peak / total:.3f}") == (
        row["total"], row["peak"], row["first"], row["ratio"])


def test_peak_table_has_its_rows():
    assert len(PEAK_ROW.findall(PEAK.read_text())) == 3
