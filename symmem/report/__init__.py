"""Views of a derivation: the text table and JSON (:mod:`.text`), LaTeX (:mod:`.latex`), Jupyter
(:mod:`.jupyter`) and plots (:mod:`.plots`).  Importing this package plugs the default views into
:class:`~symmem.derivation.Derivation` (``to_dict``, ``table``, ``_repr_html_``, ``_repr_latex_``); the Jupyter
displays are imported when first shown (a command line never shows them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..derivation import register_view
from . import text

if TYPE_CHECKING:
    from ..derivation import Derivation


def _html(d: Derivation) -> Any:
    from .jupyter import html

    return html(d)


def _latex(d: Derivation) -> Any:
    from .jupyter import latex

    return latex(d)


register_view("dict", text.to_dict)
register_view("table", text.summary)
register_view("html", _html)
register_view("latex", _latex)
