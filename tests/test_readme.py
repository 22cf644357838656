"""The README shows real, current output: its Python examples run as doctests, its CLI examples are re-run."""

from __future__ import annotations

import doctest
import re
import shlex
from pathlib import Path

import pytest

from symmem.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
EXAMPLES = re.findall(r"```\n\$ symmem (.*?)\n(.*?)```", README.read_text(), re.S)


def test_python_examples_run():
    result = doctest.testfile(str(README), module_relative=False, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5
    assert result.failed == 0


def test_readme_has_cli_examples():
    assert len(EXAMPLES) >= 2


@pytest.mark.parametrize("command, shown", EXAMPLES, ids=[c for c, _ in EXAMPLES])
def test_cli_example_is_current(command, shown, capsys):
    if " hf:" in f" {command}":
        pytest.importorskip("transformers")
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out == shown
