"""pdflatex on a page of LaTeX for the tests that check the printed formulas compile within the page
(tests/test_latex.py, test_factoring.py, test_symbolic_sizes.py; each skips where pdflatex is absent)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def pdflatex(tmp_path: Path, body: list[str]) -> tuple[int, str]:
    """Compile an amsmath ``article`` whose body is ``body`` (lines) in ``tmp_path``: pdflatex's exit status and
    its log."""
    doc = "\n".join([r"\documentclass{article}", r"\usepackage{amsmath}", r"\begin{document}", *body,
                     r"\end{document}"])
    (tmp_path / "t.tex").write_text(doc)
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "t.tex"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    return run.returncode, (tmp_path / "t.log").read_text(errors="replace")
