"""``python -m symmem``: the same as the ``symmem`` command (and ``python -m symmem.cli``)."""

from .cli import entry

entry()
