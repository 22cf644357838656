"""Views of a derivation: the text table and JSON (:mod:`.text`), LaTeX (:mod:`.latex`), Jupyter
(:mod:`.jupyter`) and plots (:mod:`.plots`).

Each view is a function of a :class:`~symmem.derivation.Derivation`, which it receives; :class:`Derivation`'s
``to_dict``, ``table``, ``_repr_html_`` and ``_repr_latex_`` import theirs when first called, so deriving
imports no view.
"""
