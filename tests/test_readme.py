"""The README and the pages its long material moved to show real, current output: every Python block runs on its
own (fresh globals, as in a fresh interpreter) as a doctest, every ``$ symmem`` example is re-run and compared."""

from __future__ import annotations

import doctest
import re
import shlex
from pathlib import Path

import pytest

from symmem.cli import main

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *(ROOT / "docs" / f"{name}.md" for name in ("tour", "your-model", "reference",
                                                                       "fp32-analysis", "importer"))]
README = PAGES[0]
EXAMPLES = [(page.name, command, shown) for page in PAGES
            for command, shown in re.findall(r"```\n\$ symmem (.*?)\n(.*?)```", page.read_text(), re.S)]
BLOCKS = [(page.name, i, block) for page in PAGES
          for i, block in enumerate(re.findall(r"```python\n(.*?)```", page.read_text(), re.S))]


@pytest.fixture
def at_root(monkeypatch):
    """The examples are run from the repository root, as the README says (``examples/encoder.py``)."""
    monkeypatch.chdir(ROOT)


def test_pages_have_python_examples():
    assert sum(block.count(">>> ") for _, _, block in BLOCKS) >= 25


@pytest.mark.parametrize("page, index, block", BLOCKS, ids=[f"{p}-{i}" for p, i, _ in BLOCKS])
def test_python_block_runs_on_its_own(page, index, block, at_root):
    test = doctest.DocTestParser().get_doctest(block, {}, f"{page}[{index}]", page, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.attempted >= 1
    assert result.failed == 0


def test_pages_have_cli_examples():
    assert len(EXAMPLES) >= 8
    assert sum(page == "README.md" for page, _, _ in EXAMPLES) >= 3


def _examples() -> list:
    """:data:`EXAMPLES`, an example whose command and output an earlier page shows already marked ``deep`` (the same
    run, the same bytes compared: README.md and tour.md both show ``fit vit-b16 --attention sdpa ...``)."""
    seen: set[tuple[str, str]] = set()
    out = []
    for page, command, shown in EXAMPLES:
        twice = (command, shown) in seen
        seen.add((command, shown))
        out.append(pytest.param(page, command, shown, id=f"{page}: {command}", marks=pytest.mark.deep if twice else ()))
    return out


@pytest.mark.parametrize("page, command, shown", _examples())
def test_cli_example_is_current(page, command, shown, capsys, at_root):
    if " hf:" in f" {command}":
        pytest.importorskip("transformers")
    if " trace " in f" {command} ":
        pytest.importorskip("torch")
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out == shown
