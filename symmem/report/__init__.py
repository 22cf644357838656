"""Views of a derivation: the text table and JSON (:mod:`.text`), LaTeX (:mod:`.latex`), Jupyter
(:mod:`.jupyter`) and plots (:mod:`.plots`).  Importing this package plugs the default views into
:class:`~symmem.derivation.Derivation` (``to_dict``, ``table``, ``_repr_html_``, ``_repr_latex_``).
"""

from __future__ import annotations

from ..derivation import register_view
from . import jupyter, text

register_view("dict", text.to_dict)
register_view("table", text.summary)
register_view("html", jupyter.html)
register_view("latex", jupyter.latex)
