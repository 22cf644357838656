"""``python -m symmem.cli``: the same as the ``symmem`` command."""

import sys

from . import main

sys.exit(main())
