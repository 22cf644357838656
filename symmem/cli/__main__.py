"""``python -m symmem.cli``: the same as the ``symmem`` command."""

from . import entry

entry()
