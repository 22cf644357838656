"""Re-run every ``$ symmem ...`` example of the README (or of the files named) and write its current output
back in place.

    python benchmarks/refresh_readme.py                              # then review `git diff README.md`
    python benchmarks/refresh_readme.py docs/jupyter-latex-plots.md  # any file with such examples

tests/test_readme.py fails when an example's output is stale; this is how to refresh them after a change
that is meant to alter what the command prints.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

from symmem.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def refresh(text: str) -> str:
    def run(m: re.Match[str]) -> str:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            main(shlex.split(m.group(1)))
        return f"```\n$ symmem {m.group(1)}\n{out.getvalue()}```"

    return re.sub(r"```\n\$ symmem (.*?)\n(.*?)```", run, text, flags=re.S)


if __name__ == "__main__":
    import sys

    for path in [Path(a) for a in sys.argv[1:]] or [README]:
        path.write_text(refresh(path.read_text()))
