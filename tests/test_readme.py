"""The README shows real, current output: its Python examples run as doctests, its CLI example is re-run."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

from symmem.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def test_python_examples_run():
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5
    assert result.failed == 0


def test_worked_example_is_current(capsys):
    text = README.read_text()
    block = re.search(r"```\n\$ symmem derive vit-b16 --attention naive\n(.*?)```", text, re.S)
    assert block, "README lost its worked example"
    assert main(["derive", "vit-b16", "--attention", "naive"]) == 0
    assert capsys.readouterr().out == block.group(1)
